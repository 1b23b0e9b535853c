#include "common/tls/tls_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle (mTLS, with --tls_cert and --tls_key): every gRPC server of "
          "this process requires client certificates from this CA, every channel it "
          "opens verifies the server's against it. Unset: plaintext gRPC.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain this process presents to gRPC peers (mTLS).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(int, tls_refresh_s, 60,
          "Seconds between checks of the --tls_ca, --tls_cert and --tls_key files "
          "for changes (rotated certificates apply to new connections).");

namespace tandem::tls {

absl::StatusOr<GrpcCredentials> MakeGrpcCredentials(const TlsFiles& files,
                                                    absl::Duration refresh) {
  const int given = !files.ca.empty() + !files.cert.empty() + !files.key.empty();
  if (given == 0) return GrpcCredentials{};
  if (given != 3) {
    return absl::InvalidArgumentError(
        "mTLS needs all of --tls_ca, --tls_cert and --tls_key (or none of them)");
  }
  TlsOptions o;
  o.files = files;
  o.refresh = refresh;
  o.require_client_cert = true;
  o.verify_server_name = false;  // workers are dialled by the IP they advertise
  GrpcCredentials c;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server =
      MakeServerCredentials(o);
  if (!server.ok()) return server.status();
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> channel =
      MakeChannelCredentials(o);
  if (!channel.ok()) return channel.status();
  c.server = *std::move(server);
  c.channel = *std::move(channel);
  c.mtls = true;
  return c;
}

absl::StatusOr<GrpcCredentials> GrpcCredentialsFromFlags() {
  const TlsFiles files{absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
                       absl::GetFlag(FLAGS_tls_key)};
  absl::StatusOr<GrpcCredentials> c =
      MakeGrpcCredentials(files, absl::Seconds(absl::GetFlag(FLAGS_tls_refresh_s)));
  if (!c.ok()) {
    return absl::Status(c.status().code(),
                        absl::StrCat("TLS flags: ", c.status().message()));
  }
  return c;
}

}  // namespace tandem::tls
