"""libFuzzer targets built with Debian's clang-14, run for a bounded time as tests.

Bazel's C++ toolchain here is GCC; libFuzzer needs clang. cc_fuzz_test compiles the
harness and the library sources it names directly with clang++-14
(-fsanitize=fuzzer,address,undefined) in a genrule, and an sh_test runs the fuzzer
for `max_seconds` over a copy of `corpus`. A crash, leak, UB report or timeout fails
the test and leaves the reproducer in the test's outputs (bazel-testlogs/.../outputs).

    cc_fuzz_test(
        name = "safetensors_header_fuzz_test",
        srcs = ["safetensors_header_fuzz.cc", "safetensors.cc", "safetensors.h"],
        linkopts = ["-labsl_strings"],
        corpus = glob(["testdata/fuzz/*"]),
    )
"""

def cc_fuzz_test(name, srcs, linkopts = [], corpus = [], max_seconds = 20, copts = [], tags = []):
    ccs = [s for s in srcs if s.endswith(".cc") or s.endswith(".cpp")]
    binary = name + "_bin"
    native.genrule(
        name = binary + "_clang",
        srcs = srcs,
        outs = [binary],
        cmd = " ".join([
            "clang++-14 -std=c++20 -O1 -g -fno-omit-frame-pointer",
            "-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined",
            "-Wno-unused-command-line-argument",
            "-I. -I$(GENDIR)",
        ] + copts + ["$(location %s)" % s for s in ccs] + [
            "-o $@",
        ] + linkopts + ["-lpthread"]),
        message = "clang++ libFuzzer " + name,
        testonly = True,
    )
    native.sh_test(
        name = name,
        srcs = ["//tools/build:run_fuzzer.sh"],
        args = ["$(location :%s)" % binary, str(max_seconds)] +
               ["$(location %s)" % c for c in corpus],
        data = [":" + binary] + corpus,
        tags = tags + ["fuzz"],
        timeout = "moderate",
    )
