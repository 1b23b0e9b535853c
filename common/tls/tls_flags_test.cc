#include "common/tls/tls_flags.h"

#include "gtest/gtest.h"

namespace tandem::tls {
namespace {

TEST(MakeGrpcCredentials, NoFilesIsInsecure) {
  absl::StatusOr<GrpcCredentials> c = MakeGrpcCredentials({}, absl::Seconds(1));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->mtls);
  EXPECT_NE(c->server, nullptr);
  EXPECT_NE(c->channel, nullptr);
}

TEST(MakeGrpcCredentials, SomeFilesAreRefused) {
  for (const TlsFiles& f : {TlsFiles{"ca.pem", "", ""}, TlsFiles{"", "c.pem", "k.pem"},
                            TlsFiles{"ca.pem", "c.pem", ""}}) {
    absl::StatusOr<GrpcCredentials> c = MakeGrpcCredentials(f, absl::Seconds(1));
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("--tls_ca, --tls_cert and --tls_key"),
              std::string::npos)
        << c.status();
  }
}

TEST(MakeGrpcCredentials, MissingFilesAreNamed) {
  absl::StatusOr<GrpcCredentials> c = MakeGrpcCredentials(
      {"/nonexistent/ca.pem", "/nonexistent/c.pem", "/nonexistent/k.pem"},
      absl::Seconds(1));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("/nonexistent/ca.pem"), std::string::npos)
      << c.status();
}

}  // namespace
}  // namespace tandem::tls
