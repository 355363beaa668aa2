// Flash-attention forward over a schedule of key tiles: one block per (query tile, head, batch), one warp
// per 16 query rows, key and value tiles double-buffered in shared memory, an online softmax in base 2
// with the scale folded into the exponent.
#pragma once

#include "../arch/matrix.hpp"
#include "attention_schedule.hpp"

#include <cmath>
#include <type_traits>

namespace vsa {
namespace gpu {
namespace detail {

struct forward_params {
  operand q, k, v, o;
  float* lse;    // [B·Hq, rows_total], natural log; +inf where a row attends nothing
  float* scores; // optional [B·Hq, rows_total, rows_total]: scaled scores before the softmax (dense only)
  // Optional combine epilogue of the whole op: o = o_s + g ⊙ o_c[tile], g from `gate` (data null: g = 1).
  const uint16_t* o_c; // [B·Hq·N, D] or null
  operand gate;
  int64_t q_heads;
  int64_t group; // q_heads / kv_heads
  float scale;
  float scale_log2; // scale · log2(e)
  // Hopper's sparse pass: K and V tiles through the copy engine (hopper_tma.hpp) when the host could encode
  // their maps (tma = 1); otherwise, and everywhere else, copy_tile.
  int tma;
  tma_map k_map, v_map;
};

template <class E, int D, class Sched>
__global__ void __launch_bounds__((4 * warp_mma<E, D>::threads), forward_min_blocks)
    attention_forward_kernel(const VSA_GRID_CONSTANT forward_params p, Sched s) {
  using M = attention_mma<E, D>;
  constexpr int nthreads = 4 * M::threads;
  constexpr int R = M::rows_per_lane;
  constexpr float inf = __builtin_huge_valf();
  // The pipeline, and why: smem_plan::forward_stages. The host sizes shared memory by the same rule.
  constexpr int stages = smem_plan<D>::forward_stages(hopper_code, Sched::few_blocks);
  constexpr bool q_shares = smem_plan<D>::forward_q_shares(hopper_code, Sched::few_blocks);
  static_assert(!q_shares || M::rows_in_registers, "Q lends its slot only from registers");

  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = aligned_smem(smem_raw);
  // (K, V) stages, then Q. With two stages Q borrows the second stage's K slot once it is in registers (64
  // KiB instead of 80 for D = 128: the whole 64 KiB LDS of CDNA). Stages are addressed by arithmetic, not
  // arrays of tiles, so that a run-time stage index does not push the tile descriptors to local memory.
  const auto sk = [&](int buf) { return smem_tile<D>{sm + (2 * buf) * 64 * D}; };
  const auto sv = [&](int buf) { return smem_tile<D>{sm + (1 + 2 * buf) * 64 * D}; };
  const smem_tile<D> sq = q_shares ? sk(1) : smem_tile<D>{sm + 2 * stages * 64 * D};

  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = b * p.q_heads + h, hk = h / p.group;
  // The block is nthreads wide, so the modulo changes nothing but what the compiler knows: tid < nthreads,
  // which lets it narrow the index arithmetic derived from tid. With that and the loop over a step count
  // below, the Hopper sparse forward measured 1.08x faster on the H200 (bench/NOTES.md, v5).
  const int tid = static_cast<int>(threadIdx.x) % nthreads, row0 = (tid / M::threads) * 16;
  const int q_valid = s.valid(i);

  int64_t begin, end;
  s.range(bh, i, begin, end);
  const int64_t steps = end - begin;
#if VSA_WGMMA
  // Hopper's sparse pass takes its K and V tiles through the copy engine where the host encoded their maps
  // (hopper_tma.hpp: thread 0 asks, an mbarrier per tile counts the bytes, every thread waits). Each tile's
  // next copy is asked for as soon as the step's product reading it is done: the next K is in flight during
  // the softmax and P·V, the next V during the next Q·Kᵀ.
  __shared__ __align__(8) uint64_t ready[2];
  const bool tma = !Sched::few_blocks && stages == 1 && p.tma != 0;
  tma::kv_copies copies(ready, tma, tid);
#else
  constexpr bool tma = false;
#endif
  const auto load_kv = [&](int64_t pos, int buf) {
    const int64_t j = s.at(pos);
#if VSA_WGMMA
    if (tma) {
      if (tid == 0) copies.load<D>(sk(0), &p.k_map, sv(0), &p.v_map, j * 64, hk, b);
      return;
    }
#endif
    const int kv = s.valid(j);
    copy_tile(sk(buf), p.k.tile(b, hk, j), p.k.token, kv, tid, nthreads);
    copy_tile(sv(buf), p.v.tile(b, hk, j), p.v.token, kv, tid, nthreads);
  };
  copy_tile(sq, p.q.tile(b, h, i), p.q.token, q_valid, tid, nthreads);
  if (begin < end) load_kv(begin, 0);
  copy_commit();

  float m[R], l[R];
#pragma unroll
  for (int r = 0; r < R; ++r) m[r] = -inf, l[r] = 0.f;
  typename M::out_tile o;
#pragma unroll
  for (int e = 0; e < M::out_elems; ++e) o.x[e] = 0.f;

  copy_wait<0>();
  __syncthreads();
  typename M::row_frag qf;
  if constexpr (M::rows_in_registers) M::load_rows(qf, sq, row0);
  if (q_shares) __syncthreads(); // Q's slot is refilled by the first prefetch

  for (int64_t step = 0; step < steps; ++step) {
    const int64_t pos = begin + step;
    const int buf = stages == 2 ? static_cast<int>(step & 1) : 0;
    if (stages == 2 && pos + 1 < end) load_kv(pos + 1, buf ^ 1);
    copy_commit();

    typename M::score_tile st;
#pragma unroll
    for (int e = 0; e < M::score_elems; ++e) st.x[e] = 0.f;
#if VSA_WGMMA
    // K's padding rows need no zeros: the select below masks the scores they make, NaN included.
    if (tma) copies.k.wait();
#endif
    if constexpr (M::rows_in_registers) {
      M::nt(st, qf, sk(buf));
    } else {
      M::nt(st, sq, row0, sk(buf));
    }

    const int64_t j = s.at(pos);
    const int kv = s.valid(j);
#if VSA_WGMMA
    if (tma) {
      __syncthreads(); // every warp's Q·Kᵀ has read K
      if (tid == 0 && pos + 1 < end) copies.k.load<D>(sk(0), &p.k_map, s.at(pos + 1) * 64, hk, b);
    }
#endif
    if constexpr (Sched::few_blocks) { // only the coarse pass writes scores
      if (p.scores != nullptr) {
        // Elements e and e + 1 (e even) are neighbours in one row in every accumulator layout, so they go out
        // as one 8-byte store where the row length keeps it aligned. Offsets inside the block fit 32 bits.
        const int len = static_cast<int>(s.rows_total());
        float* out = p.scores + (bh * len + i * 64) * len + j * 64;
        const bool pairs = len % 2 == 0 && reinterpret_cast<uintptr_t>(p.scores) % 8 == 0;
        if (pairs && q_valid == 64 && kv == 64) {
          // A whole block (every one but the last row and column of blocks): no test per pair. With the
          // tests, their branches were a fifth of the kernel's stall samples (bench/NOTES-selection.md, v9).
#pragma unroll
          for (int e = 0; e < M::score_elems; e += 2) {
            const int r = row0 + M::elem_row(e), c = M::elem_col(e);
            *reinterpret_cast<float2*>(out + r * len + c) = make_float2(st.x[e] * p.scale, st.x[e + 1] * p.scale);
          }
        } else {
#pragma unroll
          for (int e = 0; e < M::score_elems; e += 2) {
            const int r = row0 + M::elem_row(e), c = M::elem_col(e);
            if (r >= q_valid) continue;
            const float x0 = st.x[e] * p.scale, x1 = st.x[e + 1] * p.scale;
            if (pairs && c + 1 < kv) {
              *reinterpret_cast<float2*>(out + r * len + c) = make_float2(x0, x1);
            } else {
              if (c < kv) out[r * len + c] = x0;
              if (c + 1 < kv) out[r * len + c + 1] = x1;
            }
          }
        }
      }
    }

    float mx[R];
#pragma unroll
    for (int r = 0; r < R; ++r) mx[r] = -inf;
    // Scaled scores and their row maxima; the columns past the key tile's valid count masked. Only tiles at
    // the video's edges are partial, so a whole tile takes a path without a test per element.
    const auto scale_and_max = [&](auto whole) {
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) {
        const float x = decltype(whole)::value || M::elem_col(e) < kv ? st.x[e] * p.scale_log2 : -inf;
        st.x[e] = x;
        mx[M::elem_slot(e)] = fmaxf(mx[M::elem_slot(e)], x);
      }
    };
    if (kv == 64)
      scale_and_max(std::true_type{});
    else
      scale_and_max(std::false_type{});
    float base[R], alpha[R], sum[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float mnew = fmaxf(m[r], M::row_max(mx[r]));
      base[r] = mnew == -inf ? 0.f : mnew; // a row with nothing valid yet: keep exp2 away from inf - inf
      alpha[r] = fast_exp2(m[r] - base[r]);
      m[r] = mnew;
      sum[r] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < M::score_elems; ++e) {
      st.x[e] = fast_exp2(st.x[e] - base[M::elem_slot(e)]);
      sum[M::elem_slot(e)] += st.x[e];
    }
    // Each lane keeps a partial row sum; the lanes of a row agree on m, so one reduction at the end suffices.
#pragma unroll
    for (int r = 0; r < R; ++r) l[r] = l[r] * alpha[r] + sum[r];
#pragma unroll
    for (int e = 0; e < M::out_elems; ++e) o.x[e] *= alpha[M::elem_slot(e)];

#if VSA_WGMMA
    // V's padding rows are zeroed: a zero probability times a NaN there would still be NaN.
    if (tma) copies.v.wait<D>(sv(0), kv, tid, nthreads);
#endif
    M::nn(o, st, sv(buf));

    if (tma) {
#if VSA_WGMMA
      __syncthreads(); // every warp's P·V has read V
      if (tid == 0 && pos + 1 < end) copies.v.load<D>(sv(0), &p.v_map, s.at(pos + 1) * 64, hk, b);
#endif
      continue;
    }
    if (stages == 1) {
      __syncthreads(); // every warp is done with the only stage before it is refilled
      if (pos + 1 < end) load_kv(pos + 1, 0);
      copy_commit();
    }
    copy_wait<0>();
    __syncthreads();
  }

