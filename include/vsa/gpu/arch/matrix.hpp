// The warp-level matrix layer the attention kernels are written against. One backend per machine:
//
//   warp_mma<E, D>::threads            lanes per warp/wavefront; one warp owns 16 rows of a 64-row tile
//   score_tile / out_tile              16 × 64 and 16 × D fp32 accumulators, elements e with
//                                      elem_row(e), elem_col(e), elem_slot(e) (which of the lane's rows)
//   row_max / row_sum                  reductions over the lanes that share a row
//   row_frag, load_rows                the band's 16 rows of a shared tile, held as matrix operands
//   rows_in_registers                  whether a loop-invariant row_frag may be kept (else nt from shared)
//   nt(s, a, b), nt(s, ta, row0, b)    s += a · bᵀ  (a: the band's rows, in registers or rows row0.. of
//                                      shared tile ta; b: a 64-row shared tile)
//   nn(o, p, b)                        o += p · b   (p: a score tile, b: a 64-row shared tile)
//   tn(o, a, panel, b)                 wgmma backend only: o += aᵀ · b over the 64 rows of two shared tiles,
//                                      aᵀ the 64 columns of one panel of a, read transposed
//
// plus the global-to-shared tile copy. The algorithm never sees a lane layout. The attention kernels take
// attention_mma<E, D>: on Hopper (device code compiled for sm_90a) that is the warpgroup backend of
// hopper_wgmma.hpp, whose nt and nn read shared tiles through wgmma descriptors; elsewhere warp_mma.
#pragma once

#include "smem_tile.hpp"
#if VSA_PLATFORM_AMD
#include "amd_mfma.hpp"
#else
#include "nvidia_mma.hpp"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define VSA_WGMMA 1
#include "hopper_wgmma.hpp"
#endif
#endif

namespace vsa {
namespace gpu {

#if VSA_WGMMA
template <class E, int D> using attention_mma = warpgroup_mma<E, D>;
#else
template <class E, int D> using attention_mma = warp_mma<E, D>;
#endif

// Copies the 64 rows of a [rows, D] tile from global memory (row r at src + r·row_stride) into a shared
// tile, 16 bytes a thread at a time; rows at or past `valid` are zero-filled so that padding slots hold no
// NaN or Inf that a zero probability could turn into NaN. On NVIDIA the copy is asynchronous (cp.async):
// call copy_commit() after issuing a stage and copy_wait<N>() before reading it.
template <int D> __device__ __forceinline__ void copy_tile(smem_tile<D> dst, const uint16_t* src, int64_t row_stride,
                                                           int valid, int tid, int nthreads) {
  constexpr int chunks = smem_tile<D>::chunks;
  for (int i = tid; i < tile_rows * chunks; i += nthreads) {
    const int r = i / chunks, c = i % chunks;
    uint16_t* d = dst.chunk(r, c);
    const bool ok = r < valid;
#if VSA_PLATFORM_NVIDIA
    const uint16_t* s = ok ? src + r * row_stride + c * 8 : src;
    const uint32_t daddr = static_cast<uint32_t>(__cvta_generic_to_shared(d));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(daddr), "l"(s), "r"(ok ? 16 : 0));
#else
    uint4 v = make_uint4(0, 0, 0, 0);
    if (ok) v = *reinterpret_cast<const uint4*>(src + r * row_stride + c * 8);
    *reinterpret_cast<uint4*>(d) = v;
#endif
  }
}

__device__ __forceinline__ void copy_commit() {
#if VSA_PLATFORM_NVIDIA
  asm volatile("cp.async.commit_group;");
#endif
}
// On Hopper the tiles are then read by wgmma, which goes through the async proxy: the proxy fence makes
// this thread's completed copies visible to it (the barrier that follows does so for the other threads').
template <int N> __device__ __forceinline__ void copy_wait() {
#if VSA_PLATFORM_NVIDIA
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
#if VSA_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// A shared tile written with ordinary stores and then read by wgmma through a descriptor: the stores go
// through the generic proxy, the instruction's reads through the async proxy, so each writing thread fences
// its own stores before the barrier that orders them for the others. The other backends read with ordinary
// loads, which the barrier alone orders.
__device__ __forceinline__ void stores_to_matrix_fence() {
#if VSA_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

} // namespace gpu
} // namespace vsa
