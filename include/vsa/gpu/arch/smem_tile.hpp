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
#include "../tuning.hpp"
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

// The same 64 × D tile stored transposed (smem_layout::transposed_offset; AMD only, where the MFMA backend reads V
// so: nn_from_transposed, matrix.hpp). Same bytes as smem_tile<D>, so a stage's slot holds either.
template <int D> struct smem_tile_transposed {
  uint16_t* base;
  // The 8-byte unit of tile rows 4u … 4u+3 of column col.
  __device__ __forceinline__ uint16_t* unit(int col, int u) const {
    return base + smem_layout::transposed_offset(col, u);
  }
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
// from it (65536 / (threads · blocks)): the tuning table's (tuning.hpp), by pass and head dim. HIP reads the same bound
// as waves an execution unit (a SIMD), which for the attention kernels' blocks of four wave64s is blocks a CU: the cap
// is 512 / blocks VGPR + AGPR a lane.
inline constexpr int forward_min_blocks(bool hopper, bool few_blocks, int d) {
  return tuning::of(hopper).forward(few_blocks).min_blocks(d);
}
// The forward's 16-row bands a warp, 1 or 2 (the table's), and so its warps a block, 4 / bands.
inline constexpr int forward_bands(bool hopper, bool few_blocks, int d) {
  return tuning::of(hopper).forward(few_blocks).bands(d) == 2 ? 2 : 1;
}

// The backward's portable kernels' second launch bound: where the platform reads the bound as blocks (the tuning
// table's min_blocks_bound: NVIDIA's), their MinBlocks template argument (a probe's; 0 by default, no bound:
// tuning/nvidia_mma.hpp says why); elsewhere `table_blocks`, 0 (no bound) unless the table gives the kernel one.
inline constexpr int backward_min_blocks(int asked, int table_blocks = 0) {
  return tuning::of(false).min_blocks_bound ? asked : table_blocks;
}
// The dq and dk/dv kernels', with the table's dq_blocks and dkdv_blocks at head dim d: waves an execution unit to
// HIP, as in the forward.
inline constexpr int dq_min_blocks(int asked, int d) {
  return backward_min_blocks(asked, tuning::of(hopper_code).dq_blocks(d));
}
inline constexpr int dkdv_min_blocks(int asked, int d) {
  return backward_min_blocks(asked, tuning::of(hopper_code).dkdv_blocks(d));
}

// How the attention kernels use that budget for head dim D, by the tuning table of the code (`hopper`: Hopper
// code; tuning.hpp), which says why each family takes what it takes: the copy stages (with two, the next tile
// streams in while the current one is used; the table asks for two where they fit, and gets one where they do
// not), the dk/dv kernel's per-row statistics in shared memory where they fit, read from global memory otherwise.
template <int D> struct smem_plan {
  static constexpr int tile = smem_tile<D>::bytes;
  static constexpr int stats = 2 * 2 * 64 * 4; // per stage: log-sum-exp and delta of 64 rows
  // Forward: copy stages and bytes, `hopper` for Hopper code, `few_blocks` for a grid smaller than one wave
  // of the GPU (the coarse pass). Two stages: while tile j is used, tile j+1 streams into the other stage.
  // Q, read into registers first, borrows a slot, unless the table keeps it a slot of its own (Hopper's wgmma
  // reads Q from shared memory in every product): with two stages the second stage's K slot, which the first
  // prefetch fills; with one V's slot, which the first V fills once Q is in registers (K + V: 32 KiB at D = 128,
  // two blocks in CDNA's 64 KiB). forward_overlap: the products of one step overlap the softmax of the next
  // (hopper/forward_overlap.hpp).
  static constexpr bool forward_overlap(bool hopper, bool few_blocks) {
    return tuning::of(hopper).forward(few_blocks).overlap(D);
  }
  static constexpr int forward_stages(bool hopper, bool few_blocks) {
    return tuning::of(hopper).forward(few_blocks).stages(D) == 2 && 2 * 2 * tile <= max_block_smem ? 2 : 1;
  }
  static constexpr bool forward_q_shares(bool hopper, [[maybe_unused]] bool few_blocks) {
    return !tuning::of(hopper).forward_q_own_slot;
  }
  // K and V through the copy engine (hopper/feeds.hpp), where the loop has one stage or overlaps.
  static constexpr bool forward_copy_engine(bool hopper, bool few_blocks) {
    return tuning::of(hopper).forward(few_blocks).copy_engine;
  }
  // P's row sums formed on the matrix cores (row_sums_by_product, matrix.hpp): on Hopper code from a block of ones
  // after Q, which the wgmma backend reads; the mma.sync backend keeps its ones in registers.
  static constexpr int ones_bytes = 1024; // warpgroup_mma::ones_bytes, which host code cannot name
  static constexpr bool forward_ones(bool hopper, bool few_blocks) {
    return tuning::of(hopper).forward(few_blocks).ones(D);
  }
  static constexpr int forward_bytes(bool hopper, bool few_blocks) {
    return (2 * forward_stages(hopper, few_blocks) + (forward_q_shares(hopper, few_blocks) ? 0 : 1)) * tile +
           (hopper && forward_ones(hopper, few_blocks) ? ones_bytes : 0) + smem_slack;
  }
  // Backward: the dq kernel's (K, V) stages and the portable dk/dv's (Q, dO) stages (the Hopper sparse pass at
  // D = 128 has a kernel and plan of its own: hopper/dkdv.hpp), two where the table asks for two and they fit.
  static constexpr bool backward_two_stages_fit = (2 + 2 * 2) * tile + stats + smem_slack <= max_block_smem;
  static constexpr int backward_stages(bool hopper) {
    return tuning::of(hopper).dq_stages == 2 && backward_two_stages_fit ? 2 : 1;
  }
  static constexpr int dkdv_stages(bool hopper) {
    return tuning::of(hopper).dkdv_stages(D) == 2 && backward_two_stages_fit ? 2 : 1;
  }
  // Q and dO of the portable dk/dv through the copy engine (hopper/feeds.hpp).
  static constexpr bool dkdv_copy_engine(bool hopper) { return tuning::of(hopper).dkdv_copy_engine(D); }
  // The statistics in shared memory where they fit beside the tiles of as many blocks as the table asks for.
  static constexpr bool dkdv_stats_in_smem(bool hopper) {
    const int blocks = tuning::of(hopper).dkdv_blocks(D) > 1 ? tuning::of(hopper).dkdv_blocks(D) : 1;
    return (2 + 2 * dkdv_stages(hopper)) * tile + stats + smem_slack <= max_block_smem / blocks;
  }
  // The dq kernel: Q, dO and its stages of K and V. It reads its rows' statistics from global memory into
  // registers, so it asks for no room for them.
  static constexpr int backward_bytes(bool hopper) { return (2 + 2 * backward_stages(hopper)) * tile + smem_slack; }
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
