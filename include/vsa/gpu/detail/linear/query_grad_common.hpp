// Backward, query side: what both bodies of the query gradient share (query_grad.hpp's loop and
// ../hopper/linear_query_grad.hpp's): the parameters, the shared-memory shape (host and device), and the helpers of a
// row phase split by column parts (part_*, combine_parts), dq_pair and add_column_groups.
#pragma once

#include "common.hpp"
#include "features.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// ---- backward: query side --------------------------------------------------------------------------------

struct query_grad_params {
  operand q, d_o, dq;
  sequence seq;
  int64_t q_heads, group, slices;
  int64_t heads_total; // batch · q_heads
  const uint16_t* kvn;
  const float* vec;
  float eps;
  float* partial; // [slices, heads_total] records: z-scaled dKV (d1 rows), z-scaled dz̄
  float* rows;    // [slices · heads_total, 64]: the per-row factor g, handed from the row warps to the band warps
  // Hopper: Q and dO in, dq out through the copy engine where the host could encode all three maps and the
  // kernel's shared memory has room for it (tma = 1, query_grad_shape::tma); otherwise, and everywhere else,
  // copy_tile and ordinary stores.
  int tma;
  tma_map q_map, do_map, dq_map;
};

template <class E, int D> struct query_grad_shape {
  using L = band_layout<E, D>;
  static constexpr int threads = L::threads;
  // Decided with the Hopper slack counted, so that host and device agree whatever the code runs as.
  static constexpr int stages =
      (D / 64 + 2 * copy_stages) * smem_tile<D>::bytes + smem_slack <= max_block_smem ? copy_stages : 1;
  static constexpr int tiles = (D / 64 + 2 * stages) * smem_tile<D>::bytes;
  // z, m, σ copied into shared memory after the tiles where that fits (NVIDIA; AMD's 64 KiB are taken by the
  // tiles at D = 128): read there, they are not reloaded from global memory for every tile.
  static constexpr int factor_bytes = 3 * D * 4;
  static constexpr bool factors_in_smem = tiles + factor_bytes + smem_slack <= max_block_smem;
  // Hopper code with two warpgroups (D = 128) splits the row phase between them by column halves (see the
  // kernel): each warpgroup's partial row sums (at most 5 a row) go through shared memory, and so does the
  // tile's row factor g (64 floats), after the factors. Given to Hopper code only, which may exceed the
  // 99 KiB that the other NVIDIA parts share.
  static constexpr bool split_rows = L::warps == 8 && D == 128;
  static constexpr int row_sums = 5;
  static constexpr int exchange_floats = 2 * row_sums * 64 + 64;
  static constexpr int exchange_offset = tiles + (factors_in_smem ? factor_bytes : 0);
  static constexpr int exchange_bytes(bool hopper) { return hopper && split_rows ? exchange_floats * 4 : 0; }
  // Through the copy engine (Hopper code, the kernel's tma path) the block keeps the layout above with the
  // exchange whatever the split (its last 64 floats hold g at D = 64 too, instead of the global scratch), then
  // from the next 1024-byte boundary a third (Q, dO) stage and two tiles in which dq waits for the copy
  // engine's stores: three stages let two tiles stream in while one is used, two dq tiles let a tile's store
  // still read one while the next dq is written into the other. It is taken only where the blocks an SM the
  // kernel is compiled for on Hopper (the tuning table's query_grad_blocks) still fit (D = 128: 166 KiB at one
  // block; D = 64: 77 KiB at two).
  static constexpr int tma_stages = 3, dq_stages = 2;
  static constexpr int tma_extra = (exchange_offset + exchange_floats * 4 + 1023) / 1024 * 1024;
  static constexpr int tma_bytes =
      tma_extra + (2 * (tma_stages - stages) + dq_stages) * smem_tile<D>::bytes + smem_slack;
  static constexpr int hopper_blocks = tuning::of(true).query_grad_blocks(D);
  static constexpr bool tma = stages == 2 && factors_in_smem && tma_bytes <= tuning::hopper_max_block_smem &&
                              hopper_blocks * (tma_bytes + tuning::hopper_block_reserve) <= tuning::hopper_sm_smem;
  static constexpr int smem(bool hopper) {
    return hopper && tma ? tma_bytes : exchange_offset + exchange_bytes(hopper) + tile_slack(hopper);
  }
  static_assert(smem(false) <= max_block_smem, "query-gradient tiles do not fit");
  static_assert(smem(true) <= tuning::hopper_max_block_smem, "query-gradient tiles do not fit (Hopper)");
  static_assert(threads / (D / 2) * D * 4 <= smem(false), "dz̄ scratch does not fit");
};

