// Forward, third launch: apply_kernel, o_i = φ(q_i)ᵀKV / (φ(q_i)·z + eps) from the reduced state, one block per
// (slice, batch, q head); with its parameters, its shared-memory shape and the band helpers only it uses.
#pragma once

#include "common.hpp"
#include "features.hpp"
#include "../hopper/linear_copies.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// ---- forward: apply -----------------------------------------------------------------------------------------

struct apply_params {
  operand q, o;
  sequence seq;
  int64_t q_heads, group, slices;
  const uint16_t* kvn; // state_view::kvn
  const float* vec;    // state_view::vec
  float eps;
  // Hopper: Q in and O out through the copy engine where the host could encode both maps (tma = 1,
  // hopper_tma.hpp); otherwise, and everywhere else, copy_tile and store_tile.
  int tma;
  tma_map q_map, o_map;
};

// Shared memory: D / 64 tiles of KVn, the Q tiles, then the per-column factors of the state, by pairs of
// columns (the pair a lane's elements e, e + 1 form): {z, z, σ, σ} as one float4 and {m, m} as one float2.
// Elsewhere the Q tiles are copy_stages stages. On Hopper they are a ring in which Q and O take turns: Q(c)
// lands in a ring tile, each warp overwrites its rows with O(c), and the copy engine stores the tile from
// there; the tile is asked for again once that store has read it. Its blocks an SM and the largest ring are the
// tuning table's (Hopper at D = 128: three blocks, so a ring of two).
template <class E, int D> struct apply_shape {
  static constexpr int threads = 4 * warp_mma<E, D>::threads;
  static constexpr int factors = (D / 2) * (16 + 8);
  static constexpr int blocks(bool hopper) { return tuning::of(hopper).apply_blocks(D); }
  // The largest ring (at most the table's apply_ring tiles, at least two) with which a block fits and blocks(hopper)
  // blocks fit in an SM's shared memory; none where the table has no ring or the block would not fit.
  static constexpr int ring(bool hopper) {
    for (int r = tuning::of(hopper).apply_ring; r >= 2; --r) {
      const int block = (D / 64 + r) * smem_tile<D>::bytes + factors + smem_slack;
      if (block <= max_block_smem && blocks(hopper) * (block + tuning::hopper_block_reserve) <= tuning::hopper_sm_smem)
        return r;
    }
    return 0;
  }
  static constexpr int q_tiles(bool hopper) { return ring(hopper) ? ring(hopper) : copy_stages; }
  static constexpr int tiles(bool hopper) { return (D / 64 + q_tiles(hopper)) * smem_tile<D>::bytes; }
  static constexpr int smem(bool hopper) { return tiles(hopper) + factors + tile_slack(hopper); }
  static_assert(smem(true) <= max_block_smem, "apply tiles do not fit");
  static_assert(threads >= D / 2, "one thread per column pair fills the factors");
};

// store_band for the copy engine's store of a whole tile: rows at and past `valid` are written 0 (padding
// slots of a tiled tensor are written 0; in raster order those rows lie past the sequence, where the store
// does not write).
template <class E, int D> __device__ __forceinline__ void store_band_rows(const typename warp_mma<E, D>::out_tile& o,
                                                                          smem_tile<D> t, int row0, int valid) {
  using M = warp_mma<E, D>;
#pragma unroll
  for (int e = 0; e < M::out_elems; e += 2) {
    const int row = row0 + M::elem_row(e);
    *reinterpret_cast<uint32_t*>(t.at(row, M::elem_col(e))) = row < valid ? E::pack(o.x[e], o.x[e + 1]) : 0u;
  }
}

