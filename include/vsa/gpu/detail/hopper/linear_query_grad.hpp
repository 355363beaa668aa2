// Backward, query side on Hopper: query_grad_tma, the tile loop of the linear branch's query_grad_kernel
// (../linear/query_grad.hpp) through the copy engine, here with the other Hopper code. It is defined on the wgmma
// backend only (VSA_WGMMA: its products and copies exist nowhere else) and declared everywhere, so that the kernel
// names it in a branch that only that backend compiles (if constexpr on layer_tn). It keeps the linear namespace:
// it is written against the linear kernels' helpers (query_grad_common.hpp's), not against the attention kernels'.
#pragma once

#include "../linear/common.hpp"
#include "../linear/query_grad_common.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

template <class E, int D, feature_map F>
__device__ __forceinline__ void query_grad_tma(const query_grad_params& p, uint16_t* sm, const float* z, const float* m,
                                               const float* sigma, int64_t slice, int64_t bh, int64_t b, int64_t h,
                                               int64_t bhk, int64_t begin, int64_t end);

#if VSA_WGMMA
// query_grad_kernel through the copy engine (Hopper code, where query_grad_shape::tma holds and the host could
// encode the maps of Q, dO and dq). Thread 0 asks for each tile's Q and dO (three stages, one mbarrier each)
// and sends each dq tile out with bulk tensor stores from one of two dq tiles, so that no warp spends
// instructions on 16-byte copies. The row phase runs on every warpgroup: warp w of warpgroup h takes rows
// 16w … 16w+15 of the tile and the columns 64h … 64h+63 of d1 (H = D/64 warpgroups: at D = 128 the split of
// the cp.async loop, at D = 64 one warpgroup with whole rows, whose row sums then never leave the warp). Its
// s = dO·KVnᵀ is issued first and runs on the matrix cores while φ(q) and m·dO are computed. Two block
// barriers a tile (three in the cp.async loop): after the row sums (every warp is then done with tile c − 1,
// whose stage is refilled with tile c + 2), and before the products that read A and dO.
// Padding rows: a box is a whole tile and a padding slot may hold anything (NaN). A row of Q or dO feeds only
// its own row's sums, s, dq and A until the products over tokens; there A and g are masked to 0 bit for bit
// in rows at and past `valid`, and each warp zeroes its rows of dO past `valid` (of its panel) once every
// warp's s is in. dq rows past `valid` are written 0 (the padding slots of a tiled tensor; in raster order
// those rows lie past the sequence, where the store does not write).
template <class E, int D, feature_map F>
__device__ __forceinline__ void query_grad_tma(const query_grad_params& p, uint16_t* sm, const float* z, const float* m,
                                               const float* sigma, int64_t slice, int64_t bh, int64_t b, int64_t h,
                                               int64_t bhk, int64_t begin, int64_t end) {
  using M = attention_mma<E, D>;
  using L = band_layout<E, D>;
  using S = query_grad_shape<E, D>;
  constexpr int nthreads = L::threads;
  constexpr int R = M::rows_per_lane, T = D / 64, H = T;
  constexpr int K = S::row_sums, stages = S::tma_stages;
  constexpr int pairs = D / 2, groups = nthreads / pairs, rows_per_group = 64 / groups;
  static_assert(L::bands == 1 && L::warps == 4 * H, "warpgroup h takes panel h of d1, one 16-row band a warp");
  static_assert(stages == 3 && S::dq_stages == 2, "the ring of three stages and the two dq tiles below");
  static_assert(nthreads % pairs == 0 && 64 % groups == 0, "thread layout of dz̄");

  const int tid = threadIdx.x, warp = tid / M::threads, lane = tid % M::threads;
  const int half = warp / 4, col0 = half * 64, row0 = (warp % 4) * 16;
  const auto skv = [&](int c) { return smem_tile<D>{sm + c * 64 * D}; };
  // Stage s holds Q, then dO: stages 0 and 1 where the cp.async loop keeps its two, stage 2 after the exchange.
  const auto stage = [&](int s) { return sm + (s == 2 ? S::tma_extra / 2 : (T + 2 * s) * 64 * D); };
  const auto sdq = [&](int i) { return smem_tile<D>{sm + S::tma_extra / 2 + (2 + i) * 64 * D}; };
  // xch[(h · K + k) · 64 + row]: row sum k over the columns of part h (H = 2; as in the cp.async loop), then g.
  float* xch = reinterpret_cast<float*>(sm + S::exchange_offset / 2);
  float* grow = xch + 2 * K * 64;

  __shared__ __align__(8) uint64_t ready[stages];
  tma::init_barriers(ready, stages, true, tid);
  const auto load = [&](int64_t c, int s) {
    tma::tile_pair{&ready[s], 0u}.load<D>(smem_tile<D>{stage(s)}, &p.q_map, smem_tile<D>{stage(s) + 64 * D}, &p.do_map,
                                          c * 64, h, b);
  };
  if (tid == 0) {
    if (begin < end) load(begin, 0);
    if (begin + 1 < end) load(begin + 1, 1);
  }
#pragma unroll
  for (int c = 0; c < T; ++c) copy_tile(skv(c), p.kvn + (bhk * D + c * 64) * D, D, 64, tid, nthreads);
  copy_commit();
  copy_wait<0>();  // KVn landed, fenced for wgmma's reads
  __syncthreads(); // KVn and the factors complete for every thread

  typename M::out_tile acc;
#pragma unroll
  for (int e = 0; e < M::out_elems; ++e) acc.x[e] = 0.f;
  float zk[2] = {0.f, 0.f};
  const int zpair = tid % pairs, zrow = (tid / pairs) * rows_per_group;

  // The stages go round a counter, with the parity of the phase in which the barrier of the stage counts tile
  // c; the dq tiles alternate.
  int ring = 0;
  uint32_t phase = 0;
  for (int64_t c = begin; c < end; ++c) {
    uint16_t* st = stage(ring);
    const smem_tile<D> qt{st}, dot{st + 64 * D}, dqt = sdq(static_cast<int>((c - begin) & 1));
    const int valid = p.seq.valid(c);
    tma::wait(&ready[ring], phase);
    __syncwarp(); // whole warps issue wgmma

    typename M::score_tile s; // s[:, d1] of the part
    M::nt_into(s, dot, skv(half));

    float own[K][R]; // H = 1: the row sums stay in registers
    const auto put = [&](int k, const float(&v)[R]) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if constexpr (H == 2) {
          if (M::row_leader()) xch[(half * K + k) * 64 + row0 + M::slot_row(r)] = v[r];
        } else {
          own[k][r] = v[r];
        }
      }
    };
    uint32_t a16[M::score_elems / 2]; // φ(q) of the part (softmax: its unnormalized exponentials), rounded to E
    const auto word = [&](int e) -> uint32_t& { return a16[e / 2]; };
    part_features<F, E, D>(qt, row0, col0, z, put, word);
    part_mean_dot<E, D>(dot, row0, col0, m, put);
    wgmma::wait<0>();
    wgmma::pin(s.x);
    part_scaled_dot<E, D>(s, col0, sigma, put, word);
    // dq tile c mod 2 was last read by the store of tile c − 2, which must be done with it before the barrier
    // below lets any warp write it.
    if (tid == 0) tma::store_wait_read<S::dq_stages - 1>();
    __syncthreads(); // both parts' row sums are in xch; every warp is done with tile c − 1 and its stage
    if (tid == 0 && c + 2 < end) load(c + 2, ring == 0 ? stages - 1 : ring - 1);

    // The row factors, as in the cp.async loop (both warpgroups combine both parts in part order, bit for bit
    // the same values).
    float inv_den[R], gk[R], inner[R], fa[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float az, u, mu;
      if constexpr (H == 2) {
        const float* x0 = xch + row0 + M::slot_row(r);
        combine_parts<F>(x0, x0 + K * 64, half, az, u, fa[r]);
        mu = x0[64] + x0[K * 64 + 64];
      } else {
        if constexpr (F == feature_map::softmax) {
          fa[r] = 1.f / own[4][r];
          az = fa[r] * own[0][r];
          u = fa[r] * own[2][r];
        } else {
          az = own[0][r];
          u = own[2][r];
          fa[r] = 1.f;
        }
        mu = own[1][r];
      }
      inv_den[r] = 1.f / (az + p.eps);
      u *= inv_den[r];
      gk[r] = mu * p.eps * inv_den[r] - u;
      inner[r] = u + gk[r] * az * inv_den[r];
    }
    // dq of the part into its dq tile, and A = φ(q) z / den in place of the warp's Q, both 0 bit for bit in
    // rows at and past `valid` (whatever the copy brought there).
    uint32_t keep[R];