// dz̄ of a block: thread tid holds the partial sums of column pair tid % pairs over its row group tid / pairs;
// they meet in `red` (groups · D floats of shared memory that no thread reads any more) and are added in group
// order into out[0 … D).
template <int D> __device__ __forceinline__ void add_column_groups(float* red, const float (&zk)[2], int tid, int pairs,
                                                                   int groups, float* out) {
  const int group = tid / pairs, zpair = tid % pairs;
  red[group * D + 2 * zpair] = zk[0];
  red[group * D + 2 * zpair + 1] = zk[1];
  __syncthreads();
  if (tid < D) {
    float total = 0.f;
    for (int g = 0; g < groups; ++g) total += red[g * D + tid];
    out[tid] = total;
  }
}

// The row sums of query_grad's row phase over one part of a warp's 16 rows: the 64 columns col0 … col0 + 63
// of d1. `put(k, sums)` takes row sum k of the part (0 φ·z, 1 m·dO, 2 φσ·s; softmax also 3 its maximum in
// log2 units, 4 its sum), which the caller keeps or exchanges between the parts.
//
// Row sum k of the part, term(e) the pair e, e + 1's share, to put(k, ·).
template <class E, int D, class Term, class Put>
__device__ __forceinline__ void part_row_sum(int k, Term&& term, Put&& put) {
  using M = attention_mma<E, D>;
  constexpr int R = M::rows_per_lane;
  float x[R];
#pragma unroll
  for (int r = 0; r < R; ++r) x[r] = 0.f;
#pragma unroll
  for (int e = 0; e < M::score_elems; e += 2) x[M::elem_slot(e)] += term(e);
#pragma unroll
  for (int r = 0; r < R; ++r) x[r] = M::row_sum(x[r]);
  put(k, x);
}

// φ(q) of the part from the Q tile (softmax: the part's unnormalized exponentials) with sums 0 (3, 4), and φ
// rounded to E, two elements a word, into word(e) for the pair e, e + 1.
template <feature_map F, class E, int D, class Put, class Word> __device__ __forceinline__ void
part_features(smem_tile<D> qt, int row0, int col0, const float* z, Put&& put, Word&& word) {
  using M = attention_mma<E, D>;
  constexpr int R = M::rows_per_lane;
  typename M::score_tile a[1];
#pragma unroll
  for (int e = 0; e < M::score_elems; e += 2) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(qt.at(row0 + M::elem_row(e), col0 + M::elem_col(e)));
    a[0].x[e] = E::to_float(static_cast<uint16_t>(w & 0xffffu));
    a[0].x[e + 1] = E::to_float(static_cast<uint16_t>(w >> 16));
  }
  if constexpr (F == feature_map::softmax) {
    float mx[R], sum[R];
    softmax_part<E, D>(a[0], mx, sum);
    put(3, mx);
    put(4, sum);
  } else {
    feature_band<F, E, D, 1>(a);
  }
  part_row_sum<E, D>(
      0,
      [&](int e) {
        const float2 zc = column_pair(z, col0 + M::elem_col(e));
        return a[0].x[e] * zc.x + a[0].x[e + 1] * zc.y;
      },
      put);
