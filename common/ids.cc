#include "common/ids.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem {

IdGenerator::IdGenerator(std::optional<uint64_t> seed) {
  if (seed.has_value()) {
    rng_.seed(*seed);
  } else {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd(), rd(), rd(), rd(), rd()};
    rng_.seed(seq);
  }
}

std::string IdGenerator::Next(absl::string_view prefix) {
  uint64_t hi, lo;
  {
    absl::MutexLock lock(&mu_);
    hi = rng_();
    lo = rng_();
  }
  return absl::StrCat(prefix, absl::StrFormat("%016x%016x", hi, lo));
}

bool IsValidId(absl::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9') || c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

}  // namespace tandem
