// The feature map φ (softmax, elu+1, relu) and its derivative as the kernels apply them: over the row bands of
// score tiles held in registers (common.hpp), on two packed 16-bit elements of a word, and on the 16-byte
// chunks of a row in shared memory (the state kernel's pass over K).
#pragma once

#include "common.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// φ over the head dim of every row of the band, in place. With `normalize` false, softmax leaves its
// exponentials unnormalized and returns each row's 1 / Σ in `scale` instead (a caller whose result is a ratio
// of sums over the row, like apply's, folds it into per-row factors); elu+1 and relu always set scale to 1.
// (R is a parameter of its own, not warp_mma<E, D>::rows_per_lane in the declaration: clang 15 misparses that
// array bound in a template with a feature_map parameter.)
template <feature_map F, bool normalize, class E, int D, int T, int R>
__device__ __forceinline__ void feature_band_scaled(typename warp_mma<E, D>::score_tile (&x)[T], float (&scale)[R]) {
  using M = warp_mma<E, D>;
  static_assert(R == M::rows_per_lane, "one scale per row of the lane");
#pragma unroll
  for (int r = 0; r < R; ++r) scale[r] = 1.f;
  if constexpr (F == feature_map::softmax) {
    float mx[R], sum[R];
#pragma unroll
    for (int r = 0; r < R; ++r) mx[r] = -__builtin_huge_valf(), sum[r] = 0.f;
#pragma unroll
    for (int c = 0; c < T; ++c)
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) mx[M::elem_slot(e)] = fmaxf(mx[M::elem_slot(e)], x[c].x[e]);
#pragma unroll
    for (int r = 0; r < R; ++r) mx[r] = M::row_max(mx[r]) * log2_e;
#pragma unroll
    for (int c = 0; c < T; ++c)
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) {
        const float y = fast_exp2(fmaf(x[c].x[e], log2_e, -mx[M::elem_slot(e)]));
        x[c].x[e] = y;
        sum[M::elem_slot(e)] += y;
      }
#pragma unroll
    for (int r = 0; r < R; ++r) scale[r] = 1.f / M::row_sum(sum[r]);
    if constexpr (normalize) {
#pragma unroll
      for (int c = 0; c < T; ++c)
#pragma unroll
        for (int e = 0; e < M::score_elems; ++e) x[c].x[e] *= scale[M::elem_slot(e)];
#pragma unroll
      for (int r = 0; r < R; ++r) scale[r] = 1.f;
    }
  } else if constexpr (F == feature_map::elu1) {
#pragma unroll
    for (int c = 0; c < T; ++c)
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) {
        // max(v, 0) + e^min(v, 0) is v + 1 for v > 0 and e^v otherwise, without a branch around the
        // exponential (which the compiler otherwise emits for every element).
        const float v = x[c].x[e];
        x[c].x[e] = fmaxf(v, 0.f) + fast_exp2(fminf(v, 0.f) * log2_e);
      }
  } else {
#pragma unroll
    for (int c = 0; c < T; ++c)
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) x[c].x[e] = fmaxf(x[c].x[e], 0.f);
  }
}
template <feature_map F, class E, int D, int T>
__device__ __forceinline__ void feature_band(typename warp_mma<E, D>::score_tile (&x)[T]) {
  float scale[warp_mma<E, D>::rows_per_lane];
  feature_band_scaled<F, true, E, D, T>(x, scale);
}

