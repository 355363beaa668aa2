// Forward, first launch: state_kernel, one block per (slice of the sequence, batch, kv head), which adds the
// partial KV, z and Σ v of its slice into an fp32 record; with its parameters and its shared-memory shape
// (host and device).
#pragma once

#include "common.hpp"
#include "features.hpp"
#include "../hopper/linear_copies.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// ---- forward: partial states --------------------------------------------------------------------------------

struct state_params {
  operand k, v;
  sequence seq;
  int64_t kv_heads, slices;
  int64_t heads_total; // batch · kv_heads
  float* partial;      // [slices, heads_total] records: KV (d1 rows), z, Σ v
  // Hopper: K and V through the copy engine where the host could encode their maps (tma = 1,
  // hopper_tma.hpp); otherwise, and everywhere else, copy_tile.
  int tma;
  tma_map k_map, v_map;
};

// Shared memory: the (K, V) stages, then on Hopper a block of ones, the B operand through which the matrix
// cores take z and Σ v (warpgroup_mma::tn_sums). The stages are the tuning table's (Hopper: three) where they
// fit, otherwise the stages the platform's copy allows.
template <class E, int D> struct state_shape {
  using L = band_layout<E, D>;
  static constexpr int threads = L::threads;
  static constexpr int ones_bytes = 1024; // warpgroup_mma::ones_bytes, which host code cannot name
  static constexpr int stages(bool hopper) {
    return 2 * tuning::of(hopper).state_stages * smem_tile<D>::bytes + ones_bytes + smem_slack <= max_block_smem
               ? tuning::of(hopper).state_stages
               : copy_stages;
  }
  static constexpr int tiles(bool hopper) { return 2 * stages(hopper) * smem_tile<D>::bytes; }
  static constexpr int smem(bool hopper) { return tiles(hopper) + (hopper ? ones_bytes : 0) + tile_slack(hopper); }
  static_assert(smem(true) <= max_block_smem, "state tiles do not fit");
  static_assert((threads / (D / 8)) * D * 4 <= tiles(false), "Σ v scratch does not fit");
};

