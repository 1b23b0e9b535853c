#include "engine/grammar/pda.h"

#include <algorithm>

namespace tandem::grammar {

Pda::Pda(const Automaton* automaton) : a_(automaton) {
  dfa_at_.assign(a_->num_positions(), nullptr);
  for (int32_t p = 0; p < a_->num_positions(); ++p) {
    if (!a_->position_is_end[p] && a_->element(p).kind == Element::Kind::kDfa) {
      dfa_at_[p] = &a_->dfas[a_->element(p).id];
    }
  }
}

int32_t FramePool::Intern(const Frame& f) {
  auto [it, inserted] = ids_.try_emplace(f, static_cast<int32_t>(frames_.size()));
  if (inserted) frames_.push_back(f);
  return it->second;
}

void FramePool::Truncate(size_t size) {
  while (frames_.size() > size) {
    ids_.erase(frames_.back());
    frames_.pop_back();
  }
}

struct Pda::Closure {
  FramePool* pool;
  std::vector<Item>* out;
  StepResult* result;
  // (position, parent) entered and frames completed during this closure.
  absl::flat_hash_set<uint64_t> entered;
  absl::flat_hash_set<int32_t> completed;
};

namespace {
uint64_t Key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) |
         static_cast<uint32_t>(b);
}
}  // namespace

void Pda::EnterRule(int32_t rule, int32_t frame, Closure* c) const {
  for (int32_t first : a_->alt_position[rule]) Enter(first, frame, c);
}

void Pda::Enter(int32_t position, int32_t parent, Closure* c) const {
  if (!c->entered.insert(Key(position, parent)).second) return;
  if (a_->position_is_end[position]) {
    Complete(parent, c);
    return;
  }
  const Element& el = a_->element(position);
  switch (el.kind) {
    case Element::Kind::kDfa: {
      const Dfa& dfa = a_->dfas[el.id];
      if (dfa.has_next[dfa.start]) c->out->push_back({position, dfa.start, parent});
      if (dfa.accepting[dfa.start]) Enter(position + 1, parent, c);
      break;
    }
    case Element::Kind::kRule:
      EnterRule(el.id, c->pool->Intern({position, 0, parent}), c);
      break;
    case Element::Kind::kRepeat:
      if (el.max != 0) EnterRule(el.id, c->pool->Intern({position, 0, parent}), c);
      if (el.min == 0) Enter(position + 1, parent, c);
      break;
  }
}

void Pda::Complete(int32_t frame, Closure* c) const {
  if (frame == kRootFrame) {
    c->result->can_end = true;
    return;
  }
  if (frame == kContextFrame) {
    c->result->exited = true;
    return;
  }
  if (!c->completed.insert(frame).second) return;
  const Frame f = c->pool->at(frame);
  const Element& el = a_->element(f.position);
  if (el.kind == Element::Kind::kRule) {
    Enter(f.position + 1, f.parent, c);
    return;
  }
  // kRepeat: one more repetition done.
  int32_t count = f.count + 1;
  if (el.max == kUnbounded || count < el.max) {
    int32_t stored = el.max == kUnbounded ? std::min(count, el.min) : count;
    EnterRule(el.id, c->pool->Intern({f.position, stored, f.parent}), c);
  }
  if (count >= el.min) Enter(f.position + 1, f.parent, c);
}

void Pda::Start(FramePool* pool, std::vector<Item>* out, StepResult* r) const {
  out->clear();
  *r = StepResult();
  r->consumed = true;
  Closure c{pool, out, r, {}, {}};
  EnterRule(a_->root, kRootFrame, &c);
  std::sort(out->begin(), out->end());
  out->erase(std::unique(out->begin(), out->end()), out->end());
}

StepResult Pda::Step(const std::vector<Item>& in, uint8_t byte, FramePool* pool,
                     std::vector<Item>* out) const {
  out->clear();
  StepResult r;
  std::optional<Closure> closure;
  for (const Item& it : in) {
    const Dfa& dfa = *dfa_at_[it.position];
    const int32_t next = dfa.Next(it.state, byte);
    if (next < 0) continue;
    r.consumed = true;
    if (dfa.has_next[next]) out->push_back({it.position, next, it.parent});
    if (dfa.accepting[next]) {
      if (!closure) closure.emplace(Closure{pool, out, &r, {}, {}});
      Enter(it.position + 1, it.parent, &*closure);
    }
  }
  if (out->size() > 1) {
    std::sort(out->begin(), out->end());
    out->erase(std::unique(out->begin(), out->end()), out->end());
  }
  return r;
}

bool Pda::StepBytes(std::vector<Item>* frontier, absl::string_view bytes,
                    FramePool* pool, StepResult* last) const {
  std::vector<Item> next;
  StepResult r;
  for (unsigned char b : bytes) {
    r = Step(*frontier, b, pool, &next);
    if (!r.consumed) return false;
    frontier->swap(next);
  }
  if (last != nullptr) *last = r;
  return true;
}

}  // namespace tandem::grammar
