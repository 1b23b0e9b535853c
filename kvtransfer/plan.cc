#include "kvtransfer/plan.h"

#include "absl/strings/str_cat.h"

namespace tandem::kvtransfer {
namespace {

using tandem::v1::KvLayout;

uint64_t BlockBytes(const KvLayout& l) {
  return static_cast<uint64_t>(l.block_size()) *
         static_cast<uint64_t>(l.mla_token_bytes());
}
uint64_t BlockStride(const RankLayout& s, const MlaPool& p) {
  return p.block_stride ? p.block_stride : BlockBytes(s.layout);
}
uint64_t ConvOffset(const RankLayout& s, const KdaPool& p) {
  return p.conv_offset ? p.conv_offset
                       : static_cast<uint64_t>(s.layout.kda_state_bytes());
}
uint64_t SlotStride(const RankLayout& s, const KdaPool& p) {
  return p.slot_stride ? p.slot_stride
                       : static_cast<uint64_t>(s.layout.kda_state_bytes() +
                                               s.layout.kda_conv_bytes());
}
std::string Dtype(const KvLayout& l) {
  return l.mla_dtype().empty() ? "bf16" : l.mla_dtype();
}

absl::Status Bad(absl::string_view side, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(side, " layout: ", what));
}

absl::Status ValidateSide(const RankLayout& s, int64_t num_tokens,
                          absl::string_view name) {
  const KvLayout& l = s.layout;
  if (num_tokens < 0)
    return Bad(name, absl::StrCat("negative token count ", num_tokens));
  if (l.num_mla_layers() < 0 || l.num_kda_layers() < 0)
    return Bad(name, "negative layer count");
  if (static_cast<int64_t>(s.mla.size()) != l.num_mla_layers()) {
    return Bad(name, absl::StrCat(s.mla.size(), " MLA pools for ", l.num_mla_layers(),
                                  " MLA layers (layer count mismatch)"));
  }
  if (static_cast<int64_t>(s.kda.size()) != l.num_kda_layers()) {
    return Bad(name, absl::StrCat(s.kda.size(), " KDA pools for ", l.num_kda_layers(),
                                  " KDA layers (layer count mismatch)"));
  }
  if (l.tp_size() < 1 || l.tp_rank() < 0 || l.tp_rank() >= l.tp_size()) {
    return Bad(name,
               absl::StrCat("tp_rank ", l.tp_rank(), " of tp_size ", l.tp_size()));
  }
  if (l.num_mla_layers() > 0) {
    if (l.block_size() < 1)
      return Bad(name, absl::StrCat("block_size ", l.block_size()));
    if (l.mla_token_bytes() < 1) {
      return Bad(name, absl::StrCat("mla_token_bytes ", l.mla_token_bytes()));
    }
    const int64_t needed = (num_tokens + l.block_size() - 1) / l.block_size();
    if (static_cast<int64_t>(s.block_ids.size()) < needed) {
      return Bad(name,
                 absl::StrCat("block table too short: ", s.block_ids.size(),
                              " blocks for ", num_tokens, " tokens at block_size ",
                              l.block_size(), " (need ", needed, ")"));
    }
    for (size_t i = 0; i < s.mla.size(); ++i) {
      const MlaPool& p = s.mla[i];
      if (BlockStride(s, p) < BlockBytes(l)) {
        return Bad(name,
                   absl::StrCat("MLA layer ", i, " block stride smaller than a block"));
      }
      for (int64_t b = 0; b < needed; ++b) {
        if (s.block_ids[b] < 0 || s.block_ids[b] >= p.num_blocks) {
          return Bad(name, absl::StrCat("block id ", s.block_ids[b], " at position ", b,
                                        " outside MLA layer ", i, "'s ", p.num_blocks,
                                        " blocks"));
        }
      }
    }
  }
  if (l.num_kda_layers() > 0) {
    if (l.kda_state_bytes() < 1 || l.kda_conv_bytes() < 0) {
      return Bad(name, "KDA state must be non-empty and conv bytes non-negative");
    }
    for (size_t i = 0; i < s.kda.size(); ++i) {
      const KdaPool& p = s.kda[i];
      const uint64_t conv = ConvOffset(s, p);
      const uint64_t state = l.kda_state_bytes();
      if (l.kda_conv_bytes() > 0 && conv < state) {
        return Bad(name,
                   absl::StrCat("KDA layer ", i, " conv tails overlap the state"));
      }
      if (SlotStride(s, p) < conv + l.kda_conv_bytes()) {
        return Bad(name,
                   absl::StrCat("KDA layer ", i, " slot stride smaller than a slot"));
      }
      if (s.state_slot < 0 || s.state_slot >= p.num_slots) {
        return Bad(name,
                   absl::StrCat("state slot ", s.state_slot, " outside KDA layer ", i,
                                "'s ", p.num_slots, " slots"));
      }
    }
  }
  return absl::OkStatus();
}

void AppendRange(std::vector<ByteRange>* out, RegionId region, uint64_t offset,
                 uint64_t length) {
  if (length == 0) return;
  out->push_back(ByteRange{region, offset, length});
}

// Rows [begin, end) of an MLA layer (one range per block piece), or the KDA
// layer's slot state (begin/end ignored).
std::vector<ByteRange> RowRangesUnchecked(const RankLayout& s, LayerRef layer,
                                          int64_t begin, int64_t end) {
  std::vector<ByteRange> out;
  const KvLayout& l = s.layout;
  if (layer.kind == LayerKind::kMla) {
    const MlaPool& p = s.mla[layer.index];
    const uint64_t tb = l.mla_token_bytes();
    const int64_t bs = l.block_size();
    for (int64_t t = begin; t < end;) {
      const int64_t in_block = t % bs;
      const int64_t n = std::min<int64_t>(bs - in_block, end - t);
      const uint64_t block = s.block_ids[t / bs];
      AppendRange(&out, p.region, p.offset + block * BlockStride(s, p) + in_block * tb,
                  n * tb);
      t += n;
    }
  } else {
    const KdaPool& p = s.kda[layer.index];
    const uint64_t slot =
        p.offset + static_cast<uint64_t>(s.state_slot) * SlotStride(s, p);
    AppendRange(&out, p.region, slot, l.kda_state_bytes());
    AppendRange(&out, p.region, slot + ConvOffset(s, p), l.kda_conv_bytes());
  }
  return out;
}

std::vector<ByteRange> RangesUnchecked(const RankLayout& s, LayerRef layer,
                                       int64_t num_tokens) {
  return RowRangesUnchecked(s, layer, 0, num_tokens);
}

absl::Status CheckLayerIndex(const RankLayout& s, LayerRef layer) {
  const int n = layer.kind == LayerKind::kMla ? s.layout.num_mla_layers()
                                              : s.layout.num_kda_layers();
  if (layer.index < 0 || layer.index >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat(layer.kind == LayerKind::kMla ? "MLA" : "KDA", " layer ",
                     layer.index, " out of range [0, ", n, ")"));
  }
  return absl::OkStatus();
}

