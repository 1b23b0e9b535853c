// SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014; the generator xoshiro's authors recommend for seeding):
// a tiny, well-mixed 64-bit generator whose whole output is defined by its state,
// unlike std:: distributions. One implementation for every deterministic seed or
// weight stream in Tandem (the checkpoint generator's tensors, the engine's seeds
// for requests that sample without one).
#ifndef TANDEM_COMMON_SPLITMIX_H_
#define TANDEM_COMMON_SPLITMIX_H_

#include <cstdint>

namespace tandem {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed = 0) : state_(seed) {}

  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

 private:
  uint64_t state_;
};

}  // namespace tandem

#endif  // TANDEM_COMMON_SPLITMIX_H_
