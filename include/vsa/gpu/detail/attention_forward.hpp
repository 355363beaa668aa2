// Flash-attention forward over a schedule of key tiles: one block per (query tile, head, batch), one warp per 16
// query rows (or per two such bands where the tuning table asks: forward_bands), key and value tiles in shared
// memory (double-buffered where the tuning table asks for two stages: smem_plan), an online softmax in base 2 with
// the scale folded into the exponent.
#pragma once

#include "../arch/matrix.hpp"
#include "attention_schedule.hpp"
#include "hopper/feeds.hpp"
#include "hopper/forward_overlap.hpp"

#include <cmath>

namespace vsa {
namespace gpu {
namespace detail {

struct forward_params {
  operand q, k, v, o;
  float* lse; // [B·Hq, rows_total], natural log; +inf where a row attends nothing
  // The dense pass (coarse attention): [B·Hq, rows_total, rows_total] scaled scores, read instead of formed
  // (load_scores); scale_log2 is then log2(e).
  const float* scores;
  // Optional combine epilogue of the whole op: o = o_s + g ⊙ o_c[tile], g from `gate` (data null: g = 1).
  const uint16_t* o_c; // [B·Hq·N, D] or null
  operand gate;
  // Optional [B·Hq, rows_total, D]: what rounding o to 16 bits lost, one byte an element (residual_encode),
  // so that the op's backward takes its row term from o as it was before rounding.
  int8_t* o_residual;
  int64_t q_heads;
  int64_t group; // q_heads / kv_heads
  float scale;
  float scale_log2; // scale · log2(e)
  // Hopper's sparse pass: K and V tiles through the copy engine (hopper/feeds.hpp) when the host could encode
  // their maps (tma = 1); otherwise, and everywhere else, copy_tile.
  int tma;
  bool raster_out; // o in raster order (the whole op's output_order); in the padding before the maps
  tma_map k_map, v_map;
  // Where the grid has narrow steps (has_narrow_tiles): maps of V in 32- and 16-row boxes, so that a narrow step's
  // copy of V moves only the rows it reads (hopper/feeds.hpp, narrow_maps; bench/NOTES.md, v38-v40).
  tma_map v_narrow[2];
};

// The block's threads: 4 / forward_bands warps (the host launches this many).
template <class E, int D> constexpr int forward_threads(bool hopper, bool few_blocks) {
  return 4 / forward_bands(hopper, few_blocks, D) * warp_mma<E, D>::threads;
}

// Narrow: steps over partial key tiles cover their valid rows only (with_step_width); the host sets it where the
// grid has tiles of 32 valid tokens or fewer (has_narrow_tiles, attention_schedule.hpp), so that a grid without
// them runs the loop of one width. RasterOut: p.raster_out as a template parameter (with_out_rows says why).
template <class E, int D, class Sched, bool Narrow = false, bool RasterOut = false>
__global__ void __launch_bounds__((forward_threads<E, D>(hopper_code, Sched::few_blocks)),
                                  forward_min_blocks(hopper_code, Sched::few_blocks, D))
    attention_forward_kernel(const VSA_GRID_CONSTANT forward_params p, Sched s) {
  using M = attention_mma<E, D>;
  // Each warp owns `bands` bands of 16 rows, w, w + warps, …: the chains of its bands (their products, softmax and
  // rescale) are independent, so one warp keeps two in flight where with a band a warp only another warp could fill
  // the wait on the exponentials (the mma.sync backend at D = 64; bench/NOTES.md, v30).
  constexpr int bands = forward_bands(hopper_code, Sched::few_blocks, D);
  constexpr int warps = 4 / bands;
  constexpr int nthreads = warps * M::threads;
  // The wgmma backend derives from warp_mma (threads 32) but reads Q from shared memory: rows_in_registers and
  // hopper_code tell the two apart.
  static_assert(bands == 1 || (!hopper_code && M::threads == 32 && M::rows_in_registers &&
                               !smem_plan<D>::forward_overlap(hopper_code, Sched::few_blocks)),
                "bands: the mma.sync backend's one-step loop");
  constexpr int R = M::rows_per_lane;
  constexpr float inf = __builtin_huge_valf();
  // The pipeline: smem_plan::forward_stages, and why: the tuning table (tuning.hpp). The host sizes shared memory by
  // the same rule.
  constexpr int stages = smem_plan<D>::forward_stages(hopper_code, Sched::few_blocks);
  constexpr bool q_shares = smem_plan<D>::forward_q_shares(hopper_code, Sched::few_blocks);
  static_assert(!q_shares || M::rows_in_registers, "Q lends its slot only from registers");
  // With one stage Q borrows V's slot, so the first V is copied only once Q is in registers.
  constexpr bool q_in_v = q_shares && stages == 1;

  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = aligned_smem(smem_raw);
  // (K, V) stages, then Q. Where Q borrows a slot, it is the second stage's K slot with two stages (64 KiB
  // instead of 80 for D = 128: the whole 64 KiB LDS of CDNA), V's with one (32 KiB: two blocks on CDNA). Stages
  // are addressed by arithmetic, not arrays of tiles, so that a run-time stage index does not push the tile
  // descriptors to local memory.
  const auto sk = [&](int buf) { return smem_tile<D>{sm + (2 * buf) * 64 * D}; };
  const auto sv = [&](int buf) { return smem_tile<D>{sm + (1 + 2 * buf) * 64 * D}; };
  const smem_tile<D> sq = !q_shares ? smem_tile<D>{sm + 2 * stages * 64 * D} : q_in_v ? sv(0) : sk(1);
  // P's row sums: formed in the P·V chain, P times ones, where the backend can and the tuning table asks
  // (smem_plan::forward_ones: Hopper's sparse pass in the one-step loop, from a block of ones after Q; the mma.sync
  // backend's in both loops, from ones in registers), otherwise added up in the softmax. Hopper's not in the
  // narrow loop: there it made ptxas spill more at 128 registers (16 -> 44 bytes) and measured 0.5-1.5% slower,
  // where the loop of one width gained 3% (bench/NOTES.md, v15).
  constexpr auto tune = tuning::of(hopper_code).forward(Sched::few_blocks);
  // Hopper at head dim 64: the products of a step overlap the softmax of the next (smem_plan::forward_overlap).
  constexpr bool overlap = smem_plan<D>::forward_overlap(hopper_code, Sched::few_blocks);
  // Hopper's sparse pass takes its K and V tiles through the copy engine where the host encoded their maps
  // (smem_plan::forward_copy_engine; hopper/feeds.hpp; elsewhere the feed does nothing). Each tile's next copy is
  // asked for as soon as the products reading its stage are done. With one stage the next K is in flight during
  // the softmax and P·V, the next V during the next Q·Kᵀ; the overlapped loop has two.
  constexpr bool engine = smem_plan<D>::forward_copy_engine(hopper_code, Sched::few_blocks) && (stages == 1 || overlap);
  // The overlapped loop takes every step whole; the one-step loop beside it runs only where the copy engine's maps
  // did not encode, and takes them whole too: with narrow steps there, ptxas serialized every wgmma of the kernel,
  // the overlapped loop's included (C7511; bench/NOTES.md, v34).
  constexpr bool narrow = Narrow && !(overlap && engine);
  // The sparse schedule's narrow steps copy only the rows of V they read (hopper/feeds.hpp): V is asked for where its
  // step begins, at the step's height, a constant there. K, asked for a step ahead, stays whole: its height would be
  // the next tile's count in thread 0's path, which cost dq 23% and the wan2.2 forward 3% (bench/NOTES.md, v39-v40).
  // Elsewhere V is asked for as soon as the step before has read its stage: a step later, it cost the wide steps 1-2%
  // (the joint schedule, and grids with no narrow tiles).
  constexpr bool v_narrow = narrow && !Sched::joint;
  using row_sums = row_sums_by_product<M>;
  constexpr bool matrix_sums =
      row_sums::value && (!narrow || tune.ones_narrow) && smem_plan<D>::forward_ones(hopper_code, Sched::few_blocks);
  uint16_t* const ones = sm + (2 * stages + 1) * 64 * D;

  int64_t i, h, b;
  s.query_block(i, h, b);
  const int64_t bh = b * p.q_heads + h, hk = h / p.group;
  // The block is nthreads wide, so the modulo changes nothing but what the compiler knows: tid < nthreads,
  // which lets it narrow the index arithmetic derived from tid. With that and the loop over a step count
  // below, the Hopper sparse forward measured 1.08x faster on the H200 (bench/NOTES.md, v5).
  const int tid = static_cast<int>(threadIdx.x) % nthreads, warp = tid / M::threads;
  const auto band_row = [&](int bd) { return (warp + bd * warps) * 16; };
  const int q_valid = s.valid(i);

  int64_t begin, end;
  s.range(bh, i, begin, end);
  const int64_t steps = end - begin;
  static_assert(!(engine && q_in_v), "the copy engine's first load fills V's slot while Q is in it");
  using feed_type = kv_feed<D, 2 * stages, forward_params, engine>;
  __shared__ __align__(8) typename feed_type::barriers ready; // K, then V, of each stage
  feed_type feed(ready, p.tma != 0, tid, p, hk, b);
  const auto count = s.valid_counter();
  // The dense pass reads its scores: it copies neither Q nor K.
  constexpr bool products_s = !Sched::few_blocks;
  // copy_tile path; j = -1 copies nothing but zeros.
  const auto load_k = [&](int64_t j, int kv, int buf) {
    if (products_s) copy_tile(sk(buf), p.k.at(b, hk, s.token0(j)), p.k.token, kv, tid, nthreads);
  };
  const auto load_v = [&](int64_t j, int kv, int buf) {
    copy_nn_operand<M>(sv(buf), p.v.at(b, hk, s.token0(j)), p.v.token, kv, tid, nthreads);
  };
  const auto load_kv = [&](int64_t j, int buf) {
    const int kv = count.valid(j);
    load_k(j, kv, buf);
    load_v(j, kv, buf);
  };
  // The list entry and valid count of each step are read a step ahead, so that neither the load nor the
  // count (two divisions, done by multiplication: tile_valid_counter) waits behind the step's products.
  int64_t j = steps > 0 ? s.at(begin) : -1, j_next = steps > 1 ? s.at(begin + 1) : -1;
  int kv = count.valid(j);
  if (products_s) copy_tile(sq, p.q.at(b, h, s.token0(i)), p.q.token, q_valid, tid, nthreads);
  if (steps > 0) {
    if (feed.on()) {
      if (tid == 0) {
        if constexpr (v_narrow) { // each V is asked for where its step begins
          feed.load_k(sk(0), s.token0(j));
        } else {
          feed.load(sk(0), sv(0), s.token0(j));
          if (overlap && steps > 1) feed.load(sk(1), sv(1), s.token0(j_next), 1);
        }
      }
    } else if (q_in_v) {
      load_k(j, kv, 0);
    } else {
      load_kv(j, 0);
    }
  }
  copy_commit();
  // Nested, so that a backend without row_sums_by_product (the MFMA one) is never asked for ones_bytes.
  if constexpr (matrix_sums) {
    if constexpr (M::ones_bytes > 0) { // written once; the fence and the barrier below order them
      static_assert(hopper_code && M::ones_bytes == smem_plan<D>::ones_bytes && M::ones_bytes / 16 <= nthreads,
                    "block of ones");
      if (tid < M::ones_bytes / 16) {
        const uint32_t one = E::pack(1.f, 1.f);
        reinterpret_cast<uint4*>(ones)[tid] = make_uint4(one, one, one, one);
      }
      stores_to_matrix_fence();
    }
  }

  // Each band's row maxima and sums, o, and Q's fragments.
  float m[bands][R], l[bands][R];
  typename row_sums::tile lsum[bands]; // the row sums where matrix_sums: slot r at x[2r]
  typename M::out_tile o[bands];
#pragma unroll
  for (int bd = 0; bd < bands; ++bd) {
#pragma unroll
    for (int e = 0; e < 4; ++e) lsum[bd].x[e] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) m[bd][r] = -inf, l[bd][r] = 0.f;
#pragma unroll
    for (int e = 0; e < M::out_elems; ++e) o[bd].x[e] = 0.f;
  }

