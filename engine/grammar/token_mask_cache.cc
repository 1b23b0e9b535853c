#include "engine/grammar/token_mask_cache.h"

#include <algorithm>

namespace tandem::grammar {

void MaskEntry::OrAccepted(const TokenVocabulary& vocab, absl::Span<uint32_t> mask,
                           bool overwrite) const {
  if (overwrite && form == Form::kBitset) {
    std::copy(bits.begin(), bits.end(), mask.begin());
    return;
  }
  switch (form) {
    case Form::kAcceptedList:
      for (int32_t id : ids) mask[id >> 5] |= 1u << (id & 31);
      break;
    case Form::kBitset:
      for (size_t w = 0; w < bits.size(); ++w) mask[w] |= bits[w];
      break;
    case Form::kRejectedList: {
      // Everything matchable except the rejected and the uncertain ids.
      const std::vector<uint32_t>& all = vocab.matchable_mask();
      if (overwrite) {
        std::copy(all.begin(), all.end(), mask.begin());
        for (int32_t id : ids) mask[id >> 5] &= ~(1u << (id & 31));
        for (int32_t id : uncertain) mask[id >> 5] &= ~(1u << (id & 31));
        break;
      }
      std::vector<uint32_t> local(all);
      for (int32_t id : ids) local[id >> 5] &= ~(1u << (id & 31));
      for (int32_t id : uncertain) local[id >> 5] &= ~(1u << (id & 31));
      for (size_t w = 0; w < local.size(); ++w) mask[w] |= local[w];
      break;
    }
  }
}

TokenMaskCache::TokenMaskCache(const Pda* pda, const TokenVocabulary* vocab)
    : pda_(pda),
      vocab_(vocab),
      num_keys_(pda->automaton().num_mask_keys),
      entries_(new std::atomic<MaskEntry*>[2 * std::max(num_keys_, 1)]) {
  for (int32_t i = 0; i < 2 * num_keys_; ++i) entries_[i].store(nullptr);
}

TokenMaskCache::~TokenMaskCache() {
  for (int32_t i = 0; i < 2 * num_keys_; ++i) delete entries_[i].load();
}

const MaskEntry& TokenMaskCache::Get(int32_t position, int32_t state,
                                     bool at_root) const {
  const int32_t key =
      2 * (pda_->automaton().mask_key_base[position] + state) + (at_root ? 1 : 0);
  MaskEntry* e = entries_[key].load(std::memory_order_acquire);
  if (e != nullptr) return *e;
  auto fresh = std::make_unique<MaskEntry>(
      Compute(position, state, at_root ? kRootFrame : kContextFrame));
  MaskEntry* expected = nullptr;
  if (entries_[key].compare_exchange_strong(expected, fresh.get(),
                                            std::memory_order_acq_rel)) {
    computed_.fetch_add(1);
    bytes_.fetch_add(fresh->bytes());
    return *fresh.release();
  }
  return *expected;  // another thread computed it first
}

MaskEntry TokenMaskCache::Compute(int32_t position, int32_t state,
                                  int32_t parent) const {
  enum Verdict : uint8_t { kReject, kAccept, kUncertain };
  const std::vector<int32_t>& sorted = vocab_->sorted_ids();
  const std::vector<int32_t>& lcp = vocab_->lcp();
  const int32_t max_len = vocab_->max_token_bytes();

  FramePool pool;
  std::vector<std::vector<Item>> frontier(max_len + 1);
  std::vector<uint8_t> exited(max_len + 1, 0);  // an exit after <= d bytes
  frontier[0] = {Item{position, state, parent}};
  int32_t valid = 0;      // frontier[0..valid] hold the current prefix
  int32_t dead_len = -1;  // a prefix of this length is decided (dead)
  Verdict dead_verdict = kReject;

  std::vector<int32_t> accepted, rejected, uncertain;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int32_t id = sorted[i];
    const std::string& t = vocab_->token_bytes(id);
    const int32_t len = static_cast<int32_t>(t.size());
    Verdict v = kAccept;
    if (dead_len >= 0 && lcp[i] >= dead_len) {
      v = dead_verdict;
    } else {
      dead_len = -1;
      valid = std::min(valid, lcp[i]);
      for (int32_t d = valid; d < len; ++d) {
        const uint8_t byte = static_cast<uint8_t>(t[d]);
        if (frontier[d].size() == 1) {
          // Fast path: one item moving inside its DFA (no closure needed).
          const Item& it = frontier[d][0];
          const Dfa& dfa = *pda_->dfa_at(it.position);
          const int32_t next = dfa.Next(it.state, byte);
          if (next >= 0 && !dfa.accepting[next]) {
            frontier[d + 1].assign(1, Item{it.position, next, it.parent});
            exited[d + 1] = exited[d];
            valid = d + 1;
            continue;
          }
        }
        StepResult r = pda_->Step(frontier[d], byte, &pool, &frontier[d + 1]);
        if (!r.consumed) {
          v = exited[d] ? kUncertain : kReject;
          dead_len = d + 1;
          dead_verdict = v;
          valid = d;
          break;
        }
        exited[d + 1] = exited[d] || r.exited;
        valid = d + 1;
      }
    }
    switch (v) {
      case kAccept:
        accepted.push_back(id);
        break;
      case kReject:
        rejected.push_back(id);
        break;
      case kUncertain:
        uncertain.push_back(id);
        break;
    }
  }
  MaskEntry e;
  std::sort(uncertain.begin(), uncertain.end());
  e.uncertain = std::move(uncertain);
  const size_t bitset_words = vocab_->bitmask_words();
  const size_t smaller = std::min(accepted.size(), rejected.size());
  if (smaller > kMaxListIds) {
    e.form = MaskEntry::Form::kBitset;
    e.bits.assign(bitset_words, 0);
    for (int32_t id : accepted) e.bits[id >> 5] |= 1u << (id & 31);
  } else if (accepted.size() <= rejected.size()) {
    e.form = MaskEntry::Form::kAcceptedList;
    std::sort(accepted.begin(), accepted.end());
    e.ids = std::move(accepted);
  } else {
    e.form = MaskEntry::Form::kRejectedList;
    std::sort(rejected.begin(), rejected.end());
    e.ids = std::move(rejected);
  }
  return e;
}

}  // namespace tandem::grammar
