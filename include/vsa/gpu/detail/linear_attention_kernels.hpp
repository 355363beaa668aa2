// Kernels of the linear-attention branch. Per (batch, kv head) the sequence reduces to a D × D state
// KV = Σ_j φ(k_j) v_jᵀ and a D-vector z = Σ_j φ(k_j); every query then reads o_i = φ(q_i)ᵀKV / (φ(q_i)·z + eps).
//
// Forward, three launches:
//   state         one block per (slice of the sequence, batch, kv head): partial KV, z and Σ v over its
//                 slice, into fp32 workspace records. One warp per 16 rows (d1) of KV: the warp reads the
//                 transposed φ(K) band out of shared memory into a score tile and multiplies it by the V tile
//                 (on Hopper each warpgroup reads its 64 rows of φ(K)ᵀ through a transposed wgmma operand).
//   state_reduce  adds the records of every slice in slice order (so the result never depends on timing) and
//                 stores the state in the form the matrix cores read (below).
//   apply         one block per (slice, batch, q head), one warp per 16 query rows: φ(Q) in registers, one
//                 16 × D × D product per 64 tokens, the state staying in shared memory for the whole slice.
// Backward, four more (after state and state_reduce): query_grad (dq, and per-slice partial dKV, dz from the
// transposed φ(Q) band times dO), grad_reduce (over slices and over the q heads of each group, in a fixed
// order), key_grad (dk, dv). No atomics anywhere: every sum has one owner and one order.
//
// Matrix layer: attention_mma (arch/matrix.hpp), i.e. the wgmma backend in device code for sm_90a and
// warp_mma elsewhere; both give warp w rows 16w … of a 64-row tile in the same element map, so the band
// code below serves both. Launch shapes are taken from warp_mma on the host and the device alike.
//
// Stored form of the state, chosen so that no 16-bit operand can overflow or lose its range, whatever the
// sequence length or the magnitude of v (fp16 included):
//   m = mean of v over the valid tokens; KV̄ = KV − z mᵀ = Σ_j φ(k_j)(v_j − m)ᵀ;
//   σ[d1] = max_d2 |KV̄[d1, d2]|; KVn = KV̄ / σ (rows in [−1, 1]), rounded to the element type.
//   o_i = (φ(q_i)·KV̄ + (φ(q_i)·z) m) / den_i, and φ(q_i)·KV̄ = β_i Σ_d1 P̂[i, d1] KVn[d1, :] with
//   P[i, d1] = φ(q_i)[d1] σ[d1] / den_i and P̂ = P / β_i, β_i = max_d1 P[i, d1] (so P̂ is in [0, 1]).
// Centering on m also keeps the backward accurate when v has a large common mean: the gradient terms
// Σ_j φ(k_j)[d1] dO·(v_j − o_i) are formed from the centered state, never as a difference of two large sums.
#pragma once

#include "../../geometry.hpp"
#include "../../numeric.hpp"
#include "../../types.hpp"
#include "../arch/matrix.hpp"
#include "../arch/wave_reduce.hpp"
#include "attention_schedule.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// Resident blocks each kernel is compiled for (NVIDIA's second launch bound; it caps registers per
// thread at 64K / (threads · blocks)). HIP's second bound means something else, so AMD gets only the first.
#if VSA_PLATFORM_NVIDIA
#define VSA_LINEAR_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#else
#define VSA_LINEAR_BOUNDS(threads, blocks) __launch_bounds__(threads)
#endif

// Copies into shared memory are asynchronous on NVIDIA only; there a second stage lets the next tile stream
// in while the current one is used. AMD's copy is a plain load and store, which a second stage cannot hide.
#if VSA_PLATFORM_NVIDIA
constexpr int copy_stages = 2;
#else
constexpr int copy_stages = 1;
#endif

// Whether the layer reads the transposed operand of a φᵀ·V product straight out of shared memory (tn, the
// wgmma backend). Otherwise each warp gathers its 16-row band of φᵀ element by element into a score tile.
#if VSA_WGMMA
constexpr bool layer_tn = true;
#else
constexpr bool layer_tn = false;
#endif

// Where a block's shared tiles start: on the wgmma backend on a 1024-byte boundary (descriptor reads, see
// smem_tile.hpp), for which Hopper blocks are given smem_slack more bytes (tile_slack, host and device
// agree through the kernel's binary version); elsewhere at the start, with no slack. A macro, so that the
// other backends compile to exactly the code they had (an inline function in between reorders the address
// arithmetic of the copies, seen in the sm_80 PTX).
#if VSA_WGMMA
#define VSA_LINEAR_TILES(raw) aligned_smem(raw)
#else
#define VSA_LINEAR_TILES(raw) reinterpret_cast<uint16_t*>(raw)
#endif
constexpr int tile_slack(bool hopper) { return hopper ? smem_slack : 0; }
// What a Hopper (sm_90) block may opt into; only shared memory that the host adds for Hopper code alone (a
// kernel's smem(true)) may go past max_block_smem.
constexpr int hopper_max_block_smem = 227 * 1024;
// Shared memory of a Hopper SM, and what the system keeps of it for each resident block.
constexpr int hopper_sm_smem = 228 * 1024, hopper_block_reserve = 1024;

