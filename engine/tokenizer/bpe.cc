#include "engine/tokenizer/bpe.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace tandem::tokenizer {
namespace {

constexpr int kNoRank = std::numeric_limits<int>::max();
// Pieces up to this many bytes use the quadratic scan (faster when short);
// longer ones use a heap.
constexpr size_t kSmallPiece = 64;

}  // namespace

absl::StatusOr<BytePairEncoder> BytePairEncoder::Parse(absl::string_view contents,
                                                       int expected_count,
                                                       absl::string_view source) {
  BytePairEncoder enc;
  std::vector<std::string> tokens(expected_count);
  std::vector<bool> have(expected_count, false);
  int line_no = 0;
  int count = 0;
  size_t total = 0;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    ++line_no;
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    if (sp == absl::string_view::npos || sp == 0 ||
        line.find(' ', sp + 1) != absl::string_view::npos) {
      return InvalidArgument(source, ":", line_no,
                             ": expected 'base64-token rank', got '",
                             absl::CHexEscape(line.substr(0, 80)), "'");
    }
    std::string token;
    if (!absl::Base64Unescape(line.substr(0, sp), &token) || token.empty()) {
      return InvalidArgument(source, ":", line_no, ": bad base64 token '",
                             absl::CHexEscape(line.substr(0, std::min<size_t>(sp, 80))),
                             "'");
    }
    int rank;
    if (!absl::SimpleAtoi(line.substr(sp + 1), &rank)) {
      return InvalidArgument(source, ":", line_no, ": bad rank '",
                             absl::CHexEscape(line.substr(sp + 1, 20)), "'");
    }
    if (rank < 0 || rank >= expected_count) {
      return InvalidArgument(source, ":", line_no, ": rank ", rank, " outside [0, ",
                             expected_count, ")");
    }
    if (have[rank]) {
      return InvalidArgument(source, ":", line_no, ": duplicate rank ", rank);
    }
    have[rank] = true;
    total += token.size();
    tokens[rank] = std::move(token);
    ++count;
  }
  if (count != expected_count) {
    return InvalidArgument(source, ": expected ", expected_count, " ranks, found ",
                           count);
  }
  enc.arena_.reserve(total);
  enc.offsets_.reserve(expected_count + 1);
  for (const std::string& t : tokens) {
    enc.offsets_.push_back(static_cast<uint32_t>(enc.arena_.size()));
    enc.arena_ += t;
  }
  enc.offsets_.push_back(static_cast<uint32_t>(enc.arena_.size()));
  size_t capacity = 16;
  while (capacity < 3 * static_cast<size_t>(expected_count)) capacity <<= 1;
  enc.slots_.assign(capacity, Slot{kEmpty, 0});
  enc.mask_ = capacity - 1;
  for (int r = 0; r < expected_count; ++r) {
    const int other = enc.Insert(r);
    if (other >= 0) {
      return InvalidArgument(source, ": token '", absl::CHexEscape(enc.Bytes(r)),
                             "' has two ranks, ", other, " and ", r);
    }
  }
  enc.pair_rank_.resize(1 << 16);
  for (int k = 0; k < (1 << 16); ++k) {
    const char two[2] = {static_cast<char>(k >> 8), static_cast<char>(k & 0xFF)};
    enc.pair_rank_[k] = enc.Rank(absl::string_view(two, 2));
  }
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    enc.byte_rank_[b] = enc.Rank(absl::string_view(&c, 1));
    if (enc.byte_rank_[b] < 0) {
      return InvalidArgument(source, ": byte 0x", absl::Hex(b),
                             " has no rank (byte-level BPE needs all 256)");
    }
  }
  return enc;
}

uint64_t BytePairEncoder::Hash(const char* p, size_t n) {
  auto mix = [](uint64_t a, uint64_t b) {
    const __uint128_t r = static_cast<__uint128_t>(a) * b;
    return static_cast<uint64_t>(r) ^ static_cast<uint64_t>(r >> 64);
  };
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xA0761D6478BD642Full);
  while (n > 8) {
    uint64_t w;
    __builtin_memcpy(&w, p, 8);
    h = mix(h ^ w, 0xE7037ED1A0B428DBull);
    p += 8;
    n -= 8;
  }
  uint64_t w;
  if (n >= 4) {
    uint32_t a, b;
    __builtin_memcpy(&a, p, 4);
    __builtin_memcpy(&b, p + n - 4, 4);
    w = (static_cast<uint64_t>(a) << 32) | b;
  } else if (n > 0) {
    const auto* u = reinterpret_cast<const uint8_t*>(p);
    w = (static_cast<uint64_t>(u[0]) << 16) | (static_cast<uint64_t>(u[n >> 1]) << 8) |
        u[n - 1];
  } else {
    w = 0;
  }
  return mix(h ^ w, 0x8EBC6AF09C88C6E3ull);
}

