// Stage 2 on the GPU: the mean of each tile's valid tokens, for q, k and v in one launch. Each block
// reduces one (tensor, batch, head, tile): 64 rows of D elements, read as 16-byte vectors by row groups
// of threads, summed in fp32, the groups' partial sums then added through shared memory. Padding slots
// are never read. The grid walks the heads of a tile before the next tile, so that neighbouring blocks
// read neighbouring memory in the [B, S, H, D] layout.
//
// From raster order (block_means_tiling), the same pass also writes the tiled copies the sparse kernels read:
// it reads every token once anyway, so the tile pass that would otherwise precede it costs only its writes. The
// gate rides along as a fourth tensor that is copied and not averaged.
#pragma once

#include "../geometry.hpp"
#include "../validate.hpp"
#include "primitives.hpp"

namespace vsa {
namespace gpu {
namespace detail {

inline constexpr int tile_row_threads = 128;

// Thread layout of a block that reads the rows of one tile of one head: `vectors` threads across a row,
// `groups` rows at a time, each thread covering `rows_per_thread` rows.
template <int D> struct tile_row_layout {
  static constexpr int vectors = D / 8;
  static constexpr int groups = tile_row_threads / vectors;
  static constexpr int rows_per_thread = tile_tokens / groups;
  static_assert(tile_row_threads % vectors == 0 && tile_tokens % groups == 0, "rows must split evenly");
};

// Adds the groups' partial row sums: on return, thread t < D holds the column sum of element t. `partial`
// is [groups][D] in shared memory; the caller syncs before reusing it.
template <int D>
__device__ __forceinline__ float sum_row_groups(const float (&mine)[8], float (*partial)[D], int group, int vec) {
  float4* out = reinterpret_cast<float4*>(&partial[group][vec * 8]);
  out[0] = make_float4(mine[0], mine[1], mine[2], mine[3]);
  out[1] = make_float4(mine[4], mine[5], mine[6], mine[7]);
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x < D) {
#pragma unroll
    for (int g = 0; g < tile_row_layout<D>::groups; ++g) total += partial[g][threadIdx.x];
  }
  return total;
}

struct means_source {
  vector_view<const uint4> x;
  uint16_t* out;  // [B, heads, N, D]
  float* out_f32; // optional [B, heads, N, D]: the same means unrounded
  int64_t heads;
};

struct means_params {
  means_source q, k, v;
  int64_t batch;
};

// The tiles of a packed batch (packed_attention.hpp): valid counts from its tile table, {first row, valid} a tile.
struct packed_tiles {
  const int2* table;
  int64_t tiles;
  __host__ __device__ __forceinline__ int64_t num_tiles() const { return tiles; }
  __device__ __forceinline__ int valid(int64_t t) const { return table[t].y; }
};

// Field by field: selecting whole parameter structs, or taking their address, makes compilers copy the
// kernel parameters to scratch memory.
__device__ __forceinline__ means_source pick(const means_params& p, bool is_q, bool is_k) {
  means_source s;
  s.x.data = is_q ? p.q.x.data : (is_k ? p.k.x.data : p.v.x.data);
  s.x.batch_stride = is_q ? p.q.x.batch_stride : (is_k ? p.k.x.batch_stride : p.v.x.batch_stride);
  s.x.token_stride = is_q ? p.q.x.token_stride : (is_k ? p.k.x.token_stride : p.v.x.token_stride);
  s.x.head_stride = is_q ? p.q.x.head_stride : (is_k ? p.k.x.head_stride : p.v.x.head_stride);
  s.out = is_q ? p.q.out : (is_k ? p.k.out : p.v.out);
  s.out_f32 = is_q ? p.q.out_f32 : (is_k ? p.k.out_f32 : p.v.out_f32);
  s.heads = is_q ? p.q.heads : (is_k ? p.k.heads : p.v.heads);
  return s;
}

// The mean of one tile's rows `raw` (loaded by this thread: rows group + r·groups, zeros past the valid count) into
// src's means at (b, h, n). Every thread of the block calls it.
template <class E, int D>
__device__ __forceinline__ void store_tile_mean(const uint4 (&raw)[tile_row_layout<D>::rows_per_thread],
                                                const means_source& src, float (*partial)[D], int64_t b, int64_t h,
                                                int64_t n, int64_t tiles, int valid, int group, int vec) {
  float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int r = 0; r < tile_row_layout<D>::rows_per_thread; ++r) {
    float f[8];
    unpack8<E>(raw[r], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) sum[e] += f[e];
  }
  const float total = sum_row_groups<D>(sum, partial, group, vec);
  if (threadIdx.x < D) {
    const int64_t at = ((b * src.heads + h) * tiles + n) * D + threadIdx.x;
    const float mean = total / static_cast<float>(valid);
    src.out[at] = E::from_float(mean);
    if (src.out_f32 != nullptr) src.out_f32[at] = mean;
  }
  __syncthreads(); // partial is rewritten by the next item
}

// Tiles: where each tile's valid count comes from, tile_geometry (one grid) or packed_tiles (a packed batch's table).
template <class E, int D, class Tiles> __global__ void __launch_bounds__(tile_row_threads)
    block_means_kernel(means_params p, Tiles geo) {
  using L = tile_row_layout<D>;
  __shared__ __align__(16) float partial[L::groups][D];
  const int64_t tiles = geo.num_tiles();
  const int64_t slots = p.q.heads + p.k.heads + p.v.heads;
  const int64_t items = p.batch * tiles * slots;
  const int group = threadIdx.x / L::vectors, vec = threadIdx.x % L::vectors;

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    int64_t h = item % slots;
    const int64_t n = (item / slots) % tiles, b = item / slots / tiles;
    const bool is_q = h < p.q.heads, is_k = !is_q && h < p.q.heads + p.k.heads;
    h -= is_q ? 0 : (is_k ? p.q.heads : p.q.heads + p.k.heads);
    const means_source src = pick(p, is_q, is_k);
    const int valid = geo.valid(n);
    const uint4* row0 = src.x.row(b, n * tile_tokens, h) + vec;

    // All loads first, so that a thread has its rows in flight together.
    uint4 raw[L::rows_per_thread];
#pragma unroll
    for (int r = 0; r < L::rows_per_thread; ++r) {
      const int row = group + r * L::groups;
      raw[r] = row < valid ? row0[row * src.x.token_stride] : make_uint4(0u, 0u, 0u, 0u);
    }
    store_tile_mean<E, D>(raw, src, partial, b, h, n, tiles, valid, group, vec);
  }
}