// One fp32 record per (slice, head) of the partial sums: a D × D matrix, then two D-vectors.
template <int D> struct record {
  static constexpr int64_t matrix = 0, first = int64_t(D) * D, second = int64_t(D) * D + D;
  static constexpr int64_t floats = int64_t(D) * D + 2 * D;
};

// Warps of the blocks whose warps own rows of a D × D accumulator: enough bands per warp that the
// accumulators take at most 64 fp32 registers a lane (a 16 × D band is D/2 registers on 32-lane warps,
// D/4 on 64-lane wavefronts), and at least four warps.
template <class E, int D> struct band_layout {
  using M = warp_mma<E, D>;
  static constexpr int fit = 64 / M::out_elems > 0 ? 64 / M::out_elems : 1;
  static constexpr int bands = fit < D / 64 ? fit : D / 64; // bands of 16 rows per warp
  static constexpr int warps = D / 16 / bands;
  static constexpr int threads = warps * M::threads;
  static_assert(warps >= 4, "the query gradient kernel gives 16 rows of a 64-row tile to each of four warps");
};

// The tokens of one head in chunks of 64: tiles in tiled order (the last slots of a partial tile are
// padding), consecutive runs of 64 tokens in raster order (the last one may be short).
struct sequence {
  tile_geometry geo{grid3{}};
  int64_t tokens; // S
  int64_t chunks; // ⌈S / 64⌉
  int tiled;
  __device__ __forceinline__ int valid(int64_t c) const {
    if (tiled) return geo.valid(c);
    const int64_t rest = tokens - c * 64;
    return rest < 64 ? static_cast<int>(rest) : 64;
  }
};

// Units [begin, end) of slice `slice` of `slices` over `units`, as even as integers allow.
__device__ __forceinline__ void slice_range(int64_t slice, int64_t slices, int64_t units, int64_t& begin,
                                            int64_t& end) {
  begin = slice * units / slices;
  end = (slice + 1) * units / slices;
}

template <class E> __device__ __forceinline__ void unpack(const uint4& x, float (&f)[8]) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = E::to_float(static_cast<uint16_t>(w[i] & 0xffffu));
    f[2 * i + 1] = E::to_float(static_cast<uint16_t>(w[i] >> 16));
  }
}
template <class E> __device__ __forceinline__ uint4 pack(const float (&f)[8]) {
  return make_uint4(E::pack(f[0], f[1]), E::pack(f[2], f[3]), E::pack(f[4], f[5]), E::pack(f[6], f[7]));
}

// Maximum over the D threads of a block (D a multiple of the warp size); every thread gets it. `scratch`
// holds D / warp_size floats of shared memory. The lane pattern is wave_reduce's (replayed on the host for
// both warp sizes by tests/cpu/test_wave_reduce.cpp): a whole-warp butterfly, then one partial per warp.
template <int D> __device__ __forceinline__ float block_max(float v, float* scratch) {
  constexpr int warps = wave_reduce::block_warps(D, warp_size);
  static_assert(wave_reduce::block_whole_warps(D, warp_size), "block_max needs whole warps");
#pragma unroll
  for (int s = 0; s < wave_reduce::warp_steps(warp_size); ++s)
    v = fmaxf(v, shfl_xor(v, wave_reduce::warp_mask(warp_size, s)));
  if (warps == 1) return v;
  if (wave_reduce::block_slot_writer(threadIdx.x, warp_size))
    scratch[wave_reduce::block_slot(threadIdx.x, warp_size)] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < warps; ++w) r = fmaxf(r, scratch[w]);
  __syncthreads(); // scratch is reused by the next call
  return r;
}

// ---- score tiles as D-wide row bands --------------------------------------------------------------------
// A 16 × D band of a [64, D] shared tile is held as D / 64 score tiles (columns c·64 ...). Only the layer's
// element map (elem_row, elem_col, elem_slot) and its row reductions are used, so this code runs unchanged
// on every matrix backend. Like the attention kernels' epilogues, it relies on elements e and e + 1 (e even)
// being adjacent columns of one row, and moves them as one 32-bit word.

