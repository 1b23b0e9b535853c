#include "engine/vision/vision_tower.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/model/bf16.h"
#include "engine/model/tensor_table.h"

namespace tandem::vision {
namespace {

using kernels::Op;

// The ops the tower calls (Create refuses a backend lacking any).
constexpr Op kTowerOps[] = {Op::kGemmBf16, Op::kRmsNorm, Op::kAddInPlace,
                            Op::kRope2d,   Op::kGelu,    Op::kVisionAttention,
                            Op::kMerge2x2};

// Grid sides the RoPE table covers (VISION.md: 512 x 512).
constexpr int64_t kMaxGridSide = kernels::kMaxRopePosition;

absl::StatusOr<const uint16_t*> Matrix(const model::Checkpoint& ckpt,
                                       const model::ExpectedTensor& e) {
  TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                          ckpt.GetChecked(e.name, e.dtype, e.shape));
  TANDEM_ASSIGN_OR_RETURN(absl::Span<const uint16_t> bits, v.BF16Bits());
  return bits.data();
}

absl::StatusOr<std::vector<float>> Floats(const model::Checkpoint& ckpt,
                                          const model::ExpectedTensor& e) {
  TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                          ckpt.GetChecked(e.name, e.dtype, e.shape));
  return v.ToFloat();
}

}  // namespace

absl::StatusOr<VisionWeights> LoadVisionWeights(const model::Checkpoint& ckpt) {
  VisionWeights w;
  TANDEM_ASSIGN_OR_RETURN(w.config, model::VisionConfigOf(ckpt.config()));
  const std::vector<model::ExpectedTensor> table =
      model::ExpectedVisionTensors(w.config);
  std::set<std::string> known;
  for (const model::ExpectedTensor& e : table) known.insert(e.name);
  for (const std::string& name : ckpt.tensors().Names()) {
    if (model::IsVisionTensor(name) && known.count(name) == 0) {
      return FailedPrecondition(ckpt.dir(), ": unknown vision tensor '", name,
                                "' (not in the tower's table for this vision_config)");
    }
  }
  // The table's order: patch embed, position table, 6 per block, final norm,
  // proj.0, proj.2, post_norm.
  size_t i = 0;
  TANDEM_ASSIGN_OR_RETURN(w.patch_embed, Matrix(ckpt, table[i++]));
  TANDEM_ASSIGN_OR_RETURN(w.pos_emb, Floats(ckpt, table[i++]));
  w.blocks.resize(w.config.vt_num_hidden_layers);
  for (VisionBlockWeights& b : w.blocks) {
    TANDEM_ASSIGN_OR_RETURN(b.norm0, Floats(ckpt, table[i++]));
    TANDEM_ASSIGN_OR_RETURN(b.norm1, Floats(ckpt, table[i++]));
    TANDEM_ASSIGN_OR_RETURN(b.wqkv, Matrix(ckpt, table[i++]));
    TANDEM_ASSIGN_OR_RETURN(b.wo, Matrix(ckpt, table[i++]));
    TANDEM_ASSIGN_OR_RETURN(b.fc0, Matrix(ckpt, table[i++]));
    TANDEM_ASSIGN_OR_RETURN(b.fc1, Matrix(ckpt, table[i++]));
  }
  TANDEM_ASSIGN_OR_RETURN(w.final_norm, Floats(ckpt, table[i++]));
  TANDEM_ASSIGN_OR_RETURN(w.proj0, Matrix(ckpt, table[i++]));
  TANDEM_ASSIGN_OR_RETURN(w.proj2, Matrix(ckpt, table[i++]));
  TANDEM_ASSIGN_OR_RETURN(w.post_norm, Floats(ckpt, table[i++]));
  return w;
}

