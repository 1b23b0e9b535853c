#include "kernels/cpu/onednn_gemm.h"

#include <map>
#include <mutex>
#include <tuple>

#include "common/status.h"
#include "dnnl.hpp"

namespace tandem::kernels {

struct OneDnnGemm::Impl {
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool>;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{eng};
  std::mutex mu;
  std::map<Key, std::pair<dnnl::matmul::primitive_desc, dnnl::matmul>> cache;
};

OneDnnGemm::OneDnnGemm() : impl_(std::make_unique<Impl>()) {}
OneDnnGemm::~OneDnnGemm() = default;

absl::Status OneDnnGemm::GemmBf16(const uint16_t* xb, const uint16_t* w, int64_t ldw,
                                  float* y, int64_t ldy, int64_t m, int64_t n,
                                  int64_t k, bool accumulate) {
  using dt = dnnl::memory::data_type;
  // oneDNN reports errors by exception; keep them inside this boundary.
  try {
    std::lock_guard<std::mutex> lock(impl_->mu);
    const Impl::Key key{m, n, k, ldw, ldy, accumulate};
    auto it = impl_->cache.find(key);
    dnnl::memory::desc a_md({m, k}, dt::bf16, {k, 1});
    dnnl::memory::desc b_md({k, n}, dt::bf16, {1, ldw});
    dnnl::memory::desc c_md({m, n}, dt::f32, {ldy, 1});
    if (it == impl_->cache.end()) {
      dnnl::primitive_attr attr;
      if (accumulate) {
        dnnl::post_ops ops;
        ops.append_sum(1.0f);
        attr.set_post_ops(ops);
      }
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr,
                                      impl_->eng);
      it = impl_->cache.emplace(key, std::make_pair(pd, dnnl::matmul(pd))).first;
    }
    dnnl::memory a(a_md, impl_->eng, const_cast<uint16_t*>(xb));
    dnnl::memory b(b_md, impl_->eng, const_cast<uint16_t*>(w));
    dnnl::memory c(c_md, impl_->eng, y);
    it->second.second.execute(
        impl_->stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    impl_->stream.wait();
  } catch (const dnnl::error& e) {
    return Internal("oneDNN matmul ", m, "x", n, "x", k, ": ", e.what());
  }
  return absl::OkStatus();
}

}  // namespace tandem::kernels
