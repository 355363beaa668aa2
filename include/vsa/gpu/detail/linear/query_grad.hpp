// Backward, query side: query_grad_kernel (dq, and per slice the partial dKV and dz̄ that grad_reduce adds),
// whose loop serves every target; on Hopper with the copy engine's maps it hands the tiles to query_grad_tma
// (../hopper/linear_query_grad.hpp). With query_weights, which only its row warps use.
#pragma once

#include "common.hpp"
#include "features.hpp"
#include "query_grad_common.hpp"
#include "../hopper/linear_query_grad.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// Per row of the band (slot) of features a = φ(q): a·z and 1 / (a·z + eps).
template <class E, int D>
__device__ __forceinline__ void query_weights(typename warp_mma<E, D>::score_tile (&x)[D / 64], const float* vec,
                                              float eps, float (&inv_den)[warp_mma<E, D>::rows_per_lane],
                                              float (&az)[warp_mma<E, D>::rows_per_lane]) {
  using M = warp_mma<E, D>;
  constexpr int R = M::rows_per_lane, T = D / 64;
  const float* z = vec;
#pragma unroll
  for (int r = 0; r < R; ++r) az[r] = 0.f;
#pragma unroll
  for (int c = 0; c < T; ++c)
#pragma unroll
    for (int e = 0; e < M::score_elems; e += 2) {
      const float2 zc = column_pair(z, c * 64 + M::elem_col(e));
      az[M::elem_slot(e)] += x[c].x[e] * zc.x + x[c].x[e + 1] * zc.y;
    }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    az[r] = M::row_sum(az[r]);
    inv_den[r] = 1.f / (az[r] + eps);
  }
}

