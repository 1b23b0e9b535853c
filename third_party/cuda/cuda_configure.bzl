"""Repository rule that finds the CUDA toolkit (nvcc) on this machine, offline.

It never fails: where nvcc is absent it records HAS_CUDA = False, and the
cuda_library macro (tools/build/cuda.bzl) then builds nothing under --config=cuda
and says why. Search order: $CUDA_PATH, $CUDA_HOME, /usr/local/cuda, nvcc on PATH.
"""

def _find_cuda(rctx):
    for env in ["CUDA_PATH", "CUDA_HOME"]:
        root = rctx.os.environ.get(env, "")
        if root and rctx.path(root + "/bin/nvcc").exists:
            return root
    if rctx.path("/usr/local/cuda/bin/nvcc").exists:
        return "/usr/local/cuda"
    nvcc = rctx.which("nvcc")
    if nvcc:
        return str(nvcc.dirname.dirname)
    return None

def _cuda_configure_impl(rctx):
    root = _find_cuda(rctx)
    if root:
        rctx.symlink(root + "/include", "include")
        lib = root + "/lib64"
        if not rctx.path(lib).exists:
            lib = root + "/lib"
        rctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])
cc_library(
    name = "cuda_headers",
    # Every file: some CUDA headers include extension-less ones (<nv/target>).
    hdrs = glob(["include/**"], allow_empty = True),
    includes = ["include"],
)
cc_library(
    name = "cudart",
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-lcudart"],
    deps = [":cuda_headers"],
)
cc_library(
    name = "cublaslt",
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-lcublasLt"],
    deps = [":cudart"],
)
cc_library(
    name = "nccl",
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-lnccl"],
    deps = [":cudart"],
)
""".format(lib = lib))
        rctx.file("defs.bzl", 'HAS_CUDA = True\nNVCC = "{root}/bin/nvcc"\nCUDA_ROOT = "{root}"\n'.format(root = root))
    else:
        rctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])
cc_library(name = "cuda_headers")
cc_library(name = "cudart")
cc_library(name = "cublaslt")
cc_library(name = "nccl")
""")
        rctx.file("defs.bzl", 'HAS_CUDA = False\nNVCC = ""\nCUDA_ROOT = ""\n')

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH", "CUDA_HOME", "PATH"],
    local = True,
)
