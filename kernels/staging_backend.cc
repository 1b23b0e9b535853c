#include "kernels/staging_backend.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/op_checks.h"

namespace tandem::kernels {
namespace {

// Elements spanned by `rows` rows of `n` with row stride `ld` (0 when empty). A
// stride below n (which the backend rejects) is taken as n. Shapes the backend
// checks with the shared op_checks functions are checked here first, with the
// same messages, so that no bad shape makes the adapter read past host buffers.
size_t Span(int64_t rows, int64_t n, int64_t ld) {
  if (rows <= 0 || n <= 0) return 0;
  return static_cast<size_t>((rows - 1) * std::max(ld, n) + n);
}
size_t Count(int64_t a, int64_t b = 1, int64_t c = 1) {
  if (a <= 0 || b <= 0 || c <= 0) return 0;
  return static_cast<size_t>(a * b * c);
}

uint8_t GuardByte(size_t i) { return static_cast<uint8_t>(0xA5 ^ (i * 29)); }

// The device copies of one op's arguments.
class Stage {
 public:
  Stage(Backend& backend, const char* op, size_t guard)
      : backend_(backend), dev_(backend.device()), op_(op), guard_(guard) {}

  // An output (also uploaded: in/out buffers, accumulation, untouched padding),
  // surrounded by guard bytes. Register outputs before the inputs that may alias
  // them.
  template <typename T>
  absl::StatusOr<T*> Out(T* host, size_t count, const char* what) {
    if (host == nullptr) return nullptr;
    TANDEM_ASSIGN_OR_RETURN(void* p,
                            Add(host, count * sizeof(T), what, /*output=*/true));
    return static_cast<T*>(p);
  }
  // An input; a range inside an already staged buffer shares it.
  template <typename T>
  absl::StatusOr<const T*> In(const T* host, size_t count, const char* what) {
    if (host == nullptr) return nullptr;
    TANDEM_ASSIGN_OR_RETURN(void* p,
                            Add(host, count * sizeof(T), what, /*output=*/false));
    return static_cast<const T*>(p);
  }
  // A freshly built table (device pointers), uploaded as an input.
  template <typename T>
  absl::StatusOr<const T*> Table(const std::vector<T>& table, const char* what) {
    if (table.empty()) return nullptr;
    owned_tables_.emplace_back(
        reinterpret_cast<const char*>(table.data()),
        reinterpret_cast<const char*>(table.data()) + table.size() * sizeof(T));
    TANDEM_ASSIGN_OR_RETURN(
        void* p, Add(owned_tables_.back().data(), table.size() * sizeof(T), what,
                     /*output=*/false, /*shareable=*/false));
    return static_cast<const T*>(p);
  }

  // After the op: synchronises the device backend, checks the guards, downloads
  // the outputs. An op error is returned as it is (outputs are then unspecified).
  absl::Status Finish(absl::Status op_status) {
    if (!op_status.ok()) {
      (void)backend_.Synchronize();  // drain whatever the op queued
      return op_status;
    }
    const absl::Status sync = backend_.Synchronize();
    for (Buf& b : bufs_) {
      if (!b.output) continue;
      std::vector<uint8_t> all(b.bytes + 2 * guard_);
      TANDEM_RETURN_IF_ERROR(dev_.CopyToHost(all.data(), b.mem.data(), all.size()));
      for (size_t i = 0; i < guard_; ++i) {
        const bool before = all[i] != GuardByte(i);
        const bool after = all[guard_ + b.bytes + i] != GuardByte(i);
        if (before || after) {
          const std::string msg = absl::StrCat(
              "staging (", backend_.name(), "): ", op_, " wrote outside its output ",
              b.what, " (", b.bytes, " bytes): guard byte ", before ? "-" : "+",
              before ? guard_ - i : i + 1, " ", before ? "before" : "after",
              " it changed");
          std::fprintf(stderr, "%s\n", msg.c_str());
          return absl::InternalError(msg);
        }
      }
      if (sync.ok())
        std::memcpy(const_cast<char*>(b.host), all.data() + guard_, b.bytes);
    }
    return sync;
  }

 private:
  struct Buf {
    DeviceBuffer mem;
    const char* host = nullptr;
    size_t bytes = 0;
    bool output = false;
    bool shareable = true;
    const char* what = "";
    char* device() const { return mem.as<char>() + (output ? guard : 0); }
    size_t guard = 0;
  };