// Per 64-token tile. The first four warps take 16 rows each: dq_i = φ'(q_i)ᵀ da_i with (module comment;
// s = KVn · dO_i, u_i = dO_i · ô_i, ô_i = φ(q_i)·KV̄ / den_i, μ_i = m · dO_i, g_i = μ_i eps / den_i − u_i)
//   da_i[d1] = (σ[d1] s[d1] + z[d1] g_i) / den_i,   Σ_d1 φ(q_i)[d1] da_i[d1] = u_i + g_i (φ(q_i)·z) / den_i.
// Then every warp adds, for its bands of d1, dKV = Σ_i (φ(q_i) / den_i) dO_iᵀ and dz̄ = Σ_i (φ(q_i) / den_i) g_i
// (dz̄ = dz + dKV m, the key side's centered form). The transposed operand φ(q_i)[d1] z[d1] / den_i is in
// [0, 1] whatever the sequence length; the records carry that z scaling and grad_reduce removes it.
// φ(q) waits for dq in 16-bit registers (E), which keeps the warps that also hold a 16 × D accumulator under
// the register limit; everything else stays in fp32.
// On the wgmma backend at D = 128 (two warpgroups) the row phase is split instead: warp w of warpgroup h takes
// the same 16 rows as warp w of the other warpgroup but only the columns 64h … 64h+63 of d1 (s against KVn
// tile h, half of φ(q) and s a thread). The row sums that span both halves (φ·z, m·dO, φσ·s, and softmax's
// maximum and sum, combined as in a streaming softmax) are exchanged through shared memory across one
// barrier, and each warpgroup then finishes dq and A for its columns. Otherwise four warps would work here
// while the other four wait, one warp a scheduler with every latency exposed, and each would need the
// registers of a whole row. On Hopper with the maps of Q, dO and dq, query_grad_tma (../hopper/linear_query_grad.hpp)
// runs the tiles instead, through the copy engine; the loop below is the fallback, and the code of every other target.
template <class E, int D, feature_map F>
__global__ void VSA_LINEAR_BOUNDS((band_layout<E, D>::threads), (tuning::of(layer_tn).query_grad_blocks(D)))
    query_grad_kernel(const VSA_GRID_CONSTANT query_grad_params p) {
  using M = attention_mma<E, D>;
  using L = band_layout<E, D>;
  constexpr int nthreads = L::threads;
  constexpr int R = M::rows_per_lane, T = D / 64;
  constexpr int bands = L::bands;
  constexpr int stages = query_grad_shape<E, D>::stages;
  // dz̄ by columns of A (tn): thread = (16-row group, pair of columns); two accumulators, not the eight of
  // a 16-byte chunk, since this kernel has no registers to spare. A warp reads 64 columns of one row at a
  // time (one 128-byte panel row, no bank conflict), and its g is one broadcast.
  constexpr int pairs = D / 2, groups = nthreads / pairs, rows_per_group = 64 / groups;
  static_assert(nthreads % pairs == 0 && 64 % groups == 0 && pairs % 32 == 0, "thread layout");
  // Two warpgroups (D = 128) on the wgmma backend: the row phase runs on both, by column halves of d1
  // (query_grad_shape::split_rows); otherwise on the first four warps, whole rows each.
  constexpr bool split = layer_tn && query_grad_shape<E, D>::split_rows;
  constexpr bool phi_in_smem = split && query_grad_shape<E, D>::hopper_blocks == 2;
  static_assert(!split || (T == 2 && L::warps == 8 && query_grad_shape<E, D>::factors_in_smem), "split layout");

  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = VSA_LINEAR_TILES(smem_raw);
  const auto skv = [&](int c) { return smem_tile<D>{sm + c * 64 * D}; };
  const auto sq = [&](int buf) { return smem_tile<D>{sm + (T + 2 * buf) * 64 * D}; };      // Q, then φ(Q) z / den
  const auto sdo = [&](int buf) { return smem_tile<D>{sm + (T + 2 * buf + 1) * 64 * D}; }; // dO

  // Launched with overlap after the state's reduction (runtime.hpp: launch), and lets grad_reduce's blocks in
  // as its own finish.
  grid_dependents_launch();
  grid_dependency_wait();
  const int64_t slice = blockIdx.x % p.slices, bh = blockIdx.x / p.slices;
  const int64_t b = bh / p.q_heads, h = bh % p.q_heads;
  const int64_t bhk = b * (p.q_heads / p.group) + h / p.group;
  const int tid = threadIdx.x, warp = tid / M::threads;
  const bool row_warp = warp < 4;
  const int row0 = (warp % 4) * 16;
  int64_t begin, end;
  slice_range(slice, p.slices, p.seq.chunks, begin, end);
  const float* vec = p.vec + bhk * 3 * D;
  if constexpr (query_grad_shape<E, D>::factors_in_smem) {
    float* copy = reinterpret_cast<float*>(sm + query_grad_shape<E, D>::tiles / 2);
    for (int i = tid; i < 3 * D; i += nthreads) copy[i] = vec[i]; // ordered by the loop's first barrier
    vec = copy;
  }
  const float *z = vec, *m = vec + D, *sigma = vec + 2 * D;
  float* rows = p.rows + static_cast<int64_t>(blockIdx.x) * 64;

  // layer_tn: the wgmma backend, the only one on which query_grad_tma is defined.
  if constexpr (layer_tn && query_grad_shape<E, D>::tma) {
    if (p.tma != 0) {
      query_grad_tma<E, D, F>(p, sm, z, m, sigma, slice, bh, b, h, bhk, begin, end);
      return;
    }
  }

  const auto load = [&](int64_t c, int buf) {
    const int valid = p.seq.valid(c);
    copy_tile(sq(buf), p.q.tile(b, h, c), p.q.token, valid, tid, nthreads);
    copy_tile(sdo(buf), p.d_o.tile(b, h, c), p.d_o.token, valid, tid, nthreads);
  };
#pragma unroll
  for (int c = 0; c < T; ++c) copy_tile(skv(c), p.kvn + (bhk * D + c * 64) * D, D, 64, tid, nthreads);
  if (begin < end) load(begin, 0);
  copy_commit();

  typename M::out_tile acc[bands];
  float zs[bands][R];
#pragma unroll
  for (int k = 0; k < bands; ++k) {
#pragma unroll
    for (int e = 0; e < M::out_elems; ++e) acc[k].x[e] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) zs[k][r] = 0.f;
  }
  float zk[2] = {0.f, 0.f};
  const int zpair = tid % pairs, zrow = (tid / pairs) * rows_per_group;

  for (int64_t c = begin; c < end; ++c) {
    const int buf = stages == 2 ? static_cast<int>((c - begin) & 1) : 0;
    copy_wait<0>();
    __syncthreads();
    if (stages == 2 && c + 1 < end) load(c + 1, buf ^ 1);
    copy_commit();
    const int valid = p.seq.valid(c);
    const smem_tile<D> qt = sq(buf), dot = sdo(buf);

    if constexpr (split) {
      // Row phase by column halves: warpgroup `half` takes columns 64·half … 64·half+63 of d1 (panel `half`
      // of the Q tile, KVn tile `half`) of the same 16 rows as warp w of the other warpgroup, so both
      // warpgroups work here and each holds half of φ(q) and s. A warp reads and then overwrites (with A)
      // only its own 16 rows of its own panel, so no barrier is needed between the Q reads and the A stores.
      constexpr int K = query_grad_shape<E, D>::row_sums;
      const int half = warp / 4, col0 = half * 64;
      // xch[(h · K + k) · 64 + row]: row sum k over the columns of half h (0 φ·z, 1 m·dO, 2 φσ·s; softmax
      // also 3 its maximum (log2 units), 4 its sum). Written by the row's leader lane.
      float* xch = reinterpret_cast<float*>(sm + query_grad_shape<E, D>::exchange_offset / 2);
      const auto put = [&](int k, const float(&v)[R]) {
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (M::row_leader()) xch[(half * K + k) * 64 + row0 + M::slot_row(r)] = v[r];
      };
      // φ(q) of the half (softmax: its unnormalized part) rounded to E, two elements a word: in registers, or,
      // compiled for two blocks an SM, in place of the warp's Q (16 registers fewer through nt and dq).
      uint32_t a16[phi_in_smem ? 1 : M::score_elems / 2];
      const auto phi_word = [&](int e) -> uint32_t& {
        if constexpr (phi_in_smem)
          return *reinterpret_cast<uint32_t*>(qt.at(row0 + M::elem_row(e), col0 + M::elem_col(e)));
        else
          return a16[e / 2];
      };
      part_features<F, E, D>(qt, row0, col0, z, put, phi_word);
      part_mean_dot<E, D>(dot, row0, col0, m, put);
      typename M::score_tile s; // s[:, d1] of the half
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) s.x[e] = 0.f;
      M::nt(s, dot, row0, skv(half));
      part_scaled_dot<E, D>(s, col0, sigma, put, phi_word);
      __syncthreads(); // both halves' row sums are in xch
      // Both warpgroups combine both halves' sums read back from xch with the same expression, in half order,
      // so they agree bit for bit on every row factor (and the sums never depend on timing).
      float inv_den[R], gk[R], inner[R], fa[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float* x0 = xch + row0 + M::slot_row(r);
        const float* x1 = x0 + K * 64;
        float az, u;
        combine_parts<F>(x0, x1, half, az, u, fa[r]);
        inv_den[r] = 1.f / (az + p.eps);
        u *= inv_den[r];
        gk[r] = (x0[64] + x1[64]) * p.eps * inv_den[r] - u;
        inner[r] = u + gk[r] * az * inv_den[r];
      }
      // dq for the half's columns, and A = φ(q) z / den (0 in padding rows) in place of the warp's Q.
      uint16_t* dq = p.dq.tile(b, h, c);
#pragma unroll
      for (int e = 0; e < M::score_elems; e += 2) {
        const int row = row0 + M::elem_row(e), col = col0 + M::elem_col(e), sl = M::elem_slot(e);
        const float2 sc = column_pair(sigma, col), zc = column_pair(z, col);
        float a[2], g[2];
        dq_pair<F, E>(phi_word(e), fa[sl], sc, zc, s.x[e], s.x[e + 1], gk[sl], inv_den[sl], inner[sl], a, g);
        if (row < valid)
          *reinterpret_cast<uint32_t*>(dq + row * p.dq.token + col) = E::pack(g[0], g[1]);
        else if (p.seq.tiled)
          *reinterpret_cast<uint32_t*>(dq + row * p.dq.token + col) = 0u;
        const float w = row < valid ? inv_den[sl] : 0.f;
        *reinterpret_cast<uint32_t*>(qt.at(row, col)) = E::pack(a[0] * zc.x * w, a[1] * zc.y * w);
      }
      if (half == 0) { // g of each row, for dz̄ (both warpgroups hold the same values)
        float* grow = xch + 2 * K * 64;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int row = row0 + M::slot_row(r);
          if (M::row_leader()) grow[row] = row < valid ? gk[r] : 0.f;
        }
      }
      stores_to_matrix_fence(); // A was stored by this thread and is read by wgmma (tn)
    } else {
      uint32_t a16[T][M::score_elems / 2]; // φ(q), two elements a word
      float inv_den[R], gk[R];
      if (row_warp) {
        float az[R], u[R], mu[R];
        {
          typename M::score_tile a[T];
          load_band<E, D, T>(a, qt, row0);
          feature_band<F, E, D, T>(a);
          query_weights<E, D>(a, vec, p.eps, inv_den, az);
#pragma unroll
          for (int cc = 0; cc < T; ++cc)
#pragma unroll
            for (int e = 0; e < M::score_elems; e += 2) a16[cc][e / 2] = E::pack(a[cc].x[e], a[cc].x[e + 1]);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) u[r] = 0.f, mu[r] = 0.f;
#pragma unroll
        for (int cc = 0; cc < T; ++cc)
#pragma unroll
          for (int e = 0; e < M::score_elems; e += 2) {
            const int col = cc * 64 + M::elem_col(e);
            const uint32_t w = *reinterpret_cast<const uint32_t*>(dot.at(row0 + M::elem_row(e), col));
            const float2 mc = column_pair(m, col);
            mu[M::elem_slot(e)] += mc.x * E::to_float(static_cast<uint16_t>(w & 0xffffu)) +
                                   mc.y * E::to_float(static_cast<uint16_t>(w >> 16));
          }
        typename M::score_tile s[T];
#pragma unroll
        for (int cc = 0; cc < T; ++cc) {
#pragma unroll
          for (int e = 0; e < M::score_elems; ++e) s[cc].x[e] = 0.f;
          M::nt(s[cc], dot, row0, skv(cc));
        }
#pragma unroll
        for (int cc = 0; cc < T; ++cc)
#pragma unroll
          for (int e = 0; e < M::score_elems; e += 2) {
            const int col = cc * 64 + M::elem_col(e);
            const float a0 = E::to_float(static_cast<uint16_t>(a16[cc][e / 2] & 0xffffu));
            const float a1 = E::to_float(static_cast<uint16_t>(a16[cc][e / 2] >> 16));
            const float2 sc = column_pair(sigma, col);
            u[M::elem_slot(e)] += a0 * sc.x * s[cc].x[e] + a1 * sc.y * s[cc].x[e + 1];
          }
        float inner[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          u[r] = M::row_sum(u[r]) * inv_den[r];
          mu[r] = M::row_sum(mu[r]);
          gk[r] = mu[r] * p.eps * inv_den[r] - u[r];
          inner[r] = u[r] + gk[r] * az[r] * inv_den[r];
        }
        uint16_t* dq = p.dq.tile(b, h, c);
#pragma unroll
        for (int cc = 0; cc < T; ++cc)
#pragma unroll
          for (int e = 0; e < M::score_elems; e += 2) {
            const int row = row0 + M::elem_row(e), col = cc * 64 + M::elem_col(e), sl = M::elem_slot(e);
            const float2 sc = column_pair(sigma, col), zc = column_pair(z, col);
            float g[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const float a = E::to_float(static_cast<uint16_t>(a16[cc][e / 2] >> (16 * i)));
              const float da = ((i ? sc.y : sc.x) * s[cc].x[e + i] + (i ? zc.y : zc.x) * gk[sl]) * inv_den[sl];
              if constexpr (F == feature_map::softmax)
                g[i] = a * (da - inner[sl]);
              else if constexpr (F == feature_map::elu1)
                g[i] = da * fminf(a, 1.f);
              else
                g[i] = a > 0.f ? da : 0.f;
            }
            if (row < valid)
              *reinterpret_cast<uint32_t*>(dq + row * p.dq.token + col) = E::pack(g[0], g[1]);
            else if (p.seq.tiled)
              *reinterpret_cast<uint32_t*>(dq + row * p.dq.token + col) = 0u;
          }
      }
      __syncthreads(); // every row warp has read its rows of Q: they now receive φ(q) z / den
      if (row_warp) {
#pragma unroll
        for (int cc = 0; cc < T; ++cc)
#pragma unroll
          for (int e = 0; e < M::score_elems; e += 2) {
            const int row = row0 + M::elem_row(e), col = cc * 64 + M::elem_col(e);
            const float w = row < valid ? inv_den[M::elem_slot(e)] : 0.f;
            const float a0 = E::to_float(static_cast<uint16_t>(a16[cc][e / 2] & 0xffffu));
            const float a1 = E::to_float(static_cast<uint16_t>(a16[cc][e / 2] >> 16));
            const float2 zc = column_pair(z, col);
            *reinterpret_cast<uint32_t*>(qt.at(row, col)) = E::pack(a0 * zc.x * w, a1 * zc.y * w);
          }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int row = row0 + M::slot_row(r);
          if (M::row_leader()) rows[row] = row < valid ? gk[r] : 0.f;
        }
        stores_to_matrix_fence(); // A was stored by this thread and is read by wgmma (tn)
      }
    }
    __syncthreads();

    // dKV[d1 band] += Aᵀ[d1 band, tokens] · dO[tokens, D], dz̄[d1] += Aᵀ[d1, tokens] · g.
    if constexpr (layer_tn) {
      // Warpgroup g owns d1 = 64g … 64g+63, panel g of the A tile, read transposed by wgmma; dz̄ by columns.
      static_assert(bands == 1 && L::warps % 4 == 0, "one 16-row band per warp, whole warpgroups");
      M::tn(acc[0], qt, warp / 4, dot);
      const float* grow = rows; // the row factor g: in global scratch, or next to the row sums when split
      if constexpr (split)
        grow = reinterpret_cast<const float*>(sm + query_grad_shape<E, D>::exchange_offset / 2) +
               2 * query_grad_shape<E, D>::row_sums * 64;
#pragma unroll
      for (int r = 0; r < rows_per_group; ++r) {
        const float g = grow[zrow + r];
        const uint32_t w = *reinterpret_cast<const uint32_t*>(qt.at(zrow + r, 2 * zpair));
        zk[0] += E::to_float(static_cast<uint16_t>(w & 0xffffu)) * g;
        zk[1] += E::to_float(static_cast<uint16_t>(w >> 16)) * g;
      }
    } else {
#pragma unroll
      for (int k = 0; k < bands; ++k) {
        const int d0 = (warp * bands + k) * 16;
        typename M::score_tile st;
#pragma unroll
        for (int e = 0; e < M::score_elems; ++e) {
          const float x = E::to_float(*qt.at(M::elem_col(e), d0 + M::elem_row(e)));
          st.x[e] = x;
          zs[k][M::elem_slot(e)] += x * rows[M::elem_col(e)];
        }
        M::nn(acc[k], st, dot);
      }
    }
    if (stages == 1 && c + 1 < end) {
      __syncthreads(); // every warp is done with the only stage before it is refilled
      load(c + 1, 0);
      copy_commit();
    }
  }
  copy_wait<0>(); // an empty slice still loaded the state

  float* rec = p.partial + (slice * p.heads_total + bh) * record<D>::floats;
#pragma unroll
  for (int k = 0; k < bands; ++k) {
    const int d0 = (warp * bands + k) * 16;
#pragma unroll
    for (int e = 0; e < M::out_elems; e += 2)
      *reinterpret_cast<float2*>(rec + (d0 + M::elem_row(e)) * D + M::elem_col(e)) =
          make_float2(acc[k].x[e], acc[k].x[e + 1]);
    if constexpr (!layer_tn) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float total = M::row_sum(zs[k][r]);
        if (M::row_leader()) rec[record<D>::first + d0 + M::slot_row(r)] = total;
      }
    }
  }
  if constexpr (layer_tn) {
    // dz̄: the row groups' partial column sums, added in group order through shared memory.
    __syncthreads();
    add_column_groups<D>(reinterpret_cast<float*>(sm), zk, tid, pairs, groups, rec + record<D>::first);
  }
}

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
