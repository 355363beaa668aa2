// Dense attention between the tile means, in two pieces as on the GPU: the scaled scores from the fp32 means,
// then their softmax over the tile values (the log-sum-exp and the coarse output), and its backward.
#pragma once

#include "detail.hpp"

namespace vsa {
namespace reference {

namespace detail {

// All arrays dense doubles: q_c [B, Hq, N, D], k_c [B, Hkv, N, D], scores [B, Hq, N, N].
inline void coarse_scores_core(const problem& p, double scale, const double* q_c, const double* k_c, double* scores) {
  const int64_t n = tile_geometry(p.grid).num_tiles(), dim = p.head_dim, group = p.q_heads / p.kv_heads;
  const dense_shape qs{p.batch, p.q_heads, n, dim}, ks{p.batch, p.kv_heads, n, dim};
  parallel_for(p.batch * p.q_heads * n, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % n, bh = row / n, b = bh / p.q_heads, h = bh % p.q_heads, hk = h / group;
      for (int64_t j = 0; j < n; ++j)
        scores[row * n + j] = scale * dot(q_c + qs.row(b, h, i), k_c + ks.row(b, hk, j), dim);
    }
  });
}

// o_c [B, Hq, N, D] and lse_c [B, Hq, N] from the scores and v_c [B, Hkv, N, D], all dense doubles.
inline void coarse_forward_core(const problem& p, const double* scores, const double* v_c, double* o_c, double* lse_c) {
  const int64_t n = tile_geometry(p.grid).num_tiles(), dim = p.head_dim, group = p.q_heads / p.kv_heads;
  const dense_shape qs{p.batch, p.q_heads, n, dim}, ks{p.batch, p.kv_heads, n, dim};
  parallel_for(p.batch * p.q_heads * n, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % n, bh = row / n, b = bh / p.q_heads, h = bh % p.q_heads, hk = h / group;
      const double* s = scores + row * n;
      double m = -INFINITY;
      for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
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

// Gradients of the coarse attention, P from the scores and lse_c; dk_c and dv_c sum over the query heads of
// each group. q_c and k_c are the operands of dk_c = scale · dSᵀ · q_c and dq_c = scale · dS · k_c.
inline void coarse_backward_core(const problem& p, double scale, const double* q_c, const double* k_c,
                                 const double* v_c, const double* scores, const double* o_c, const double* d_o_c,
                                 const double* lse_c, double* dq_c, double* dk_c, double* dv_c) {
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
          const int64_t row = (b * p.q_heads + h) * n + i;
          const double* q = q_c + qs.row(b, h, i);
          const double* d_o = d_o_c + qs.row(b, h, i);
          double* dq = dq_c + qs.row(b, h, i);
          std::fill(dq, dq + dim, 0.0);
          const double lse = lse_c[row];
          if (is_plus_inf(lse)) continue;
          const double delta = dot(d_o, o_c + qs.row(b, h, i), dim);
          for (int64_t j = 0; j < n; ++j) {
            const double* k = k_c + ks.row(b, hk, j);
            const double prob = std::exp(scores[row * n + j] - lse);
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

inline std::vector<double> widened(const float* x, int64_t n) { return std::vector<double>(x, x + n); }

// The residual bytes of o rounded to t (numeric.hpp): what the GPU's epilogue writes beside a 16-bit output.
// Zeros for f32 and f64, which are not rounded to 16 bits.
inline void encode_residuals(const double* o, int64_t n, dtype t, int8_t* codes) {
  const bool narrow = t == dtype::bf16 || t == dtype::fp16;
  for (int64_t e = 0; e < n; ++e)
    codes[e] = narrow ? residual_encode(static_cast<float>(o[e]), static_cast<float>(round_to(o[e], t)), t) : 0;
}
// o (read back from its 16-bit storage) with its residual added back.
inline void decode_residuals(double* o, int64_t n, dtype t, const int8_t* codes) {
  if (t != dtype::bf16 && t != dtype::fp16) return;
  for (int64_t e = 0; e < n; ++e) o[e] = residual_decode(codes[e], static_cast<float>(o[e]), t);
}

} // namespace detail

// scores [B, Hq, N, N] = scale · q_c · k_cᵀ from the fp32 means q_c [B, Hq, N, D] and k_c [B, Hkv, N, D].
inline status coarse_scores(const problem& p, float scale, const float* q_c, const float* k_c, float* scores) {
  status s = detail::check_coarse(p, scale);
  if (!s) return s;
  if (!(s = detail::check_array("q_c", q_c))) return s;
  if (!(s = detail::check_array("k_c", k_c))) return s;
  if (!(s = detail::check_array("scores", scores))) return s;
  if (!(s = check_coarse_scores_disjoint(p, q_c, k_c, scores))) return s;
  return detail::guarded("coarse_scores", [&]() {
    const int64_t n = tile_geometry(p.grid).num_tiles();
    const int64_t q_size = p.batch * p.q_heads * n * p.head_dim, k_size = p.batch * p.kv_heads * n * p.head_dim;
    std::vector<double> out(static_cast<std::size_t>(p.batch * p.q_heads * n * n));
    detail::coarse_scores_core(p, scale, detail::widened(q_c, q_size).data(), detail::widened(k_c, k_size).data(),
                               out.data());
    detail::store_array(scores, static_cast<int64_t>(out.size()), dtype::f32, out.data());
    return status::ok();
  });
}

// o_c [B, Hq, N, D] (p.type) and lse_c [B, Hq, N]: the softmax of the scores over v_c [B, Hkv, N, D] (p.type);
// o_c_residual, when not null, receives o_c's rounding residual (zeros for f32 and f64).
inline status coarse_attention(const problem& p, const float* scores, const void* v_c, void* o_c, int8_t* o_c_residual,
                               float* lse_c) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  if (!(s = detail::check_array("scores", scores))) return s;
  if (!(s = detail::check_array("v_c", v_c))) return s;
  if (!(s = detail::check_array("o_c", o_c))) return s;
  if (!(s = detail::check_array("lse_c", lse_c))) return s;
  if (!(s = check_coarse_forward_disjoint(p, scores, v_c, o_c, o_c_residual, lse_c))) return s;
  return detail::guarded("coarse_attention", [&]() {
    const int64_t n = tile_geometry(p.grid).num_tiles();
    const int64_t q_size = p.batch * p.q_heads * n * p.head_dim, k_size = p.batch * p.kv_heads * n * p.head_dim;
    std::vector<double> v(k_size), o(q_size), lse(p.batch * p.q_heads * n);
    detail::load_array(v_c, k_size, p.type, v.data());
    detail::coarse_forward_core(p, detail::widened(scores, p.batch * p.q_heads * n * n).data(), v.data(), o.data(),
                                lse.data());
    detail::store_array(o_c, q_size, p.type, o.data());
    if (o_c_residual != nullptr) detail::encode_residuals(o.data(), q_size, p.type, o_c_residual);
    for (std::size_t r = 0; r < lse.size(); ++r) lse_c[r] = static_cast<float>(lse[r]);
    return status::ok();
  });
}

inline status coarse_attention_backward(const problem& p, float scale, const void* q_c, const void* k_c,
                                        const void* v_c, const float* scores, const void* o_c,
                                        const int8_t* o_c_residual, const void* d_o_c, const float* lse_c, float* dq_c,
                                        float* dk_c, float* dv_c) {
  status s = detail::check_coarse(p, scale);
  if (!s) return s;
  if (!(s = detail::check_array("q_c", q_c))) return s;
  if (!(s = detail::check_array("k_c", k_c))) return s;
  if (!(s = detail::check_array("v_c", v_c))) return s;
  if (!(s = detail::check_array("scores", scores))) return s;
  if (!(s = detail::check_array("o_c", o_c))) return s;
  if (!(s = detail::check_array("d_o_c", d_o_c))) return s;
  if (!(s = detail::check_array("lse_c", lse_c))) return s;
  if (!(s = detail::check_array("dq_c", dq_c))) return s;
  if (!(s = detail::check_array("dk_c", dk_c))) return s;
  if (!(s = detail::check_array("dv_c", dv_c))) return s;
  if (!(s = check_coarse_backward_disjoint(p, q_c, k_c, v_c, scores, o_c, o_c_residual, d_o_c, lse_c, dq_c, dk_c, dv_c,
                                           nullptr, 0)))
    return s;
  return detail::guarded("coarse_attention_backward", [&]() {
    const int64_t n = tile_geometry(p.grid).num_tiles();
    const int64_t q_size = p.batch * p.q_heads * n * p.head_dim, k_size = p.batch * p.kv_heads * n * p.head_dim;
    std::vector<double> q(q_size), k(k_size), v(k_size), o(q_size), d_o(q_size), lse(p.batch * p.q_heads * n);
    std::vector<double> dq(q_size), dk(k_size), dv(k_size);
    detail::load_array(q_c, q_size, p.type, q.data());
    detail::load_array(k_c, k_size, p.type, k.data());
    detail::load_array(v_c, k_size, p.type, v.data());
    detail::load_array(o_c, q_size, p.type, o.data());
    if (o_c_residual != nullptr) detail::decode_residuals(o.data(), q_size, p.type, o_c_residual);
    detail::load_array(d_o_c, q_size, p.type, d_o.data());
    for (std::size_t r = 0; r < lse.size(); ++r) lse[r] = lse_c[r];
    detail::coarse_backward_core(p, scale, q.data(), k.data(), v.data(),
                                 detail::widened(scores, p.batch * p.q_heads * n * n).data(), o.data(), d_o.data(),
                                 lse.data(), dq.data(), dk.data(), dv.data());
    detail::store_array(dq_c, q_size, dtype::f32, dq.data());
    detail::store_array(dk_c, k_size, dtype::f32, dk.data());
    detail::store_array(dv_c, k_size, dtype::f32, dv.data());
    return status::ok();
  });
}

} // namespace reference
} // namespace vsa
