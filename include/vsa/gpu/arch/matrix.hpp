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
//   nt<W>, nn<W>                       the same over the first W = 16 or 32 rows of b only: the first W
//                                      columns of s (its first score_elems·W/64 elements), the first W
//                                      columns of p (a narrow step over a partial tile, attention_schedule.hpp)
//   nn_sums<W>(o, l, p, b, ones)       nn<W> and l += p · ones, P's row sums (row_sums_by_product backends)
//   nt_pair, nn_pair (free functions)  two independent nt or nn whose results are read after both: one
//                                      wait for the pair where the backend can keep both in flight
//   nt_bands, nn_sums_bands            mma.sync backend only: nt and nn_sums of a warp's several bands against
//                                      one shared tile, each fragment of it loaded once (the forward's bands)
//   nt_fresh (free function)           s = a · bᵀ written anew (no zeros first where the backend writes its
//                                      products in place: nt_into)
//   nn_t(o, p, bt), copy_transposed    MFMA backend only (nn_from_transposed): nn from a tile stored
//                                      transposed, and the copy that stores it so; the kernels reach them
//                                      through nn_operand and copy_nn_operand (free functions)
//   pack_rows, store_transposed,       mma.sync backend only (stores_score_frags): a score tile rounded once to
//   nn_frags                           A fragments (score_frag), stored transposed as dq's, and nn from such
//                                      fragments (the wgmma backend has its own nn_frags)
//   tn(o, a, panel, b)                 wgmma backend only: o += aᵀ · b over the 64 rows of two shared tiles,
//                                      aᵀ the 64 columns of one panel of a, read transposed
//   tn_sums(o, sa, sb, a, panel, b, ones)
//                                      wgmma backend only: tn plus, in the same chain, the sums over the 64
//                                      rows of that panel of a and of b (each read transposed times a block
//                                      of ones)
//
// plus the global-to-shared tile copy. The algorithm never sees a lane layout. The attention kernels take
// attention_mma<E, D>: on Hopper (device code compiled for sm_90a) that is the warpgroup backend of
// hopper_wgmma.hpp, whose nt and nn read shared tiles through wgmma descriptors; elsewhere warp_mma.
#pragma once

#include <type_traits>

#include "smem_tile.hpp"
#if VSA_PLATFORM_AMD
#include "amd_mfma.hpp"
#else
#include "nvidia_mma.hpp"
#if VSA_WGMMA
#include "hopper_wgmma.hpp"
#endif
#endif
#include "hopper_tma.hpp"

