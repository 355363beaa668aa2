// Dense attention between the tile means: scores, their log-sum-exp and the coarse output, and its backward.
#pragma once

#include "detail.hpp"

namespace vsa {
namespace reference {

namespace detail {

// All arrays dense doubles: q_c, o_c [B, Hq, N, D], k_c, v_c [B, Hkv, N, D], lse_c [B, Hq, N].
// scores (float [B, Hq, N, N]) may be null when only o_c and lse_c are wanted.
inline void coarse_forward_core(const problem& p, double scale, const double* q_c, const double* k_c, const double* v_c,
                                float* scores, double* o_c, double* lse_c) {
  const int64_t n = tile_geometry(p.grid).num_tiles(), dim = p.head_dim, group = p.q_heads / p.kv_heads;
  const dense_shape qs{p.batch, p.q_heads, n, dim}, ks{p.batch, p.kv_heads, n, dim};
  parallel_for(p.batch * p.q_heads * n, [&](int64_t begin, int64_t end) {
    std::vector<double> s(static_cast<std::size_t>(n));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % n, bh = row / n, b = bh / p.q_heads, h = bh % p.q_heads, hk = h / group;
      const double* q = q_c + qs.row(b, h, i);
      double m = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        s[j] = scale * dot(q, k_c + ks.row(b, hk, j), dim);
        if (scores != nullptr) scores[row * n + j] = static_cast<float>(s[j]);
        m = std::max(m, s[j]);
      }
      double sum = 0.0;
      double* o = o_c + qs.row(b, h, i);
      std::fill(o, o + dim, 0.0);
      for (int64_t j = 0; j < n; ++j) {
        const double e = std::exp(s[j] - m);
        sum += e;
        axpy(e, v_c + ks.row(b, hk, j), o, dim);
      }
      for (int64_t d = 0; d < dim; ++d) o[d] /= sum;
      lse_c[row] = m + std::log(sum);
    }
  });
}

// Gradients of the coarse attention; dk_c and dv_c sum over the query heads of each group.
inline void coarse_backward_core(const problem& p, double scale, const double* q_c, const double* k_c,
                                 const double* v_c, const double* o_c, const double* d_o_c, const double* lse_c,
                                 double* dq_c, double* dk_c, double* dv_c) {
  const int64_t n = tile_geometry(p.grid).num_tiles(), dim = p.head_dim, group = p.q_heads / p.kv_heads;
  const dense_shape qs{p.batch, p.q_heads, n, dim}, ks{p.batch, p.kv_heads, n, dim};
  parallel_for(p.batch * p.kv_heads, [&](int64_t begin, int64_t end) {
    for (int64_t bk = begin; bk < end; ++bk) {
      const int64_t b = bk / p.kv_heads, hk = bk % p.kv_heads;
      double* dk = dk_c + ks.row(b, hk, 0);
      double* dv = dv_c + ks.row(b, hk, 0);
      std::fill(dk, dk + n * dim, 0.0);
      std::fill(dv, dv + n * dim, 0.0);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t i = 0; i < n; ++i) {
          const double* q = q_c + qs.row(b, h, i);
          const double* d_o = d_o_c + qs.row(b, h, i);
          double* dq = dq_c + qs.row(b, h, i);
          std::fill(dq, dq + dim, 0.0);
          const double lse = lse_c[(b * p.q_heads + h) * n + i];
          if (is_plus_inf(lse)) continue;
          const double delta = dot(d_o, o_c + qs.row(b, h, i), dim);
          for (int64_t j = 0; j < n; ++j) {
            const double* k = k_c + ks.row(b, hk, j);
            const double prob = std::exp(scale * dot(q, k, dim) - lse);
            const double ds = prob * (dot(d_o, v_c + ks.row(b, hk, j), dim) - delta);
            axpy(scale * ds, k, dq, dim);
            axpy(scale * ds, q, dk + j * dim, dim);
            axpy(prob, d_o, dv + j * dim, dim);
          }
        }
    }
  });
}