// Softmax over one part of each row of the band (the 64 columns of a score tile, when a row's columns are
// split between warps): the exponentials relative to the part's own maximum, unnormalized, and per row that
// maximum (times log2 e) and the part's sum. The parts combine as in a streaming softmax: with M the larger
// maximum, part p is scaled by 2^(mx_p − M) / Σ_p' sum_p' 2^(mx_p' − M).
template <class E, int D, int R>
__device__ __forceinline__ void softmax_part(typename warp_mma<E, D>::score_tile& x, float (&mx)[R], float (&sum)[R]) {
  using M = warp_mma<E, D>;
  static_assert(R == M::rows_per_lane, "one maximum and sum per row of the lane");
#pragma unroll
  for (int r = 0; r < R; ++r) mx[r] = -__builtin_huge_valf(), sum[r] = 0.f;
#pragma unroll
  for (int e = 0; e < M::score_elems; ++e) mx[M::elem_slot(e)] = fmaxf(mx[M::elem_slot(e)], x.x[e]);
#pragma unroll
  for (int r = 0; r < R; ++r) mx[r] = M::row_max(mx[r]) * log2_e;
#pragma unroll
  for (int e = 0; e < M::score_elems; ++e) {
    const float y = fast_exp2(fmaf(x.x[e], log2_e, -mx[M::elem_slot(e)]));
    x.x[e] = y;
    sum[M::elem_slot(e)] += y;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) sum[r] = M::row_sum(sum[r]);
}

// d ← (∂φ/∂x)ᵀ d, with a = φ(x). Each derivative is a function of a alone: softmax's Jacobian is
// diag(a) − a aᵀ; elu(x)+1 has slope 1 where x > 0 (a > 1) and e^x = a elsewhere, i.e. min(a, 1); relu has
// slope 1 where x > 0, i.e. where a > 0.
template <feature_map F, class E, int D, int T> __device__ __forceinline__ void
feature_backward_band(const typename warp_mma<E, D>::score_tile (&a)[T], typename warp_mma<E, D>::score_tile (&d)[T]) {
  using M = warp_mma<E, D>;
  constexpr int R = M::rows_per_lane;
  if constexpr (F == feature_map::softmax) {
    float inner[R];
#pragma unroll
    for (int r = 0; r < R; ++r) inner[r] = 0.f;
#pragma unroll
    for (int c = 0; c < T; ++c)
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) inner[M::elem_slot(e)] += a[c].x[e] * d[c].x[e];
#pragma unroll
    for (int r = 0; r < R; ++r) inner[r] = M::row_sum(inner[r]);
#pragma unroll
    for (int c = 0; c < T; ++c)
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) d[c].x[e] = a[c].x[e] * (d[c].x[e] - inner[M::elem_slot(e)]);
  } else if constexpr (F == feature_map::elu1) {
#pragma unroll
    for (int c = 0; c < T; ++c)
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) d[c].x[e] *= fminf(a[c].x[e], 1.f);
  } else {
#pragma unroll
    for (int c = 0; c < T; ++c)
#pragma unroll
      for (int e = 0; e < M::score_elems; ++e) d[c].x[e] = a[c].x[e] > 0.f ? d[c].x[e] : 0.f;
  }
}

// φ of the two 16-bit elements of one 32-bit word (adjacent columns of a row), rounded back to E; relu and
// elu+1 only (softmax needs its row's maximum and sum). On NVIDIA both work on the packed pair: relu is one
// max.bf16x2 / max.f16x2, exact like fmaxf; elu+1 takes v + 1 as one fma.rn on the pair (v·1 + 1 rounded
// once, which is what rounding the exact fp32 sum gives: it is exact in fp32 for every 16-bit v below 2^24,
// and above that both round back to v) and picks it where the sign bit is clear (at ±0 both branches give
// 1), 2^(v·log2 e) elsewhere; only the exponentials go through fp32. Elsewhere: fp32, one element at a time.
template <feature_map F, class E> __device__ __forceinline__ uint32_t feature_pair(uint32_t w) {
  static_assert(F != feature_map::softmax, "softmax is not elementwise");
#if VSA_PLATFORM_NVIDIA
  uint32_t r;
  if constexpr (F == feature_map::relu) {
    if constexpr (E::is_bf16)
      asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(w), "r"(0u));
    else
      asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(w), "r"(0u));
  } else {
    const float lo = E::to_float(static_cast<uint16_t>(w & 0xffffu)), hi = E::to_float(static_cast<uint16_t>(w >> 16));
    const uint32_t ex = E::pack(fast_exp2(lo * log2_e), fast_exp2(hi * log2_e));
    uint32_t plus1, neg;
    if constexpr (E::is_bf16)
      asm("fma.rn.bf16x2 %0, %1, %2, %2;" : "=r"(plus1) : "r"(w), "r"(0x3f803f80u));
    else
      asm("fma.rn.f16x2 %0, %1, %2, %2;" : "=r"(plus1) : "r"(w), "r"(0x3c003c00u));
    // 0xffff in each half whose sign bit is set: prmt replicates the sign of bytes 1 and 3.
    asm("prmt.b32 %0, %1, 0, 0xBB99;" : "=r"(neg) : "r"(w));
    r = (plus1 & ~neg) | (ex & neg);
  }
  return r;