// Zips two token-ordered range lists of equal total into segments.
void Zip(const std::vector<ByteRange>& src, const std::vector<ByteRange>& dst,
         std::vector<Segment>* out) {
  size_t i = 0, j = 0;
  uint64_t si = 0, dj = 0;  // consumed within src[i], dst[j]
  while (i < src.size() && j < dst.size()) {
    const uint64_t n = std::min(src[i].length - si, dst[j].length - dj);
    out->push_back(Segment{src[i].region, src[i].offset + si, dst[j].region,
                           dst[j].offset + dj, n});
    si += n;
    dj += n;
    if (si == src[i].length) {
      ++i;
      si = 0;
    }
    if (dj == dst[j].length) {
      ++j;
      dj = 0;
    }
  }
}

}  // namespace

RankLayout ContiguousRankLayout(const KvLayout& layout, int64_t num_blocks,
                                int64_t num_slots, RegionId region,
                                uint64_t base_offset) {
  RankLayout s;
  s.layout = layout;
  uint64_t off = base_offset;
  for (int l = 0; l < layout.num_mla_layers(); ++l) {
    s.mla.push_back(MlaPool{region, off, 0, num_blocks});
    off += static_cast<uint64_t>(num_blocks) * BlockBytes(layout);
  }
  const uint64_t slot = layout.kda_state_bytes() + layout.kda_conv_bytes();
  for (int l = 0; l < layout.num_kda_layers(); ++l) {
    s.kda.push_back(KdaPool{region, off, 0, 0, num_slots});
    off += static_cast<uint64_t>(num_slots) * slot;
  }
  return s;
}

uint64_t ContiguousRegionBytes(const KvLayout& layout, int64_t num_blocks,
                               int64_t num_slots) {
  return static_cast<uint64_t>(layout.num_mla_layers()) * num_blocks *
             BlockBytes(layout) +
         static_cast<uint64_t>(layout.num_kda_layers()) * num_slots *
             (layout.kda_state_bytes() + layout.kda_conv_bytes());
}

absl::Status ValidateRankLayout(const RankLayout& side, int64_t num_tokens) {
  return ValidateSide(side, num_tokens, "rank");
}

