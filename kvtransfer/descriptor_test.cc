#include "kvtransfer/descriptor.h"

#include <xxhash.h>

#include "gtest/gtest.h"

namespace tandem::kvtransfer {
namespace {

AgentDescriptor Sample() {
  AgentDescriptor d;
  d.kind = AgentKind::kUcx;
  d.agent_id = 0x1122334455667788ull;
  d.address = std::string("\x01\x02\x00\x03worker", 10);
  d.metadata = "geometry";
  d.regions.push_back({1, 0x7f0000001000ull, 4096, std::string("rkey-one")});
  d.regions.push_back({7, 0x7f0000100000ull, 1 << 20, std::string(300, 'k')});
  return d;
}

// Rewrites the length field and checksum after tampering with the body.
std::string Reseal(std::string s) {
  const uint64_t total = s.size();
  for (int i = 0; i < 4; ++i) s[8 + i] = static_cast<char>((total >> (8 * i)) & 0xff);
  const uint64_t sum = XXH3_64bits(s.data(), s.size() - 8);
  for (int i = 0; i < 8; ++i)
    s[s.size() - 8 + i] = static_cast<char>((sum >> (8 * i)) & 0xff);
  return s;
}

TEST(DescriptorTest, RoundTrip) {
  const AgentDescriptor d = Sample();
  const std::string bytes = SerializeDescriptor(d);
  auto parsed = ParseDescriptor(bytes);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->kind, d.kind);
  EXPECT_EQ(parsed->agent_id, d.agent_id);
  EXPECT_EQ(parsed->address, d.address);
  EXPECT_EQ(parsed->metadata, d.metadata);
  ASSERT_EQ(parsed->regions.size(), 2u);
  EXPECT_EQ(parsed->regions[1].id, 7u);
  EXPECT_EQ(parsed->regions[1].base, 0x7f0000100000ull);
  EXPECT_EQ(parsed->regions[1].length, 1u << 20);
  EXPECT_EQ(parsed->regions[1].rkey, std::string(300, 'k'));
  EXPECT_EQ(parsed->FindRegion(7), &parsed->regions[1]);
  EXPECT_EQ(parsed->FindRegion(2), nullptr);
  EXPECT_EQ(SerializeDescriptor(*parsed), bytes);
}

void ExpectRejected(const std::string& bytes, absl::string_view needle) {
  auto parsed = ParseDescriptor(bytes);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find(needle), absl::string_view::npos)
      << parsed.status().message();
}

TEST(DescriptorTest, RejectsEveryTruncation) {
  const std::string bytes = SerializeDescriptor(Sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(ParseDescriptor(bytes.substr(0, n)).ok()) << n;
  }
}

TEST(DescriptorTest, RejectsEveryFlippedByte) {
  const std::string bytes = SerializeDescriptor(Sample());
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] ^= 0x40;
    EXPECT_FALSE(ParseDescriptor(bad).ok()) << i;
  }
}

TEST(DescriptorTest, ClearErrors) {
  std::string bytes = SerializeDescriptor(Sample());
  ExpectRejected("", "too short");
  ExpectRejected(std::string("XKVD") + bytes.substr(4), "bad magic");
  std::string v = bytes;
  v[4] = 9;
  ExpectRejected(Reseal(v), "unsupported version 9");
  std::string k = bytes;
  k[6] = 42;
  ExpectRejected(Reseal(k), "unknown agent kind 42");
  ExpectRejected(bytes + "x", "length field");
  std::string c = bytes;
  c[c.size() - 1] ^= 1;
  ExpectRejected(c, "checksum mismatch");
}

TEST(DescriptorTest, RejectsHostileLengthsAfterReseal) {
  const std::string bytes = SerializeDescriptor(Sample());
  // Address length field at offset 20: claim 2^31 bytes.
  std::string a = bytes;
  a[23] = 0x7f;
  ExpectRejected(Reseal(a), "address");
  // Region count claiming far more regions than bytes.
  AgentDescriptor empty = Sample();
  empty.regions.clear();
  std::string r = SerializeDescriptor(empty);
  const size_t count_at = r.size() - 8 - 4;
  r[count_at] = static_cast<char>(0xff);
  r[count_at + 1] = static_cast<char>(0x0f);
  ExpectRejected(Reseal(r), "region count");
}

TEST(DescriptorTest, RejectsBadRegions) {
  AgentDescriptor d = Sample();
  d.regions[1].id = 1;
  ExpectRejected(SerializeDescriptor(d), "duplicate region id 1");
  d = Sample();
  d.regions[0].length = 0;
  ExpectRejected(SerializeDescriptor(d), "is empty");
  d = Sample();
  d.regions[0].base = ~0ull - 10;
  ExpectRejected(SerializeDescriptor(d), "wraps");
}

// Version 2 carries extensions after the regions (a decorating agent's, e.g.
// the host staging's device IPC handles); without any, the bytes stay version 1.
TEST(DescriptorTest, ExtensionsRoundTripAsVersion2) {
  AgentDescriptor d = Sample();
  EXPECT_EQ(SerializeDescriptor(d)[4], 1);
  d.extensions.push_back({kExtensionDeviceIpc, std::string("\x00handles\xff", 9)});
  d.extensions.push_back({77, ""});
  const std::string bytes = SerializeDescriptor(d);
  EXPECT_EQ(bytes[4], 2);
  auto parsed = ParseDescriptor(bytes);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->extensions, d.extensions);
  EXPECT_EQ(parsed->regions.size(), 2u);
  ASSERT_NE(parsed->FindExtension(kExtensionDeviceIpc), nullptr);
  EXPECT_EQ(parsed->FindExtension(kExtensionDeviceIpc)->bytes, d.extensions[0].bytes);
  EXPECT_EQ(parsed->FindExtension(5), nullptr);
  EXPECT_EQ(SerializeDescriptor(*parsed), bytes);
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(ParseDescriptor(bytes.substr(0, n)).ok()) << n;
  }
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] ^= 0x40;
    EXPECT_FALSE(ParseDescriptor(bad).ok()) << i;
  }
}

TEST(DescriptorTest, RejectsBadExtensions) {
  // A version 1 body claimed as version 2: no extension section.
  std::string v = SerializeDescriptor(Sample());
  v[4] = 2;
  ExpectRejected(Reseal(v), "truncated extension count");
  AgentDescriptor d = Sample();
  d.extensions = {{3, "a"}, {3, "b"}};
  ExpectRejected(SerializeDescriptor(d), "duplicate extension tag 3");
  // Zero extensions under version 2 (it would not re-serialise the same).
  d.extensions = {{3, "a"}};
  std::string z = SerializeDescriptor(d);
  z.resize(z.size() - 8 - (4 + 4 + 1) - 4);
  z += std::string(4, '\0') + std::string(8, '\0');
  ExpectRejected(Reseal(z), "with 0 extensions");
  // An extension length beyond the bytes.
  std::string l = SerializeDescriptor(d);
  l[l.size() - 8 - 1 - 4 + 3] = 0x7f;
  ExpectRejected(Reseal(l), "extension 0");
}

}  // namespace
}  // namespace tandem::kvtransfer