// From raster order (block_means_tiling), one tensor a launch: a tile's valid tokens of one head read at their raster
// rows, all 64 slots of its tiled copy written (padding zero, as tile() writes them), and the tile's mean where
// src.out is set (the gate is copied only). One tensor a launch, not the three-way pick above: with the copies' views
// beside the sources', that selection spilled scalar registers on CDNA (amd-isa-check).
template <class E, int D> __global__ void __launch_bounds__(tile_row_threads)
    block_means_tiling_kernel(means_source src, vector_view<uint4> tiled, tile_geometry geo, int64_t batch) {
  using L = tile_row_layout<D>;
  __shared__ __align__(16) float partial[L::groups][D];
  const int64_t tiles = geo.num_tiles();
  const int64_t items = batch * tiles * src.heads;
  const int group = threadIdx.x / L::vectors, vec = threadIdx.x % L::vectors;

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t h = item % src.heads, n = (item / src.heads) % tiles, b = item / src.heads / tiles;
    const int valid = geo.valid(n);
    const raster_rows tokens = geo.raster_rows_of(n);
    uint4 raw[L::rows_per_thread];
#pragma unroll
    for (int r = 0; r < L::rows_per_thread; ++r) {
      const int row = group + r * L::groups;
      raw[r] = row < valid ? src.x.row(b, tokens.token(row), h)[vec] : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int r = 0; r < L::rows_per_thread; ++r) tiled.row(b, n * tile_tokens + group + r * L::groups, h)[vec] = raw[r];
    if (src.out != nullptr) store_tile_mean<E, D>(raw, src, partial, b, h, n, tiles, valid, group, vec);
  }
}

} // namespace detail
} // namespace gpu

namespace detail {

// The kernel over the tiles of `geo` (tile_geometry or gpu::detail::packed_tiles), the arguments checked.
template <class Tiles> status launch_block_means(const problem& p, const Tiles& geo, const_tensor q, const_tensor k,
                                                 const_tensor v, void* q_c, void* k_c, void* v_c, float* q_c_f32,
                                                 float* k_c_f32, gpu::stream_t stream) {
  namespace gd = gpu::detail;
  const gd::means_params mp{{gd::make_vector_view<const uint4>(q), static_cast<uint16_t*>(q_c), q_c_f32, p.q_heads},
                            {gd::make_vector_view<const uint4>(k), static_cast<uint16_t*>(k_c), k_c_f32, p.kv_heads},
                            {gd::make_vector_view<const uint4>(v), static_cast<uint16_t*>(v_c), nullptr, p.kv_heads},
                            p.batch};
  const unsigned blocks = gd::grid_blocks(p.batch * geo.num_tiles() * (p.q_heads + 2 * p.kv_heads));
  return gd::dispatch_element(p.type, [&](auto element) {
    using E = decltype(element);
    const auto kernel = p.head_dim == 64 ? gd::block_means_kernel<E, 64, Tiles> : gd::block_means_kernel<E, 128, Tiles>;
    return gpu::launch("block_means", kernel, blocks, gd::tile_row_threads, 0, stream, false, mp, geo);
  });
}

// block_means_tiling's launches, the arguments checked: q, k, v and the gate (when given) in turn.
inline status launch_block_means_tiling(const problem& p, const_tensor q, const_tensor k, const_tensor v,
                                        const_tensor gate, const tiled_inputs& tiled, void* q_c, void* k_c, void* v_c,
                                        float* q_c_f32, float* k_c_f32, gpu::stream_t stream) {
  namespace gd = gpu::detail;
  const tile_geometry geo(p.grid);
  const struct {
    const_tensor x;
    void* out;
    float* out_f32;
    int64_t heads;
    tensor copy;
  } parts[4] = {{q, q_c, q_c_f32, p.q_heads, tiled.q},
                {k, k_c, k_c_f32, p.kv_heads, tiled.k},
                {v, v_c, nullptr, p.kv_heads, tiled.v},
                {gate, nullptr, nullptr, p.q_heads, tiled.gate}};
  status s = status::ok();
  for (const auto& part : parts) {
    if (!s || part.x.data == nullptr) continue;
    const gd::means_source src{gd::make_vector_view<const uint4>(part.x), static_cast<uint16_t*>(part.out),
                               part.out_f32, part.heads};
    const unsigned blocks = gd::grid_blocks(p.batch * geo.num_tiles() * part.heads);
    s = gd::dispatch_element(p.type, [&](auto element) {
      using E = decltype(element);
      const auto kernel =
          p.head_dim == 64 ? gd::block_means_tiling_kernel<E, 64> : gd::block_means_tiling_kernel<E, 128>;
      return gpu::launch("block_means_tiling", kernel, blocks, gd::tile_row_threads, 0, stream, false, src,
                         gd::make_vector_view<uint4>(part.copy), geo, p.batch);
    });
  }
  return s;
}

} // namespace detail

