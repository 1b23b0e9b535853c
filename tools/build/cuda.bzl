"""CUDA kernels with nvcc for Hopper (sm_90a), behind --config=cuda.

cuda_library(name, srcs, hdrs, deps) compiles each .cu with nvcc into an object
and wraps the objects in a cc_library with the CUDA runtime. In the default CPU
build, or where nvcc is absent, the target is an empty library: nothing links
CUDA, and the CUDA build says why it was skipped.
"""

load("@local_cuda//:defs.bzl", "HAS_CUDA", "NVCC")

# Hopper (H100/H200) and Blackwell, both compile-checked (no GPU run yet). B300 is
# compute capability 10.3 and B200 10.0: an sm_100a cubin loads on 10.0 only, so
# Blackwell is built for the family target sm_100f (CUDA 12.9+), which loads on
# both (the kernels use no instruction specific to one member).
CUDA_ARCH_FLAGS = [
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_100f,code=sm_100f",
]

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_flags = [], visibility = None):
    """A cc_library from .cu sources, built only under --config=cuda."""
    if not HAS_CUDA:
        # Under --config=cuda on a machine without nvcc, an action says the target
        # was skipped; the library is then empty and nothing links CUDA.
        note = name + "_cuda_skipped.cc"
        native.genrule(
            name = name + "_cuda_skipped",
            outs = [note],
            cmd = ("echo 'CUDA: nvcc not found ($$CUDA_PATH, /usr/local/cuda, PATH): " +
                   "skipping //%s:%s' >&2; " % (native.package_name(), name) +
                   "echo '// CUDA target skipped: nvcc not found at build time.' > $@"),
            message = "CUDA skipped (no nvcc) for " + name,
            tags = ["manual"],
        )
        native.cc_library(
            name = name,
            srcs = select({
                "//:cuda_enabled": [note],
                "//conditions:default": [],
            }),
            hdrs = hdrs,
            visibility = visibility,
            deps = deps,
        )
        return
    objs = []
    for src in srcs:
        obj = name + "_" + src.replace("/", "_").replace(".cu", ".o")
        objs.append(obj)
        native.genrule(
            name = obj.replace(".o", "_nvcc"),
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = " ".join([
                NVCC,
                "-std=c++17",
                "-O3",
                "--expt-relaxed-constexpr",
                "-Xcompiler=-fPIC",
                "-I.",
                "-I$(GENDIR)",
            ] + CUDA_ARCH_FLAGS + nvcc_flags + [
                "-c $(location %s)" % src,
                "-o $@",
            ]),
            message = "nvcc " + src,
            tags = ["manual"],
        )
    native.cc_library(
        name = name,
        srcs = select({
            "//:cuda_enabled": objs,
            "//conditions:default": [],
        }),
        hdrs = hdrs,
        deps = deps + select({
            "//:cuda_enabled": ["@local_cuda//:cudart"],
            "//conditions:default": [],
        }),
        visibility = visibility,
    )