  copy_wait<0>();
  __syncthreads();
  typename M::row_frag qf[bands];
  if constexpr (M::rows_in_registers && products_s) {
#pragma unroll
    for (int bd = 0; bd < bands; ++bd) M::load_rows(qf[bd], sq, band_row(bd));
  }
  if (q_shares) __syncthreads(); // Q's slot is refilled by the first prefetch, or by the first V
  if constexpr (q_in_v) {
    if (steps > 0) load_v(j, kv, 0);
    copy_commit();
    copy_wait<0>();
    __syncthreads(); // the first V, before any warp's P·V reads it
  }

  // One step's online softmax, in base 2, on the raw scores st of a key tile with kv valid rows: st becomes P
  // (unnormalized), m and l move to the new row maxima, alpha is the factor o must be rescaled by. The scale
  // is folded into the exponent, one fma an element: it is positive (check_scale), so the maximum of the raw
  // scores, scaled, is the maximum of the scaled scores (rounding is monotone), as before. Only a tile with
  // padding slots is masked (kv is the same for the whole block): the select drops whatever the padding rows
  // of K made, NaN included, so K's padding rows need no zeros. Only the first `width` columns of st are
  // scores (a narrow step, with_step_width); the rest are not read. alpha is R floats (a pointer: a reference
  // to an array as a parameter of a generic lambda crashes the device front end of CUDA 13.0).
  // Where the tuning table asks (lazy_rescale), a row's maximum in use moves only when the step's grows past it by
  // more than lazy_margin, and then for every row of the warp: P is then at most 2^lazy_margin before rounding (256:
  // far inside fp16's range, and rounded to E with the same relative error as near 1), o and the row sums carry the
  // same factor, and the log-sum-exp is taken from the maximum in use. Exact in real arithmetic, as the maximum
  // only keeps exp2 in range. Steps where no row of the warp moved leave alpha at 1: the softmax returns false,
  // and o is not rescaled (a warp-uniform branch; FlashAttention-4 skips its rescale the same way).
  constexpr bool lazy = tune.lazy_rescale;
  constexpr float lazy_margin = 8.f;
  // softmax_of and rescale_of act on band bd's state; softmax and rescale on band 0's (the Hopper loop's).
  const auto softmax_of = [&](int bd, auto width, typename M::score_tile& st, int kv_rows, float* alpha) -> bool {
    constexpr int W = decltype(width)::value, n = step_elems<M, W>;
    if (kv_rows < W) {
#pragma unroll
      for (int e = 0; e < n; ++e) st.x[e] = M::elem_col(e) < kv_rows ? st.x[e] : -inf;
    }
    float mx[R];
#pragma unroll
    for (int r = 0; r < R; ++r) mx[r] = -inf;
#pragma unroll
    for (int e = 0; e < n; ++e) mx[M::elem_slot(e)] = fmaxf(mx[M::elem_slot(e)], st.x[e]);
    float nbase[R], sum[R], step_max[R];
    bool grows = false;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      step_max[r] = M::row_max(mx[r]) * p.scale_log2;
      grows |= step_max[r] > m[bd][r] + lazy_margin; // m = -inf: any finite maximum grows
    }
    const bool moves = !lazy || warp_any(grows);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float mnew = moves ? fmaxf(m[bd][r], step_max[r]) : m[bd][r];
      const float base = mnew == -inf ? 0.f : mnew; // a row with nothing valid yet: keep exp2 away from inf - inf
      alpha[r] = moves ? fast_exp2(m[bd][r] - base) : 1.f;
      m[bd][r] = mnew;
      nbase[r] = -base;
      sum[r] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < n; ++e) {
      st.x[e] = fast_exp2(fmaf(st.x[e], p.scale_log2, nbase[M::elem_slot(e)]));
    }
    // The row sums add P as P·V sees it, rounded to E, so that o's weights sum to one. Summed unrounded, they
    // did not: the row maximum's exponent is not 0 but the rounding error of max · scale_log2, up to half its
    // last place (2^-10 where that product nears 2·10^4, as with q and k of scale 64), and its P, just off 1,
    // rounds to 1 for the product. A sharp row's o then missed v by that factor, and the backward's row term,
    // delta = dO · o, missed dO · v by as much, which at such scores is the whole of dS (README.md, accuracy;
    // bench/NOTES.md, v13). Elements e and e + 1 (e even) share a row and form one operand register in every
    // layout, so the rounding is exactly the pack's (ptxas does not merge the two packs: about 1.5 instructions
    // an element more, the v13 notes' forward cost).
    // Where matrix_sums the P·V chain forms them instead, from the product's own rounding of P.
    if constexpr (!matrix_sums) {
#pragma unroll
      for (int e = 0; e < n; e += 2) {
        float lo, hi;
        rounded_pair<E>(st.x[e], st.x[e + 1], lo, hi);
        sum[M::elem_slot(e)] += lo + hi;
      }
      // Each lane keeps a partial row sum; the lanes of a row agree on m, so one reduction at the end suffices.
#pragma unroll
      for (int r = 0; r < R; ++r) l[bd][r] = l[bd][r] * alpha[r] + sum[r];
    }
    return moves;
  };
  const auto rescale_of = [&](int bd, const float* alpha) {
#pragma unroll
    for (int e = 0; e < M::out_elems; ++e) o[bd].x[e] *= alpha[M::elem_slot(e)];
    if constexpr (matrix_sums) {
#pragma unroll
      for (int e = 0; e < 4; ++e) lsum[bd].x[e] *= alpha[M::elem_slot(e)];
    }
  };
  auto softmax = [&](auto width, typename M::score_tile& st, int kv_rows, float* alpha) {
    return softmax_of(0, width, st, kv_rows, alpha);
  };
  auto rescale = [&](const float(&alpha)[R]) { rescale_of(0, alpha); };