  absl::StatusOr<void*> Add(const void* host_ptr, size_t bytes, const char* what,
                            bool output, bool shareable = true) {
    const char* host = static_cast<const char*>(host_ptr);
    if (shareable) {
      for (const Buf& b : bufs_) {
        if (b.shareable && host >= b.host && host + bytes <= b.host + b.bytes &&
            (bytes > 0 || host < b.host + b.bytes)) {
          if (output && !b.output) break;  // outputs are registered first
          return b.device() + (host - b.host);
        }
      }
    }
    Buf b;
    b.host = host;
    b.bytes = bytes;
    b.output = output;
    b.shareable = shareable;
    b.what = what;
    b.guard = output ? guard_ : 0;
    const size_t total = bytes + 2 * b.guard;
    // Zero-extent arguments still get a (1-byte) device pointer: non-null stays
    // non-null for the backend's own checks.
    auto mem = DeviceBuffer::Allocate(&dev_, std::max<size_t>(total, 1));
    if (!mem.ok()) {
      return Annotate(mem.status(), absl::StrCat("staging ", op_, " ", what));
    }
    b.mem = std::move(mem).value();
    if (total > 0) {
      std::vector<uint8_t> init(total);
      for (size_t i = 0; i < b.guard; ++i)
        init[i] = init[b.guard + bytes + i] = GuardByte(i);
      if (bytes > 0) std::memcpy(init.data() + b.guard, host, bytes);
      TANDEM_RETURN_IF_ERROR(dev_.CopyToDevice(b.mem.data(), init.data(), total));
      // The host vector goes out of scope: let the copy run first.
      TANDEM_RETURN_IF_ERROR(dev_.Synchronize());
    }
    bufs_.push_back(std::move(b));
    return bufs_.back().device();
  }

