// AMD backend of the warp-level matrix layer: v_mfma_f32_16x16x16 (bf16_1k / f16) on CDNA2 and CDNA3,
// one 64-lane wavefront per 16-row band of a 64-row tile.
//
// For 16×16×16 the CDNA ISA gives lane l the A elements (row l mod 16, k 4⌊l/16⌋ … +3), the B elements
// (k 4⌊l/16⌋ … +3, column l mod 16) and the accumulator elements (rows 4⌊l/16⌋ … +3, column l mod 16).
// The accumulator of a product is therefore laid out like the B operand of the next one. This backend
// computes every tile transposed (Sᵀ = K·Qᵀ, Oᵀ = Vᵀ·Pᵀ): the band's own rows (queries) then sit on
// column l mod 16 of every accumulator, P feeds the next product straight from registers, and the row
// statistics of the online softmax are reduced across the four lanes l mod 16 + {0, 16, 32, 48}.
#pragma once

#include "element.hpp"
#include "lane_layout.hpp"
#include "smem_tile.hpp"

namespace vsa {
namespace gpu {

namespace amd_lanes = lane_layout::amd;

template <class E, int D> struct warp_mma {
  static constexpr int threads = 64;
  static constexpr int score_elems = 16; // 16 × 64 fp32 over 64 lanes
  static constexpr int out_elems = D / 4;
  static constexpr int rows_per_lane = 1;
  // The band's rows of a loop-invariant operand (Q in the forward) can be loaded into registers once.
  static constexpr bool rows_in_registers = true;

  typedef short short4_t __attribute__((ext_vector_type(4)));
  typedef _Float16 half4_t __attribute__((ext_vector_type(4)));
  typedef float float4_t __attribute__((ext_vector_type(4)));

  struct score_tile {
    float x[score_elems];
  };
  struct out_tile {
    float x[out_elems];
  };
  // The band's 16 rows as B operands: per 16-wide k step, row l mod 16, elements 4⌊l/16⌋ … +3.
  struct row_frag {
    uint32_t x[D / 16][2];
  };

  __device__ __forceinline__ static int lane() { return threadIdx.x & 63; }
  __device__ __forceinline__ static int elem_slot(int e) { return amd_lanes::elem_slot(e); }
  __device__ __forceinline__ static int slot_row(int s) { return amd_lanes::slot_row(lane(), s); }
  __device__ __forceinline__ static int elem_row(int e) { return amd_lanes::elem_row(lane(), e); }
  // Element e: 16-wide tile e / 4, accumulator register e mod 4.
  __device__ __forceinline__ static int elem_col(int e) { return amd_lanes::elem_col(lane(), e); }

  __device__ __forceinline__ static bool row_leader() { return amd_lanes::row_leader(lane()); }
  __device__ __forceinline__ static float row_max(float v) {
    v = fmaxf(v, shfl_xor(v, amd_lanes::row_xor_mask(0)));
    return fmaxf(v, shfl_xor(v, amd_lanes::row_xor_mask(1)));
  }
  __device__ __forceinline__ static float row_sum(float v) {
    v += shfl_xor(v, amd_lanes::row_xor_mask(0));
    return v + shfl_xor(v, amd_lanes::row_xor_mask(1));
  }

  __device__ __forceinline__ static void mfma(float* c, uint32_t a0, uint32_t a1, uint32_t b0, uint32_t b1) {
    float4_t acc = {c[0], c[1], c[2], c[3]};
    if constexpr (E::is_bf16) {
      const short4_t a = __builtin_bit_cast(short4_t, (uint64_t(a1) << 32) | a0);
      const short4_t b = __builtin_bit_cast(short4_t, (uint64_t(b1) << 32) | b0);
      acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, acc, 0, 0, 0);
    } else {
      const half4_t a = __builtin_bit_cast(half4_t, (uint64_t(a1) << 32) | a0);
      const half4_t b = __builtin_bit_cast(half4_t, (uint64_t(b1) << 32) | b0);
      acc = __builtin_amdgcn_mfma_f32_16x16x16f16(a, b, acc, 0, 0, 0);
    }
    c[0] = acc[0];
    c[1] = acc[1];
    c[2] = acc[2];
    c[3] = acc[3];
  }

