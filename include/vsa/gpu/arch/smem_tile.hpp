// A 64-row tile of a [rows, D] operand in shared memory, the one layout every matrix-core backend reads.
//
// Rows are D 16-bit elements (128 or 256 bytes). A warp's fragment loads read the same 16-byte column chunk
// of eight consecutive rows at once; with rows a multiple of 128 bytes apart those eight reads would all
// hit the same bank group. XOR-ing the chunk index with (row mod 8) spreads them over all 32 banks.
#pragma once

#include "../runtime.hpp"

namespace vsa {
namespace gpu {

inline constexpr int tile_rows = 64;

template <int D> struct smem_tile {
  static_assert(D % 64 == 0, "head dim must be a multiple of 64");
  static constexpr int chunks = D / 8; // 16-byte chunks per row
  static constexpr int bytes = tile_rows * D * 2;

  uint16_t* base;

  __device__ __forceinline__ static int offset(int row, int col) {
    return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
  }
  __device__ __forceinline__ uint16_t* at(int row, int col) const { return base + offset(row, col); }
  __device__ __forceinline__ uint16_t* chunk(int row, int c) const { return base + row * D + ((c ^ (row & 7)) << 3); }
};

// Dynamic shared memory one block may take: AMD's LDS is 64 KiB per workgroup; on NVIDIA 99 KiB is what
// every part from sm_80 on grants after opting in (sm_86/sm_89 stop there; sm_80 and sm_90 go further).
#if VSA_PLATFORM_AMD
inline constexpr int max_block_smem = 64 * 1024;
#else
inline constexpr int max_block_smem = 99 * 1024;
#endif

// Blocks of the forward kernel that should share a multiprocessor: its shared memory lets three sit on a
// Hopper SM (227 KiB), which also needs registers capped at 170 a thread; CDNA places by LDS alone.
#if VSA_PLATFORM_AMD
inline constexpr int forward_min_blocks = 1;
#else
inline constexpr int forward_min_blocks = 3;
#endif

// How the attention kernels use that budget for head dim D: two copy stages (the next tile streams in while
// the current one is used) where they fit, one otherwise; the dk/dv kernel's per-row statistics in shared
// memory where they fit, read from global memory otherwise.
template <int D> struct smem_plan {
  static constexpr int tile = smem_tile<D>::bytes;
  static constexpr int stats = 2 * 2 * 64 * 4; // per stage: log-sum-exp and delta of 64 rows
  // Forward: with two stages Q borrows the second stage's K slot (it is in registers before that fills).
  static constexpr int forward_stages = 2 * 2 * tile <= max_block_smem ? 2 : 1;
  static constexpr int forward_bytes = (forward_stages == 2 ? 4 : 3) * tile;
  static constexpr int backward_stages = (2 + 2 * 2) * tile + stats <= max_block_smem ? 2 : 1;
  static constexpr bool stats_in_smem = (2 + 2 * backward_stages) * tile + stats <= max_block_smem;
  static constexpr int backward_bytes = (2 + 2 * backward_stages) * tile + (stats_in_smem ? stats : 0);
  static_assert(forward_bytes <= max_block_smem && backward_bytes <= max_block_smem, "tiles do not fit");
};

} // namespace gpu
} // namespace vsa