  // Hopper at head dim 64 with its tiles through the copy engine: hopper/forward_overlap.hpp.
  if constexpr (overlap && feed_type::copy_engine) {
    if (feed.on() && steps > 0) {
      typename M::score_tile st; // S_n of the loop's steps
      hopper::forward_overlapped<M, D>(feed, s, count, begin, end, j, j_next, kv, sq, sk, sv, o[0], tid, nthreads,
                                       softmax, rescale, st);
    }
  }

  // Every other case: one step at a time (the coarse pass, head dim 128 on Hopper, other machines, and head
  // dim 64 on Hopper where the copy engine's maps did not encode).
  if (!(overlap && feed.on())) {
    auto kc = feed.k_stage0(), vc = feed.v_stage0(); // the waits on K and V, each keeping its barrier's phase
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t pos = begin + step;
      const int buf = stages == 2 ? static_cast<int>(step & 1) : 0;
      const int64_t j2 = pos + 2 < end ? s.at(pos + 2) : -1;
      if (stages == 2 && pos + 1 < end) load_kv(j_next, buf ^ 1);
      copy_commit();

      // The step at the key tile's width (with_step_width): products, softmax and the clear of V's rows.
      // Each stage of the step runs every band before the next stage, so that a warp's bands overlap.
      with_step_width<narrow>(kv, [&](auto width) {
        constexpr int W = decltype(width)::value;
        typename M::score_tile st[bands];
        if constexpr (!products_s) {
#pragma unroll
          for (int bd = 0; bd < bands; ++bd)
            load_scores<M>(st[bd], s.scores_of(p.scores, bh), s, i, j, band_row(bd), false);
        } else {
          // V at the step's height (a constant here), asked for once every warp's last P·V has read its slot.
          if constexpr (v_narrow) {
            if (feed.on() && tid == 0) feed.template load_v_rows<W>(sv(0), s.token0(j));
          }
          if (feed.on()) kc.wait();
          if constexpr (bands > 1) { // each fragment of K loaded once for every band (warp_mma::nt_bands)
#pragma unroll
            for (int bd = 0; bd < bands; ++bd)
#pragma unroll
              for (int e = 0; e < step_elems<M, W>; ++e) st[bd].x[e] = 0.f;
            M::template nt_bands<W>(st, qf, sk(buf));
          } else {
            nt_fresh<M, W>(st[0], qf[0], sq, band_row(0), sk(buf));
          }
          if (feed.on()) {
            __syncthreads(); // every warp's Q·Kᵀ has read K
            if (tid == 0 && pos + 1 < end) feed.load_k(sk(0), s.token0(j_next));
          }
        }

#pragma unroll
        for (int bd = 0; bd < bands; ++bd) {
          float alpha[R];
          if (softmax_of(bd, width, st[bd], kv, alpha)) rescale_of(bd, alpha);
        }

        // V's padding rows among the W the product reads are zeroed where it came through the copy engine: a zero
        // probability times a NaN there would still be NaN.
        if (feed.on()) vc.wait(sv(0), kv, tid, nthreads, W);
        if constexpr (bands > 1) { // each fragment of V loaded once for every band
          static_assert(matrix_sums, "bands: the row sums from the P·V chain");
          M::template nn_sums_bands<W>(o, lsum, st, sv(buf));
        } else if constexpr (matrix_sums) {
          M::template nn_sums<W>(o[0], lsum[0], st[0], sv(buf), ones);
        } else {
          nn_operand<M, W>(o[0], st[0], sv(buf));
        }
      });
      j = j_next;
      j_next = j2;
      kv = count.valid(j);

      if (feed.on()) {
        __syncthreads(); // every warp's P·V has read V
        if (!v_narrow && tid == 0 && pos + 1 < end) feed.load_v(sv(0), s.token0(j));
        continue;
      }
      if (stages == 1) {
        __syncthreads(); // every warp is done with the only stage before it is refilled
        if (pos + 1 < end) load_kv(j, 0);
        copy_commit();
      }
      copy_wait<0>();
      __syncthreads();
    }
  }

  if constexpr (Sched::joint) {
    int64_t piece;
    if (s.piece_of(i, piece)) { // a piece of an extra query tile's walk: its rows go to joint_merge_kernel
      const int64_t at = ((bh * s.extra_tiles() + (i - s.video)) * s.pieces + piece) * tile_rows;
#pragma unroll
      for (int bd = 0; bd < bands; ++bd) {
        const int row0 = band_row(bd);
        float factor[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float total = matrix_sums ? lsum[bd].x[2 * r] : M::row_sum(l[bd][r]);
          const bool live = total > 0.f;
          if (M::row_leader()) s.part_lse[at + row0 + M::slot_row(r)] = live ? (m[bd][r] + log2f(total)) * ln_2 : -inf;
          factor[r] = live ? 1.f / total : 0.f;
        }
#pragma unroll
        for (int e = 0; e < M::out_elems; e += 2) {
          const float sc = factor[M::elem_slot(e)];
          *reinterpret_cast<float2*>(s.part_o + (at + row0 + M::elem_row(e)) * D + M::elem_col(e)) =
              make_float2(o[bd].x[e] * sc, o[bd].x[e + 1] * sc);
        }
      }
      return;
    }
  }

  const int64_t rows_total = s.rows_total();
  // Raster order: o's rows are staged in stage 0's K and V slots (staged_rows), free once every warp's last step
  // has read them.
  static_assert(staged_rows<D>::bytes <= 2 * smem_tile<D>::bytes, "the staging tile fits stage 0");
  static_assert(!RasterOut || (Sched::has_padding_rows && !Sched::joint),
                "only the sparse schedule's tiles are video tiles");
  if constexpr (RasterOut) __syncthreads();
