#include "kernels/cpu/reference_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common/status.h"
#include "kernels/bf16.h"
#include "kernels/cpu/chunk_hash.h"
#include "kernels/op_checks.h"

namespace tandem::kernels {
namespace {

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

class ReferenceBackend final : public Backend {
 public:
  absl::string_view name() const override { return "cpu_reference"; }
  Device& device() override { return *device_; }

  absl::Status GemmBf16(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                        float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                        bool accumulate) override {
    TANDEM_RETURN_IF_ERROR(CheckGemm(x, ldx, w, ldw, y, ldy, m, n, k));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double acc = accumulate ? y[i * ldy + j] : 0.0;
        for (int64_t l = 0; l < k; ++l) {
          acc += static_cast<double>(x[i * ldx + l]) * Bf16ToF32(w[j * ldw + l]);
        }
        y[i * ldy + j] = static_cast<float>(acc);
      }
    }
    return absl::OkStatus();
  }

  absl::Status GemmF32(const float* x, int64_t ldx, const float* w, int64_t ldw,
                       float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                       bool accumulate) override {
    TANDEM_RETURN_IF_ERROR(CheckGemm(x, ldx, w, ldw, y, ldy, m, n, k));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double acc = accumulate ? y[i * ldy + j] : 0.0;
        for (int64_t l = 0; l < k; ++l) {
          acc += static_cast<double>(x[i * ldx + l]) * w[j * ldw + l];
        }
        y[i * ldy + j] = static_cast<float>(acc);
      }
    }
    return absl::OkStatus();
  }

  absl::Status RmsNorm(const float* x, int64_t ldx, const float* w, float* y,
                       int64_t ldy, int64_t rows, int64_t n, float eps) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldx, "rmsnorm"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldy, "rmsnorm"));
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * ldx;
      float* yr = y + r * ldy;
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const double scale = 1.0 / std::sqrt(ss / n + eps);
      for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<float>(xr[i] * scale * w[i]);
    }
    return absl::OkStatus();
  }

  absl::Status L2NormHeads(const float* x, int64_t ldx, float* y, int64_t ldy,
                           int64_t rows, int64_t heads, int64_t d, float eps,
                           float scale) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, heads * d, ldx, "l2norm"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, heads * d, ldy, "l2norm"));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* xh = x + r * ldx + h * d;
        float* yh = y + r * ldy + h * d;
        double ss = 0;
        for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(xh[i]) * xh[i];
        const double f = scale / std::sqrt(ss + eps);
        for (int64_t i = 0; i < d; ++i) yh[i] = static_cast<float>(xh[i] * f);
      }
    }
    return absl::OkStatus();
  }

  absl::Status SituGlu(const float* g, int64_t ldg, const float* u, int64_t ldu,
                       float* out, int64_t ldo, int64_t rows, int64_t n, float beta,
                       float lbeta) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldg, "situ"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldu, "situ"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldo, "situ"));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        const double gv = g[r * ldg + i], uv = u[r * ldu + i];
        const double a = beta * std::tanh(gv / beta) * Sigmoid(gv);
        const double b = lbeta * std::tanh(uv / lbeta);
        out[r * ldo + i] = static_cast<float>(a * b);
      }
    }
    return absl::OkStatus();
  }

  absl::Status MulSigmoid(const float* x, int64_t ldx, const float* gate, int64_t ldg,
                          float* out, int64_t ldo, int64_t rows, int64_t n) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldx, "mul_sigmoid"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldg, "mul_sigmoid"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldo, "mul_sigmoid"));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        out[r * ldo + i] =
            static_cast<float>(x[r * ldx + i] * Sigmoid(gate[r * ldg + i]));
      }
    }
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
    for (int64_t t = 0; t < tokens; ++t) {
      const bool mine = ids[t] >= first && ids[t] < first + rows;
      for (int64_t i = 0; i < hidden; ++i) {
        out[t * hidden + i] =
            mine ? Bf16ToF32(table[(ids[t] - first) * hidden + i]) : 0.0f;
      }
    }
    return absl::OkStatus();
  }

  absl::Status CausalConv1dSilu(const float* x, int64_t ldx, const float* w,
                                int64_t kernel, float* state, float* y, int64_t ldy,
                                int64_t tokens, int64_t channels) override {
    if (kernel < 1) return InvalidArgument("conv1d: kernel must be >= 1");
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, channels, ldx, "conv1d"));
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, channels, ldy, "conv1d"));
    const int64_t tail = kernel - 1;
    // xx = [state; x], (tail + T) rows.
    auto xx = [&](int64_t row, int64_t c) -> float {
      return row < tail ? state[row * channels + c] : x[(row - tail) * ldx + c];
    };
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < channels; ++c) {
        double acc = 0;
        for (int64_t i = 0; i < kernel; ++i) acc += w[c * kernel + i] * xx(t + i, c);
        y[t * ldy + c] = static_cast<float>(acc * Sigmoid(acc));
      }
    }
    std::vector<float> next(tail * channels);
    for (int64_t r = 0; r < tail; ++r) {
      for (int64_t c = 0; c < channels; ++c) next[r * channels + c] = xx(tokens + r, c);
    }
    std::copy(next.begin(), next.end(), state);
    return absl::OkStatus();
  }

  absl::Status KdaGates(const float* graw, int64_t ld_graw, const float* a_log,
                        const float* dt_bias, const float* braw, int64_t ld_braw,
                        float lower_bound, int64_t tokens, int64_t heads, int64_t d,
                        float* g, float* beta) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_graw, "kda_gates"));
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads, ld_braw, "kda_gates"));
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const double a = std::exp(static_cast<double>(a_log[h]));
        for (int64_t c = 0; c < d; ++c) {
          const double raw = graw[t * ld_graw + h * d + c] + dt_bias[h * d + c];
          g[(t * heads + h) * d + c] =
              static_cast<float>(lower_bound * Sigmoid(a * raw));
        }
        beta[t * heads + h] = static_cast<float>(Sigmoid(braw[t * ld_braw + h]));
      }
    }
    return absl::OkStatus();
  }

  absl::Status KdaRecurrent(const KdaArgs& a) override {
    TANDEM_RETURN_IF_ERROR(CheckKda(a));
    const int64_t dk = a.head_dim_k, dv = a.head_dim_v;
    std::vector<double> s(dk * dv), sk(dv);
    for (int64_t h = 0; h < a.heads; ++h) {
      float* st = a.state + h * dk * dv;
      for (int64_t i = 0; i < dk * dv; ++i) s[i] = st[i];
      for (int64_t t = 0; t < a.tokens; ++t) {
        const float* q = a.q + t * a.ld_qk + h * dk;
        const float* k = a.k + t * a.ld_qk + h * dk;
        const float* v = a.v + t * a.ld_v + h * dv;
        const float* g = a.g + (t * a.heads + h) * dk;
        const double b = a.beta[t * a.heads + h];
        for (int64_t i = 0; i < dk; ++i) {
          const double decay = std::exp(static_cast<double>(g[i]));
          for (int64_t j = 0; j < dv; ++j) s[i * dv + j] *= decay;
        }
        for (int64_t j = 0; j < dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < dk; ++i) acc += s[i * dv + j] * k[i];
          sk[j] = acc;
        }
        for (int64_t i = 0; i < dk; ++i) {
          for (int64_t j = 0; j < dv; ++j) s[i * dv + j] += b * k[i] * (v[j] - sk[j]);
        }
        float* o = a.out + t * a.ld_out + h * dv;
        for (int64_t j = 0; j < dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < dk; ++i) acc += s[i * dv + j] * q[i];
          o[j] = static_cast<float>(acc);
        }
      }
      for (int64_t i = 0; i < dk * dv; ++i) st[i] = static_cast<float>(s[i]);
    }
    return absl::OkStatus();
  }

  // Chunked form, written plainly. Inside a chunk with cumulative log-decay
  // G_t = sum_{s<=t} g_s and start state S0, the delta-rule pseudo-values u_t solve
  //   u_t + beta_t sum_{j<t} (k_t . exp(G_t - G_j) . k_j) u_j = beta_t (v_t - S0^T
  //   (exp(G_t) k_t))
  // (a unit lower-triangular system: the UT transform), then
  //   o_t = S0^T (exp(G_t) q_t) + sum_{j<=t} (q_t . exp(G_t - G_j) . k_j) u_j
  //   S   = diag(exp(G_L)) S0 + sum_j (exp(G_L - G_j) k_j) u_j^T.
  // Only exp of non-positive arguments is ever formed.
  absl::Status KdaChunked(const KdaArgs& a) override {
    TANDEM_RETURN_IF_ERROR(CheckKda(a));
    constexpr int64_t kChunk = 64;
    const int64_t dk = a.head_dim_k, dv = a.head_dim_v;
    std::vector<double> s(dk * dv), big_g(kChunk * dk), u(kChunk * dv);
    for (int64_t h = 0; h < a.heads; ++h) {
      float* st = a.state + h * dk * dv;
      for (int64_t i = 0; i < dk * dv; ++i) s[i] = st[i];
      for (int64_t t0 = 0; t0 < a.tokens; t0 += kChunk) {
        const int64_t len = std::min(kChunk, a.tokens - t0);
        auto q = [&](int64_t t) { return a.q + (t0 + t) * a.ld_qk + h * dk; };
        auto k = [&](int64_t t) { return a.k + (t0 + t) * a.ld_qk + h * dk; };
        auto v = [&](int64_t t) { return a.v + (t0 + t) * a.ld_v + h * dv; };
        for (int64_t t = 0; t < len; ++t) {
          const float* g = a.g + ((t0 + t) * a.heads + h) * dk;
          for (int64_t c = 0; c < dk; ++c) {
            big_g[t * dk + c] = (t > 0 ? big_g[(t - 1) * dk + c] : 0.0) + g[c];
          }
        }
        auto decayed_dot = [&](const float* x, int64_t t, int64_t j) {
          double acc = 0;
          for (int64_t c = 0; c < dk; ++c) {
            acc += x[c] * std::exp(big_g[t * dk + c] - big_g[j * dk + c]) * k(j)[c];
          }
          return acc;
        };
        for (int64_t t = 0; t < len; ++t) {
          const double b = a.beta[(t0 + t) * a.heads + h];
          for (int64_t e = 0; e < dv; ++e) {
            double s0k = 0;
            for (int64_t c = 0; c < dk; ++c) {
              s0k += s[c * dv + e] * std::exp(big_g[t * dk + c]) * k(t)[c];
            }
            u[t * dv + e] = b * (v(t)[e] - s0k);
          }
          for (int64_t j = 0; j < t; ++j) {
            const double coef = b * decayed_dot(k(t), t, j);
            for (int64_t e = 0; e < dv; ++e) u[t * dv + e] -= coef * u[j * dv + e];
          }
        }
        for (int64_t t = 0; t < len; ++t) {
          float* o = a.out + (t0 + t) * a.ld_out + h * dv;
          std::vector<double> acc(dv, 0.0);
          for (int64_t e = 0; e < dv; ++e) {
            for (int64_t c = 0; c < dk; ++c) {
              acc[e] += s[c * dv + e] * std::exp(big_g[t * dk + c]) * q(t)[c];
            }
          }
          for (int64_t j = 0; j <= t; ++j) {
            const double coef = decayed_dot(q(t), t, j);
            for (int64_t e = 0; e < dv; ++e) acc[e] += coef * u[j * dv + e];
          }
          for (int64_t e = 0; e < dv; ++e) o[e] = static_cast<float>(acc[e]);
        }
        const int64_t last = len - 1;
        for (int64_t c = 0; c < dk; ++c) {
          const double decay = std::exp(big_g[last * dk + c]);
          for (int64_t e = 0; e < dv; ++e) s[c * dv + e] *= decay;
          for (int64_t j = 0; j < len; ++j) {
            const double kd =
                std::exp(big_g[last * dk + c] - big_g[j * dk + c]) * k(j)[c];
            for (int64_t e = 0; e < dv; ++e) s[c * dv + e] += kd * u[j * dv + e];
          }
        }
      }
      for (int64_t i = 0; i < dk * dv; ++i) st[i] = static_cast<float>(s[i]);
    }
    return absl::OkStatus();
  }

  absl::Status KdaOutputGate(const float* o, int64_t ld_o, const float* norm_w,
                             const float* gate, int64_t ld_gate, float* out,
                             int64_t ld_out, int64_t tokens, int64_t heads, int64_t d,
                             float eps) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_o, "kda_output_gate"));
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_gate, "kda_output_gate"));
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_out, "kda_output_gate"));
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* oh = o + t * ld_o + h * d;
        double ss = 0;
        for (int64_t c = 0; c < d; ++c) ss += static_cast<double>(oh[c]) * oh[c];
        const double scale = 1.0 / std::sqrt(ss / d + eps);
        for (int64_t c = 0; c < d; ++c) {
          const double gv = gate[t * ld_gate + h * d + c];
          out[t * ld_out + h * d + c] =
              static_cast<float>(oh[c] * scale * norm_w[c] * Sigmoid(gv));
        }
      }
    }
    return absl::OkStatus();
  }

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
      for (int64_t i = 0; i < width; ++i) {
        cache[slots[t] * width + i] = F32ToBf16(src[t * ld_src + i]);
      }
    }
    return absl::OkStatus();
  }

  absl::Status MlaAttentionExpanded(const MlaArgs& a) override {
    return Mla(a, /*absorbed=*/false);
  }
  absl::Status MlaAttentionAbsorbed(const MlaArgs& a) override {
    return Mla(a, /*absorbed=*/true);
  }

  absl::Status RouterTopK(const float* x, int64_t ldx, const uint16_t* gate,
                          const float* bias, int64_t tokens, int64_t hidden,
                          int64_t num_experts, int64_t top_k, bool renormalize,
                          float scaling, int32_t* ids, float* weights) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(tokens, hidden, ldx, "router"));
    if (top_k < 0 || top_k > num_experts) {
      return InvalidArgument("router: top_k ", top_k, " not in [0, ", num_experts, "]");
    }
    std::vector<float> s(num_experts);
    std::vector<int32_t> order(num_experts);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t e = 0; e < num_experts; ++e) {
        double acc = 0;
        for (int64_t i = 0; i < hidden; ++i) {
          acc += static_cast<double>(x[t * ldx + i]) * Bf16ToF32(gate[e * hidden + i]);
        }
        s[e] = static_cast<float>(Sigmoid(static_cast<float>(acc)));
      }
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t l, int32_t r) {
        return s[l] + bias[l] > s[r] + bias[r];
      });
      double sum = 0;
      for (int64_t i = 0; i < top_k; ++i) sum += s[order[i]];
      for (int64_t i = 0; i < top_k; ++i) {
        ids[t * top_k + i] = order[i];
        double wv = s[order[i]];
        if (renormalize) wv /= (sum + 1e-20);
        weights[t * top_k + i] = static_cast<float>(wv * scaling);
      }
    }
    return absl::OkStatus();
  }

  absl::Status MoeMxfp4(const MoeArgs& a) override {
    TANDEM_RETURN_IF_ERROR(CheckMoe(a));
    const int64_t hd = a.hidden, in = a.inter;
    for (int64_t t = 0; t < a.tokens; ++t) {
      for (int64_t i = 0; i < hd; ++i) a.out[t * a.ld_out + i] = 0.0f;
    }
    std::vector<float> w1, w3, w2;
    std::vector<double> acc(hd);
    std::vector<double> act(in);
    for (int64_t e = 0; e < a.num_experts; ++e) {
      const Mxfp4Expert& ex = a.experts[e];
      bool used = false;
      for (int64_t i = 0; i < a.tokens * a.top_k; ++i) used |= a.ids[i] == e;
      if (!used || ex.w1_packed == nullptr) continue;
      Dequant(ex.w1_packed, ex.w1_scale, in, hd, &w1);
      Dequant(ex.w3_packed, ex.w3_scale, in, hd, &w3);
      Dequant(ex.w2_packed, ex.w2_scale, hd, in, &w2);
      for (int64_t t = 0; t < a.tokens; ++t) {
        for (int64_t slot = 0; slot < a.top_k; ++slot) {
          if (a.ids[t * a.top_k + slot] != e) continue;
          const float* z = a.z + t * a.ld_z;
          for (int64_t r = 0; r < in; ++r) {
            double h1 = 0, h3 = 0;
            for (int64_t c = 0; c < hd; ++c) {
              h1 += static_cast<double>(w1[r * hd + c]) * z[c];
              h3 += static_cast<double>(w3[r * hd + c]) * z[c];
            }
            const double ga = a.situ_beta * std::tanh(h1 / a.situ_beta) * Sigmoid(h1);
            const double ub = a.situ_linear_beta * std::tanh(h3 / a.situ_linear_beta);
            act[r] = ga * ub;
          }
          const double wt = a.weights[t * a.top_k + slot];
          for (int64_t r = 0; r < hd; ++r) {
            double y = 0;
            for (int64_t c = 0; c < in; ++c) y += w2[r * in + c] * act[c];
            a.out[t * a.ld_out + r] += static_cast<float>(wt * y);
          }
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status AttnResMix(const float* const* bank, int64_t bank_size, const float* p,
                          const float* proj_w, const float* norm_w, float eps,
                          int64_t tokens, int64_t hidden, float* out) override {
    if (bank_size < 0 || tokens < 0 || hidden <= 0) {
      return InvalidArgument("attn_res_mix: bad shape");
    }
    const int64_t n = bank_size + 1;
    std::vector<double> score(n);
    std::vector<double> mixed(hidden);
    for (int64_t t = 0; t < tokens; ++t) {
      auto v = [&](int64_t j) { return (j < bank_size ? bank[j] : p) + t * hidden; };
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        double ss = 0, dot = 0;
        for (int64_t i = 0; i < hidden; ++i) {
          ss += static_cast<double>(v(j)[i]) * v(j)[i];
          dot += static_cast<double>(v(j)[i]) * norm_w[i] * proj_w[i];
        }
        score[j] = dot / std::sqrt(ss / hidden + eps);
        mx = std::max(mx, score[j]);
      }
      double den = 0;
      for (int64_t j = 0; j < n; ++j) den += (score[j] = std::exp(score[j] - mx));
      std::fill(mixed.begin(), mixed.end(), 0.0);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t i = 0; i < hidden; ++i) mixed[i] += score[j] / den * v(j)[i];
      }
      for (int64_t i = 0; i < hidden; ++i)
        out[t * hidden + i] = static_cast<float>(mixed[i]);
    }
    return absl::OkStatus();
  }

  // libxxhash: the published XXH64, the value every backend must equal.
  absl::Status ChunkHashes(const ChunkHashArgs& args) override {
    return HostChunkHashes(args);
  }

  // ---- Vision tower -------------------------------------------------------------
  bool Supports(Op) const override { return true; }

  absl::Status Rope2d(float* x, int64_t ldx, const int32_t* pos, int64_t tokens,
                      int64_t heads, int64_t head_dim, float theta) override {
    TANDEM_RETURN_IF_ERROR(CheckRope2d(x, ldx, pos, tokens, heads, head_dim, theta));
    for (int64_t t = 0; t < tokens; ++t) {
      const double row = pos[2 * t], col = pos[2 * t + 1];
      for (int64_t h = 0; h < heads; ++h) {
        float* xh = x + t * ldx + h * head_dim;
        for (int64_t i = 0; i < head_dim / 4; ++i) {
          const double f = std::pow(static_cast<double>(theta),
                                    -4.0 * static_cast<double>(i) / head_dim);
          for (int half = 0; half < 2; ++half) {
            const double phi = (half == 0 ? col : row) * f;
            float* e = xh + 4 * i + 2 * half;
            const double a = e[0], b = e[1];
            e[0] = static_cast<float>(a * std::cos(phi) - b * std::sin(phi));
            e[1] = static_cast<float>(a * std::sin(phi) + b * std::cos(phi));
          }
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Gelu(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t rows,
                    int64_t n, bool tanh_approx) override {
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldx, "gelu"));
    TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldy, "gelu"));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        const double v = x[r * ldx + i];
        const double g = tanh_approx ? 0.5 * v *
                                           (1.0 + std::tanh(std::sqrt(2.0 / M_PI) *
                                                            (v + 0.044715 * v * v * v)))
                                     : 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
        y[r * ldy + i] = static_cast<float>(g);
      }
    }
    return absl::OkStatus();
  }

  absl::Status VisionAttention(const VisionAttnArgs& a) override {
    TANDEM_RETURN_IF_ERROR(CheckVisionAttention(a));
    const int64_t d = a.head_dim;
    std::vector<double> score;
    for (int64_t img = 0; img < a.num_images; ++img) {
      const int64_t b = a.cu_seqlens[img], e = a.cu_seqlens[img + 1];
      score.resize(e - b);
      for (int64_t h = 0; h < a.heads; ++h) {
        for (int64_t t = b; t < e; ++t) {
          const float* q = a.q + t * a.ld_qkv + h * d;
          double mx = -std::numeric_limits<double>::infinity();
          for (int64_t j = b; j < e; ++j) {
            const float* k = a.k + j * a.ld_qkv + h * d;
            double dot = 0;
            for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * k[c];
            score[j - b] = dot * a.scale;
            mx = std::max(mx, score[j - b]);
          }
          double den = 0;
          for (double& sc : score) {
            sc = std::exp(sc - mx);
            den += sc;
          }
          float* o = a.out + t * a.ld_out + h * d;
          for (int64_t c = 0; c < d; ++c) {
            double acc = 0;
            for (int64_t j = b; j < e; ++j) {
              acc += score[j - b] * a.v[j * a.ld_qkv + h * d + c];
            }
            o[c] = static_cast<float>(acc / den);
          }
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
        const float* src = x + (r * grid_w + c) * ldx;
        std::copy(src, src + d, out + m * ldo + part * d);
      }
    }
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<Device> device_ = CreateHostDevice();
  static void Dequant(const uint8_t* packed, const uint8_t* scale, int64_t rows,
                      int64_t cols, std::vector<float>* w) {
    w->resize(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t byte = packed[r * (cols / 2) + c / 2];
        const int code = (c % 2 == 0) ? (byte & 0xf) : (byte >> 4);
        (*w)[r * cols + c] =
            kE2m1Values[code] * E8m0ToF32(scale[r * (cols / 32) + c / 32]);
      }
    }
  }

  absl::Status Mla(const MlaArgs& a, bool absorbed) {
    TANDEM_RETURN_IF_ERROR(CheckMla(a));
    const int64_t lora = a.kv_lora_rank, nope = a.nope_dim, rope = a.rope_dim;
    const int64_t width = lora + rope, dq = nope + rope, per_head = nope + a.v_dim;
    auto w = [&](int64_t row, int64_t col) {
      return static_cast<double>(Bf16ToF32(a.kv_b_proj[row * lora + col]));
    };
    for (int64_t s = 0; s < a.num_seqs; ++s) {
      const int64_t q_len = a.query_start[s + 1] - a.query_start[s];
      const int64_t ctx = a.seq_lens[s];
      auto cache = [&](int64_t pos, int64_t i) {
        const int32_t blk =
            a.block_tables[s * a.block_table_stride + pos / a.block_size];
        return static_cast<double>(Bf16ToF32(
            a.kv_cache[(blk * a.block_size + pos % a.block_size) * width + i]));
      };
      for (int64_t h = 0; h < a.heads; ++h) {
        const int64_t r0 = h * per_head;  // W_UK rows r0..r0+nope, W_UV after
        // Expanded keys / values of every cached position for this head.
        std::vector<double> kn, vv;
        if (!absorbed) {
          kn.assign(ctx * nope, 0.0);
          vv.assign(ctx * a.v_dim, 0.0);
          for (int64_t p = 0; p < ctx; ++p) {
            for (int64_t c = 0; c < lora; ++c) {
              const double cv = cache(p, c);
              for (int64_t i = 0; i < nope; ++i) kn[p * nope + i] += w(r0 + i, c) * cv;
              for (int64_t j = 0; j < a.v_dim; ++j) {
                vv[p * a.v_dim + j] += w(r0 + nope + j, c) * cv;
              }
            }
          }
        }
        for (int64_t qi = 0; qi < q_len; ++qi) {
          const int64_t tok = a.query_start[s] + qi;
          const int64_t pos = ctx - q_len + qi;
          const float* q = a.q + tok * a.ld_q + h * dq;
          std::vector<double> score(pos + 1);
          std::vector<double> qlat(lora, 0.0);
          if (absorbed) {
            for (int64_t c = 0; c < lora; ++c) {
              for (int64_t i = 0; i < nope; ++i) qlat[c] += q[i] * w(r0 + i, c);
            }
          }
          double mx = -std::numeric_limits<double>::infinity();
          for (int64_t p = 0; p <= pos; ++p) {
            double dot = 0;
            if (absorbed) {
              for (int64_t c = 0; c < lora; ++c) dot += qlat[c] * cache(p, c);
            } else {
              for (int64_t i = 0; i < nope; ++i) dot += q[i] * kn[p * nope + i];
            }
            for (int64_t i = 0; i < rope; ++i) dot += q[nope + i] * cache(p, lora + i);
            score[p] = dot * a.scale;
            mx = std::max(mx, score[p]);
          }
          double den = 0;
          for (int64_t p = 0; p <= pos; ++p)
            den += (score[p] = std::exp(score[p] - mx));
          float* o = a.out + tok * a.ld_out + h * a.v_dim;
          if (absorbed) {
            std::vector<double> ctxv(lora, 0.0);
            for (int64_t p = 0; p <= pos; ++p) {
              for (int64_t c = 0; c < lora; ++c)
                ctxv[c] += score[p] / den * cache(p, c);
            }
            for (int64_t j = 0; j < a.v_dim; ++j) {
              double acc = 0;
              for (int64_t c = 0; c < lora; ++c) acc += w(r0 + nope + j, c) * ctxv[c];
              o[j] = static_cast<float>(acc);
            }
          } else {
            for (int64_t j = 0; j < a.v_dim; ++j) {
              double acc = 0;
              for (int64_t p = 0; p <= pos; ++p)
                acc += score[p] / den * vv[p * a.v_dim + j];
              o[j] = static_cast<float>(acc);
            }
          }
        }
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Backend> CreateReferenceBackend() {
  return std::make_unique<ReferenceBackend>();
}

}  // namespace tandem::kernels
