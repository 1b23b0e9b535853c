// LibfabricAgent across two processes (this test = prefill side, a transfer_peer
// child = decode side) on the tcp and shm providers, one rail and several:
// full-K3-shaped per-layer state bit-exact (checksums computed by each side from
// its own layout) at several context lengths and block sizes; a peer stopped
// (deadline) and killed mid-transfer (UNAVAILABLE within the deadline);
// cancellation mid-transfer; an unreachable peer; bad descriptors; striping over
// rails; every libfabric registration released.
#include "kvtransfer/libfabric_agent.h"

#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
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
#include "kvtransfer/descriptor.h"
#include "kvtransfer/peer_process.h"
#include "kvtransfer/plan.h"

namespace tandem::kvtransfer {
namespace {

class Env : public ::testing::Environment {
 public:
  // Hard ceiling for the whole binary: a hang is killed, never waited out.
  void SetUp() override { alarm(240); }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new Env);

std::unique_ptr<PeerProcess> SpawnPeer() {
  return PeerProcess::Spawn("kvtransfer/transfer_peer");
}

std::string InitCommand(const std::string& provider, int rails,
                        absl::Duration progress_timeout = absl::ZeroDuration()) {
  return absl::StrCat("INIT libfabric ", provider, " ", rails, " ",
                      absl::ToInt64Milliseconds(progress_timeout));
}

std::unique_ptr<LibfabricAgent> MakeAgent(
    const std::string& provider, int rails,
    absl::Duration progress_timeout = absl::Seconds(10)) {
  LibfabricAgentConfig config;
  config.provider = provider;
  config.rails = rails;
  config.progress_timeout = progress_timeout;
  auto agent = LibfabricAgent::Create(config);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
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

struct TransferCase {
  std::string name;
  std::string provider;
  int rails;
  int64_t tokens;
  int src_block;
  int dst_block;
  bool dst_allocated;  // the receiver's cache from AllocateMemory
};

class LibfabricStateTransferTest : public ::testing::TestWithParam<TransferCase> {};

TEST_P(LibfabricStateTransferTest, ArrivesBitExact) {
  const TransferCase& c = GetParam();
  constexpr int kMla = 4, kKda = 3;
  auto child = SpawnPeer();
  ASSERT_NE(child, nullptr);
  ASSERT_EQ(child->Call(InitCommand(c.provider, c.rails)), "OK");

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

  auto agent = MakeAgent(c.provider, c.rails);
  ASSERT_NE(agent, nullptr);
  const tandem::v1::KvLayout src_layout = K3Layout(c.src_block, kMla, kKda);
  const int64_t src_needed = (c.tokens + c.src_block - 1) / c.src_block;
  const int64_t src_blocks = src_needed + 3, src_slots = 2;
  std::vector<uint8_t> mem(ContiguousRegionBytes(src_layout, src_blocks, src_slots));
  std::mt19937_64 rng(c.tokens * 31 + c.src_block);
  for (size_t i = 0; i + 8 <= mem.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(&mem[i], &v, 8);
  }
  auto src_region = agent->RegisterMemory(mem.data(), mem.size());
  ASSERT_TRUE(src_region.ok());
  RankLayout src = ContiguousRankLayout(src_layout, src_blocks, src_slots, *src_region);
  for (int64_t i = 0; i < src_needed; ++i) src.block_ids.push_back(src_blocks - 1 - i);
  src.state_slot = 1;
  RankLayout dst = ContiguousRankLayout(dst_layout, dst_blocks, dst_slots, dst_region);
  dst.block_ids.assign(target.block_ids().begin(), target.block_ids().end());
  dst.state_slot = target.state_slot();

  auto peer = agent->Connect(target.transfer_descriptor());
  ASSERT_TRUE(peer.ok()) << peer.status();
  std::vector<BatchId> batches;
  const absl::Time start = absl::Now();
  for (int l = 0; l < kMla + kKda; ++l) {
    const LayerRef layer =
        l < kMla ? LayerRef{LayerKind::kMla, l} : LayerRef{LayerKind::kKda, l - kMla};
    auto plan = PlanLayer(src, dst, layer, c.tokens);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto batch = agent->PostWrite(*peer, plan->segments);
    ASSERT_TRUE(batch.ok()) << batch.status();
    batches.push_back(*batch);
  }
  for (BatchId b : batches) {
    const absl::Status st = agent->Wait(b, absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(st.ok()) << st;
  }
  ASSERT_TRUE(
      agent->Notify(*peer, "req-lf", "done", absl::Now() + absl::Seconds(10)).ok());
  const absl::Duration took = absl::Now() - start;
  reply = child->Call("WAITNOTE 10000");
  ASSERT_EQ(reply, absl::StrCat("NOTE ", absl::BytesToHexString("req-lf"), " ",
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
  const std::string transport = agent->Transport(*peer);
  EXPECT_EQ(transport.rfind(c.provider, 0), 0u) << transport;
  std::cerr << c.name << ": " << took << ", transport " << transport << "\n";

  EXPECT_TRUE(agent->Disconnect(*peer).ok());
  EXPECT_TRUE(agent->DeregisterMemory(*src_region).ok());
  EXPECT_EQ(agent->NumRegisteredRegions(), 0u);
  // Only the agent's own message buffers stay registered.
  EXPECT_EQ(agent->NumLibfabricRegistrationsForTesting(), 1u);
  EXPECT_EQ(child->Call("QUIT", absl::Seconds(1)), "ERR child closed its output");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LibfabricStateTransferTest,
    ::testing::Values(
        TransferCase{"tcp_1_token", "tcp", 1, 1, 16, 64, false},
        TransferCase{"tcp_100_tokens", "tcp", 1, 100, 64, 16, true},
        TransferCase{"tcp_4096_tokens", "tcp", 1, 4096, 16, 64, false},
        TransferCase{"tcp_2rails_4096_tokens", "tcp", 2, 4096, 64, 16, true},
        TransferCase{"shm_1_token", "shm", 1, 1, 64, 16, true},
        TransferCase{"shm_100_tokens", "shm", 1, 100, 16, 16, false},
        TransferCase{"shm_4096_tokens", "shm", 1, 4096, 16, 64, true},
        TransferCase{"shm_3rails_4096_tokens", "shm", 3, 4096, 64, 16, false}),
    [](const ::testing::TestParamInfo<TransferCase>& info) { return info.param.name; });

// A plain region of `bytes` in the child, connected.
struct Wired {
  std::unique_ptr<PeerProcess> child;
  std::unique_ptr<LibfabricAgent> agent;
  std::vector<uint8_t> mem;
  RegionId local = 0;
  RegionId remote = 0;
  PeerId peer = 0;
  std::string descriptor;
};

void WireRaw(const std::string& provider, int rails, uint64_t bytes,
             absl::Duration progress_timeout, Wired* w) {
  w->child = SpawnPeer();
  ASSERT_NE(w->child, nullptr);
  ASSERT_EQ(w->child->Call(InitCommand(provider, rails)), "OK");
  tandem::v1::KvLayout l;  // one MLA layer of 4096-byte blocks: a raw region
  l.set_block_size(1);
  l.set_num_mla_layers(1);
  l.set_mla_token_bytes(4096);
  l.set_tp_size(1);
  std::string reply = w->child->Call(
      absl::StrCat("LAYOUT ", absl::BytesToHexString(l.SerializeAsString()), " ",
                   bytes / 4096, " 0"));
  ASSERT_TRUE(absl::StartsWith(reply, "OK ")) << reply;
  std::vector<std::string> words = absl::StrSplit(reply, ' ');
  ASSERT_TRUE(absl::SimpleAtoi(words[1], &w->remote));
  reply = w->child->Call("DESC");
  ASSERT_TRUE(absl::StartsWith(reply, "DESC ")) << reply;
  w->descriptor = absl::HexStringToBytes(reply.substr(5));
  w->agent = MakeAgent(provider, rails, progress_timeout);
  ASSERT_NE(w->agent, nullptr);
  w->mem.assign(bytes, 0x5a);
  auto local = w->agent->RegisterMemory(w->mem.data(), w->mem.size());
  ASSERT_TRUE(local.ok());
  w->local = *local;
  auto peer = w->agent->Connect(w->descriptor);
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
  EXPECT_EQ(w->agent->NumLibfabricRegistrationsForTesting(), 1u);  // message buffers
  const absl::Time t0 = absl::Now();
  w->agent.reset();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
}

struct ProviderCase {
  std::string provider;
  int rails;
};

class LibfabricPeerFailureTest : public ::testing::TestWithParam<ProviderCase> {};

// A stopped peer: the batch misses its deadline (shm and tcp both need the
// target's progress for 64 MiB). Killed: UNAVAILABLE within the deadline — tcp
// from the connection's error completions, shm (a dead process completes
// nothing) from the progress timeout (2 s here).
TEST_P(LibfabricPeerFailureTest, StoppedPeerMissesDeadlineKilledPeerFailsUnavailable) {
  constexpr uint64_t kBytes = 64 << 20;
  Wired w;
  WireRaw(GetParam().provider, GetParam().rails, kBytes, absl::Seconds(2), &w);
  if (HasFatalFailure()) return;
  w.child->Signal(SIGSTOP);
  auto batch = w.agent->PostWrite(w.peer, Chunks(w, kBytes, 1 << 20));
  ASSERT_TRUE(batch.ok());
  absl::Time t0 = absl::Now();
  EXPECT_EQ(w.agent->Wait(*batch, t0 + absl::Milliseconds(300)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  EXPECT_EQ(
      w.agent->Notify(w.peer, "r", "", absl::Now() + absl::Milliseconds(100)).code(),
      absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(w.agent->DeregisterMemory(w.local).code(),
            absl::StatusCode::kFailedPrecondition);
  w.child->Signal(SIGKILL);
  w.child->Reap();
  t0 = absl::Now();
  const absl::Status st = w.agent->Wait(*batch, t0 + absl::Seconds(15));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(15));
  std::cerr << "killed peer: " << st << " after " << absl::Now() - t0 << "\n";
  EXPECT_EQ(w.agent->PostWrite(w.peer, Chunks(w, 4096, 4096)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(w.agent->Notify(w.peer, "r", "", absl::Now() + absl::Seconds(5)).code(),
            absl::StatusCode::kUnavailable);
  ExpectAllReleased(&w);
}

TEST_P(LibfabricPeerFailureTest, KilledPeerMidTransferIsReportedBeforeTheDeadline) {
  constexpr uint64_t kBytes = 128 << 20;
  Wired w;
  WireRaw(GetParam().provider, GetParam().rails, kBytes, absl::Seconds(2), &w);
  if (HasFatalFailure()) return;
  auto batch = w.agent->PostWrite(w.peer, Chunks(w, kBytes, 64 << 10));
  ASSERT_TRUE(batch.ok());
  w.child->Signal(SIGKILL);
  w.child->Reap();
  absl::Time t0 = absl::Now();
  const absl::Status first = w.agent->Wait(*batch, t0 + absl::Seconds(15));
  // It may have completed before the kill landed; it never hangs.
  EXPECT_NE(first.code(), absl::StatusCode::kDeadlineExceeded) << first;
  t0 = absl::Now();
  absl::Status after;
  auto again = w.agent->PostWrite(w.peer, Chunks(w, 1 << 20, 1 << 20));
  after = again.ok() ? w.agent->Wait(*again, t0 + absl::Seconds(15)) : again.status();
  EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << after;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(15));
  std::cerr << "first batch: " << first << "; after death: " << after << "\n";
  ExpectAllReleased(&w);
}

TEST_P(LibfabricPeerFailureTest, CancelMidTransfer) {
  constexpr uint64_t kBytes = 64 << 20;
  Wired w;
  WireRaw(GetParam().provider, GetParam().rails, kBytes, absl::Seconds(10), &w);
  if (HasFatalFailure()) return;
  w.child->Signal(SIGSTOP);  // keeps the batch in flight until we cancel
  auto batch = w.agent->PostWrite(w.peer, Chunks(w, kBytes, 256 << 10));
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(w.agent->Cancel(*batch).ok());
  w.child->Signal(SIGCONT);  // operations handed to libfabric drain
  const absl::Status st = w.agent->Wait(*batch, absl::Now() + absl::Seconds(15));
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
  auto again = w.agent->PostWrite(w.peer, Chunks(w, 1 << 20, 1 << 20));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(w.agent->Wait(*again, absl::Now() + absl::Seconds(15)).ok());
  ExpectAllReleased(&w);
}

TEST_P(LibfabricPeerFailureTest, UnreachablePeerFailsConnect) {
  Wired w;
  WireRaw(GetParam().provider, GetParam().rails, 1 << 20, absl::Seconds(10), &w);
  if (HasFatalFailure()) return;
  w.child->Signal(SIGKILL);
  w.child->Reap();
  const absl::Time t0 = absl::Now();
  auto peer = w.agent->Connect(w.descriptor);
  ASSERT_FALSE(peer.ok()) << "connected to a dead peer's address: "
                          << w.agent->Transport(*peer);
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kUnavailable) << peer.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(11));  // connect_timeout
  ExpectAllReleased(&w);
}

INSTANTIATE_TEST_SUITE_P(Providers, LibfabricPeerFailureTest,
                         ::testing::Values(ProviderCase{"tcp", 1},
                                           ProviderCase{"tcp", 2},
                                           ProviderCase{"shm", 1}),
                         [](const ::testing::TestParamInfo<ProviderCase>& info) {
                           return absl::StrCat(info.param.provider, "_",
                                               info.param.rails, "rails");
                         });

// In one process.
TEST(LibfabricAgentTest, BadAddressesAreRejectedWithAClearError) {
  auto a = MakeAgent("tcp", 1);
  auto shm = MakeAgent("shm", 1);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(shm, nullptr);
  auto good = ParseDescriptor(*a->LocalDescriptor());
  ASSERT_TRUE(good.ok());
  // Another provider's agent.
  auto st = a->Connect(*shm->LocalDescriptor());
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.status().message().find("provider"), std::string::npos) << st.status();
  // A well-formed descriptor (checksum intact) whose address is not ours.
  auto with_address = [&](std::string address) {
    AgentDescriptor d = *good;
    d.address = std::move(address);
    return a->Connect(SerializeDescriptor(d)).status();
  };
  for (const std::string& bad :
       {std::string(), std::string("TKLF"), good->address.substr(0, 10),
        good->address + "x", std::string("XXXX") + good->address.substr(4)}) {
    const absl::Status s = with_address(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("libfabric"), std::string::npos) << s;
  }
  // An older agent's address (version 1: one domain per agent) says so.
  const absl::Status v1 = with_address(std::string("TKLF") + good->address.substr(4));
  EXPECT_EQ(v1.code(), absl::StatusCode::kInvalidArgument) << v1;
  EXPECT_NE(v1.message().find("version 1"), std::string::npos) << v1;
  // A region whose remote key is not a libfabric key.
  std::vector<uint8_t> buf(4096);
  ASSERT_TRUE(a->RegisterMemory(buf.data(), buf.size()).ok());
  AgentDescriptor d = *ParseDescriptor(*a->LocalDescriptor());
  d.regions[0].rkey = "abc";
  const absl::Status s = a->Connect(SerializeDescriptor(d)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("remote key"), std::string::npos) << s;
  EXPECT_EQ(a->NumPeers(), 0u);
}

// A descriptor naming an address that another agent now holds (a port or shm
// name reused after its owner died): Connect reads the agent id behind the
// address and refuses.
TEST(LibfabricAgentTest, AddressHeldByAnotherAgentIsRefused) {
  for (const char* provider : {"tcp", "shm"}) {
    auto a = MakeAgent(provider, 1);
    auto b = MakeAgent(provider, 1);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    AgentDescriptor d = *ParseDescriptor(*b->LocalDescriptor());
    d.agent_id ^= 0x1234;  // "the agent that used to be there"
    const absl::Status st = a->Connect(SerializeDescriptor(d)).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << provider << ": " << st;
    EXPECT_NE(st.message().find("stale descriptor"), std::string::npos) << st;
    EXPECT_EQ(a->NumPeers(), 0u);
    // The real one connects.
    EXPECT_TRUE(a->Connect(*b->LocalDescriptor()).ok()) << provider;
  }
}

TEST(LibfabricAgentTest, UnknownProviderAndBadRailsAreRefused) {
  LibfabricAgentConfig config;
  config.provider = "efa";  // not on this machine: an error, never tcp instead
  auto efa = LibfabricAgent::Create(config);
  ASSERT_FALSE(efa.ok());
  EXPECT_EQ(efa.status().code(), absl::StatusCode::kFailedPrecondition);
  config.provider = "tcp";
  for (int rails : {-1, 65}) {
    config.rails = rails;
    EXPECT_EQ(LibfabricAgent::Create(config).status().code(),
              absl::StatusCode::kInvalidArgument)
        << rails;
  }
  config.rails = 1;
  config.domain = "nosuchnic";
  auto st = LibfabricAgent::Create(config).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("no domain \"nosuchnic\""), std::string::npos) << st;
  config.domain = "";
  config.gpu_pci_bus_ids = {"gpu0"};
  st = LibfabricAgent::Create(config).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("GPU PCI bus id"), std::string::npos) << st;
}

TEST(LibfabricAgentTest, ReportsWhatTheProviderDemands) {
  auto shm = MakeAgent("shm", 1);
  ASSERT_NE(shm, nullptr);
  EXPECT_EQ(shm->provider(), "shm");
  // Debian's shm demands virtual addresses in RMA (checked in the key path).
  EXPECT_NE(shm->mr_mode().find("FI_MR_VIRT_ADDR"), std::string::npos)
      << shm->mr_mode();
  auto tcp = MakeAgent("tcp", 1);
  ASSERT_NE(tcp, nullptr);
  EXPECT_EQ(tcp->provider(), "tcp;ofi_rxm");
  EXPECT_FALSE(tcp->hmem_supported());
}

// A CUDA worker's cache needs FI_HMEM: the agent asks for it by itself when the
// CUDA driver is in the process (hmem_if_cuda_loaded). This test process has
// none, so shm (which would list FI_HMEM and then refuse the domain) opens
// without it, and CUDA memory is refused saying why, never staged silently.
TEST(LibfabricAgentTest, CudaMemoryNeedsFiHmem) {
  ASSERT_EQ(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), nullptr)
      << "this test assumes no CUDA driver in the process";
  for (const char* provider : {"shm", "tcp"}) {
    auto agent = MakeAgent(provider, 1);
    ASSERT_NE(agent, nullptr) << provider;
    EXPECT_FALSE(agent->hmem_supported()) << provider;
    std::vector<uint8_t> mem(4096);
    auto r = agent->RegisterMemory(mem.data(), mem.size(), MemoryKind::Cuda(0));
    ASSERT_FALSE(r.ok()) << provider;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(r.status().message().find("no CUDA driver was loaded"), std::string::npos)
        << r.status();
    EXPECT_EQ(agent->NumRegisteredRegions(), 0u);
  }
}

// Striping: with 3 rails, every rail carries pieces and the bytes arrive exact.
TEST(LibfabricAgentTest, RailsStripeOneBatch) {
  auto a = MakeAgent("tcp", 3);
  auto b = MakeAgent("tcp", 3);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  constexpr size_t kBytes = 8 << 20;
  std::vector<uint8_t> src(kBytes), dst(kBytes, 0);
  std::mt19937 rng(5);
  for (auto& x : src) x = static_cast<uint8_t>(rng());
  auto s = a->RegisterMemory(src.data(), src.size());
  auto d = b->RegisterMemory(dst.data(), dst.size());
  ASSERT_TRUE(s.ok() && d.ok());
  auto peer = a->Connect(*b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status();
  std::vector<Segment> segs;
  for (uint64_t off = 0; off < kBytes; off += 64 << 10)
    segs.push_back({*s, off, *d, kBytes - (64 << 10) - off, 64 << 10});
  auto batch = a->PostWrite(*peer, segs);
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(a->Wait(*batch, absl::Now() + absl::Seconds(30)).ok());
  for (uint64_t off = 0; off < kBytes; off += 64 << 10) {
    ASSERT_TRUE(std::equal(src.begin() + off, src.begin() + off + (64 << 10),
                           dst.begin() + (kBytes - (64 << 10) - off)))
        << off;
  }
  const std::vector<uint64_t> per_rail = a->PiecesPerRailForTesting();
  ASSERT_EQ(per_rail.size(), 3u);
  // Operations (of up to iov_limit gathered pieces) alternate over the rails.
  for (uint64_t n : per_rail)
    EXPECT_GE(n, segs.size() / 3 - a->iov_limit()) << "rail idle";
  EXPECT_EQ(a->Transport(*peer), "tcp;ofi_rxm x3 rails");
}

// Per-NIC domains: tcp lists one domain per interface (eth0 and lo on this VM),
// each of its own fabric (subnet), so naming both gives each rail its own
// fabric, domain, endpoint, CQ and AV, every region registered in both domains
// and a key per domain in the descriptor: the code path of several EFA devices.
std::unique_ptr<LibfabricAgent> MakeTcpAgent(const std::string& domains, int rails) {
  LibfabricAgentConfig config;
  config.provider = "tcp";
  config.domain = domains;
  config.rails = rails;
  auto agent = LibfabricAgent::Create(config);
  EXPECT_TRUE(agent.ok()) << domains << ": " << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

bool TcpHasDomains(const std::string& domains) {
  LibfabricAgentConfig config;
  config.provider = "tcp";
  config.domain = domains;
  return LibfabricAgent::Create(config).ok();
}

TEST(LibfabricAgentTest, EachRailOnItsOwnDomain) {
  if (!TcpHasDomains("eth0,lo")) GTEST_SKIP() << "tcp lists no eth0 and lo here";
  auto a = MakeTcpAgent("eth0,lo", 1);
  auto b = MakeTcpAgent("lo,eth0", 3);  // three rails over two NICs
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(a->domain_name(), "eth0,lo");
  EXPECT_EQ(a->rails(), 2);
  EXPECT_EQ(a->rail_nics(), (std::vector<int>{0, 1}));
  ASSERT_EQ(a->nics().size(), 2u);
  EXPECT_EQ(a->nics()[0].substr(0, 5), "eth0 ");
  EXPECT_EQ(a->nics()[1].substr(0, 3), "lo ");
  EXPECT_NE(a->fabric_name().find(','), std::string::npos) << a->fabric_name();
  EXPECT_EQ(b->rails(), 3);
  EXPECT_EQ(b->rail_nics(), (std::vector<int>{0, 1, 0}));
  constexpr size_t kBytes = 4 << 20, kSeg = 32 << 10;
  std::vector<uint8_t> src(kBytes), dst(kBytes, 0), back(kBytes, 0);
  std::mt19937 rng(11);
  for (auto& x : src) x = static_cast<uint8_t>(rng());
  auto s = a->RegisterMemory(src.data(), src.size());
  auto r = a->RegisterMemory(back.data(), back.size());
  auto d = b->RegisterMemory(dst.data(), dst.size());
  ASSERT_TRUE(s.ok() && r.ok() && d.ok());
  // One logical registration per region, one MR in each domain behind it; the
  // remote key is one key per domain.
  EXPECT_EQ(b->NumLibfabricRegistrationsForTesting(), 2u);  // + message buffers
  auto desc = ParseDescriptor(*b->LocalDescriptor());
  ASSERT_TRUE(desc.ok()) << desc.status();
  ASSERT_EQ(desc->regions.size(), 1u);
  EXPECT_EQ(desc->regions[0].rkey.size(), 16u);
  // Paired by fabric: a's eth0 rail with b's eth0 rail, a's lo with b's lo
  // (every rail's identity read succeeds, else Connect is UNAVAILABLE).
  auto peer = a->Connect(*b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(a->Transport(*peer), "tcp;ofi_rxm x2 rails on eth0,lo");
  std::vector<Segment> segs;
  for (uint64_t off = 0; off < kBytes; off += 2 * kSeg)  // scattered both sides
    segs.push_back({*s, off, *d, kBytes - 2 * kSeg - off, kSeg});
  auto w = a->PostWrite(*peer, segs);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(a->Wait(*w, absl::Now() + absl::Seconds(30)).ok());
  std::vector<Segment> reads;
  for (const Segment& g : segs)
    reads.push_back({*r, g.local_offset, *d, g.remote_offset, g.length});
  auto rd = a->PostRead(*peer, reads);
  ASSERT_TRUE(rd.ok()) << rd.status();
  ASSERT_TRUE(a->Wait(*rd, absl::Now() + absl::Seconds(30)).ok());
  for (const Segment& g : segs) {
    ASSERT_TRUE(std::equal(src.begin() + g.local_offset,
                           src.begin() + g.local_offset + kSeg,
                           dst.begin() + g.remote_offset))
        << g.local_offset;
    ASSERT_TRUE(std::equal(src.begin() + g.local_offset,
                           src.begin() + g.local_offset + kSeg,
                           back.begin() + g.local_offset))
        << g.local_offset;
  }
  const std::vector<uint64_t> per_rail = a->PiecesPerRailForTesting();
  ASSERT_EQ(per_rail.size(), 2u);
  for (uint64_t n : per_rail) EXPECT_GT(n, segs.size() / 2) << "a NIC idle";
  // The other way, from b's three rails (lo, eth0 and a second endpoint on
  // lo): every one carries pieces.
  auto bs = b->RegisterMemory(dst.data(), kBytes / 2);
  auto ad = a->RegisterMemory(back.data() + kBytes / 2, kBytes / 2);
  ASSERT_TRUE(bs.ok() && ad.ok());
  auto again = b->Connect(*a->LocalDescriptor());
  ASSERT_TRUE(again.ok()) << again.status();
  std::vector<Segment> back_segs;
  for (uint64_t off = 0; off < kBytes / 2; off += 2 * kSeg)
    back_segs.push_back({*bs, off, *ad, off, kSeg});
  auto bw = b->PostWrite(*again, back_segs);
  ASSERT_TRUE(bw.ok()) << bw.status();
  ASSERT_TRUE(b->Wait(*bw, absl::Now() + absl::Seconds(30)).ok());
  for (const Segment& g : back_segs) {
    ASSERT_TRUE(std::equal(dst.begin() + g.local_offset,
                           dst.begin() + g.local_offset + kSeg,
                           back.begin() + kBytes / 2 + g.remote_offset));
  }
  for (uint64_t n : b->PiecesPerRailForTesting()) EXPECT_GT(n, 0u) << "rail idle";
  // A one-NIC agent (lo only) and the two-NIC one talk: its lo rail pairs with
  // the other's lo rail (same fabric), and the other's eth0 rail, finding no
  // eth0 here, with rail 0.
  auto c = MakeTcpAgent("lo", 1);
  ASSERT_NE(c, nullptr);
  auto cd = c->RegisterMemory(back.data(), kBytes);
  ASSERT_TRUE(cd.ok());
  auto to_c = a->Connect(*c->LocalDescriptor());
  ASSERT_TRUE(to_c.ok()) << to_c.status();
  auto cw = a->PostWrite(*to_c, {{*s, 0, *cd, 0, kBytes}});
  ASSERT_TRUE(cw.ok()) << cw.status();
  ASSERT_TRUE(a->Wait(*cw, absl::Now() + absl::Seconds(30)).ok());
  EXPECT_TRUE(std::equal(src.begin(), src.end(), back.begin()));
  EXPECT_TRUE(c->Connect(*a->LocalDescriptor()).ok());
}

// The rails planned per GPU from a fake sysfs tree: tcp's eth0 and lo given
// PCI devices under two switches, one GPU under each; each GPU's nearest NIC
// gets its rail (host memory, which is all this VM can register, uses both).
TEST(LibfabricAgentTest, RailsPlannedPerGpuFromTopology) {
  if (!TcpHasDomains("eth0,lo")) GTEST_SKIP() << "tcp lists no eth0 and lo here";
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string root = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/sysXXXXXX");
  ASSERT_NE(mkdtemp(root.data()), nullptr);
  auto sh = [](const std::string& cmd) {
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  };
  const std::string a = "devices/pci0000:00/0000:00:01.0/0000:01:00.0";
  const std::string b = "devices/pci0000:00/0000:00:02.0/0000:02:00.0";
  sh(absl::StrCat("cd ", root, " && mkdir -p ", a, "/0000:01:01.0 ", a,
                  "/0000:01:02.0 ", b, "/0000:02:01.0 ", b,
                  "/0000:02:02.0 bus/pci/devices class/net/eth0 class/net/lo"));
  sh(absl::StrCat("cd ", root, " && ln -s $PWD/", a, "/0000:01:01.0 bus/pci/devices/",
                  " && ln -s $PWD/", b, "/0000:02:01.0 bus/pci/devices/",
                  " && ln -s $PWD/", a, "/0000:01:02.0 class/net/eth0/device",
                  " && ln -s $PWD/", b, "/0000:02:02.0 class/net/lo/device"));
  LibfabricAgentConfig config;
  config.provider = "tcp";
  config.sysfs_root = root;
  // GPU 0 beside lo's "device", GPU 1 beside eth0's.
  config.gpu_pci_bus_ids = {"0000:02:01.0", "0000:01:01.0"};
  auto agent = LibfabricAgent::Create(config);
  ASSERT_TRUE(agent.ok()) << agent.status();
  ASSERT_EQ((*agent)->nics().size(), 2u);
  EXPECT_EQ((*agent)->nics()[0],
            "lo pci=0000:02:02.0 numa=-1 pci_hops=2 same_pci_root");
  EXPECT_EQ((*agent)->nics()[1],
            "eth0 pci=0000:01:02.0 numa=-1 pci_hops=2 same_pci_root");
  EXPECT_EQ((*agent)->rails(), 2);
  // Two per GPU: its own NIC first, the other's second, endpoints shared.
  config.rails = 2;
  agent = LibfabricAgent::Create(config);
  ASSERT_TRUE(agent.ok()) << agent.status();
  EXPECT_EQ((*agent)->rails(), 2);
  EXPECT_EQ((*agent)->domain_name(), "lo,eth0");
  // Without GPUs and no NUMA information: fi_getinfo's order, both NICs.
  config.gpu_pci_bus_ids.clear();
  agent = LibfabricAgent::Create(config);
  ASSERT_TRUE(agent.ok()) << agent.status();
  EXPECT_EQ((*agent)->domain_name(), "eth0,lo");
  sh(absl::StrCat("rm -rf ", root));
}

// Multi-segment batches: small scattered segments go out gathered, up to the
// provider's iov limits per fi_writemsg / fi_readmsg; the bytes land (and are
// read back) exactly, in the same places as one operation per segment puts them.
class LibfabricGatherTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LibfabricGatherTest, ScatteredSegmentsShareOperations) {
  constexpr uint64_t kPiece = 3000, kSlots = 96;
  constexpr uint64_t kBytes = kPiece * kSlots * 2;
  for (int max_iovs : {0, 1, 2}) {
    LibfabricAgentConfig config;
    config.provider = GetParam();
    config.max_iovs_per_op = max_iovs;
    auto a = LibfabricAgent::Create(config);
    auto b = LibfabricAgent::Create(config);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    const size_t limit = (*a)->iov_limit();
    ASSERT_EQ((*a)->rma_iov_limit(), limit) << "tcp and shm: 4 and 4";
    if (max_iovs == 0) {
      EXPECT_GE(limit, 2u) << "tcp;ofi_rxm and shm take 4";
    } else {
      EXPECT_EQ(limit, static_cast<size_t>(max_iovs));
    }
    std::vector<uint8_t> src(kBytes), dst(kBytes, 0), back(kBytes, 0);
    std::mt19937 rng(17 + max_iovs);
    for (auto& x : src) x = static_cast<uint8_t>(rng());
    auto s = (*a)->RegisterMemory(src.data(), src.size());
    auto r = (*a)->RegisterMemory(back.data(), back.size());
    auto d = (*b)->RegisterMemory(dst.data(), dst.size());
    ASSERT_TRUE(s.ok() && r.ok() && d.ok());
    auto peer = (*a)->Connect(*(*b)->LocalDescriptor());
    ASSERT_TRUE(peer.ok()) << peer.status();
    // Every other slot locally, reversed remotely: nothing contiguous either side.
    std::vector<Segment> segs;
    for (uint64_t i = 0; i < kSlots; ++i)
      segs.push_back({*s, 2 * i * kPiece, *d, 2 * (kSlots - 1 - i) * kPiece, kPiece});
    const uint64_t ops_before = (*a)->RmaOpsPostedForTesting();
    auto batch = (*a)->PostWrite(*peer, segs);
    ASSERT_TRUE(batch.ok()) << batch.status();
    ASSERT_TRUE((*a)->Wait(*batch, absl::Now() + absl::Seconds(30)).ok());
    const uint64_t ops = (*a)->RmaOpsPostedForTesting() - ops_before;
    // Greedy grouping of scattered pieces: exactly ceil(kSlots / limit).
    EXPECT_EQ(ops, (kSlots + limit - 1) / limit) << "max_iovs " << max_iovs;
    for (uint64_t i = 0; i < kSlots; ++i) {
      ASSERT_TRUE(std::equal(src.begin() + 2 * i * kPiece,
                             src.begin() + (2 * i + 1) * kPiece,
                             dst.begin() + 2 * (kSlots - 1 - i) * kPiece))
          << "slot " << i;
      ASSERT_TRUE(std::all_of(dst.begin() + (2 * i + 1) * kPiece,
                              dst.begin() + (2 * i + 2) * kPiece,
                              [](uint8_t x) { return x == 0; }))
          << "gap after slot " << i << " written";
    }
    // Read the same segments back into `back`: gathered reads scatter right too.
    std::vector<Segment> reads;
    for (const Segment& g : segs)
      reads.push_back({*r, g.local_offset, g.remote_region, g.remote_offset, g.length});
    auto rb = (*a)->PostRead(*peer, reads);
    ASSERT_TRUE(rb.ok()) << rb.status();
    ASSERT_TRUE((*a)->Wait(*rb, absl::Now() + absl::Seconds(30)).ok());
    for (uint64_t i = 0; i < kSlots; ++i) {
      ASSERT_TRUE(std::equal(src.begin() + 2 * i * kPiece,
                             src.begin() + (2 * i + 1) * kPiece,
                             back.begin() + 2 * i * kPiece))
          << "read slot " << i;
    }
    // Contiguous segments need one entry each side, so an operation carries as
    // many as the agent's window of pieces in flight (max_inflight_ops, 64).
    std::vector<Segment> runs;
    for (uint64_t off = 0; off < kBytes; off += 1000)
      runs.push_back({*s, off, *d, off, 1000});
    const uint64_t before_runs = (*a)->RmaOpsPostedForTesting();
    auto rr = (*a)->PostWrite(*peer, runs);
    ASSERT_TRUE(rr.ok());
    ASSERT_TRUE((*a)->Wait(*rr, absl::Now() + absl::Seconds(30)).ok());
    EXPECT_LE((*a)->RmaOpsPostedForTesting() - before_runs, (runs.size() + 63) / 64);
    EXPECT_EQ(dst, src);
    ASSERT_TRUE((*a)->Disconnect(*peer).ok());
    ASSERT_TRUE((*a)->DeregisterMemory(*s).ok());
    ASSERT_TRUE((*a)->DeregisterMemory(*r).ok());
    ASSERT_TRUE((*b)->DeregisterMemory(*d).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(Providers, LibfabricGatherTest,
                         ::testing::Values("tcp", "shm"));

// What the worker logs and labels its metric with comes from fi_getinfo.
TEST(LibfabricAgentTest, NamesItsFabricAndDomain) {
  auto tcp = MakeAgent("tcp", 2);
  ASSERT_NE(tcp, nullptr);
  EXPECT_EQ(tcp->rails(), 2);
  EXPECT_FALSE(tcp->fabric_name().empty());
  EXPECT_FALSE(tcp->domain_name().empty());
  auto shm = MakeAgent("shm", 1);
  ASSERT_NE(shm, nullptr);
  EXPECT_EQ(shm->domain_name(), "shm");
}

}  // namespace
}  // namespace tandem::kvtransfer
