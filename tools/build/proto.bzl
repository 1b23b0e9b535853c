"""Protobuf + gRPC C++ code generation with Debian's protoc and grpc_cpp_plugin, offline."""

def tandem_proto_library(name, srcs, deps = [], grpc = True, visibility = None):
    """Generates C++ (and gRPC stubs when grpc = True) for `srcs` into a cc_library.

    Proto imports are resolved from the workspace root, so a proto imports
    another as `import "proto/common.proto";` and C++ includes
    `#include "proto/common.pb.h"`.

    Args:
      name: the cc_library to create.
      srcs: .proto files of this package.
      deps: other tandem_proto_library targets whose protos these import.
      grpc: also generate service stubs (.grpc.pb.{h,cc}).
      visibility: visibility of the cc_library.
    """
    bases = [s[:-len(".proto")] for s in srcs]
    outs = [b + ".pb.h" for b in bases] + [b + ".pb.cc" for b in bases]
    if grpc:
        outs += [b + ".grpc.pb.h" for b in bases] + [b + ".grpc.pb.cc" for b in bases]
    dep_srcs = [d + "_srcs" for d in deps]
    cmd = "protoc -I. --cpp_out=$(GENDIR) "
    if grpc:
        cmd += "--grpc_out=$(GENDIR) --plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin "
    cmd += " ".join(["$(location %s)" % s for s in srcs])
    native.filegroup(
        name = name + "_srcs",
        srcs = srcs + dep_srcs,
        visibility = visibility,
    )
    native.genrule(
        name = name + "_gen",
        srcs = srcs + dep_srcs,
        outs = outs,
        cmd = cmd,
        message = "protoc " + ", ".join(srcs),
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["@system//:protobuf"] + (["@system//:grpc++"] if grpc else []),
        copts = ["-Wno-unused-parameter"],
        visibility = visibility,
    )