#else
  float x[2] = {E::to_float(static_cast<uint16_t>(w & 0xffffu)), E::to_float(static_cast<uint16_t>(w >> 16))};
#pragma unroll
  for (int i = 0; i < 2; ++i)
    x[i] = F == feature_map::relu ? fmaxf(x[i], 0.f) : x[i] > 0.f ? x[i] + 1.f : fast_exp2(x[i] * log2_e);
  return E::pack(x[0], x[1]);
#endif
}

// φ of the `cpt` 16-byte chunks `chunk[j]` of one row, in place, rounded to E; a row that is not `valid`
// (a padding slot, zero-filled by the copy) becomes 0, so that it adds nothing to z. The `tpr` threads that
// share the row are a butterfly group of a warp; softmax merges their partial maxima and sums of
// exponentials, so it runs on every row (the shuffles need the whole warp) and zeroes a padding row through
// its scale; relu keeps the zeros as they are. With `clear`, a padding row may hold anything (the copy
// engine copies whole tiles, padding slots included, and a NaN there would survive a zero scale or relu):
// it is overwritten with zeros for every map.
template <feature_map F, class E, int tpr, int cpt, bool clear = false>
__device__ __forceinline__ void feature_row_chunks(uint4* const (&chunk)[cpt], bool valid) {
  if constexpr (F == feature_map::softmax) {
    // First pass: the row's running maximum · log2(e) and Σ 2^(x·log2(e) − max), chunk by chunk.
    float mx = -__builtin_huge_valf(), sum = 0.f;
#pragma unroll
    for (int j = 0; j < cpt; ++j) {
      float x[8];
      unpack<E>(*chunk[j], x);
      float mc = x[0];
#pragma unroll
      for (int i = 1; i < 8; ++i) mc = fmaxf(mc, x[i]);
      mc = fmaxf(mx, mc * log2_e);
      sum *= fast_exp2(mx - mc);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += fast_exp2(fmaf(x[i], log2_e, -mc));
      mx = mc;
    }
    // The row's `tpr` partials merged by wave_reduce's group butterfly; the merge is symmetric in its two
    // operands, so every thread of the row ends with the same maximum and sum.
#pragma unroll
    for (int s = 0; s < wave_reduce::group_steps(tpr); ++s) {
      const int o = wave_reduce::group_mask(s);
      const float mo = shfl_xor(mx, o), so = shfl_xor(sum, o);
      const float mn = fmaxf(mx, mo);
      sum = sum * fast_exp2(mx - mn) + so * fast_exp2(mo - mn);
      mx = mn;
    }
    sum = valid ? 1.f / sum : 0.f;
    if (clear && !valid) {
#pragma unroll
      for (int j = 0; j < cpt; ++j) *chunk[j] = make_uint4(0u, 0u, 0u, 0u);
      return;
    }
#pragma unroll
    for (int j = 0; j < cpt; ++j) {
      float x[8];
      unpack<E>(*chunk[j], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = fast_exp2(fmaf(x[i], log2_e, -mx)) * sum;
      *chunk[j] = pack<E>(x);
    }
  } else if ((F == feature_map::relu && !clear) || valid) {
#pragma unroll
    for (int j = 0; j < cpt; ++j) {
      const uint4 w = *chunk[j];
      *chunk[j] = make_uint4(feature_pair<F, E>(w.x), feature_pair<F, E>(w.y), feature_pair<F, E>(w.z),
                             feature_pair<F, E>(w.w));
    }
  } else {
#pragma unroll
    for (int j = 0; j < cpt; ++j) *chunk[j] = make_uint4(0u, 0u, 0u, 0u);
  }
}

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