#pragma unroll
  for (int bd = 0; bd < bands; ++bd) {
    const int row0 = band_row(bd);
    float inv[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float total = matrix_sums ? lsum[bd].x[2 * r] : M::row_sum(l[bd][r]);
      const int row = row0 + M::slot_row(r);
      const bool live = row < q_valid && total > 0.f;
      inv[r] = live ? 1.f / total : 0.f;
      if ((s.padding_stored(i) || row < q_valid) && M::row_leader())
        p.lse[bh * rows_total + s.token0(i) + row] = live ? (m[bd][r] + log2f(total)) * ln_2 : inf;
    }
    // The combine epilogue's coarse rows and gate are the video tiles' (joint_schedule: not the extra tokens').
    const bool combined = p.o_c != nullptr && s.video_tile(i);
    const uint16_t* oc = combined ? p.o_c + (bh * s.video_tiles() + i) * D : nullptr;
    const uint16_t* gate = combined && p.gate.data != nullptr ? p.gate.at(b, h, s.token0(i)) : nullptr;
    const auto out_rows = [&](auto&& f) {
      if constexpr (RasterOut) {
        f(staged_rows<D>{sm});
      } else {
        with_out_rows<false, M>(p.o, s, b, h, i, row0, q_valid, f);
      }
    };
    out_rows([&](const auto& out) {
#pragma unroll
      for (int e = 0; e < M::out_elems; e += 2) {
        const int row = row0 + M::elem_row(e), col = M::elem_col(e);
        if ((!s.padding_stored(i) && row >= q_valid) || out.skips(row, q_valid)) continue;
        const float sc = inv[M::elem_slot(e)];
        float x0 = o[bd].x[e] * sc, x1 = o[bd].x[e + 1] * sc;
        if (oc != nullptr && row < q_valid) {
          const float g0 = gate ? E::to_float(gate[row * p.gate.token + col]) : 1.f;
          const float g1 = gate ? E::to_float(gate[row * p.gate.token + col + 1]) : 1.f;
          x0 += g0 * E::to_float(oc[col]);
          x1 += g1 * E::to_float(oc[col + 1]);
        }
        const uint32_t packed = E::pack(x0, x1);
        *reinterpret_cast<uint32_t*>(out.row(row, M::elem_slot(e)) + col) = packed;
        if (p.o_residual != nullptr) {
          const int8_t r0 = residual_encode(x0, E::to_float(static_cast<uint16_t>(packed & 0xffffu)), E::type);
          const int8_t r1 = residual_encode(x1, E::to_float(static_cast<uint16_t>(packed >> 16)), E::type);
          *reinterpret_cast<uint16_t*>(p.o_residual + (bh * rows_total + s.token0(i) + row) * D + col) =
              static_cast<uint16_t>(static_cast<uint8_t>(r0) | (static_cast<uint8_t>(r1) << 8));
        }
      }
    });
  }
  if constexpr (RasterOut) {
    __syncthreads();
    store_staged_rows<D>(p.o, s.geo, b, h, i, q_valid, staged_rows<D>{sm}, tid, nthreads);
  }
}

} // namespace detail
} // namespace gpu
} // namespace vsa