inline status check_coarse(const problem& p, float scale) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  return check_scale(scale);
}

} // namespace detail

inline status coarse_attention(const problem& p, float scale, const void* q_c, const void* k_c, const void* v_c,
                               float* scores, void* o_c, float* lse_c) {
  status s = detail::check_coarse(p, scale);
  if (!s) return s;
  if (!(s = detail::check_array("q_c", q_c))) return s;
  if (!(s = detail::check_array("k_c", k_c))) return s;
  if (!(s = detail::check_array("v_c", v_c))) return s;
  if (!(s = detail::check_array("scores", scores))) return s;
  if (!(s = detail::check_array("o_c", o_c))) return s;
  if (!(s = detail::check_array("lse_c", lse_c))) return s;
  return detail::guarded("coarse_attention", [&]() {
    const int64_t n = tile_geometry(p.grid).num_tiles();
    const int64_t q_size = p.batch * p.q_heads * n * p.head_dim, k_size = p.batch * p.kv_heads * n * p.head_dim;
    std::vector<double> q(q_size), k(k_size), v(k_size), o(q_size), lse(p.batch * p.q_heads * n);
    detail::load_array(q_c, q_size, p.type, q.data());
    detail::load_array(k_c, k_size, p.type, k.data());
    detail::load_array(v_c, k_size, p.type, v.data());
    detail::coarse_forward_core(p, scale, q.data(), k.data(), v.data(), scores, o.data(), lse.data());
    detail::store_array(o_c, q_size, p.type, o.data());
    for (std::size_t r = 0; r < lse.size(); ++r) lse_c[r] = static_cast<float>(lse[r]);
    return status::ok();
  });
}

inline status coarse_attention_backward(const problem& p, float scale, const void* q_c, const void* k_c,
                                        const void* v_c, const void* o_c, const void* d_o_c, const float* lse_c,
                                        float* dq_c, float* dk_c, float* dv_c) {
  status s = detail::check_coarse(p, scale);
  if (!s) return s;
  if (!(s = detail::check_array("q_c", q_c))) return s;
  if (!(s = detail::check_array("k_c", k_c))) return s;
  if (!(s = detail::check_array("v_c", v_c))) return s;
  if (!(s = detail::check_array("o_c", o_c))) return s;
  if (!(s = detail::check_array("d_o_c", d_o_c))) return s;
  if (!(s = detail::check_array("lse_c", lse_c))) return s;
  if (!(s = detail::check_array("dq_c", dq_c))) return s;
  if (!(s = detail::check_array("dk_c", dk_c))) return s;
  if (!(s = detail::check_array("dv_c", dv_c))) return s;
  return detail::guarded("coarse_attention_backward", [&]() {
    const int64_t n = tile_geometry(p.grid).num_tiles();
    const int64_t q_size = p.batch * p.q_heads * n * p.head_dim, k_size = p.batch * p.kv_heads * n * p.head_dim;
    std::vector<double> q(q_size), k(k_size), v(k_size), o(q_size), d_o(q_size), lse(p.batch * p.q_heads * n);
    std::vector<double> dq(q_size), dk(k_size), dv(k_size);
    detail::load_array(q_c, q_size, p.type, q.data());
    detail::load_array(k_c, k_size, p.type, k.data());
    detail::load_array(v_c, k_size, p.type, v.data());
    detail::load_array(o_c, q_size, p.type, o.data());
    detail::load_array(d_o_c, q_size, p.type, d_o.data());
    for (std::size_t r = 0; r < lse.size(); ++r) lse[r] = lse_c[r];
    detail::coarse_backward_core(p, scale, q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(),
                                 dk.data(), dv.data());
    detail::store_array(dq_c, q_size, dtype::f32, dq.data());
    detail::store_array(dk_c, k_size, dtype::f32, dk.data());
    detail::store_array(dv_c, k_size, dtype::f32, dv.data());
    return status::ok();
  });
}

} // namespace reference
} // namespace vsa
