// ./tandem project: Kimi K3 (the published config, engine/model/testdata) on a
// node of 8 GPUs, projected from vendor figures and, where given, a GPU
// measurement (engine_bench --backend cuda's JSON line, or the GPU check's
// results.json). Prints a labelled table and ends with one JSON line.
//
//   projection_main [--hardware b300] [--tp 8] [--measured FILE --measured_on h200]
//                   [--config config.json] [--batches 1,8,32,64]
//                   [--contexts 4096,...] [--activation_peak 8GiB] ...
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/init.h"
#include "common/status.h"
#include "engine/cache/memory_budget.h"
#include "engine/runtime/projection.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, config, "",
          "The model's config.json (default: Kimi K3's published config, "
          "engine/model/testdata/kimi_k3_config.json)");
ABSL_FLAG(std::string, hardware, "b300", "The GPU projected to: b300, h200, h100");
ABSL_FLAG(int32_t, tp, 8, "Tensor-parallel size (GPUs of one node)");
ABSL_FLAG(std::string, measured, "",
          "A GPU measurement: engine_bench --backend cuda's JSON line, or the GPU "
          "check's results.json (its engine_mid run, else the first engine run)");
ABSL_FLAG(std::string, measured_on, "",
          "The GPU the measurement ran on (h200, h100, b300): its datasheet "
          "bandwidth turns the measured copy bandwidth into a share");
ABSL_FLAG(std::string, batches, "1,8,32,64", "Decode batch sizes");
ABSL_FLAG(std::string, contexts, "4096,32768,131072,1048576",
          "Tokens in each sequence's cache");
ABSL_FLAG(std::string, handoff_prompts, "4096,32768,131072,1048576",
          "Prompt lengths of the hand-off rows");
ABSL_FLAG(std::string, activation_peak, "8GiB",
          "Per GPU: what a profiling forward would add (not measurable here; assumed)");
ABSL_FLAG(double, gpu_memory_utilization, 0.9, "As the workers' flag");
ABSL_FLAG(double, collective_latency_us, 10.0,
          "One collective's fixed cost, microseconds (assumed)");
ABSL_FLAG(int64_t, prefill_chunk, 8192,
          "Prefill step budget in tokens (the workers' default on a GPU of >= 70 GiB)");
ABSL_FLAG(std::string, backend, "cuda",
          "GPU backend of the prefill: cuda (the default; split-BF16 operands: 2 mma "
          "a matrix product, 3 an attention one) or cuda_bf16 (1 and 1)");
ABSL_FLAG(double, prefill_efficiency, 0.4,
          "Share of the dense BF16 tensor rate the prefill kernels reach (assumed)");
ABSL_FLAG(double, network_gbps, 0,
          "The node's network, Gbit/s (0: the hardware profile's)");

namespace {

using tandem::engine::Projection;
using tandem::engine::ProjectionInput;

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "project: %s\n", std::string(s.message()).c_str());
  return 1;
}

absl::StatusOr<std::vector<int64_t>> ParseList(const std::string& flag,
                                               const std::string& text) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v <= 0) {
      return tandem::InvalidArgument("--", flag, ": \"", part,
                                     "\" is not a positive integer");
    }
    out.push_back(v);
  }
  if (out.empty()) return tandem::InvalidArgument("--", flag, " is empty");
  return out;
}

// The engine_bench JSON object in `path`: the file itself, or a GPU check's
// results.json holding them under "engine" (engine_mid preferred: the mid
// checkpoint's step streams enough bytes to be bandwidth-bound).
absl::StatusOr<nlohmann::json> ReadMeasurement(const std::string& path) {
  std::ifstream in(path);
  if (!in) return tandem::NotFound("--measured: cannot read ", path);
  std::stringstream text;
  text << in.rdbuf();
  // A log may hold several lines; the measurement is the last JSON object.
  nlohmann::json doc;
  std::string line, last;
  std::istringstream lines(text.str());
  bool parsed = false;
  try {
    doc = nlohmann::json::parse(text.str());
    parsed = true;
  } catch (const nlohmann::json::exception&) {
  }
  if (!parsed) {
    while (std::getline(lines, line)) {
      if (!line.empty() && line.front() == '{') last = line;
    }
    try {
      doc = nlohmann::json::parse(last);
    } catch (const nlohmann::json::exception& e) {
      return tandem::InvalidArgument("--measured: ", path, " holds no JSON object (",
                                     e.what(), ")");
    }
  }
  if (doc.is_object() && doc.contains("engine") && doc["engine"].is_object()) {
    const nlohmann::json& engine = doc["engine"];
    if (engine.contains("engine_mid")) return engine["engine_mid"];
    for (const auto& [name, run] : engine.items()) {
      if (run.is_object() && run.contains("results")) return run;
    }
    return tandem::InvalidArgument("--measured: ", path,
                                   " has no engine run with results");
  }
  if (!doc.is_object() || !doc.contains("results") || !doc["results"].is_array()) {
    return tandem::InvalidArgument(
        "--measured: ", path,
        " is neither engine_bench's JSON line nor a GPU check's results.json");
  }
  return doc;
}