  // Fragment addresses: a load reads at a pointer of the lane's, one a tile and k step (smem_layout::row_lane_part),
  // plus a constant of the unrolled counters (row_step_part), which the compiler puts into the ds_read's offset field;
  // in a loop over tiles the pointers stay, or take one add each where the tile's base moves (two copy stages).
  // Through smem_tile::at each load formed its address whole: where the base moved, or registers ran short, one or
  // two instructions a load (bench/NOTES-amd.md, "LDS addresses"). nt takes a pointer a k step, though the layout
  // would let steps ks and ks + 4 share one: on one pointer the compiler paired their reads into one ds_read2, which
  // loads an operand a step early (coarse_scores at D = 128: 104 → 156 VGPRs, 4 → 2 waves a SIMD).
  __device__ __forceinline__ static const uint16_t* lane_at(smem_tile<D> t, int r, int c) {
    return t.base + smem_layout::row_lane_part(D, r, c);
  }
  __device__ __forceinline__ static void load8(uint32_t& lo, uint32_t& hi, const uint16_t* p) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    lo = v.x;
    hi = v.y;
  }
  // nt's operand: four consecutive k elements (k step ks) of row r0 + operand_row of t, r0 a multiple of 8.
  __device__ __forceinline__ static void load_operand(uint32_t& lo, uint32_t& hi, smem_tile<D> t, int r0, int ks) {
    const int l = lane();
    load8(lo, hi,
          lane_at(t, amd_lanes::operand_row(l), 16 * ks + amd_lanes::operand_k(l)) +
              smem_layout::row_step_part(D, r0, 0));
  }

