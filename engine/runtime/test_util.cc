#include "engine/runtime/test_util.h"

#include <cstdlib>
#include <iostream>
#include <numeric>

#include "kernels/backend_factory.h"

namespace tandem::engine::testing {
namespace {

template <typename T>
T OrDie(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::cerr << what << ": " << v.status() << "\n";
    std::abort();
  }
  return std::move(v).value();
}

}  // namespace

const ModelWeights& TinyWeights() {
  // Process-lifetime, held by one static pointer so that LeakSanitizer sees both
  // the checkpoint and its weight views as reachable.
  struct Tiny {
    std::unique_ptr<model::Checkpoint> checkpoint;
    std::unique_ptr<ModelWeights> weights;
  };
  static const Tiny* tiny = [] {
    auto* t = new Tiny;
    t->checkpoint = OrDie(model::Checkpoint::Open(kTinyCheckpointDir), "open tiny");
    t->weights = OrDie(LoadModelWeights(*t->checkpoint), "load weights");
    return t;
  }();
  return *tiny->weights;
}

std::unique_ptr<ModelWeights> TinyWeightsOn(kernels::Backend& backend) {
  static const model::Checkpoint* checkpoint =
      OrDie(model::Checkpoint::Open(kTinyCheckpointDir), "open tiny").release();
  return OrDie(PlaceModelWeights(OrDie(LoadModelWeights(*checkpoint), "load weights"),
                                 backend.device()),
               "place weights");
}

std::unique_ptr<KvCache> MakeCacheOn(const ModelWeights& w, kernels::Backend& backend,
                                     int64_t blocks, int64_t block_size,
                                     int64_t slots) {
  KvCacheOptions o;
  o.num_blocks = blocks;
  o.block_size = block_size;
  o.num_slots = slots;
  o.device = &backend.device();
  return OrDie(KvCache::Create(w.config, o), "cache");
}

std::unique_ptr<kernels::Backend> MakeBackend(const char* name) {
  return OrDie(kernels::CreateBackend(name), "backend");
}

std::unique_ptr<KvCache> MakeCache(const ModelWeights& w, int64_t blocks,
                                   int64_t block_size, int64_t slots) {
  KvCacheOptions o;
  o.num_blocks = blocks;
  o.block_size = block_size;
  o.num_slots = slots;
  return OrDie(KvCache::Create(w.config, o), "cache");
}

std::vector<int32_t> BlockRange(int32_t first, int32_t count) {
  std::vector<int32_t> v(count);
  std::iota(v.begin(), v.end(), first);
  return v;
}

absl::Status Feed(ModelRunner* runner, TestSequence* seq,
                  absl::Span<const int32_t> tokens, bool all_logits,
                  std::vector<float>* logits) {
  SequenceInput in;
  in.tokens = tokens;
  in.start_pos = seq->pos;
  in.block_table = seq->blocks;
  in.kda_slot = seq->slot;
  if (all_logits) {
    for (size_t i = 0; i < tokens.size(); ++i) in.logits_indices.push_back(i);
  } else {
    in.logits_indices.push_back(static_cast<int32_t>(tokens.size()) - 1);
  }
  absl::Status s = runner->Forward({&in, 1}, logits);
  if (s.ok()) seq->pos += tokens.size();
  return s;
}

int32_t Argmax(absl::Span<const float> row) {
  int32_t best = 0;
  for (size_t i = 1; i < row.size(); ++i) {
    if (row[i] > row[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

absl::StatusOr<std::vector<int32_t>> GreedyGenerate(ModelRunner* runner,
                                                    TestSequence* seq,
                                                    absl::Span<const int32_t> prompt,
                                                    int64_t chunk, int steps) {
  const int64_t V = runner->weights().config.text.vocab_size;
  std::vector<float> logits;
  for (size_t i = 0; i < prompt.size(); i += chunk) {
    const size_t n = std::min<size_t>(chunk, prompt.size() - i);
    absl::Status s = Feed(runner, seq, prompt.subspan(i, n), false, &logits);
    if (!s.ok()) return s;
  }
  std::vector<int32_t> out;
  for (int step = 0; step < steps; ++step) {
    const int32_t next = Argmax(absl::MakeConstSpan(logits).subspan(0, V));
    out.push_back(next);
    if (step + 1 == steps) break;
    absl::Status s = Feed(runner, seq, {&out.back(), 1}, false, &logits);
    if (!s.ok()) return s;
  }
  return out;
}

std::vector<int32_t> MakePrompt(int n, uint64_t seed) {
  std::vector<int32_t> p(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 12345;
  for (int i = 0; i < n; ++i) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    p[i] = static_cast<int32_t>((x * 0x2545F4914F6CDD1Dull) >> 33) % 100000;
  }
  return p;
}

}  // namespace tandem::engine::testing
