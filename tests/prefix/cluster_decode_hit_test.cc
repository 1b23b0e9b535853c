// Decode-side prefix hits through the cluster (issue 17, item 5): when the
// decode worker already holds the MLA rows of a prompt's prefix (the landed
// prompt of an earlier request, cached at its admission), its reservation
// shares those blocks and the prefill worker writes only the rest plus the
// KDA state. Checked on three processes (router, prefill, decode; checksums
// on, so the decode worker hashes its held rows with the landed ones against
// the prefill worker's):
//   - the bytes on the wire fall by exactly the held rows' bytes (the per-token
//     MLA bytes measured from two requests without a hit);
//   - the tokens equal a cluster with prefix caching off, greedy and seeded;
//   - the decode worker's reserve-hit counter is that prefix, a whole number of
//     blocks, and a tenant with another cache_salt shares nothing;
//   - a Reserve with the prompt's ids but without share_held_prefix (a router
//     older than the field) shares nothing;
//   - with a prefill worker that does not register writes_after_held_prefix
//     (--kv_write_after_held_prefix=false, as a worker older than the
//     handshake) nothing is shared: every row crosses, tokens unchanged.
#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/router.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "tests/prefix/prefix_metrics.h"
#include "tests/testing/process_cluster.h"

namespace tandem {
namespace {

using testing::MakeRequest;
using testing::Metric;
using testing::ProcessCluster;
using testing::StreamResult;

// Every test disaggregates its prompts (they are short).
const std::vector<std::string> kRouterFlags = {"--colocate_below_tokens=0"};

tandem::v1::GenerateRequest Extend(tandem::v1::GenerateRequest base, int more,
                                   uint64_t seed) {
  for (int i = 0; i < more; ++i) {
    base.mutable_prompt_token_ids()->add_ids(
        static_cast<int32_t>((seed * 31337 + i * 7907) % 100000));
  }
  return base;
}

double Counter(int port, const std::string& name) {
  auto v = Metric(port, name, {});
  return v.ok() ? *v : -1;
}

// The prefill worker's bytes written so far, once its counter is current (it
// is updated when a transfer ends, before the response: no wait needed).
double WireBytes(ProcessCluster& c) {
  return Counter(c.prefill_metrics(), "tandem_worker_transfer_bytes_total");
}

double ReserveHits(ProcessCluster& c) {
  return Counter(c.decode_metrics(),
                 "tandem_worker_prefix_cache_reserve_hit_tokens_total");
}

// Polls the decode worker's reserve-hit counter (refreshed every 500 ms) until
// it changes from `before` (bounded).
double NextReserveHits(ProcessCluster& c, double before) {
  double v = ReserveHits(c);
  for (int i = 0; i < 30 && v == before; ++i) {
    absl::SleepFor(absl::Milliseconds(200));
    v = ReserveHits(c);
  }
  return v;
}

double SettledReserveHits(ProcessCluster& c) {
  return testing::SettledMetric(c.decode_metrics(),
                                "tandem_worker_prefix_cache_reserve_hit_tokens_total");
}

struct Reference {
  StreamResult a, b, b_seeded;
};

TEST(ClusterDecodeHitTest, OnlyTheRowsTheDecodeWorkerLacksCrossTheWire) {
  const tandem::v1::GenerateRequest a = MakeRequest(300, 11, 4, 0.0f);
  tandem::v1::GenerateRequest b = Extend(a, 100, 5);  // a + 100 new tokens
  b.set_request_id("b");
  tandem::v1::GenerateRequest b_seeded = b;
  b_seeded.set_request_id("b-seeded");
  b_seeded.mutable_sampling()->set_temperature(0.8f);
  b_seeded.mutable_sampling()->set_seed(77);

  // Reference: prefix caching off on both workers.
  Reference off;
  {
    ProcessCluster c;
    ASSERT_EQ(c.Start(kRouterFlags, 4, {"--enable_prefix_caching=false"},
                      {"--enable_prefix_caching=false"}),
              "");
    off.a = c.Generate(a);
    off.b = c.Generate(b);
    off.b_seeded = c.Generate(b_seeded);
    ASSERT_TRUE(off.b_seeded.status.ok())
        << off.b_seeded.status.error_message() << c.Logs();
  }

  ProcessCluster c;
  ASSERT_EQ(c.Start(kRouterFlags, 4), "");
  // Two prompts nobody holds: the wire bytes of one MLA row (every layer),
  // and those of the KDA state.
  const double w0 = WireBytes(c);
  const StreamResult d200 = c.Generate(MakeRequest(200, 901, 2, 0.0f));
  ASSERT_TRUE(d200.status.ok()) << d200.status.error_message() << c.Logs();
  const double w1 = WireBytes(c);
  const StreamResult d400 = c.Generate(MakeRequest(400, 902, 2, 0.0f));
  ASSERT_TRUE(d400.status.ok()) << d400.status.error_message();
  const double w2 = WireBytes(c);
  const double row = ((w2 - w1) - (w1 - w0)) / 200.0;
  ASSERT_GT(row, 0);
  const double kda = (w1 - w0) - 200 * row;
  ASSERT_GT(kda, 0);

  // a: the decode worker holds nothing of it yet; its landed prompt is cached
  // at admission.
  const double h0 = ReserveHits(c);
  const StreamResult got_a = c.Generate(a);
  ASSERT_TRUE(got_a.status.ok()) << got_a.status.error_message();
  EXPECT_EQ(got_a.tokens, off.a.tokens);
  const double w3 = WireBytes(c);
  EXPECT_DOUBLE_EQ(w3 - w2, 300 * row + kda);

  // b extends a: the decode worker holds a's full blocks, so only the rest of
  // b's rows (and the KDA state) are written.
  const StreamResult got_b = c.Generate(b);
  ASSERT_TRUE(got_b.status.ok()) << got_b.status.error_message() << c.Logs();
  EXPECT_EQ(got_b.tokens, off.b.tokens);
  const double w4 = WireBytes(c);
  const double held = NextReserveHits(c, h0) - h0;
  EXPECT_GT(held, 0) << c.Logs();
  EXPECT_LE(held, 300);
  EXPECT_GT(held, 300 - 64) << "a's full blocks were not all held";
  EXPECT_DOUBLE_EQ(w4 - w3, (400 - held) * row + kda);

  // Seeded: the same tokens as the cache off (the shared rows are bit-exact:
  // the checksums over every row passed).
  const StreamResult got_bs = c.Generate(b_seeded);
  ASSERT_TRUE(got_bs.status.ok()) << got_bs.status.error_message();
  EXPECT_EQ(got_bs.tokens, off.b_seeded.tokens);
  const double w5 = WireBytes(c);
  EXPECT_DOUBLE_EQ(w5 - w4, kda) << "b again: all 400 rows (25 blocks) are held";

  // Another tenant shares nothing.
  tandem::v1::GenerateRequest other = b;
  other.set_request_id("other-tenant");
  other.set_cache_salt("tenant-b");
  const double h1 = SettledReserveHits(c);
  EXPECT_EQ(h1 - h0, held + 400) << "b again holds all of its 400 tokens";
  const StreamResult got_o = c.Generate(other);
  ASSERT_TRUE(got_o.status.ok()) << got_o.status.error_message();
  EXPECT_EQ(got_o.tokens, off.b.tokens);
  EXPECT_DOUBLE_EQ(WireBytes(c) - w5, 400 * row + kda);
  EXPECT_EQ(SettledReserveHits(c), h1);

  // A router older than share_held_prefix sends the prompt's ids without it:
  // the decode worker, which holds all of b's blocks, shares none of them
  // (the prefill worker that router picks may write every row).
  {
    auto decode = tandem::v1::DecodeWorker::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(c.decode_port()),
                            grpc::InsecureChannelCredentials()));
    tandem::v1::ReserveRequest rr;
    rr.set_request_id("old-router");
    rr.set_prompt_tokens(b.prompt_token_ids().ids_size());
    rr.set_max_new_tokens(4);
    rr.set_lease_ms(30000);
    rr.set_prefill_tp_size(1);
    *rr.mutable_prompt_token_ids() = b.prompt_token_ids().ids();
    tandem::v1::KvTarget target;
    grpc::ClientContext ctx;
    ctx.set_deadline(testing::In(30));
    grpc::Status st = decode->Reserve(&ctx, rr, &target);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(target.cached_prefix_tokens(), 0);
    tandem::v1::ReleaseRequest rel;
    rel.set_request_id("old-router");
    tandem::v1::ReleaseResponse released;
    grpc::ClientContext rctx;
    rctx.set_deadline(testing::In(30));
    ASSERT_TRUE(decode->Release(&rctx, rel, &released).ok());
    EXPECT_TRUE(released.found());
  }
  EXPECT_EQ(SettledReserveHits(c), h1);

