// Backward, key side: what both loops of key_grad_kernel share (key_grad.hpp's and ../hopper/linear_key_grad.hpp's
// through the copy engine): the parameters, the shared-memory shape (host and device) and key_db.
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

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