  __device__ __forceinline__ static void load_rows(row_frag& f, smem_tile<D> t, int row0) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) load_operand(f.x[ks][0], f.x[ks][1], t, row0, ks);
  }

  // s += A · Bᵀ: computed as sᵀ += B · Aᵀ, B's rows as the MFMA A operand, the band's rows as its B operand.
  // With W < 64 only the first W rows of b, and so the first W columns of s (its first W/4 elements).
  template <int W = tile_rows>
  __device__ __forceinline__ static void nt_step(score_tile& s, uint32_t f0, uint32_t f1, smem_tile<D> b, int ks) {
#pragma unroll
    for (int t = 0; t < W / 16; ++t) {
      uint32_t a0, a1;
      load_operand(a0, a1, b, t * 16, ks);
      mfma(&s.x[t * 4], a0, a1, f0, f1);
    }
  }
  template <int W = tile_rows>
  __device__ __forceinline__ static void nt(score_tile& s, const row_frag& a, smem_tile<D> b) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) nt_step<W>(s, a.x[ks][0], a.x[ks][1], b, ks);
  }
  template <int W = tile_rows>
  __device__ __forceinline__ static void nt(score_tile& s, smem_tile<D> a, int row0, smem_tile<D> b) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t f0, f1;
      load_operand(f0, f1, a, row0, ks);
      nt_step<W>(s, f0, f1, b, ks);
    }
  }

  // o += P · B: computed as oᵀ += Bᵀ · Pᵀ; Pᵀ is the score tile as it lies in registers. With W < 64 over the
  // first W columns of P and rows of b only. B's rows operand_k + i (i < 4) at column dt·16 + operand_row are read one
  // element each, at the lane's pointer for x = 2(dt mod 4) ^ i (smem_layout::row_lane_part: 8 a tile) plus constants.
  template <int W = tile_rows>
  __device__ __forceinline__ static void nn(out_tile& o, const score_tile& p, smem_tile<D> b) {
    const int l = lane();
    const uint16_t* col[8];
#pragma unroll
    for (int x = 0; x < 8; ++x) col[x] = lane_at(b, amd_lanes::operand_k(l), (8 * x) ^ amd_lanes::operand_row(l));
#pragma unroll
    for (int kk = 0; kk < W / 16; ++kk) {
      const uint32_t p0 = E::pack(p.x[amd_lanes::p_elem(kk, 0)], p.x[amd_lanes::p_elem(kk, 1)]);
      const uint32_t p1 = E::pack(p.x[amd_lanes::p_elem(kk, 2)], p.x[amd_lanes::p_elem(kk, 3)]);
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) {
        const int step = smem_layout::row_step_part(D, kk * 16, 64 * (dt >> 2));
        uint32_t e[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) e[i] = col[(2 * (dt & 3)) ^ i][step + i * D];
        mfma(&o.x[dt * 4], e[0] | (e[1] << 16), e[2] | (e[3] << 16), p0, p1);
      }
    }
  }

  // nn from a tile stored transposed (smem_tile_transposed, written by copy_transposed): B's rows operand_k … +3 at
  // column operand_row are one 8-byte unit, where nn above reads them as four 2-byte elements and packs them (in the
  // forward that was 128 reads and about 200 instructions of packing and addressing a step at D = 128:
  // bench/NOTES-amd.md). The lane's unit in the first 16 columns, plus 16 columns a dt (transposed_step_part).
  static constexpr bool nn_from_transposed = true;
  template <int W = tile_rows>
  __device__ __forceinline__ static void nn_t(out_tile& o, const score_tile& p, smem_tile_transposed<D> b) {
    const int l = lane();
#pragma unroll
    for (int kk = 0; kk < W / 16; ++kk) {
      const uint32_t p0 = E::pack(p.x[amd_lanes::p_elem(kk, 0)], p.x[amd_lanes::p_elem(kk, 1)]);
      const uint32_t p1 = E::pack(p.x[amd_lanes::p_elem(kk, 2)], p.x[amd_lanes::p_elem(kk, 3)]);
      const uint16_t* unit =
          b.unit(amd_lanes::operand_row(l), (kk * 16 + amd_lanes::operand_k(l)) / smem_layout::transposed_unit);
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) {
        uint32_t a0, a1;
        load8(a0, a1, unit + smem_layout::transposed_step_part(dt * 16));
        mfma(&o.x[dt * 4], a0, a1, p0, p1);
      }
    }
  }

  // Copies the 64 rows of a [rows, D] tile from global memory (row r at src + r·row_stride) into a tile stored
  // transposed, rows at or past `valid` as zeros (copy_tile's contract): each thread loads a block of four rows of
  // one 16-byte chunk and stores it as eight 8-byte units, transposed in registers (smem_layout::transposed_word).
  // The four rows come from one byte pointer a fixed stride apart; taken whole, each row's address was five
  // instructions. Each row keeps its test: an arm of its own for whole tiles came out no shorter, the compiler adding
  // flow blocks around both arms (bench/NOTES-amd.md, "LDS addresses").
  __device__ __forceinline__ static void copy_transposed(smem_tile_transposed<D> dst, const uint16_t* src,
                                                         int64_t row_stride, int valid, int tid, int nthreads) {
    constexpr int chunks = D / 8;
    for (int blk = tid; blk < 16 * chunks; blk += nthreads) {
      const int u = smem_layout::transposed_block_unit(blk), c = smem_layout::transposed_block_chunk(blk);
      const int r0 = u * smem_layout::transposed_unit;
      const char* s = reinterpret_cast<const char*>(src + r0 * row_stride + c * 8);
      uint32_t in[4][4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r0 + k < valid) v = *reinterpret_cast<const uint4*>(s + k * row_stride * 2);
        in[k][0] = v.x, in[k][1] = v.y, in[k][2] = v.z, in[k][3] = v.w;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
        *reinterpret_cast<uint2*>(dst.unit(c * 8 + i, u)) =
            make_uint2(smem_layout::transposed_word(in, i, 0), smem_layout::transposed_word(in, i, 1));
    }
  }
};

} // namespace gpu
} // namespace vsa