// One warp's 16 rows of an output tile, from its rows of the Q tile qt: with a = φ(q_i) (for softmax the
// unnormalized exponentials e and the row's scale 1 / Σ e, a = e · scale), den = a·z + eps and w = e σ,
//   P̂ = w / max_d1 w,   β = max_d1 w · scale / den,   o_i = β (P̂ · KVn) + m (a·z) / den,
// which is the module comment's P / β with den (and softmax's normalization) cancelled out of P̂.
// The per-column factors are read from shared memory, a pair of columns a load.
template <class E, int D, feature_map F>
__device__ __forceinline__ void apply_band(typename attention_mma<E, D>::out_tile& o, smem_tile<D> qt, int row0,
                                           uint16_t* kvn, const float4* zsigma, const float2* mean, float eps) {
  using M = attention_mma<E, D>;
  constexpr int R = M::rows_per_lane, T = D / 64;
  typename M::score_tile x[T];
  load_band<E, D, T>(x, qt, row0);
  float scale[R], az[R], wmax[R];
  feature_band_scaled<F, false, E, D, T>(x, scale);
#pragma unroll
  for (int r = 0; r < R; ++r) az[r] = 0.f, wmax[r] = 0.f;
#pragma unroll
  for (int cc = 0; cc < T; ++cc)
#pragma unroll
    for (int e = 0; e < M::score_elems; e += 2) {
      const float4 f = zsigma[(cc * 64 + M::elem_col(e)) / 2];
      const int sl = M::elem_slot(e);
      az[sl] = fmaf(x[cc].x[e], f.x, fmaf(x[cc].x[e + 1], f.y, az[sl]));
      x[cc].x[e] *= f.z;
      x[cc].x[e + 1] *= f.w;
      wmax[sl] = fmaxf(wmax[sl], fmaxf(x[cc].x[e], x[cc].x[e + 1]));
    }
  float beta[R], mix[R], inv_wmax[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    az[r] = M::row_sum(az[r]) * scale[r];
    const float inv_den = 1.f / (az[r] + eps);
    wmax[r] = M::row_max(wmax[r]);
    inv_wmax[r] = wmax[r] > 0.f ? 1.f / wmax[r] : 0.f;
    beta[r] = wmax[r] * scale[r] * inv_den;
    mix[r] = az[r] * inv_den;
  }
#pragma unroll
  for (int cc = 0; cc < T; ++cc)
#pragma unroll
    for (int e = 0; e < M::score_elems; ++e) x[cc].x[e] *= inv_wmax[M::elem_slot(e)];
#pragma unroll
  for (int e = 0; e < M::out_elems; ++e) o.x[e] = 0.f;
#pragma unroll
  for (int cc = 0; cc < T; ++cc) M::nn(o, x[cc], smem_tile<D>{kvn + cc * 64 * D});
#pragma unroll
  for (int e = 0; e < M::out_elems; e += 2) {
    const int s = M::elem_slot(e);
    const float2 m = mean[M::elem_col(e) / 2];
    o.x[e] = fmaf(beta[s], o.x[e], m.x * mix[s]);
    o.x[e + 1] = fmaf(beta[s], o.x[e + 1], m.y * mix[s]);
  }
}

