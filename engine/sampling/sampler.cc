#include "engine/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/status.h"
#include "engine/sampling/counter_rng.h"

namespace tandem::engine {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// First gather keeps tokens within this many nats of the maximum: their
// weights are >= e^-16 (~1e-7) of the top token's, which covers the
// truncated set for all but nearly flat distributions; otherwise we widen.
constexpr float kGatherWindow = 16.0f;
constexpr int64_t kChunk = 256;

// Four-lane vectors (GCC/Clang vector extensions: SSE2 on x86-64, NEON on
// Arm). The two whole-row scans of greedy sampling below run at memory speed
// with them; written as scalar loops they did not vectorise at -O2.
using V4i = int32_t __attribute__((vector_size(16)));
using V4f = float __attribute__((vector_size(16)));

// kNibbleLanes[n]: lane j all ones when bit j of n is set.
constexpr V4i Nibble(int n) {
  return V4i{(n & 1) ? -1 : 0, (n & 2) ? -1 : 0, (n & 4) ? -1 : 0, (n & 8) ? -1 : 0};
}
constexpr V4i kNibbleLanes[16] = {Nibble(0),  Nibble(1),  Nibble(2),  Nibble(3),
                                  Nibble(4),  Nibble(5),  Nibble(6),  Nibble(7),
                                  Nibble(8),  Nibble(9),  Nibble(10), Nibble(11),
                                  Nibble(12), Nibble(13), Nibble(14), Nibble(15)};
constexpr int32_t kNegInfWord = static_cast<int32_t>(0xff800000u);  // -inf's bits
constexpr V4i kNegInfBits = {kNegInfWord, kNegInfWord, kNegInfWord, kNegInfWord};

// Whether x[0, n) holds a NaN or +inf (-inf is a masked token: allowed).
bool AnyNanOrPosInf(const float* x, int64_t n) {
  const V4i abs_bits = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
  const V4i inf_bits = {0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000};
  V4i bad = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    V4i b;
    std::memcpy(&b, x + i, sizeof(b));
    // NaN: magnitude above inf's bits (either sign); +inf: exactly inf's bits.
    bad |= ((b & abs_bits) > inf_bits) | (b == inf_bits);
  }
  bool any = (bad[0] | bad[1] | bad[2] | bad[3]) != 0;
  for (; i < n; ++i) any |= std::isnan(x[i]) || x[i] == -kNegInf;
  return any;
}

// The largest value of x[0, n), n >= 1, x without NaN.
float MaxOf(const float* x, int64_t n) {
  V4f m0 = {x[0], x[0], x[0], x[0]};
  V4f m1 = m0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    V4f a, b;
    std::memcpy(&a, x + i, sizeof(a));
    std::memcpy(&b, x + i + 4, sizeof(b));
    m0 = a > m0 ? a : m0;
    m1 = b > m1 ? b : m1;
  }
  m0 = m1 > m0 ? m1 : m0;
  float m = std::max(std::max(m0[0], m0[1]), std::max(m0[2], m0[3]));
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

struct Greater {
  template <typename C>
  bool operator()(const C& a, const C& b) const {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  }
};

// Reorders v so that v[0, cut) is the shortest prefix, in Greater order, whose
// weight reaches `target` (all of v when the total is below it), and returns
// cut. Expected linear time: halving by nth_element, then a sort of a small
// remainder.
template <typename C>
size_t PrefixByMass(std::vector<C>& v, double target) {
  size_t lo = 0, hi = v.size();
  double acc = 0.0;  // weight of v[0, lo), all inside the prefix
  while (hi - lo > 64) {
    const size_t mid = lo + (hi - lo) / 2;
    std::nth_element(v.begin() + lo, v.begin() + mid, v.begin() + hi, Greater());
    double mass = 0.0;
    for (size_t i = lo; i < mid; ++i) mass += v[i].weight;
    if (acc + mass >= target) {
      hi = mid;
    } else {
      acc += mass;
      lo = mid;
    }
  }
  std::sort(v.begin() + lo, v.begin() + hi, Greater());
  for (size_t i = lo; i < hi; ++i) {
    acc += v[i].weight;
    if (acc >= target) return i + 1;
  }
  return hi;
}

}  // namespace