std::vector<float> InterpolatePosEmb(const std::vector<float>& table, int64_t h0,
                                     int64_t w0, int64_t d, int64_t grid_h,
                                     int64_t grid_w) {
  if (grid_h == h0 && grid_w == w0) return table;
  // PyTorch's upsample_bilinear2d (align_corners=false): src = scale * (o + 0.5)
  // - 0.5 in fp32, clamped at 0; the upper neighbour clamped to the last index.
  struct Tap {
    int64_t i0, i1;
    float l0, l1;
  };
  auto taps = [](int64_t in, int64_t out) {
    std::vector<Tap> t(out);
    const float scale = static_cast<float>(in) / static_cast<float>(out);
    for (int64_t o = 0; o < out; ++o) {
      float src = scale * (static_cast<float>(o) + 0.5f) - 0.5f;
      if (src < 0) src = 0;
      const int64_t i0 = std::min<int64_t>(static_cast<int64_t>(src), in - 1);
      const int64_t i1 = std::min<int64_t>(i0 + 1, in - 1);
      const float l1 = src - static_cast<float>(i0);
      t[o] = {i0, i1, 1.0f - l1, l1};
    }
    return t;
  };
  const std::vector<Tap> th = taps(h0, grid_h), tw = taps(w0, grid_w);
  std::vector<float> out(grid_h * grid_w * d);
  for (int64_t r = 0; r < grid_h; ++r) {
    for (int64_t c = 0; c < grid_w; ++c) {
      const Tap& a = th[r];
      const Tap& b = tw[c];
      const float* x00 = &table[(a.i0 * w0 + b.i0) * d];
      const float* x01 = &table[(a.i0 * w0 + b.i1) * d];
      const float* x10 = &table[(a.i1 * w0 + b.i0) * d];
      const float* x11 = &table[(a.i1 * w0 + b.i1) * d];
      float* o = &out[(r * grid_w + c) * d];
      for (int64_t k = 0; k < d; ++k) {
        o[k] = a.l0 * (b.l0 * x00[k] + b.l1 * x01[k]) +
               a.l1 * (b.l0 * x10[k] + b.l1 * x11[k]);
      }
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<VisionTower>> VisionTower::Create(
    VisionWeights weights, kernels::Backend* backend) {
  if (backend == nullptr) return InvalidArgument("vision tower: no backend");
  for (Op op : kTowerOps) {
    if (!backend->Supports(op)) {
      return FailedPrecondition("vision tower: backend ", backend->name(),
                                " does not implement ", kernels::OpName(op),
                                "; image input needs a backend that has it");
    }
  }
  TANDEM_RETURN_IF_ERROR(model::ValidateVisionConfig(weights.config));
  std::unique_ptr<VisionTower> tower(new VisionTower(std::move(weights), backend));
  TANDEM_RETURN_IF_ERROR(tower->Place());
  return tower;
}

absl::Status VisionTower::Place() {
  const model::VisionConfig& c = w_.config;
  kernels::Device& dev = be_->device();
  const bool host = dev.name() == "host";
  TANDEM_RETURN_IF_ERROR(dev.MakeCurrent());
  // The host's pointers as they are; on a device an uploaded copy of `count`
  // elements.
  auto place = [&](const auto* src, int64_t count, const char* what, auto** dst) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(src)>>;
    if (host) {
      *dst = src;
      return absl::OkStatus();
    }
    const size_t bytes = static_cast<size_t>(count) * sizeof(T);
    auto buf = kernels::DeviceBuffer::Allocate(&dev, bytes);
    if (!buf.ok()) {
      return Annotate(buf.status(), absl::StrCat("vision tower: uploading ", what, " (",
                                                 bytes, " bytes) to ", dev.name()));
    }
    TANDEM_RETURN_IF_ERROR(dev.CopyToDevice(buf->data(), src, bytes));
    *dst = buf->as<T>();
    weight_device_bytes_ += static_cast<int64_t>(bytes);
    uploaded_.push_back(std::move(buf).value());
    return absl::OkStatus();
  };
  const int64_t D = c.vt_hidden_size, Q = c.qkv_hidden_size, I = c.vt_intermediate_size;
  const int64_t M4 = c.merged_dim(), Ht = c.text_hidden_size, pd = c.patch_dim();
  TANDEM_RETURN_IF_ERROR(place(w_.patch_embed, D * pd, "patch_embed", &p_.patch_embed));
  p_.blocks.resize(w_.blocks.size());
  for (size_t i = 0; i < w_.blocks.size(); ++i) {
    const VisionBlockWeights& b = w_.blocks[i];
    BlockPtrs& d = p_.blocks[i];
    TANDEM_RETURN_IF_ERROR(place(b.norm0.data(), D, "norm0", &d.norm0));
    TANDEM_RETURN_IF_ERROR(place(b.norm1.data(), D, "norm1", &d.norm1));
    TANDEM_RETURN_IF_ERROR(place(b.wqkv, 3 * Q * D, "wqkv", &d.wqkv));
    TANDEM_RETURN_IF_ERROR(place(b.wo, D * Q, "wo", &d.wo));
    TANDEM_RETURN_IF_ERROR(place(b.fc0, I * D, "fc0", &d.fc0));
    TANDEM_RETURN_IF_ERROR(place(b.fc1, D * I, "fc1", &d.fc1));
  }
  TANDEM_RETURN_IF_ERROR(place(w_.final_norm.data(), D, "final_norm", &p_.final_norm));
  TANDEM_RETURN_IF_ERROR(place(w_.proj0, M4 * M4, "proj.0", &p_.proj0));
  TANDEM_RETURN_IF_ERROR(place(w_.proj2, Ht * M4, "proj.2", &p_.proj2));
  TANDEM_RETURN_IF_ERROR(place(w_.post_norm.data(), Ht, "post_norm", &p_.post_norm));
  return host ? absl::OkStatus() : dev.Synchronize();
}

namespace {
// Sub-buffers carved from one allocation, each 256-byte aligned.
constexpr size_t kAlign = 256;
size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
}  // namespace

std::vector<size_t> VisionTower::BufferBytes(int64_t patches, int64_t images) const {
  const model::VisionConfig& c = w_.config;
  const int64_t P = patches, N = patches / 4;
  const size_t f = sizeof(float), i32 = sizeof(int32_t);
  return {
      P * c.patch_dim() * f,           // patches
      2 * P * i32,                     // positions
      (images + 1) * i32,              // cu_seqlens
      P * c.vt_hidden_size * f,        // position table rows
      P * c.vt_hidden_size * f,        // x
      P * c.vt_hidden_size * f,        // h
      3 * P * c.qkv_hidden_size * f,   // qkv
      P * c.qkv_hidden_size * f,       // attn
      P * c.vt_intermediate_size * f,  // mlp
      N * c.merged_dim() * f,          // merged
      N * c.merged_dim() * f,          // hidden
      N * c.text_hidden_size * f,      // out
  };
}

int64_t VisionTower::ActivationBytes(int64_t patches, int64_t images) const {
  size_t total = 0;
  for (size_t b : BufferBytes(patches, images)) total += Aligned(b);
  return static_cast<int64_t>(total);
}

absl::StatusOr<int64_t> VisionTower::ReserveActivations(int64_t patches,
                                                        int64_t images) {
  kernels::Device& dev = be_->device();
  if (dev.name() == "host") return 0;
  const size_t bytes = static_cast<size_t>(ActivationBytes(patches, images));
  if (arena_.bytes() >= bytes) return static_cast<int64_t>(arena_.bytes());
  TANDEM_RETURN_IF_ERROR(dev.MakeCurrent());
  arena_.Reset();
  auto buf = kernels::DeviceBuffer::Allocate(&dev, bytes);
  if (!buf.ok()) {
    return Annotate(buf.status(),
                    absl::StrCat("vision tower: reserving ", bytes, " bytes on ",
                                 dev.name(), " for calls of ", patches, " patches"));
  }
  arena_ = std::move(buf).value();
  return static_cast<int64_t>(bytes);
}

absl::StatusOr<std::unique_ptr<VisionTower>> VisionTower::Load(
    const model::Checkpoint& ckpt, kernels::Backend* backend) {
  TANDEM_ASSIGN_OR_RETURN(VisionWeights w, LoadVisionWeights(ckpt));
  return Create(std::move(w), backend);
}

const std::vector<float>& VisionTower::PosEmbFor(int64_t grid_h, int64_t grid_w) {
  auto key = std::make_pair(grid_h, grid_w);
  auto it = pos_cache_.find(key);
  if (it != pos_cache_.end()) return it->second;
  if (pos_cache_.size() >= 64) pos_cache_.clear();  // bounded: distinct grids
  const model::VisionConfig& c = w_.config;
  return pos_cache_
      .emplace(key, InterpolatePosEmb(w_.pos_emb, c.init_pos_emb_height,
                                      c.init_pos_emb_width, c.vt_hidden_size, grid_h,
                                      grid_w))
      .first->second;
}

absl::StatusOr<std::vector<float>> VisionTower::Encode(
    absl::Span<const media::PatchedImage* const> images) {
  const model::VisionConfig& c = w_.config;
  const int64_t pd = c.patch_dim();
  std::vector<int64_t> sizes(images.size());
  for (size_t i = 0; i < images.size(); ++i) {
    const media::PatchedImage* im = images[i];
    if (im == nullptr) return InvalidArgument("vision tower: image ", i, " is null");
    if (im->patch_size != c.patch_size) {
      return InvalidArgument("vision tower: image ", i, " has patch_size ",
                             im->patch_size, ", the tower ", c.patch_size);
    }
    if (im->grid_h <= 0 || im->grid_w <= 0 || im->grid_h % 2 != 0 ||
        im->grid_w % 2 != 0 || im->grid_h > kMaxGridSide || im->grid_w > kMaxGridSide) {
      return InvalidArgument("vision tower: image ", i, " has grid ", im->grid_h, "x",
                             im->grid_w, " (both sides even, 2..", kMaxGridSide, ")");
    }
    const int64_t n = int64_t{im->grid_h} * im->grid_w;
    if (static_cast<int64_t>(im->patches.size()) != n * pd) {
      return InvalidArgument("vision tower: image ", i, " holds ", im->patches.size(),
                             " patch values, its grid needs ", n * pd);
    }
    sizes[i] = n;
  }
  // Groups of consecutive images within max_patches_per_call_ (an image alone
  // beyond it): the images are independent, so the rows are the same (up to
  // the GEMMs' blocking by row count).
  std::vector<float> out;
  for (size_t i = 0; i < images.size();) {
    size_t j = i;
    int64_t patches = 0;
    while (j < images.size() &&
           (j == i || patches + sizes[j] <= max_patches_per_call_)) {
      patches += sizes[j++];
    }
    TANDEM_ASSIGN_OR_RETURN(std::vector<float> rows,
                            EncodeGroup(images.subspan(i, j - i)));
    if (out.empty()) {
      out = std::move(rows);
    } else {
      out.insert(out.end(), rows.begin(), rows.end());
    }
    i = j;
  }
  return out;
}

absl::StatusOr<std::vector<float>> VisionTower::EncodeGroup(
    absl::Span<const media::PatchedImage* const> images) {
  const model::VisionConfig& c = w_.config;
  const int64_t D = c.vt_hidden_size, Q = c.qkv_hidden_size, I = c.vt_intermediate_size;
  const int64_t nh = c.vt_num_attention_heads, hd = c.head_dim(), pd = c.patch_dim();
  const int64_t M4 = c.merged_dim(), Ht = c.text_hidden_size;
  const float eps = static_cast<float>(c.vt_norm_eps);
  const int64_t G = static_cast<int64_t>(images.size());
  int64_t P = 0, max_len = 0;
  for (const media::PatchedImage* im : images) {
    const int64_t n = int64_t{im->grid_h} * im->grid_w;
    P += n;
    max_len = std::max(max_len, n);
  }
  const int64_t N = P / 4;
  if (P == 0) return std::vector<float>();

  // Host inputs: the patches rounded to BF16 (the reference's cast), RoPE
  // positions (row, column) from (0, 0) per image, cu_seqlens, and each image's
  // position table rows.
  std::vector<float> patches(P * pd), pe(P * D);
  std::vector<int32_t> pos(2 * P), cu(G + 1, 0);
  {
    int64_t t = 0;
    for (int64_t i = 0; i < G; ++i) {
      const media::PatchedImage& im = *images[i];
      for (size_t k = 0; k < im.patches.size(); ++k) {
        patches[t * pd + k] = model::Bf16ToFloat(model::FloatToBf16(im.patches[k]));
      }
      const std::vector<float>& table = PosEmbFor(im.grid_h, im.grid_w);
      std::copy(table.begin(), table.end(), pe.begin() + t * D);
      for (int r = 0; r < im.grid_h; ++r) {
        for (int col = 0; col < im.grid_w; ++col, ++t) {
          pos[2 * t] = r;
          pos[2 * t + 1] = col;
        }
      }
      cu[i + 1] = static_cast<int32_t>(t);
    }
  }

  // Every buffer of the call in one allocation of the backend's memory (on a
  // device the tower's kept one, grown when a call needs more; on the host the
  // call's own), the kernels launched on its device (the calling thread's
  // current one on CUDA).
  kernels::Device& dev = be_->device();
  TANDEM_RETURN_IF_ERROR(dev.MakeCurrent());
  kernels::DeviceBuffer local;
  char* next = nullptr;
  if (dev.name() == "host") {
    TANDEM_ASSIGN_OR_RETURN(local,
                            kernels::DeviceBuffer::Allocate(
                                &dev, static_cast<size_t>(ActivationBytes(P, G))));
    next = local.as<char>();
  } else {
    TANDEM_RETURN_IF_ERROR(ReserveActivations(P, G).status());
    next = arena_.as<char>();
  }
  const std::vector<size_t> sizes = BufferBytes(P, G);
  size_t part = 0;
  auto carve = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    T* p = reinterpret_cast<T*>(next);
    next += Aligned(sizes[part++]);
    return p;
  };
  float* d_patches = carve(static_cast<float*>(nullptr));
  int32_t* d_pos = carve(static_cast<int32_t*>(nullptr));
  int32_t* d_cu = carve(static_cast<int32_t*>(nullptr));
  float* d_pe = carve(static_cast<float*>(nullptr));
  float* x = carve(static_cast<float*>(nullptr));
  float* h = carve(static_cast<float*>(nullptr));
  float* qkv = carve(static_cast<float*>(nullptr));
  float* attn = carve(static_cast<float*>(nullptr));
  float* mlp = carve(static_cast<float*>(nullptr));
  float* merged = carve(static_cast<float*>(nullptr));
  float* hidden = carve(static_cast<float*>(nullptr));
  float* d_out = carve(static_cast<float*>(nullptr));
  TANDEM_RETURN_IF_ERROR(
      dev.CopyToDevice(d_patches, patches.data(), patches.size() * sizeof(float)));
  TANDEM_RETURN_IF_ERROR(
      dev.CopyToDevice(d_pos, pos.data(), pos.size() * sizeof(int32_t)));
  TANDEM_RETURN_IF_ERROR(
      dev.CopyToDevice(d_cu, cu.data(), cu.size() * sizeof(int32_t)));
  TANDEM_RETURN_IF_ERROR(dev.CopyToDevice(d_pe, pe.data(), pe.size() * sizeof(float)));

  TANDEM_RETURN_IF_ERROR(
      be_->GemmBf16(d_patches, pd, p_.patch_embed, pd, x, D, P, D, pd, false));
  TANDEM_RETURN_IF_ERROR(be_->AddInPlace(x, d_pe, P * D));

  kernels::VisionAttnArgs a;
  a.heads = nh;
  a.head_dim = hd;
  a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  a.num_images = G;
  a.num_tokens = P;
  a.max_seqlen = max_len;
  a.cu_seqlens = d_cu;
  a.q = qkv;
  a.k = qkv + Q;
  a.v = qkv + 2 * Q;
  a.ld_qkv = 3 * Q;
  a.out = attn;
  a.ld_out = Q;
  const float theta = static_cast<float>(c.vt_rope_theta);
  for (const BlockPtrs& b : p_.blocks) {
    TANDEM_RETURN_IF_ERROR(be_->RmsNorm(x, D, b.norm0, h, D, P, D, eps));
    TANDEM_RETURN_IF_ERROR(
        be_->GemmBf16(h, D, b.wqkv, D, qkv, 3 * Q, P, 3 * Q, D, false));
    // q and k are the first 2Q columns: 2 * nh heads of hd.
    TANDEM_RETURN_IF_ERROR(be_->Rope2d(qkv, 3 * Q, d_pos, P, 2 * nh, hd, theta));
    TANDEM_RETURN_IF_ERROR(be_->VisionAttention(a));
    TANDEM_RETURN_IF_ERROR(be_->GemmBf16(attn, Q, b.wo, Q, x, D, P, D, Q, true));
    TANDEM_RETURN_IF_ERROR(be_->RmsNorm(x, D, b.norm1, h, D, P, D, eps));
    TANDEM_RETURN_IF_ERROR(be_->GemmBf16(h, D, b.fc0, D, mlp, I, P, I, D, false));
    TANDEM_RETURN_IF_ERROR(be_->Gelu(mlp, I, mlp, I, P, I, /*tanh_approx=*/true));
    TANDEM_RETURN_IF_ERROR(be_->GemmBf16(mlp, I, b.fc1, I, x, D, P, D, I, true));
  }
  TANDEM_RETURN_IF_ERROR(be_->RmsNorm(x, D, p_.final_norm, x, D, P, D, eps));

  int64_t m0 = 0;
  for (int64_t i = 0; i < G; ++i) {
    const media::PatchedImage& im = *images[i];
    TANDEM_RETURN_IF_ERROR(be_->Merge2x2(x + int64_t{cu[i]} * D, D, im.grid_h,
                                         im.grid_w, D, merged + m0 * M4, M4));
    m0 += im.num_tokens();
  }
  TANDEM_RETURN_IF_ERROR(
      be_->GemmBf16(merged, M4, p_.proj0, M4, hidden, M4, N, M4, M4, false));
  TANDEM_RETURN_IF_ERROR(
      be_->Gelu(hidden, M4, hidden, M4, N, M4, /*tanh_approx=*/false));
  TANDEM_RETURN_IF_ERROR(
      be_->GemmBf16(hidden, M4, p_.proj2, M4, d_out, Ht, N, Ht, M4, false));
  TANDEM_RETURN_IF_ERROR(be_->RmsNorm(d_out, Ht, p_.post_norm, d_out, Ht, N, Ht,
                                      static_cast<float>(c.projector_ln_eps)));
  std::vector<float> out(N * Ht);
  TANDEM_RETURN_IF_ERROR(dev.CopyToHost(out.data(), d_out, out.size() * sizeof(float)));
  // Device errors of the call's kernels (bad tables), and the inputs' host
  // copies outlive their uploads.
  TANDEM_RETURN_IF_ERROR(be_->Synchronize());
  return out;
}

}  // namespace tandem::vision