namespace vsa {
namespace gpu {

#if VSA_WGMMA
template <class E, int D> using attention_mma = warpgroup_mma<E, D>;
#else
template <class E, int D> using attention_mma = warp_mma<E, D>;
#endif

// Two independent products whose results are read only after both: s1 = a1 · b1ᵀ and s2 = a2 · b2ᵀ (nt_pair,
// a1 and a2 the band's rows row0.. of shared tiles; nt_pair<M, W> over the first W rows of b1 and b2 only, as
// nt<W>), o1 += p1 · c1 and o2 += p2 · c2 (nn_pair; p1, p2 as nn_of takes them, except that the wgmma backend's
// nn_pair takes fragments as p1 only). A backend that
// can keep both in flight says so (one_group_pairs) and has members of these names: the wgmma backend issues
// both chains as one group with one wait. The others run them in turn.
template <class M, class = void> struct one_group_pairs : std::false_type {};
template <class M> struct one_group_pairs<M, std::void_t<decltype(M::one_group_pairs)>>
    : std::bool_constant<M::one_group_pairs> {};

template <class M, int W = tile_rows, int D>
__device__ __forceinline__ void nt_pair(typename M::score_tile& s1, smem_tile<D> a1, smem_tile<D> b1,
                                        typename M::score_tile& s2, smem_tile<D> a2, smem_tile<D> b2, int row0) {
  if constexpr (one_group_pairs<M>::value) {
    M::template nt_pair<W>(s1, a1, b1, s2, a2, b2);
  } else {
#pragma unroll
    for (int e = 0; e < M::score_elems; ++e) s1.x[e] = 0.f, s2.x[e] = 0.f;
    M::template nt<W>(s1, a1, row0, b1);
    M::template nt<W>(s2, a2, row0, b2);
  }
}
// o += p · c for nn_pair: p a score tile (nn) or, on a backend with score fragments (stores_score_frags), the A
// fragments of one already rounded to E (score_frag, nn_frags: dSᵀ in dk/dv, whose registers are also stored for
// dq).
template <class M, class P, int D>
__device__ __forceinline__ void nn_of(typename M::out_tile& o, const P& p, smem_tile<D> c) {
  if constexpr (std::is_same_v<P, typename M::score_tile>) {
    M::nn(o, p, c);
  } else {
    M::nn_frags(o, p, c);
  }
}
template <class M, class P1, class P2, int D>
__device__ __forceinline__ void nn_pair(typename M::out_tile& o1, const P1& p1, smem_tile<D> c1,
                                        typename M::out_tile& o2, const P2& p2, smem_tile<D> c2) {
  if constexpr (one_group_pairs<M>::value) {
    M::nn_pair(o1, p1, c1, o2, p2, c2);
  } else {
    nn_of<M>(o1, p1, c1);
    nn_of<M>(o2, p2, c2);
  }
}

// s = a · bᵀ over the first W rows of b (as nt<W>), formed anew rather than added to s; a is the band's rows: af
// where the backend keeps them in registers (rows_in_registers), else rows row0.. of shared tile ta. A backend
// that writes a product in place says so by having nt_into (the wgmma backend, whose first k step does not
// accumulate): s then needs no zeros. The others zero s and add.
template <class M, class = void> struct writes_products : std::false_type {};
template <class M> struct writes_products<M, std::void_t<decltype(&M::template nt_into<tile_rows>)>> : std::true_type {
};

template <class M, int W = tile_rows, int D> __device__ __forceinline__ void
nt_fresh(typename M::score_tile& s, const typename M::row_frag& af, smem_tile<D> ta, int row0, smem_tile<D> b) {
  if constexpr (writes_products<M>::value) {
    M::template nt_into<W>(s, ta, b);
    M::template wait_first<0, W>(s);
  } else {
#pragma unroll
    for (int e = 0; e < (W * M::score_elems) / tile_rows; ++e) s.x[e] = 0.f;
    if constexpr (M::rows_in_registers) {
      M::template nt<W>(s, af, b);
    } else {
      M::template nt<W>(s, ta, row0, b);
    }
  }
}

// Whether the backend forms P's row sums in the P · V chain (row_sums_by_product, with nn_sums: the wgmma
// backend, from a block of ones in shared memory of M::ones_bytes; the mma.sync backend, from ones in registers,
// ones_bytes 0) and the accumulator it forms them in; elsewhere the softmax adds them up and `tile` is a
// placeholder.
template <class M, class = void> struct row_sums_by_product : std::false_type {
  struct tile {
    float x[4];
  };
};
template <class M> struct row_sums_by_product<M, std::void_t<decltype(M::row_sums_by_product)>>
    : std::bool_constant<M::row_sums_by_product> {
  using tile = typename M::sum_tile;
};

// Whether the backend's nn reads its B operand from a tile stored transposed (nn_t, copy_transposed: the MFMA
// backend, whose operands run along k in every lane, which for the B of nn is down a row-major tile's columns).
// The forward stores V so (copy_nn_operand) and multiplies by it so (nn_operand); where a tile feeds both nt and nn
// (K in dq, Q and dO in dk/dv) it stays row-major. The other backends read row-major tiles transposed as they load
// (ldmatrix.trans, wgmma's MN-major descriptors).
template <class M, class = void> struct nn_from_transposed : std::false_type {};
template <class M> struct nn_from_transposed<M, std::void_t<decltype(M::nn_from_transposed)>>
    : std::bool_constant<M::nn_from_transposed> {};

template <class M, int W = tile_rows, int D>
__device__ __forceinline__ void nn_operand(typename M::out_tile& o, const typename M::score_tile& p, smem_tile<D> b) {
  if constexpr (nn_from_transposed<M>::value) {
    M::template nn_t<W>(o, p, smem_tile_transposed<D>{b.base});
  } else {
    M::template nn<W>(o, p, b);
  }
}

// Whether the backend can store a score tile transposed as the A fragments of a later product and run that
// product from them (pack_rows, store_transposed, frag_chunk, nn_frags, score_frag: the mma.sync backend), which dq
// from the dS that dk/dv stores needs (detail/attention_dq_stored.hpp). The MFMA backend has no such members yet.
template <class M, class = void> struct stores_score_frags : std::false_type {};
template <class M> struct stores_score_frags<M, std::void_t<decltype(M::stores_score_frags)>>
    : std::bool_constant<M::stores_score_frags> {};

// Copies the 64 rows of a [rows, D] tile from global memory (row r at src + r·row_stride) into a shared
// tile, 16 bytes a thread at a time; rows at or past `valid` are zero-filled so that padding slots hold no
// NaN or Inf that a zero probability could turn into NaN. On NVIDIA the copy is asynchronous (cp.async):
// call copy_commit() after issuing a stage and copy_wait<N>() before reading it.
#if VSA_PLATFORM_NVIDIA
// One cp.async of 16 bytes to a shared address, of which `bytes` (16 or 0) are read from src and the rest zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
#endif
// One 16-byte chunk of copy_tile; a chunk that is not ok is zero-filled (cp.async reads 0 bytes of `fallback`).
__device__ __forceinline__ void copy_chunk(uint16_t* d, const uint16_t* s, const uint16_t* fallback, bool ok) {
#if VSA_PLATFORM_NVIDIA
  cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(d)), ok ? s : fallback, ok ? 16 : 0);
#else
  (void)fallback; // loads go through registers: a chunk that is not ok is simply not read
  uint4 v = make_uint4(0, 0, 0, 0);
  if (ok) v = *reinterpret_cast<const uint4*>(s);
  *reinterpret_cast<uint4*>(d) = v;
#endif
}
template <int D> __device__ __forceinline__ void copy_tile(smem_tile<D> dst, const uint16_t* src, int64_t row_stride,
                                                           int valid, int tid, int nthreads) {
  constexpr int chunks = smem_tile<D>::chunks;
  if (nthreads % chunks == 0 && (nthreads / chunks) % 8 == 0 && tile_rows % (nthreads / chunks) == 0) {
    // Every block width the kernels use (but the banded forward's 64 threads at D = 128, which takes the general loop,
    // and no table asks for): a thread keeps one chunk column and steps by whole groups of eight
    // rows, which leaves the swizzle (row mod 8) unchanged, so both addresses move by a fixed step. The
    // general loop below recomputes the row, column and swizzle of every chunk: ~20 instructions a chunk
    // against ~6 here, which made the sparse passes 1.16x faster on the H200 (bench/NOTES.md, v6).
    const int c = tid % chunks, r0 = tid / chunks, rows = nthreads / chunks;
#if VSA_PLATFORM_NVIDIA
    // The shared address is taken once: rows is a multiple of 8, so chunk (r0 + k·rows, c) lies k·rows whole rows of
    // its panel past chunk (r0, c), a constant the copy takes as its immediate offset. The source moves in bytes. A
    // whole tile (every key tile of a video without partial tiles, and most of any other) copies without the
    // per-chunk test and select of a partial one. Through copy_chunk each chunk took its addresses again: ~10
    // instructions a chunk (PTX of the sm_80 forward), 16 chunks a thread a step at D = 128 (bench/NOTES.md, v25).
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst.chunk(r0, c)));
    const int d_step = rows * smem_layout::panel_cols * 2;
    const char* s = reinterpret_cast<const char*>(src + r0 * row_stride + c * 8);
    const int64_t s_step = rows * row_stride * 2;
    if (valid >= tile_rows) {
#pragma unroll
      for (int k = 0; k < tile_rows / rows; ++k) cp_async16(d + k * d_step, s + k * s_step, 16);
    } else {
#pragma unroll
      for (int k = 0; k < tile_rows / rows; ++k) {
        const bool ok = r0 + k * rows < valid;
        cp_async16(d + k * d_step, ok ? s + k * s_step : reinterpret_cast<const char*>(src), ok ? 16 : 0);
      }
    }
    return;
