// Linear-attention branch: o_i = φ(q_i)·(Σ_j φ(k_j)ᵀ v_j) / (φ(q_i)·Σ_j φ(k_j) + eps) over all valid
// tokens j of the sequence, and its backward.
#pragma once

#include "detail.hpp"

namespace vsa {
namespace reference {

namespace detail {

inline void feature(feature_map phi, const double* x, double* y, int64_t dim) {
  switch (phi) {
  case feature_map::softmax: {
    double m = -INFINITY, sum = 0.0;
    for (int64_t d = 0; d < dim; ++d) m = std::max(m, x[d]);
    for (int64_t d = 0; d < dim; ++d) sum += (y[d] = std::exp(x[d] - m));
    for (int64_t d = 0; d < dim; ++d) y[d] /= sum;
    return;
  }
  case feature_map::elu1:
    for (int64_t d = 0; d < dim; ++d) y[d] = x[d] > 0.0 ? x[d] + 1.0 : std::exp(x[d]);
    return;
  case feature_map::relu:
    for (int64_t d = 0; d < dim; ++d) y[d] = x[d] > 0.0 ? x[d] : 0.0;
    return;
  }
}

// dx = (∂φ/∂x)ᵀ dy at x, where y = φ(x).
inline void feature_backward(feature_map phi, const double* x, const double* y, const double* dy, double* dx,
                             int64_t dim) {
  switch (phi) {
  case feature_map::softmax: {
    const double inner = dot(y, dy, dim);
    for (int64_t d = 0; d < dim; ++d) dx[d] = y[d] * (dy[d] - inner);
    return;
  }
  case feature_map::elu1:
    for (int64_t d = 0; d < dim; ++d) dx[d] = dy[d] * (x[d] > 0.0 ? 1.0 : y[d]);
    return;
  case feature_map::relu:
    for (int64_t d = 0; d < dim; ++d) dx[d] = x[d] > 0.0 ? dy[d] : 0.0;
    return;
  }
}

struct linear_shape {
  tile_geometry geo;
  token_order order;
  int64_t tokens() const { return order == token_order::tiled ? geo.tiled_tokens() : geo.raster_tokens(); }
  bool valid(int64_t s) const { return order == token_order::raster || (s % tile_tokens) < geo.valid(s / tile_tokens); }
};

// kv [D, D] = Σ_j φ(k_j) v_jᵀ and z [D] = Σ_j φ(k_j) over the valid tokens of one kv head.
inline void linear_state(const linear_shape& shape, feature_map phi, int64_t dim, const double* k, const double* v,
                         double* kv, double* z, double* scratch) {
  std::fill(kv, kv + dim * dim, 0.0);
  std::fill(z, z + dim, 0.0);
  for (int64_t s = 0; s < shape.tokens(); ++s) {
    if (!shape.valid(s)) continue;
    feature(phi, k + s * dim, scratch, dim);
    for (int64_t d = 0; d < dim; ++d) {
      z[d] += scratch[d];
      axpy(scratch[d], v + s * dim, kv + d * dim, dim);
    }
  }
}

// Dense doubles q, o [B, Hq, S, D], k, v [B, Hkv, S, D].
inline void linear_forward_core(const problem& p, feature_map phi, double eps, const linear_shape& shape,
                                const double* q, const double* k, const double* v, double* o) {
  const int64_t dim = p.head_dim, group = p.q_heads / p.kv_heads, tokens = shape.tokens();
  parallel_for(p.batch * p.kv_heads, [&](int64_t begin, int64_t end) {
    std::vector<double> kv(dim * dim), z(dim), a(dim);
    for (int64_t bk = begin; bk < end; ++bk) {
      linear_state(shape, phi, dim, k + bk * tokens * dim, v + bk * tokens * dim, kv.data(), z.data(), a.data());
      const int64_t b = bk / p.kv_heads, hk = bk % p.kv_heads;
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t s = 0; s < tokens; ++s) {
          const int64_t at = ((b * p.q_heads + h) * tokens + s) * dim;
          double* out = o + at;
          std::fill(out, out + dim, 0.0);
          if (!shape.valid(s)) continue;
          feature(phi, q + at, a.data(), dim);
          for (int64_t d = 0; d < dim; ++d) axpy(a[d], kv.data() + d * dim, out, dim);
          const double den = dot(a.data(), z.data(), dim) + eps;
          for (int64_t e = 0; e < dim; ++e) out[e] /= den;
        }
    }
  });
}

inline void linear_backward_core(const problem& p, feature_map phi, double eps, const linear_shape& shape,
                                 const double* q, const double* k, const double* v, const double* d_o, double* dq,
                                 double* dk, double* dv) {
  const int64_t dim = p.head_dim, group = p.q_heads / p.kv_heads, tokens = shape.tokens();
  parallel_for(p.batch * p.kv_heads, [&](int64_t begin, int64_t end) {
    std::vector<double> kv(dim * dim), z(dim), dkv(dim * dim), dz(dim), a(dim), num(dim), da(dim);
    for (int64_t bk = begin; bk < end; ++bk) {
      const double* kh = k + bk * tokens * dim;
      const double* vh = v + bk * tokens * dim;
      linear_state(shape, phi, dim, kh, vh, kv.data(), z.data(), a.data());
      std::fill(dkv.begin(), dkv.end(), 0.0);
      std::fill(dz.begin(), dz.end(), 0.0);
      const int64_t b = bk / p.kv_heads, hk = bk % p.kv_heads;
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t s = 0; s < tokens; ++s) {
          const int64_t at = ((b * p.q_heads + h) * tokens + s) * dim;
          double* g = dq + at;
          std::fill(g, g + dim, 0.0);
          if (!shape.valid(s)) continue;
          feature(phi, q + at, a.data(), dim);
          std::fill(num.begin(), num.end(), 0.0);
          for (int64_t d = 0; d < dim; ++d) axpy(a[d], kv.data() + d * dim, num.data(), dim);
          const double den = dot(a.data(), z.data(), dim) + eps;
          // o = num / den: d num = dO / den, d den = -(dO · o) / den.
          const double dden = -dot(d_o + at, num.data(), dim) / (den * den);
          for (int64_t d = 0; d < dim; ++d) {
            da[d] = dot(kv.data() + d * dim, d_o + at, dim) / den + dden * z[d];
            axpy(a[d] / den, d_o + at, dkv.data() + d * dim, dim);
            dz[d] += a[d] * dden;
          }
          feature_backward(phi, q + at, a.data(), da.data(), g, dim);
        }
      // Key side, with the gradients of the state summed over the group.
      for (int64_t s = 0; s < tokens; ++s) {
        double* gk = dk + bk * tokens * dim + s * dim;
        double* gv = dv + bk * tokens * dim + s * dim;
        std::fill(gk, gk + dim, 0.0);
        std::fill(gv, gv + dim, 0.0);
        if (!shape.valid(s)) continue;
        feature(phi, kh + s * dim, a.data(), dim);
        for (int64_t d = 0; d < dim; ++d) {
          da[d] = dot(dkv.data() + d * dim, vh + s * dim, dim) + dz[d];
          axpy(a[d], dkv.data() + d * dim, gv, dim);
        }
        feature_backward(phi, kh + s * dim, a.data(), da.data(), gk, dim);
      }
    }
  });
}

inline status check_linear(const problem& p, feature_map phi, float eps, token_order order, const const_tensor& q,
                           const const_tensor& k, const const_tensor& v) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  const int f = static_cast<int>(phi), o = static_cast<int>(order);
  if (f < 0 || f > 2) return status::error(errc::bad_argument, "phi: not a feature_map value (%d)", f);
  if (!(eps >= 0.0f) || !std::isfinite(eps))
    return status::error(errc::bad_argument, "eps: must be >= 0 and finite, got %g", static_cast<double>(eps));
  if (o < 0 || o > 1) return status::error(errc::bad_argument, "order: not a token_order value (%d)", o);
  const linear_shape shape{tile_geometry(p.grid), order};
  if (!(s = check_tensor("q", q, p, p.q_heads, shape.tokens(), target::cpu))) return s;
  if (!(s = check_tensor("k", k, p, p.kv_heads, shape.tokens(), target::cpu))) return s;
  return check_tensor("v", v, p, p.kv_heads, shape.tokens(), target::cpu);
}

} // namespace detail

