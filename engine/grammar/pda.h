// The matcher's state over an Automaton: a set of stacks (a persistent,
// hash-consed tree of frames) whose tops are DFA elements.
//
//   Item  = (position of a DFA element, DFA state, parent frame)
//   Frame = (position of the calling kRule/kRepeat element, repeat count,
//            parent frame); kRootFrame under the root rule.
//
// Frontier: the sorted set of items that can read the next byte. Stepping a
// byte moves each item along its DFA; an item reaching an accepting state is
// also closed over (advance past the element, pop completed rules, push
// called rules) until DFA items again. Frames are interned, so equal stacks
// share one id and the frontier stays a small set.
#ifndef TANDEM_ENGINE_GRAMMAR_PDA_H_
#define TANDEM_ENGINE_GRAMMAR_PDA_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "engine/grammar/automaton.h"

namespace tandem::grammar {

inline constexpr int32_t kRootFrame = -1;
// Parent of the item a mask-cache entry is computed for: the stack below is
// unknown, so popping it means "the rest depends on the context".
inline constexpr int32_t kContextFrame = -2;

struct Item {
  int32_t position;
  int32_t state;
  int32_t parent;
  bool operator==(const Item& o) const {
    return position == o.position && state == o.state && parent == o.parent;
  }
  bool operator<(const Item& o) const {
    if (position != o.position) return position < o.position;
    if (state != o.state) return state < o.state;
    return parent < o.parent;
  }
};

struct Frame {
  int32_t position;
  int32_t count;
  int32_t parent;
  bool operator==(const Frame& o) const {
    return position == o.position && count == o.count && parent == o.parent;
  }
  template <typename H>
  friend H AbslHashValue(H h, const Frame& f) {
    return H::combine(std::move(h), f.position, f.count, f.parent);
  }
};

// Interned frames. Mark/Truncate discard frames made by a speculative check.
class FramePool {
 public:
  int32_t Intern(const Frame& f);
  const Frame& at(int32_t id) const { return frames_[id]; }
  size_t size() const { return frames_.size(); }
  void Truncate(size_t size);

 private:
  std::vector<Frame> frames_;
  absl::flat_hash_map<Frame, int32_t> ids_;
};

struct StepResult {
  bool consumed = false;  // some item read the byte
  bool can_end = false;   // the root rule may be complete after it
  bool exited = false;    // a kContextFrame was popped after it
};

class Pda {
 public:
  explicit Pda(const Automaton* automaton);  // not owned

  // The frontier before any byte: the root rule entered.
  void Start(FramePool* pool, std::vector<Item>* out, StepResult* r) const;
  // Reads `byte` from `in` into `out` (sorted, unique). Items whose DFA state
  // has no outgoing byte are not kept (they cannot read more).
  StepResult Step(const std::vector<Item>& in, uint8_t byte, FramePool* pool,
                  std::vector<Item>* out) const;
  // Reads all of `bytes`; false when some byte cannot be read.
  bool StepBytes(std::vector<Item>* frontier, absl::string_view bytes, FramePool* pool,
                 StepResult* last) const;

  const Automaton& automaton() const { return *a_; }
  // The DFA of a DFA element's position (nullptr for other positions).
  const Dfa* dfa_at(int32_t position) const { return dfa_at_[position]; }

 private:
  struct Closure;
  void Enter(int32_t position, int32_t parent, Closure* c) const;
  void Complete(int32_t frame, Closure* c) const;
  void EnterRule(int32_t rule, int32_t frame, Closure* c) const;

  const Automaton* a_;
  std::vector<const Dfa*> dfa_at_;  // per position: its DFA element's DFA
};

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_PDA_H_