template <class E, int D, int T>
__device__ __forceinline__ void load_band(typename warp_mma<E, D>::score_tile (&x)[T], smem_tile<D> t, int row0) {
  using M = warp_mma<E, D>;
#pragma unroll
  for (int c = 0; c < T; ++c)
#pragma unroll
    for (int e = 0; e < M::score_elems; e += 2) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(t.at(row0 + M::elem_row(e), c * 64 + M::elem_col(e)));
      x[c].x[e] = E::to_float(static_cast<uint16_t>(w & 0xffffu));
      x[c].x[e + 1] = E::to_float(static_cast<uint16_t>(w >> 16));
    }
}

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

// Per-column factors (z, m, σ, ...) of the even column `col` and the next, which a lane's elements e, e + 1
// (e even) always pair: one 8-byte load instead of two.
__device__ __forceinline__ float2 column_pair(const float* v, int col) {
  return *reinterpret_cast<const float2*>(v + col);
}

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

// Writes a 16 × D fp32 band into rows row0 … of a shared tile, rounded to E. Adjacent elements e, e + 1
// of the layer are adjacent columns of one row, so pairs go out as one 32-bit store.
template <class E, int D>
__device__ __forceinline__ void store_band(const typename warp_mma<E, D>::out_tile& o, smem_tile<D> t, int row0) {
  using M = warp_mma<E, D>;
#pragma unroll
  for (int e = 0; e < M::out_elems; e += 2)
    *reinterpret_cast<uint32_t*>(t.at(row0 + M::elem_row(e), M::elem_col(e))) = E::pack(o.x[e], o.x[e + 1]);
}

