"""GPU kernel sources built twice: by nvcc, and as host C++ on the SIMT emulator.

gpu_kernels(name, srcs, hdrs, deps) defines
  name + "_cuda": the .cu files compiled by nvcc (cuda_library: empty unless
                  --config=cuda and nvcc is present);
  name + "_sim":  the same files compiled by the host compiler with
                  -DTANDEM_CUDA_SIM against kernels/cuda/sim/simt.h (always built;
                  what CI tests).
The .cu sources include "kernels/cuda/vendor.h" first.
"""

load("//tools/build:cuda.bzl", "cuda_library")

SIM_COPTS = [
    "-DTANDEM_CUDA_SIM",
    "-Wno-unknown-pragmas",
    "-Wno-unused-variable",
    "-Wno-unused-but-set-variable",
]

GPU_COMMON_HDRS = [
    "//kernels/cuda:vendor.h",
    "//kernels/cuda:ptx.h",
    "//kernels/cuda:device_errors.h",
]

def gpu_kernels(name, srcs, hdrs = [], deps = [], visibility = None):
    sim_srcs = []
    for src in srcs:
        out = name + "_sim_" + src.replace("/", "_").replace(".cu", ".cc")
        native.genrule(
            name = out.replace(".cc", "_copy"),
            srcs = [src],
            outs = [out],
            # #line keeps compiler messages pointing at the .cu file.
            cmd = "(echo '#line 1 \"%s/%s\"'; cat $<) > $@" % (native.package_name(), src),
        )
        sim_srcs.append(out)
    native.cc_library(
        name = name + "_sim",
        srcs = sim_srcs,
        hdrs = hdrs,
        copts = SIM_COPTS,
        deps = deps + ["//kernels/cuda:sim_runtime"],
        visibility = visibility,
    )
    cuda_library(
        name = name + "_cuda",
        srcs = srcs,
        hdrs = hdrs + GPU_COMMON_HDRS,
        deps = deps,
        visibility = visibility,
    )
