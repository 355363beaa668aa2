// The coarse pass's scores, S = scale · q_c · k_cᵀ for every head, from the fp32 tile means at about twice
// bf16's precision: each mean is split into a bf16 part and the bf16 rounding of what that part lost
// (x = hi + lo to 2^-16 of x), and S is hi·hiᵀ + hi·loᵀ + lo·hiᵀ on the matrix cores (lo·loᵀ is below the
// rest's rounding). One block a 64 × 64 block of S, four warps of 16 rows, as the attention kernels.
//
// Why not one product of the means rounded to 16 bits: the means of tiles with few valid tokens keep the
// tokens' scale (a tile of one token is that token), so coarse scores run to hundreds where queries and keys
// are large, and a 2^-9 error of each mean moves them by whole units: a sharp softmax then loses its small
// probabilities, which are the coarse branch's gradient (README.md, accuracy).
#pragma once

#include "../arch/element.hpp"
#include "../arch/matrix.hpp"
#include "attention_schedule.hpp"

namespace vsa {
namespace gpu {
namespace detail {

struct coarse_scores_params {
  const float* q_c; // [B, Hq, N, D] fp32
  const float* k_c; // [B, Hkv, N, D] fp32
  float* scores;    // [B, Hq, N, N] (dense_scores), or [B, Hq, N, width] (packed_scores)
  int64_t q_heads, group;
  float scale;
};

// One 64 × 64 block of the scores: its query and key rows of the means, and where it lies in a head's scores.
struct score_block {
  int64_t q_row0, k_row0; // the first query and key rows
  int q_valid, k_valid;   // rows of each (the block's rows and columns past them are not written)
  int64_t out, stride;    // the block's first score, from the head's first; the row stride
};
// One grid: a head's scores are [N, N], block (i, j) of the grid (⌈N/64⌉, ⌈N/64⌉).
struct dense_scores {
  int64_t length; // N
  __host__ __device__ __forceinline__ int64_t head_size() const { return length * length; }
  __device__ __forceinline__ bool block(int64_t i, int64_t j, score_block& b) const {
    b.q_row0 = i * 64, b.k_row0 = j * 64;
    b.q_valid = static_cast<int>(length - b.q_row0 < 64 ? length - b.q_row0 : 64);
    b.k_valid = static_cast<int>(length - b.k_row0 < 64 ? length - b.k_row0 : 64);
    b.out = b.q_row0 * length + b.k_row0, b.stride = length;
    return true;
  }
};
// A packed batch (packed_attention.hpp): row r of a head's [N, width] scores holds its sample's N_s scores first, so
// that every sample's block of the scores is that of its own call (width: the largest N_s). Blocks (j, i) of the grid
// (⌈width/64⌉, the samples' query blocks): i one of packed_dense_schedule's blocks, j a key block of its sample.
struct packed_scores {
  const int4* blocks; // packed_dense_schedule::blocks
  int64_t length, width;
  __host__ __device__ __forceinline__ int64_t head_size() const { return length * width; }
  __device__ __forceinline__ bool block(int64_t i, int64_t j, score_block& b) const {
    const int4 e = blocks[i]; // {first row, valid rows, the sample's first block, the sample's rows}
    if (j * 64 >= e.w) return false;
    b.q_row0 = e.x, b.q_valid = e.y;
    b.k_row0 = e.x - (i - e.z) * 64 + j * 64;
    b.k_valid = e.w - static_cast<int>(j) * 64 < 64 ? e.w - static_cast<int>(j) * 64 : 64;
    b.out = b.q_row0 * width + j * 64, b.stride = width;
    return true;
  }
};

// Rows [block·64, block·64 + 64) of a [length, D] fp32 array into two bf16 tiles: the bf16 rounding of each
// value (hi) and the bf16 rounding of what that lost (lo). Rows past the length are zeros. Every thread's loads
// are issued before its first store, so that the whole tile is in flight at once.
template <int D, int Threads> __device__ __forceinline__ void
split_rows(smem_tile<D> hi, smem_tile<D> lo, const float* src, int64_t block, int64_t length, int tid) {
  constexpr int chunks = smem_tile<D>::chunks, per_thread = tile_rows * chunks / Threads;
  static_assert(tile_rows * chunks % Threads == 0, "the tile's chunks split evenly over the block");
  float4 x[per_thread][2];
#pragma unroll
  for (int k = 0; k < per_thread; ++k) {
    const int at = tid + k * Threads, r = at / chunks, c = at % chunks;
    const int64_t row = block * 64 + r;
    // An if, not a select between the loaded vectors and zeros: the AMD compiler builds that select in scratch.
    x[k][0] = x[k][1] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row < length) {
      const float4* s = reinterpret_cast<const float4*>(src + row * D + c * 8);
      x[k][0] = s[0];
      x[k][1] = s[1];
    }
  }
  // A pair of values as bf16 (hi, in .x) and what that lost, as bf16 (lo, in .y).
  const auto split = [](float x0, float x1) {
    float h0, h1;
    rounded_pair<bf16_type>(x0, x1, h0, h1);
    return make_uint2(bf16_type::pack(x0, x1), bf16_type::pack(x0 - h0, x1 - h1));
  };
#pragma unroll
  for (int k = 0; k < per_thread; ++k) {
    const int at = tid + k * Threads, r = at / chunks, c = at % chunks;
    const uint2 a = split(x[k][0].x, x[k][0].y), b = split(x[k][0].z, x[k][0].w), d = split(x[k][1].x, x[k][1].y),
                e = split(x[k][1].z, x[k][1].w);
    *reinterpret_cast<uint4*>(hi.chunk(r, c)) = make_uint4(a.x, b.x, d.x, e.x);
    *reinterpret_cast<uint4*>(lo.chunk(r, c)) = make_uint4(a.y, b.y, d.y, e.y);
  }
}

// Grid: (key blocks, query blocks, B·Hq), as the Layout (dense_scores, packed_scores) numbers them.
template <int D, class Layout = dense_scores> __global__ void __launch_bounds__((4 * warp_mma<bf16_type, D>::threads))
    coarse_scores_kernel(coarse_scores_params p, Layout layout) {
  using M = attention_mma<bf16_type, D>;
  constexpr int nthreads = 4 * M::threads;
  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = aligned_smem(smem_raw);
  const smem_tile<D> q_hi{sm}, q_lo{sm + 64 * D}, k_hi{sm + 2 * 64 * D}, k_lo{sm + 3 * 64 * D};
  const int64_t j = blockIdx.x, i = blockIdx.y, bh = blockIdx.z, b = bh / p.q_heads, h = bh % p.q_heads;
  const int tid = static_cast<int>(threadIdx.x) % nthreads, row0 = (tid / M::threads) * 16;
  score_block blk;
  if (!layout.block(i, j, blk)) return; // the whole block: no key block of this sample
  const float* q = p.q_c + bh * layout.length * D;
  const float* k = p.k_c + (b * (p.q_heads / p.group) + h / p.group) * layout.length * D;

  split_rows<D, nthreads>(q_hi, q_lo, q + blk.q_row0 * D, 0, blk.q_valid, tid);
  split_rows<D, nthreads>(k_hi, k_lo, k + blk.k_row0 * D, 0, blk.k_valid, tid);
  stores_to_matrix_fence();
  __syncthreads();
  typename M::score_tile st;
#pragma unroll
  for (int e = 0; e < M::score_elems; ++e) st.x[e] = 0.f;
  M::nt(st, q_hi, row0, k_hi);
  M::nt(st, q_hi, row0, k_lo);
  M::nt(st, q_lo, row0, k_hi);
  // Elements e and e + 1 (e even) are neighbours in one row in every accumulator layout: one 8-byte store
  // where the row stride keeps it aligned (a block's first score is then at an even offset too).
  float* out = p.scores + bh * layout.head_size() + blk.out;
  const bool pairs = blk.stride % 2 == 0;
#pragma unroll
  for (int e = 0; e < M::score_elems; e += 2) {
    const int r = row0 + M::elem_row(e), c = M::elem_col(e);
    if (r >= blk.q_valid) continue;
    const float x0 = st.x[e] * p.scale, x1 = st.x[e + 1] * p.scale;
    if (pairs && c + 1 < blk.k_valid) {
      *reinterpret_cast<float2*>(out + r * blk.stride + c) = make_float2(x0, x1);
    } else {
      if (c < blk.k_valid) out[r * blk.stride + c] = x0;
      if (c + 1 < blk.k_valid) out[r * blk.stride + c + 1] = x1;
    }
  }
}

inline int coarse_scores_smem(int head_dim) { return 4 * tile_rows * head_dim * 2 + smem_slack; }

} // namespace detail
} // namespace gpu
} // namespace vsa
