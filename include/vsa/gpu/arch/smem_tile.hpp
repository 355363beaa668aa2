// A 64-row tile of a [rows, D] operand in shared memory, the one layout every matrix-core backend reads.
//
// A warp's fragment loads read the same 16-byte column chunk of eight consecutive rows at once; with rows a
// multiple of 128 bytes apart those eight reads would all hit the same bank group. XOR-ing the chunk index
// with (row mod 8) spreads them over all 32 banks.
//
// On NVIDIA the tile is stored as D/64 panels of 64 columns, each 64 rows of 128 bytes: that is the
// "128-byte swizzle" layout Hopper's warpgroup matrix instructions read straight from shared memory (eight
// rows of a panel form one 1024-byte swizzle atom, chunk c of row r at chunk c ^ (r mod 8)), and it is as
// conflict-free for ldmatrix as whole rows are. Tiles then start on 1024-byte boundaries (aligned_smem).
// On AMD a row is stored whole (D elements) with the same XOR. The placement itself is plain arithmetic in
// smem_layout.hpp, which host code (the CPU model of wgmma's shared-memory reads) runs as well.
#pragma once

#include "../platform.hpp"
#include "smem_layout.hpp"

namespace vsa {
namespace gpu {

template <int D> struct smem_tile {
  static_assert(D % 64 == 0, "head dim must be a multiple of 64");
  static constexpr int chunks = D / 8; // 16-byte chunks per row
  static constexpr int bytes = tile_rows * D * 2;

  uint16_t* base;

  __device__ __forceinline__ static int chunk_offset(int row, int c) {
#if VSA_PLATFORM_NVIDIA
    return smem_layout::panel_chunk_offset(row, c);
#else
    return smem_layout::row_chunk_offset(D, row, c);
#endif
  }
  __device__ __forceinline__ static int offset(int row, int col) { return chunk_offset(row, col >> 3) + (col & 7); }
  __device__ __forceinline__ uint16_t* at(int row, int col) const { return base + offset(row, col); }
  __device__ __forceinline__ uint16_t* chunk(int row, int c) const { return base + chunk_offset(row, c); }
};

// Alignment of the tiles in dynamic shared memory, and the slack a kernel asks for to reach it: the
// hardware applies the 128-byte swizzle to address bits, so a panel must start on a 1024-byte boundary.
#if VSA_PLATFORM_NVIDIA
inline constexpr int smem_alignment = 1024;
#else
inline constexpr int smem_alignment = 16;
#endif
inline constexpr int smem_slack = smem_alignment > 16 ? smem_alignment : 0;

// The offset is added to the shared pointer itself (not through an integer round trip), so the compiler
// still knows it points into shared memory (LDS instructions on AMD, where nothing needs aligning).
__device__ __forceinline__ uint16_t* aligned_smem(void* raw) {
#if VSA_PLATFORM_NVIDIA
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  const uint32_t pad = (smem_alignment - addr % smem_alignment) % smem_alignment;
  return reinterpret_cast<uint16_t*>(static_cast<char*>(raw) + pad);
#else
  return static_cast<uint16_t*>(raw);
#endif
}

// Dynamic shared memory one block may take: AMD's LDS is 64 KiB per workgroup; on NVIDIA 99 KiB is what
// every part from sm_80 on grants after opting in (sm_86/sm_89 stop there; sm_80 and sm_90 go further).
#if VSA_PLATFORM_AMD
inline constexpr int max_block_smem = 64 * 1024;
#else
inline constexpr int max_block_smem = 99 * 1024;
#endif

// Blocks of the forward kernel that should share a multiprocessor, the register cap __launch_bounds__ derives
// from it (65536 / (128 threads · blocks)). Hopper's sparse pass: the one-stage pipeline's 48 KiB (D = 128) or
// 40 KiB (D = 64) let four sit on an SM's 227 KiB, so registers are capped at 128 (ptxas spills 16-92 bytes at
// D = 128, none at D = 64); measured on the H200 against three blocks (163 / 136 registers): 1.04-1.05x at
// D = 128, 1.10x at D = 64 (bench/NOTES.md, v15). Elsewhere three, the most the shared memory of two stages
// allows on sm_80 and sm_90 (the coarse pass); CDNA places by LDS alone.
inline constexpr int forward_min_blocks([[maybe_unused]] bool hopper, [[maybe_unused]] bool few_blocks) {
#if VSA_PLATFORM_AMD
  return 1;
#else
  return hopper && !few_blocks ? 4 : 3;
#endif
}

// The backward's portable kernels' second launch bound, from their MinBlocks template argument (a probe's; 0 by
// default, no bound). With none, ptxas picks their registers itself (Hopper, D = 64: 128 for dq, 165 for dk/dv: four
// and three blocks an SM); a bound of one block would let it take up to 255 (152 and 203), and caps of five dq or
// four dk/dv blocks spill and measured 1.5x and 1.8x slower on the H200 (bench/NOTES.md, v19). CDNA reads the
// second bound as waves an execution unit: none there.
inline constexpr int backward_min_blocks([[maybe_unused]] int asked) {
#if VSA_PLATFORM_AMD
  return 0;
#else
  return asked;
#endif
}

// How the attention kernels use that budget for head dim D: two copy stages (the next tile streams in while
// the current one is used) where they fit, one otherwise; the dk/dv kernel's per-row statistics in shared
// memory where they fit, read from global memory otherwise.
template <int D> struct smem_plan {
  static constexpr int tile = smem_tile<D>::bytes;
  static constexpr int stats = 2 * 2 * 64 * 4; // per stage: log-sum-exp and delta of 64 rows
  // Forward: copy stages and bytes, `hopper` for Hopper code, `few_blocks` for a grid smaller than one wave
  // of the GPU (the coarse pass). Two stages: while tile j is used, tile j+1 streams into the other stage;
  // Q, read into registers first, borrows the second stage's K slot. On Hopper the wgmma backend reads Q
  // from shared memory in every product, so Q keeps a slot of its own, and a grid that fills the GPU gets
  // one stage: Q, K and V in 48 KiB for D = 128, four blocks per SM with registers capped at 128
  // (forward_min_blocks), against two with two stages and Q's own slot (80 KiB). Measured on an H200
  // (bench/NOTES.md): one stage 1.17x faster than two at three blocks an SM, four blocks 1.04x more. With the copy
  // engine (hopper_tma.hpp) K and V are each refilled right after the product that reads them, so one stage still
  // overlaps copy and work. The coarse pass keeps two stages and copy_tile: there each block's chain of steps matters,
  // not occupancy, and one stage through the copy engine measured slower (23.4 → 27.9 µs on wan2.1, bench/NOTES.md v8).
  //
  // Head dim 64 on Hopper is the exception (forward_overlap): its tiles are small (40 KiB for two stages and
  // Q; registers, not shared memory, bound its blocks an SM), and its matrix work per step is no more than
  // its exponentials, so the loop overlaps the products of one step with the softmax of the next, which
  // needs the next K while the current V is still read: two stages.
  static constexpr bool forward_overlap(bool hopper, bool few_blocks) { return hopper && !few_blocks && D == 64; }
  static constexpr int forward_stages(bool hopper, bool few_blocks) {
    return forward_overlap(hopper, few_blocks) ? 2 : hopper && !few_blocks ? 1 : 2 * 2 * tile <= max_block_smem ? 2 : 1;
  }
  static constexpr bool forward_q_shares(bool hopper, bool few_blocks) {
    return !hopper && forward_stages(hopper, few_blocks) == 2;
  }
  // Hopper's sparse pass in the one-step loop forms P's row sums on the matrix cores (row_sums_by_product,
  // matrix.hpp) from a block of ones after Q: 1 KiB more, four blocks an SM still.
  static constexpr int ones_bytes = 1024; // warpgroup_mma::ones_bytes, which host code cannot name
  static constexpr bool forward_ones(bool hopper, bool few_blocks) {
    return hopper && !few_blocks && !forward_overlap(hopper, few_blocks);
  }
  static constexpr int forward_bytes(bool hopper, bool few_blocks) {
    return (2 * forward_stages(hopper, few_blocks) + (forward_q_shares(hopper, few_blocks) ? 0 : 1)) * tile +
           (forward_ones(hopper, few_blocks) ? ones_bytes : 0) + smem_slack;
  }
  // Backward: two stages where they fit, except on Hopper, where one stage (64 KiB for D = 128: three dq
  // blocks per SM instead of two) measured 1.07x faster on the H200.
  static constexpr int backward_stages(bool hopper) {
    return !hopper && (2 + 2 * 2) * tile + stats + smem_slack <= max_block_smem ? 2 : 1;
  }
  // The portable dk/dv (the Hopper sparse pass at D = 128 has a kernel and plan of its own: hopper/dkdv.hpp)
  // takes two stages of Q and dO wherever they fit, Hopper's D = 128 included: its registers (254 a
  // thread) hold it at two blocks an SM whatever its shared memory, so the second stage costs no block, and
  // the next pair's tiles stream in through the copy engine during the whole of a step: 1.04x on the H200
  // (bench/NOTES.md, v15). Hopper's D = 64 keeps one: its second stage goes through cp.async (no copy engine
  // there, see the kernel) and measured 1.04x slower.
  static constexpr int dkdv_stages(bool hopper) {
    return hopper && D == 64 ? 1 : (2 + 2 * 2) * tile + stats + smem_slack <= max_block_smem ? 2 : 1;
  }
  static constexpr bool stats_in_smem(bool hopper) {
    return (2 + 2 * backward_stages(hopper)) * tile + stats + smem_slack <= max_block_smem;
  }
  static constexpr bool dkdv_stats_in_smem(bool hopper) {
    return (2 + 2 * dkdv_stages(hopper)) * tile + stats + smem_slack <= max_block_smem;
  }
  static constexpr int backward_bytes(bool hopper) {
    return (2 + 2 * backward_stages(hopper)) * tile + (stats_in_smem(hopper) ? stats : 0) + smem_slack;
  }
  static constexpr int dkdv_bytes(bool hopper) {
    return (2 + 2 * dkdv_stages(hopper)) * tile + (dkdv_stats_in_smem(hopper) ? stats : 0) + smem_slack;
  }
  static_assert(forward_bytes(false, false) <= max_block_smem && forward_bytes(false, true) <= max_block_smem &&
                    backward_bytes(false) <= max_block_smem && dkdv_bytes(false) <= max_block_smem,
                "tiles do not fit");
#if VSA_PLATFORM_NVIDIA
  static_assert(forward_bytes(true, true) <= max_block_smem && backward_bytes(true) <= max_block_smem &&
                    dkdv_bytes(true) <= max_block_smem,
                "tiles do not fit");
#endif
};

} // namespace gpu
} // namespace vsa
