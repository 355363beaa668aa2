// Flash-attention backward over a schedule of key tiles, without atomics: one kernel walks each query
// tile's key tiles and accumulates dq; another walks each key tile's query tiles (every query head of its
// group) and accumulates dk and dv. Each output element is summed by one thread in a fixed order, so the
// result is bitwise the same on every run. Both recompute P from the saved log-sum-exp.
//
// A third, small kernel forms delta_i = Σ_d dO_id · o_id, the row term of dS = P ∘ (dP − delta).
//
// On Hopper the sparse pass at head dim 128 runs dk/dv as the warp-specialized kernel of hopper/dkdv.hpp
// (attention_launch.hpp chooses); the dk/dv kernel here serves every other case.
#pragma once

#include "../arch/matrix.hpp"
#include "attention_schedule.hpp"
#include "hopper/feeds.hpp"

#include <type_traits>

namespace vsa {
namespace gpu {
namespace detail {

struct backward_params {
  operand q, k, v, d_o;
  operand dq, dk, dv; // written in the element type, unless the f32 outputs are set
  float* dq_f32;      // optional contiguous [B, Hq, rows, D] fp32 outputs (the coarse pass)
  float* dk_f32;      // [B, Hkv, rows, D]
  float* dv_f32;
  const float* lse;   // [B·Hq, rows_total]
  const float* delta; // [B·Hq, rows_total]
  // The dense pass (coarse attention): its scaled scores, read instead of formed (load_scores); scale_log2 is
  // then log2(e), and scale still scales dq and dk.
  const float* scores; // [B·Hq, rows_total, rows_total]
  const float* fold_q; // optional [B, Hq, N, D] fp32, added as fold_q[tile] / valid(tile) to every valid row
  const float* fold_k; // [B, Hkv, N, D]
  const float* fold_v;
  // Optional launch order of the dk/dv blocks: entry item0 + x is the (b·Hkv + hk)·N + j that block x computes.
  const int32_t* order;
  int64_t item0;
  // dq from stored dS (attention_dq_stored.hpp), the sparse pass only: dk/dv stores the dS of each pair of
  // the query heads ds_head0 … (b·Hq + h flattened) in the slot of its k2q position, 64 · 64 elements a slot
  // at ds + the schedule's ds_slot · 4096 (the video's: position − ds_head0 · N · capacity); ds_map holds, for each q2k
  // entry, its pair's k2q position within its head (−1: none). ds_units: kv heads (b·Hkv + hk flattened) whose slots
  // the workspace holds at once, 0 where dq recomputes dS instead.
  uint16_t* ds;
  int32_t* ds_map;
  int64_t ds_head0, ds_units;
  int64_t q_heads, kv_heads, group;
  float scale;
  float scale_log2;
  // Hopper's sparse pass: the tiles each step loads (K and V for dq, Q and dO for dk/dv) through the copy
  // engine when the host could encode their maps (tma = 1; hopper/feeds.hpp); otherwise copy_tile.
  int tma;
  bool raster_out; // dq, dk and dv in raster order (the whole op's output_order); in the padding before the maps
  tma_map k_map, v_map, q_map, do_map;
};

// Writes a 16 × D band of an fp32 accumulator: scaled, plus the coarse gradient spread over the tile's
// valid rows, zero in padding rows where the tile's padding rows are rows of the output (padding: the schedule's
// padding_stored of the tile).
template <class E, int D, class M, class Sched, class Rows>
__device__ __forceinline__ void store_band(const typename M::out_tile& acc, float scale, int row0, int valid,
                                           const Rows& out, float* out_f32, const float* fold, int64_t fold_row,
                                           bool padding = Sched::has_padding_rows) {
  const float fold_scale = valid > 0 ? 1.f / valid : 0.f;
  // The coarse gradient's row, all of it read before the first store: read in the loop, each load would wait
  // for the store before it (nothing tells the compiler that the pointers differ), one dependent load a pair
  // of elements in the epilogue of every tile. Rows of the band share their columns, so the loads of the same
  // column pair are one.
  float2 folded[M::out_elems / 2];
#pragma unroll
  for (int e = 0; e < M::out_elems; e += 2)
    folded[e / 2] = fold != nullptr ? *reinterpret_cast<const float2*>(fold + fold_row * D + M::elem_col(e))
                                    : make_float2(0.f, 0.f);
#pragma unroll
  for (int e = 0; e < M::out_elems; e += 2) {
    const int row = row0 + M::elem_row(e), col = M::elem_col(e);
    if ((!padding && row >= valid) || out.skips(row, valid)) continue;
    float x0 = 0.f, x1 = 0.f;
    if (row < valid) {
      x0 = acc.x[e] * scale;
      x1 = acc.x[e + 1] * scale;
      // One fused multiply-add, written out: as a sum of two products the compiler fused one or the other, not the
      // same in every instantiation, and the packed op's dq (joint schedule) missed its samples' own (sparse schedule)
      // by a last place in a few elements a tensor (bench/NOTES.md, v33).
      if (fold != nullptr) {
        x0 = fmaf(folded[e / 2].x, fold_scale, x0);
        x1 = fmaf(folded[e / 2].y, fold_scale, x1);
      }
    }
    if (out_f32 != nullptr) {
      out_f32[row * D + col] = x0;
      out_f32[row * D + col + 1] = x1;
    } else {
      *reinterpret_cast<uint32_t*>(out.row(row, M::elem_slot(e)) + col) = E::pack(x0, x1);
    }
  }
}

// Narrow, as for the forward: steps over partial key tiles cover their valid rows only (with_step_width).
// MinBlocks: blocks an SM to cap the registers for, 0 for no cap, where the platform takes it (dq_min_blocks;
// elsewhere the tuning table's dq_blocks). RasterOut: p.raster_out as a template parameter, as in the forward.
template <class E, int D, class Sched, bool Narrow = false, int MinBlocks = 0, bool RasterOut = false>
__global__ void __launch_bounds__((4 * warp_mma<E, D>::threads), dq_min_blocks(MinBlocks, D))
    attention_dq_kernel(const VSA_GRID_CONSTANT backward_params p, Sched s) {
  using M = attention_mma<E, D>;
  constexpr int nthreads = 4 * M::threads;
  constexpr int R = M::rows_per_lane;
  constexpr int stages = smem_plan<D>::backward_stages(hopper_code);

  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = aligned_smem(smem_raw);
  const smem_tile<D> sq{sm}, sdo{sm + 64 * D};
  const auto sk = [&](int buf) { return smem_tile<D>{sm + (2 + 2 * buf) * 64 * D}; };
  const auto sv = [&](int buf) { return smem_tile<D>{sm + (3 + 2 * buf) * 64 * D}; };

  int64_t i, h, b;
  s.query_block(i, h, b);
  const int64_t bh = b * p.q_heads + h, hk = h / p.group;
  const int tid = threadIdx.x, row0 = (tid / M::threads) * 16;
  const int q_valid = s.valid(i);
  const int64_t rows_total = s.rows_total();

  int64_t begin, end;
  s.range(bh, i, begin, end);
  // As in the forward, K and V through the copy engine on a barrier each where the host encoded their maps
  // (hopper/feeds.hpp). dO·Vᵀ goes first, so that the next V is in flight during Q·Kᵀ and dS·K, and the next
  // K during the next dO·Vᵀ.
  using feed_type = kv_feed<D, 2, backward_params, stages == 1>;
  __shared__ __align__(8) typename feed_type::barriers ready;
  feed_type feed(ready, p.tma != 0, tid, p, hk, b);
  auto kc = feed.k_stage0(), vc = feed.v_stage0(); // the waits on K and V, each keeping its barrier's phase
  const auto load_kv = [&](int64_t pos, int buf) {
    const int64_t j = s.at(pos);
    if (feed.on()) {
      if (tid == 0) feed.load(sk(0), sv(0), s.token0(j));
      return;
    }
    const int kv = s.valid(j);
    copy_tile(sk(buf), p.k.at(b, hk, s.token0(j)), p.k.token, kv, tid, nthreads);
    copy_tile(sv(buf), p.v.at(b, hk, s.token0(j)), p.v.token, kv, tid, nthreads);
  };
  constexpr bool products_s = !Sched::few_blocks; // the dense pass reads its scores and needs no Q
  if (products_s) copy_tile(sq, p.q.at(b, h, s.token0(i)), p.q.token, q_valid, tid, nthreads);
  copy_tile(sdo, p.d_o.at(b, h, s.token0(i)), p.d_o.token, q_valid, tid, nthreads);
  if (begin < end) load_kv(begin, 0);
  copy_commit();

  // Row statistics of the lane's rows, in the base-2 domain of the forward.
  float lse2[R], delta[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + M::slot_row(r);
    const bool live = row < q_valid;
    lse2[r] = live ? p.lse[bh * rows_total + s.token0(i) + row] * log2_e : __builtin_huge_valf();
    delta[r] = live ? p.delta[bh * rows_total + s.token0(i) + row] : 0.f;
  }
  typename M::out_tile dq;
#pragma unroll
  for (int e = 0; e < M::out_elems; ++e) dq.x[e] = 0.f;

  copy_wait<0>();
  __syncthreads();

  for (int64_t pos = begin; pos < end; ++pos) {
    const int buf = stages == 2 ? static_cast<int>((pos - begin) & 1) : 0;
    if (stages == 2 && pos + 1 < end) load_kv(pos + 1, buf ^ 1);
    copy_commit();
    const int kv = s.valid(s.at(pos));

    // The step at the key tile's width (with_step_width): the products cover its valid rows rounded up to 16.
    with_step_width<Narrow>(kv, [&](auto width) {
      constexpr int W = decltype(width)::value, n = step_elems<M, W>;
      typename M::score_tile st, dp;
#pragma unroll
      for (int e = 0; e < n; ++e) st.x[e] = 0.f, dp.x[e] = 0.f;
      // dPᵀ and S. Where the backend pairs products (one_group_pairs: Hopper at D = 128) both tiles are waited
      // for first and the two products share one wait, V refilled after both; otherwise V is refilled as soon
      // as dPᵀ has read it, before K is waited for (at D = 64 the pair's order measured 3% slower,
      // bench/NOTES.md v15). The dense pass reads its scores instead of forming S.
      constexpr bool paired = one_group_pairs<M>::value && products_s;
      // Both tiles' padding rows among the W the products read are zeroed on the copy-engine path (kc's and
      // vc's waits): at a padded column the probability is zero, and zero times a NaN from dO·Vᵀ, or dS times a NaN
      // of K, would still be NaN.
      const auto refill_v = [&] {
        if (feed.on()) {
          __syncthreads(); // every warp's dO·Vᵀ has read V
          if (tid == 0 && pos + 1 < end) feed.load_v(sv(0), s.token0(s.at(pos + 1)));
        }
      };
      if (feed.on()) vc.wait(sv(0), kv, tid, nthreads, W);
      if constexpr (paired) {
        if (feed.on()) kc.wait(sk(0), kv, tid, nthreads, W);
        nt_pair<M, W>(dp, sdo, sv(buf), st, sq, sk(buf), row0);
        refill_v();
      } else {
        M::template nt<W>(dp, sdo, row0, sv(buf));
        refill_v();
        if (feed.on()) kc.wait(sk(0), kv, tid, nthreads, W);
        if constexpr (products_s) {
          M::template nt<W>(st, sq, row0, sk(buf));
        } else {
          load_scores<M>(st, s.scores_of(p.scores, bh), s, i, s.at(pos), row0, false);
        }
      }
      // dS; the columns past the key tile's valid count get P = 0 (a tile whose valid rows fill the width, the
      // common case, without a test per element, as in the forward).
      const auto make_ds = [&](auto whole) {
#pragma unroll
        for (int e = 0; e < n; ++e) {
          const int r = M::elem_slot(e);
          const float pr =
              decltype(whole)::value || M::elem_col(e) < kv ? fast_exp2(st.x[e] * p.scale_log2 - lse2[r]) : 0.f;
          st.x[e] = pr * (dp.x[e] - delta[r]);
        }
      };
      if (kv == W)
        make_ds(std::true_type{});
      else
        make_ds(std::false_type{});
      M::template nn<W>(dq, st, sk(buf));
    });

    if (feed.on()) {
      __syncthreads(); // every warp's dS·K has read K
      if (tid == 0 && pos + 1 < end) feed.load_k(sk(0), s.token0(s.at(pos + 1)));
      continue;
    }
    if (stages == 1) {
      __syncthreads();
      if (pos + 1 < end) load_kv(pos + 1, 0);
      copy_commit();
    }
    copy_wait<0>();
    __syncthreads();
  }

  float* f32 = p.dq_f32 != nullptr ? p.dq_f32 + (bh * rows_total + s.token0(i)) * D : nullptr;
  with_out_rows<RasterOut, M>(p.dq, s, b, h, i, row0, q_valid, [&](const auto& rows) {
    store_band<E, D, M, Sched>(dq, p.scale, row0, q_valid, rows, f32, s.video_tile(i) ? p.fold_q : nullptr,
                               bh * s.video_tiles() + i, s.padding_stored(i));
  });
}

// The portable dk/dv (hopper/dkdv.hpp replaces it for Hopper's sparse pass at D = 128). Its steps stay 64 wide:
// narrowing them by the query tile's valid rows gained 1% on wan2.1 and made the
// kernel spill on gfx940 (bench/NOTES.md, v12). Where two stages fit (smem_plan::dkdv_stages) the next pair's
// Q, dO and row statistics are asked for at the start of a step, into the other stage, and waited for at its
// end; each step's four products go as two pairs (nt_pair, nn_pair), one wait each. StoreDs: each pair's dS also
// goes to its slot of p.ds for dq (attention_dq_stored.hpp).
template <class E, int D, class Sched, int MinBlocks = 0, bool StoreDs = false>
__global__ void __launch_bounds__((4 * warp_mma<E, D>::threads), dkdv_min_blocks(MinBlocks, D))
    attention_dkdv_kernel(const VSA_GRID_CONSTANT backward_params p, Sched s) {
  using M = attention_mma<E, D>;
  constexpr int nthreads = 4 * M::threads;
  constexpr int stages = smem_plan<D>::dkdv_stages(hopper_code);
  constexpr bool stats_in_smem = smem_plan<D>::dkdv_stats_in_smem(hopper_code);

  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = aligned_smem(smem_raw);
  const smem_tile<D> sk{sm}, sv{sm + 64 * D};
  const auto sq = [&](int buf) { return smem_tile<D>{sm + (2 + 2 * buf) * 64 * D}; };
  const auto sdo = [&](int buf) { return smem_tile<D>{sm + (3 + 2 * buf) * 64 * D}; };
  float* stats = reinterpret_cast<float*>(sm + (2 + 2 * stages) * 64 * D); // [stage][lse2 | delta][64]

  int64_t j = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  if (p.order != nullptr) {
    const int64_t item = p.order[p.item0 + blockIdx.x];
    j = item % s.tiles;
    hk = (item / s.tiles) % p.kv_heads;
    b = item / s.tiles / p.kv_heads;
  }
  const int tid = threadIdx.x, row0 = (tid / M::threads) * 16;
  const int kv = s.valid(j);
  const int64_t rows_total = s.rows_total();
  // The query tiles' valid counts by multiplication (tile_valid_counter), as in the forward: through s.valid each
  // pair took three 32-bit divisions in software, two or three times. (Not in the recomputing dq: there ptxas then took
  // 240 registers instead of 168 at D = 128 on sm_80, a block an SM fewer.)
  const auto count = s.valid_counter();

  constexpr bool products_s = !Sched::few_blocks; // the dense pass reads its scores and needs no K
  if (products_s) copy_tile(sk, p.k.at(b, hk, s.token0(j)), p.k.token, kv, tid, nthreads);
  copy_tile(sv, p.v.at(b, hk, s.token0(j)), p.v.token, kv, tid, nthreads);

  // The (query head, query tile) pairs of this key tile: the lists of every head of the group, in order.
  const auto locate = [&](int g, int64_t& begin, int64_t& end) {
    s.range(b * p.q_heads + hk * p.group + g, j, begin, end);
  };
  // Q and dO through the copy engine where the host encoded their maps and the tuning table takes it (Hopper at
  // D = 128: smem_plan::dkdv_copy_engine; hopper/feeds.hpp), a barrier a stage; the row statistics keep their
  // plain loads.
  using feed_type = qdo_feed<D, stages, backward_params, smem_plan<D>::dkdv_copy_engine(hopper_code)>;
  __shared__ __align__(8) typename feed_type::barriers q_ready;
  feed_type feed(q_ready, p.tma != 0, tid, p);
  // A pair's row statistics (threads < 64, one row each) are read into registers when its tiles are asked for
  // and stored to its stage only at the barrier before it is used, so that the loads run under the step's
  // products instead of holding the warpgroup's first product back by an L2 round trip.
  struct row_stats {
    float lse2, delta;
  };
  const auto load_q = [&](int g, int64_t pos, int buf, row_stats& r) {
    const int64_t h = hk * p.group + g, i = s.at(pos), bh = b * p.q_heads + h;
    const int qv = count.valid(i);
    if (feed.on()) {
      if (tid == 0) feed.load(buf, sq(buf), sdo(buf), s.token0(i), h, b);
    } else {
      copy_tile(sq(buf), p.q.at(b, h, s.token0(i)), p.q.token, qv, tid, nthreads);
      copy_tile(sdo(buf), p.d_o.at(b, h, s.token0(i)), p.d_o.token, qv, tid, nthreads);
    }
    r = {__builtin_huge_valf(), 0.f};
    if (stats_in_smem && tid < 64 && tid < qv) {
      r.lse2 = p.lse[bh * rows_total + s.token0(i) + tid] * log2_e;
      r.delta = p.delta[bh * rows_total + s.token0(i) + tid];
    }
  };
  const auto put_stats = [&](const row_stats& r, int buf) {
    if (stats_in_smem && tid < 64) {
      stats[buf * 128 + tid] = r.lse2;
      stats[buf * 128 + 64 + tid] = r.delta;
    }
  };
  // Waits for the pair in stage buf; `uses` counts the earlier waits on that stage (its barrier's phase).
  const auto wait_q = [&](int64_t pos, int buf, int64_t uses) {
    if (feed.on()) feed.wait(buf, uses, sq(buf), sdo(buf), count.valid(s.at(pos)), tid, nthreads);
  };

  typename M::out_tile dk, dv;
#pragma unroll
  for (int e = 0; e < M::out_elems; ++e) dk.x[e] = 0.f, dv.x[e] = 0.f;

  int g = 0;
  int64_t pos = 0, end = 0;
  locate(0, pos, end);
  while (pos == end && ++g < p.group) locate(g, pos, end);
  if (g < p.group) {
    row_stats first;
    load_q(g, pos, 0, first);
    put_stats(first, 0);
  }
  copy_commit();
  copy_wait<0>();
  if (g < p.group) wait_q(pos, 0, 0);
  __syncthreads();

  int buf = 0;
  for (int64_t step = 0; g < p.group; ++step) {
    // Find the next pair before computing this one, so that its copy overlaps the arithmetic.
    int ng = g;
    int64_t npos = pos + 1, nend = end;
    while (npos == nend && ++ng < p.group) locate(ng, npos, nend);
    const int nbuf = buf ^ (stages - 1);
    row_stats next{};
    if (stages == 2 && ng < p.group) load_q(ng, npos, nbuf, next);
    copy_commit();

    // Statistics of the current query tile's rows, from shared memory or straight from global memory.
    const int64_t cur_i = s.at(pos), cur_bh = b * p.q_heads + hk * p.group + g,
                  cur_row = cur_bh * rows_total + s.token0(cur_i);
    const int cur_valid = count.valid(cur_i);
    const auto lse2 = [&](int c) {
      if constexpr (stats_in_smem) return stats[buf * 128 + c];
      return c < cur_valid ? p.lse[cur_row + c] * log2_e : __builtin_huge_valf();
    };
    const auto delta = [&](int c) {
      if constexpr (stats_in_smem) return stats[buf * 128 + 64 + c];
      return c < cur_valid ? p.delta[cur_row + c] : 0.f;
    };
    typename M::score_tile st, dp;
    if constexpr (products_s) {
      nt_pair<M>(st, sk, sq(buf), dp, sv, sdo(buf), row0); // Sᵀ and dPᵀ: rows are keys, columns queries
    } else {
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) dp.x[e] = 0.f;
      load_scores<M>(st, s.scores_of(p.scores, cur_bh), s, j, cur_i, row0, true);
      M::nt(dp, sv, row0, sdo(buf));
    }
#pragma unroll
    for (int e = 0; e < M::score_elems; ++e) {
      const int c = M::elem_col(e);
      const float pr = fast_exp2(st.x[e] * p.scale_log2 - lse2(c));
      st.x[e] = pr;
      dp.x[e] = pr * (dp.x[e] - delta(c)); // dSᵀ
    }
    if constexpr (StoreDs) {
      // dSᵀ rounded to E once, its padding keys zeroed (pack_rows says why that is safe for dK), and the same
      // registers both stored for dq and multiplied into dK: one conversion a pair of elements. dK's product goes
      // first, so that dSᵀ's registers are free before dV's: in the other order ptxas kept one value on the stack
      // at D = 128 (sm_80 build, 255 registers), reloaded every step.
      static_assert(stores_score_frags<warp_mma<E, D>>::value, "the backend stores no score fragments");
      typename warp_mma<E, D>::score_frag ds;
      warp_mma<E, D>::pack_rows(ds, dp, row0, kv);
      const int64_t slot = s.ds_slot(pos, cur_bh, p.ds_head0);
      warp_mma<E, D>::store_transposed(p.ds + slot * (tile_rows * tile_rows), ds, row0);
      nn_pair<M>(dk, ds, sq(buf), dv, st, sdo(buf));
    } else {
      nn_pair<M>(dv, st, sdo(buf), dk, dp, sq(buf));
    }

    if (stages == 1) {
      __syncthreads();
      if (ng < p.group) load_q(ng, npos, 0, next);
      copy_commit();
    }
    if (ng < p.group) put_stats(next, nbuf);
    copy_wait<0>();
    // Pair step + 1 sits in stage (step + 1) mod stages, which has been waited on (step + 1) / stages times.
    if (ng < p.group) wait_q(npos, nbuf, (step + 1) / stages);
    __syncthreads();
    g = ng, pos = npos, end = nend, buf = nbuf;
  }

