"""Offline stand-in for @rules_cc//cc:defs.bzl on Bazel 4.2.3.

Debian's bazel-rules-cc 0.0.4 needs a newer Bazel (use_cpp_toolchain); these thin
wrappers over the native rules are all Bazel 4.2.3 needs to resolve the load()s of
its own embedded tools.
"""

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
