// Drafting with a smaller model of the same architecture and tokenizer: its own
// ModelRunner, KvCache (MLA pages + KDA slots) and block/slot pools, one slot
// per drafted sequence.
//
//   Propose(batch)
//     → per sequence: sync the draft state with the committed history
//       (restore the snapshot / reset when it consumed rejected drafts)
//     → forward 0: the committed tokens the draft has not seen (>= 1, the
//       accepted drafts + the target's next token), logits of the last
//       → snapshot the KDA slot (state == committed history)
//       → draft d_0 (argmax, or drawn from q_0 with the request's seed)
//     → forwards 1..k-1: d_{j-1} → d_j (T = 1, all sequences in one batch)
//   OnAccepted(id, a, next)
//     → a >= k - 1: the consumed drafts d_0..d_{k-2} were all accepted, keep
//     → otherwise restore the snapshot (the MLA rows past it are overwritten
//       by the next forward; the block table keeps its reservation)
//
// Random drafts use the request's counter-based stream at the draft's output
// position with the plain-sampling tag (CounterUniform(seed, pos, kSample)),
// inverse CDF over q in id order: when the draft model IS the target, q == p and
// every draft equals what plain sampling would emit there, so all are accepted
// and speculation reproduces the non-speculative output (up to floating-point
// differences between the batched forms).
// Not thread-safe: the engine's thread owns it.
#ifndef TANDEM_ENGINE_RUNTIME_DRAFT_MODEL_PROPOSER_H_
#define TANDEM_ENGINE_RUNTIME_DRAFT_MODEL_PROPOSER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cache/block_allocator.h"
#include "engine/cache/block_table.h"
#include "engine/cache/slot_pool.h"
#include "engine/runtime/kv_cache.h"
#include "engine/runtime/model_runner.h"
#include "engine/runtime/weights.h"
#include "engine/sampling/sampler.h"
#include "engine/speculative/proposer.h"
#include "kernels/backend.h"

namespace tandem::engine {

struct DraftModelOptions {
  int32_t num_slots = 8;  // sequences drafted at once (the engine's slots)
  int32_t block_size = 16;
  // Tokens per sequence the draft cache holds (history + drafts); sequences
  // beyond it get no drafts.
  int64_t max_context_tokens = 4096;
  engine::MlaMode mla_mode = engine::MlaMode::kAuto;
  bool enforce_eager = false;  // no CUDA graphs for the draft's decode steps
};

class DraftModelProposer : public speculative::Proposer {
 public:
  // weights and backend are not owned and must outlive the proposer.
  // `target_vocab_size`: the draft must share the target's vocabulary.
  static absl::StatusOr<std::unique_ptr<DraftModelProposer>> Create(
      const engine::ModelWeights* weights, kernels::Backend* backend,
      int64_t target_vocab_size, const DraftModelOptions& options);

  absl::Status Propose(absl::Span<const speculative::ProposeRequest> requests,
                       std::vector<speculative::Proposal>* proposals) override;
  void OnAccepted(int64_t id, int32_t num_accepted, int32_t next_token) override;
  void Release(int64_t id) override;
  absl::string_view name() const override { return "draft"; }

  // Introspection (tests): sequences with draft state, free pools, the cache.
  int num_sequences() const { return static_cast<int>(seqs_.size()); }
  int32_t num_free_slots() const { return slots_.num_free(); }
  int32_t num_free_blocks() const { return blocks_.num_free(); }
  int64_t forward_passes() const { return forward_passes_; }
  engine::KvCache& cache() { return *cache_; }

 private:
  struct Seq {
    engine::SlotId slot = -1;
    engine::BlockTable table;
    // Tokens whose state the slot and the MLA rows hold (positions 0..n-1).
    std::vector<int32_t> cached;
    // The KDA slot after cached[0..snapshot_len) (taken at the last proposal).
    engine::KdaSnapshot snapshot;
    int64_t snapshot_len = -1;
    int32_t last_drafts = 0;  // drafts in the last proposal
  };

  DraftModelProposer(const engine::ModelWeights* weights, const DraftModelOptions& o);
  absl::StatusOr<Seq*> GetOrCreate(int64_t id);
  // Rolls the draft state back to the longest prefix of `tokens` it can
  // reproduce (the snapshot, or nothing); always leaves >= 1 token to feed.
  absl::Status Sync(Seq* s, absl::Span<const int32_t> tokens);

  const engine::ModelWeights* weights_;  // not owned
  DraftModelOptions options_;
  std::unique_ptr<engine::KvCache> cache_;
  std::unique_ptr<engine::ModelRunner> runner_;
  std::unique_ptr<engine::Sampler> sampler_;
  engine::BlockAllocator blocks_;
  engine::SlotPool slots_;
  absl::flat_hash_map<int64_t, std::unique_ptr<Seq>> seqs_;
  int64_t forward_passes_ = 0;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_DRAFT_MODEL_PROPOSER_H_
