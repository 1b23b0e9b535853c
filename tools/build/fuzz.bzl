"""libFuzzer targets built with Debian's clang-14, run for a bounded time as tests.

Bazel's C++ toolchain here is GCC; libFuzzer needs clang. cc_fuzz_test compiles the
harness and the library sources it names directly with clang++-14
(-fsanitize=fuzzer,address,undefined) in a genrule, and an sh_test runs the fuzzer
for `max_seconds` over a copy of `corpus`. A crash, leak, UB report or timeout fails
the test and leaves the reproducer in the test's outputs (bazel-testlogs/.../outputs).

    cc_fuzz_test(
        name = "safetensors_header_fuzz_test",
        srcs = ["safetensors_header_fuzz.cc", "safetensors.cc", "safetensors.h"],
        linkopts = ABSL_FUZZ_LINKOPTS,
        corpus = glob(["testdata/fuzz/*"]),
    )
"""

# The Abseil shared libraries a harness that uses absl::Status, strings, time and
# synchronisation links (the genrule links by hand, outside Bazel's cc rules).
ABSL_FUZZ_LINKOPTS = [
    "-labsl_statusor",
    "-labsl_status",
    "-labsl_cord",
    "-labsl_cordz_info",
    "-labsl_cord_internal",
    "-labsl_cordz_functions",
    "-labsl_cordz_handle",
    "-labsl_exponential_biased",
    "-labsl_synchronization",
    "-labsl_graphcycles_internal",
    "-labsl_stacktrace",
    "-labsl_symbolize",
    "-labsl_debugging_internal",
    "-labsl_demangle_internal",
    "-labsl_malloc_internal",
    "-labsl_time",
    "-labsl_civil_time",
    "-labsl_time_zone",
    "-labsl_str_format_internal",
    "-labsl_strings",
    "-labsl_strings_internal",
    "-labsl_int128",
    "-labsl_throw_delegate",
    "-labsl_raw_logging_internal",
    "-labsl_log_severity",
    "-labsl_base",
    "-labsl_spinlock_wait",
]


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