inline status linear_attention_forward(const problem& p, feature_map phi, float eps, token_order order, const_tensor q,
                                       const_tensor k, const_tensor v, tensor o_l) {
  status s = detail::check_linear(p, phi, eps, order, q, k, v);
  if (!s) return s;
  const detail::linear_shape shape{tile_geometry(p.grid), order};
  if (!(s = check_tensor("o_l", o_l, p, p.q_heads, shape.tokens(), target::cpu))) return s;
  if (!(s = check_linear_forward_disjoint(p, q, k, v, o_l, nullptr, 0, nullptr, 0))) return s;
  return detail::guarded("linear_attention_forward", [&]() {
    const int64_t q_size = p.batch * p.q_heads * shape.tokens() * p.head_dim;
    const int64_t k_size = p.batch * p.kv_heads * shape.tokens() * p.head_dim;
    std::vector<double> qd(q_size), kd(k_size), vd(k_size), od(q_size);
    detail::gather(p, p.q_heads, q, qd.data());
    detail::gather(p, p.kv_heads, k, kd.data());
    detail::gather(p, p.kv_heads, v, vd.data());
    detail::linear_forward_core(p, phi, eps, shape, qd.data(), kd.data(), vd.data(), od.data());
    detail::scatter(p, p.q_heads, od.data(), o_l);
    return status::ok();
  });
}

