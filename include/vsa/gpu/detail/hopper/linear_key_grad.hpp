// Backward, key side on Hopper: key_grad_tma, the tile loop of the linear branch's key_grad_kernel
// (../linear/key_grad.hpp) through the copy engine, here with the other Hopper code. As query_grad_tma
// (linear_query_grad.hpp) it is defined on the wgmma backend only (VSA_WGMMA) and declared everywhere, so that the
// kernel names it in a branch that only that backend compiles (if constexpr on layer_tn), and it keeps the linear
// namespace, whose helpers it is written against.
#pragma once

#include "../linear/common.hpp"
#include "../linear/features.hpp"
#include "../linear/key_grad_common.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// The tiles [begin, end) of kv head hk, batch b (bhk = b · kv_heads + hk) from the kernel's shared memory `sm`;
// m, dz and sigma the factors as the kernel placed them, tid and row0 the thread's and its warp's first row.
// `ready` is the kernel's copy_stages barriers: declared in its static shared memory, as the attention kernels
// declare their feeds' (feeds.hpp). begin and end are the kernel's variables (slice_range's), taken by reference as
// the loop read them when it was written in the kernel: passed by value, the compiler forms a tile's token
// differently ((begin + 1)·64 for begin·64 + 64) and the code is no longer that loop's.
template <class E, int D, feature_map F>
__device__ __forceinline__ void key_grad_tma(const key_grad_params& p, uint64_t* ready, uint16_t* sm, const float* m,
                                             const float* dz, const float* sigma, int64_t b, int64_t hk, int64_t bhk,
                                             const int64_t& begin, const int64_t& end, int tid, int row0);

#if VSA_WGMMA
template <class E, int D, feature_map F>
__device__ __forceinline__ void key_grad_tma(const key_grad_params& p, uint64_t* ready, uint16_t* sm, const float* m,
                                             const float* dz, const float* sigma, int64_t b, int64_t hk, int64_t bhk,
                                             const int64_t& begin, const int64_t& end, int tid, int row0) {
  using M = attention_mma<E, D>;
  constexpr int nthreads = key_grad_shape<E, D>::threads;
  constexpr int R = M::rows_per_lane, T = D / 64;
  constexpr int stages = copy_stages;
  // The kernel's layout: D / 64 tiles of dKVn, then the stages of (K, V).
  const auto sg = [&](int c) { return smem_tile<D>{sm + c * 64 * D}; };
  const auto sk = [&](int buf) { return smem_tile<D>{sm + (T + 2 * buf) * 64 * D}; };
  const auto sv = [&](int buf) { return smem_tile<D>{sm + (T + 2 * buf + 1) * 64 * D}; };

  // The copy engine (hopper_tma.hpp), two stages of (K, V), each on one mbarrier. Thread 0 asks for each
  // pair and stores each tile's dv and dk with bulk tensor stores straight from the stage they were written
  // into (dv over K's rows, dk over V's): a warp reads only its own 16 rows of K and V (into registers:
  // φ(k) for P̂ and φ', v − m as the A operand of nt), and writes its results over exactly those rows, so
  // within a tile no warp waits for another until the stage is complete for the store.
  static_assert(stages == 2, "two stages of K and V");
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
}
#endif

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
