// Counter-based randomness for per-request reproducible sampling.
//
// Every random number a request consumes is a pure function of (seed, output
// position, stream): Philox-4x32-10 (Salmon et al., "Parallel random numbers:
// as easy as 1, 2, 3", SC'11) keyed by the 64-bit seed, with the counter built
// from the position and a stream tag. So the token at output position i depends
// only on (seed, i, logits): not on batch composition, step boundaries, which
// worker runs it (a prefill worker samples position 0, a decode worker 1..), or
// how many numbers earlier positions drew.
#ifndef TANDEM_ENGINE_SAMPLING_COUNTER_RNG_H_
#define TANDEM_ENGINE_SAMPLING_COUNTER_RNG_H_

#include <array>
#include <cstdint>

namespace tandem::engine {

// Philox-4x32 with 10 rounds; matches Random123's known-answer vectors.
std::array<uint32_t, 4> Philox4x32(std::array<uint32_t, 4> counter,
                                   std::array<uint32_t, 2> key);

// What a uniform is for; distinct streams at one position are independent.
enum class RngStream : uint32_t {
  kSample = 0,        // choosing the token at this position
  kSpecAccept = 1,    // speculative decoding: accept/reject the draft here
  kSpecResidual = 2,  // speculative decoding: resample after a rejection
};

// A uniform double in [0, 1) with 53 random bits, for (seed, position,
// stream). `index` selects further independent draws at the same point.
double CounterUniform(uint64_t seed, int64_t position, RngStream stream,
                      uint32_t index = 0);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_SAMPLING_COUNTER_RNG_H_
