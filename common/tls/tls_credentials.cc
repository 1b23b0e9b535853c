#include "common/tls/tls_credentials.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace tandem::tls {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  if (path.empty())
    return absl::InvalidArgumentError(absl::StrCat("no ", what, " file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " ", path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::unique_ptr<BIO, BioFree> Bio(const std::string& pem) {
  return std::unique_ptr<BIO, BioFree>(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The certificates in a PEM text, in order; InvalidArgument when there are none.
absl::StatusOr<std::vector<std::unique_ptr<X509, X509Free>>> Certificates(
    const std::string& pem, const std::string& path) {
  std::vector<std::unique_ptr<X509, X509Free>> out;
  auto bio = Bio(pem);
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    out.emplace_back(x);
  }
  ERR_clear_error();  // the read past the last certificate
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " holds no PEM certificate"));
  }
  return out;
}

struct Pems {
  std::string ca, cert, key;
};

absl::StatusOr<Pems> LoadChecked(const TlsFiles& f) {
  Pems p;
  absl::StatusOr<std::string> s = ReadFile(f.ca, "CA");
  if (!s.ok()) return s.status();
  p.ca = *std::move(s);
  s = ReadFile(f.cert, "certificate");
  if (!s.ok()) return s.status();
  p.cert = *std::move(s);
  s = ReadFile(f.key, "key");
  if (!s.ok()) return s.status();
  p.key = *std::move(s);
  auto ca = Certificates(p.ca, f.ca);
  if (!ca.ok()) return ca.status();
  auto chain = Certificates(p.cert, f.cert);
  if (!chain.ok()) return chain.status();
  auto bio = Bio(p.key);
  std::unique_ptr<EVP_PKEY, KeyFree> key(
      PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(f.key, " holds no PEM private key"));
  }
  if (X509_check_private_key(chain->front().get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(f.key, " is not the key of the certificate in ", f.cert));
  }
  return p;
}

unsigned int RefreshSeconds(absl::Duration d) {
  return static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(d)));
}

std::shared_ptr<grpc::experimental::CertificateProviderInterface> Provider(
    const TlsOptions& o) {
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      o.files.key, o.files.cert, o.files.ca, RefreshSeconds(o.refresh));
}

}  // namespace

absl::Status CheckFiles(const TlsFiles& files) { return LoadChecked(files).status(); }

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& options) {
  if (absl::Status s = CheckFiles(options.files); !s.ok()) return s;
  grpc::experimental::TlsServerCredentialsOptions o(Provider(options));
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_cert_request_type(
      options.require_client_cert
          ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
          : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  std::shared_ptr<grpc::ServerCredentials> creds =
      grpc::experimental::TlsServerCredentials(o);
  if (creds == nullptr)
    return absl::InternalError("gRPC refused the TLS server options");
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& options) {
  if (absl::Status s = CheckFiles(options.files); !s.ok()) return s;
  grpc::experimental::TlsChannelCredentialsOptions o;
  o.set_certificate_provider(Provider(options));
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_verify_server_certs(true);
  if (!options.verify_server_name) {
    // The chain is still verified against the CA; only the name check goes.
    o.set_check_call_host(false);
    o.set_certificate_verifier(
        std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  }
  std::shared_ptr<grpc::ChannelCredentials> creds =
      grpc::experimental::TlsCredentials(o);
  if (creds == nullptr)
    return absl::InternalError("gRPC refused the TLS channel options");
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeStaticServerCredentials(
    const TlsFiles& files, bool require_client_cert) {
  absl::StatusOr<Pems> p = LoadChecked(files);
  if (!p.ok()) return p.status();
  grpc::SslServerCredentialsOptions o(
      require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                          : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  o.pem_root_certs = p->ca;
  o.pem_key_cert_pairs.push_back({p->key, p->cert});
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeStaticChannelCredentials(
    const TlsFiles& files) {
  absl::StatusOr<Pems> p = LoadChecked(files);
  if (!p.ok()) return p.status();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = p->ca;
  o.pem_private_key = p->key;
  o.pem_cert_chain = p->cert;
  return grpc::SslCredentials(o);
}

}  // namespace tandem::tls