template <class E, int D, feature_map F>
__global__ void VSA_LINEAR_BOUNDS((band_layout<E, D>::threads), (tuning::of(layer_tn).state_blocks(D)))
    state_kernel(const VSA_GRID_CONSTANT state_params p) {
  using M = attention_mma<E, D>;
  using L = band_layout<E, D>;
  constexpr int nthreads = L::threads;
  constexpr int R = M::rows_per_lane;
  constexpr int bands = L::bands;
  constexpr int stages = state_shape<E, D>::stages(layer_tn);
  // Tiles asked for before the loop: all stages but the one the loop refills first (one stage: the first tile).
  constexpr int ahead = stages > 1 ? stages - 1 : 1;
  // φ pass: `tpr` consecutive threads share a row, each converting `cpt` 16-byte chunks of it.
  constexpr int tpr = nthreads / 64, cpt = D / 8 / tpr;
  // Σ v (other backends): thread = (row group, 16-byte column chunk).
  constexpr int vecs = D / 8, groups = nthreads / vecs, rows_per_group = 64 / groups;
  static_assert(tpr >= 1 && cpt >= 1 && nthreads % 64 == 0 && 64 % groups == 0, "thread layout");
  static_assert(wave_reduce::group_fits(tpr, warp_size), "the threads of a row must be a butterfly group of a warp");

  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = VSA_LINEAR_TILES(smem_raw);
  const auto sk = [&](int buf) { return smem_tile<D>{sm + (2 * buf) * 64 * D}; };
  const auto sv = [&](int buf) { return smem_tile<D>{sm + (2 * buf + 1) * 64 * D}; };

  // The reduction after this kernel may be resident as soon as every block of this one is (runtime.hpp: launch).
  grid_dependents_launch();
  const int64_t slice = blockIdx.x % p.slices, bh = blockIdx.x / p.slices;
  const int64_t b = bh / p.kv_heads, hk = bh % p.kv_heads;
  const int tid = threadIdx.x, warp = tid / M::threads;
  int64_t begin, end;
  slice_range(slice, p.slices, p.seq.chunks, begin, end);

  // On Hopper the copy engine (kv_pair_feed, ../hopper/linear_copies.hpp): thread 0 asks for both tiles of a
  // stage, counted on that stage's barrier, so a thread's whole copy work is one wait a tile. Elsewhere the feed
  // does nothing and tma is a constant false.
  static_assert(!layer_tn || stages == 3, "the barriers' phases follow the ring of three stages");
  using feed_type = kv_pair_feed<D, stages, state_params>;
  __shared__ __align__(8) typename feed_type::barriers ready;
  const feed_type feed(ready, p.tma != 0, tid, p, hk, b);
  const bool tma = feed.on();
  // On Hopper the ones of the column sums, after the tiles (whole KiB from a 1024-byte boundary, so the block is
  // one swizzle atom). Written once; the fence and the loop's first barrier order them before the first product.
  uint16_t* ones = sm + 2 * stages * 64 * D;
  if constexpr (layer_tn) {
    static_assert(M::ones_bytes == state_shape<E, D>::ones_bytes && M::ones_bytes / 16 <= nthreads, "block of ones");
    if (tid < M::ones_bytes / 16) {
      const uint32_t one = E::pack(1.f, 1.f);
      reinterpret_cast<uint4*>(ones)[tid] = make_uint4(one, one, one, one);
    }
    stores_to_matrix_fence();
  }

  const auto load = [&](int64_t c, int buf) {
    if (tma) {
      if (tid == 0) feed.load(sk(buf), sv(buf), c, buf);
      return;
    }
    const int valid = p.seq.valid(c);
    copy_tile(sk(buf), p.k.tile(b, hk, c), p.k.token, valid, tid, nthreads);
    copy_tile(sv(buf), p.v.tile(b, hk, c), p.v.token, valid, tid, nthreads);
  };

  typename M::out_tile acc[bands];
  float zs[bands][R];
#pragma unroll
  for (int k = 0; k < bands; ++k) {
#pragma unroll
    for (int e = 0; e < M::out_elems; ++e) acc[k].x[e] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) zs[k][r] = 0.f;
  }
  float vs[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  // z and Σ v of this warp's 16 rows (tn_sums, Hopper; the backend's sum tile, a placeholder elsewhere).
  typename row_sums_by_product<M>::tile zsum{}, vsum{};
  const int vrow = tid / vecs, vcol = tid % vecs;
  const int frow = wave_reduce::group_item(tid, tpr), fpart = wave_reduce::group_part(tid, tpr);

  // One copy group per tile (possibly empty), so that with `stages` stages waiting for all groups but the
  // last stages − 2 means waiting for the current tile.
#pragma unroll
  for (int s = 0; s < ahead; ++s) {
    if (begin + s < end) load(begin + s, s);
    if (!tma) copy_commit();
  }
  // Three stages go round a counter (no division by 3), with the parity of the phase in which the barrier of
  // the stage counts tile c (tma); two alternate as in the other kernels.
  int ring = 0;
  uint32_t phase = 0;
  for (int64_t c = begin; c < end; ++c) {
    const int buf = stages == 3 ? ring : stages == 2 ? static_cast<int>((c - begin) & 1) : 0;
    if (tma) {
      feed.wait(buf, phase);
    } else {
      copy_wait<(stages > 1 ? stages - 2 : 0)>();
    }
    __syncthreads(); // tile c is complete for every thread; every warp is done with the stage refilled next
    if (stages > 1) {
      const int next = stages == 3 ? (buf == 0 ? 2 : buf - 1) : buf ^ 1;
      if (c + stages - 1 < end) load(c + stages - 1, next);
      if (!tma) copy_commit();
    }
    const int valid = p.seq.valid(c);
    const smem_tile<D> kt = sk(buf), vt = sv(buf);

    // φ(k) of every row, in place, rounded to E, padding rows 0. One 16-byte chunk at a time, to keep
    // registers for the accumulators. Rows alternate which half of the chunks they start with, so that the
    // two rows a quarter-warp touches fall on different banks. On Hopper padding rows are cleared whatever
    // they hold (the copy engine does not zero-fill them).
    {
      uint4* chunk[cpt];
#pragma unroll
      for (int j = 0; j < cpt; ++j)
        chunk[j] = reinterpret_cast<uint4*>(kt.chunk(frow, fpart + tpr * ((j + frow) % cpt)));
      feature_row_chunks<F, E, tpr, cpt, layer_tn>(chunk, frow < valid);
    }
    if constexpr (layer_tn) {
      // V's padding rows as copy_tile leaves them, 0: a zero φ(k) times a NaN there would still be NaN.
      if (tma && valid < tile_rows) feed.zero_rows(vt, valid, tid, nthreads);
    } else {
      // Σ v over the tile (padding rows were zero-filled by the copy).
#pragma unroll
      for (int r = 0; r < rows_per_group; ++r) {
        float x[8];
        unpack<E>(*reinterpret_cast<const uint4*>(vt.chunk(vrow + r * groups, vcol)), x);
#pragma unroll
        for (int i = 0; i < 8; ++i) vs[i] += x[i];
      }
    }
    stores_to_matrix_fence(); // φ(K) and V's zeroed rows were stored by this thread and are read by wgmma
    __syncthreads();

    // KV[d1 band] += φ(K)ᵀ[d1 band, 64 tokens] · V[64 tokens, D]; z[d1] = row sums of the same operand.
    if constexpr (layer_tn) {
      // Warpgroup g owns d1 = 64g … 64g+63, panel g of the φ(K) tile, which wgmma reads transposed; in the
      // same chain it takes z for those d1 and Σ v for columns 64g … 64g+63 of V, each as a transposed panel
      // times a block of ones. No warp loads or adds a tile element for the sums.
      static_assert(bands == 1 && L::warps % 4 == 0, "one 16-row band per warp, whole warpgroups");
      M::tn_sums(acc[0], zsum, vsum, kt, warp / 4, vt, ones);
    } else {
#pragma unroll
      for (int k = 0; k < bands; ++k) {
        const int d0 = (warp * bands + k) * 16;
        typename M::score_tile st;
#pragma unroll
        for (int e = 0; e < M::score_elems; ++e) {
          const float x = E::to_float(*kt.at(M::elem_col(e), d0 + M::elem_row(e)));
          st.x[e] = x;
          zs[k][M::elem_slot(e)] += x;
        }
        M::nn(acc[k], st, vt);
      }
    }
    if (stages == 1) {
      __syncthreads(); // every warp is done with the only stage before it is refilled
      if (c + 1 < end) load(c + 1, 0);
      copy_commit();
    }
    if (stages == 3 && ++ring == stages) ring = 0, phase ^= 1u;
  }

  if (!tma) copy_wait<0>(); // nothing may still be landing in shared memory when it is reused below

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
    // Warp w's sums are those of d = 16w + its rows (warpgroup g: d = 64g + 16(w mod 4) + …); every column of
    // a sum tile holds the same value, so the row's leader writes its first.
    if (M::row_leader()) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int d = 16 * warp + M::slot_row(r);
        rec[record<D>::first + d] = zsum.x[2 * r];
        rec[record<D>::second + d] = vsum.x[2 * r];
      }
    }
  } else {
    // Σ v: the row groups' partial sums, added in group order through shared memory.
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem_raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) red[vrow * D + vcol * 8 + i] = vs[i];
    __syncthreads();
    if (tid < D) {
      float total = 0.f;
      for (int g = 0; g < groups; ++g) total += red[g * D + tid];
      rec[record<D>::second + tid] = total;
    }
  }
}

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