  Backend& backend_;
  Device& dev_;
  const char* op_;
  size_t guard_;
  std::vector<Buf> bufs_;
  std::vector<std::vector<char>> owned_tables_;
};

#define STAGE_OUT(var, host, count, what) \
  TANDEM_ASSIGN_OR_RETURN(auto* var, st.Out((host), (count), (what)))
#define STAGE_IN(var, host, count, what) \
  TANDEM_ASSIGN_OR_RETURN(auto* var, st.In((host), (count), (what)))

}  // namespace

StagingBackend::StagingBackend(std::unique_ptr<Backend> device_backend, Options options)
    : inner_(std::move(device_backend)), options_(options), host_(CreateHostDevice()) {}

StagingBackend::~StagingBackend() = default;

absl::Status StagingBackend::GemmBf16(const float* x, int64_t ldx, const uint16_t* w,
                                      int64_t ldw, float* y, int64_t ldy, int64_t m,
                                      int64_t n, int64_t k, bool accumulate) {
  TANDEM_RETURN_IF_ERROR(CheckGemm(x, ldx, w, ldw, y, ldy, m, n, k));
  Stage st(*inner_, "GemmBf16", options_.guard_bytes);
  STAGE_OUT(dy, y, Span(m, n, ldy), "y");
  STAGE_IN(dx, x, Span(m, k, ldx), "x");
  STAGE_IN(dw, w, Span(n, k, ldw), "w");
  return st.Finish(inner_->GemmBf16(dx, ldx, dw, ldw, dy, ldy, m, n, k, accumulate));
}

absl::Status StagingBackend::GemmF32(const float* x, int64_t ldx, const float* w,
                                     int64_t ldw, float* y, int64_t ldy, int64_t m,
                                     int64_t n, int64_t k, bool accumulate) {
  TANDEM_RETURN_IF_ERROR(CheckGemm(x, ldx, w, ldw, y, ldy, m, n, k));
  Stage st(*inner_, "GemmF32", options_.guard_bytes);
  STAGE_OUT(dy, y, Span(m, n, ldy), "y");
  STAGE_IN(dx, x, Span(m, k, ldx), "x");
  STAGE_IN(dw, w, Span(n, k, ldw), "w");
  return st.Finish(inner_->GemmF32(dx, ldx, dw, ldw, dy, ldy, m, n, k, accumulate));
}

absl::Status StagingBackend::RmsNorm(const float* x, int64_t ldx, const float* w,
                                     float* y, int64_t ldy, int64_t rows, int64_t n,
                                     float eps) {
  Stage st(*inner_, "RmsNorm", options_.guard_bytes);
  STAGE_OUT(dy, y, Span(rows, n, ldy), "y");
  STAGE_IN(dx, x, Span(rows, n, ldx), "x");
  STAGE_IN(dw, w, Count(n), "w");
  return st.Finish(inner_->RmsNorm(dx, ldx, dw, dy, ldy, rows, n, eps));
}

absl::Status StagingBackend::L2NormHeads(const float* x, int64_t ldx, float* y,
                                         int64_t ldy, int64_t rows, int64_t heads,
                                         int64_t d, float eps, float scale) {
  Stage st(*inner_, "L2NormHeads", options_.guard_bytes);
  const int64_t width = heads > 0 && d > 0 ? heads * d : 0;
  STAGE_OUT(dy, y, Span(rows, width, ldy), "y");
  STAGE_IN(dx, x, Span(rows, width, ldx), "x");
  return st.Finish(inner_->L2NormHeads(dx, ldx, dy, ldy, rows, heads, d, eps, scale));
}

absl::Status StagingBackend::SituGlu(const float* g, int64_t ldg, const float* u,
                                     int64_t ldu, float* out, int64_t ldo, int64_t rows,
                                     int64_t n, float beta, float lbeta) {
  Stage st(*inner_, "SituGlu", options_.guard_bytes);
  STAGE_OUT(dout, out, Span(rows, n, ldo), "out");
  STAGE_IN(dg, g, Span(rows, n, ldg), "g");
  STAGE_IN(du, u, Span(rows, n, ldu), "u");
  return st.Finish(inner_->SituGlu(dg, ldg, du, ldu, dout, ldo, rows, n, beta, lbeta));
}

absl::Status StagingBackend::MulSigmoid(const float* x, int64_t ldx, const float* gate,
                                        int64_t ldg, float* out, int64_t ldo,
                                        int64_t rows, int64_t n) {
  Stage st(*inner_, "MulSigmoid", options_.guard_bytes);
  STAGE_OUT(dout, out, Span(rows, n, ldo), "out");
  STAGE_IN(dx, x, Span(rows, n, ldx), "x");
  STAGE_IN(dgate, gate, Span(rows, n, ldg), "gate");
  return st.Finish(inner_->MulSigmoid(dx, ldx, dgate, ldg, dout, ldo, rows, n));
}

absl::Status StagingBackend::AddInPlace(float* y, const float* x, int64_t n) {
  Stage st(*inner_, "AddInPlace", options_.guard_bytes);
  STAGE_OUT(dy, y, Count(n), "y");
  STAGE_IN(dx, x, Count(n), "x");
  return st.Finish(inner_->AddInPlace(dy, dx, n));
}

absl::Status StagingBackend::EmbeddingGatherRows(const uint16_t* table, int64_t vocab,
                                                 int64_t first, int64_t rows,
                                                 int64_t hidden, const int32_t* ids,
                                                 int64_t tokens, float* out) {
  TANDEM_RETURN_IF_ERROR(CheckEmbeddingRows(vocab, first, rows));
  if (options_.check_contents && ids != nullptr) {
    for (int64_t t = 0; t < tokens; ++t) {  // the CPU backends' check and message
      if (ids[t] < 0 || ids[t] >= vocab) {
        return InvalidArgument("embedding: token id ", ids[t], " out of range [0, ",
                               vocab, ")");
      }
    }
  }
  Stage st(*inner_, "EmbeddingGather", options_.guard_bytes);
  STAGE_OUT(dout, out, Count(tokens, hidden), "out");
  STAGE_IN(dtable, table, Count(rows, hidden), "table");
  STAGE_IN(dids, ids, Count(tokens), "ids");
  return st.Finish(inner_->EmbeddingGatherRows(dtable, vocab, first, rows, hidden, dids,
                                               tokens, dout));
}

absl::Status StagingBackend::CausalConv1dSilu(const float* x, int64_t ldx,
                                              const float* w, int64_t kernel,
                                              float* state, float* y, int64_t ldy,
                                              int64_t tokens, int64_t channels) {
  Stage st(*inner_, "CausalConv1dSilu", options_.guard_bytes);
  STAGE_OUT(dy, y, Span(tokens, channels, ldy), "y");
  STAGE_OUT(dstate, state, Count(kernel - 1, channels), "state");
  STAGE_IN(dx, x, Span(tokens, channels, ldx), "x");
  STAGE_IN(dw, w, Count(channels, kernel), "w");
  return st.Finish(
      inner_->CausalConv1dSilu(dx, ldx, dw, kernel, dstate, dy, ldy, tokens, channels));
}

absl::Status StagingBackend::KdaGates(const float* graw, int64_t ld_graw,
                                      const float* a_log, const float* dt_bias,
                                      const float* braw, int64_t ld_braw,
                                      float lower_bound, int64_t tokens, int64_t heads,
                                      int64_t d, float* g, float* beta) {
  Stage st(*inner_, "KdaGates", options_.guard_bytes);
  const int64_t width = heads > 0 && d > 0 ? heads * d : 0;
  STAGE_OUT(dg, g, Count(tokens, width), "g");
  STAGE_OUT(dbeta, beta, Count(tokens, heads), "beta");
  STAGE_IN(dgraw, graw, Span(tokens, width, ld_graw), "graw");
  STAGE_IN(da, a_log, Count(heads), "a_log");
  STAGE_IN(ddt, dt_bias, Count(width), "dt_bias");
  STAGE_IN(dbraw, braw, Span(tokens, heads, ld_braw), "braw");
  return st.Finish(inner_->KdaGates(dgraw, ld_graw, da, ddt, dbraw, ld_braw,
                                    lower_bound, tokens, heads, d, dg, dbeta));
}

absl::Status StagingBackend::Kda(const KdaArgs& a, bool chunked) {
  TANDEM_RETURN_IF_ERROR(CheckKda(a));
  Stage st(*inner_, chunked ? "KdaChunked" : "KdaRecurrent", options_.guard_bytes);
  KdaArgs d = a;
  const int64_t wk = a.heads > 0 && a.head_dim_k > 0 ? a.heads * a.head_dim_k : 0;
  const int64_t wv = a.heads > 0 && a.head_dim_v > 0 ? a.heads * a.head_dim_v : 0;
  STAGE_OUT(dout, a.out, Span(a.tokens, wv, a.ld_out), "out");
  STAGE_OUT(dstate, a.state, Count(a.heads, a.head_dim_k, a.head_dim_v), "state");
  STAGE_IN(dq, a.q, Span(a.tokens, wk, a.ld_qk), "q");
  STAGE_IN(dk, a.k, Span(a.tokens, wk, a.ld_qk), "k");
  STAGE_IN(dv, a.v, Span(a.tokens, wv, a.ld_v), "v");
  STAGE_IN(dg, a.g, Count(a.tokens, wk), "g");
  STAGE_IN(dbeta, a.beta, Count(a.tokens, a.heads), "beta");
  d.out = dout;
  d.state = dstate;
  d.q = dq;
  d.k = dk;
  d.v = dv;
  d.g = dg;
  d.beta = dbeta;
  return st.Finish(chunked ? inner_->KdaChunked(d) : inner_->KdaRecurrent(d));
}

absl::Status StagingBackend::KdaRecurrent(const KdaArgs& args) {
  return Kda(args, /*chunked=*/false);
}
absl::Status StagingBackend::KdaChunked(const KdaArgs& args) {
  return Kda(args, /*chunked=*/true);
}

absl::Status StagingBackend::KdaOutputGate(const float* o, int64_t ld_o,
                                           const float* norm_w, const float* gate,
                                           int64_t ld_gate, float* out, int64_t ld_out,
                                           int64_t tokens, int64_t heads, int64_t d,
                                           float eps) {
  Stage st(*inner_, "KdaOutputGate", options_.guard_bytes);
  const int64_t width = heads > 0 && d > 0 ? heads * d : 0;
  STAGE_OUT(dout, out, Span(tokens, width, ld_out), "out");
  STAGE_IN(dO, o, Span(tokens, width, ld_o), "o");
  STAGE_IN(dnw, norm_w, Count(d), "norm_w");
  STAGE_IN(dgate, gate, Span(tokens, width, ld_gate), "gate");
  return st.Finish(inner_->KdaOutputGate(dO, ld_o, dnw, dgate, ld_gate, dout, ld_out,
                                         tokens, heads, d, eps));
}

absl::Status StagingBackend::PagedCacheWrite(const float* src, int64_t ld_src,
                                             const int32_t* slots, int64_t tokens,
                                             int64_t width, uint16_t* cache,
                                             int64_t num_slots) {
  if (options_.check_contents && slots != nullptr) {
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, width, ld_src, "cache_write"));
    for (int64_t t = 0; t < tokens; ++t) {  // the CPU backends' check and message
      if (slots[t] >= num_slots) {
        return InvalidArgument("cache_write: slot ", slots[t], " >= ", num_slots);
      }
    }
  }
  Stage st(*inner_, "PagedCacheWrite", options_.guard_bytes);
  STAGE_OUT(dcache, cache, Count(num_slots, width), "cache");
  STAGE_IN(dsrc, src, Span(tokens, width, ld_src), "src");
  STAGE_IN(dslots, slots, Count(tokens), "slots");
  return st.Finish(
      inner_->PagedCacheWrite(dsrc, ld_src, dslots, tokens, width, dcache, num_slots));
}

