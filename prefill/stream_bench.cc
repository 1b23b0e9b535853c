// Layer-by-layer KV streaming vs whole-state transfer after the prefill, in one
// process: two prefill services (--kv_stream_layers on and off) over the same
// model, each with its own UCX agent (the prefill worker's default UcxAgent
// configuration), writing into a receiver UCX agent's landing cache (another
// block size, as a decode worker's). For each prompt length the two modes run
// alternately (--repeats times) and the bench reports medians of:
//   prefill latency  the Prefill RPC as the router sees it (compute + exposed
//                    transfer + notify): the prefill part of TTFT
//   compute          PrefillResponse.prefill_seconds
//   exposed          tandem_worker_exposed_transfer_seconds: transfer time left
//                    after the compute ended (first token sampled → last byte)
//   transfer         TransferStats.seconds (first post → last byte)
// and the on/off ratios, every landed state checked against the sender's
// checksums. Ends with one JSON line {"bench":"kv_stream",...}.
//
//   stream_bench --model=DIR [--prompt_lens=2048,4096,8192] [--repeats=3]
//                [--max_tokens_per_step=256] [--ucx_tls=]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/init.h"
#include "common/logging.h"
#include "common/status.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/ucx_agent.h"
#include "metrics/registry.h"
#include "nlohmann/json.hpp"
#include "prefill/prefill_service.h"
#include "worker/cache_layout.h"
#include "worker/engine_loop.h"
#include "worker/worker_metrics.h"
#include "worker/worker_model.h"

ABSL_FLAG(std::string, model, "", "Checkpoint directory (e.g. the tiny checkpoint).");
ABSL_FLAG(std::string, prompt_lens, "2048,4096,8192", "Prompt lengths (tokens).");
ABSL_FLAG(int, repeats, 3, "Runs per length and mode (alternating modes).");
ABSL_FLAG(int64_t, max_tokens_per_step, 256, "Engine token budget per step (chunk).");
ABSL_FLAG(int, block_size, 16, "Prefill engine block size.");
ABSL_FLAG(int, landing_block_size, 64, "Receiver block size.");
ABSL_FLAG(std::string, ucx_tls, "", "UCX transports (empty: the workers' default).");