// q_c [B, Hq, N, D], k_c and v_c [B, Hkv, N, D], contiguous, in p.type: the mean of each tile's valid tokens
// of the tiled tensors q [B, N·64, Hq, D], k and v [B, N·64, Hkv, D], accumulated in fp32. q_c_f32 and k_c_f32,
// when not null, receive the same means of q and k unrounded (fp32, same shapes): what coarse_scores takes.
inline status block_means(const problem& p, const_tensor q, const_tensor k, const_tensor v, void* q_c, void* k_c,
                          void* v_c, float* q_c_f32, float* k_c_f32, gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  const tile_geometry geo(p.grid);
  if (s) s = check_tensor("q", q, p, p.q_heads, geo.tiled_tokens(), target::gpu);
  if (s) s = check_tensor("k", k, p, p.kv_heads, geo.tiled_tokens(), target::gpu);
  if (s) s = check_tensor("v", v, p, p.kv_heads, geo.tiled_tokens(), target::gpu);
  if (s) s = check_pointer("q_c", q_c, 16);
  if (s) s = check_pointer("k_c", k_c, 16);
  if (s) s = check_pointer("v_c", v_c, 16);
  if (s && q_c_f32 != nullptr) s = check_pointer("q_c_f32", q_c_f32, 16);
  if (s && k_c_f32 != nullptr) s = check_pointer("k_c_f32", k_c_f32, 16);
  if (s) s = check_means_disjoint(p, q, k, v, q_c, k_c, v_c, q_c_f32, k_c_f32);
  if (!s) return s;
  return detail::launch_block_means(p, geo, q, k, v, q_c, k_c, v_c, q_c_f32, k_c_f32, stream);
}

// block_means from raster order, fused with the tile pass its inputs would otherwise need: q [B, T·H·W, Hq, D], k
// and v [B, T·H·W, Hkv, D] and the gate (like q, or data null) are read once, and besides the means (as above) the
// call writes tiled.q, tiled.k, tiled.v and tiled.gate ([B, N·64, heads, D], what tile() makes of each: padding slots
// zero). tiled.gate is given exactly when the gate is.
inline status block_means_tiling(const problem& p, const_tensor q, const_tensor k, const_tensor v, const_tensor gate,
                                 const tiled_inputs& tiled, void* q_c, void* k_c, void* v_c, float* q_c_f32,
                                 float* k_c_f32, gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (s) s = check_raster_inputs(p, q, k, v, gate, tiled, target::gpu);
  if (s) s = check_pointer("q_c", q_c, 16);
  if (s) s = check_pointer("k_c", k_c, 16);
  if (s) s = check_pointer("v_c", v_c, 16);
  if (s && q_c_f32 != nullptr) s = check_pointer("q_c_f32", q_c_f32, 16);
  if (s && k_c_f32 != nullptr) s = check_pointer("k_c_f32", k_c_f32, 16);
  if (s) s = check_means_disjoint(p, q, k, v, q_c, k_c, v_c, q_c_f32, k_c_f32, gate, &tiled);
  if (!s) return s;
  return detail::launch_block_means_tiling(p, q, k, v, gate, tiled, q_c, k_c, v_c, q_c_f32, k_c_f32, stream);
}

// The same without the fp32 means.
inline status block_means(const problem& p, const_tensor q, const_tensor k, const_tensor v, void* q_c, void* k_c,
                          void* v_c, gpu::stream_t stream) {
  return block_means(p, q, k, v, q_c, k_c, v_c, nullptr, nullptr, stream);
}

} // namespace vsa