inline status linear_attention_backward(const problem& p, feature_map phi, float eps, token_order order, const_tensor q,
                                        const_tensor k, const_tensor v, const_tensor d_o, tensor dq, tensor dk,
                                        tensor dv) {
  status s = detail::check_linear(p, phi, eps, order, q, k, v);
  if (!s) return s;
  const detail::linear_shape shape{tile_geometry(p.grid), order};
  if (!(s = check_tensor("d_o", d_o, p, p.q_heads, shape.tokens(), target::cpu))) return s;
  if (!(s = check_tensor("dq", dq, p, p.q_heads, shape.tokens(), target::cpu))) return s;
  if (!(s = check_tensor("dk", dk, p, p.kv_heads, shape.tokens(), target::cpu))) return s;
  if (!(s = check_tensor("dv", dv, p, p.kv_heads, shape.tokens(), target::cpu))) return s;
  if (!(s = check_linear_backward_disjoint(p, q, k, v, d_o, nullptr, 0, dq, dk, dv, nullptr, 0))) return s;
  return detail::guarded("linear_attention_backward", [&]() {
    const int64_t q_size = p.batch * p.q_heads * shape.tokens() * p.head_dim;
    const int64_t k_size = p.batch * p.kv_heads * shape.tokens() * p.head_dim;
    std::vector<double> qd(q_size), kd(k_size), vd(k_size), dod(q_size), dqd(q_size), dkd(k_size), dvd(k_size);
    detail::gather(p, p.q_heads, q, qd.data());
    detail::gather(p, p.kv_heads, k, kd.data());
    detail::gather(p, p.kv_heads, v, vd.data());
    detail::gather(p, p.q_heads, d_o, dod.data());
    detail::linear_backward_core(p, phi, eps, shape, qd.data(), kd.data(), vd.data(), dod.data(), dqd.data(),
                                 dkd.data(), dvd.data());
    detail::scatter(p, p.q_heads, dqd.data(), dq);
    detail::scatter(p, p.kv_heads, dkd.data(), dk);
    detail::scatter(p, p.kv_heads, dvd.data(), dv);
    return status::ok();
  });
}

} // namespace reference
} // namespace vsa