absl::Status StagingBackend::Mla(const MlaArgs& a, bool absorbed) {
  if (options_.check_contents) TANDEM_RETURN_IF_ERROR(CheckMla(a));
  Stage st(*inner_, absorbed ? "MlaAttentionAbsorbed" : "MlaAttentionExpanded",
           options_.guard_bytes);
  MlaArgs d = a;
  // The device backend sizes its grid from num_tokens (a host copy).
  if (d.num_tokens == 0 && a.query_start != nullptr && a.num_seqs > 0) {
    d.num_tokens = a.query_start[a.num_seqs];
  }
  const int64_t qw =
      a.heads > 0 ? a.heads * std::max<int64_t>(a.nope_dim + a.rope_dim, 0) : 0;
  const int64_t ow = a.heads > 0 && a.v_dim > 0 ? a.heads * a.v_dim : 0;
  const int64_t width = std::max<int64_t>(a.kv_lora_rank + a.rope_dim, 0);
  STAGE_OUT(dout, a.out, Span(d.num_tokens, ow, a.ld_out), "out");
  STAGE_IN(dlens, a.seq_lens, Count(a.num_seqs), "seq_lens");
  STAGE_IN(dqs, a.query_start, a.num_seqs >= 0 ? Count(a.num_seqs + 1) : 0,
           "query_start");
  STAGE_IN(dtables, a.block_tables, Count(a.num_seqs, a.block_table_stride),
           "block_tables");
  STAGE_IN(dcache, a.kv_cache, Count(a.num_blocks, a.block_size, width), "kv_cache");
  STAGE_IN(dkvb, a.kv_b_proj,
           Count(a.heads, std::max<int64_t>(a.nope_dim + a.v_dim, 0), a.kv_lora_rank),
           "kv_b_proj");
  STAGE_IN(dq, a.q, Span(d.num_tokens, qw, a.ld_q), "q");
  d.out = dout;
  d.seq_lens = dlens;
  d.query_start = dqs;
  d.block_tables = dtables;
  d.kv_cache = dcache;
  d.kv_b_proj = dkvb;
  d.q = dq;
  return st.Finish(absorbed ? inner_->MlaAttentionAbsorbed(d)
                            : inner_->MlaAttentionExpanded(d));
}