#pragma unroll
  for (int e = 0; e < M::score_elems; e += 2) word(e) = E::pack(a[0].x[e], a[0].x[e + 1]);
}
// μ = m·dO over the part, sum 1.
template <class E, int D, class Put>
__device__ __forceinline__ void part_mean_dot(smem_tile<D> dot, int row0, int col0, const float* m, Put&& put) {
  using M = attention_mma<E, D>;
  part_row_sum<E, D>(
      1,
      [&](int e) {
        const int col = col0 + M::elem_col(e);
        const uint32_t w = *reinterpret_cast<const uint32_t*>(dot.at(row0 + M::elem_row(e), col));
        const float2 mc = column_pair(m, col);
        return mc.x * E::to_float(static_cast<uint16_t>(w & 0xffffu)) +
               mc.y * E::to_float(static_cast<uint16_t>(w >> 16));
      },
      put);
}
// u = Σ φσ·s over the part, sum 2, with φ read back from word(e) as part_features rounded it.
template <class E, int D, class Put, class Word>
__device__ __forceinline__ void part_scaled_dot(const typename attention_mma<E, D>::score_tile& s, int col0,
                                                const float* sigma, Put&& put, Word&& word) {
  using M = attention_mma<E, D>;
  part_row_sum<E, D>(
      2,
      [&](int e) {
        const uint32_t aw = word(e);
        const float a0 = E::to_float(static_cast<uint16_t>(aw & 0xffffu));
        const float a1 = E::to_float(static_cast<uint16_t>(aw >> 16));
        const float2 sc = column_pair(sigma, col0 + M::elem_col(e));
        return a0 * sc.x * s.x[e] + a1 * sc.y * s.x[e + 1];
      },
      put);
}

// Row sums 0 and 2 (φ·z and φσ·s) of one row over both parts, from each part's sums as part_features and
// part_scaled_dot gave them (x0, x1: the row's sum 0 of parts 0 and 1, the others 64 apart), and the factor that
// turns part `half`'s own φ into the row's (softmax: its exponentials relative to the part's own maximum; 1
// otherwise). Every caller evaluates this one expression in part order, so all agree bit for bit.
template <feature_map F> __device__ __forceinline__ void combine_parts(const float* x0, const float* x1, int half,
                                                                       float& az, float& u, float& fa) {
  if constexpr (F == feature_map::softmax) {
    const float mx = fmaxf(x0[3 * 64], x1[3 * 64]);
    const float w0 = fast_exp2(x0[3 * 64] - mx), w1 = fast_exp2(x1[3 * 64] - mx);
    const float inv_sum = 1.f / (x0[4 * 64] * w0 + x1[4 * 64] * w1);
    const float f0 = w0 * inv_sum, f1 = w1 * inv_sum;
    az = f0 * x0[0] + f1 * x1[0];
    u = f0 * x0[2 * 64] + f1 * x1[2 * 64];
    fa = half ? f1 : f0;
  } else {
    az = x0[0] + x1[0];
    u = x0[2 * 64] + x1[2 * 64];
    fa = 1.f;
  }
}

// One pair of a row's elements (columns sc, zc: σ and z of the pair): φ(q) from its rounded word (softmax's
// exponentials times the row's 1 / Σ, fa), da = (σ s + z g_k) / den and dq = φ'ᵀ da through φ, as both loops of
// query_grad need them. a: φ(q) of the pair, g: dq of the pair.
template <feature_map F, class E> __device__ __forceinline__ void dq_pair(uint32_t aw, float fa, float2 sc, float2 zc,
                                                                          float s0, float s1, float gk, float inv_den,
                                                                          float inner, float (&a)[2], float (&g)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    a[i] = E::to_float(static_cast<uint16_t>(aw >> (16 * i)));
    if constexpr (F == feature_map::softmax) a[i] *= fa;
    const float da = ((i ? sc.y : sc.x) * (i ? s1 : s0) + (i ? zc.y : zc.x) * gk) * inv_den;
    if constexpr (F == feature_map::softmax)
      g[i] = a[i] * (da - inner);
    else if constexpr (F == feature_map::elu1)
      g[i] = da * fminf(a[i], 1.f);
    else
      g[i] = a[i] > 0.f ? da : 0.f;
  }
}

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