absl::Status ValidatePair(const RankLayout& src, const RankLayout& dst,
                          int64_t num_tokens) {
  absl::Status st = ValidateSide(src, num_tokens, "sender");
  if (!st.ok()) return st;
  st = ValidateSide(dst, num_tokens, "receiver");
  if (!st.ok()) return st;
  const KvLayout& a = src.layout;
  const KvLayout& b = dst.layout;
  auto mismatch = [](absl::string_view what, auto x, auto y) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " mismatch: sender ", x, ", receiver ", y));
  };
  if (a.tp_size() != b.tp_size()) return mismatch("TP size", a.tp_size(), b.tp_size());
  if (a.tp_rank() != b.tp_rank()) return mismatch("TP rank", a.tp_rank(), b.tp_rank());
  if (a.num_mla_layers() != b.num_mla_layers()) {
    return mismatch("MLA layer count", a.num_mla_layers(), b.num_mla_layers());
  }
  if (a.num_kda_layers() != b.num_kda_layers()) {
    return mismatch("KDA layer count", a.num_kda_layers(), b.num_kda_layers());
  }
  if (a.num_mla_layers() > 0) {
    if (a.mla_token_bytes() != b.mla_token_bytes()) {
      return mismatch("MLA token bytes", a.mla_token_bytes(), b.mla_token_bytes());
    }
    if (Dtype(a) != Dtype(b)) return mismatch("MLA dtype", Dtype(a), Dtype(b));
  }
  if (a.num_kda_layers() > 0) {
    if (a.kda_state_bytes() != b.kda_state_bytes()) {
      return mismatch("KDA state bytes", a.kda_state_bytes(), b.kda_state_bytes());
    }
    if (a.kda_conv_bytes() != b.kda_conv_bytes()) {
      return mismatch("KDA conv bytes", a.kda_conv_bytes(), b.kda_conv_bytes());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ByteRange>> LayerRanges(const RankLayout& side,
                                                   LayerRef layer, int64_t num_tokens) {
  absl::Status st = ValidateSide(side, num_tokens, "rank");
  if (!st.ok()) return st;
  st = CheckLayerIndex(side, layer);
  if (!st.ok()) return st;
  return RangesUnchecked(side, layer, num_tokens);
}

size_t Coalesce(std::vector<Segment>* segments) {
  if (segments->empty()) return 0;
  size_t w = 0;
  for (size_t r = 1; r < segments->size(); ++r) {
    Segment& last = (*segments)[w];
    const Segment& s = (*segments)[r];
    if (s.local_region == last.local_region && s.remote_region == last.remote_region &&
        s.local_offset == last.local_offset + last.length &&
        s.remote_offset == last.remote_offset + last.length) {
      last.length += s.length;
    } else {
      (*segments)[++w] = s;
    }
  }
  segments->resize(w + 1);
  return segments->size();
}

absl::StatusOr<TransferPlan> PlanLayer(const RankLayout& src, const RankLayout& dst,
                                       LayerRef layer, int64_t num_tokens) {
  absl::Status st = ValidatePair(src, dst, num_tokens);
  if (!st.ok()) return st;
  st = CheckLayerIndex(src, layer);
  if (!st.ok()) return st;
  TransferPlan plan;
  Zip(RangesUnchecked(src, layer, num_tokens), RangesUnchecked(dst, layer, num_tokens),
      &plan.segments);
  plan.segments_before_coalescing = plan.segments.size();
  for (const Segment& s : plan.segments) plan.bytes += s.length;
  Coalesce(&plan.segments);
  return plan;
}

absl::StatusOr<TransferPlan> PlanLayerRows(const RankLayout& src, const RankLayout& dst,
                                           LayerRef layer, int64_t begin, int64_t end) {
  if (begin < 0 || begin > end) {
    return absl::InvalidArgumentError(
        absl::StrCat("row range [", begin, ", ", end, ") is not a range"));
  }
  absl::Status st = ValidatePair(src, dst, end);
  if (!st.ok()) return st;
  st = CheckLayerIndex(src, layer);
  if (!st.ok()) return st;
  TransferPlan plan;
  Zip(RowRangesUnchecked(src, layer, begin, end),
      RowRangesUnchecked(dst, layer, begin, end), &plan.segments);
  plan.segments_before_coalescing = plan.segments.size();
  for (const Segment& s : plan.segments) plan.bytes += s.length;
  Coalesce(&plan.segments);
  return plan;
}

absl::StatusOr<TransferPlan> PlanAll(const RankLayout& src, const RankLayout& dst,
                                     int64_t num_tokens, int64_t first_token) {
  if (first_token < 0 || first_token > num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("first token ", first_token,
                                                   " outside the sequence of ",
                                                   num_tokens, " tokens"));
  }
  absl::Status st = ValidatePair(src, dst, num_tokens);
  if (!st.ok()) return st;
  TransferPlan plan;
  auto add = [&](LayerRef layer) {
    Zip(RowRangesUnchecked(src, layer, first_token, num_tokens),
        RowRangesUnchecked(dst, layer, first_token, num_tokens), &plan.segments);
  };
  for (int l = 0; l < src.layout.num_mla_layers(); ++l) add({LayerKind::kMla, l});
  for (int l = 0; l < src.layout.num_kda_layers(); ++l) add({LayerKind::kKda, l});
  plan.segments_before_coalescing = plan.segments.size();
  for (const Segment& s : plan.segments) plan.bytes += s.length;
  Coalesce(&plan.segments);
  return plan;
}

}  // namespace tandem::kvtransfer