// Copies the 64 rows of a shared tile to global memory in 16-byte vectors: rows below `valid`, and zeros in
// the rows from `valid` to `rows_out` (the padding slots of a tiled tensor; rows_out = valid in raster
// order, whose short last chunk has no rows beyond the sequence).
template <int D> __device__ __forceinline__ void store_tile(uint16_t* dst, int64_t row_stride, smem_tile<D> t,
                                                            int valid, int rows_out, int tid, int nthreads) {
  constexpr int chunks = smem_tile<D>::chunks;
  for (int i = tid; i < rows_out * chunks; i += nthreads) {
    const int r = i / chunks, c = i % chunks;
    const uint4 v = r < valid ? *reinterpret_cast<const uint4*>(t.chunk(r, c)) : make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(dst + r * row_stride + c * 8) = v;
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
// cores take z and Σ v (warpgroup_mma::tn_sums). Hopper keeps three stages (96 KiB of tiles at D = 128,
// still two blocks an SM): the next two tiles stream in while one is used, which the copy engine's latency
// needs at two blocks an SM; elsewhere the stages the platform's copy allows.
template <class E, int D> struct state_shape {
  using L = band_layout<E, D>;
  static constexpr int threads = L::threads;
  static constexpr int ones_bytes = 1024; // warpgroup_mma::ones_bytes, which host code cannot name
  static constexpr int stages(bool hopper) {
    return hopper && 3 * 2 * smem_tile<D>::bytes + ones_bytes + smem_slack <= max_block_smem ? 3 : copy_stages;
  }
  static constexpr int tiles(bool hopper) { return 2 * stages(hopper) * smem_tile<D>::bytes; }
  static constexpr int smem(bool hopper) { return tiles(hopper) + (hopper ? ones_bytes : 0) + tile_slack(hopper); }
  static_assert(smem(true) <= max_block_smem, "state tiles do not fit");
  static_assert((threads / (D / 8)) * D * 4 <= tiles(false), "Σ v scratch does not fit");
};

template <class E, int D, feature_map F>
__global__ void VSA_LINEAR_BOUNDS((band_layout<E, D>::threads), (D == 128 ? 2 : 3))
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

#if VSA_WGMMA
  // The copy engine (hopper_tma.hpp): thread 0 asks for both tiles of a stage, counted on that stage's
  // barrier, so a thread's whole copy work is one wait a tile.
  static_assert(stages == 3, "the barriers' phases follow the ring of three stages");
  __shared__ __align__(8) uint64_t ready[stages];
  const bool tma = p.tma != 0;
  tma::init_barriers(ready, stages, tma, tid);
  // The ones of the column sums, after the tiles (whole KiB from a 1024-byte boundary, so the block is one
  // swizzle atom). Written once; the fence and the loop's first barrier order them before the first product.
  static_assert(M::ones_bytes == state_shape<E, D>::ones_bytes && M::ones_bytes / 16 <= nthreads, "block of ones");
  uint16_t* ones = sm + 2 * stages * 64 * D;
  if (tid < M::ones_bytes / 16) {
    const uint32_t one = E::pack(1.f, 1.f);
    reinterpret_cast<uint4*>(ones)[tid] = make_uint4(one, one, one, one);
  }
  stores_to_matrix_fence();
#else
  constexpr bool tma = false;
#endif

  const auto load = [&](int64_t c, int buf) {
#if VSA_WGMMA
    if (tma) {
      if (tid == 0) tma::tile_pair{&ready[buf], 0u}.load<D>(sk(buf), &p.k_map, sv(buf), &p.v_map, c * 64, hk, b);
      return;
    }
#endif
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
#if VSA_WGMMA
  typename M::sum_tile zsum{}, vsum{}; // z and Σ v of this warp's 16 rows (tn_sums)
#endif
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
#if VSA_WGMMA
      tma::wait(&ready[buf], phase);
#endif
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
#if VSA_WGMMA
      if (tma && valid < tile_rows) tma::zero_rows<D>(vt, valid, tid, nthreads);
#endif
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
#if VSA_WGMMA
      M::tn_sums(acc[0], zsum, vsum, kt, warp / 4, vt, ones);
#endif
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
#if VSA_WGMMA
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
#endif
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

// ---- forward: reduced state ------------------------------------------------------------------------------------

// The state of one kv head as the apply and gradient kernels read it.
struct state_view {
  uint16_t* kvn; // [heads_total, D, D] KVn
  float* vec;    // [heads_total, 3, D]: z, m, σ
};

struct state_reduce_params {
  const float* partial;
  int64_t slices, heads_total;
  float inv_count; // 1 / number of valid tokens
  state_view state;
};

// One block per (head, row d1 of the state), one thread per column d2: the block adds its row of every
// slice's record, z[d1] and Σ v in slice order. The slice loop is unrolled, so that the loads of several
// slices are in flight at once while the additions keep their order; with four rows a block and one load in
// flight a thread the kernel was bound by the latency of its loads (22 µs on wan2.1 for ~17 MB of records).
// Every block adds Σ v for m itself (its sum is the same in every block: same values, same order).
template <class E, int D> __global__ void __launch_bounds__(D) state_reduce_kernel(state_reduce_params p) {
  __shared__ float scratch[D / warp_size > 0 ? D / warp_size : 1];
  // Launched with overlap (runtime.hpp: launch): the records are the state kernel's.
  grid_dependents_launch();
  grid_dependency_wait();
  const int t = threadIdx.x;
  const int64_t bh = blockIdx.x / D;
  const int d1 = static_cast<int>(blockIdx.x % D);
  const float* base = p.partial + bh * record<D>::floats;
  const int64_t step = p.heads_total * record<D>::floats;

  float vs = 0.f, kv = 0.f, z = 0.f;
#pragma unroll 8
  for (int64_t s = 0; s < p.slices; ++s) {
    const float* r = base + s * step;
    vs += r[record<D>::second + t];
    kv += r[d1 * D + t];
    z += r[record<D>::first + d1];
  }
  const float m = vs * p.inv_count;
  float* vec = p.state.vec + bh * 3 * D;
  if (d1 == 0) vec[D + t] = m;
  const float centered = kv - z * m;
  const float sigma = block_max<D>(fabsf(centered), scratch);
  p.state.kvn[(bh * D + d1) * D + t] = E::from_float(sigma > 0.f ? centered / sigma : 0.f);
  if (t == 0) {
    vec[d1] = z;
    vec[2 * D + d1] = sigma;
  }
}

// ---- forward: apply -----------------------------------------------------------------------------------------

struct apply_params {
  operand q, o;
  sequence seq;
  int64_t q_heads, group, slices;
  const uint16_t* kvn; // state_view::kvn
  const float* vec;    // state_view::vec
  float eps;
  // Hopper: Q in and O out through the copy engine where the host could encode both maps (tma = 1,
  // hopper_tma.hpp); otherwise, and everywhere else, copy_tile and store_tile.
  int tma;
  tma_map q_map, o_map;
};

// Shared memory: D / 64 tiles of KVn, the Q tiles, then the per-column factors of the state, by pairs of
// columns (the pair a lane's elements e, e + 1 form): {z, z, σ, σ} as one float4 and {m, m} as one float2.
// Elsewhere the Q tiles are copy_stages stages. On Hopper they are a ring in which Q and O take turns: Q(c)
// lands in a ring tile, each warp overwrites its rows with O(c), and the copy engine stores the tile from
// there; the tile is asked for again once that store has read it.
// The kernel is bound by latency, not by bytes: at two blocks of four warps an SM a scheduler found an eligible
// warp in about half of its cycles, and a ring of four tiles (three Q tiles in flight) was no faster than one
// Q tile in flight. So Hopper code at D = 128 runs three blocks an SM (168 registers, no spill) with a ring of
// two, which is what three blocks' shared memory leaves room for.
template <class E, int D> struct apply_shape {
  static constexpr int threads = 4 * warp_mma<E, D>::threads;
  static constexpr int factors = (D / 2) * (16 + 8);
  static constexpr int blocks(bool hopper) { return D == 128 ? (hopper ? 3 : 2) : 4; }
  // The largest ring (at most four tiles) with which a block fits and blocks(true) blocks fit in an SM's shared
  // memory; none where the block would not fit (AMD's 64 KiB).
  static constexpr int ring(bool hopper) {
    for (int r = 4; hopper && r >= 2; --r) {
      const int block = (D / 64 + r) * smem_tile<D>::bytes + factors + smem_slack;
      if (block <= max_block_smem && blocks(true) * (block + hopper_block_reserve) <= hopper_sm_smem) return r;
    }
    return 0;
  }
  static constexpr int q_tiles(bool hopper) { return ring(hopper) ? ring(hopper) : copy_stages; }
  static constexpr int tiles(bool hopper) { return (D / 64 + q_tiles(hopper)) * smem_tile<D>::bytes; }
  static constexpr int smem(bool hopper) { return tiles(hopper) + factors + tile_slack(hopper); }
  static_assert(smem(true) <= max_block_smem, "apply tiles do not fit");
  static_assert(threads >= D / 2, "one thread per column pair fills the factors");
};

// store_band for the copy engine's store of a whole tile: rows at and past `valid` are written 0 (padding
// slots of a tiled tensor are written 0; in raster order those rows lie past the sequence, where the store
// does not write).
template <class E, int D> __device__ __forceinline__ void store_band_rows(const typename warp_mma<E, D>::out_tile& o,
                                                                          smem_tile<D> t, int row0, int valid) {
  using M = warp_mma<E, D>;
#pragma unroll
  for (int e = 0; e < M::out_elems; e += 2) {
    const int row = row0 + M::elem_row(e);
    *reinterpret_cast<uint32_t*>(t.at(row, M::elem_col(e))) = row < valid ? E::pack(o.x[e], o.x[e + 1]) : 0u;
  }
}

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

// One warp's 16 rows of an output tile, from its rows of the Q tile qt: with a = φ(q_i) (for softmax the
// unnormalized exponentials e and the row's scale 1 / Σ e, a = e · scale), den = a·z + eps and w = e σ,
//   P̂ = w / max_d1 w,   β = max_d1 w · scale / den,   o_i = β (P̂ · KVn) + m (a·z) / den,
// which is the module comment's P / β with den (and softmax's normalization) cancelled out of P̂.
// The per-column factors are read from shared memory, a pair of columns a load.
template <class E, int D, feature_map F>
__device__ __forceinline__ void apply_band(typename attention_mma<E, D>::out_tile& o, smem_tile<D> qt, int row0,
                                           uint16_t* kvn, const float4* zsigma, const float2* mean, float eps) {
  using M = attention_mma<E, D>;
  constexpr int R = M::rows_per_lane, T = D / 64;
  typename M::score_tile x[T];
  load_band<E, D, T>(x, qt, row0);
  float scale[R], az[R], wmax[R];
  feature_band_scaled<F, false, E, D, T>(x, scale);
#pragma unroll
  for (int r = 0; r < R; ++r) az[r] = 0.f, wmax[r] = 0.f;
#pragma unroll
  for (int cc = 0; cc < T; ++cc)
#pragma unroll
    for (int e = 0; e < M::score_elems; e += 2) {
      const float4 f = zsigma[(cc * 64 + M::elem_col(e)) / 2];
      const int sl = M::elem_slot(e);
      az[sl] = fmaf(x[cc].x[e], f.x, fmaf(x[cc].x[e + 1], f.y, az[sl]));
      x[cc].x[e] *= f.z;
      x[cc].x[e + 1] *= f.w;
      wmax[sl] = fmaxf(wmax[sl], fmaxf(x[cc].x[e], x[cc].x[e + 1]));
    }
  float beta[R], mix[R], inv_wmax[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    az[r] = M::row_sum(az[r]) * scale[r];
    const float inv_den = 1.f / (az[r] + eps);
    wmax[r] = M::row_max(wmax[r]);
    inv_wmax[r] = wmax[r] > 0.f ? 1.f / wmax[r] : 0.f;
    beta[r] = wmax[r] * scale[r] * inv_den;
    mix[r] = az[r] * inv_den;
  }
#pragma unroll
  for (int cc = 0; cc < T; ++cc)
#pragma unroll
    for (int e = 0; e < M::score_elems; ++e) x[cc].x[e] *= inv_wmax[M::elem_slot(e)];
#pragma unroll
  for (int e = 0; e < M::out_elems; ++e) o.x[e] = 0.f;
#pragma unroll
  for (int cc = 0; cc < T; ++cc) M::nn(o, x[cc], smem_tile<D>{kvn + cc * 64 * D});
#pragma unroll
  for (int e = 0; e < M::out_elems; e += 2) {
    const int s = M::elem_slot(e);
    const float2 m = mean[M::elem_col(e) / 2];
    o.x[e] = fmaf(beta[s], o.x[e], m.x * mix[s]);
    o.x[e + 1] = fmaf(beta[s], o.x[e + 1], m.y * mix[s]);
  }
}

// One block per (slice, batch, q head): KVn (D/64 tiles of 64 rows d1, the k axis of nn) and the column
// factors stay in shared memory for the slice; each warp takes 16 rows of every Q tile (apply_band).
template <class E, int D, feature_map F>
__global__ void VSA_LINEAR_BOUNDS((apply_shape<E, D>::threads), (apply_shape<E, D>::blocks(layer_tn)))
    apply_kernel(const VSA_GRID_CONSTANT apply_params p) {
  using M = attention_mma<E, D>;
  constexpr int nthreads = apply_shape<E, D>::threads;
  constexpr int T = D / 64;
  constexpr int stages = copy_stages;

  // KVn is copied once with cp.async in the tile layout and fenced by copy_wait, so wgmma reads it as nn's B
  // as it stands.
  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = VSA_LINEAR_TILES(smem_raw);
  const auto sq = [&](int buf) { return smem_tile<D>{sm + (T + buf) * 64 * D}; };
  float4* zsigma = reinterpret_cast<float4*>(sm + (T + apply_shape<E, D>::q_tiles(layer_tn)) * 64 * D);
  float2* mean = reinterpret_cast<float2*>(zsigma + D / 2);

  const int64_t slice = blockIdx.x % p.slices, bh = blockIdx.x / p.slices;
  const int64_t b = bh / p.q_heads, h = bh % p.q_heads;
  const int64_t bhk = b * (p.q_heads / p.group) + h / p.group;
  const int tid = threadIdx.x, row0 = (tid / M::threads) * 16;
  int64_t begin, end;
  slice_range(slice, p.slices, p.seq.chunks, begin, end);
  if (begin >= end) return;

#if VSA_WGMMA
  // The copy engine (hopper_tma.hpp): thread 0 asks for each Q tile (one barrier a ring tile) and stores each
  // O tile from the same ring tile; the block's copy work is then one wait a tile, and O leaves without a
  // pass of 16-byte loads and stores through every thread.
  constexpr int ring = apply_shape<E, D>::ring(layer_tn);
  static_assert(ring >= 2, "a ring of two Q/O tiles at least");
  __shared__ __align__(8) uint64_t ready[ring];
  const bool tma = p.tma != 0;
  tma::init_barriers(ready, ring, tma, tid);
  // Padding rows come as they are in memory: each output row depends on its own query row alone (φ, the row
  // factors and the product are row by row), and rows at and past `valid` are written 0.
  const auto load_ring = [&](int64_t c) {
    const int buf = static_cast<int>((c - begin) % ring);
    tma::tile_one{&ready[buf], 0u}.load<D>(sq(buf), &p.q_map, c * 64, h, b);
  };
  if (tma && tid == 0)
    for (int64_t c = begin; c < end && c < begin + ring; ++c) load_ring(c);
#endif
  // Launched with overlap (runtime.hpp: launch): the first Q tiles, an input of the call, are on their way while
  // the state is reduced; the state and every write wait for the reduction.
  grid_dependency_wait();
  const auto load_q = [&](int64_t c, int buf) {
    copy_tile(sq(buf), p.q.tile(b, h, c), p.q.token, p.seq.valid(c), tid, nthreads);
  };

#pragma unroll
  for (int c = 0; c < T; ++c)
    copy_tile(smem_tile<D>{sm + c * 64 * D}, p.kvn + (bhk * D + c * 64) * D, D, 64, tid, nthreads);
#if VSA_WGMMA
  if (!tma)
#endif
    load_q(begin, 0);
  copy_commit();
  if (tid < D / 2) { // ordered before the first use by the first barrier below
    const float* vec = p.vec + bhk * 3 * D + 2 * tid;
    const float2 z = *reinterpret_cast<const float2*>(vec), m = *reinterpret_cast<const float2*>(vec + D),
                 sigma = *reinterpret_cast<const float2*>(vec + 2 * D);
    zsigma[tid] = make_float4(z.x, z.y, sigma.x, sigma.y);
    mean[tid] = m;
  }

#if VSA_WGMMA
  if (tma) {
    copy_wait<0>(); // KVn
    __syncthreads();
    for (int64_t c = begin; c < end; ++c) {
      const int buf = static_cast<int>((c - begin) % ring);
      // The ring tile of the previous tile receives Q(c − 1 + ring) once O(c − 1)'s store has read it.
      if (tid == 0 && c > begin && c - 1 + ring < end) {
        tma::store_wait_read<0>();
        load_ring(c - 1 + ring);
      }
      // Q(c) on the barrier of its ring tile, in that barrier's phase (c − begin) / ring.
      tma::wait(&ready[buf], static_cast<uint32_t>((c - begin) / ring) & 1u);
      const int valid = p.seq.valid(c);
      typename M::out_tile o;
      apply_band<E, D, F>(o, sq(buf), row0, sm, zsigma, mean, p.eps);
      // O over the warp's own rows of Q (read by every lane of the warp: the row sums' shuffles needed all of
      // them), fenced for the copy engine's reads; the fence also orders this thread's reads of Q before the
      // copy engine refills the tile.
      __syncwarp();
      if (valid < tile_rows)
        store_band_rows<E, D>(o, sq(buf), row0, valid);
      else
        store_band<E, D>(o, sq(buf), row0);
      stores_to_matrix_fence();
      __syncthreads();
      if (tid == 0) tma::store_tile<D>(&p.o_map, sq(buf), c * 64, h, b);
    }
    if (tid == 0) tma::store_wait<0>(); // the block's shared memory must outlast the last stores
    return;
  }
#endif
  for (int64_t c = begin; c < end; ++c) {
    const int buf = stages == 2 ? static_cast<int>((c - begin) & 1) : 0;
    copy_wait<0>(); // KVn, and Q
    __syncthreads();
    if (stages == 2 && c + 1 < end) load_q(c + 1, buf ^ 1);
    copy_commit();
    const int valid = p.seq.valid(c);
    typename M::out_tile o;
    apply_band<E, D, F>(o, sq(buf), row0, sm, zsigma, mean, p.eps);
    __syncthreads(); // the band's rows of Q are read; the stage now receives O
    store_band<E, D>(o, sq(buf), row0);
    __syncthreads();
    store_tile<D>(p.o.tile(b, h, c), p.o.token, sq(buf), valid, p.seq.tiled ? 64 : valid, tid, nthreads);
    if (stages == 1 && c + 1 < end) {
      __syncthreads();
      copy_tile(sq(0), p.q.tile(b, h, c + 1), p.q.token, p.seq.valid(c + 1), tid, nthreads);
      copy_commit();
    }
  }
}

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

// Blocks of query_grad an SM is compiled for at D = 128 on the wgmma backend (elsewhere one at D = 128, two at
// D = 64). Two need registers capped at 128 a thread (256 threads), with the 64 of the dKV accumulator live
// throughout; shared memory allows two (2 × ~101 KiB of the 228 KiB). Measured on the H200 (wan2.1, bf16,
// elu+1): two blocks spill 64-112 B a thread inside the tile loop (165 MB of local loads a call) and the
// backward took 534 µs; one block, no spills, 520 µs. So one is the default (bench/NOTES-linear.md). Two
// blocks leave no room for the copy engine's stages, so that build keeps the cp.async loop.
#ifndef VSA_QUERY_GRAD_HOPPER_BLOCKS
#define VSA_QUERY_GRAD_HOPPER_BLOCKS 1
#endif
constexpr int query_grad_hopper_blocks = VSA_QUERY_GRAD_HOPPER_BLOCKS;

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
  // kernel is compiled for still fit (D = 128: 166 KiB at one block; D = 64: 77 KiB at two).
  static constexpr int tma_stages = 3, dq_stages = 2;
  static constexpr int tma_extra = (exchange_offset + exchange_floats * 4 + 1023) / 1024 * 1024;
  static constexpr int tma_bytes =
      tma_extra + (2 * (tma_stages - stages) + dq_stages) * smem_tile<D>::bytes + smem_slack;
  static constexpr int hopper_blocks = D == 128 ? query_grad_hopper_blocks : 2;
  static constexpr bool tma = stages == 2 && factors_in_smem && tma_bytes <= hopper_max_block_smem &&
                              hopper_blocks * (tma_bytes + hopper_block_reserve) <= hopper_sm_smem;
  static constexpr int smem(bool hopper) {
    return hopper && tma ? tma_bytes : exchange_offset + exchange_bytes(hopper) + tile_slack(hopper);
  }
  static_assert(smem(false) <= max_block_smem, "query-gradient tiles do not fit");
  static_assert(smem(true) <= hopper_max_block_smem, "query-gradient tiles do not fit (Hopper)");
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
// registers of a whole row. On Hopper with the maps of Q, dO and dq, query_grad_tma (above) runs the tiles
// instead, through the copy engine; the loop below is the fallback, and the code of every other target.
template <class E, int D, feature_map F> __global__ void
VSA_LINEAR_BOUNDS((band_layout<E, D>::threads), (D == 128 ? (layer_tn ? query_grad_hopper_blocks : 1) : 2))
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
  constexpr bool phi_in_smem = split && query_grad_hopper_blocks == 2;
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

#if VSA_WGMMA
  if constexpr (query_grad_shape<E, D>::tma) {
    if (p.tma != 0) {
      query_grad_tma<E, D, F>(p, sm, z, m, sigma, slice, bh, b, h, bhk, begin, end);
      return;
    }
  }
#endif

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

// ---- backward: reduced state gradient ---------------------------------------------------------------------

// Gradient of the state of one kv head, summed over its group: dKVn = dKV / σ' (σ'[d1] = max_d2 |dKV|),
// rounded to E, and the fp32 vectors dz̄, σ'.
struct grad_view {
  uint16_t* kvn; // [batch · kv_heads, D, D]
  float* vec;    // [batch · kv_heads, 2, D]: dz̄, σ'
};

struct grad_reduce_params {
  const float* partial; // query_grad records
  int64_t slices, q_heads, kv_heads, group;
  int64_t heads_total; // batch · q_heads (the records' head count)
  const float* state_vec;
  grad_view grad;
};

// One block per (kv head, row d1 of the gradient), one thread per column d2: the block adds its row of the
// records of every q head of the group and every slice, in that order (q head, then slice), as grad_reduce
// always has. The slice loop is unrolled, so that the loads of several records are in flight at once while the
// additions keep their order; with four rows a block and one load in flight a thread the kernel was bound by
// the latency of its loads (25 µs on wan2.1 for ~9 MB of records, 12% of issue slots used), as state_reduce
// was.
template <class E, int D> __global__ void __launch_bounds__(D) grad_reduce_kernel(grad_reduce_params p) {
  __shared__ float scratch[D / warp_size > 0 ? D / warp_size : 1];
  // Launched with overlap (runtime.hpp: launch): the records are query_grad's.
  grid_dependents_launch();
  grid_dependency_wait();
  const int t = threadIdx.x;
  const int64_t bhk = blockIdx.x / D;
  const int d1 = static_cast<int>(blockIdx.x % D);
  const int64_t b = bhk / p.kv_heads, hk = bhk % p.kv_heads;
  const int64_t step = p.heads_total * record<D>::floats;
  const float* z = p.state_vec + bhk * 3 * D;
  float* vec = p.grad.vec + bhk * 2 * D;
  float dkv = 0.f, dz = 0.f;
  for (int64_t g = 0; g < p.group; ++g) {
    const float* base = p.partial + (b * p.q_heads + hk * p.group + g) * record<D>::floats;
#pragma unroll 8
    for (int64_t s = 0; s < p.slices; ++s) {
      const float* r = base + s * step;
      dkv += r[d1 * D + t];
      dz += r[record<D>::first + d1];
    }
  }
  // A channel that no key reaches (z = 0: relu only) has φ(k_j)[d1] = 0 and φ'(k_j)[d1] = 0 for every key, so
  // its row of the gradient is never used; it is stored as 0.
  const float unscale = z[d1] > 0.f ? 1.f / z[d1] : 0.f;
  dkv *= unscale;
  const float sigma = block_max<D>(fabsf(dkv), scratch);
  p.grad.kvn[(bhk * D + d1) * D + t] = E::from_float(sigma > 0.f ? dkv / sigma : 0.f);
  if (t == 0) {
    vec[d1] = dz * unscale;
    vec[D + d1] = sigma;
  }
}

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

// dv_j = Σ_d1 φ(k_j)[d1] dKV[d1, :] = β_j Σ_d1 P̂[j, d1] dKVn[d1, :] (P = φ(k_j) σ', P̂ = P / β_j), and
// dk_j = φ'(k_j)ᵀ db_j with db_j[d1] = σ'[d1] (dKVn (v_j − m))[d1] + dz̄[d1].
// Every output row depends on its own rows of k and v alone, so a warp needs no other warp's rows: on
// Hopper with the copy engine (key_grad_tma below) the tile loop meets at one block barrier a tile.
template <class E, int D, feature_map F>
__global__ void VSA_LINEAR_BOUNDS((key_grad_shape<E, D>::threads), (D == 128 ? 2 : 3))
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