absl::Status StagingBackend::MlaAttentionExpanded(const MlaArgs& args) {
  return Mla(args, /*absorbed=*/false);
}
absl::Status StagingBackend::MlaAttentionAbsorbed(const MlaArgs& args) {
  return Mla(args, /*absorbed=*/true);
}

absl::Status StagingBackend::RouterTopK(const float* x, int64_t ldx,
                                        const uint16_t* gate, const float* bias,
                                        int64_t tokens, int64_t hidden,
                                        int64_t num_experts, int64_t top_k,
                                        bool renormalize, float scaling, int32_t* ids,
                                        float* weights) {
  Stage st(*inner_, "RouterTopK", options_.guard_bytes);
  STAGE_OUT(dids, ids, Count(tokens, top_k), "ids");
  STAGE_OUT(dweights, weights, Count(tokens, top_k), "weights");
  STAGE_IN(dx, x, Span(tokens, hidden, ldx), "x");
  STAGE_IN(dgate, gate, Count(num_experts, hidden), "gate");
  STAGE_IN(dbias, bias, Count(num_experts), "bias");
  return st.Finish(inner_->RouterTopK(dx, ldx, dgate, dbias, tokens, hidden,
                                      num_experts, top_k, renormalize, scaling, dids,
                                      dweights));
}

