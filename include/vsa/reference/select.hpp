// Top-k key tiles per query tile from the coarse scores.
#pragma once

#include "detail.hpp"

namespace vsa {
namespace reference {

namespace detail {

// Strict ranking of (score, index) pairs: higher score first, ties to the lower index, NaN below every
// number (NaNs among themselves by index). A total order, so the selection is unique.
inline bool ranks_above(float a, int32_t ia, float b, int32_t ib) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// Top-k of every row of scores into q2k (ascending), counts = top_k, unused capacity = -1.
inline void select_core(const problem& p, int64_t top_k, const float* scores, const index_lists& idx) {
  const int64_t n = tile_geometry(p.grid).num_tiles();
  parallel_for(p.batch * p.q_heads * n, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> order(static_cast<std::size_t>(n));
    for (int64_t row = begin; row < end; ++row) {
      const float* sc = scores + row * n;
      for (int64_t j = 0; j < n; ++j) order[j] = static_cast<int32_t>(j);
      std::nth_element(order.begin(), order.begin() + (top_k - 1), order.end(),
                       [&](int32_t a, int32_t b) { return ranks_above(sc[a], a, sc[b], b); });
      std::sort(order.begin(), order.begin() + top_k);
      int32_t* out = idx.q2k + row * idx.q2k_capacity;
      for (int64_t c = 0; c < idx.q2k_capacity; ++c) out[c] = c < top_k ? order[c] : -1;
      idx.q2k_count[row] = static_cast<int32_t>(top_k);
    }
  });
}

} // namespace detail

// Writes the top_k key tiles of every (b, h, i) row of scores [B, Hq, N, N] into q2k (ascending), sets
// q2k_count to top_k, and fills the unused capacity of each row with -1.
inline status select_top_k(const problem& p, int64_t top_k, const float* scores, index_lists idx) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  const int64_t n = tile_geometry(p.grid).num_tiles();
  if (top_k < 1 || top_k > n)
    return status::error(errc::bad_top_k, "top_k: must be in 1..%lld, got %lld", (long long)n, (long long)top_k);
  if (!(s = detail::check_array("scores", scores))) return s;
  if (!(s = detail::check_array("q2k", idx.q2k))) return s;
  if (!(s = detail::check_array("q2k_count", idx.q2k_count))) return s;
  if (idx.q2k_capacity < top_k || idx.q2k_capacity > n)
    return status::error(errc::bad_index, "q2k_capacity: must be in top_k..N = %lld..%lld, got %lld", (long long)top_k,
                         (long long)n, (long long)idx.q2k_capacity);
  if (!(s = check_top_k_disjoint(p, scores, idx, nullptr, 0))) return s;
  return detail::guarded("select_top_k", [&]() {
    detail::select_core(p, top_k, scores, idx);
    return status::ok();
  });
}

} // namespace reference
} // namespace vsa
