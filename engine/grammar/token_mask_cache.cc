#include "engine/grammar/token_mask_cache.h"

#include <algorithm>

#include "absl/strings/string_view.h"

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
  return Store(key, Compute(position, state, at_root ? kRootFrame : kContextFrame));
}

const MaskEntry& TokenMaskCache::Store(int32_t key, MaskEntry entry) const {
  auto fresh = std::make_unique<MaskEntry>(std::move(entry));
  MaskEntry* expected = nullptr;
  if (entries_[key].compare_exchange_strong(expected, fresh.get(),
                                            std::memory_order_acq_rel)) {
    computed_.fetch_add(1);
    bytes_.fetch_add(fresh->bytes());
    return *fresh.release();
  }
  return *expected;  // another thread computed it first
}

bool TokenMaskCache::PrecomputeUntil(absl::Time deadline) const {
  if (precomputed()) return true;
  const Automaton& a = pda_->automaton();
  for (int32_t p = precompute_position_.load(); p < a.num_positions(); ++p) {
    const Dfa* dfa = pda_->dfa_at(p);
    if (dfa != nullptr) {
      const bool at_root = a.position_rule[p] == a.root;
      for (int32_t st = 0; st < dfa->num_states; ++st) {
        // Items exist only in states with a transition (Pda::Enter, Step).
        if (!dfa->has_next[st]) continue;
        const int32_t key = 2 * (a.mask_key_base[p] + st) + (at_root ? 1 : 0);
        if (entries_[key].load(std::memory_order_acquire) != nullptr) continue;
        if (absl::Now() >= deadline) {
          precompute_position_.store(p);
          return false;
        }
        Store(key, Compute(p, st, at_root ? kRootFrame : kContextFrame));
      }
    }
    precompute_position_.store(p + 1);
  }
  precomputed_.store(true, std::memory_order_release);
  return true;
}

MaskEntry TokenMaskCache::Compute(int32_t position, int32_t state,
                                  int32_t parent) const {
  enum Verdict : uint8_t { kReject, kAccept, kUncertain };
  const std::vector<int32_t>& sorted = vocab_->sorted_ids();
  const std::vector<int32_t>& lcp = vocab_->lcp();
  const std::vector<int32_t>& next_shorter = vocab_->next_shorter();
  const int32_t n = static_cast<int32_t>(sorted.size());
  const int32_t max_len = vocab_->max_token_bytes();

  // The frontier after each prefix length of the current token. Most walks
  // are one item moving inside its DFA: that item is kept inline (`one`) and
  // the general frontier (`many`) is used only once a step needs closure.
  struct Level {
    bool single = false;
    bool exited = false;  // an exit after <= this many bytes
    Item one{};
    std::vector<Item> many;
  };
  FramePool pool;
  std::vector<Level> lv(max_len + 1);
  lv[0].single = true;
  lv[0].one = Item{position, state, parent};
  std::vector<Item> single_in(1);
  int32_t valid = 0;  // lv[0..valid] hold the current token's prefix

  std::vector<uint32_t> accepted_bits(vocab_->bitmask_words(), 0);
  int64_t num_accepted = 0;
  int64_t num_rejected = 0;
  std::vector<int32_t> uncertain;
  int32_t i = 0;
  while (i < n) {
    const absl::string_view t = vocab_->sorted_token(i);
    const int32_t len = static_cast<int32_t>(t.size());
    valid = std::min(valid, lcp[i]);
    Verdict v = kAccept;
    int32_t dead_len = -1;  // token i's first dead_len bytes decide it
    for (int32_t d = valid; d < len; ++d) {
      const uint8_t byte = static_cast<uint8_t>(t[d]);
      Level& cur = lv[d];
      Level& nx = lv[d + 1];
      const std::vector<Item>* in = &cur.many;
      if (cur.single) {
        const Dfa& dfa = *pda_->dfa_at(cur.one.position);
        const int32_t next = dfa.Next(cur.one.state, byte);
        if (next >= 0 && !dfa.accepting[next]) {
          nx.single = true;
          nx.one = Item{cur.one.position, next, cur.one.parent};
          nx.exited = cur.exited;
          valid = d + 1;
          continue;
        }
        single_in[0] = cur.one;
        in = &single_in;
      }
      StepResult r = pda_->Step(*in, byte, &pool, &nx.many);
      if (!r.consumed) {
        v = cur.exited ? kUncertain : kReject;
        dead_len = d + 1;
        valid = d;
        break;
      }
      nx.single = nx.many.size() == 1;
      if (nx.single) nx.one = nx.many[0];
      nx.exited = cur.exited || r.exited;
      valid = d + 1;
    }
    // Every following token that shares the first dead_len bytes has the same
    // verdict: find the end of that run by hopping over deeper subtrees.
    int32_t run_end = i + 1;
    if (dead_len >= 0) {
      while (run_end < n && lcp[run_end] >= dead_len) run_end = next_shorter[run_end];
    }
    switch (v) {
      case kAccept:
        accepted_bits[sorted[i] >> 5] |= 1u << (sorted[i] & 31);
        ++num_accepted;
        break;
      case kReject:
        num_rejected += run_end - i;
        break;
      case kUncertain:
        for (int32_t j = i; j < run_end; ++j) uncertain.push_back(sorted[j]);
        break;
    }
    i = run_end;
  }
  MaskEntry e;
  std::sort(uncertain.begin(), uncertain.end());
  e.uncertain = std::move(uncertain);
  const int64_t smaller = std::min(num_accepted, num_rejected);
  if (smaller > static_cast<int64_t>(kMaxListIds)) {
    e.form = MaskEntry::Form::kBitset;
    e.bits = std::move(accepted_bits);
  } else if (num_accepted <= num_rejected) {
    e.form = MaskEntry::Form::kAcceptedList;
    e.ids.reserve(num_accepted);
    for (size_t w = 0; w < accepted_bits.size(); ++w) {
      for (uint32_t bits = accepted_bits[w]; bits != 0; bits &= bits - 1) {
        e.ids.push_back(static_cast<int32_t>(32 * w + __builtin_ctz(bits)));
      }
    }
  } else {
    // Rejected = matchable, not accepted, not uncertain (ids in order).
    e.form = MaskEntry::Form::kRejectedList;
    std::vector<uint32_t> rejected = vocab_->matchable_mask();
    for (size_t w = 0; w < rejected.size(); ++w) rejected[w] &= ~accepted_bits[w];
    for (int32_t id : e.uncertain) rejected[id >> 5] &= ~(1u << (id & 31));
    e.ids.reserve(num_rejected);
    for (size_t w = 0; w < rejected.size(); ++w) {
      for (uint32_t bits = rejected[w]; bits != 0; bits &= bits - 1) {
        e.ids.push_back(static_cast<int32_t>(32 * w + __builtin_ctz(bits)));
      }
    }
  }
  return e;
}

}  // namespace tandem::grammar
