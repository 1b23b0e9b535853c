// TLS credentials for Tandem's gRPC servers and channels, from PEM files (a CA
// bundle, a certificate chain and its private key: what a Kubernetes Secret of type
// kubernetes.io/tls plus ca.crt mounts), reloaded when the files change.
//
//   files on disk --CheckFiles--> readable PEM, key matches certificate
//     -> MakeServerCredentials: TLS, client certificate required and verified
//        against the CA (mTLS) unless require_client_cert is false
//     -> MakeChannelCredentials: TLS, server chain verified against the CA, this
//        process's certificate presented (mTLS); server name checked unless
//        verify_server_name is false (peers dialled by pod IP)
//   reload: gRPC's FileWatcherCertificateProvider re-reads the three files every
//   `refresh`; new handshakes use the new files, open connections keep theirs. A
//   file that no longer parses leaves the last good credentials in use.
//
// The Static* variants read the files once (grpc::SslServerCredentials /
// grpc::SslCredentials), for tools and tests that need no reload.
//
// Not wired into the processes yet (issue 18, item 4).
#ifndef TANDEM_COMMON_TLS_TLS_CREDENTIALS_H_
#define TANDEM_COMMON_TLS_TLS_CREDENTIALS_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::tls {

struct TlsFiles {
  std::string ca;    // PEM CA bundle that peers' certificates must chain to
  std::string cert;  // PEM certificate chain of this process
  std::string key;   // PEM private key of `cert`
};

struct TlsOptions {
  TlsFiles files;
  // How often the files are checked for changes (whole seconds, at least 1).
  absl::Duration refresh = absl::Seconds(60);
  // Server: refuse clients without a certificate from `files.ca`.
  bool require_client_cert = true;
  // Channel: the server certificate must name the host dialled. false checks
  // only that it chains to `files.ca`.
  bool verify_server_name = true;
};

// The three files are readable PEM, the CA and chain hold certificates, and the
// key is the chain's first certificate's key. InvalidArgument / NotFound naming
// the file otherwise.
absl::Status CheckFiles(const TlsFiles& files);

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& options);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& options);

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeStaticServerCredentials(
    const TlsFiles& files, bool require_client_cert);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeStaticChannelCredentials(
    const TlsFiles& files);

}  // namespace tandem::tls

#endif  // TANDEM_COMMON_TLS_TLS_CREDENTIALS_H_
