// NVIDIA backend of the warp-level matrix layer: mma.sync m16n8k16 (sm_80 and later), fragments loaded
// from shared memory with ldmatrix. One warp of 32 lanes owns a 16-row band of a 64-row tile (or two: the forward's
// bands, nt_bands and nn_sums_bands).
//
// Lane l holds, of a 16×8 accumulator, rows l/4 and l/4 + 8 at columns 2(l mod 4) and 2(l mod 4) + 1 (the
// PTX ISA's fragment layout for m16n8k16). The accumulator of two adjacent n8 tiles is, element for
// element, the A fragment of the next product, which is why P never leaves registers between S = Q·Kᵀ and
// O += P·V.
#pragma once

#include "element.hpp"
#include "lane_layout.hpp"
#include "smem_tile.hpp"

namespace vsa {
namespace gpu {

namespace nv_lanes = lane_layout::nvidia;

template <class E, int D> struct warp_mma {
  static constexpr int threads = 32;
  static constexpr int score_elems = 32;  // 16 × 64 fp32 over 32 lanes
  static constexpr int out_elems = D / 2; // 16 × D fp32 over 32 lanes
  static constexpr int rows_per_lane = 2;
  // The band's rows of a loop-invariant operand (Q in the forward) can be loaded into registers once.
  static constexpr bool rows_in_registers = true;

  struct score_tile {
    float x[score_elems];
  };
  struct out_tile {
    float x[out_elems];
  };
  // A fragments of a 16 × D band, one group of four registers per 16-wide k step.
  struct row_frag {
    uint32_t x[D / 16][4];
  };

  __device__ __forceinline__ static int lane() { return threadIdx.x & 31; }
  // Element e of a score or output tile: n8 tile e / 4, register e mod 4.
  __device__ __forceinline__ static int elem_slot(int e) { return nv_lanes::elem_slot(e); }
  __device__ __forceinline__ static int slot_row(int s) { return nv_lanes::slot_row(lane(), s); }
  __device__ __forceinline__ static int elem_row(int e) { return nv_lanes::elem_row(lane(), e); }
  __device__ __forceinline__ static int elem_col(int e) { return nv_lanes::elem_col(lane(), e); }

  // One lane of the four that share a row, to write per-row results once.
  __device__ __forceinline__ static bool row_leader() { return nv_lanes::row_leader(lane()); }
  // Reductions over the four lanes that share a row.
  __device__ __forceinline__ static float row_max(float v) {
    v = fmaxf(v, shfl_xor(v, nv_lanes::row_xor_mask(0)));
    return fmaxf(v, shfl_xor(v, nv_lanes::row_xor_mask(1)));
  }
  __device__ __forceinline__ static float row_sum(float v) {
    v += shfl_xor(v, nv_lanes::row_xor_mask(0));
    return v + shfl_xor(v, nv_lanes::row_xor_mask(1));
  }

  __device__ __forceinline__ static uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
  }
  __device__ __forceinline__ static void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
  __device__ __forceinline__ static void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
  __device__ __forceinline__ static void mma(float* c, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (E::is_bf16) {
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};"
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};"
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
  }