absl::StatusOr<SampleResult> ScoreToken(absl::Span<const float> logits, int32_t token,
                                        int top_n) {
  const int64_t n = static_cast<int64_t>(logits.size());
  if (token < 0 || token >= n) {
    return InvalidArgument("token ", token, " is outside the ", n, "-entry logits row");
  }
  if (top_n < 0 || top_n > kMaxTopLogprobs) {
    return InvalidArgument("top_n must be in [0, ", kMaxTopLogprobs, "], got ", top_n);
  }
  if (AnyNanOrPosInf(logits.data(), n)) {
    return InvalidArgument("logits contain NaN or +inf");
  }
  const float m = MaxOf(logits.data(), n);
  if (m == kNegInf) return InvalidArgument("every logit is -inf");
  // Each term in float (x - m <= 0: no overflow; a term's relative error ~1e-7),
  // the sum in float64.
  double sum = 0.0;
  for (float x : logits) sum += std::exp(x - m);
  const double lse = m + std::log(sum);
  SampleResult res;
  res.token_id = token;
  res.logprob = static_cast<float>(logits[token] - lse);
  // The rank and the best top_n in one pass (the list short, most likely first;
  // -inf tokens are no alternatives, as the sampler's and the device's lists).
  const float own = logits[token];
  int64_t above = 0;
  std::vector<std::pair<float, int32_t>> best;
  best.reserve(top_n + 1);
  for (int64_t i = 0; i < n; ++i) {
    const float x = logits[i];
    above += x > own;
    if (top_n > 0 && x != kNegInf) {
      if (static_cast<int>(best.size()) == top_n && !(x > best.back().first)) continue;
      auto at = std::upper_bound(
          best.begin(), best.end(), x,
          [](float v, const std::pair<float, int32_t>& e) { return v > e.first; });
      best.insert(at, {x, static_cast<int32_t>(i)});
      if (static_cast<int>(best.size()) > top_n) best.pop_back();
    }
  }
  res.rank = static_cast<int32_t>(above + 1);
  for (const auto& [x, id] : best) res.top.push_back({id, static_cast<float>(x - lse)});
  return res;
}

Sampler::Sampler(int64_t vocab_size)
    : vocab_size_(vocab_size), x_(static_cast<size_t>(vocab_size)) {}

