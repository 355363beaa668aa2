// Stage 1 on the GPU: raster <-> tiled token order. A pure copy, so the kernel is built for bandwidth:
// 16-byte vectors, every block a quarter tile (16 slots × all heads), its slot -> raster map computed once
// into shared memory, and four independent loads in flight per thread before their stores.
#pragma once

#include "../geometry.hpp"
#include "../validate.hpp"
#include "primitives.hpp"

namespace vsa {
namespace gpu {
namespace detail {

inline constexpr int layout_threads = 256;
inline constexpr int layout_slots = 16; // slots per block: a quarter tile keeps the grid at 4·N·B blocks
inline constexpr int layout_unroll = 4;

struct layout_params {
  vector_view<const uint4> src;
  vector_view<uint4> dst;
  tile_geometry geo;
  int64_t batch;
  unsigned heads;
  int vec_shift; // log2 of the 16-byte vectors per row: 3 (D = 64) or 4 (D = 128)
};

// ToTiled: raster -> tiled, zeros into padding slots. Otherwise tiled -> raster over the valid slots only.
template <bool ToTiled> __global__ void __launch_bounds__(layout_threads) layout_kernel(layout_params p) {
  __shared__ int64_t raster_token[layout_slots];
  const int64_t tiles = p.geo.num_tiles();
  const int64_t items = p.batch * tiles * (tile_tokens / layout_slots);
  const unsigned row_vectors = p.heads << p.vec_shift;
  const unsigned vec_mask = (1u << p.vec_shift) - 1u;

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int quarter = static_cast<int>(item % (tile_tokens / layout_slots));
    const int64_t n = (item / (tile_tokens / layout_slots)) % tiles;
    const int64_t b = item / (tile_tokens / layout_slots) / tiles;
    const int first_slot = quarter * layout_slots;
    if (threadIdx.x < layout_slots) raster_token[threadIdx.x] = p.geo.raster_of_slot(n, first_slot + threadIdx.x);
    __syncthreads();

    // Untiling skips the padding slots, which sit at the end of the tile.
    int slots = layout_slots;
    if (!ToTiled) {
      const int rest = p.geo.valid(n) - first_slot;
      slots = rest < 0 ? 0 : (rest < layout_slots ? rest : layout_slots);
    }
    const unsigned count = static_cast<unsigned>(slots) * row_vectors;
    for (unsigned base = threadIdx.x; base < count; base += layout_threads * layout_unroll) {
      uint4 value[layout_unroll];
      uint4* target[layout_unroll];
#pragma unroll
      for (int u = 0; u < layout_unroll; ++u) {
        const unsigned i = base + u * layout_threads;
        target[u] = nullptr;
        if (i >= count) continue;
        const unsigned s = i / row_vectors, hv = i - s * row_vectors;
        const unsigned h = hv >> p.vec_shift, v = hv & vec_mask;
        const int64_t tiled_slot = n * tile_tokens + first_slot + s;
        const int64_t r = raster_token[s];
        if (ToTiled) {
          target[u] = p.dst.row(b, tiled_slot, h) + v;
          value[u] = r < 0 ? make_uint4(0u, 0u, 0u, 0u) : p.src.row(b, r, h)[v];
        } else {
          target[u] = p.dst.row(b, r, h) + v;
          value[u] = p.src.row(b, tiled_slot, h)[v];
        }
      }
#pragma unroll
      for (int u = 0; u < layout_unroll; ++u)
        if (target[u] != nullptr) *target[u] = value[u];
    }
    __syncthreads(); // raster_token is rewritten by the next item
  }
}

inline status check_layout(const problem& p, int64_t heads, const const_tensor& raster, const const_tensor& tiled) {
  status s = check_problem(p, target::gpu);
  if (!s) return s;
  if (heads < 1 || heads > 65536)
    return status::error(errc::bad_heads, "heads: the GPU layout kernels take 1..65536, got %lld", (long long)heads);
  const tile_geometry geo(p.grid);
  if (!(s = check_tensor("raster", raster, p, heads, geo.raster_tokens(), target::gpu))) return s;
  return check_tensor("tiled", tiled, p, heads, geo.tiled_tokens(), target::gpu);
}

template <bool ToTiled>
status launch_layout(const problem& p, int64_t heads, const const_tensor& src, const tensor& dst, stream_t stream) {
  const tile_geometry geo(p.grid);
  layout_params lp{make_vector_view<const uint4>(src), make_vector_view<uint4>(dst), geo, p.batch, 0u, 0};
  lp.heads = static_cast<unsigned>(heads);
  lp.vec_shift = p.head_dim == 64 ? 3 : 4;
  const int64_t items = p.batch * geo.num_tiles() * (tile_tokens / layout_slots);
  return launch(ToTiled ? "tile" : "untile", layout_kernel<ToTiled>, grid_blocks(items), layout_threads, 0, stream,
                false, lp);
}

} // namespace detail
} // namespace gpu

// raster [B, T·H·W, heads, D] -> tiled [B, N·64, heads, D]; padding slots become zeros.
inline status tile(const problem& p, int64_t heads, const_tensor raster, tensor tiled, gpu::stream_t stream) {
  status s = gpu::detail::check_layout(p, heads, raster, as_const(tiled));
  if (s) s = check_layout_disjoint(p, heads, raster, as_const(tiled), true);
  if (!s) return s;
  return gpu::detail::launch_layout<true>(p, heads, raster, tiled, stream);
}

// tiled [B, N·64, heads, D] -> raster [B, T·H·W, heads, D]; padding slots are dropped.
inline status untile(const problem& p, int64_t heads, const_tensor tiled, tensor raster, gpu::stream_t stream) {
  status s = gpu::detail::check_layout(p, heads, as_const(raster), tiled);
  if (s) s = check_layout_disjoint(p, heads, as_const(raster), tiled, false);
  if (!s) return s;
  return gpu::detail::launch_layout<false>(p, heads, tiled, raster, stream);
}

} // namespace vsa