#pragma unroll
    for (int r = 0; r < R; ++r) keep[r] = row0 + M::slot_row(r) < valid ? ~0u : 0u;
#pragma unroll
    for (int e = 0; e < M::score_elems; e += 2) {
      const int row = row0 + M::elem_row(e), col = col0 + M::elem_col(e), sl = M::elem_slot(e);
      const float2 sc = column_pair(sigma, col), zc = column_pair(z, col);
      float a[2], g[2];
      dq_pair<F, E>(a16[e / 2], fa[sl], sc, zc, s.x[e], s.x[e + 1], gk[sl], inv_den[sl], inner[sl], a, g);
      *reinterpret_cast<uint32_t*>(dqt.at(row, col)) = E::pack(g[0], g[1]) & keep[sl];
      *reinterpret_cast<uint32_t*>(qt.at(row, col)) =
          E::pack(a[0] * zc.x * inv_den[sl], a[1] * zc.y * inv_den[sl]) & keep[sl];
    }
    // dO's rows past `valid` in this warp's rows and panel, as copy_tile's zero-fill leaves them: tn sums over
    // the tile's rows, and a zero of A times a NaN there would be NaN. Every warp's s has read them (the
    // barrier above).
    if (row0 + 16 > valid) {
      constexpr int pc = smem_layout::panel_cols / 8; // 16-byte chunks of a panel row
      for (int x = lane; x < 16 * pc; x += M::threads) {
        const int r = row0 + x / pc;
        if (r >= valid) *reinterpret_cast<uint4*>(dot.chunk(r, half * pc + x % pc)) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    if (half == 0) { // g of each row, for dz̄ (every warpgroup holds the same values)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int row = row0 + M::slot_row(r);
        if (M::row_leader()) grow[row] = row < valid ? gk[r] : 0.f;
      }
    }
    stores_to_matrix_fence(); // dq, A and dO's zeros are read by the copy engine and by wgmma
    __syncthreads();

    // dKV[d1 band] += Aᵀ[d1 band, tokens] · dO[tokens, D] on the matrix cores while dz̄ is summed by columns, and
    // the tile's dq goes out.
    M::tn_async(acc, qt, half, dot);
    if (tid == 0) tma::store_tile<D>(&p.dq_map, dqt, c * 64, h, b);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < rows_per_group; ++r) {
      const float g = grow[zrow + r];
      const uint32_t w = *reinterpret_cast<const uint32_t*>(qt.at(zrow + r, 2 * zpair));
      zk[0] += E::to_float(static_cast<uint16_t>(w & 0xffffu)) * g;
      zk[1] += E::to_float(static_cast<uint16_t>(w >> 16)) * g;
    }
    stores_to_matrix_fence(); // orders this thread's reads of the stage before the copy engine refills it
    wgmma::wait<0>();
    wgmma::pin(acc.x);
    if (++ring == stages) ring = 0, phase ^= 1u;
  }

  // The records, as the cp.async loop writes them.
  float* rec = p.partial + (slice * p.heads_total + bh) * record<D>::floats;
#pragma unroll
  for (int e = 0; e < M::out_elems; e += 2)
    *reinterpret_cast<float2*>(rec + (16 * warp + M::elem_row(e)) * D + M::elem_col(e)) =
        make_float2(acc.x[e], acc.x[e + 1]);
  __syncthreads(); // every product has read KVn, whose tile now takes the partial column sums of dz̄
  add_column_groups<D>(reinterpret_cast<float*>(sm), zk, tid, pairs, groups, rec + record<D>::first);
  if (tid == 0) tma::store_wait<0>(); // the block's shared memory must outlast the last stores
}
#endif

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