absl::Status Sampler::Prepare(const SampleRequest& request, bool need_softmax) {
  if (request.params == nullptr) return InvalidArgument("params are required");
  if (static_cast<int64_t>(request.logits.size()) != vocab_size_) {
    return InvalidArgument("logits row has ", request.logits.size(),
                           " entries, vocabulary has ", vocab_size_);
  }
  const SamplingParams& p = *request.params;
  const bool masked = !request.allowed_bitmask.empty();
  if (!masked) {
    std::copy(request.logits.begin(), request.logits.end(), x_.begin());
  } else {
    const absl::Span<const uint32_t> mask = request.allowed_bitmask;
    if (static_cast<int64_t>(mask.size()) * 32 < vocab_size_) {
      return InvalidArgument("token bitmask has ", mask.size(),
                             " words, vocabulary has ", vocab_size_, " tokens");
    }
    // Copy and mask in one pass, a 32-token word at a time: a grammar's mask
    // is mostly whole words of allowed or of disallowed tokens.
    const float* src = request.logits.data();
    float* dst = x_.data();
    for (int64_t w = 0, base = 0; base < vocab_size_; ++w, base += 32) {
      const int64_t end = std::min<int64_t>(vocab_size_, base + 32);
      const uint32_t bits = mask[w];
      if (end - base == 32) {
        // A whole word: eight four-lane blends, each lane keeping the logit
        // or -inf by its bit (a scalar select was the cost of rows inside a
        // JSON string, where most words are partly allowed).
        for (int k = 0; k < 8; ++k) {
          const V4i keep = kNibbleLanes[(bits >> (4 * k)) & 15u];
          V4i v;
          std::memcpy(&v, src + base + 4 * k, sizeof(v));
          v = (v & keep) | (kNegInfBits & ~keep);
          std::memcpy(dst + base + 4 * k, &v, sizeof(v));
        }
      } else {
        for (int64_t i = base; i < end; ++i) {
          dst[i] = ((bits >> (i - base)) & 1u) != 0 ? src[i] : kNegInf;
        }
      }
    }
  }
  for (int32_t id : request.suppressed_tokens) {
    if (id >= 0 && id < vocab_size_) x_[id] = kNegInf;
  }
  if (masked) {
    // Some allowed token must still be finite; only the mask's set bits are
    // looked at.
    const absl::Span<const uint32_t> mask = request.allowed_bitmask;
    bool any = false;
    for (int64_t w = 0; w * 32 < vocab_size_ && !any; ++w) {
      for (uint32_t bits = mask[w]; bits != 0 && !any; bits &= bits - 1) {
        const int64_t i = w * 32 + __builtin_ctz(bits);
        any = i < vocab_size_ && x_[i] != kNegInf;
      }
    }
    if (!any) {
      return absl::FailedPreconditionError(
          "structured output: the constraint allows no next token");
    }
  }
  // logit_bias (ids validated in the vocabulary; a masked token stays -inf).
  for (const TokenBias& b : p.logit_bias) {
    if (b.token_id >= 0 && b.token_id < vocab_size_) x_[b.token_id] += b.bias;
  }
  if (request.history != nullptr && p.HasPenalties()) {
    const PenaltyState& h = *request.history;
    const float rep = p.repetition_penalty;
    auto repeat = [&](int32_t id) {
      if (id < 0 || id >= vocab_size_) return;
      float& v = x_[id];
      v = v > 0.0f ? v / rep : v * rep;
    };
    if (rep != 1.0f) {
      for (int32_t id : h.prompt_tokens()) repeat(id);
      for (const auto& [id, count] : h.output_counts()) {
        if (!h.prompt_tokens().contains(id)) repeat(id);
      }
    }
    for (const auto& [id, count] : h.output_counts()) {
      if (id < 0 || id >= vocab_size_) continue;
      x_[id] -= p.frequency_penalty * static_cast<float>(count) + p.presence_penalty;
    }
  }
  if (!p.IsGreedy() && p.temperature != 1.0f) {
    const float t = p.temperature;
    for (float& v : x_) v /= t;
  }
  if (!need_softmax) {
    if (AnyNanOrPosInf(x_.data(), vocab_size_)) {
      return InvalidArgument("logits contain NaN or +inf");
    }
    return absl::OkStatus();
  }
  // Online softmax over chunks: one read of the row.
  double m = -std::numeric_limits<double>::infinity();
  double s = 0.0;
  for (int64_t base = 0; base < vocab_size_; base += kChunk) {
    const int64_t end = std::min(vocab_size_, base + kChunk);
    float cm = kNegInf;
    bool bad = false;
    for (int64_t i = base; i < end; ++i) {
      cm = std::max(cm, x_[i]);
      bad |= std::isnan(x_[i]);
    }
    if (bad || cm == std::numeric_limits<float>::infinity()) {
      return InvalidArgument("logits contain NaN or +inf");
    }
    if (cm == kNegInf) continue;
    if (cm > m) {
      s *= std::exp(m - cm);
      m = cm;
    }
    const float mf = static_cast<float>(m);
    float cs = 0.0f;
    for (int64_t i = base; i < end; ++i) cs += std::exp(x_[i] - mf);
    s += cs;
  }
  if (!(m > -std::numeric_limits<double>::infinity())) {
    return InvalidArgument("every token is masked out (all logits -inf)");
  }
  max_ = m;
  sum_ = s;
  lse_ = m + std::log(s);
  return absl::OkStatus();
}

