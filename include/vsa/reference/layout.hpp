// Raster <-> tiled token order. Values are copied bit for bit; tile() writes zeros into padding slots.
#pragma once

#include "detail.hpp"

namespace vsa {
namespace reference {

namespace detail {

inline status check_layout(const problem& p, int64_t heads, const const_tensor& raster, const const_tensor& tiled,
                           const char* raster_name, const char* tiled_name) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  if (heads < 1 || heads > (int64_t(1) << 30))
    return status::error(errc::bad_heads, "heads: must be in 1..2^30, got %lld", (long long)heads);
  const tile_geometry geo(p.grid);
  const int64_t elements = vsa::detail::checked_mul(vsa::detail::checked_mul(p.batch, heads),
                                                    vsa::detail::checked_mul(geo.tiled_tokens(), p.head_dim));
  if (elements < 0 || elements > vsa::detail::size_limit)
    return status::error(errc::bad_heads, "heads: %lld heads overflow the sizes", (long long)heads);
  if (!(s = check_tensor(raster_name, raster, p, heads, geo.raster_tokens(), target::cpu))) return s;
  return check_tensor(tiled_name, tiled, p, heads, geo.tiled_tokens(), target::cpu);
}

} // namespace detail

inline status tile(const problem& p, int64_t heads, const_tensor raster, tensor tiled) {
  status s = detail::check_layout(p, heads, raster, as_const(tiled), "raster", "tiled");
  if (s) s = check_layout_disjoint(p, heads, raster, as_const(tiled), true);
  if (!s) return s;
  return detail::guarded("tile", [&]() {
    const tile_geometry geo(p.grid);
    const std::size_t row_bytes = static_cast<std::size_t>(p.head_dim) * dtype_size(p.type);
    const int64_t esize = static_cast<int64_t>(dtype_size(p.type));
    const const_tensor out = as_const(tiled);
    detail::parallel_for(p.batch * heads, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / heads, h = bh % heads;
        for (int64_t n = 0; n < geo.num_tiles(); ++n)
          for (int slot = 0; slot < tile_tokens; ++slot) {
            unsigned char* dst = static_cast<unsigned char*>(tiled.data) +
                                 detail::tensor_offset(out, b, n * tile_tokens + slot, h) * esize;
            const int64_t r = geo.raster_of_slot(n, slot);
            if (r < 0)
              std::memset(dst, 0, row_bytes);
            else
              std::memcpy(
                  dst, static_cast<const unsigned char*>(raster.data) + detail::tensor_offset(raster, b, r, h) * esize,
                  row_bytes);
          }
      }
    });
    return status::ok();
  });
}

inline status untile(const problem& p, int64_t heads, const_tensor tiled, tensor raster) {
  status s = detail::check_layout(p, heads, as_const(raster), tiled, "raster", "tiled");
  if (s) s = check_layout_disjoint(p, heads, as_const(raster), tiled, false);
  if (!s) return s;
  return detail::guarded("untile", [&]() {
    const tile_geometry geo(p.grid);
    const std::size_t row_bytes = static_cast<std::size_t>(p.head_dim) * dtype_size(p.type);
    const int64_t esize = static_cast<int64_t>(dtype_size(p.type));
    const const_tensor out = as_const(raster);
    detail::parallel_for(p.batch * heads, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / heads, h = bh % heads;
        for (int64_t r = 0; r < geo.raster_tokens(); ++r)
          std::memcpy(static_cast<unsigned char*>(raster.data) + detail::tensor_offset(out, b, r, h) * esize,
                      static_cast<const unsigned char*>(tiled.data) +
                          detail::tensor_offset(tiled, b, geo.slot_of_raster(r), h) * esize,
                      row_bytes);
      }
    });
    return status::ok();
  });
}

} // namespace reference
} // namespace vsa
