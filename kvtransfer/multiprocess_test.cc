// Two processes: this test (the prefill side, initiator) and a transfer_peer child
// (the decode side, target), exchanging descriptors over pipes. Full-K3-shaped
// per-layer state goes over UCX and must arrive bit-exact (checksums computed by
// each side from its own layout); a peer killed mid-transfer must turn into an
// error before the deadline, with every registration released.
#include <signal.h>
#include <unistd.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/peer_process.h"
#include "kvtransfer/plan.h"
#include "kvtransfer/ucx_agent.h"

namespace tandem::kvtransfer {
namespace {

std::unique_ptr<PeerProcess> SpawnPeer() {
  return PeerProcess::Spawn("kvtransfer/transfer_peer");
}

tandem::v1::KvLayout K3Layout(int block_size, int mla_layers, int kda_layers) {
  tandem::v1::KvLayout l;
  l.set_block_size(block_size);
  l.set_num_mla_layers(mla_layers);
  l.set_num_kda_layers(kda_layers);
  l.set_mla_token_bytes((512 + 64) * 2);               // 576 BF16 values
  l.set_kda_state_bytes(96LL * 128 * 128 * 4);         // 96 heads x 128 x 128 FP32
  l.set_kda_conv_bytes(3LL * (4 - 1) * 96 * 128 * 4);  // 3 projections, kernel 4
  l.set_tp_rank(0);
  l.set_tp_size(1);
  l.set_mla_dtype("bf16");
  return l;
}

class MultiProcessEnv : public ::testing::Environment {
 public:
  // Hard ceiling for the whole binary: a hang is killed, never waited out.
  void SetUp() override { alarm(120); }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new MultiProcessEnv);

struct TransferCase {
  std::string name;
  std::string tls;  // "" = UCX default
  bool detect_failures;
  int64_t tokens;
  int src_block;
  int dst_block;
  // The receiver's cache from UcxAgent::AllocateMemory (shared memory: the
  // sender's puts are direct copies) instead of plain mmap memory.
  bool dst_allocated = false;
};

class KvStateTransferTest : public ::testing::TestWithParam<TransferCase> {};

TEST_P(KvStateTransferTest, ArrivesBitExact) {
  const TransferCase& c = GetParam();
  constexpr int kMla = 4, kKda = 3;
  auto child = SpawnPeer();
  ASSERT_NE(child, nullptr);
  ASSERT_EQ(child->Call(absl::StrCat("INIT ", c.tls.empty() ? "-" : c.tls,
                                     c.detect_failures ? "" : " noerr")),
            "OK");

  // Receiver: its own block size, blocks reserved in a scattered order.
  const tandem::v1::KvLayout dst_layout = K3Layout(c.dst_block, kMla, kKda);
  const int64_t dst_needed = (c.tokens + c.dst_block - 1) / c.dst_block;
  const int64_t dst_blocks = dst_needed * 2 + 1, dst_slots = 3;
  tandem::v1::RankTarget target;
  for (int64_t i = 0; i < dst_needed; ++i)
    target.add_block_ids((i * 2 + 1) % dst_blocks);
  target.set_state_slot(2);
  *target.mutable_layout() = dst_layout;
  std::string reply = child->Call(
      absl::StrCat("LAYOUT ", absl::BytesToHexString(dst_layout.SerializeAsString()),
                   " ", dst_blocks, " ", dst_slots, c.dst_allocated ? " ucx" : ""));
  ASSERT_TRUE(absl::StartsWith(reply, "OK ")) << reply;
  std::vector<std::string> words = absl::StrSplit(reply, ' ');
  uint32_t dst_region = 0;
  ASSERT_TRUE(absl::SimpleAtoi(words[1], &dst_region));
  reply = child->Call("DESC");
  ASSERT_TRUE(absl::StartsWith(reply, "DESC ")) << reply;
  target.set_transfer_descriptor(absl::HexStringToBytes(reply.substr(5)));

  // Sender: random state in its own layout.
  UcxAgentConfig config;
  config.tls = c.tls;
  config.peer_failure_detection = c.detect_failures;
  auto agent = UcxAgent::Create(config);
  ASSERT_TRUE(agent.ok()) << agent.status();
  const tandem::v1::KvLayout src_layout = K3Layout(c.src_block, kMla, kKda);
  const int64_t src_needed = (c.tokens + c.src_block - 1) / c.src_block;
  const int64_t src_blocks = src_needed + 3, src_slots = 2;
  std::vector<uint8_t> mem(ContiguousRegionBytes(src_layout, src_blocks, src_slots));
  std::mt19937_64 rng(c.tokens * 31 + c.src_block);
  for (size_t i = 0; i + 8 <= mem.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(&mem[i], &v, 8);
  }
  auto src_region = (*agent)->RegisterMemory(mem.data(), mem.size());
  ASSERT_TRUE(src_region.ok());
  RankLayout src = ContiguousRankLayout(src_layout, src_blocks, src_slots, *src_region);
  for (int64_t i = 0; i < src_needed; ++i) src.block_ids.push_back(src_blocks - 1 - i);
  src.state_slot = 1;
  RankLayout dst = ContiguousRankLayout(dst_layout, dst_blocks, dst_slots, dst_region);
  dst.block_ids.assign(target.block_ids().begin(), target.block_ids().end());
  dst.state_slot = target.state_slot();

  auto peer = (*agent)->Connect(target.transfer_descriptor());
  ASSERT_TRUE(peer.ok()) << peer.status();

  // Per-layer streaming: one batch per layer, as prefill produces them.
  std::vector<BatchId> batches;
  int64_t raw = 0, posted = 0;
  const absl::Time start = absl::Now();
  for (int l = 0; l < kMla + kKda; ++l) {
    const LayerRef layer =
        l < kMla ? LayerRef{LayerKind::kMla, l} : LayerRef{LayerKind::kKda, l - kMla};
    auto plan = PlanLayer(src, dst, layer, c.tokens);
    ASSERT_TRUE(plan.ok()) << plan.status();
    raw += plan->segments_before_coalescing;
    posted += plan->segments.size();
    auto batch = (*agent)->PostWrite(*peer, plan->segments);
    ASSERT_TRUE(batch.ok()) << batch.status();
    batches.push_back(*batch);
  }
  for (BatchId b : batches) {
    ASSERT_TRUE((*agent)->Wait(b, absl::Now() + absl::Seconds(30)).ok());
  }
  ASSERT_TRUE(
      (*agent)->Notify(*peer, "req-mp", "done", absl::Now() + absl::Seconds(10)).ok());
  const absl::Duration took = absl::Now() - start;
  reply = child->Call("WAITNOTE 10000");
  ASSERT_EQ(reply, absl::StrCat("NOTE ", absl::BytesToHexString("req-mp"), " ",
                                absl::BytesToHexString("done"), " "));

  auto want = ComputeChecksums(src, c.tokens, [&](RegionId r) {
    return r == *src_region ? absl::Span<const uint8_t>(mem)
                            : absl::Span<const uint8_t>();
  });
  ASSERT_TRUE(want.ok()) << want.status();
  reply = child->Call(absl::StrCat("CHECKSUM ",
                                   absl::BytesToHexString(target.SerializeAsString()),
                                   " ", c.tokens, " ", dst_blocks, " ", dst_slots));
  ASSERT_TRUE(absl::StartsWith(reply, "SUM ")) << reply;
  tandem::v1::StateChecksums got;
  ASSERT_TRUE(got.ParseFromString(absl::HexStringToBytes(reply.substr(4))));
  EXPECT_TRUE(Verify(*want, got).ok()) << Verify(*want, got);
  EXPECT_EQ(got.mla_layer_size(), kMla);
  EXPECT_EQ(got.kda_layer_size(), kKda);

  const std::string transport = (*agent)->Transport(*peer);
  if (c.tls == "tcp") {
    EXPECT_EQ(transport, "tcp");
  }
  if (!c.detect_failures) {
    EXPECT_NE(transport.find("cma"), std::string::npos) << transport;
  }
  EXPECT_FALSE(transport.empty());
  EXPECT_LE(posted, raw);
  RecordProperty("transport", transport);
  std::cerr << c.name << ": segments " << raw << " -> " << posted << ", " << took
            << ", transport " << transport << "\n";

  EXPECT_TRUE((*agent)->Disconnect(*peer).ok());
  EXPECT_TRUE((*agent)->DeregisterMemory(*src_region).ok());
  EXPECT_EQ((*agent)->NumRegisteredRegions(), 0u);
  EXPECT_EQ(child->Call("QUIT", absl::Seconds(1)), "ERR child closed its output");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, KvStateTransferTest,
    ::testing::Values(
        TransferCase{"default_1_token", "", true, 1, 16, 64},
        TransferCase{"default_100_tokens", "", true, 100, 64, 16},
        TransferCase{"default_4096_tokens", "", true, 4096, 16, 64},
        TransferCase{"tcp_100_tokens", "tcp", true, 100, 16, 16},
        TransferCase{"tcp_4096_tokens", "tcp", true, 4096, 64, 16},
        TransferCase{"shm_1_token", "", false, 1, 64, 16},
        TransferCase{"shm_4096_tokens", "", false, 4096, 16, 64},
        TransferCase{"shm_allocated_100_tokens", "", false, 100, 64, 16, true},
        TransferCase{"shm_allocated_4096_tokens", "", false, 4096, 16, 64, true},
        TransferCase{"tcp_allocated_4096_tokens", "tcp", true, 4096, 64, 16, true}),
    [](const ::testing::TestParamInfo<TransferCase>& info) { return info.param.name; });

// Registers a plain region of `bytes` in the child and connects to it.
struct Wired {
  std::unique_ptr<PeerProcess> child;
  std::unique_ptr<UcxAgent> agent;
  std::vector<uint8_t> mem;
  RegionId local = 0;
  RegionId remote = 0;
  PeerId peer = 0;
};

// `detect`: peer-failure detection on both sides (false: shared memory on one
// host); `allocated`: the child's region from AllocateMemory (what a decode
// worker's host cache is), else plain mmap memory; `progress_timeout`: this
// side's.
void WireRaw(const std::string& tls, uint64_t bytes, Wired* w, bool detect = true,
             bool allocated = false,
             absl::Duration progress_timeout = absl::Seconds(10)) {
  w->child = SpawnPeer();
  ASSERT_NE(w->child, nullptr);
  ASSERT_EQ(w->child->Call(
                absl::StrCat("INIT ", tls.empty() ? "-" : tls, detect ? "" : " noerr")),
            "OK");
  // One MLA layer of `bytes / 4096` blocks of one 4096-byte token: a raw region.
  tandem::v1::KvLayout l;
  l.set_block_size(1);
  l.set_num_mla_layers(1);
  l.set_mla_token_bytes(4096);
  l.set_tp_size(1);
  std::string reply = w->child->Call(
      absl::StrCat("LAYOUT ", absl::BytesToHexString(l.SerializeAsString()), " ",
                   bytes / 4096, " 0", allocated ? " ucx" : ""));
  ASSERT_TRUE(absl::StartsWith(reply, "OK ")) << reply;
  std::vector<std::string> words = absl::StrSplit(reply, ' ');
  ASSERT_TRUE(absl::SimpleAtoi(words[1], &w->remote));
  reply = w->child->Call("DESC");
  ASSERT_TRUE(absl::StartsWith(reply, "DESC ")) << reply;
  UcxAgentConfig config;
  config.tls = tls;
  config.peer_failure_detection = detect;
  config.progress_timeout = progress_timeout;
  auto agent = UcxAgent::Create(config);
  ASSERT_TRUE(agent.ok()) << agent.status();
  w->agent = std::move(*agent);
  w->mem.assign(bytes, 0x5a);
  auto local = w->agent->RegisterMemory(w->mem.data(), w->mem.size());
  ASSERT_TRUE(local.ok());
  w->local = *local;
  auto peer = w->agent->Connect(absl::HexStringToBytes(reply.substr(5)));
  ASSERT_TRUE(peer.ok()) << peer.status();
  w->peer = *peer;
}

std::vector<Segment> Chunks(const Wired& w, uint64_t bytes, uint64_t chunk) {
  std::vector<Segment> segs;
  for (uint64_t off = 0; off < bytes; off += chunk)
    segs.push_back({w.local, off, w.remote, off, chunk});
  return segs;
}

void ExpectAllReleased(Wired* w) {
  EXPECT_TRUE(w->agent->Disconnect(w->peer).ok());
  EXPECT_TRUE(w->agent->DeregisterMemory(w->local).ok());
  EXPECT_EQ(w->agent->NumRegisteredRegions(), 0u);
  EXPECT_EQ(w->agent->NumPeers(), 0u);
  EXPECT_EQ(w->agent->NumBatchesForTesting(), 0u);
  const absl::Time t0 = absl::Now();
  w->agent.reset();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
}

TEST(PeerFailureTest, StoppedPeerMissesDeadlineKilledPeerFailsUnavailable) {
  // Over tcp the target's progress is needed for the flush to complete, so a
  // stopped peer stalls the batch deterministically.
  constexpr uint64_t kBytes = 64 << 20;
  Wired w;
  WireRaw("tcp", kBytes, &w);
  if (HasFatalFailure()) return;
  w.child->Signal(SIGSTOP);
  auto batch = w.agent->PostWrite(w.peer, Chunks(w, kBytes, 1 << 20));
  ASSERT_TRUE(batch.ok());
  absl::Time t0 = absl::Now();
  EXPECT_EQ(w.agent->Wait(*batch, t0 + absl::Milliseconds(300)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  // Notify cannot overtake it either.
  EXPECT_EQ(
      w.agent->Notify(w.peer, "r", "", absl::Now() + absl::Milliseconds(100)).code(),
      absl::StatusCode::kDeadlineExceeded);
  // The region is in use by the stalled batch.
  EXPECT_EQ(w.agent->DeregisterMemory(w.local).code(),
            absl::StatusCode::kFailedPrecondition);
  w.child->Signal(SIGKILL);
  w.child->Reap();
  t0 = absl::Now();
  const absl::Status st = w.agent->Wait(*batch, t0 + absl::Seconds(15));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(15));
  // Later operations to the dead peer fail at once.
  EXPECT_EQ(w.agent->PostWrite(w.peer, Chunks(w, 4096, 4096)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(w.agent->Notify(w.peer, "r", "", absl::Now() + absl::Seconds(5)).code(),
            absl::StatusCode::kUnavailable);
  ExpectAllReleased(&w);
}

TEST(PeerFailureTest, KilledPeerMidTransferDefaultTransports) {
  constexpr uint64_t kBytes = 128 << 20;
  Wired w;
  WireRaw("", kBytes, &w);
  if (HasFatalFailure()) return;
  auto batch = w.agent->PostWrite(w.peer, Chunks(w, kBytes, 64 << 10));
  ASSERT_TRUE(batch.ok());
  w.child->Signal(SIGKILL);
  w.child->Reap();
  absl::Time t0 = absl::Now();
  // The batch ends (it may have completed before the kill landed); never hangs.
  const absl::Status first = w.agent->Wait(*batch, t0 + absl::Seconds(15));
  EXPECT_NE(first.code(), absl::StatusCode::kDeadlineExceeded) << first;
  // A write after the death is an error before its deadline.
  t0 = absl::Now();
  absl::Status after;
  auto again = w.agent->PostWrite(w.peer, Chunks(w, 1 << 20, 1 << 20));
  if (again.ok()) {
    after = w.agent->Wait(*again, t0 + absl::Seconds(15));
  } else {
    after = again.status();
  }
  EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << after;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(15));
  std::cerr << "first batch: " << first << "; after death: " << after << "\n";
  ExpectAllReleased(&w);
}

// Shared memory on one host (no peer-failure detection, what ./tandem up runs):
// a peer killed mid-transfer never hangs the sender past its progress timeout,
// and leaves nothing registered or tracked.
//   - into plain mmap memory UCX 1.13 emulates the puts with active messages,
//     which a dead process never answers: the batch fails UNAVAILABLE after the
//     progress timeout (before it, DEADLINE_EXCEEDED), and so does every later
//     write and notification, at once;
//   - into memory from AllocateMemory (a decode worker's host cache) a put is a
//     copy into a shared-memory segment that stays mapped after its owner died:
//     the batch completes, and the dead decode worker is the router's to notice.
class SharedMemoryPeerDeathTest : public ::testing::TestWithParam<bool> {};

TEST_P(SharedMemoryPeerDeathTest, KilledPeerMidTransferEndsWithinTheProgressTimeout) {
  const bool allocated = GetParam();
  constexpr uint64_t kBytes = 256 << 20;
  constexpr absl::Duration kProgressTimeout = absl::Seconds(1);
  Wired w;
  WireRaw("", kBytes, &w, /*detect=*/false, allocated, kProgressTimeout);
  if (HasFatalFailure()) return;
  const std::string transport = w.agent->Transport(w.peer);
  EXPECT_FALSE(UcxTransportsAreTcpOnly(transport)) << transport;
  auto batch = w.agent->PostWrite(w.peer, Chunks(w, kBytes, 64 << 10));
  ASSERT_TRUE(batch.ok());
  w.child->Signal(SIGKILL);
  w.child->Reap();
  absl::Time t0 = absl::Now();
  const absl::Status first = w.agent->Wait(*batch, t0 + absl::Seconds(8));
  const absl::Duration took = absl::Now() - t0;
  std::cerr << (allocated ? "allocated" : "mmap") << ": first batch " << first
            << " after " << took << "\n";
  EXPECT_LT(took, kProgressTimeout + absl::Seconds(3));
  if (allocated) {
    EXPECT_TRUE(first.ok() || absl::IsUnavailable(first)) << first;
  } else {
    EXPECT_EQ(first.code(), absl::StatusCode::kUnavailable) << first;
    EXPECT_NE(first.message().find("no completion for"), absl::string_view::npos)
        << first;
    // Later operations to the dead peer fail at once.
    t0 = absl::Now();
    EXPECT_EQ(w.agent->PostWrite(w.peer, Chunks(w, 4096, 4096)).status().code(),
              absl::StatusCode::kUnavailable);
    EXPECT_EQ(w.agent->Notify(w.peer, "r", "", absl::Now() + absl::Seconds(5)).code(),
              absl::StatusCode::kUnavailable);
    EXPECT_LT(absl::Now() - t0, absl::Seconds(1));
  }
  ExpectAllReleased(&w);
}

INSTANTIATE_TEST_SUITE_P(Receivers, SharedMemoryPeerDeathTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "allocated" : "mmap";
                         });

// A stopped peer over shared memory: DEADLINE_EXCEEDED before the progress
// timeout, UNAVAILABLE after it (nothing completes), the batch ended either way.
TEST(PeerFailureTest, StoppedPeerOverSharedMemoryFailsAfterTheProgressTimeout) {
  constexpr uint64_t kBytes = 64 << 20;
  constexpr absl::Duration kProgressTimeout = absl::Seconds(1);
  Wired w;
  WireRaw("", kBytes, &w, /*detect=*/false, /*allocated=*/false, kProgressTimeout);
  if (HasFatalFailure()) return;
  w.child->Signal(SIGSTOP);
  // Before the post: the progress clock starts when the first piece goes out.
  const absl::Time t0 = absl::Now();
  auto batch = w.agent->PostWrite(w.peer, Chunks(w, kBytes, 1 << 20));
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ(w.agent->Wait(*batch, t0 + absl::Milliseconds(200)).code(),
            absl::StatusCode::kDeadlineExceeded);
  const absl::Status st = w.agent->Wait(*batch, t0 + absl::Seconds(8));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_GE(absl::Now() - t0, kProgressTimeout);
  EXPECT_LT(absl::Now() - t0, kProgressTimeout + absl::Seconds(3));
  w.child->Signal(SIGKILL);
  w.child->Reap();
  ExpectAllReleased(&w);
}

TEST(PeerFailureTest, CancelMidTransfer) {
  constexpr uint64_t kBytes = 64 << 20;
  Wired w;
  WireRaw("tcp", kBytes, &w);
  if (HasFatalFailure()) return;
  w.child->Signal(SIGSTOP);  // keeps the batch in flight until we cancel
  auto batch = w.agent->PostWrite(w.peer, Chunks(w, kBytes, 256 << 10));
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(w.agent->Cancel(*batch).ok());
  // Operations already handed to UCX drain once the peer runs again.
  w.child->Signal(SIGCONT);
  const absl::Status st = w.agent->Wait(*batch, absl::Now() + absl::Seconds(15));
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
  // The connection stays usable.
  auto again = w.agent->PostWrite(w.peer, Chunks(w, 1 << 20, 1 << 20));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(w.agent->Wait(*again, absl::Now() + absl::Seconds(15)).ok());
  ExpectAllReleased(&w);
}

TEST(PeerFailureTest, UnreachablePeerFailsConnect) {
  Wired w;
  WireRaw("tcp", 1 << 20, &w);
  if (HasFatalFailure()) return;
  const std::string desc = absl::HexStringToBytes(w.child->Call("DESC").substr(5));
  w.child->Signal(SIGKILL);
  w.child->Reap();
  auto peer = w.agent->Connect(desc);
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kUnavailable) << peer.status();
  ExpectAllReleased(&w);
}

}  // namespace
}  // namespace tandem::kvtransfer