  const int64_t bhk = b * p.kv_heads + hk;
  float* kf = p.dk_f32 != nullptr ? p.dk_f32 + (bhk * rows_total + s.token0(j)) * D : nullptr;
  float* vf = p.dv_f32 != nullptr ? p.dv_f32 + (bhk * rows_total + s.token0(j)) * D : nullptr;
  const bool video = s.video_tile(j); // the extra tokens' tiles have no folds
  with_out_rows<M>(p.dk, p.raster_out, s, b, hk, j, row0, kv, [&](const auto& rows) {
    store_band<E, D, M, Sched>(dk, p.scale, row0, kv, rows, kf, video ? p.fold_k : nullptr, bhk * s.video_tiles() + j,
                               s.padding_stored(j));
  });
  with_out_rows<M>(p.dv, p.raster_out, s, b, hk, j, row0, kv, [&](const auto& rows) {
    store_band<E, D, M, Sched>(dv, 1.f, row0, kv, rows, vf, video ? p.fold_v : nullptr, bhk * s.video_tiles() + j,
                               s.padding_stored(j));
  });
}

// delta[bh, row] = Σ_d dO · (o − g ⊙ o_c[tile]) over a row, fp32 accumulation. o_c and the gate are
// optional: without o_c the second factor is o itself (o_s of the plain sparse backward). With the forward's
// residual bytes, o is first restored to its value before rounding (residual_decode): at large scores the
// row term is a near cancellation (dS = P ∘ (dP − delta) with P close to one-hot), and the rounding of o
// alone, half a last place, is then the largest error of dq and dk (README.md, accuracy).
// Memory-bound: D/8 consecutive lanes share a row, each with one 16-byte load per tensor, and reduce by
// shuffles.
struct delta_params {
  operand o, d_o, gate;     // gate.data may be null (g = 1)
  const uint16_t* o_c;      // optional [B, Hq, N, D]
  const int8_t* o_residual; // optional [B·Hq, rows_total, D] (forward_params::o_residual)
  float* delta;             // [B·Hq, rows_total]
  int64_t q_heads, rows_total, tiles;
  bool o_raster; // o in raster order (the whole op's output_order)
};

template <int D> inline constexpr int delta_lanes = D / 8; // threads a row: 8 columns (16 bytes) each

// A block per (query tile, head, batch): its 64 rows, delta_lanes<D> threads a row, so that one thread has
// the 16-byte loads of several rows in flight at once (a thread a row-chunk had two, and the kernel read
// at ~60% of the copy rate on the H200) and the tile's o_c row is loaded once. Rows past the tile's valid
// count read nothing; where they exist in memory (the padding rows of the sparse pass) delta is 0 there.
template <class E, int D, class Sched> __global__ void __launch_bounds__(256)
    attention_delta_kernel(delta_params p, Sched s) {
  constexpr int lanes = delta_lanes<D>, rows_per_pass = 256 / lanes, passes = 64 / rows_per_pass;
  const int64_t tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z, bh = b * p.q_heads + h;
  const int tid = static_cast<int>(threadIdx.x) % 256, col = (tid % lanes) * 8, sub = tid / lanes;
  const int valid = s.valid(tile);
  const bool coarse = p.o_c != nullptr && s.video_tile(tile), gated = coarse && p.gate.data != nullptr;
  const auto load8 = [&](const operand& t, int r) {
    return *reinterpret_cast<const uint4*>(t.data + b * t.batch + h * t.head + (s.token0(tile) + r) * t.token + col);
  };
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  const uint4 cv = coarse ? *reinterpret_cast<const uint4*>(p.o_c + (bh * p.tiles + tile) * D + col) : zero;
  const bool restore = p.o_residual != nullptr;
  const int8_t* residual = restore ? p.o_residual + (bh * s.rows_total() + s.token0(tile)) * D + col : nullptr;
  // o may be in raster order (the whole op's output_order; its rows found as with_out_rows does); d_o and the
  // gate are tiled.
  const auto row_terms = [&](const auto& o_row) {
    uint4 ov[passes], dv[passes], gv[passes];
    uint2 rv[passes];
#pragma unroll
    for (int k = 0; k < passes; ++k) {
      const int r = sub + k * rows_per_pass;
      const bool live = r < valid;
      ov[k] = live ? *reinterpret_cast<const uint4*>(o_row(r) + col) : zero;
      dv[k] = live ? load8(p.d_o, r) : zero;
      gv[k] = live && gated ? load8(p.gate, r) : zero;
      rv[k] = live && restore ? *reinterpret_cast<const uint2*>(residual + r * D) : make_uint2(0u, 0u);
    }
    // Element c of a loaded vector is taken out of its 32-bit word by a shift, not read through a 16-bit
    // pointer: a pointer into the vectors makes them addressable, and the AMD compiler then keeps them in LDS
    // instead of registers (bench/NOTES-amd.md).
    const auto elem = [](const uint4& v, int c) {
      const uint32_t w = c < 2 ? v.x : c < 4 ? v.y : c < 6 ? v.z : v.w;
      return static_cast<uint16_t>(c % 2 == 0 ? w & 0xffffu : w >> 16);
    };
#pragma unroll
    for (int k = 0; k < passes; ++k) {
      float acc = 0.f;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        float x = E::to_float(elem(ov[k], c));
        if (restore) {
          const uint32_t w = c < 4 ? rv[k].x : rv[k].y;
          x = residual_decode(static_cast<int8_t>((w >> (8 * (c % 4))) & 0xffu), x, E::type);
        }
        if (coarse) x -= (gated ? E::to_float(elem(gv[k], c)) : 1.f) * E::to_float(elem(cv, c));
        acc += E::to_float(elem(dv[k], c)) * x;
      }
#pragma unroll
      for (int m = lanes / 2; m > 0; m /= 2) acc += shfl_xor(acc, m);
      // Rows past the valid ones only where they are rows (the padding slots of a video tile).
      const int64_t row = s.token0(tile) + sub + k * rows_per_pass;
      if (row < s.rows_total() && (s.padding_stored(tile) || sub + k * rows_per_pass < valid) && col == 0)
        p.delta[bh * s.rows_total() + row] = acc;
    }
  };
  const uint16_t* const head = p.o.data + b * p.o.batch + h * p.o.head;
  if constexpr (Sched::has_padding_rows && !Sched::joint) { // the sparse schedule: video tiles
    if (p.o_raster) {
      const raster_rows map = s.geo.raster_rows_of(tile);
      row_terms([&](int r) { return head + map.token(r) * p.o.token; });
      return;
    }
  }
  row_terms([&](int r) { return head + (s.token0(tile) + r) * p.o.token; });
}

// Longest-first launch order of the dk/dv blocks within each (batch, kv head). The selection from data is
// skewed (a key tile whose mean stands out is chosen by most query tiles: on wan2.1 shapes the longest k2q
// list is ~3.4× the mean), and a long list landing in the last wave of blocks dominates the kernel's time.
// Blocks are grouped by ⌊log2(list length)⌋, largest first: within a factor of two of longest-processing-
// time order, with no sort. Heads stay in order, so the blocks running together share one head's q and dO
// in L2 (ordering across heads measured 4–20% slower on balanced lists). Atomics place blocks within a
// group in any order; that changes only which block runs when, never what a block computes, so results
// stay bitwise reproducible.
// The joint pass's extra key tiles (the last `lead` tiles of each head: joint_schedule) walk every query tile of the
// group, about N/k times a video key tile's pairs. Put first within their own head, as the buckets would, the last
// head's started only when the rest of the kernel was nearly done, and ran on alone: the sm_80 build's storing dk/dv
// at wan2.1 with E = 256 took 8.62 ms against 7.33 for its pairs at the video pass's rate (bench/NOTES.md, v28, v29).
// So they go first across every head of a launch (a run of `run` kv heads, the groups the stored-dS backward launches
// one at a time; all of them otherwise), in head order, and each head's video tiles after them in bucket order.
inline constexpr int order_buckets = 32;

struct order_params {
  const int32_t* k2q_offset; // [B·Hq, N + 1]
  int32_t* counts;           // [B·Hkv, 2 · order_buckets], zeroed: histogram, then cursors
  int32_t* order;            // [B·Hkv·N]
  int64_t tiles, q_heads, kv_heads, group, items;
  int64_t lead = 0; // tiles N − lead … N − 1 of each head go before every video tile of the run
  int64_t run = 1;  // kv heads a launch takes (b·Hkv + hk flattened, from 0)
};

__device__ __forceinline__ int order_bucket(const order_params& p, int64_t item) {
  const int64_t j = item % p.tiles, hk = (item / p.tiles) % p.kv_heads, b = item / p.tiles / p.kv_heads;
  int64_t len = 0;
  for (int64_t g = 0; g < p.group; ++g) {
    const int32_t* o = p.k2q_offset + (b * p.q_heads + hk * p.group + g) * (p.tiles + 1) + j;
    len += o[1] - o[0];
  }
  int bucket = 0;
  while (bucket < order_buckets - 1 && (int64_t(2) << bucket) <= len + 1) ++bucket;
  return order_buckets - 1 - bucket; // longest first
}

template <int Threads = 256> __global__ void __launch_bounds__(Threads) order_count_kernel(order_params p) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * Threads + threadIdx.x;
  if (item < p.items && item % p.tiles < p.tiles - p.lead)
    atomicAdd(&p.counts[(item / p.tiles) * 2 * order_buckets + order_bucket(p, item)], 1);
}

