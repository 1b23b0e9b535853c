#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/bf16.h"
#include "kernels/cpu/chunk_hash.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/onednn_gemm.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/vec_ops.h"
#include "kernels/op_checks.h"

namespace tandem::kernels {
namespace {

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Work below this many multiply-adds runs on the calling thread.
constexpr int64_t kParallelMacs = 1 << 15;

class CpuBackend final : public Backend {
 public:
  CpuBackend(CpuIsa isa, int threads, bool use_onednn)
      : isa_(isa),
        use_onednn_(use_onednn),
        name_(absl::StrCat("cpu_", IsaName(isa))),
        vec_(VecOpsFor(isa)),
        pool_(threads) {}

  absl::string_view name() const override { return name_; }
  Device& device() override { return *device_; }

  // ---- GEMM -----------------------------------------------------------------
  // Threads split N (in multiples of 8 rows of W) when N is large enough,
  // else M. With AVX512_BF16, X is first rounded to BF16 rows.
  absl::Status GemmBf16(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                        float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                        bool accumulate) override {
    TANDEM_RETURN_IF_ERROR(CheckGemm(x, ldx, w, ldw, y, ldy, m, n, k));
    if (m == 0 || n == 0) return absl::OkStatus();
    if (isa_ == CpuIsa::kAvx512Bf16) {
      std::vector<uint16_t>& xb = XBuffer(m * k);
      pool_.ParallelFor(m, [&](int64_t b, int64_t e, int) {
        internal::ConvertRowsToBf16Avx512Bf16(x + b * ldx, ldx, xb.data() + b * k, k,
                                              e - b, k);
      });
      if (m >= kOneDnnMinM && use_onednn_) {
        return onednn_.GemmBf16(xb.data(), w, ldw, y, ldy, m, n, k, accumulate);
      }
      Split(m, n, k, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
        internal::GemmBf16Avx512Bf16(xb.data() + m0 * k, k, w + n0 * ldw, ldw,
                                     y + m0 * ldy + n0, ldy, m1 - m0, n1 - n0, k,
                                     accumulate);
      });
      return absl::OkStatus();
    }
    auto* fn = isa_ >= CpuIsa::kAvx512 ? &internal::GemmBf16Avx512
               : isa_ == CpuIsa::kAvx2 ? &internal::GemmBf16Avx2
                                       : &internal::GemmBf16Generic;
    Split(m, n, k, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
      fn(x + m0 * ldx, ldx, w + n0 * ldw, ldw, y + m0 * ldy + n0, ldy, m1 - m0, n1 - n0,
         k, accumulate);
    });
    return absl::OkStatus();
  }