// Decimal units, as the vendors give memory and bandwidth (FormatBytes prints
// binary ones).
std::string Bytes(double b) {
  char buf[64];
  if (b >= 1e12) {
    std::snprintf(buf, sizeof(buf), "%.2f TB", b / 1e12);
  } else if (b >= 1e9) {
    std::snprintf(buf, sizeof(buf), "%.2f GB", b / 1e9);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f MB", b / 1e6);
  }
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(
      argc, argv, "project",
      "Usage: project [--hardware b300] [--tp 8] [--measured FILE --measured_on h200]\n"
      "Kimi K3 on a node of GPUs, projected from the published config, the vendor's "
      "figures and, where given, a GPU measurement. Not a measurement.");
  std::string config_path = absl::GetFlag(FLAGS_config);
  if (config_path.empty()) {
    // Next to the binary (bazel-bin), else from the working directory (a test's
    // runfiles, the GPU bundle's runfiles/).
    config_path = std::string(argv[0]) +
                  ".runfiles/tandem/engine/model/testdata/kimi_k3_config.json";
    if (!std::ifstream(config_path)) {
      config_path = "engine/model/testdata/kimi_k3_config.json";
    }
  }
  absl::StatusOr<tandem::model::ModelConfig> config =
      tandem::model::LoadModelConfig(config_path);
  if (!config.ok()) return Fail(config.status());
  absl::StatusOr<tandem::engine::HardwareProfile> hw =
      tandem::engine::FindHardware(absl::GetFlag(FLAGS_hardware));
  if (!hw.ok()) return Fail(hw.status());
  ProjectionInput in;
  in.config = *config;
  in.tp = absl::GetFlag(FLAGS_tp);
  in.hardware = *hw;
  if (absl::GetFlag(FLAGS_network_gbps) < 0) {
    return Fail(tandem::InvalidArgument("--network_gbps must not be negative"));
  }
  if (absl::GetFlag(FLAGS_network_gbps) > 0) {
    in.hardware.network_bandwidth = absl::GetFlag(FLAGS_network_gbps) * 1e9 / 8;
  }
  in.gpu_memory_utilization = absl::GetFlag(FLAGS_gpu_memory_utilization);
  in.collective_latency_s = absl::GetFlag(FLAGS_collective_latency_us) * 1e-6;
  in.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  in.prefill_efficiency = absl::GetFlag(FLAGS_prefill_efficiency);
  in.backend = absl::GetFlag(FLAGS_backend);
  auto peak = tandem::engine::ParseMemoryBudget(absl::GetFlag(FLAGS_activation_peak));
  if (!peak.ok() || peak->is_fraction()) {
    return Fail(tandem::InvalidArgument("--activation_peak: give bytes, like 8GiB"));
  }
  in.activation_peak_bytes = peak->bytes;
  {
    auto batches = ParseList("batches", absl::GetFlag(FLAGS_batches));
    if (!batches.ok()) return Fail(batches.status());
    in.batches = *batches;
    auto contexts = ParseList("contexts", absl::GetFlag(FLAGS_contexts));
    if (!contexts.ok()) return Fail(contexts.status());
    in.contexts = *contexts;
    auto prompts = ParseList("handoff_prompts", absl::GetFlag(FLAGS_handoff_prompts));
    if (!prompts.ok()) return Fail(prompts.status());
    in.handoff_prompts = *prompts;
  }

  nlohmann::json measured_json;
  if (!absl::GetFlag(FLAGS_measured).empty()) {
    if (absl::GetFlag(FLAGS_measured_on).empty()) {
      return Fail(tandem::InvalidArgument(
          "--measured needs --measured_on (the GPU it ran on: h200, h100, b300)"));
    }
    auto on = tandem::engine::FindHardware(absl::GetFlag(FLAGS_measured_on));
    if (!on.ok()) return Fail(on.status());
    auto m = ReadMeasurement(absl::GetFlag(FLAGS_measured));
    if (!m.ok()) return Fail(m.status());
    const double copy_gbs = m->value("copy_bandwidth_gb_per_s", 0.0);
    if (!(copy_gbs > 0)) {
      return Fail(tandem::InvalidArgument(
          "--measured: no copy_bandwidth_gb_per_s in the measurement"));
    }
    if (m->value("backend", std::string()) != "cuda" &&
        m->value("backend", std::string()) != "cuda_bf16") {
      return Fail(tandem::InvalidArgument(
          "--measured: the measurement ran on backend \"",
          m->value("backend", std::string("?")),
          "\"; a projection to a GPU takes a GPU's (engine_bench --backend cuda)"));
    }
    in.bandwidth_share = copy_gbs * 1e9 / on->memory_bandwidth;
    for (const nlohmann::json& r : (*m)["results"]) {
      if (r.contains("batch") && r.contains("decode_bandwidth_efficiency")) {
        in.efficiency_by_batch[r["batch"].get<int64_t>()] =
            r["decode_bandwidth_efficiency"].get<double>();
      }
    }
    if (in.efficiency_by_batch.empty()) {
      return Fail(tandem::InvalidArgument(
          "--measured: no result carries batch and decode_bandwidth_efficiency"));
    }
    in.efficiency_source = "measured on " + on->name + " (" +
                           m->value("model", std::string("?")) + "): copy " +
                           std::to_string(copy_gbs) + " GB/s";
    measured_json = *m;
  }

  absl::StatusOr<Projection> p = tandem::engine::Project(in);
  if (!p.ok()) return Fail(p.status());

  std::printf("PROJECTION, not a measurement: %s on %s, TP %d\n",
              config->model_type.c_str(), hw->description.c_str(), in.tp);
  std::printf("  hardware figures: %s\n", hw->source.c_str());
  std::printf("  decode efficiency: %s\n", in.efficiency_source.c_str());
  std::printf("weights: %s in all; the largest rank holds %s (%.1f%% of its %s)\n",
              Bytes(p->total_weight_bytes).c_str(), Bytes(p->max_rank_bytes).c_str(),
              100.0 * p->max_rank_bytes / hw->memory_bytes,
              Bytes(hw->memory_bytes).c_str());
  std::printf("cache (the workers' sizing, activation peak %s assumed): %s\n",
              Bytes(in.activation_peak_bytes).c_str(), p->cache.Summary().c_str());
  std::printf("\ndecode step per rank (%d collectives per step)\n",
              p->collectives_per_step);
  std::printf("%6s %9s %10s %10s %10s %10s %9s %9s %9s %11s %5s\n", "batch", "context",
              "dense", "experts", "mla", "kda", "bound_ms", "coll_ms", "step_ms",
              "tokens/s", "fits");
  for (const auto& d : p->decode) {
    std::printf("%6lld %9lld %10s %10s %10s %10s %9.3f %9.3f %9.3f %11.1f %5s\n",
                static_cast<long long>(d.batch), static_cast<long long>(d.context),
                Bytes(d.bytes.dense).c_str(), Bytes(d.bytes.experts).c_str(),
                Bytes(d.bytes.mla_cache).c_str(), Bytes(d.bytes.kda_state).c_str(),
                d.roofline_s * 1e3, d.collectives_s * 1e3, d.step_s * 1e3,
                d.tokens_per_s, d.fits ? "yes" : "no");
  }
  std::printf(
      "\nKV hand-off per request (rank r to rank r; network %.0f GB/s per node, "
      "link %.0f GB/s per GPU)\n",
      in.hardware.network_bandwidth / 1e9, in.hardware.link_bandwidth / 1e9);
  std::printf("%9s %12s %12s %11s %11s %9s\n", "prompt", "sent", "latent_once",
              "network_s", "once_s", "link_s");
  for (const auto& h : p->handoff) {
    std::printf("%9lld %12s %12s %11.3f %11.3f %9.3f\n",
                static_cast<long long>(h.prompt_tokens), Bytes(h.bytes_sent).c_str(),
                Bytes(h.bytes_latent_once).c_str(), h.network_s,
                h.network_latent_once_s, h.link_s);
  }

  const tandem::engine::TensorWork work = *tandem::engine::TensorWorkOf(in.backend);
  std::printf(
      "\nprefill per prompt on %s (chunks of %lld tokens; per rank; %d mma a matrix "
      "product, %d an attention one; the BF16 rate at %.2f assumed)\n",
      in.backend.c_str(), static_cast<long long>(in.prefill_chunk), work.matrix,
      work.attention, in.prefill_efficiency);
  std::printf("%9s %7s %12s %12s %12s %12s %9s %9s %11s\n", "prompt", "chunks",
              "matrix", "attention", "tensor", "weights", "bound_s", "time_s",
              "tokens/s");
  for (const auto& f : p->prefill) {
    std::printf(
        "%9lld %7lld %9.1f TF %9.1f TF %9.1f TF %12s %9.3f %9.3f %11.0f\n",
        static_cast<long long>(f.prompt_tokens), static_cast<long long>(f.chunks),
        f.matrix_flops / 1e12, f.attention_flops / 1e12, f.tensor_flops / 1e12,
        Bytes(f.weight_bytes).c_str(), f.bound_s, f.at_efficiency_s, f.tokens_per_s);
  }

  nlohmann::json out;
  out["bench"] = "projection";
  out["projection"] = true;  // not a measurement
  out["model_type"] = config->model_type;
  out["hardware"] = hw->name;
  out["hardware_source"] = hw->source;
  out["tp"] = in.tp;
  out["efficiency_source"] = in.efficiency_source;
  out["bandwidth_share"] = in.bandwidth_share;
  out["activation_peak_bytes_assumed"] = in.activation_peak_bytes;
  out["collective_latency_us_assumed"] = in.collective_latency_s * 1e6;
  out["total_weight_bytes"] = p->total_weight_bytes;
  out["max_rank_weight_bytes"] = p->max_rank_bytes;
  out["cache"] = {{"num_blocks", p->cache.num_blocks},
                  {"cache_tokens", p->cache.cache_tokens},
                  {"num_slots", p->cache.num_slots},
                  {"num_snapshots", p->cache.num_snapshots},
                  {"max_model_len", p->cache.max_model_len},
                  {"budget_per_device_bytes", p->memory.budget_per_device_bytes}};
  out["collectives_per_step"] = p->collectives_per_step;
  for (const auto& d : p->decode) {
    out["decode"].push_back({{"batch", d.batch},
                             {"context", d.context},
                             {"bytes_per_rank", d.bytes.total()},
                             {"experts_touched_per_layer", d.bytes.experts_touched},
                             {"roofline_ms", d.roofline_s * 1e3},
                             {"efficiency", d.efficiency},
                             {"collectives_ms", d.collectives_s * 1e3},
                             {"step_ms", d.step_s * 1e3},
                             {"tokens_per_s", d.tokens_per_s},
                             {"fits", d.fits}});
  }
  for (const auto& h : p->handoff) {
    out["handoff"].push_back({{"prompt_tokens", h.prompt_tokens},
                              {"bytes_sent", h.bytes_sent},
                              {"bytes_latent_once", h.bytes_latent_once},
                              {"network_s", h.network_s},
                              {"network_latent_once_s", h.network_latent_once_s},
                              {"link_s", h.link_s}});
  }
  out["prefill_chunk"] = in.prefill_chunk;
  out["prefill_efficiency_assumed"] = in.prefill_efficiency;
  out["backend"] = in.backend;
  out["mma_per_product"] = {{"matrix", work.matrix}, {"attention", work.attention}};
  for (const auto& f : p->prefill) {
    out["prefill"].push_back({{"prompt_tokens", f.prompt_tokens},
                              {"chunks", f.chunks},
                              {"matrix_flops", f.matrix_flops},
                              {"attention_flops", f.attention_flops},
                              {"tensor_flops", f.tensor_flops},
                              {"weight_bytes", f.weight_bytes},
                              {"bound_s", f.bound_s},
                              {"time_s", f.at_efficiency_s},
                              {"tokens_per_s", f.tokens_per_s}});
  }
  std::cout << out.dump() << "\n";
  return 0;
}
