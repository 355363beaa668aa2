// Backward, key side: key_grad_kernel (dk, dv) from the reduced gradient, through the copy engine on Hopper and
// the cp.async loop elsewhere; with its parameters, its shared-memory shape and key_db, which both loops share.
#pragma once

#include "common.hpp"
#include "features.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// ---- backward: key side -----------------------------------------------------------------------------------

struct key_grad_params {
  operand k, v, dk, dv;
  sequence seq;
  int64_t kv_heads, slices;
  const float* state_vec; // for m
  const uint16_t* grad_kvn;
  const float* grad_vec;
  // Hopper: K and V in, dk and dv out through the copy engine where the host could encode all four maps
  // (tma = 1, hopper_tma.hpp); otherwise, and everywhere else, copy_tile and store_tile.
  int tma;
  tma_map k_map, v_map, dk_map, dv_map;
};

template <class E, int D> struct key_grad_shape {
  static constexpr int threads = 4 * warp_mma<E, D>::threads;
  static constexpr int tiles = (D / 64 + 2 * copy_stages) * smem_tile<D>::bytes;
  // m, dz̄, σ' copied into shared memory after the tiles where that fits (NVIDIA; AMD's 64 KiB are taken by
  // the tiles at D = 128), as in query_grad.
  static constexpr int factor_bytes = 3 * D * 4;
  static constexpr bool factors_in_smem = tiles + factor_bytes + smem_slack <= max_block_smem;
  static constexpr int smem(bool hopper) { return tiles + (factors_in_smem ? factor_bytes : 0) + tile_slack(hopper); }
  static_assert(smem(true) <= max_block_smem, "key-gradient tiles do not fit");
};

// The key side's db = σ′ · s + dz̄ per column, s = (v − m)·dKVnᵀ over the band's T score tiles; the two loops
// of key_grad (through the copy engine, and the fallback) share it. g may be s itself.
template <class M, int T> __device__ __forceinline__ void
key_db(typename M::score_tile (&g)[T], const typename M::score_tile (&s)[T], const float* sigma, const float* dz) {
#pragma unroll
  for (int cc = 0; cc < T; ++cc)
#pragma unroll
    for (int e = 0; e < M::score_elems; e += 2) {
      const int col = cc * 64 + M::elem_col(e);
      const float2 sc = column_pair(sigma, col), zc = column_pair(dz, col);
      g[cc].x[e] = sc.x * s[cc].x[e] + zc.x;
      g[cc].x[e + 1] = sc.y * s[cc].x[e + 1] + zc.y;
    }
}