  absl::Status GemmF32(const float* x, int64_t ldx, const float* w, int64_t ldw,
                       float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                       bool accumulate) override {
    TANDEM_RETURN_IF_ERROR(CheckGemm(x, ldx, w, ldw, y, ldy, m, n, k));
    if (m == 0 || n == 0) return absl::OkStatus();
    auto* fn = isa_ >= CpuIsa::kAvx512 ? &internal::GemmF32Avx512
               : isa_ == CpuIsa::kAvx2 ? &internal::GemmF32Avx2
                                       : &internal::GemmF32Generic;
    Split(m, n, k, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
      fn(x + m0 * ldx, ldx, w + n0 * ldw, ldw, y + m0 * ldy + n0, ldy, m1 - m0, n1 - n0,
         k, accumulate);
    });
    return absl::OkStatus();
  }

  // ---- Element-wise -----------------------------------------------------------
  absl::Status RmsNorm(const float* x, int64_t ldx, const float* w, float* y,
                       int64_t ldy, int64_t rows, int64_t n, float eps) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldx, "rmsnorm"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldy, "rmsnorm"));
    Rows(rows, n, [&](int64_t b, int64_t e) {
      if (ldx == n && ldy == n) {
        RmsNormIsa(isa_, x + b * n, w, y + b * n, e - b, n, eps);
      } else {
        for (int64_t r = b; r < e; ++r)
          RmsNormIsa(isa_, x + r * ldx, w, y + r * ldy, 1, n, eps);
      }
    });
    return absl::OkStatus();
  }

  absl::Status L2NormHeads(const float* x, int64_t ldx, float* y, int64_t ldy,
                           int64_t rows, int64_t heads, int64_t d, float eps,
                           float scale) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, heads * d, ldx, "l2norm"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, heads * d, ldy, "l2norm"));
    Rows(rows * heads, d, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t r = i / heads, h = i % heads;
        const float* xh = x + r * ldx + h * d;
        float* yh = y + r * ldy + h * d;
        const float f = scale / std::sqrt(vec_.dot(xh, xh, d) + eps);
        for (int64_t c = 0; c < d; ++c) yh[c] = xh[c] * f;
      }
    });
    return absl::OkStatus();
  }

  absl::Status SituGlu(const float* g, int64_t ldg, const float* u, int64_t ldu,
                       float* out, int64_t ldo, int64_t rows, int64_t n, float beta,
                       float lbeta) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldg, "situ"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldu, "situ"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldo, "situ"));
    Rows(rows, n * 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        SituRow(g + r * ldg, u + r * ldu, out + r * ldo, n, beta, lbeta);
      }
    });
    return absl::OkStatus();
  }

  absl::Status MulSigmoid(const float* x, int64_t ldx, const float* gate, int64_t ldg,
                          float* out, int64_t ldo, int64_t rows, int64_t n) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldx, "mul_sigmoid"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldg, "mul_sigmoid"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldo, "mul_sigmoid"));
    Rows(rows, n * 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        for (int64_t i = 0; i < n; ++i) {
          out[r * ldo + i] = x[r * ldx + i] * Sigmoid(gate[r * ldg + i]);
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status AddInPlace(float* y, const float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) y[i] += x[i];
    return absl::OkStatus();
  }

  absl::Status EmbeddingGatherRows(const uint16_t* table, int64_t vocab, int64_t first,
                                   int64_t rows, int64_t hidden, const int32_t* ids,
                                   int64_t tokens, float* out) override {
    TANDEM_RETURN_IF_ERROR(CheckEmbeddingRows(vocab, first, rows));
    for (int64_t t = 0; t < tokens; ++t) {
      if (ids[t] < 0 || ids[t] >= vocab) {
        return InvalidArgument("embedding: token id ", ids[t], " out of range [0, ",
                               vocab, ")");
      }
    }
    Rows(tokens, hidden, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        float* dst = out + t * hidden;
        if (ids[t] < first || ids[t] >= first + rows) {
          std::fill(dst, dst + hidden, 0.0f);
          continue;
        }
        const uint16_t* row = table + static_cast<int64_t>(ids[t] - first) * hidden;
        for (int64_t i = 0; i < hidden; ++i) dst[i] = Bf16ToF32(row[i]);
      }
    });
    return absl::OkStatus();
  }

  // ---- KDA ------------------------------------------------------------------
  absl::Status CausalConv1dSilu(const float* x, int64_t ldx, const float* w,
                                int64_t kernel, float* state, float* y, int64_t ldy,
                                int64_t tokens, int64_t channels) override {
    if (kernel < 1) return InvalidArgument("conv1d: kernel must be >= 1");
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, channels, ldx, "conv1d"));
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, channels, ldy, "conv1d"));
    const int64_t tail = kernel - 1;
    // Channels are independent: each thread owns a channel range, including its
    // slice of the state.
    Rows(channels, tokens * kernel, [&](int64_t c0, int64_t c1) {
      const int64_t nc = c1 - c0;
      std::vector<float> win(tail * nc);  // the last `tail` inputs, oldest first
      for (int64_t r = 0; r < tail; ++r) {
        std::memcpy(&win[r * nc], state + r * channels + c0, nc * sizeof(float));
      }
      std::vector<float> acc(nc);
      for (int64_t t = 0; t < tokens; ++t) {
        const float* xt = x + t * ldx + c0;
        for (int64_t c = 0; c < nc; ++c) acc[c] = w[(c0 + c) * kernel + tail] * xt[c];
        for (int64_t i = 0; i < tail; ++i) {
          for (int64_t c = 0; c < nc; ++c)
            acc[c] += w[(c0 + c) * kernel + i] * win[i * nc + c];
        }
        float* yt = y + t * ldy + c0;
        for (int64_t c = 0; c < nc; ++c) yt[c] = acc[c] * Sigmoid(acc[c]);
        if (tail > 0) {
          std::memmove(win.data(), win.data() + nc, (tail - 1) * nc * sizeof(float));
          std::memcpy(&win[(tail - 1) * nc], xt, nc * sizeof(float));
        }
      }
      for (int64_t r = 0; r < tail; ++r) {
        std::memcpy(state + r * channels + c0, &win[r * nc], nc * sizeof(float));
      }
    });
    return absl::OkStatus();
  }

  absl::Status KdaGates(const float* graw, int64_t ld_graw, const float* a_log,
                        const float* dt_bias, const float* braw, int64_t ld_braw,
                        float lower_bound, int64_t tokens, int64_t heads, int64_t d,
                        float* g, float* beta) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_graw, "kda_gates"));
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads, ld_braw, "kda_gates"));
    Rows(tokens, heads * d * 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          const float a = std::exp(a_log[h]);
          for (int64_t c = 0; c < d; ++c) {
            const float raw = graw[t * ld_graw + h * d + c] + dt_bias[h * d + c];
            g[(t * heads + h) * d + c] = lower_bound * Sigmoid(a * raw);
          }
          beta[t * heads + h] = Sigmoid(braw[t * ld_braw + h]);
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status KdaRecurrent(const KdaArgs& a) override {
    TANDEM_RETURN_IF_ERROR(CheckKda(a));
    const int64_t dk = a.head_dim_k, dv = a.head_dim_v;
    pool_.ParallelFor(a.heads, [&](int64_t h0, int64_t h1, int) {
      std::vector<float> decay(dk), sk(dv), delta(dv);
      for (int64_t h = h0; h < h1; ++h) {
        float* s = a.state + h * dk * dv;
        for (int64_t t = 0; t < a.tokens; ++t) {
          const float* q = a.q + t * a.ld_qk + h * dk;
          const float* k = a.k + t * a.ld_qk + h * dk;
          const float* v = a.v + t * a.ld_v + h * dv;
          const float b = a.beta[t * a.heads + h];
          vec_.exp_nonpos(a.g + (t * a.heads + h) * dk, decay.data(), dk);
          std::fill(sk.begin(), sk.end(), 0.0f);
          for (int64_t i = 0; i < dk; ++i) {
            float* row = s + i * dv;
            for (int64_t j = 0; j < dv; ++j) row[j] *= decay[i];
            vec_.axpy(k[i], row, sk.data(), dv);
          }
          for (int64_t j = 0; j < dv; ++j) delta[j] = v[j] - sk[j];
          float* o = a.out + t * a.ld_out + h * dv;
          std::fill(o, o + dv, 0.0f);
          for (int64_t i = 0; i < dk; ++i) {
            float* row = s + i * dv;
            vec_.axpy(b * k[i], delta.data(), row, dv);
            vec_.axpy(q[i], row, o, dv);
          }
        }
      }
    });
    return absl::OkStatus();
  }

  // Chunked form (see reference_backend.cc for the derivation): per head and chunk
  // of L <= 64 tokens with cumulative log-decay G,
  //   u_t = beta_t (v_t - S0^T (e^{G_t} k_t)) - sum_{j<t} beta_t (k_t.e^{G_t-G_j}.k_j)
  //   u_j o_t = S0^T (e^{G_t} q_t) + sum_{j<=t} (q_t.e^{G_t-G_j}.k_j) u_j S   = e^{G_L}
  //   S0 + sum_j (e^{G_L-G_j} k_j) u_j^T
  // Heads run in parallel; only exps of non-positive numbers are formed.
  absl::Status KdaChunked(const KdaArgs& a) override {
    TANDEM_RETURN_IF_ERROR(CheckKda(a));
    constexpr int64_t kChunk = 64, kSub = 16;
    const int64_t dk = a.head_dim_k, dv = a.head_dim_v;
    pool_.ParallelFor(a.heads, [&](int64_t h0, int64_t h1, int) {
      std::vector<float> big_g(kChunk * dk), eg(kChunk * dk), kg(kChunk * dk),
          qk(kChunk * dk), kdat(kChunk * dk), qdat(kChunk * dk), u(kChunk * dv),
          diff(dk), kd(kChunk * dk), kdt(dk * kChunk), qkm(kChunk * kChunk),
          amat(kChunk * kChunk), kl(kSub * dk), ql(kSub * dk), krt(dk * kChunk), ex(dk);
      for (int64_t h = h0; h < h1; ++h) {
        float* s = a.state + h * dk * dv;
        for (int64_t t0 = 0; t0 < a.tokens; t0 += kChunk) {
          const int64_t len = std::min(kChunk, a.tokens - t0);
          for (int64_t t = 0; t < len; ++t) {
            const float* g = a.g + ((t0 + t) * a.heads + h) * dk;
            const float* k = a.k + (t0 + t) * a.ld_qk + h * dk;
            const float* q = a.q + (t0 + t) * a.ld_qk + h * dk;
            std::memcpy(&kdat[t * dk], k, dk * sizeof(float));
            std::memcpy(&qdat[t * dk], q, dk * sizeof(float));
            for (int64_t c = 0; c < dk; ++c) {
              big_g[t * dk + c] = (t > 0 ? big_g[(t - 1) * dk + c] : 0.0f) + g[c];
            }
          }
          vec_.exp_nonpos(big_g.data(), eg.data(), len * dk);
          for (int64_t i = 0; i < len * dk; ++i) {
            kg[i] = eg[i] * kdat[i];
            qk[i] = eg[i] * qdat[i];
          }
          // Decayed key-key and query-key products for j <= t, in sub-blocks of
          // kSub tokens. Inside a sub-block: direct e^{G_t-G_j}. Across sub-blocks,
          // through the last token r of the previous sub-block (j <= r < t):
          // e^{G_t-G_j} = e^{G_t-G_r} e^{G_r-G_j}, both factors <= 1, so the
          // cross terms are one small GEMM with few exps and nothing can overflow.
          for (int64_t b0 = 0; b0 < len; b0 += kSub) {
            const int64_t b1 = std::min(len, b0 + kSub);
            for (int64_t t = b0; t < b1; ++t) {
              for (int64_t j = b0; j <= t; ++j) {
                qkm[t * kChunk + j] = vec_.decayed_dot(
                    &qdat[t * dk], &big_g[t * dk], &kdat[j * dk], &big_g[j * dk], dk);
                if (j < t) {
                  amat[t * kChunk + j] = vec_.decayed_dot(
                      &kdat[t * dk], &big_g[t * dk], &kdat[j * dk], &big_g[j * dk], dk);
                }
              }
              for (int64_t j = t + 1; j < len; ++j) qkm[t * kChunk + j] = 0.0f;
            }
            if (b0 == 0) continue;
            const float* gr = &big_g[(b0 - 1) * dk];
            for (int64_t t = b0; t < b1; ++t) {
              for (int64_t c = 0; c < dk; ++c) diff[c] = big_g[t * dk + c] - gr[c];
              vec_.exp_nonpos(diff.data(), ex.data(), dk);
              for (int64_t c = 0; c < dk; ++c) {
                kl[(t - b0) * dk + c] = kdat[t * dk + c] * ex[c];
                ql[(t - b0) * dk + c] = qdat[t * dk + c] * ex[c];
              }
            }
            for (int64_t j = 0; j < b0; ++j) {
              for (int64_t c = 0; c < dk; ++c) diff[c] = gr[c] - big_g[j * dk + c];
              vec_.exp_nonpos(diff.data(), ex.data(), dk);
              for (int64_t c = 0; c < dk; ++c)
                krt[c * kChunk + j] = kdat[j * dk + c] * ex[c];
            }
            vec_.gemm_nn(kl.data(), dk, krt.data(), kChunk, &amat[b0 * kChunk], kChunk,
                         b1 - b0, b0, dk, false);
            vec_.gemm_nn(ql.data(), dk, krt.data(), kChunk, &qkm[b0 * kChunk], kChunk,
                         b1 - b0, b0, dk, false);
          }
          // u = beta (v - (e^G k) S0), then forward substitution with the strictly
          // lower-triangular beta_t A[t][j]: earlier sub-blocks as one GEMM, the
          // sub-block itself row by row.
          vec_.gemm_nn(kg.data(), dk, s, dv, u.data(), dv, len, dv, dk, false);
          for (int64_t t = 0; t < len; ++t) {
            const float b = a.beta[(t0 + t) * a.heads + h];
            float* ut = &u[t * dv];
            const float* v = a.v + (t0 + t) * a.ld_v + h * dv;
            for (int64_t e = 0; e < dv; ++e) ut[e] = b * (v[e] - ut[e]);
          }
          for (int64_t b0 = 0; b0 < len; b0 += kSub) {
            const int64_t b1 = std::min(len, b0 + kSub);
            for (int64_t t = b0; t < b1; ++t) {
              const float nb = -a.beta[(t0 + t) * a.heads + h];
              for (int64_t j = 0; j < t; ++j) amat[t * kChunk + j] *= nb;
            }
            if (b0 > 0) {
              vec_.gemm_nn(&amat[b0 * kChunk], kChunk, u.data(), dv, &u[b0 * dv], dv,
                           b1 - b0, dv, b0, true);
            }
            for (int64_t t = b0 + 1; t < b1; ++t) {
              for (int64_t j = b0; j < t; ++j) {
                vec_.axpy(amat[t * kChunk + j], &u[j * dv], &u[t * dv], dv);
              }
            }
          }
          // O = (e^G q) S0 + Qk U.
          float* o0 = a.out + t0 * a.ld_out + h * dv;
          vec_.gemm_nn(qk.data(), dk, s, dv, o0, a.ld_out, len, dv, dk, false);
          vec_.gemm_nn(qkm.data(), kChunk, u.data(), dv, o0, a.ld_out, len, dv, len,
                       true);
          // S = diag(e^{G_L}) S0 + Kd^T U with Kd[j][c] = e^{G_L-G_j} k_j.
          const float* gl = &big_g[(len - 1) * dk];
          for (int64_t j = 0; j < len; ++j) {
            for (int64_t c = 0; c < dk; ++c) diff[c] = gl[c] - big_g[j * dk + c];
            vec_.exp_nonpos(diff.data(), &kd[j * dk], dk);
            for (int64_t c = 0; c < dk; ++c)
              kdt[c * kChunk + j] = kd[j * dk + c] * kdat[j * dk + c];
          }
          for (int64_t c = 0; c < dk; ++c) {
            float* row = s + c * dv;
            const float decay = eg[(len - 1) * dk + c];
            for (int64_t e = 0; e < dv; ++e) row[e] *= decay;
          }
          vec_.gemm_nn(kdt.data(), kChunk, u.data(), dv, s, dv, dk, dv, len, true);
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status KdaOutputGate(const float* o, int64_t ld_o, const float* norm_w,
                             const float* gate, int64_t ld_gate, float* out,
                             int64_t ld_out, int64_t tokens, int64_t heads, int64_t d,
                             float eps) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_o, "kda_output_gate"));
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_gate, "kda_output_gate"));
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_out, "kda_output_gate"));
    Rows(tokens * heads, d * 8, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t t = i / heads, h = i % heads;
        const float* oh = o + t * ld_o + h * d;
        const float* gh = gate + t * ld_gate + h * d;
        float* yh = out + t * ld_out + h * d;
        const float scale = 1.0f / std::sqrt(vec_.dot(oh, oh, d) / d + eps);
        for (int64_t c = 0; c < d; ++c)
          yh[c] = oh[c] * scale * norm_w[c] * Sigmoid(gh[c]);
      }
    });
    return absl::OkStatus();
  }

  // ---- MLA ------------------------------------------------------------------
  absl::Status PagedCacheWrite(const float* src, int64_t ld_src, const int32_t* slots,
                               int64_t tokens, int64_t width, uint16_t* cache,
                               int64_t num_slots) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, width, ld_src, "cache_write"));
    for (int64_t t = 0; t < tokens; ++t) {
      if (slots[t] >= num_slots) {
        return InvalidArgument("cache_write: slot ", slots[t], " >= ", num_slots);
      }
    }
    for (int64_t t = 0; t < tokens; ++t) {
      if (slots[t] < 0) continue;
      uint16_t* dst = cache + static_cast<int64_t>(slots[t]) * width;
      for (int64_t i = 0; i < width; ++i) dst[i] = F32ToBf16(src[t * ld_src + i]);
    }
    return absl::OkStatus();
  }

  absl::Status MlaAttentionExpanded(const MlaArgs& a) override { return Mla(a, false); }
  absl::Status MlaAttentionAbsorbed(const MlaArgs& a) override { return Mla(a, true); }

  // ---- MoE ----------------------------------------------------------------
  absl::Status RouterTopK(const float* x, int64_t ldx, const uint16_t* gate,
                          const float* bias, int64_t tokens, int64_t hidden,
                          int64_t num_experts, int64_t top_k, bool renormalize,
                          float scaling, int32_t* ids, float* weights) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, hidden, ldx, "router"));
    if (top_k < 0 || top_k > num_experts) {
      return InvalidArgument("router: top_k ", top_k, " not in [0, ", num_experts, "]");
    }
    std::vector<float> s(tokens * num_experts);
    // fp32 products with the exact BF16 -> fp32 widening (never rounds x to BF16).
    Rows(tokens * num_experts, hidden, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t t = i / num_experts, ex = i % num_experts;
        s[i] = Sigmoid(vec_.dot_bf16(x + t * ldx, gate + ex * hidden, hidden));
      }
    });
    std::vector<int32_t> order(num_experts);
    for (int64_t t = 0; t < tokens; ++t) {
      const float* st = &s[t * num_experts];
      for (int64_t e = 0; e < num_experts; ++e) order[e] = static_cast<int32_t>(e);
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                        [&](int32_t l, int32_t r) {
                          const float kl = st[l] + bias[l], kr = st[r] + bias[r];
                          return kl > kr || (kl == kr && l < r);
                        });
      float sum = 0;
      for (int64_t i = 0; i < top_k; ++i) sum += st[order[i]];
      for (int64_t i = 0; i < top_k; ++i) {
        ids[t * top_k + i] = order[i];
        float wv = st[order[i]];
        if (renormalize) wv /= (sum + 1e-20f);
        weights[t * top_k + i] = wv * scaling;
      }
    }
    return absl::OkStatus();
  }

  // Three parallel passes per call whatever the number of experts: (1) w1/w3
  // rows of every routed expert, (2) SiTU, (3) w2 rows, then a combine that adds
  // each token's experts in increasing expert id. Every (expert, token) product
  // uses the same arithmetic whatever else is routed, so a token's output does
  // not depend on the batch.
  absl::Status MoeMxfp4(const MoeArgs& a) override {
    TANDEM_RETURN_IF_ERROR(CheckMoe(a));
    const int64_t hd = a.hidden, in = a.inter;
    MoeScratch& sc = moe_;
    // Group (token, weight) pairs by expert, experts in increasing id.
    sc.count.assign(a.num_experts, 0);
    for (int64_t t = 0; t < a.tokens; ++t) {
      for (int64_t i = 0; i < a.top_k; ++i) {
        const int32_t e = a.ids[t * a.top_k + i];
        if (e < 0 || a.experts[e].w1_packed == nullptr) continue;
        ++sc.count[e];
      }
    }
    sc.active.clear();
    sc.start.assign(a.num_experts + 1, 0);
    for (int64_t e = 0; e < a.num_experts; ++e) {
      sc.start[e + 1] = sc.start[e] + sc.count[e];
      if (sc.count[e] > 0) sc.active.push_back(e);
    }
    const int64_t pairs = sc.start[a.num_experts];
    sc.pair_token.resize(pairs);
    sc.pair_weight.resize(pairs);
    sc.fill.assign(sc.start.begin(), sc.start.end() - 1);
    for (int64_t t = 0; t < a.tokens; ++t) {
      for (int64_t i = 0; i < a.top_k; ++i) {
        const int32_t e = a.ids[t * a.top_k + i];
        if (e < 0 || a.experts[e].w1_packed == nullptr) continue;
        const int64_t p = sc.fill[e]++;
        sc.pair_token[p] = t;
        sc.pair_weight[p] = a.weights[t * a.top_k + i];
      }
    }
    // Per pair: the token's input de-interleaved (even / odd elements, as the
    // packed nibbles hold element pairs), h1, h3, the activation, the output.
    sc.ze.resize(pairs * hd / 2);
    sc.zo.resize(pairs * hd / 2);
    sc.h1.resize(pairs * in);
    sc.h3.resize(pairs * in);
    sc.ae.resize(pairs * in / 2);
    sc.ao.resize(pairs * in / 2);
    sc.y.resize(pairs * hd);
    Rows(pairs, hd, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const float* z = a.z + sc.pair_token[p] * a.ld_z;
        for (int64_t j = 0; j < hd / 2; ++j) {
          sc.ze[p * hd / 2 + j] = z[2 * j];
          sc.zo[p * hd / 2 + j] = z[2 * j + 1];
        }
      }
    });
    // Work units: (active expert, block of kMoeRows output rows).
    constexpr int64_t kMoeRows = 64;
    const int64_t nact = static_cast<int64_t>(sc.active.size());
    auto rows_pass = [&](int64_t rows, int64_t cols, auto&& run) {
      const int64_t blocks = (rows + kMoeRows - 1) / kMoeRows;
      const int64_t units = nact * blocks;
      auto body = [&](int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t e = sc.active[u / blocks];
          const int64_t r0 = (u % blocks) * kMoeRows;
          run(e, r0, std::min(rows, r0 + kMoeRows));
        }
      };
      const int64_t work = pairs * rows * cols;
      if (work < kParallelMacs || pool_.size() == 1) {
        body(0, units);
      } else {
        pool_.ParallelFor(
            units, [&](int64_t u0, int64_t u1, int) { body(u0, u1); },
            std::min<int64_t>(units, 4 * pool_.size()));
      }
    };
    rows_pass(in, 2 * hd, [&](int64_t e, int64_t r0, int64_t r1) {
      const Mxfp4Expert& ex = a.experts[e];
      for (int64_t p = sc.start[e]; p < sc.start[e + 1]; p += 4) {
        const int n4 = static_cast<int>(std::min<int64_t>(4, sc.start[e + 1] - p));
        vec_.mxfp4_rows(ex.w1_packed, ex.w1_scale, hd, &sc.ze[p * hd / 2],
                        &sc.zo[p * hd / 2], hd / 2, n4, &sc.h1[p * in], in, r0, r1);
        vec_.mxfp4_rows(ex.w3_packed, ex.w3_scale, hd, &sc.ze[p * hd / 2],
                        &sc.zo[p * hd / 2], hd / 2, n4, &sc.h3[p * in], in, r0, r1);
      }
    });
    Rows(pairs, in * 16, [&](int64_t p0, int64_t p1) {
      std::vector<float> act(in);
      for (int64_t p = p0; p < p1; ++p) {
        SituRow(&sc.h1[p * in], &sc.h3[p * in], act.data(), in, a.situ_beta,
                a.situ_linear_beta);
        for (int64_t j = 0; j < in / 2; ++j) {
          sc.ae[p * in / 2 + j] = act[2 * j];
          sc.ao[p * in / 2 + j] = act[2 * j + 1];
        }
      }
    });
    rows_pass(hd, in, [&](int64_t e, int64_t r0, int64_t r1) {
      const Mxfp4Expert& ex = a.experts[e];
      for (int64_t p = sc.start[e]; p < sc.start[e + 1]; p += 4) {
        const int n4 = static_cast<int>(std::min<int64_t>(4, sc.start[e + 1] - p));
        vec_.mxfp4_rows(ex.w2_packed, ex.w2_scale, in, &sc.ae[p * in / 2],
                        &sc.ao[p * in / 2], in / 2, n4, &sc.y[p * hd], hd, r0, r1);
      }
    });
    // Combine: out[t] = sum over t's experts in increasing id of weight * y.
    sc.token_pairs.assign(a.tokens, {});
    for (int64_t e : sc.active) {
      for (int64_t p = sc.start[e]; p < sc.start[e + 1]; ++p) {
        sc.token_pairs[sc.pair_token[p]].push_back(p);
      }
    }
    Rows(a.tokens, hd * a.top_k, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* out = a.out + t * a.ld_out;
        std::fill(out, out + hd, 0.0f);
        for (int64_t p : sc.token_pairs[t]) {
          const float wt = sc.pair_weight[p];
          const float* yp = &sc.y[p * hd];
          for (int64_t r = 0; r < hd; ++r) out[r] += wt * yp[r];
        }
      }
    });
    return absl::OkStatus();
  }

  // ---- Attention residuals ------------------------------------------------------
  absl::Status AttnResMix(const float* const* bank, int64_t bank_size, const float* p,
                          const float* proj_w, const float* norm_w, float eps,
                          int64_t tokens, int64_t hidden, float* out) override {
    if (bank_size < 0 || tokens < 0 || hidden <= 0) {
      return InvalidArgument("attn_res_mix: bad shape");
    }
    const int64_t n = bank_size + 1;
    std::vector<float> wcomb(hidden);
    for (int64_t i = 0; i < hidden; ++i) wcomb[i] = norm_w[i] * proj_w[i];
    Rows(tokens, n * hidden * 3, [&](int64_t b, int64_t e) {
      std::vector<float> score(n), mixed(hidden);
      for (int64_t t = b; t < e; ++t) {
        auto v = [&](int64_t j) { return (j < bank_size ? bank[j] : p) + t * hidden; };
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          const float* vj = v(j);
          score[j] = vec_.dot(vj, wcomb.data(), hidden) /
                     std::sqrt(vec_.dot(vj, vj, hidden) / hidden + eps);
          mx = std::max(mx, score[j]);
        }
        float den = 0;
        for (int64_t j = 0; j < n; ++j) den += (score[j] = std::exp(score[j] - mx));
        std::fill(mixed.begin(), mixed.end(), 0.0f);
        for (int64_t j = 0; j < n; ++j)
          vec_.axpy(score[j] / den, v(j), mixed.data(), hidden);
        std::memcpy(out + t * hidden, mixed.data(), hidden * sizeof(float));
      }
    });
    return absl::OkStatus();
  }

  // ---- Integrity -----------------------------------------------------------------
  absl::Status ChunkHashes(const ChunkHashArgs& args) override {
    return HostChunkHashes(args);
  }

  // ---- Vision tower -------------------------------------------------------------
  bool Supports(Op) const override { return true; }

  // Angles in fp32 as the reference's table (f_i = theta^(-4i/d) in fp32, times
  // the integer position), rotations in fp32.
  absl::Status Rope2d(float* x, int64_t ldx, const int32_t* pos, int64_t tokens,
                      int64_t heads, int64_t head_dim, float theta) override {
    TANDEM_RETURN_IF_ERROR(CheckRope2d(x, ldx, pos, tokens, heads, head_dim, theta));
    const int64_t quarter = head_dim / 4;
    std::vector<float> freq(quarter);
    for (int64_t i = 0; i < quarter; ++i) {
      freq[i] = 1.0f / std::pow(theta, static_cast<float>(4 * i) /
                                           static_cast<float>(head_dim));
    }
    Rows(tokens, heads * head_dim * 4, [&](int64_t b, int64_t e) {
      std::vector<float> cs(4 * quarter);
      for (int64_t t = b; t < e; ++t) {
        const float row = static_cast<float>(pos[2 * t]);
        const float col = static_cast<float>(pos[2 * t + 1]);
        for (int64_t i = 0; i < quarter; ++i) {
          const float pc = col * freq[i], pr = row * freq[i];
          cs[4 * i] = std::cos(pc);
          cs[4 * i + 1] = std::sin(pc);
          cs[4 * i + 2] = std::cos(pr);
          cs[4 * i + 3] = std::sin(pr);
        }
        for (int64_t h = 0; h < heads; ++h) {
          float* xh = x + t * ldx + h * head_dim;
          for (int64_t i = 0; i < 2 * quarter; ++i) {
            const float c = cs[2 * i], sn = cs[2 * i + 1];
            const float a = xh[2 * i], bb = xh[2 * i + 1];
            xh[2 * i] = a * c - bb * sn;
            xh[2 * i + 1] = a * sn + bb * c;
          }
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status Gelu(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t rows,
                    int64_t n, bool tanh_approx) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldx, "gelu"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldy, "gelu"));
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    constexpr float kInvSqrt2 = 0.7071067811865476f;
    Rows(rows, n * 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const float* xr = x + r * ldx;
        float* yr = y + r * ldy;
        if (tanh_approx) {
          for (int64_t i = 0; i < n; ++i) {
            const float v = xr[i];
            yr[i] = 0.5f * v *
                    (1.0f + std::tanh(kSqrt2OverPi * (v + 0.044715f * v * v * v)));
          }
        } else {
          for (int64_t i = 0; i < n; ++i) {
            const float v = xr[i];
            yr[i] = 0.5f * v * (1.0f + std::erf(v * kInvSqrt2));
          }
        }
      }
    });
    return absl::OkStatus();
  }

  // Per (image, head): scores of a tile of queries against all of the image's keys
  // by GemmF32, a row softmax (the ISA's vector exp), then P . V by GemmF32 on V
  // transposed.
  // Scratch: kTile * max_seqlen + head_dim * max_seqlen floats.
  absl::Status VisionAttention(const VisionAttnArgs& a) override {
    TANDEM_RETURN_IF_ERROR(CheckVisionAttention(a));
    constexpr int64_t kTile = 64;
    const int64_t d = a.head_dim;
    std::vector<float> scores(kTile * a.max_seqlen), vt(d * a.max_seqlen);
    for (int64_t img = 0; img < a.num_images; ++img) {
      const int64_t b = a.cu_seqlens[img], n = a.cu_seqlens[img + 1] - b;
      if (n == 0) continue;
      for (int64_t h = 0; h < a.heads; ++h) {
        const float* v = a.v + b * a.ld_qkv + h * d;
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t c = 0; c < d; ++c) vt[c * n + j] = v[j * a.ld_qkv + c];
        }
        for (int64_t t0 = 0; t0 < n; t0 += kTile) {
          const int64_t m = std::min(kTile, n - t0);
          TANDEM_RETURN_IF_ERROR(GemmF32(a.q + (b + t0) * a.ld_qkv + h * d, a.ld_qkv,
                                         a.k + b * a.ld_qkv + h * d, a.ld_qkv,
                                         scores.data(), n, m, n, d, false));
          Rows(m, n * 8, [&](int64_t rb, int64_t re) {
            for (int64_t r = rb; r < re; ++r) {
              float* sr = scores.data() + r * n;
              float mx = -std::numeric_limits<float>::infinity();
              for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sr[j] * a.scale);
              for (int64_t j = 0; j < n; ++j) sr[j] = sr[j] * a.scale - mx;
              vec_.exp_nonpos(sr, sr, n);  // the ISA's vector exp (~2 ulp)
              double den = 0;
              for (int64_t j = 0; j < n; ++j) den += sr[j];
              const float inv = static_cast<float>(1.0 / den);
              for (int64_t j = 0; j < n; ++j) sr[j] *= inv;
            }
          });
          TANDEM_RETURN_IF_ERROR(GemmF32(scores.data(), n, vt.data(), n,
                                         a.out + (b + t0) * a.ld_out + h * d, a.ld_out,
                                         m, d, n, false));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Merge2x2(const float* x, int64_t ldx, int64_t grid_h, int64_t grid_w,
                        int64_t d, float* out, int64_t ldo) override {
    TANDEM_RETURN_IF_ERROR(CheckMerge2x2(x, ldx, grid_h, grid_w, d, out, ldo));
    for (int64_t r = 0; r < grid_h; ++r) {
      for (int64_t c = 0; c < grid_w; ++c) {
        const int64_t m = (r / 2) * (grid_w / 2) + c / 2;
        const int64_t part = (r % 2) * 2 + (c % 2);
        std::memcpy(out + m * ldo + part * d, x + (r * grid_w + c) * ldx,
                    static_cast<size_t>(d) * sizeof(float));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<Device> device_ = CreateHostDevice();
  static void SituRow(const float* g, const float* u, float* out, int64_t n, float beta,
                      float lbeta) {
    for (int64_t i = 0; i < n; ++i) {
      const float a = beta * std::tanh(g[i] / beta) * Sigmoid(g[i]);
      out[i] = a * (lbeta * std::tanh(u[i] / lbeta));
    }
  }

  // Runs fn(begin, end) over [0, rows) on the pool when rows * cost_per_row is big
  // enough to be worth it.
  template <typename Fn>
  void Rows(int64_t rows, int64_t cost_per_row, const Fn& fn) {
    if (rows <= 0) return;
    if (rows * cost_per_row < kParallelMacs || pool_.size() == 1) {
      fn(0, rows);
      return;
    }
    pool_.ParallelFor(rows, [&](int64_t b, int64_t e, int) { fn(b, e); });
  }
  // The same, always parallel when there are at least 2 rows (row-split matrices).
  template <typename Fn>
  void RowsOf(int64_t rows, int64_t cost_per_row, const Fn& fn) {
    Rows(rows, cost_per_row, fn);
  }

  // GEMM work split: by W rows (units of 8) when N is wide, else by X rows.
  template <typename Fn>
  void Split(int64_t m, int64_t n, int64_t k, const Fn& fn) {
    const int64_t threads = pool_.size();
    if (m * n * k < kParallelMacs * 4 || threads == 1) {
      fn(0, m, 0, n);
      return;
    }
    // Units of 8 W rows: the GEMV kernel's row group.
    const int64_t units = (n + 7) / 8;
    if (units >= 2 * threads || m < threads) {
      // GEMV-like: stream W in a few chunks per thread (late threads leave theirs).
      pool_.ParallelFor(
          units,
          [&](int64_t b, int64_t e, int) { fn(0, m, b * 8, std::min(n, e * 8)); },
          std::min<int64_t>(units, 4 * threads));
    } else {
      pool_.ParallelFor(m, [&](int64_t b, int64_t e, int) { fn(b, e, 0, n); });
    }
  }

  std::vector<uint16_t>& XBuffer(int64_t size) {
    if (static_cast<int64_t>(xbuf_.size()) < size) xbuf_.resize(size);
    return xbuf_;
  }

  // MLA for both forms. Work items are (sequence, head) pairs; each walks the
  // sequence's cached positions in tiles of kTile with an online softmax per query,
  // so scratch stays bounded for any context length.
  absl::Status Mla(const MlaArgs& a, bool absorbed) {
    TANDEM_RETURN_IF_ERROR(CheckMla(a));
    constexpr int64_t kTile = 256;
    const int64_t lora = a.kv_lora_rank, nope = a.nope_dim, rope = a.rope_dim,
                  dvv = a.v_dim;
    const int64_t width = lora + rope, dq = nope + rope, per_head = nope + dvv;
    // Value width accumulated per query: the latent (absorbed) or v (expanded).
    const int64_t acc_w = absorbed ? lora : dvv;
    const int64_t items = a.num_seqs * a.heads;
    pool_.ParallelFor(items, [&](int64_t i0, int64_t i1, int) {
      std::vector<float> qlat, m, l, acc, score(kTile), cf(lora), kn, vv;
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t s = item / a.heads, h = item % a.heads;
        const int64_t q_len = a.query_start[s + 1] - a.query_start[s];
        if (q_len == 0) continue;
        const int64_t ctx = a.seq_lens[s];
        const uint16_t* wuk = a.kv_b_proj + h * per_head * lora;
        const uint16_t* wuv = wuk + nope * lora;
        auto qrow = [&](int64_t qi) {
          return a.q + (a.query_start[s] + qi) * a.ld_q + h * dq;
        };
        auto cache_row = [&](int64_t pos) {
          const int32_t blk =
              a.block_tables[s * a.block_table_stride + pos / a.block_size];
          return a.kv_cache +
                 (static_cast<int64_t>(blk) * a.block_size + pos % a.block_size) *
                     width;
        };
        if (absorbed) {
          qlat.assign(q_len * lora, 0.0f);
          for (int64_t qi = 0; qi < q_len; ++qi) {
            for (int64_t i = 0; i < nope; ++i) {
              vec_.axpy_bf16(qrow(qi)[i], wuk + i * lora, &qlat[qi * lora], lora);
            }
          }
        }
        m.assign(q_len, -std::numeric_limits<float>::infinity());
        l.assign(q_len, 0.0f);
        acc.assign(q_len * acc_w, 0.0f);
        for (int64_t p0 = 0; p0 < ctx; p0 += kTile) {
          const int64_t p1 = std::min(ctx, p0 + kTile);
          if (!absorbed) {
            // Expand this tile's keys and values for head h.
            kn.resize(kTile * nope);
            vv.resize(kTile * dvv);
            for (int64_t p = p0; p < p1; ++p) {
              const uint16_t* c = cache_row(p);
              for (int64_t i = 0; i < lora; ++i) cf[i] = Bf16ToF32(c[i]);
              for (int64_t i = 0; i < nope; ++i) {
                kn[(p - p0) * nope + i] =
                    vec_.dot_bf16(cf.data(), wuk + i * lora, lora);
              }
              for (int64_t j = 0; j < dvv; ++j) {
                vv[(p - p0) * dvv + j] = vec_.dot_bf16(cf.data(), wuv + j * lora, lora);
              }
            }
          }
          for (int64_t qi = 0; qi < q_len; ++qi) {
            const int64_t pos = ctx - q_len + qi;
            const int64_t end = std::min(p1, pos + 1);
            if (end <= p0) continue;
            const float* q = qrow(qi);
            float tile_max = -std::numeric_limits<float>::infinity();
            for (int64_t p = p0; p < end; ++p) {
              const uint16_t* c = cache_row(p);
              float dot = absorbed ? vec_.dot_bf16(&qlat[qi * lora], c, lora)
                                   : vec_.dot(q, &kn[(p - p0) * nope], nope);
              dot += vec_.dot_bf16(q + nope, c + lora, rope);
              score[p - p0] = dot * a.scale;
              tile_max = std::max(tile_max, score[p - p0]);
            }
            const float new_m = std::max(m[qi], tile_max);
            const float corr = std::exp(m[qi] - new_m);  // 0 on the first tile
            float* accq = &acc[qi * acc_w];
            if (corr != 1.0f) {
              for (int64_t j = 0; j < acc_w; ++j) accq[j] *= corr;
            }
            float lsum = l[qi] * corr;
            for (int64_t p = p0; p < end; ++p) {
              const float pr = std::exp(score[p - p0] - new_m);
              lsum += pr;
              if (absorbed) {
                vec_.axpy_bf16(pr, cache_row(p), accq, lora);
              } else {
                vec_.axpy(pr, &vv[(p - p0) * dvv], accq, dvv);
              }
            }
            l[qi] = lsum;
            m[qi] = new_m;
          }
        }
        for (int64_t qi = 0; qi < q_len; ++qi) {
          float* o = a.out + (a.query_start[s] + qi) * a.ld_out + h * dvv;
          const float inv = 1.0f / l[qi];
          const float* accq = &acc[qi * acc_w];
          if (absorbed) {
            for (int64_t j = 0; j < dvv; ++j)
              o[j] = vec_.dot_bf16(accq, wuv + j * lora, lora) * inv;
          } else {
            for (int64_t j = 0; j < dvv; ++j) o[j] = accq[j] * inv;
          }
        }
      }
    });
    return absl::OkStatus();
  }

  const CpuIsa isa_;
  const bool use_onednn_;
  const std::string name_;
  const VecOps& vec_;
  ThreadPool pool_;
  std::vector<uint16_t> xbuf_;
  // MoeMxfp4 scratch, reused across calls (grows to the largest batch seen).
  struct MoeScratch {
    std::vector<int64_t> count, start, fill, active, pair_token;
    std::vector<float> pair_weight, ze, zo, h1, h3, ae, ao, y;
    std::vector<std::vector<int64_t>> token_pairs;
  };
  MoeScratch moe_;
  OneDnnGemm onednn_;  // BF16 copy of X for the vdpbf16ps GEMM
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(CpuIsa isa, int threads,
                                                          bool use_onednn) {
  if (static_cast<int>(isa) > static_cast<int>(HardwareIsa())) {
    return InvalidArgument("cpu backend: ISA ", IsaName(isa),
                           " not supported by this CPU (best: ", IsaName(HardwareIsa()),
                           ")");
  }
  return std::unique_ptr<Backend>(new CpuBackend(isa, threads, use_onednn));
}

}  // namespace tandem::kernels