int32_t Sampler::ArgMax() const {
  // The first index of the largest value (x_ holds no NaN here).
  const float best = MaxOf(x_.data(), vocab_size_);
  for (int64_t j = 0; j < vocab_size_; ++j) {
    if (x_[j] == best) return static_cast<int32_t>(j);
  }
  return 0;
}

void Sampler::TopN(int n, std::vector<TopLogprob>* out) const {
  out->clear();
  if (n <= 0) return;
  struct Entry {
    float logit;
    int32_t id;
  };
  std::vector<Entry> best;  // sorted, most likely first
  best.reserve(n + 1);
  for (int64_t i = 0; i < vocab_size_; ++i) {
    const float v = x_[i];
    // Later ids lose ties, so only strictly larger values enter a full list.
    if (static_cast<int>(best.size()) == n && !(v > best.back().logit)) {
      continue;
    }
    if (v == kNegInf) continue;
    Entry e{v, static_cast<int32_t>(i)};
    auto pos = std::upper_bound(
        best.begin(), best.end(), e, [](const Entry& a, const Entry& b) {
          return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
        });
    best.insert(pos, e);
    if (static_cast<int>(best.size()) > n) best.pop_back();
  }
  for (const Entry& e : best) {
    out->push_back({e.id, static_cast<float>(e.logit - lse_)});
  }
}

void Sampler::SelectKept(const SamplingParams& p) {
  kept_.clear();
  kept_mass_ = 0.0;
  const bool use_k = p.top_k > 0 && p.top_k < vocab_size_;
  const bool use_p = p.top_p < 1.0f;
  const bool use_min_p = p.min_p > 0.0f;
  keep_all_ = !use_k && !use_p && !use_min_p;
  if (keep_all_) return;

  const float mf = static_cast<float>(max_);
  // min-p keeps p_i >= min_p * p_max, i.e. x_i >= max + log(min_p). Since
  // top-k and top-p always keep the most likely token, the ratio does not
  // change under their renormalisation: applying it last equals intersecting.
  const float min_p_cut =
      use_min_p ? static_cast<float>(max_ + std::log(p.min_p)) : kNegInf;
  // Elements below min_p_cut can matter only through top-k's normaliser when
  // both top-k and top-p are on.
  const float floor_cut = (use_k && use_p) ? kNegInf : min_p_cut;

  for (int attempt = 0; attempt < 2; ++attempt) {
    const float threshold =
        attempt == 0 ? std::max(mf - kGatherWindow, floor_cut) : floor_cut;
    const bool complete = threshold <= floor_cut;
    kept_.clear();
    double mass = 0.0;
    for (int64_t i = 0; i < vocab_size_; ++i) {
      const float v = x_[i];
      if (v >= threshold && v != kNegInf) {
        const float w = std::exp(v - mf);
        kept_.push_back({v, static_cast<int32_t>(i), w});
        mass += w;
      }
    }
    // The gathered set is a prefix of the ranking, so top-k inside it is exact
    // once it holds at least k tokens.
    double norm = sum_;
    // Everything gathered survives unless a cut below says otherwise.
    boundary_ = {std::numeric_limits<float>::lowest(),
                 std::numeric_limits<int32_t>::max()};
    if (use_k) {
      if (static_cast<int64_t>(kept_.size()) >= p.top_k) {
        std::nth_element(kept_.begin(), kept_.begin() + (p.top_k - 1), kept_.end(),
                         Greater());
        kept_.resize(p.top_k);
        boundary_ = {kept_.back().logit, kept_.back().id};
        norm = 0.0;
        for (const Candidate& c : kept_) norm += c.weight;
      } else if (!complete) {
        continue;
      } else {
        norm = mass;  // everything that can survive is here
      }
    } else if (!complete && (!use_p || mass < p.top_p * sum_)) {
      // Without top-k, min-p alone needs everything above its cut; top-p
      // needs a gathered prefix heavy enough to contain its boundary.
      continue;
    }
    if (use_p) {
      const size_t cut = PrefixByMass(kept_, static_cast<double>(p.top_p) * norm);
      boundary_ = {kept_[cut - 1].logit, kept_[cut - 1].id};
    }
    if (use_min_p && boundary_.logit < min_p_cut) {
      boundary_ = {min_p_cut, std::numeric_limits<int32_t>::max()};
    }
    break;
  }
  for (const Candidate& c : kept_) {
    if (Keeps(c.logit, c.id)) kept_mass_ += c.weight;
  }
}