// One block per (slice, batch, q head): KVn (D/64 tiles of 64 rows d1, the k axis of nn) and the column
// factors stay in shared memory for the slice; each warp takes 16 rows of every Q tile (apply_band).
template <class E, int D, feature_map F>
__global__ void VSA_LINEAR_BOUNDS((apply_shape<E, D>::threads), (apply_shape<E, D>::blocks(layer_tn)))
    apply_kernel(const VSA_GRID_CONSTANT apply_params p) {
  using M = attention_mma<E, D>;
  constexpr int nthreads = apply_shape<E, D>::threads;
  constexpr int T = D / 64;
  constexpr int stages = copy_stages;

  // KVn is copied once with cp.async in the tile layout and fenced by copy_wait, so wgmma reads it as nn's B
  // as it stands.
  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = VSA_LINEAR_TILES(smem_raw);
  const auto sq = [&](int buf) { return smem_tile<D>{sm + (T + buf) * 64 * D}; };
  float4* zsigma = reinterpret_cast<float4*>(sm + (T + apply_shape<E, D>::q_tiles(layer_tn)) * 64 * D);
  float2* mean = reinterpret_cast<float2*>(zsigma + D / 2);

  const int64_t slice = blockIdx.x % p.slices, bh = blockIdx.x / p.slices;
  const int64_t b = bh / p.q_heads, h = bh % p.q_heads;
  const int64_t bhk = b * (p.q_heads / p.group) + h / p.group;
  const int tid = threadIdx.x, row0 = (tid / M::threads) * 16;
  int64_t begin, end;
  slice_range(slice, p.slices, p.seq.chunks, begin, end);
  if (begin >= end) return;

  // On Hopper the copy engine (qo_ring_feed, ../hopper/linear_copies.hpp): thread 0 asks for each Q tile (one
  // barrier a ring tile) and stores each O tile from the same ring tile; the block's copy work is then one wait a
  // tile, and O leaves without a pass of 16-byte loads and stores through every thread. Elsewhere the feed does
  // nothing and tma is a constant false.
  constexpr int ring = apply_shape<E, D>::ring(layer_tn);
  using feed_type = qo_ring_feed<D, ring, apply_params>;
  __shared__ __align__(8) typename feed_type::barriers ready;
  const feed_type feed(ready, p.tma != 0, tid, p, h, b);
  const bool tma = feed.on();
  // Padding rows come as they are in memory: each output row depends on its own query row alone (φ, the row
  // factors and the product are row by row), and rows at and past `valid` are written 0.
  const auto load_ring = [&](int64_t c) { feed.load(c, begin, sq); };
  if (tma && tid == 0)
    for (int64_t c = begin; c < end && c < begin + ring; ++c) load_ring(c);
  // Launched with overlap (runtime.hpp: launch): the first Q tiles, an input of the call, are on their way while
  // the state is reduced; the state and every write wait for the reduction.
  grid_dependency_wait();
  const auto load_q = [&](int64_t c, int buf) {
    copy_tile(sq(buf), p.q.tile(b, h, c), p.q.token, p.seq.valid(c), tid, nthreads);
  };

#pragma unroll
  for (int c = 0; c < T; ++c)
    copy_tile(smem_tile<D>{sm + c * 64 * D}, p.kvn + (bhk * D + c * 64) * D, D, 64, tid, nthreads);
  if (!tma) load_q(begin, 0);
  copy_commit();
  if (tid < D / 2) { // ordered before the first use by the first barrier below
    const float* vec = p.vec + bhk * 3 * D + 2 * tid;
    const float2 z = *reinterpret_cast<const float2*>(vec), m = *reinterpret_cast<const float2*>(vec + D),
                 sigma = *reinterpret_cast<const float2*>(vec + 2 * D);
    zsigma[tid] = make_float4(z.x, z.y, sigma.x, sigma.y);
    mean[tid] = m;
  }

  // The ring through the copy engine: on Hopper (layer_tn) only, the one backend with a ring (apply_shape::ring).
  if constexpr (layer_tn) {
    if (tma) {
      copy_wait<0>(); // KVn
      __syncthreads();
      for (int64_t c = begin; c < end; ++c) {
        const int buf = static_cast<int>((c - begin) % ring);
        // The ring tile of the previous tile receives Q(c − 1 + ring) once O(c − 1)'s store has read it.
        if (tid == 0 && c > begin && c - 1 + ring < end) {
          feed.wait_stores_read();
          load_ring(c - 1 + ring);
        }
        // Q(c) on the barrier of its ring tile, in that barrier's phase (c − begin) / ring.
        feed.wait(buf, static_cast<uint32_t>((c - begin) / ring) & 1u);
        const int valid = p.seq.valid(c);
        typename M::out_tile o;
        apply_band<E, D, F>(o, sq(buf), row0, sm, zsigma, mean, p.eps);
        // O over the warp's own rows of Q (read by every lane of the warp: the row sums' shuffles needed all of
        // them), fenced for the copy engine's reads; the fence also orders this thread's reads of Q before the
        // copy engine refills the tile.
        warp_sync();
        if (valid < tile_rows)
          store_band_rows<E, D>(o, sq(buf), row0, valid);
        else
          store_band<E, D>(o, sq(buf), row0);
        stores_to_matrix_fence();
        __syncthreads();
        if (tid == 0) feed.store(sq(buf), c);
      }
      if (tid == 0) feed.wait_stores(); // the block's shared memory must outlast the last stores
      return;
    }
  }
  for (int64_t c = begin; c < end; ++c) {
    const int buf = stages == 2 ? static_cast<int>((c - begin) & 1) : 0;
    copy_wait<0>(); // KVn, and Q
    __syncthreads();
    if (stages == 2 && c + 1 < end) load_q(c + 1, buf ^ 1);
    copy_commit();
    const int valid = p.seq.valid(c);
    typename M::out_tile o;
    apply_band<E, D, F>(o, sq(buf), row0, sm, zsigma, mean, p.eps);
    __syncthreads(); // the band's rows of Q are read; the stage now receives O
    store_band<E, D>(o, sq(buf), row0);
    __syncthreads();
    store_tile<D>(p.o.tile(b, h, c), p.o.token, sq(buf), valid, p.seq.tiled ? 64 : valid, tid, nthreads);
    if (stages == 1 && c + 1 < end) {
      __syncthreads();
      copy_tile(sq(0), p.q.tile(b, h, c + 1), p.q.token, p.seq.valid(c + 1), tid, nthreads);
      copy_commit();
    }
  }
}

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
