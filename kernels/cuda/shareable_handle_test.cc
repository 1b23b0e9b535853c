#include "kernels/cuda/shareable_handle.h"

#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace tandem::kernels::cuda {
namespace {

constexpr char kBootId[] = "0123abcd-4567-89ef-0123-456789abcdef";
constexpr size_t kPayload = 12;

ShareableHandle Valid() {
  ShareableHandle h;
  h.kind = ShareableKind::kCudaSim;
  h.boot_id = kBootId;
  h.pid = 4242;
  h.allocation_bytes = 1 << 20;
  h.offset = 4096;
  h.length = 8192;
  h.payload = std::string("payload-here", kPayload);
  return h;
}

TEST(ShareableHandle, RoundTripsEveryField) {
  const ShareableHandle h = Valid();
  const std::string bytes = EncodeShareableHandle(h);
  EXPECT_EQ(bytes.size(), kShareableHandleHeaderBytes + kPayload);
  EXPECT_LE(bytes.size(), kMaxShareableHandleBytes);
  auto back = DecodeShareableHandle(bytes, ShareableKind::kCudaSim, kPayload, "dev");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->kind, h.kind);
  EXPECT_EQ(back->boot_id, h.boot_id);
  EXPECT_EQ(back->pid, h.pid);
  EXPECT_EQ(back->allocation_bytes, h.allocation_bytes);
  EXPECT_EQ(back->offset, h.offset);
  EXPECT_EQ(back->length, h.length);
  EXPECT_EQ(back->payload, h.payload);
}

struct BadCase {
  const char* name;
  std::string bytes;
  const char* says;  // in the message
};

TEST(ShareableHandle, MalformedBytesAreInvalidArgumentSayingWhy) {
  const std::string good = EncodeShareableHandle(Valid());
  auto with = [](void (*edit)(ShareableHandle&)) {
    ShareableHandle h = Valid();
    edit(h);
    return EncodeShareableHandle(h);
  };
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  std::string bad_version = good;
  bad_version[6] = 9;
  const std::vector<BadCase> cases = {
      {"empty", "", "no magic"},
      {"garbage", std::string(good.size(), '\x5a'), "no magic"},
      {"bad magic", bad_magic, "no magic"},
      {"header only", good.substr(0, kShareableHandleHeaderBytes), "bytes, want"},
      {"one byte short", good.substr(0, good.size() - 1), "bytes, want"},
      {"one byte long", good + "x", "bytes, want"},
      {"magic only", good.substr(0, 4), "bytes, want"},
      {"other kind", with([](ShareableHandle& h) { h.kind = ShareableKind::kCuda; }),
       "exported by a cuda device"},
      {"version", bad_version, "version 9"},
      {"zero pid", with([](ShareableHandle& h) { h.pid = 0; }), "pid 0"},
      {"negative pid", with([](ShareableHandle& h) { h.pid = -7; }), "pid -7"},
      {"empty range", with([](ShareableHandle& h) { h.length = 0; }), "empty range"},
      {"past the end",
       with([](ShareableHandle& h) { h.offset = h.allocation_bytes - 1; }), "outside"},
      {"offset past the end",
       with([](ShareableHandle& h) { h.offset = h.allocation_bytes + 1; }), "outside"},
      {"wrapping length",
       with([](ShareableHandle& h) { h.length = ~uint64_t{0} - 100; }), "outside"},
      {"wrapping offset", with([](ShareableHandle& h) { h.offset = ~uint64_t{0}; }),
       "outside"},
  };
  for (const BadCase& c : cases) {
    auto h = DecodeShareableHandle(c.bytes, ShareableKind::kCudaSim, kPayload, "dev");
    ASSERT_FALSE(h.ok()) << c.name;
    EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_TRUE(absl::StrContains(h.status().message(), c.says))
        << c.name << ": " << h.status();
    EXPECT_TRUE(absl::StartsWith(h.status().message(), "dev: ")) << h.status();
  }
  // Every truncation is refused.
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_EQ(DecodeShareableHandle(good.substr(0, n), ShareableKind::kCudaSim,
                                    kPayload, "dev")
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument)
        << n;
  }
}

TEST(ShareableHandle, OpenableOnlyFromAnotherProcessOfTheSameHost) {
  const ShareableHandle h = Valid();
  EXPECT_TRUE(CheckShareableOpenable(h, kBootId, 1, "dev").ok());
  absl::Status other_host =
      CheckShareableOpenable(h, "ffffffff-4567-89ef-0123-456789abcdef", 1, "dev");
  EXPECT_EQ(other_host.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(other_host.message(), "another host")) << other_host;
  absl::Status same_process = CheckShareableOpenable(h, kBootId, h.pid, "dev");
  EXPECT_EQ(same_process.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(same_process.message(), "this process"))
      << same_process;
}

TEST(ShareableHandle, HostBootIdIsThisHosts) {
  auto id = HostBootId();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->size(), kBootIdBytes);
  EXPECT_EQ((*id)[8], '-');
  ShareableHandle h = Valid();
  h.boot_id = *id;
  EXPECT_TRUE(CheckShareableOpenableHere(h, "dev").ok());
  h.pid = static_cast<int32_t>(getpid());
  EXPECT_EQ(CheckShareableOpenableHere(h, "dev").code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tandem::kernels::cuda
