// The gRPC credentials of a Tandem process from --tls_ca, --tls_cert and
// --tls_key (issue 18, item 4): the one place the router, the workers, the
// gateway and the tools get the credentials for every gRPC server they run and
// every channel they open.
//
//   no --tls_* flag       -> insecure server and channels (as before)
//   all three             -> mTLS: servers require and verify a client certificate
//                            from the CA; channels present this process's
//                            certificate and verify the server's chain against
//                            the CA (not its name: peers are dialled by IP);
//                            files re-read every --tls_refresh_s
//   one or two, bad files -> an error naming the flag or file; the process exits
//
// The KV data path (UCX, libfabric) is not covered: it stays on the cluster
// network.
#ifndef TANDEM_COMMON_TLS_TLS_FLAGS_H_
#define TANDEM_COMMON_TLS_TLS_FLAGS_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/tls/tls_credentials.h"

ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(int, tls_refresh_s);

namespace tandem::tls {

// What a process serves and dials with. Default-constructed: insecure.
struct GrpcCredentials {
  std::shared_ptr<grpc::ServerCredentials> server = grpc::InsecureServerCredentials();
  std::shared_ptr<grpc::ChannelCredentials> channel =
      grpc::InsecureChannelCredentials();
  bool mtls = false;
};

// `files` all empty: insecure; all set: mTLS as above; otherwise InvalidArgument,
// or the files' errors (CheckFiles).
absl::StatusOr<GrpcCredentials> MakeGrpcCredentials(const TlsFiles& files,
                                                    absl::Duration refresh);

// MakeGrpcCredentials from the flags; errors name the flags.
absl::StatusOr<GrpcCredentials> GrpcCredentialsFromFlags();

}  // namespace tandem::tls

#endif  // TANDEM_COMMON_TLS_TLS_FLAGS_H_
