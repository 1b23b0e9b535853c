#include "engine/runtime/device_sampler.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/status.h"

namespace tandem::engine {
namespace {

static_assert(kernels::kSamplingGreedyTemperature == kGreedyTemperature);
static_assert(kernels::kSamplingMaxTopLogprobs == kMaxTopLogprobs);

// Byte offsets of a packed buffer, each array aligned to 8 bytes.
class Layout {
 public:
  template <typename T>
  size_t Add(size_t count) {
    size_t at = (bytes_ + 7) / 8 * 8;
    bytes_ = at + count * sizeof(T);
    return at;
  }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
};

template <typename T>
T* At(unsigned char* base, size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

absl::Status RowError(int32_t status) {
  switch (status) {
    case kernels::kSampleBadLogits:
      return InvalidArgument("logits contain NaN or +inf");
    case kernels::kSampleAllMasked:
      return InvalidArgument("every token is masked out (all logits -inf)");
    case kernels::kSampleNoSeed:
      return FailedPrecondition("random sampling needs a seed (draw one at admission)");
    case kernels::kSampleNoAllowedToken:
      return FailedPrecondition(
          "structured output: the constraint allows no next token");
    default:
      return Internal("device sampling: unknown row status ", status);
  }
}

}  // namespace

DeviceSampler::DeviceSampler(kernels::Backend* backend, int64_t vocab_size)
    : backend_(backend), vocab_(vocab_size) {}

absl::Status DeviceSampler::Reserve(kernels::DeviceBuffer* buf, size_t bytes) {
  if (buf->bytes() >= bytes) return absl::OkStatus();
  const size_t want = std::max(bytes, 2 * buf->bytes());
  buf->Reset();
  absl::StatusOr<kernels::DeviceBuffer> b =
      kernels::DeviceBuffer::Allocate(&backend_->device(), want);
  if (!b.ok()) {
    return absl::Status(b.status().code(), absl::StrCat("device sampling: ", want,
                                                        " bytes of device memory: ",
                                                        b.status().message()));
  }
  *buf = std::move(b).value();
  return absl::OkStatus();
}

absl::Status DeviceSampler::Prepare(absl::Span<const Row> rows) {
  TANDEM_RETURN_IF_ERROR(Pack(rows));
  return Upload();
}

absl::Status DeviceSampler::Pack(absl::Span<const Row> rows) {
  packed_ = false;
  ready_ = false;
  rows_.clear();
  if (!backend_->SupportsSampling()) {
    return FailedPrecondition("backend ", backend_->name(),
                              " does not sample on its device");
  }
  if (vocab_ <= 0 || vocab_ > kernels::kSamplingMaxVocab) {
    return InvalidArgument("device sampling: vocabulary of ", vocab_, " tokens (1 .. ",
                           kernels::kSamplingMaxVocab, ")");
  }
  const size_t n = rows.size();
  if (n == 0) {
    packed_ = true;
    return absl::OkStatus();
  }

  // Each row's penalty entries: distinct ids in the vocabulary, the prompt's
  // first, then output-only ones, in the hash tables' order (each id is
  // distinct and the kernel treats each on its own, so the order changes
  // nothing); and its suppressed ids in the vocabulary. The vectors are members:
  // no allocation per step once they have grown.
  std::vector<int32_t>& pen_offsets = pen_offsets_;
  std::vector<int32_t>& sup_offsets = sup_offsets_;
  std::vector<int32_t>& pen_tokens = pen_tokens_;
  std::vector<int32_t>& pen_counts = pen_counts_;
  std::vector<int32_t>& sup_tokens = sup_tokens_;
  std::vector<uint8_t>& pen_in_prompt = pen_in_prompt_;
  std::vector<int32_t>& bias_offsets = bias_offsets_;
  std::vector<int32_t>& bias_tokens = bias_tokens_;
  std::vector<float>& bias_values = bias_values_;
  pen_offsets.assign(n + 1, 0);
  sup_offsets.assign(n + 1, 0);
  bias_offsets.assign(n + 1, 0);
  bias_tokens.clear();
  bias_values.clear();
  pen_tokens.clear();
  pen_counts.clear();
  sup_tokens.clear();
  pen_in_prompt.clear();
  int32_t top_n = 0;
  auto in_vocab = [&](int32_t id) { return id >= 0 && id < vocab_; };
  for (size_t i = 0; i < n; ++i) {
    const Row& r = rows[i];
    if (r.score_token >= 0) {
      // A scored row: raw logits, no per-row entries (empty CSR ranges).
      if (r.score_token >= vocab_) {
        return InvalidArgument("device sampling: row ", i, " scores token ",
                               r.score_token, ", outside the vocabulary of ", vocab_);
      }
      if (r.score_top < 0 || r.score_top > kernels::kSamplingMaxTopLogprobs) {
        return InvalidArgument("device sampling: row ", i, " asks for ", r.score_top,
                               " alternatives (0 .. ", kernels::kSamplingMaxTopLogprobs,
                               ")");
      }
      top_n = std::max(top_n, r.score_top);
      rows_.push_back({true, r.score_top, true});
      pen_offsets[i + 1] = static_cast<int32_t>(pen_tokens.size());
      sup_offsets[i + 1] = static_cast<int32_t>(sup_tokens.size());
      bias_offsets[i + 1] = static_cast<int32_t>(bias_tokens.size());
      continue;
    }
    if (r.params == nullptr)
      return InvalidArgument("device sampling: row ", i, " has no params");
    const SamplingParams& p = *r.params;
    if (p.logprobs) top_n = std::max(top_n, p.top_logprobs);
    rows_.push_back({p.logprobs, p.top_logprobs, false});
    if (r.history != nullptr && p.HasPenalties()) {
      const PenaltyState& hist = *r.history;
      for (int32_t id : hist.prompt_tokens()) {
        if (!in_vocab(id)) continue;
        auto it = hist.output_counts().find(id);
        pen_tokens.push_back(id);
        pen_counts.push_back(it == hist.output_counts().end() ? 0 : it->second);
        pen_in_prompt.push_back(1);
      }
      for (const auto& [id, count] : hist.output_counts()) {
        if (!in_vocab(id) || hist.prompt_tokens().contains(id)) continue;
        pen_tokens.push_back(id);
        pen_counts.push_back(count);
        pen_in_prompt.push_back(0);
      }
    }
    pen_offsets[i + 1] = static_cast<int32_t>(pen_tokens.size());
    for (int32_t id : r.suppressed_tokens) {
      if (in_vocab(id)) sup_tokens.push_back(id);
    }
    sup_offsets[i + 1] = static_cast<int32_t>(sup_tokens.size());
    // Distinct ids (SamplingParams::Validate): one thread each on the device.
    for (const TokenBias& b : p.logit_bias) {
      if (!in_vocab(b.token_id)) continue;
      bias_tokens.push_back(b.token_id);
      bias_values.push_back(b.bias);
    }
    bias_offsets[i + 1] = static_cast<int32_t>(bias_tokens.size());
  }
  const int64_t mask_words = (vocab_ + 31) / 32;
  int32_t masks = 0;
  for (size_t i = 0; i < n; ++i) {
    const absl::Span<const uint32_t> m = rows[i].allowed_bitmask;
    if (m.empty() || rows[i].score_token >= 0) continue;
    if (static_cast<int64_t>(m.size()) < mask_words) {
      return InvalidArgument("device sampling: row ", i, "'s token bitmask has ",
                             m.size(), " words, the vocabulary needs ", mask_words);
    }
    ++masks;
  }
  if (top_n > kernels::kSamplingMaxTopLogprobs) {
    return InvalidArgument("device sampling: top_logprobs ", top_n, " (at most ",
                           kernels::kSamplingMaxTopLogprobs, ")");
  }
  const bool penalties = !pen_tokens.empty();
  const bool suppress = !sup_tokens.empty();
  const bool bias = !bias_tokens.empty();

  Layout in;
  const size_t o_params = in.Add<kernels::SamplingRowParams>(n);
  size_t o_pen_off = 0, o_pen_tok = 0, o_pen_cnt = 0, o_pen_flag = 0;
  if (penalties) {
    o_pen_off = in.Add<int32_t>(n + 1);
    o_pen_tok = in.Add<int32_t>(pen_tokens.size());
    o_pen_cnt = in.Add<int32_t>(pen_counts.size());
    o_pen_flag = in.Add<uint8_t>(pen_in_prompt.size());
  }
  size_t o_sup_off = 0, o_sup_tok = 0;
  if (suppress) {
    o_sup_off = in.Add<int32_t>(n + 1);
    o_sup_tok = in.Add<int32_t>(sup_tokens.size());
  }
  size_t o_bias_off = 0, o_bias_tok = 0, o_bias_val = 0;
  if (bias) {
    o_bias_off = in.Add<int32_t>(n + 1);
    o_bias_tok = in.Add<int32_t>(bias_tokens.size());
    o_bias_val = in.Add<float>(bias_values.size());
  }
  const size_t o_masks = masks > 0 ? in.Add<uint32_t>(masks * mask_words) : 0;
  Layout out;
  off_tokens_ = out.Add<int32_t>(n);
  off_status_ = out.Add<int32_t>(n);
  off_logprobs_ = out.Add<float>(n);
  off_top_ids_ = out.Add<int32_t>(n * top_n);
  off_top_lps_ = out.Add<float>(n * top_n);
  off_ranks_ = out.Add<int32_t>(n);
  out_bytes_ = out.bytes();

  in_bytes_ = in.bytes();
  o_params_ = o_params;
  o_pen_off_ = o_pen_off;
  o_pen_tok_ = o_pen_tok;
  o_pen_cnt_ = o_pen_cnt;
  o_pen_flag_ = o_pen_flag;
  o_sup_off_ = o_sup_off;
  o_sup_tok_ = o_sup_tok;
  o_masks_ = o_masks;
  o_bias_off_ = o_bias_off;
  o_bias_tok_ = o_bias_tok;
  o_bias_val_ = o_bias_val;
  bias_ = bias;
  masks_ = masks;
  top_n_ = top_n;
  penalties_ = penalties;
  suppress_ = suppress;
  staging_.assign(in.bytes(), 0);
  unsigned char* h = staging_.data();
  kernels::SamplingRowParams* params = At<kernels::SamplingRowParams>(h, o_params);
  int32_t mask_row = 0;
  for (size_t i = 0; i < n; ++i) {
    kernels::SamplingRowParams q;
    if (rows[i].score_token >= 0) {
      q.temperature = 1.0f;  // raw logits (above the greedy threshold: softmax on)
      q.logprobs = 1;
      q.top_logprobs = rows[i].score_top;
      q.score_token = rows[i].score_token;
      params[i] = q;
      continue;
    }
    const SamplingParams& p = *rows[i].params;
    if (!rows[i].allowed_bitmask.empty()) {
      std::memcpy(h + o_masks + mask_row * mask_words * sizeof(uint32_t),
                  rows[i].allowed_bitmask.data(), mask_words * sizeof(uint32_t));
      q.mask_row = mask_row++;
    }
    q.temperature = p.temperature;
    q.top_p = p.top_p;
    q.min_p = p.min_p;
    q.presence_penalty = p.presence_penalty;
    q.frequency_penalty = p.frequency_penalty;
    q.repetition_penalty = p.repetition_penalty;
    q.top_k = p.top_k;
    q.logprobs = p.logprobs ? 1 : 0;
    q.top_logprobs = p.logprobs ? p.top_logprobs : 0;
    q.has_seed = p.seed.has_value() ? 1 : 0;
    q.seed = p.seed.value_or(0);
    q.position = rows[i].position;
    params[i] = q;
  }
  if (penalties) {
    std::memcpy(h + o_pen_off, pen_offsets.data(),
                pen_offsets.size() * sizeof(int32_t));
    std::memcpy(h + o_pen_tok, pen_tokens.data(), pen_tokens.size() * sizeof(int32_t));
    std::memcpy(h + o_pen_cnt, pen_counts.data(), pen_counts.size() * sizeof(int32_t));
    std::memcpy(h + o_pen_flag, pen_in_prompt.data(), pen_in_prompt.size());
  }
  if (suppress) {
    std::memcpy(h + o_sup_off, sup_offsets.data(),
                sup_offsets.size() * sizeof(int32_t));
    std::memcpy(h + o_sup_tok, sup_tokens.data(), sup_tokens.size() * sizeof(int32_t));
  }
  if (bias) {
    std::memcpy(h + o_bias_off, bias_offsets.data(),
                bias_offsets.size() * sizeof(int32_t));
    std::memcpy(h + o_bias_tok, bias_tokens.data(),
                bias_tokens.size() * sizeof(int32_t));
    std::memcpy(h + o_bias_val, bias_values.data(), bias_values.size() * sizeof(float));
  }
  packed_ = true;
  return absl::OkStatus();
}

absl::Status DeviceSampler::Upload() {
  if (!packed_) return FailedPrecondition("device sampling: Upload without a Pack");
  packed_ = false;
  if (args_.rows > 0) {
    // A prepared step that never ran: its upload may still be queued, writing
    // in_, which this call may replace.
    TANDEM_RETURN_IF_ERROR(backend_->Synchronize());
  }
  args_ = kernels::SampleArgs();
  const size_t n = rows_.size();
  if (n == 0) {
    ready_ = true;
    return absl::OkStatus();
  }
  TANDEM_RETURN_IF_ERROR(Reserve(&in_, in_bytes_));
  TANDEM_RETURN_IF_ERROR(Reserve(&out_, out_bytes_));
  TANDEM_RETURN_IF_ERROR(
      backend_->device().CopyToDevice(in_.data(), staging_.data(), staging_.size()));
  const bool penalties = penalties_, suppress = suppress_;
  const int64_t mask_words = (vocab_ + 31) / 32;
  const int32_t masks = masks_, top_n = top_n_;
  const size_t o_params = o_params_, o_pen_off = o_pen_off_, o_pen_tok = o_pen_tok_,
               o_pen_cnt = o_pen_cnt_, o_pen_flag = o_pen_flag_, o_sup_off = o_sup_off_,
               o_sup_tok = o_sup_tok_, o_masks = o_masks_;

  unsigned char* d = static_cast<unsigned char*>(in_.data());
  unsigned char* o = static_cast<unsigned char*>(out_.data());
  args_.rows = static_cast<int32_t>(n);
  args_.vocab = static_cast<int32_t>(vocab_);
  args_.params = At<kernels::SamplingRowParams>(d, o_params);
  if (penalties) {
    args_.penalty_offsets = At<int32_t>(d, o_pen_off);
    args_.penalty_tokens = At<int32_t>(d, o_pen_tok);
    args_.penalty_output_counts = At<int32_t>(d, o_pen_cnt);
    args_.penalty_in_prompt = At<uint8_t>(d, o_pen_flag);
  }
  if (masks > 0) {
    args_.allowed_bitmask = At<uint32_t>(d, o_masks);
    args_.mask_words = static_cast<int32_t>(mask_words);
    args_.mask_count = masks;
  }
  if (suppress) {
    args_.suppress_offsets = At<int32_t>(d, o_sup_off);
    args_.suppress_tokens = At<int32_t>(d, o_sup_tok);
  }
  if (bias_) {
    args_.bias_offsets = At<int32_t>(d, o_bias_off_);
    args_.bias_tokens = At<int32_t>(d, o_bias_tok_);
    args_.bias_values = At<float>(d, o_bias_val_);
  }
  args_.token_ids = At<int32_t>(o, off_tokens_);
  args_.row_status = At<int32_t>(o, off_status_);
  args_.logprobs = At<float>(o, off_logprobs_);
  args_.ranks = At<int32_t>(o, off_ranks_);
  args_.top_n_stride = top_n;
  if (top_n > 0) {
    args_.top_ids = At<int32_t>(o, off_top_ids_);
    args_.top_logprobs = At<float>(o, off_top_lps_);
  }
  ready_ = true;
  return absl::OkStatus();
}

absl::Status DeviceSampler::Run(float* logits,
                                std::vector<absl::StatusOr<SampleResult>>* results) {
  const size_t n = rows_.size();
  results->clear();
  if (!ready_) {
    return FailedPrecondition("device sampling: Run without a successful Prepare");
  }
  ready_ = false;  // one Run per Prepare
  if (n == 0) return absl::OkStatus();
  if (logits == nullptr) return InvalidArgument("device sampling: no logits");
  args_.logits = logits;
  TANDEM_RETURN_IF_ERROR(backend_->SampleTokens(args_));
  TANDEM_RETURN_IF_ERROR(backend_->Synchronize());
  results_.resize(out_bytes_);
  TANDEM_RETURN_IF_ERROR(
      backend_->device().CopyToHost(results_.data(), out_.data(), out_bytes_));
  args_.rows = 0;  // one Run per Prepare
  unsigned char* h = results_.data();
  const int32_t* tokens = At<int32_t>(h, off_tokens_);
  const int32_t* status = At<int32_t>(h, off_status_);
  const float* logprobs = At<float>(h, off_logprobs_);
  const int32_t top_n = args_.top_n_stride;
  const int32_t* top_ids = At<int32_t>(h, off_top_ids_);
  const float* top_lps = At<float>(h, off_top_lps_);
  const int32_t* ranks = At<int32_t>(h, off_ranks_);
  results->reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (status[i] != kernels::kSampleOk) {
      // A scored row's errors in engine::ScoreToken's words.
      results->push_back(rows_[i].scored && status[i] == kernels::kSampleAllMasked
                             ? InvalidArgument("every logit is -inf")
                             : RowError(status[i]));
      continue;
    }
    if (tokens[i] < 0 || tokens[i] >= vocab_) {
      return Internal("device sampling: row ", i, " chose token ", tokens[i],
                      " outside the vocabulary of ", vocab_);
    }
    SampleResult res;
    res.token_id = tokens[i];
    const RowOut& p = rows_[i];
    if (p.scored) res.rank = ranks[i];
    if (p.logprobs) {
      res.logprob = logprobs[i];
      for (int32_t k = 0; k < p.top_logprobs && k < top_n; ++k) {
        const int32_t id = top_ids[i * top_n + k];
        if (id < 0) break;
        res.top.push_back({id, top_lps[i * top_n + k]});
      }
    }
    results->push_back(std::move(res));
  }
  return absl::OkStatus();
}

}  // namespace tandem::engine