#else
    // AMD, where the copy goes through registers: the shared address is one pointer plus constant offsets (the
    // chunks lie rows·D elements apart: row_step_part), the global one a byte pointer stepping by a fixed stride, and a
    // whole tile issues all its loads before the first store, without a test a chunk. Through the general loop each
    // chunk took ~25 instructions (its addresses, the loop's count, the test and the zero fill) and waited for its
    // load before the next one (bench/NOTES-amd.md, "LDS addresses").
    uint16_t* d = dst.chunk(r0, c);
    const char* s = reinterpret_cast<const char*>(src + r0 * row_stride + c * 8);
    const int64_t s_step = rows * row_stride * 2;
    if (valid >= tile_rows) {
      uint4 v[tile_rows / 8];
#pragma unroll
      for (int k = 0; k < tile_rows / rows; ++k) v[k] = *reinterpret_cast<const uint4*>(s + k * s_step);
#pragma unroll
      for (int k = 0; k < tile_rows / rows; ++k)
        *reinterpret_cast<uint4*>(d + smem_layout::row_step_part(D, k * rows, 0)) = v[k];
    } else {
      // copy_chunk's test, written out: through copy_chunk the compiler joined the two arms through flow blocks (the
      // dk/dv kernel at D = 64: 51 instructions more on the path that amd-isa-check counts).
#pragma unroll
      for (int k = 0; k < tile_rows / rows; ++k) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r0 + k * rows < valid) v = *reinterpret_cast<const uint4*>(s + k * s_step);
        *reinterpret_cast<uint4*>(d + smem_layout::row_step_part(D, k * rows, 0)) = v;
      }
    }
    return;
#endif
  }
  for (int i = tid; i < tile_rows * chunks; i += nthreads) {
    const int r = i / chunks, c = i % chunks;
    copy_chunk(dst.chunk(r, c), src + r * row_stride + c * 8, src, r < valid);
  }
}

// copy_tile for a tile that only nn reads (V in the forward): stored transposed where the backend reads it so.
template <class M, int D> __device__ __forceinline__ void
copy_nn_operand(smem_tile<D> dst, const uint16_t* src, int64_t row_stride, int valid, int tid, int nthreads) {
  if constexpr (nn_from_transposed<M>::value) {
    M::copy_transposed(smem_tile_transposed<D>{dst.base}, src, row_stride, valid, tid, nthreads);
  } else {
    copy_tile(dst, src, row_stride, valid, tid, nthreads);
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