  // The shared address lane l gives ldmatrix for rows r0 + lr(l) and chunk 2s + lc(l) of tile t (r0 a multiple of
  // 8; lr, lc one of lane_layout's load_row / load_chunk pairs): smem_tile::chunk's place, split into the tile's
  // address plus the lane's part for s mod 4 (frag_base) and a constant of r0 and s / 4 (frag_offset;
  // smem_layout::panel_lane_part). Through chunk() each load's address took the swizzle's shifts, XOR and ORs again
  // in every step. frag_base adds in an asm statement: in plain arithmetic LLVM, knowing that the lane's part has no
  // bits where the constant has, merged the two with ORs and shifted the sum, three instructions a load again; and
  // since NVVM does not merge equal asm statements, each function below takes its bases once and reuses them for
  // every load from the same tile and s mod 4. ptxas folds the constant into the load's offset (with copy_tile's
  // lean addresses, 23-31% fewer instructions in the sm_80 forward; bench/NOTES.md, v25). A row offset r0 known
  // only at run time goes into the base.
  __device__ __forceinline__ static uint32_t frag_base(smem_tile<D> t, int lr, int lc, int q, int r0 = 0) {
    uint32_t at;
    asm("add.u32 %0, %1, %2;"
        : "=r"(at)
        : "r"(smem_addr(t.base) + 2 * r0 * smem_layout::panel_cols), "r"(2 * smem_layout::panel_lane_part(lr, lc, q)));
    return at;
  }
  __device__ __forceinline__ static constexpr uint32_t frag_offset(int r0, int s) {
    return 2 * smem_layout::panel_step_part(r0, s);
  }
  // The bases of nn's B (tile rows = k, loaded with .trans) for the four values of its n step mod 4.
  struct nn_bases {
    uint32_t at[4];
  };
  __device__ __forceinline__ static nn_bases nn_b_bases(smem_tile<D> b) {
    const int l = lane();
    nn_bases n;
#pragma unroll
    for (int q = 0; q < 4; ++q) n.at[q] = frag_base(b, nv_lanes::nn_b_load_row(l), nv_lanes::nn_b_load_chunk(l), q);
    return n;
  }

