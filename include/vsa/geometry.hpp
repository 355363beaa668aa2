// Tile geometry: how the latent grid is cut into 4×4×4 cubes, how many tokens each cube holds, and where a
// token sits in raster and in tiled order. Shared by host and device code, so the CPU reference and the
// kernels cannot disagree about it.
//
// Tiles are ordered t, then h, then w. A tile at the far edge of an axis is partial: its extent along that
// axis is the remainder. Inside a tile its valid tokens fill the first slots, row-major over the partial
// cube (extent_t × extent_h × extent_w), and the padding slots come after them, as FastVideo lays them out.
#pragma once

#include "types.hpp"

namespace vsa {

inline constexpr int64_t tile_edge = 4;
inline constexpr int64_t tile_tokens = 64;

struct tile_geometry {
  grid3 grid;  // tokens
  grid3 tiles; // tiles along each axis

  VSA_HOST_DEVICE static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

  VSA_HOST_DEVICE explicit tile_geometry(grid3 g)
      : grid(g), tiles{ceil_div(g.t, tile_edge), ceil_div(g.h, tile_edge), ceil_div(g.w, tile_edge)} {}

  VSA_HOST_DEVICE int64_t num_tiles() const { return tiles.t * tiles.h * tiles.w; }
  VSA_HOST_DEVICE int64_t tiled_tokens() const { return num_tiles() * tile_tokens; }
  VSA_HOST_DEVICE int64_t raster_tokens() const { return grid.t * grid.h * grid.w; }

  // Extent of tile n along each axis (4, or the remainder at the far edge).
  VSA_HOST_DEVICE grid3 extent(int64_t n) const {
    const int64_t tw = n % tiles.w, th = (n / tiles.w) % tiles.h, tt = n / (tiles.w * tiles.h);
    return {axis_extent(grid.t, tt), axis_extent(grid.h, th), axis_extent(grid.w, tw)};
  }
  // Number of valid tokens of tile n: its first valid(n) slots hold tokens, the rest are padding.
  // Tile counts stay below 2^30 (check_problem), so 32-bit division is exact; kernels call this for every
  // tile they visit, and 64-bit division is a long software sequence on GPUs.
  VSA_HOST_DEVICE int valid(int64_t n) const {
    const uint32_t u = static_cast<uint32_t>(n), tw = static_cast<uint32_t>(tiles.w),
                   th = static_cast<uint32_t>(tiles.h);
    const uint32_t x = u % tw, y = (u / tw) % th, z = u / (tw * th);
    return static_cast<int>(axis_extent(grid.t, z) * axis_extent(grid.h, y) * axis_extent(grid.w, x));
  }
  // Raster index (t·H + h)·W + w of slot s of tile n, or -1 for a padding slot.
  VSA_HOST_DEVICE int64_t raster_of_slot(int64_t n, int s) const {
    const int64_t tw = n % tiles.w, th = (n / tiles.w) % tiles.h, tt = n / (tiles.w * tiles.h);
    const grid3 e = {axis_extent(grid.t, tt), axis_extent(grid.h, th), axis_extent(grid.w, tw)};
    if (s >= e.t * e.h * e.w) return -1;
    const int64_t lw = s % e.w, lh = (s / e.w) % e.h, lt = s / (e.w * e.h);
    return ((tt * tile_edge + lt) * grid.h + th * tile_edge + lh) * grid.w + tw * tile_edge + lw;
  }
  // Tiled position n·64 + s of raster token r.
  VSA_HOST_DEVICE int64_t slot_of_raster(int64_t r) const {
    const int64_t w = r % grid.w, h = (r / grid.w) % grid.h, t = r / (grid.w * grid.h);
    const int64_t tt = t / tile_edge, th = h / tile_edge, tw = w / tile_edge;
    const grid3 e = {axis_extent(grid.t, tt), axis_extent(grid.h, th), axis_extent(grid.w, tw)};
    const int64_t s = ((t % tile_edge) * e.h + h % tile_edge) * e.w + w % tile_edge;
    return ((tt * tiles.h + th) * tiles.w + tw) * tile_tokens + s;
  }

private:
  VSA_HOST_DEVICE static int64_t axis_extent(int64_t size, int64_t tile) {
    const int64_t rest = size - tile * tile_edge;
    return rest < tile_edge ? rest : tile_edge;
  }
};

// Number of key tiles each query tile keeps: k itself, or clamp(ceil((1 - sparsity)·N), 1, N).
// Returns 0 when the request is out of range (k > N, k < 0, sparsity outside [0, 1)).
inline int64_t resolve_top_k(int64_t num_tiles, const options& opt) {
  if (opt.top_k != 0) return (opt.top_k >= 1 && opt.top_k <= num_tiles) ? opt.top_k : 0;
  if (!(opt.sparsity >= 0.0 && opt.sparsity < 1.0)) return 0;
  const double want = (1.0 - opt.sparsity) * static_cast<double>(num_tiles);
  int64_t k = static_cast<int64_t>(want);
  if (static_cast<double>(k) < want) ++k;
  return k < 1 ? 1 : (k > num_tiles ? num_tiles : k);
}

} // namespace vsa
