// The PTX wrappers of kernels/cuda/ptx.h on the emulator: warp collectives that
// implement the instructions' definitions in the PTX ISA, fragment layouts
// included.
#include <cstdint>
#include <cstring>

#include "kernels/cuda/ptx.h"

namespace tandem::gpu {
namespace {

float LowBf16(uint32_t r) { return Bf16ToF32(static_cast<uint16_t>(r & 0xffffu)); }
float HighBf16(uint32_t r) { return Bf16ToF32(static_cast<uint16_t>(r >> 16)); }
float Half(uint32_t r, int hi) { return hi ? HighBf16(r) : LowBf16(r); }

struct MmaFragments {
  uint32_t a[4];
  uint32_t b[2];
};

}  // namespace

void MmaBf16M16N8K16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  MmaFragments mine;
  std::memcpy(mine.a, a, sizeof mine.a);
  std::memcpy(mine.b, b, sizeof mine.b);
  const unsigned char* all = ::cuda_sim::WarpExchange(kFullMask, &mine, sizeof mine);
  auto frag = [&](int lane) {
    MmaFragments f;
    std::memcpy(&f, all + 64 * lane, sizeof f);
    return f;
  };
  // A[r][c]: rows g and g + 8 of lane 4g + t, columns 2t, 2t+1 (+8 in a[2], a[3]).
  auto A = [&](int r, int c) {
    const int g = r % 8, t = (c % 8) / 2;
    const int reg = (r >= 8 ? 1 : 0) + (c >= 8 ? 2 : 0);
    return Half(frag(4 * g + t).a[reg], c % 2);
  };
  // B[k][n]: column n of lane 4n + t, rows 2t, 2t+1 (+8 in b[1]).
  auto B = [&](int k, int n) {
    const int t = (k % 8) / 2;
    return Half(frag(4 * n + t).b[k >= 8 ? 1 : 0], k % 2);
  };
  const int lane = ::cuda_sim::Self().lane;
  const int g = lane / 4, t = lane % 4;
  const int rows[4] = {g, g, g + 8, g + 8};
  const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc = std::fma(A(rows[i], k), B(k, cols[i]), acc);
    d[i] = acc;
  }
}

void LdMatrixX4(uint32_t r[4], const void* smem_row) {
  // ldmatrix takes 16-byte-aligned row addresses; a GPU faults on others.
  if (reinterpret_cast<uintptr_t>(smem_row) % 16 != 0) {
    ::cuda_sim::Fault("ldmatrix: a row address is not 16-byte aligned");
  }
  const unsigned char* all =
      ::cuda_sim::WarpExchange(kFullMask, &smem_row, sizeof smem_row);
  const int lane = ::cuda_sim::Self().lane;
  for (int i = 0; i < 4; ++i) {
    const unsigned char* row;
    std::memcpy(&row, all + 64 * (8 * i + lane / 4), sizeof row);
    std::memcpy(&r[i], row + 4 * (lane % 4), 4);
  }
}

void CpAsync16(void* smem, const void* gmem) {
  // cp.async of 16 bytes needs both addresses 16-byte aligned; a GPU faults on
  // others.
  if (reinterpret_cast<uintptr_t>(smem) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(gmem) % 16 != 0) {
    ::cuda_sim::Fault("cp.async: an address is not 16-byte aligned");
  }
  // Under a shuffling seed a copy lands either at once or only when waited for,
  // drawn per copy: a read before the wait (stale data) and a copy issued into a
  // buffer other threads still read (overwritten too early) both show.
  if (::cuda_sim::RandomBit()) {
    std::memcpy(smem, gmem, 16);
    return;
  }
  ::cuda_sim::ThreadState& s = ::cuda_sim::Self();
  ::cuda_sim::PendingCopy c;
  c.dst = smem;
  std::memcpy(c.data, gmem, 16);
  c.group = s.cp_async_group;
  s.cp_async.push_back(c);
}

void CpAsyncCommit() { ++::cuda_sim::Self().cp_async_group; }

void CpAsyncWaitGroups(int n) {
  ::cuda_sim::ThreadState& s = ::cuda_sim::Self();
  const int done_below =
      s.cp_async_group - n;  // committed groups older than the n newest
  size_t kept = 0;
  for (size_t i = 0; i < s.cp_async.size(); ++i) {
    ::cuda_sim::PendingCopy& c = s.cp_async[i];
    if (c.group < done_below) {
      std::memcpy(c.dst, c.data, 16);
    } else {
      s.cp_async[kept++] = c;
    }
  }
  s.cp_async.resize(kept);
}

}  // namespace tandem::gpu