  // A fragment of rows row0 .. row0+15, k step ks: the four 8×8 matrices (rows 0-7 | 8-15) × (k 0-7 | 8-15).
  __device__ __forceinline__ static void load_a(uint32_t (&a)[4], smem_tile<D> t, int row0, int ks) {
    const int l = lane();
    ldmatrix_x4(a, frag_base(t, nv_lanes::a_load_row(l), nv_lanes::a_load_chunk(l), ks & 3, row0) + frag_offset(0, ks));
  }
  __device__ __forceinline__ static void load_rows(row_frag& f, smem_tile<D> t, int row0) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) load_a(f.x[ks], t, row0, ks);
  }

  // s += A · Bᵀ over the head dim, B the 64 rows of tile b; A from registers or from rows row0.. of tile a.
  // With W < 64 only the first W rows of b, and so the first W columns of s (its first W/2 elements).
  // The A fragments of k step ks of N bands' row_frags.
  template <int N> struct frags { uint32_t x[N][4]; };
  template <int N> __device__ __forceinline__ static frags<N> step_frags(const row_frag* a, int ks) {
    frags<N> f;
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) f.x[n][r] = a[n].x[ks][r];
    return f;
  }
  // k step ks of it for N bands at once (s and a: N consecutive tiles and fragments), each fragment of b loaded once.
  template <int W = tile_rows, int N = 1>
  __device__ __forceinline__ static void nt_step(score_tile* s, const uint32_t (&a)[N][4], smem_tile<D> b, int ks) {
    const int l = lane();
    const uint32_t base = frag_base(b, nv_lanes::nt_b_load_row(l), nv_lanes::nt_b_load_chunk(l), ks & 3);
#pragma unroll
    for (int np = 0; np < W / 16; ++np) { // pairs of n8 tiles: 16 rows of b
      uint32_t r[4];
      ldmatrix_x4(r, base + frag_offset(np * 16, ks));
#pragma unroll
      for (int n = 0; n < N; ++n) {
        mma(&s[n].x[(2 * np) * 4], a[n], r[0], r[1]);
        mma(&s[n].x[(2 * np + 1) * 4], a[n], r[2], r[3]);
      }
    }
  }
  template <int W = tile_rows>
  __device__ __forceinline__ static void nt(score_tile& s, const row_frag& a, smem_tile<D> b) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) nt_step<W>(&s, step_frags<1>(&a, ks).x, b, ks);
  }
  template <int W = tile_rows>
  __device__ __forceinline__ static void nt(score_tile& s, smem_tile<D> a, int row0, smem_tile<D> b) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t f[1][4];
      load_a(f[0], a, row0, ks);
      nt_step<W>(&s, f, b, ks);
    }
  }

  // o += P · B, P the 16 × 64 score tile (rounded to E), B the 64 × D tile b (rows = the k axis); with W < 64
  // over the first W columns of P and rows of b only.
  template <int W = tile_rows>
  __device__ __forceinline__ static void nn(out_tile& o, const score_tile& p, smem_tile<D> b) {
    nn_chain<W, false>(&o, nullptr, &p, b);
  }

  // A 16 × 8 accumulator of row sums (rows lane/4 in x[0], x[1] and lane/4 + 8 in x[2], x[3]): P times a B of
  // ones, so every column is the row's sum, slot r at x[2r], as the wgmma backend's sum_tile.
  struct sum_tile {
    float x[4];
  };
  // The ones are a constant B fragment in registers, so no shared block of them (the wgmma backend's reads one).
  static constexpr int ones_bytes = 0;
  // nn and, in the same loop, l += P · ones: P's row sums from the matrix cores, of P exactly as the product
  // rounds it, one m16n8k16 a 16-wide k step (W/16 a step, against 2·D/16 for the product) instead of rounding P a
  // second time and adding it up in the softmax (bench/NOTES.md v13, v21). `ones` is unused here.
  static constexpr bool row_sums_by_product = true;
  template <int W = tile_rows> __device__ __forceinline__ static void
  nn_sums(out_tile& o, sum_tile& l, const score_tile& p, smem_tile<D> b, const uint16_t* /*ones*/) {
    nn_chain<W, true>(&o, &l, &p, b);
  }

  // ---- several 16-row bands a warp (the forward's bands, detail/attention_forward.hpp) ----
  // nt and nn_sums of N bands against one shared tile, each fragment of b loaded once for all N bands: at D = 64 the
  // 16 KB of K and V a band reads a step take about as many of the SM's shared-memory clocks (128 bytes a clock) as its
  // products take of the tensor pipe's.
  template <int W, int N>
  __device__ __forceinline__ static void nt_bands(score_tile (&s)[N], const row_frag (&a)[N], smem_tile<D> b) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) nt_step<W, N>(s, step_frags<N>(a, ks).x, b, ks);
  }
  template <int W, int N> __device__ __forceinline__ static void
  nn_sums_bands(out_tile (&o)[N], sum_tile (&sums)[N], const score_tile (&p)[N], smem_tile<D> b) {
    nn_chain<W, true, N>(o, sums, p, b);
  }

  // ---- dq from the dS that dk/dv stores (detail/attention_dq_stored.hpp) ----
  // A 16 × 64 band of a score tile as the A operand of nn, one fragment a 16-wide k step (the layout of the stored
  // dS, lane_layout::nvidia::ds_chunk).
  struct score_frag {
    uint32_t x[tile_rows / 16][4];
  };
  static constexpr bool stores_score_frags = true;
  __device__ __forceinline__ static uint32_t transpose8x8(uint32_t x) {
    uint32_t y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
  }
  // dSᵀ in dk/dv rounded to E once for both of its uses: the A fragments of dK's product (nn_frags; the registers
  // nn forms from a score tile, p_elem) and the copy that store_transposed stores for dq. Rows at or past `valid`
  // are zeros: they are the padding keys of a partial tile, whose scores dk/dv does not mask, and dq must read
  // zeros there. The same zeros in dK's product change only dK's rows at or past `valid` (row r of dSᵀ · Q is row
  // r of dK), which are never stored: store_band writes zeros, not the accumulator, in those rows. Each register is
  // converted first and then selected, so that the selects do not branch around the conversions. Tile is the
  // score tile of any backend with this lane layout (the wgmma backend's too).
  template <class Tile>
  __device__ __forceinline__ static void pack_rows(score_frag& a, const Tile& t, int row0, int valid) {
    const int l = lane();
#pragma unroll
    for (int kk = 0; kk < tile_rows / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t x = E::pack(t.x[nv_lanes::p_elem(kk, r, 0)], t.x[nv_lanes::p_elem(kk, r, 1)]);
        a.x[kk][r] = row0 + nv_lanes::a_row(l, r) < valid ? x : 0u;
      }
  }
  // Stores the transpose of a band given as A fragments (pack_rows) as the 64 × 64 tile that dq's product takes as
  // its A operand: this warp holds the band's rows row0 … row0 + 15 (keys, dSᵀ in dk/dv), which are the columns of
  // k step row0 / 16 of every query band. Each register is transposed as it is (ds_frag_reg), so dq reads the
  // values that dK's product multiplied.
  __device__ __forceinline__ static void store_transposed(uint16_t* slot, const score_frag& a, int row0) {
    const int l = lane(), kk = row0 / 16;
#pragma unroll
    for (int band = 0; band < tile_rows / 16; ++band) {
      uint32_t r[4];
#pragma unroll
      for (int reg = 0; reg < 4; ++reg) r[reg] = transpose8x8(a.x[band][nv_lanes::ds_frag_reg(reg)]);
      store16(slot + 8 * nv_lanes::ds_chunk(band, kk, l), r);
    }
  }
  // One 16-byte store to global memory. A uint4 assigned through the slot pointer came out of NVVM (CUDA 13.0) as
  // four 4-byte stores in the dk/dv kernel, though as one in a kernel of the store alone: 16 store instructions a
  // step instead of 4, each a quarter as wide. Streaming (.cs: evict first in L2): the slots, gigabytes written
  // once and read once by dq, then push fewer of the Q and dO tiles that dk/dv reads again out of L2 (DRAM reads
  // 1.98 -> 1.52 GB at wan2.1; the kernel's time did not move with them: bench/NOTES.md, v25).
  __device__ __forceinline__ static void store16(uint16_t* p, const uint32_t (&r)[4]) {
    asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
  }

  // The chunk of a stored tile that lane `lane` of the warp on rows row0 … reads for its A fragment at k step kk.
  __device__ __forceinline__ static int frag_chunk(int row0, int kk) {
    return nv_lanes::ds_chunk(row0 / 16, kk, lane());
  }
  // o += a · b over the first W rows of b, a the band's A fragments (as nn, with P given as fragments).
  template <int W = tile_rows>
  __device__ __forceinline__ static void nn_frags(out_tile& o, const score_frag& a, smem_tile<D> b) {
    const nn_bases bases = nn_b_bases(b);
#pragma unroll
    for (int kk = 0; kk < W / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, bases.at[dp & 3] + frag_offset(kk * 16, dp));
        mma(&o.x[(2 * dp) * 4], a.x[kk], r[0], r[1]);
        mma(&o.x[(2 * dp + 1) * 4], a.x[kk], r[2], r[3]);
      }
    }
  }

