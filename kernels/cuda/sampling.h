// Token sampling on the GPU: the device twin of engine/sampling (sampler.h,
// rejection_sampler.h). Launchers take plain C++ types; every pointer is device
// memory (under the emulator device memory is host memory), scalars are host.
//
// THE CONTRACT is the CPU sampler: for the same logits, parameters, history and
// seed, LaunchSample chooses the same token as engine::Sampler::Sample, and
// LaunchRejectionSample makes the same accept/reject decisions and emits the
// same tokens as engine::RejectionSample. Same order of operations (suppress →
// logit bias → repetition → frequency/presence → temperature → top-k → top-p → min-p →
// inverse-CDF draw in token-id order), the same counter-based uniform
// (CounterUniform below is engine/sampling/counter_rng's Philox-4x32-10,
// header-inline for both compilers), the same float arithmetic where the CPU's
// float arithmetic decides (see "Exactness").
//
// Design (one 512-thread block per row; no sort of the vocabulary):
//   P0  the structured-output mask (SampleArgs::allowed_bitmask: disallowed
//       tokens to -inf), the logit bias, repetition / frequency / presence
//       penalties, then suppression, applied IN
//       PLACE to the logits row (each listed id is distinct, one thread each);
//       temperature is applied on the fly (x = l / t) by every later pass.
//   P1  per 256-token chunk (the CPU's online-softmax chunk): chunk max, NaN/+inf
//       check, finite count, argmax (lowest id on ties). Greedy stops here.
//   P2  prefix max over chunks (block scan), then per chunk the float sum of
//       exp(x - running max) in index order by one lane: bit-for-bit the CPU's
//       chunk sums; their rescaled double total is sum, lse = max + log(sum).
//       The same pass counts the tokens within 16 nats of the max and their
//       mass (the CPU's gather window).
//   P3  top-k: radix select (4 passes of 8-bit digits of an order-preserving
//       key, shared-memory count histograms, the bin found by a warp scan) for
//       the k-th value, then its tie-breaking id (lowest ids first) by a tiled
//       block count; top-p: the same radix select over mass histograms (double)
//       restricted to the top-k set, finding the shortest rank prefix whose mass
//       reaches top_p * norm; min-p: a threshold. Both selections look only at
//       the 16-nat window (a prefix of the ranking, usually a few hundred
//       tokens, so few histogram atomics) when it provably holds the answer
//       (>= k tokens, >= the top-p target's mass), else at every finite token.
//       The kept set is "ranked at or above a boundary (logit, id)", as the CPU
//       describes it.
//   P4  inverse-CDF draw: per chunk the double sum of kept weights in index
//       order, a block exclusive scan over chunks, the chunk where the CDF
//       crosses u * mass, then that chunk's sequential scan by one thread.
//   P5  logprob of the chosen token (x - lse) and top-n alternatives (radix
//       select of the n-th, gather, rank in shared memory); optionally the
//       whole distribution (Sampler::Distribution) for speculative decoding.
//   Score rows (prompt logprobs, SamplingRowParams::score_token >= 0, the twin
//       of engine::ScoreToken): the packer gives them no P0 entries and
//       temperature 1; P1 and P2 as for a logprob row, no draw (P3, P4): the
//       token is the given one, its rank 1 + a block count of the tokens
//       strictly above it, then P5. The softmax sum is the sampler's chunked
//       one (ScoreToken sums in one float64 pass): logprobs agree to ~1e-7.
//   The per-chunk sequential passes (P1, P2, P4) give each lane one chunk and
//   load through a per-warp padded shared tile (32 chunks x 8 tokens per step:
//   full 32-byte sectors, conflict-free reads), so the CPU's order costs no
//   uncoalesced traffic. Cost per row: ~6 streaming reads of the row (mostly
//   L2-resident) plus 4-8 radix passes when top-k/top-p/top-n are on. One block
//   per row suits batches of tens of rows and more; a single-row launch uses one
//   SM (a split-row variant for tiny batches is future work).
//
// Exactness. Float sums that the CPU computes sequentially (the 256-token chunk
// sums) are computed sequentially here in the same order, so they are the same
// bits. Double sums of float weights (the CDF, the kept mass, the top-k norm)
// are computed here in a different (parallel, deterministic) order; their
// rounding differs from the CPU's by at most ~n * 2^-53 of the total. The draw
// therefore checks its margin: when u * mass lies within kMarginRel * mass of
// the chosen token's CDF interval ends (probability ~2e-9 per draw), one thread
// replays the CPU's sequential computation exactly (the CPU's chunked sum, then
// the running sum in id order) and that decides. Residual cases that cannot
// be replayed bit-for-bit (both ~1e-11 per draw, documented, not hidden):
//   - truncated sampling: the CPU sums the kept mass in the order nth_element
//     left its candidates (libstdc++'s permutation); the replay sums in id
//     order, equal whenever that sum is exact (e.g. all weights >= 2^-29 of
//     the largest) or the margin is wider than the rounding.
//   - top-p: the CPU accumulates its prefix mass in nth_element's halving order,
//     the GPU in shared-memory atomics per radix bin (an order that also varies
//     from run to run); a prefix mass within ~1e-11 relative of top_p * norm
//     could cut one token differently. Exact when the weights sum exactly (the
//     tie-group tests) or the target is not that close to a prefix mass.
// Transcendentals: under the emulator exp/log are the host's libm, the CPU's
// functions, so the test checks bit-identity. With nvcc, expf/logf of a float
// are computed as (float)exp((double)x): CUDA's double exp is within 1 ulp, so
// that is the correctly rounded float except within 2^-29 of a rounding
// midpoint. glibc's expf is not correctly rounded (its bound is 0.502 ulp, and
// logf's 0.818): results that close to a midpoint round either way, a small
// fraction of arguments but a few tokens of most 163,840-token rows. On
// hardware a token's weight therefore differs from the CPU's in its last bit in
// most rows, a chunk sum or a logprob now and then (the GPU tests compare
// logprobs within 1e-5), and a draw flips only when its u lands within ~1e-7 of
// a CDF step. Making that exact needs one shared expf implementation for both
// samplers (a follow-up for engine/sampling). No FMA contraction where the CPU has
// none: products that feed sums use __fmul_rn / __dmul_rn on the device.
//
// Errors: a row whose processed logits hold NaN or +inf, or whose every token
// is -inf, or whose structured-output mask leaves no token, or random sampling
// without a seed, gets token -1 and a nonzero row_status (SampleStatus); penalty,
// bias or suppressed ids outside the vocabulary are skipped (as the CPU skips them) and
// recorded as kTokenIdOutOfRange in error_word; a draft token outside the vocabulary
// fails its request the same way.
#ifndef TANDEM_KERNELS_CUDA_SAMPLING_H_
#define TANDEM_KERNELS_CUDA_SAMPLING_H_

