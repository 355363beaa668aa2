// Backward, key side: key_grad_kernel (dk, dv) from the reduced gradient, through the copy engine on Hopper
// (key_grad_tma, ../hopper/linear_key_grad.hpp) and the cp.async loop elsewhere; its parameters, its shared-memory
// shape and key_db, which both loops share, are in key_grad_common.hpp.
#pragma once

#include "common.hpp"
#include "features.hpp"
#include "key_grad_common.hpp"
#include "../hopper/linear_key_grad.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// dv_j = Σ_d1 φ(k_j)[d1] dKV[d1, :] = β_j Σ_d1 P̂[j, d1] dKVn[d1, :] (P = φ(k_j) σ', P̂ = P / β_j), and
// dk_j = φ'(k_j)ᵀ db_j with db_j[d1] = σ'[d1] (dKVn (v_j − m))[d1] + dz̄[d1].
// Every output row depends on its own rows of k and v alone, so a warp needs no other warp's rows: on
// Hopper with the copy engine (key_grad_tma) the tile loop meets at one block barrier a tile.
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

  // Hopper with the maps of K, V, dk and dv: key_grad_tma (../hopper/linear_key_grad.hpp) runs the tiles through the
  // copy engine; the loop below is the fallback, and the code of every other target. layer_tn: the wgmma backend,
  // the only one on which key_grad_tma is defined.
  if constexpr (layer_tn) {
    if (p.tma != 0) {
      __shared__ __align__(8) uint64_t ready[stages]; // the copy engine's barriers, one a stage of (K, V)
      key_grad_tma<E, D, F>(p, ready, sm, m, dz, sigma, b, hk, bhk, begin, end, tid, row0);
      return;
    }
  }

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
