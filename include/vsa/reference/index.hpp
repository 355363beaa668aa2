// Key-to-query lists: the transpose of the q2k lists, per (batch, query head).
#pragma once

#include "detail.hpp"

namespace vsa {
namespace reference {

// For every key tile j of head (b, h), the query tiles whose q2k row holds j, ascending, packed in k2q
// after the exclusive prefix sum k2q_offset. The unused tail of each head's N·q2k_capacity entries is
// filled with -1. q2k rows may be ragged (counts 0..capacity).
inline status build_k2q(const problem& p, index_lists idx) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  if (!(s = check_q2k_host(p, as_const(idx)))) return s;
  if (!(s = detail::check_array("k2q", idx.k2q))) return s;
  if (!(s = detail::check_array("k2q_offset", idx.k2q_offset))) return s;
  if (!(s = check_k2q_disjoint(p, idx, nullptr, 0))) return s;
  return detail::guarded("build_k2q", [&]() {
    const int64_t n = tile_geometry(p.grid).num_tiles(), cap = idx.q2k_capacity;
    detail::parallel_for(p.batch * p.q_heads, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> fill(static_cast<std::size_t>(n));
      for (int64_t head = begin; head < end; ++head) {
        const int32_t* q2k = idx.q2k + head * n * cap;
        const int32_t* count = idx.q2k_count + head * n;
        int32_t* offset = idx.k2q_offset + head * (n + 1);
        int32_t* k2q = idx.k2q + head * n * cap;
        std::fill(offset, offset + n + 1, 0);
        for (int64_t i = 0; i < n; ++i)
          for (int32_t c = 0; c < count[i]; ++c) ++offset[q2k[i * cap + c] + 1];
        for (int64_t j = 0; j < n; ++j) offset[j + 1] += offset[j];
        for (int64_t j = 0; j < n; ++j) fill[j] = offset[j];
        // Visiting query tiles in ascending order makes every key tile's list ascending.
        for (int64_t i = 0; i < n; ++i)
          for (int32_t c = 0; c < count[i]; ++c) k2q[fill[q2k[i * cap + c]]++] = static_cast<int32_t>(i);
        std::fill(k2q + offset[n], k2q + n * cap, -1);
      }
    });
    return status::ok();
  });
}

} // namespace reference
} // namespace vsa
