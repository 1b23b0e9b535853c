#include "engine/tokenizer/bpe.h"

#include <fstream>
#include <limits>
#include <queue>
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
      return InvalidArgument(source, ":", line_no, ": rank ", rank,
                             " outside [0, ", expected_count, ")");
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
  enc.ranks_.reserve(expected_count);
  for (int r = 0; r < expected_count; ++r) {
    auto [it, inserted] = enc.ranks_.emplace(enc.Bytes(r), r);
    if (!inserted) {
      return InvalidArgument(source, ": token '", absl::CHexEscape(enc.Bytes(r)),
                             "' has two ranks, ", it->second, " and ", r);
    }
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
    const int r = Rank(piece.substr(a, b - a));
    return r < 0 ? kNoRank : r;
  };
  size_t parts = n;  // number of parts; start[parts] == n
  for (size_t i = 0; i + 1 < parts; ++i) pair[i] = rank_of(start[i], start[i + 2]);
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
    out->push_back(Rank(piece.substr(start[i], start[i + 1] - start[i])));
  }
}

// Same rule in O(n log n): a linked list of parts and a min-heap of candidate
// pairs keyed by (rank, start); stale entries are skipped when popped.
void BytePairEncoder::MergeLarge(absl::string_view piece, std::vector<int>* out) const {
  const uint32_t n = static_cast<uint32_t>(piece.size());
  std::vector<uint32_t> next(n), prev(n);
  for (uint32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i == 0 ? 0 : i - 1;
  }
  struct Cand {
    int rank;
    uint32_t start;
    uint32_t end;  // end of the pair's second part when the entry was made
    bool operator>(const Cand& o) const {
      return rank != o.rank ? rank > o.rank : start > o.start;
    }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](uint32_t s) {
    const uint32_t mid = next[s];
    if (mid >= n) return;
    const uint32_t e = next[mid];
    const int r = Rank(piece.substr(s, e - s));
    if (r >= 0) heap.push({r, s, e});
  };
  std::vector<bool> alive(n, true);
  for (uint32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    if (!alive[c.start]) continue;
    const uint32_t mid = next[c.start];
    if (mid >= n || next[mid] != c.end) continue;  // stale
    // Merge part `mid` into part `c.start`.
    alive[mid] = false;
    next[c.start] = c.end;
    if (c.end < n) prev[c.end] = c.start;
    push(c.start);
    if (c.start > 0) push(prev[c.start]);
  }
  for (uint32_t s = 0; s < n; s = next[s]) {
    out->push_back(Rank(piece.substr(s, next[s] - s)));
  }
}

}  // namespace tandem::tokenizer