  // Rolling upgrade: a prefill worker that does not register
  // writes_after_held_prefix (as one older than the handshake, which would
  // write every row from 0 into the shared blocks) gets no sharing: the
  // router sends no prompt ids with the Reserve, so b's turn carries all 400
  // rows although the decode worker holds a's, and the tokens are the cache
  // off's.
  ProcessCluster old;
  ASSERT_EQ(old.Start(kRouterFlags, 4, {"--kv_write_after_held_prefix=false"}), "");
  const StreamResult old_a = old.Generate(a);
  ASSERT_TRUE(old_a.status.ok()) << old_a.status.error_message() << old.Logs();
  EXPECT_EQ(old_a.tokens, off.a.tokens);
  const double o0 = WireBytes(old);
  const StreamResult old_b = old.Generate(b);
  ASSERT_TRUE(old_b.status.ok()) << old_b.status.error_message() << old.Logs();
  EXPECT_EQ(old_b.tokens, off.b.tokens);
  EXPECT_DOUBLE_EQ(WireBytes(old) - o0, 400 * row + kda);
  const StreamResult old_bs = old.Generate(b_seeded);
  ASSERT_TRUE(old_bs.status.ok()) << old_bs.status.error_message();
  EXPECT_EQ(old_bs.tokens, off.b_seeded.tokens);
  EXPECT_DOUBLE_EQ(WireBytes(old) - o0, 2 * (400 * row + kda));
  EXPECT_EQ(SettledReserveHits(old), 0);
}

// Without checksums nothing that lands is cached: unverified rows would be
// shared with every later turn. The next turn then sends all its rows.
TEST(ClusterDecodeHitTest, UnverifiedStateIsNotCached) {
  ProcessCluster c;
  ASSERT_EQ(c.Start({"--colocate_below_tokens=0", "--kv_checksums=false"}, 4), "");
  const tandem::v1::GenerateRequest a = MakeRequest(300, 11, 2, 0.0f);
  tandem::v1::GenerateRequest b = Extend(a, 100, 5);
  b.set_request_id("b");
  ASSERT_TRUE(c.Generate(a).status.ok()) << c.Logs();
  const double w0 = WireBytes(c);
  ASSERT_TRUE(c.Generate(b).status.ok()) << c.Logs();
  const double w1 = WireBytes(c);
  ASSERT_TRUE(c.Generate(b).status.ok()) << c.Logs();
  // b twice: the same bytes both times (nothing of a or b was held).
  EXPECT_DOUBLE_EQ(WireBytes(c) - w1, w1 - w0);
  EXPECT_EQ(SettledReserveHits(c), 0);
}

}  // namespace
}  // namespace tandem