absl::Status StagingBackend::MoeMxfp4(const MoeArgs& a) {
  TANDEM_RETURN_IF_ERROR(options_.check_contents ? CheckMoe(a) : CheckMoeShape(a));
  Stage st(*inner_, "MoeMxfp4", options_.guard_bytes);
  MoeArgs d = a;
  STAGE_OUT(dout, a.out, Span(a.tokens, a.hidden, a.ld_out), "out");
  STAGE_IN(dz, a.z, Span(a.tokens, a.hidden, a.ld_z), "z");
  STAGE_IN(dids, a.ids, Count(a.tokens, a.top_k), "ids");
  STAGE_IN(dw, a.weights, Count(a.tokens, a.top_k), "weights");
  const Mxfp4Expert* dexperts = nullptr;
  if (a.experts != nullptr && a.num_experts > 0) {
    const size_t packed = Count(a.inter, a.hidden) / 2;
    const size_t scales = Count(a.inter, a.hidden) / 32;
    std::vector<Mxfp4Expert> table(a.num_experts);
    for (int64_t e = 0; e < a.num_experts; ++e) {
      const Mxfp4Expert& h = a.experts[e];
      Mxfp4Expert& t = table[e];
      STAGE_IN(w1p, h.w1_packed, packed, "w1_packed");
      STAGE_IN(w1s, h.w1_scale, scales, "w1_scale");
      STAGE_IN(w3p, h.w3_packed, packed, "w3_packed");
      STAGE_IN(w3s, h.w3_scale, scales, "w3_scale");
      STAGE_IN(w2p, h.w2_packed, packed, "w2_packed");
      STAGE_IN(w2s, h.w2_scale, scales, "w2_scale");
      t = {w1p, w1s, w3p, w3s, w2p, w2s};
    }
    TANDEM_ASSIGN_OR_RETURN(dexperts, st.Table(table, "experts"));
  }
  d.out = dout;
  d.z = dz;
  d.ids = dids;
  d.weights = dw;
  d.experts = dexperts;
  return st.Finish(inner_->MoeMxfp4(d));
}

absl::Status StagingBackend::AttnResMix(const float* const* bank, int64_t bank_size,
                                        const float* p, const float* proj_w,
                                        const float* norm_w, float eps, int64_t tokens,
                                        int64_t hidden, float* out) {
  Stage st(*inner_, "AttnResMix", options_.guard_bytes);
  STAGE_OUT(dout, out, Count(tokens, hidden), "out");
  STAGE_IN(dp, p, Count(tokens, hidden), "p");
  STAGE_IN(dproj, proj_w, Count(hidden), "proj_w");
  STAGE_IN(dnorm, norm_w, Count(hidden), "norm_w");
  const float* const* dbank = nullptr;
  if (bank != nullptr && bank_size > 0) {
    std::vector<const float*> table(bank_size);
    for (int64_t j = 0; j < bank_size; ++j) {
      STAGE_IN(b, bank[j], Count(tokens, hidden), "bank entry");
      table[j] = b;
    }
    TANDEM_ASSIGN_OR_RETURN(dbank, st.Table(table, "bank"));
  }
  return st.Finish(inner_->AttnResMix(dbank, bank_size, dp, dproj, dnorm, eps, tokens,
                                      hidden, dout));
}