// dv_j = Σ_d1 φ(k_j)[d1] dKV[d1, :] = β_j Σ_d1 P̂[j, d1] dKVn[d1, :] (P = φ(k_j) σ', P̂ = P / β_j), and
// dk_j = φ'(k_j)ᵀ db_j with db_j[d1] = σ'[d1] (dKVn (v_j − m))[d1] + dz̄[d1].
// Every output row depends on its own rows of k and v alone, so a warp needs no other warp's rows: on
// Hopper with the copy engine (key_grad_tma below) the tile loop meets at one block barrier a tile.
template <class E, int D, feature_map F>
__global__ void VSA_LINEAR_BOUNDS((key_grad_shape<E, D>::threads), (tuning::of(layer_tn).key_grad_blocks(D)))
    key_grad_kernel(const VSA_GRID_CONSTANT key_grad_params p) {
  using M = attention_mma<E, D>;
  constexpr int nthreads = key_grad_shape<E, D>::threads;
  constexpr int R = M::rows_per_lane, T = D / 64;
  constexpr int stages = copy_stages;

  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = VSA_LINEAR_TILES(smem_raw);
  const auto sg = [&](int c) { return smem_tile<D>{sm + c * 64 * D}; };
  const auto sk = [&](int buf) { return smem_tile<D>{sm + (T + 2 * buf) * 64 * D}; };
  const auto sv = [&](int buf) { return smem_tile<D>{sm + (T + 2 * buf + 1) * 64 * D}; };

  grid_dependency_wait(); // launched with overlap after grad_reduce (runtime.hpp: launch)
  const int64_t slice = blockIdx.x % p.slices, bhk = blockIdx.x / p.slices;
  const int64_t b = bhk / p.kv_heads, hk = bhk % p.kv_heads;
  const int tid = threadIdx.x, row0 = (tid / M::threads) * 16;
  int64_t begin, end;
  slice_range(slice, p.slices, p.seq.chunks, begin, end);
  if (begin >= end) return;
  const float* m = p.state_vec + bhk * 3 * D + D;
  const float *dz = p.grad_vec + bhk * 2 * D, *sigma = dz + D;
  if constexpr (key_grad_shape<E, D>::factors_in_smem) {
    float* copy = reinterpret_cast<float*>(sm + key_grad_shape<E, D>::tiles / 2);
    for (int i = tid; i < D; i += nthreads) { // ordered before their use by the loop's first barrier
      copy[i] = m[i];
      copy[D + i] = dz[i];
      copy[2 * D + i] = sigma[i];
    }
    m = copy, dz = copy + D, sigma = copy + 2 * D;
  }

#if VSA_WGMMA
  if (p.tma != 0) {
    // The copy engine (hopper_tma.hpp), two stages of (K, V), each on one mbarrier. Thread 0 asks for each
    // pair and stores each tile's dv and dk with bulk tensor stores straight from the stage they were written
    // into (dv over K's rows, dk over V's): a warp reads only its own 16 rows of K and V (into registers:
    // φ(k) for P̂ and φ', v − m as the A operand of nt), and writes its results over exactly those rows, so
    // within a tile no warp waits for another until the stage is complete for the store.
    static_assert(stages == 2, "two stages of K and V");
    __shared__ __align__(8) uint64_t ready[stages];
    tma::init_barriers(ready, stages, true, tid);
    const auto load = [&](int64_t c, int buf) {
      tma::tile_pair{&ready[buf], 0u}.load<D>(sk(buf), &p.k_map, sv(buf), &p.v_map, c * 64, hk, b);
    };
    if (tid == 0) {
      load(begin, 0);
      if (begin + 1 < end) load(begin + 1, 1);
    }
#pragma unroll
    for (int c = 0; c < T; ++c) copy_tile(sg(c), p.grad_kvn + (bhk * D + c * 64) * D, D, 64, tid, nthreads);
    copy_commit();
    copy_wait<0>();  // dKVn landed, fenced for wgmma's reads
    __syncthreads(); // dKVn and the factors complete for every thread

    for (int64_t c = begin; c < end; ++c) {
      const int64_t i = c - begin;
      const int buf = static_cast<int>(i & 1);
      const smem_tile<D> kt = sk(buf), vt = sv(buf);
      const int valid = p.seq.valid(c);
      // Tile c is the (i / 2)-th pair on its stage's barrier: the phase of parity (i / 2) mod 2.
      tma::wait(&ready[buf], static_cast<uint32_t>(i >> 1) & 1u);

      // v − m of the warp's rows, rounded to E (the same values the other paths store in shared memory), as
      // nt's A operand in registers; then s = (v − m) · dKVnᵀ runs on the matrix cores while φ(k) is computed.
      typename M::score_tile s[T];
      typename M::band_frag va;
      {
        typename M::score_tile x[T];
        load_band<E, D, T>(x, vt, row0);
#pragma unroll
        for (int cc = 0; cc < T; ++cc)
#pragma unroll
          for (int e = 0; e < M::score_elems; e += 2) {
            const float2 mc = column_pair(m, cc * 64 + M::elem_col(e));
            x[cc].x[e] -= mc.x;
            x[cc].x[e + 1] -= mc.y;
          }
        M::pack(va, x);
      }
#pragma unroll
      for (int cc = 0; cc < T; ++cc) M::nt_async(s[cc], va, sg(cc));
      // The other stage held tile c − 1, whose stores were issued at the end of the last tile: once they have
      // read it, it receives tile c + 1 (tile begin + 1 was asked for before the loop). Done here, not right
      // after the stores, so that thread 0 seldom waits for them; tile c + 1 still has this tile's work to land.
      if (tid == 0 && i > 0 && c + 1 < end) {
        tma::store_wait_read<0>();
        load(c + 1, buf ^ 1);
      }
      __syncwarp(); // warp 0 whole again before its next wgmma

      typename M::score_tile f[T];
      load_band<E, D, T>(f, kt, row0);
      feature_band<F, E, D, T>(f);

      // dk, over the warp's rows of V's stage, once s is in (0 at and past `valid`: padding slots of a tiled
      // tensor are written 0; in raster order those rows lie past the sequence, where the store does not write).
      wgmma::wait<0>();
#pragma unroll
      for (int cc = 0; cc < T; ++cc) wgmma::pin(s[cc].x);
      M::pin(va);
      typename M::score_tile g[T]; // db, then dk
      key_db<M, T>(g, s, sigma, dz);
      feature_backward_band<F, E, D, T>(f, g);
      // All ones for the lane's rows below `valid`: a padding row's results (from whatever the copy engine
      // brought, NaN included) are masked to 0 bit for bit, with no branch per stored word.
      uint32_t keep[R];
#pragma unroll
      for (int r = 0; r < R; ++r) keep[r] = row0 + M::slot_row(r) < valid ? ~0u : 0u;
#pragma unroll
      for (int cc = 0; cc < T; ++cc)
#pragma unroll
        for (int e = 0; e < M::score_elems; e += 2)
          *reinterpret_cast<uint32_t*>(vt.at(row0 + M::elem_row(e), cc * 64 + M::elem_col(e))) =
              E::pack(g[cc].x[e], g[cc].x[e + 1]) & keep[M::elem_slot(e)];

      // φ(k) is no longer needed as such: P = φ(k) σ' in its place, then P̂ = P / β rounded to E (the products
      // in the order of the other paths, so the operand is the same to the bit).
      float beta[R], inv_beta[R];
#pragma unroll
      for (int r = 0; r < R; ++r) beta[r] = 0.f;
#pragma unroll
      for (int cc = 0; cc < T; ++cc)
#pragma unroll
        for (int e = 0; e < M::score_elems; e += 2) {
          const float2 sc = column_pair(sigma, cc * 64 + M::elem_col(e));
          f[cc].x[e] *= sc.x;
          f[cc].x[e + 1] *= sc.y;
          beta[M::elem_slot(e)] = fmaxf(beta[M::elem_slot(e)], fmaxf(f[cc].x[e], f[cc].x[e + 1]));
        }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        beta[r] = M::row_max(beta[r]);
        inv_beta[r] = beta[r] > 0.f ? 1.f / beta[r] : 0.f;
      }
      typename M::prob_frag pf[T]; // nn's A operand
#pragma unroll
      for (int cc = 0; cc < T; ++cc) {
#pragma unroll
        for (int e = 0; e < M::score_elems; ++e) f[cc].x[e] *= inv_beta[M::elem_slot(e)];
        M::pack(pf[cc], f[cc]);
      }

      // dv = β (P̂ · dKVn), over the warp's rows of K's stage.
      typename M::out_tile o;
      M::nn_stack_async(o, pf, sg(0));
      wgmma::wait<0>();
      wgmma::pin(o.x);
#pragma unroll
      for (int cc = 0; cc < T; ++cc) M::pin(pf[cc]);
#pragma unroll
      for (int e = 0; e < M::out_elems; e += 2) {
        const int sl = M::elem_slot(e);
        *reinterpret_cast<uint32_t*>(kt.at(row0 + M::elem_row(e), M::elem_col(e))) =
            E::pack(o.x[e] * beta[sl], o.x[e + 1] * beta[sl]) & keep[sl];
      }

      // Every thread fences its stores for the copy engine's reads; after the barrier both tiles of the stage
      // are complete, and thread 0 stores them as one bulk group.
      stores_to_matrix_fence();
      __syncthreads();
      if (tid == 0) {
#pragma unroll
        for (int cc = 0; cc < T; ++cc) {
          tma::store_box(&p.dv_map, kt.base + cc * smem_layout::panel, cc * smem_layout::panel_cols,
                         static_cast<int>(c * 64), static_cast<int>(hk), static_cast<int>(b));
          tma::store_box(&p.dk_map, vt.base + cc * smem_layout::panel, cc * smem_layout::panel_cols,
                         static_cast<int>(c * 64), static_cast<int>(hk), static_cast<int>(b));
        }
        tma::store_commit();
      }
    }
    if (tid == 0) tma::store_wait<0>(); // the block's shared memory must outlast the last stores
    return;
  }