private:
  // o[n] += p[n] · b (and sums[n] += p[n] · ones) for N bands (N consecutive tiles each), each fragment of b loaded
  // once for all of them.
  template <int W, bool Sums, int N = 1>
  __device__ __forceinline__ static void nn_chain(out_tile* o, sum_tile* sums, const score_tile* p, smem_tile<D> b) {
    const nn_bases bases = nn_b_bases(b);
    const uint32_t one = E::pack(1.f, 1.f);
#pragma unroll
    for (int kk = 0; kk < W / 16; ++kk) { // 16 rows of b per step
      uint32_t a[N][4];
#pragma unroll
      for (int n = 0; n < N; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          a[n][r] = E::pack(p[n].x[nv_lanes::p_elem(kk, r, 0)], p[n].x[nv_lanes::p_elem(kk, r, 1)]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) { // pairs of n8 tiles along the head dim
        uint32_t r[4];
        ldmatrix_x4_trans(r, bases.at[dp & 3] + frag_offset(kk * 16, dp));
#pragma unroll
        for (int n = 0; n < N; ++n) {
          mma(&o[n].x[(2 * dp) * 4], a[n], r[0], r[1]);
          mma(&o[n].x[(2 * dp + 1) * 4], a[n], r[2], r[3]);
        }
      }
      if constexpr (Sums) {
#pragma unroll
        for (int n = 0; n < N; ++n) mma(sums[n].x, a[n], one, one);
      }
    }
  }
};

} // namespace gpu
} // namespace vsa