#include <cstdint>

#include "kernels/sampling_args.h"

#if defined(__CUDACC__)
#define TANDEM_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define TANDEM_SAMPLING_HD inline
#endif

namespace tandem::kernels::cuda {

// ---- Counter-based uniform: engine/sampling/counter_rng.{h,cc}, inline ---------
// Stream tags (engine::RngStream).
constexpr uint32_t kRngSample = 0;
constexpr uint32_t kRngSpecAccept = 1;
constexpr uint32_t kRngSpecResidual = 2;

TANDEM_SAMPLING_HD void SamplingPhilox4x32(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32),
                   lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32),
                   lo1 = static_cast<uint32_t>(p1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
  }
}

// engine::CounterUniform(seed, position, stream, index): [0, 1), 53 bits.
TANDEM_SAMPLING_HD double CounterUniform(uint64_t seed, int64_t position,
                                         uint32_t stream, uint32_t index = 0) {
  const uint64_t pos = static_cast<uint64_t>(position);
  uint32_t c[4] = {static_cast<uint32_t>(pos), static_cast<uint32_t>(pos >> 32), stream,
                   index};
  SamplingPhilox4x32(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = (static_cast<uint64_t>(c[0]) << 32) | c[1];
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

// ---- Sampling -------------------------------------------------------------------
// The launch arguments (kernels/sampling_args.h, shared with Backend::SampleTokens).
using kernels::kSampleAllMasked;
using kernels::kSampleBadLogits;
using kernels::kSampleNoAllowedToken;
using kernels::kSampleNoSeed;
using kernels::kSampleOk;
using kernels::kSamplingGreedyTemperature;
using kernels::kSamplingMaxTopLogprobs;
using kernels::kSamplingMaxVocab;
using kernels::SampleArgs;
using kernels::SampleStatus;
using kernels::SamplingRowParams;

// Samples every row (one block per row). nullptr or the launch error.
const char* LaunchSample(const SampleArgs& args, void* stream);

// ---- Speculative decoding (engine/sampling/rejection_sampler) ---------------------
struct RejectionArgs {
  int32_t requests = 0;
  int32_t vocab = 0;
  int32_t max_drafts = 0;  // K
  // [requests, K + 1, vocab]: row j is the target distribution at drafted
  // position j, row num_drafts follows the last draft.
  const float* target_probs = nullptr;
  const float* draft_probs = nullptr;        // [requests, K, vocab]
  const int32_t* draft_tokens = nullptr;     // [requests, K]
  const int32_t* num_drafts = nullptr;       // [requests] (<= K), or null: all K
  const uint64_t* seeds = nullptr;           // [requests]
  const int64_t* first_positions = nullptr;  // [requests]
  int32_t* num_accepted = nullptr;           // [requests]; -1 on a failed request
  int32_t* next_token = nullptr;             // [requests]; -1 on a failed request
  int32_t* error_word = nullptr;
  int32_t debug_exact_replay = 0;
};

// engine::RejectionSample for every request (one block per request).
const char* LaunchRejectionSample(const RejectionArgs& args, void* stream);

// engine::GreedyVerify: target_argmax [requests, K + 1], drafts [requests, K].
const char* LaunchGreedyVerify(int32_t requests, int32_t max_drafts,
                               const int32_t* target_argmax,
                               const int32_t* draft_tokens, const int32_t* num_drafts,
                               int32_t* num_accepted, int32_t* next_token,
                               void* stream);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_SAMPLING_H_