#endif

  const auto load = [&](int64_t c, int buf) {
    const int valid = p.seq.valid(c);
    copy_tile(sk(buf), p.k.tile(b, hk, c), p.k.token, valid, tid, nthreads);
    copy_tile(sv(buf), p.v.tile(b, hk, c), p.v.token, valid, tid, nthreads);
  };
#pragma unroll
  for (int c = 0; c < T; ++c) copy_tile(sg(c), p.grad_kvn + (bhk * D + c * 64) * D, D, 64, tid, nthreads);
  if (begin < end) load(begin, 0);
  copy_commit();

  for (int64_t c = begin; c < end; ++c) {
    const int buf = stages == 2 ? static_cast<int>((c - begin) & 1) : 0;
    copy_wait<0>();
    __syncthreads();
    if (stages == 2 && c + 1 < end) load(c + 1, buf ^ 1);
    copy_commit();
    const int valid = p.seq.valid(c);
    const smem_tile<D> kt = sk(buf), vt = sv(buf);

    // v − m, in place (valid rows only; the rest stay zero and their results are discarded). A thread keeps
    // one 16-byte column chunk (and its 8 means) and steps down the rows.
    {
      static_assert(nthreads % (D / 8) == 0, "whole rows of chunks per step");
      const int cc = tid % (D / 8);
      const float4 m0 = *reinterpret_cast<const float4*>(m + cc * 8),
                   m1 = *reinterpret_cast<const float4*>(m + cc * 8 + 4);
      const float mc[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
      for (int r = tid / (D / 8); r < valid; r += nthreads / (D / 8)) {
        uint4* at = reinterpret_cast<uint4*>(vt.chunk(r, cc));
        float x[8];
        unpack<E>(*at, x);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] -= mc[j];
        *at = pack<E>(x);
      }
    }
    stores_to_matrix_fence(); // v − m is nt's A, read by wgmma after the barrier below

    typename M::score_tile f[T];
    load_band<E, D, T>(f, kt, row0);
    feature_band<F, E, D, T>(f);

    // dv.
    float beta[R], inv_beta[R];
#pragma unroll
    for (int r = 0; r < R; ++r) beta[r] = 0.f;
#pragma unroll
    for (int cc = 0; cc < T; ++cc)
#pragma unroll
      for (int e = 0; e < M::score_elems; e += 2) {
        const float2 sc = column_pair(sigma, cc * 64 + M::elem_col(e));
        beta[M::elem_slot(e)] = fmaxf(beta[M::elem_slot(e)], fmaxf(f[cc].x[e] * sc.x, f[cc].x[e + 1] * sc.y));
      }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      beta[r] = M::row_max(beta[r]);
      inv_beta[r] = beta[r] > 0.f ? 1.f / beta[r] : 0.f;
    }
    typename M::out_tile o;
