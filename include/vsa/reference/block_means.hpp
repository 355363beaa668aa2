// Per-tile means of q, k and v over each tile's valid tokens, accumulated in double and rounded to p.type.
#pragma once

#include "detail.hpp"

namespace vsa {
namespace reference {

namespace detail {

// Means of one tiled tensor into a contiguous [B, heads, N, D] array of type t.
inline void tile_means(const problem& p, int64_t heads, const const_tensor& x, void* means, dtype t) {
  const tile_geometry geo(p.grid);
  const int64_t n_tiles = geo.num_tiles(), dim = p.head_dim;
  parallel_for(p.batch * heads * n_tiles, [&](int64_t begin, int64_t end) {
    std::vector<double> row(static_cast<std::size_t>(dim)), sum(static_cast<std::size_t>(dim));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item % n_tiles, bh = item / n_tiles, b = bh / heads, h = bh % heads;
      const int valid = geo.valid(n);
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int s = 0; s < valid; ++s) {
        load_row(x.data, tensor_offset(x, b, n * tile_tokens + s, h), dim, p.type, row.data());
        for (int64_t d = 0; d < dim; ++d) sum[d] += row[d];
      }
      for (int64_t d = 0; d < dim; ++d) sum[d] /= valid;
      store_row(means, item * dim, dim, t, sum.data());
    }
  });
}

} // namespace detail

// q_c_f32 and k_c_f32, when not null, receive the means of q and k in fp32 (the GPU's block_means says why).
inline status block_means(const problem& p, const_tensor q, const_tensor k, const_tensor v, void* q_c, void* k_c,
                          void* v_c, float* q_c_f32 = nullptr, float* k_c_f32 = nullptr) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  if (!(s = detail::check_tiled("q", q, p, p.q_heads))) return s;
  if (!(s = detail::check_tiled("k", k, p, p.kv_heads))) return s;
  if (!(s = detail::check_tiled("v", v, p, p.kv_heads))) return s;
  if (!(s = detail::check_array("q_c", q_c))) return s;
  if (!(s = detail::check_array("k_c", k_c))) return s;
  if (!(s = detail::check_array("v_c", v_c))) return s;
  if (!(s = check_means_disjoint(p, q, k, v, q_c, k_c, v_c, q_c_f32, k_c_f32))) return s;
  return detail::guarded("block_means", [&]() {
    detail::tile_means(p, p.q_heads, q, q_c, p.type);
    detail::tile_means(p, p.kv_heads, k, k_c, p.type);
    detail::tile_means(p, p.kv_heads, v, v_c, p.type);
    if (q_c_f32 != nullptr) detail::tile_means(p, p.q_heads, q, q_c_f32, dtype::f32);
    if (k_c_f32 != nullptr) detail::tile_means(p, p.kv_heads, k, k_c_f32, dtype::f32);
    return status::ok();
  });
}

} // namespace reference
} // namespace vsa
