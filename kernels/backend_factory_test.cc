// Backend names: kind and GPU ordinal parsed from "kind[:N]"; ordinals only on
// the kinds with GPUs; the factory refuses unknown kinds and misplaced ordinals.
#include "kernels/backend_factory.h"

#include <string>

#include "gtest/gtest.h"

namespace tandem::kernels {
namespace {

TEST(ParseBackendName, KindsAndOrdinals) {
  struct Case {
    const char* name;
    const char* kind;
    int ordinal;
  };
  for (const Case& c :
       {Case{"cpu", "cpu", 0}, Case{"cuda", "cuda", 0}, Case{"cuda:0", "cuda", 0},
        Case{"cuda:3", "cuda", 3}, Case{"cuda_bf16:7", "cuda_bf16", 7},
        Case{"cuda_sim", "cuda_sim", 0}}) {
    auto p = ParseBackendName(c.name);
    ASSERT_TRUE(p.ok()) << c.name << ": " << p.status();
    EXPECT_EQ(p->kind, c.kind) << c.name;
    EXPECT_EQ(p->ordinal, c.ordinal) << c.name;
  }
}

TEST(ParseBackendName, RefusesBadOrdinals) {
  for (const char* bad : {"cuda:", "cuda:x", "cuda:-1", "cuda:1.5", "cpu:0",
                          "cuda_sim:1", "cpu_reference:2"}) {
    auto p = ParseBackendName(bad);
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_TRUE(absl::IsInvalidArgument(p.status())) << bad << ": " << p.status();
    EXPECT_NE(p.status().message().find(bad), std::string::npos) << p.status();
  }
}

TEST(CreateBackend, OrdinalsOnlyWhereThereAreDevices) {
  EXPECT_TRUE(CreateBackend("cpu_reference").ok());
  EXPECT_TRUE(CreateBackend("cpu_reference", 0).ok());
  auto host = CreateBackend("cpu_reference", 1);
  ASSERT_FALSE(host.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(host.status())) << host.status();
  EXPECT_FALSE(CreateBackend("cuda", -1).ok());
  auto unknown = CreateBackend("tpu");
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(unknown.status()));
  EXPECT_NE(unknown.status().message().find("\"tpu\""), std::string::npos);
}

}  // namespace
}  // namespace tandem::kernels