absl::StatusOr<SampleResult> Sampler::Sample(const SampleRequest& request) {
  if (request.params == nullptr) return InvalidArgument("params are required");
  const SamplingParams& p = *request.params;
  TANDEM_RETURN_IF_ERROR(
      Prepare(request, /*need_softmax=*/!p.IsGreedy() || p.logprobs));
  SampleResult result;
  if (p.IsGreedy()) {
    result.token_id = ArgMax();
    if (x_[result.token_id] == kNegInf) {
      return InvalidArgument("every token is masked out (all logits -inf)");
    }
  } else {
    if (!p.seed.has_value()) {
      return FailedPrecondition("random sampling needs a seed (draw one at admission)");
    }
    SelectKept(p);
    const double u = CounterUniform(*p.seed, request.position, RngStream::kSample);
    const float mf = static_cast<float>(max_);
    if (keep_all_) {
      const double target = u * sum_;
      double acc = 0.0;
      int32_t last_positive = -1;
      result.token_id = -1;
      for (int64_t i = 0; i < vocab_size_; ++i) {
        const float w = std::exp(x_[i] - mf);
        if (w <= 0.0f) continue;
        last_positive = static_cast<int32_t>(i);
        acc += w;
        if (acc > target) {
          result.token_id = last_positive;
          break;
        }
      }
      if (result.token_id < 0) result.token_id = last_positive;
    } else {
      const double target = u * kept_mass_;
      double acc = 0.0;
      result.token_id = -1;
      int32_t last_kept = -1;
      for (int64_t i = 0; i < vocab_size_; ++i) {
        if (!Keeps(x_[i], static_cast<int32_t>(i))) continue;
        last_kept = static_cast<int32_t>(i);
        acc += std::exp(x_[i] - mf);
        if (acc > target) {
          result.token_id = last_kept;
          break;
        }
      }
      if (result.token_id < 0) result.token_id = last_kept;
    }
  }
  if (p.logprobs) {
    result.logprob = static_cast<float>(x_[result.token_id] - lse_);
    TopN(p.top_logprobs, &result.top);
  }
  return result;
}

absl::Status Sampler::Distribution(const SampleRequest& request,
                                   std::vector<float>* probs) {
  if (request.params == nullptr) return InvalidArgument("params are required");
  const SamplingParams& p = *request.params;
  TANDEM_RETURN_IF_ERROR(Prepare(request, /*need_softmax=*/!p.IsGreedy()));
  probs->assign(static_cast<size_t>(vocab_size_), 0.0f);
  if (p.IsGreedy()) {
    (*probs)[ArgMax()] = 1.0f;
    return absl::OkStatus();
  }
  SelectKept(p);
  const float mf = static_cast<float>(max_);
  if (keep_all_) {
    for (int64_t i = 0; i < vocab_size_; ++i) {
      (*probs)[i] = static_cast<float>(std::exp(x_[i] - mf) / sum_);
    }
  } else {
    for (int64_t i = 0; i < vocab_size_; ++i) {
      if (Keeps(x_[i], static_cast<int32_t>(i))) {
        (*probs)[i] = static_cast<float>(std::exp(x_[i] - mf) / kept_mass_);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::engine
