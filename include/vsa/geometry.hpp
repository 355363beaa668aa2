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

// The raster tokens of one tile's slots (tile_geometry::raster_rows_of), for code that asks for several: an
// epilogue storing a tile's rows in raster order. The tile's first token and extent are found once; each slot's
// token then takes two 32-bit divisions by the tile's own extents (a slot is below 64).
struct raster_rows {
  int64_t first = 0;          // raster index of the tile's first token
  int64_t frame = 0, row = 0; // raster strides of t (H·W) and h (W)
  uint32_t w = 1, hw = 1;     // the tile's extent along w, and along h times w

  // Raster index of valid slot s (s below the tile's valid count).
  VSA_HOST_DEVICE int64_t token(int s) const {
    const uint32_t u = static_cast<uint32_t>(s), lt = u / hw, rest = u - lt * hw, lh = rest / w;
    return first + lt * frame + lh * row + (rest - lh * w);
  }
};

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
  // raster_of_slot for every slot of tile n, in 32-bit arithmetic as valid().
  VSA_HOST_DEVICE raster_rows raster_rows_of(int64_t n) const {
    const uint32_t u = static_cast<uint32_t>(n), tw = static_cast<uint32_t>(tiles.w),
                   th = static_cast<uint32_t>(tiles.h);
    const uint32_t x = u % tw, y = (u / tw) % th, z = u / (tw * th);
    raster_rows r;
    r.row = grid.w;
    r.frame = grid.h * grid.w;
    r.w = static_cast<uint32_t>(axis_extent(grid.w, x));
    r.hw = static_cast<uint32_t>(axis_extent(grid.h, y)) * r.w;
    r.first = z * tile_edge * r.frame + y * tile_edge * r.row + x * tile_edge;
    return r;
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

// Division of 32-bit values below 2^31 by a divisor fixed at construction, through one high multiply, an add
// and a shift (the round-up method of Granlund and Montgomery): with l = ceil(log2 d) and
// mul = floor(2^32 (2^l - d) / d) + 1, n / d = (hi32(n · mul) + n) >> l for every n < 2^32; n < 2^31 keeps the
// sum inside 32 bits. A kernel that needs the valid count of every tile it visits divides twice per tile: as
// machine division that is a reciprocal on the special-function unit and ~10 more instructions each.
struct fast_divider {
  uint32_t divisor = 1, mul = 1, shift = 0;

  fast_divider() = default;
  VSA_HOST_DEVICE explicit fast_divider(uint32_t d) : divisor(d) {
    while ((uint64_t(1) << shift) < d) ++shift;
    mul = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  VSA_HOST_DEVICE uint32_t div(uint32_t n) const {
    return (static_cast<uint32_t>((static_cast<uint64_t>(n) * mul) >> 32) + n) >> shift;
  }
};

// tile_geometry::valid for tile indices below num_tiles() with the divisions by the grid's tile counts done
// by fast_divider and the extents as 32-bit selects (only the last tile of an axis is short): the same count
// (tests/cpu/test_layout.cpp compares the two over whole grids).
struct tile_valid_counter {
  fast_divider by_w, by_h;
  uint32_t last_t = 0, last_h = 0, last_w = 0; // index of the last tile along each axis
  int end_t = 4, end_h = 4, end_w = 4;         // and its extent

  tile_valid_counter() = default;
  VSA_HOST_DEVICE explicit tile_valid_counter(const tile_geometry& geo)
      : by_w(static_cast<uint32_t>(geo.tiles.w)), by_h(static_cast<uint32_t>(geo.tiles.h)),
        last_t(static_cast<uint32_t>(geo.tiles.t - 1)), last_h(static_cast<uint32_t>(geo.tiles.h - 1)),
        last_w(static_cast<uint32_t>(geo.tiles.w - 1)),
        end_t(static_cast<int>(geo.grid.t - (geo.tiles.t - 1) * tile_edge)),
        end_h(static_cast<int>(geo.grid.h - (geo.tiles.h - 1) * tile_edge)),
        end_w(static_cast<int>(geo.grid.w - (geo.tiles.w - 1) * tile_edge)) {}
  VSA_HOST_DEVICE int valid(int64_t n) const {
    const uint32_t u = static_cast<uint32_t>(n), q = by_w.div(u), z = by_h.div(q);
    const uint32_t x = u - q * by_w.divisor, y = q - z * by_h.divisor;
    return (z == last_t ? end_t : 4) * (y == last_h ? end_h : 4) * (x == last_w ? end_w : 4);
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