template <int Threads = 256> __global__ void __launch_bounds__(Threads) order_place_kernel(order_params p) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * Threads + threadIdx.x;
  if (item >= p.items) return;
  const int64_t head = item / p.tiles, j = item % p.tiles, video = p.tiles - p.lead;
  // The run's first head run0 and its in_run heads (the last run may be short): their extra tiles fill the first
  // in_run · lead entries of the run's span of the order, and head run0 + u's video tiles the N − lead after
  // u · (N − lead) more.
  const int64_t heads = p.items / p.tiles, run0 = head / p.run * p.run;
  const int64_t in_run = heads - run0 < p.run ? heads - run0 : p.run;
  if (j >= video) {
    p.order[run0 * p.tiles + (head - run0) * p.lead + (j - video)] = static_cast<int32_t>(item);
    return;
  }
  int32_t* counts = p.counts + head * 2 * order_buckets;
  const int bucket = order_bucket(p, item);
  int64_t base = run0 * p.tiles + in_run * p.lead + (head - run0) * video;
  for (int k = 0; k < bucket; ++k) base += counts[k];
  p.order[base + atomicAdd(&counts[order_buckets + bucket], 1)] = static_cast<int32_t>(item);
}

} // namespace detail
} // namespace gpu
} // namespace vsa