int BytePairEncoder::Insert(uint32_t r) {
  const absl::string_view b = Bytes(static_cast<int>(r));
  const int existing = Find(b.data(), b.size());
  if (existing >= 0) return existing;
  const uint64_t h = Hash(b.data(), b.size());
  size_t i = h & mask_;
  while (slots_[i].rank != kEmpty) i = (i + 1) & mask_;
  slots_[i] = Slot{r, static_cast<uint32_t>(h >> 32)};
  return -1;
}

absl::StatusOr<BytePairEncoder> BytePairEncoder::Load(const std::string& path,
                                                      int expected_count) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot open ", path);
  std::stringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return DataLoss("error reading ", path);
  return Parse(buf.str(), expected_count, path);
}

void BytePairEncoder::Encode(absl::string_view piece, std::vector<int>* out) const {
  if (piece.size() == 1) {
    out->push_back(byte_rank_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (int r = Rank(piece); r >= 0) {
    out->push_back(r);
    return;
  }
  if (piece.size() <= kSmallPiece) {
    MergeSmall(piece, out);
  } else {
    MergeLarge(piece, out);
  }
}

// tiktoken's loop: parts are start offsets; pair[i] is the rank of
// parts i and i+1 joined. Merge the minimum (leftmost), refresh its neighbours.
void BytePairEncoder::MergeSmall(absl::string_view piece, std::vector<int>* out) const {
  uint32_t start[kSmallPiece + 1];
  int pair[kSmallPiece];
  size_t n = piece.size();
  for (size_t i = 0; i <= n; ++i) start[i] = static_cast<uint32_t>(i);
  auto rank_of = [&](uint32_t a, uint32_t b) {
    const int r =
        b - a == 2 ? PairRank(piece.data() + a) : Find(piece.data() + a, b - a);
    return r < 0 ? kNoRank : r;
  };
  size_t parts = n;  // number of parts; start[parts] == n
  for (size_t i = 0; i + 1 < parts; ++i) {
    const int r = PairRank(piece.data() + i);
    pair[i] = r < 0 ? kNoRank : r;
  }
  while (parts > 1) {
    int best = kNoRank;
    size_t bi = 0;
    for (size_t i = 0; i + 1 < parts; ++i) {
      if (pair[i] < best) {
        best = pair[i];
        bi = i;
      }
    }
    if (best == kNoRank) break;
    // Remove boundary bi+1.
    for (size_t k = bi + 1; k < parts; ++k) start[k] = start[k + 1];
    for (size_t k = bi; k + 1 < parts - 1; ++k) pair[k] = pair[k + 1];
    --parts;
    if (bi + 1 < parts) pair[bi] = rank_of(start[bi], start[bi + 2]);
    if (bi > 0) pair[bi - 1] = rank_of(start[bi - 1], start[bi + 1]);
  }
  for (size_t i = 0; i < parts; ++i) {
    out->push_back(Find(piece.data() + start[i], start[i + 1] - start[i]));
  }
}

// Same rule in O(n log n): a linked list of parts and a min-heap of candidate
// pairs keyed by rank << 32 | start (the order of the scan: lowest rank, then
// leftmost). A rank names its bytes, so (rank, start) names the pair; an entry
// is current iff pair_rank[start] still equals its rank (merged-away parts
// hold kDead), and stale entries are skipped when popped.
void BytePairEncoder::MergeLarge(absl::string_view piece, std::vector<int>* out) const {
  constexpr int kDead = -2;
  const uint32_t n = static_cast<uint32_t>(piece.size());
  thread_local std::vector<uint32_t> next, prev;
  thread_local std::vector<int> pair_rank;
  thread_local std::vector<uint64_t> heap;
  next.resize(n);
  prev.resize(n);
  pair_rank.assign(n, -1);
  heap.clear();
  for (uint32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i == 0 ? 0 : i - 1;
  }
  auto key = [](int rank, uint32_t start) {
    return (static_cast<uint64_t>(rank) << 32) | start;
  };
  auto refresh = [&](uint32_t s) {
    const uint32_t mid = next[s];
    int r = -1;
    if (mid < n) r = Find(piece.data() + s, next[mid] - s);
    pair_rank[s] = r;
    if (r >= 0) {
      heap.push_back(key(r, s));
      std::push_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    }
  };
  for (uint32_t i = 0; i + 1 < n; ++i) {
    const int r = PairRank(piece.data() + i);
    pair_rank[i] = r;
    if (r >= 0) heap.push_back(key(r, i));
  }
  std::make_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    const uint64_t top = heap.back();
    heap.pop_back();
    const int rank = static_cast<int>(top >> 32);
    const uint32_t s = static_cast<uint32_t>(top);
    if (pair_rank[s] != rank) continue;  // stale
    // Merge part `mid` into part `s`.
    const uint32_t mid = next[s];
    const uint32_t end = next[mid];
    pair_rank[mid] = kDead;
    next[s] = end;
    if (end < n) prev[end] = s;
    refresh(s);
    if (s > 0) refresh(prev[s]);
  }
  for (uint32_t s = 0; s < n; s = next[s]) {
    out->push_back(Find(piece.data() + s, next[s] - s));
  }
}

}  // namespace tandem::tokenizer