namespace tandem {
namespace {

struct Sender {
  std::unique_ptr<worker::WorkerModel> model;
  std::unique_ptr<kvtransfer::UcxAgent> agent;
  metrics::Registry registry;
  std::unique_ptr<worker::WorkerMetrics> metrics;
  std::unique_ptr<worker::EngineLoop> loop;
  std::unique_ptr<prefill::PrefillService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<tandem::v1::PrefillWorker::Stub> stub;
  ~Sender() {
    if (server) server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    loop.reset();
    service.reset();
  }
};

absl::StatusOr<std::unique_ptr<Sender>> MakeSender(bool stream, int64_t max_len) {
  auto s = std::make_unique<Sender>();
  TANDEM_ASSIGN_OR_RETURN(
      s->model, worker::LoadWorkerModel(absl::GetFlag(FLAGS_model), "cpu", ""));
  engine::EngineOptions eo;
  eo.block_size = absl::GetFlag(FLAGS_block_size);
  eo.num_slots = 2;
  eo.max_context_tokens = max_len + 16;
  eo.max_tokens_per_step = absl::GetFlag(FLAGS_max_tokens_per_step);
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<engine::Engine> engine,
                          worker::MakeEngine(s->model.get(), eo));
  engine::KvCache* cache = &engine->cache();
  kvtransfer::UcxAgentConfig uc;
  uc.tls = absl::GetFlag(FLAGS_ucx_tls);
  uc.name = stream ? "bench-stream" : "bench-whole";
  TANDEM_ASSIGN_OR_RETURN(s->agent, kvtransfer::UcxAgent::Create(uc));
  s->metrics = std::make_unique<worker::WorkerMetrics>(&s->registry);
  s->loop = std::make_unique<worker::EngineLoop>(std::move(engine));
  prefill::PrefillServiceOptions po;
  po.stream_layers = stream;
  TANDEM_ASSIGN_OR_RETURN(
      s->service, prefill::PrefillService::Create(s->loop.get(), cache, s->agent.get(),
                                                  s->metrics.get(), po));
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(s->service.get());
  s->server = b.BuildAndStart();
  s->stub = tandem::v1::PrefillWorker::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  return s;
}

struct Sample {
  double latency = 0, compute = 0, exposed = 0, transfer = 0;
  int64_t bytes = 0;
  double batches = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Main() {
  std::vector<int64_t> lens;
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_prompt_lens), ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(p, &n) || n < 1) {
      std::fprintf(stderr, "bad --prompt_lens entry '%s'\n", std::string(p).c_str());
      return 2;
    }
    lens.push_back(n);
  }
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  auto on = MakeSender(true, max_len);
  auto off = MakeSender(false, max_len);
  if (!on.ok() || !off.ok()) {
    std::fprintf(stderr, "setup failed: %s %s\n", on.status().ToString().c_str(),
                 off.status().ToString().c_str());
    return 1;
  }
  // The receiver: a landing cache registered with its own UCX agent.
  kvtransfer::UcxAgentConfig rc;
  rc.tls = absl::GetFlag(FLAGS_ucx_tls);
  rc.name = "bench-receiver";
  auto receiver = kvtransfer::UcxAgent::Create(rc);
  if (!receiver.ok()) {
    std::fprintf(stderr, "receiver: %s\n", receiver.status().ToString().c_str());
    return 1;
  }
  const int lbs = absl::GetFlag(FLAGS_landing_block_size);
  engine::KvCacheOptions lo;
  lo.block_size = lbs;
  lo.num_blocks = (max_len + lbs - 1) / lbs + 1;
  lo.num_slots = 1;
  auto landing = engine::KvCache::Create((*on)->model->weights->config, lo);
  if (!landing.ok()) return 1;
  auto regions = worker::RegisterCache(receiver->get(), landing->get());
  if (!regions.ok()) return 1;
  const kvtransfer::RankLayout pools =
      worker::CacheRankLayout(**landing, *regions, {}, 0);
  const std::string descriptor =
      *(*receiver)->LocalDescriptor(worker::PoolsMetadata(pools));

  std::printf(
      "kv_stream bench: tiny-model prefill, chunks of %ld tokens, UCX tls '%s'\n",
      static_cast<long>(absl::GetFlag(FLAGS_max_tokens_per_step)),
      absl::GetFlag(FLAGS_ucx_tls).c_str());
  std::printf("%7s %6s %12s %10s %12s %12s %10s %9s\n", "tokens", "mode", "prefill_ms",
              "compute_ms", "exposed_ms", "transfer_ms", "MB", "batches");
  nlohmann::json rows = nlohmann::json::array();
  int run = 0;
  bool all_exact = true;
  for (int64_t n : lens) {
    std::vector<Sample> samples[2];  // 0 off, 1 on
    for (int rep = 0; rep < absl::GetFlag(FLAGS_repeats); ++rep) {
      for (int mode : {rep % 2, 1 - rep % 2}) {  // alternate which goes first
        Sender& s = mode == 1 ? **on : **off;
        tandem::v1::PrefillRequest req;
        req.set_request_id("bench-" + std::to_string(run++));
        for (int64_t i = 0; i < n; ++i) {
          req.add_prompt_token_ids(
              static_cast<int32_t>((i * 7919 + run * 31) % 100000));
        }
        req.mutable_sampling()->set_temperature(0);
        req.set_checksums(true);
        tandem::v1::RankTarget* t = req.mutable_target()->add_ranks();
        t->set_transfer_descriptor(descriptor);
        t->set_transfer_address("in-process");
        for (int64_t b = 0; b < (n + lbs - 1) / lbs; ++b) t->add_block_ids(b);
        t->set_state_slot(0);
        *t->mutable_layout() = worker::KvLayoutOf(**landing);
        const double exposed0 = s.metrics->exposed_transfer_seconds->Sum();
        const double batches0 = s.metrics->transfer_batches->Value();
        grpc::ClientContext ctx;
        ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(600)));
        tandem::v1::PrefillResponse resp;
        const absl::Time t0 = absl::Now();
        grpc::Status st = s.stub->Prefill(&ctx, req, &resp);
        const double latency = absl::ToDoubleSeconds(absl::Now() - t0);
        if (!st.ok()) {
          std::fprintf(stderr, "prefill of %ld tokens failed: %s\n",
                       static_cast<long>(n), st.error_message().c_str());
          return 1;
        }
        std::vector<int32_t> blocks(t->block_ids().begin(), t->block_ids().end());
        auto landed = kvtransfer::ComputeChecksums(
            worker::CacheRankLayout(**landing, *regions, blocks, 0), n,
            worker::CacheRegionBytes(landing->get(), *regions));
        if (!landed.ok() || !kvtransfer::Verify(resp.checksums(), *landed).ok()) {
          all_exact = false;
          std::fprintf(stderr, "landed state differs (%ld tokens, mode %d)\n",
                       static_cast<long>(n), mode);
        }
        Sample x;
        x.latency = latency;
        x.compute = resp.prefill_seconds();
        x.exposed = s.metrics->exposed_transfer_seconds->Sum() - exposed0;
        x.transfer = resp.transfer().seconds();
        x.bytes = resp.transfer().bytes();
        x.batches = s.metrics->transfer_batches->Value() - batches0;
        samples[mode].push_back(x);
      }
    }
    double med[2][4];
    for (int mode : {0, 1}) {
      std::vector<double> l, c, e, tr;
      for (const Sample& x : samples[mode]) {
        l.push_back(x.latency);
        c.push_back(x.compute);
        e.push_back(x.exposed);
        tr.push_back(x.transfer);
      }
      med[mode][0] = Median(l);
      med[mode][1] = Median(c);
      med[mode][2] = Median(e);
      med[mode][3] = Median(tr);
      std::printf("%7ld %6s %12.2f %10.2f %12.3f %12.3f %10.2f %9.0f\n",
                  static_cast<long>(n), mode ? "stream" : "whole", med[mode][0] * 1e3,
                  med[mode][1] * 1e3, med[mode][2] * 1e3, med[mode][3] * 1e3,
                  samples[mode].back().bytes / 1e6, samples[mode].back().batches);
    }
    const double exposed_ratio = med[0][2] > 0 ? med[1][2] / med[0][2] : 0;
    const double latency_ratio = med[0][0] > 0 ? med[1][0] / med[0][0] : 0;
    std::printf("%7ld  stream/whole: exposed %.3fx, prefill latency %.3fx\n",
                static_cast<long>(n), exposed_ratio, latency_ratio);
    rows.push_back({{"tokens", n},
                    {"whole_prefill_ms", med[0][0] * 1e3},
                    {"stream_prefill_ms", med[1][0] * 1e3},
                    {"whole_exposed_ms", med[0][2] * 1e3},
                    {"stream_exposed_ms", med[1][2] * 1e3},
                    {"whole_transfer_ms", med[0][3] * 1e3},
                    {"stream_transfer_ms", med[1][3] * 1e3},
                    {"exposed_ratio", exposed_ratio},
                    {"prefill_latency_ratio", latency_ratio},
                    {"bytes", samples[1].back().bytes}});
  }
  nlohmann::json j = {{"bench", "kv_stream"},
                      {"max_tokens_per_step", absl::GetFlag(FLAGS_max_tokens_per_step)},
                      {"ucx_tls", absl::GetFlag(FLAGS_ucx_tls)},
                      {"bit_exact", all_exact},
                      {"lengths", rows}};
  std::printf("%s\n", j.dump().c_str());
  on->reset();
  off->reset();
  return all_exact ? 0 : 1;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "stream_bench",
                      "Layer-by-layer KV streaming vs whole-state transfer.\n"
                      "usage: stream_bench --model=DIR [--prompt_lens=2048,4096,8192]");
  return tandem::Main();
}