absl::Status StagingBackend::ChunkHashes(const ChunkHashArgs& a) {
  TANDEM_RETURN_IF_ERROR(options_.check_contents ? CheckChunkHashes(a)
                                                 : CheckChunkHashShape(a));
  Stage st(*inner_, "ChunkHashes", options_.guard_bytes);
  ChunkHashArgs d = a;
  STAGE_OUT(dhashes, a.hashes, static_cast<size_t>(NumHashChunks(a)), "hashes");
  const ByteSegment* dsegs = nullptr;
  if (a.segments != nullptr && a.num_segments > 0) {
    std::vector<ByteSegment> table(a.segments, a.segments + a.num_segments);
    for (ByteSegment& seg : table) {
      STAGE_IN(data, seg.data, static_cast<size_t>(std::max<int64_t>(seg.bytes, 0)),
               "segment");
      seg.data = data;
    }
    TANDEM_ASSIGN_OR_RETURN(dsegs, st.Table(table, "segments"));
  }
  d.segments = dsegs;
  d.hashes = dhashes;
  d.stream = nullptr;  // the host's streams are not the device backend's
  return st.Finish(inner_->ChunkHashes(d));
}

absl::Status StagingBackend::Rope2d(float* x, int64_t ldx, const int32_t* pos,
                                    int64_t tokens, int64_t heads, int64_t head_dim,
                                    float theta) {
  TANDEM_RETURN_IF_ERROR(
      options_.check_contents
          ? CheckRope2d(x, ldx, pos, tokens, heads, head_dim, theta)
          : CheckRope2dShape(x, ldx, pos, tokens, heads, head_dim, theta));
  Stage st(*inner_, "Rope2d", options_.guard_bytes);
  const int64_t width = heads > 0 && head_dim > 0 ? heads * head_dim : 0;
  STAGE_OUT(dx, x, Span(tokens, width, ldx), "x");
  STAGE_IN(dpos, pos, Count(tokens, 2), "pos");
  return st.Finish(inner_->Rope2d(dx, ldx, dpos, tokens, heads, head_dim, theta));
}

absl::Status StagingBackend::Gelu(const float* x, int64_t ldx, float* y, int64_t ldy,
                                  int64_t rows, int64_t n, bool tanh_approx) {
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldx, "gelu"));
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldy, "gelu"));
  Stage st(*inner_, "Gelu", options_.guard_bytes);
  STAGE_OUT(dy, y, Span(rows, n, ldy), "y");
  STAGE_IN(dx, x, Span(rows, n, ldx), "x");
  return st.Finish(inner_->Gelu(dx, ldx, dy, ldy, rows, n, tanh_approx));
}

absl::Status StagingBackend::VisionAttention(const VisionAttnArgs& a) {
  TANDEM_RETURN_IF_ERROR(options_.check_contents ? CheckVisionAttention(a)
                                                 : CheckVisionAttentionShape(a));
  Stage st(*inner_, "VisionAttention", options_.guard_bytes);
  VisionAttnArgs d = a;
  const int64_t width = a.heads > 0 && a.head_dim > 0 ? a.heads * a.head_dim : 0;
  STAGE_OUT(dout, a.out, Span(a.num_tokens, width, a.ld_out), "out");
  STAGE_IN(dcu, a.cu_seqlens, a.num_images >= 0 ? Count(a.num_images + 1) : 0,
           "cu_seqlens");
  STAGE_IN(dq, a.q, Span(a.num_tokens, width, a.ld_qkv), "q");
  STAGE_IN(dk, a.k, Span(a.num_tokens, width, a.ld_qkv), "k");
  STAGE_IN(dv, a.v, Span(a.num_tokens, width, a.ld_qkv), "v");
  d.out = dout;
  d.cu_seqlens = dcu;
  d.q = dq;
  d.k = dk;
  d.v = dv;
  return st.Finish(inner_->VisionAttention(d));
}

absl::Status StagingBackend::Merge2x2(const float* x, int64_t ldx, int64_t grid_h,
                                      int64_t grid_w, int64_t d, float* out,
                                      int64_t ldo) {
  TANDEM_RETURN_IF_ERROR(CheckMerge2x2(x, ldx, grid_h, grid_w, d, out, ldo));
  Stage st(*inner_, "Merge2x2", options_.guard_bytes);
  STAGE_OUT(dout, out, Span(grid_h * grid_w / 4, 4 * d, ldo), "out");
  STAGE_IN(dx, x, Span(grid_h * grid_w, d, ldx), "x");
  return st.Finish(inner_->Merge2x2(dx, ldx, grid_h, grid_w, d, dout, ldo));
}

}  // namespace tandem::kernels