#pragma unroll
    for (int e = 0; e < M::out_elems; ++e) o.x[e] = 0.f;
#pragma unroll
    for (int cc = 0; cc < T; ++cc) {
      typename M::score_tile w;
#pragma unroll
      for (int e = 0; e < M::score_elems; e += 2) {
        const float2 sc = column_pair(sigma, cc * 64 + M::elem_col(e));
        w.x[e] = f[cc].x[e] * sc.x * inv_beta[M::elem_slot(e)];
        w.x[e + 1] = f[cc].x[e + 1] * sc.y * inv_beta[M::elem_slot(e)];
      }
      M::nn(o, w, sg(cc));
    }
#pragma unroll
    for (int e = 0; e < M::out_elems; ++e) o.x[e] *= beta[M::elem_slot(e)];
    __syncthreads(); // v − m is complete, and every warp has read its rows of K: they now receive dv
    store_band<E, D>(o, kt, row0);

    // dk.
    typename M::score_tile s[T];
#pragma unroll
    for (int cc = 0; cc < T; ++cc) {
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) s[cc].x[e] = 0.f;
      M::nt(s[cc], vt, row0, sg(cc));
    }
    key_db<M, T>(s, s, sigma, dz);
    feature_backward_band<F, E, D, T>(f, s);
    __syncthreads(); // every warp has read its rows of v − m: they now receive dk
#pragma unroll
    for (int cc = 0; cc < T; ++cc)
#pragma unroll
      for (int e = 0; e < M::score_elems; e += 2)
        *reinterpret_cast<uint32_t*>(vt.at(row0 + M::elem_row(e), cc * 64 + M::elem_col(e))) =
            E::pack(s[cc].x[e], s[cc].x[e + 1]);
    __syncthreads();
    const int rows_out = p.seq.tiled ? 64 : valid;
    store_tile<D>(p.dv.tile(b, hk, c), p.dv.token, kt, valid, rows_out, tid, nthreads);
    store_tile<D>(p.dk.tile(b, hk, c), p.dk.token, vt, valid, rows_out, tid, nthreads);
    if (stages == 1 && c + 1 < end) {
      __syncthreads();
      load(c + 1, 0);
      copy_commit();
    }
  }
}

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