  float inv[R];
  const int64_t rows_total = s.rows_total();
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float total = M::row_sum(l[r]);
    const int row = row0 + M::slot_row(r);
    const bool live = row < q_valid && total > 0.f;
    inv[r] = live ? 1.f / total : 0.f;
    if ((Sched::has_padding_rows || row < q_valid) && M::row_leader())
      p.lse[bh * rows_total + i * 64 + row] = live ? (m[r] + log2f(total)) * 0.6931471805599453f : inf;
  }
  uint16_t* out = p.o.tile(b, h, i);
  const uint16_t* oc = p.o_c != nullptr ? p.o_c + (bh * s.tiles + i) * D : nullptr;
  const uint16_t* gate = p.gate.data != nullptr ? p.gate.tile(b, h, i) : nullptr;
#pragma unroll
  for (int e = 0; e < M::out_elems; e += 2) {
    const int row = row0 + M::elem_row(e), col = M::elem_col(e);
    if (!Sched::has_padding_rows && row >= q_valid) continue;
    const float sc = inv[M::elem_slot(e)];
    float x0 = o.x[e] * sc, x1 = o.x[e + 1] * sc;
    if (oc != nullptr && row < q_valid) {
      const float g0 = gate ? E::to_float(gate[row * p.gate.token + col]) : 1.f;
      const float g1 = gate ? E::to_float(gate[row * p.gate.token + col + 1]) : 1.f;
      x0 += g0 * E::to_float(oc[col]);
      x1 += g1 * E::to_float(oc[col + 1]);
    }
    *reinterpret_cast<uint32_t*>(out + row * p.o.token + col) = E::pack(x0, x1);
  }
}

} // namespace detail
} // namespace gpu
} // namespace vsa
