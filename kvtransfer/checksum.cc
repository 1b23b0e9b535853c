#include "kvtransfer/checksum.h"

#include <xxhash.h>

#include <memory>

#include "absl/strings/str_cat.h"

namespace tandem::kvtransfer {
namespace {

struct StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

}  // namespace

absl::StatusOr<uint64_t> LayerChecksum(const RankLayout& side, LayerRef layer,
                                       int64_t num_tokens, const RegionBytes& regions) {
  auto ranges = LayerRanges(side, layer, num_tokens);
  if (!ranges.ok()) return ranges.status();
  std::unique_ptr<XXH3_state_t, StateDeleter> state(XXH3_createState());
  XXH3_64bits_reset(state.get());
  for (const ByteRange& r : *ranges) {
    absl::Span<const uint8_t> bytes = regions(r.region);
    if (bytes.empty() || r.offset > bytes.size() ||
        r.length > bytes.size() - r.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("checksum range [", r.offset, ", +", r.length,
                       ") outside region ", r.region, " of ", bytes.size(), " bytes"));
    }
    XXH3_64bits_update(state.get(), bytes.data() + r.offset, r.length);
  }
  return static_cast<uint64_t>(XXH3_64bits_digest(state.get()));
}

uint64_t TotalChecksum(const tandem::v1::StateChecksums& sums) {
  std::string buf;
  auto put = [&buf](uint64_t v) {
    for (int i = 0; i < 8; ++i) buf.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  for (uint64_t v : sums.mla_layer()) put(v);
  for (uint64_t v : sums.kda_layer()) put(v);
  return XXH3_64bits(buf.data(), buf.size());
}

absl::StatusOr<tandem::v1::StateChecksums> ComputeChecksums(
    const RankLayout& side, int64_t num_tokens, const RegionBytes& regions) {
  tandem::v1::StateChecksums sums;
  for (int l = 0; l < side.layout.num_mla_layers(); ++l) {
    auto c = LayerChecksum(side, {LayerKind::kMla, l}, num_tokens, regions);
    if (!c.ok()) return c.status();
    sums.add_mla_layer(*c);
  }
  for (int l = 0; l < side.layout.num_kda_layers(); ++l) {
    auto c = LayerChecksum(side, {LayerKind::kKda, l}, num_tokens, regions);
    if (!c.ok()) return c.status();
    sums.add_kda_layer(*c);
  }
  sums.set_total(TotalChecksum(sums));
  return sums;
}

absl::Status Verify(const tandem::v1::StateChecksums& expected,
                    const tandem::v1::StateChecksums& actual) {
  if (expected.mla_layer_size() != actual.mla_layer_size() ||
      expected.kda_layer_size() != actual.kda_layer_size()) {
    return absl::DataLossError(absl::StrCat(
        "state checksums cover different layers: expected ", expected.mla_layer_size(),
        " MLA + ", expected.kda_layer_size(), " KDA, got ", actual.mla_layer_size(),
        " MLA + ", actual.kda_layer_size(), " KDA"));
  }
  for (int l = 0; l < expected.mla_layer_size(); ++l) {
    if (expected.mla_layer(l) != actual.mla_layer(l)) {
      return absl::DataLossError(absl::StrCat(
          "state checksum mismatch in MLA layer ", l, ": expected ",
          absl::Hex(expected.mla_layer(l)), ", got ", absl::Hex(actual.mla_layer(l))));
    }
  }
  for (int l = 0; l < expected.kda_layer_size(); ++l) {
    if (expected.kda_layer(l) != actual.kda_layer(l)) {
      return absl::DataLossError(absl::StrCat(
          "state checksum mismatch in KDA layer ", l, ": expected ",
          absl::Hex(expected.kda_layer(l)), ", got ", absl::Hex(actual.kda_layer(l))));
    }
  }
  if (expected.total() != actual.total()) {
    return absl::DataLossError(absl::StrCat("state checksum total mismatch: expected ",
                                            absl::Hex(expected.total()), ", got ",
                                            absl::Hex(actual.total())));
  }
  return absl::OkStatus();
}

}  // namespace tandem::kvtransfer
