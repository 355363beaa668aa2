// Block-sparse attention over the key tiles each query tile selected, and its backward.
#pragma once

#include "detail.hpp"

namespace vsa {
namespace reference {

namespace detail {

inline bool list_holds(const const_index_lists& idx, int64_t row, int32_t j) {
  const int32_t* first = idx.q2k + row * idx.q2k_capacity;
  const int32_t* last = first + idx.q2k_count[row];
  return std::binary_search(first, last, j);
}

// Dense doubles: q, o [B, Hq, S, D], k, v [B, Hkv, S, D], lse [B, Hq, S] with S = N·64.
// Padding query rows and rows with an empty list get o = 0 and lse = +inf.
inline void sparse_forward_core(const problem& p, double scale, const double* q, const double* k, const double* v,
                                const const_index_lists& idx, double* o, double* lse) {
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), dim = p.head_dim, group = p.q_heads / p.kv_heads;
  const dense_shape qs{p.batch, p.q_heads, geo.tiled_tokens(), dim}, ks{p.batch, p.kv_heads, geo.tiled_tokens(), dim};
  parallel_for(p.batch * p.q_heads * n, [&](int64_t begin, int64_t end) {
    std::vector<double> s;
    std::vector<int64_t> keys; // dense rows of the valid key tokens of the selected tiles
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % n, bh = row / n, b = bh / p.q_heads, h = bh % p.q_heads, hk = h / group;
      keys.clear();
      const int32_t* list = idx.q2k + row * idx.q2k_capacity;
      for (int32_t c = 0; c < idx.q2k_count[row]; ++c)
        for (int t = 0; t < geo.valid(list[c]); ++t) keys.push_back(ks.row(b, hk, list[c] * tile_tokens + t));
      s.resize(keys.size());
      const int valid = geo.valid(i);
      for (int r = 0; r < tile_tokens; ++r) {
        const int64_t token = i * tile_tokens + r;
        double* out = o + qs.row(b, h, token);
        std::fill(out, out + dim, 0.0);
        double& l = lse[(b * p.q_heads + h) * geo.tiled_tokens() + token];
        if (r >= valid || keys.empty()) {
          l = INFINITY;
          continue;
        }
        const double* qr = q + qs.row(b, h, token);
        double m = -INFINITY;
        for (std::size_t t = 0; t < keys.size(); ++t) {
          s[t] = scale * dot(qr, k + keys[t], dim);
          m = std::max(m, s[t]);
        }
        double sum = 0.0;
        for (std::size_t t = 0; t < keys.size(); ++t) {
          const double e = std::exp(s[t] - m);
          sum += e;
          axpy(e, v + keys[t], out, dim);
        }
        for (int64_t d = 0; d < dim; ++d) out[d] /= sum;
        l = m + std::log(sum);
      }
    }
  });
}

// Gradients of the sparse pass into dense doubles dq [B, Hq, S, D], dk, dv [B, Hkv, S, D] (dk, dv summed
// over each group), padding slots 0. delta is scratch of [B, Hq, S]. Two passes, as the kernels do: one
// over query tiles for dq, one over key tiles for dk and dv, so that no two threads add into one row.
inline void sparse_backward_core(const problem& p, double scale, const double* q, const double* k, const double* v,
                                 const double* o, const double* d_o, const double* lse, const const_index_lists& idx,
                                 double* dq, double* dk, double* dv, double* delta) {
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), dim = p.head_dim, group = p.q_heads / p.kv_heads, slots = geo.tiled_tokens();
  const dense_shape qs{p.batch, p.q_heads, slots, dim}, ks{p.batch, p.kv_heads, slots, dim};
  parallel_for(p.batch * p.q_heads * n, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % n, bh = row / n, b = bh / p.q_heads, h = bh % p.q_heads, hk = h / group;
      const int32_t* list = idx.q2k + row * idx.q2k_capacity;
      const int valid = geo.valid(i);
      for (int r = 0; r < tile_tokens; ++r) {
        const int64_t token = i * tile_tokens + r, at = qs.row(b, h, token);
        double* g = dq + at;
        std::fill(g, g + dim, 0.0);
        const double l = lse[bh * slots + token];
        double& dl = delta[bh * slots + token];
        dl = 0.0;
        if (r >= valid || is_plus_inf(l)) continue;
        dl = dot(d_o + at, o + at, dim);
        for (int32_t c = 0; c < idx.q2k_count[row]; ++c)
          for (int t = 0; t < geo.valid(list[c]); ++t) {
            const int64_t kt = ks.row(b, hk, list[c] * tile_tokens + t);
            const double prob = std::exp(scale * dot(q + at, k + kt, dim) - l);
            const double ds = prob * (dot(d_o + at, v + kt, dim) - dl);
            axpy(scale * ds, k + kt, g, dim);
          }
      }
    }
  });
  parallel_for(p.batch * p.kv_heads * n, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t j = item % n, bk = item / n, b = bk / p.kv_heads, hk = bk % p.kv_heads;
      const int kv_valid = geo.valid(j);
      std::fill(dk + ks.row(b, hk, j * tile_tokens), dk + ks.row(b, hk, (j + 1) * tile_tokens), 0.0);
      std::fill(dv + ks.row(b, hk, j * tile_tokens), dv + ks.row(b, hk, (j + 1) * tile_tokens), 0.0);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const int64_t bh = b * p.q_heads + h;
        for (int64_t i = 0; i < n; ++i) {
          if (!list_holds(idx, bh * n + i, static_cast<int32_t>(j))) continue;
          for (int r = 0; r < geo.valid(i); ++r) {
            const int64_t token = i * tile_tokens + r, at = qs.row(b, h, token);
            const double l = lse[bh * slots + token];
            if (is_plus_inf(l)) continue;
            const double dl = delta[bh * slots + token];
            for (int t = 0; t < kv_valid; ++t) {
              const int64_t kt = ks.row(b, hk, j * tile_tokens + t);
              const double prob = std::exp(scale * dot(q + at, k + kt, dim) - l);
              const double ds = prob * (dot(d_o + at, v + kt, dim) - dl);
              axpy(scale * ds, q + at, dk + kt, dim);
              axpy(prob, d_o + at, dv + kt, dim);
            }
          }
        }
      }
    }
  });
}

inline status check_sparse_common(const problem& p, float scale, const const_tensor& q, const const_tensor& k,
                                  const const_tensor& v, const const_index_lists& idx) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  if (!(s = check_scale(scale))) return s;
  if (!(s = check_tiled("q", q, p, p.q_heads))) return s;
  if (!(s = check_tiled("k", k, p, p.kv_heads))) return s;
  if (!(s = check_tiled("v", v, p, p.kv_heads))) return s;
  return check_q2k_host(p, idx);
}

} // namespace detail

inline status sparse_attention_forward(const problem& p, float scale, const_tensor q, const_tensor k, const_tensor v,
                                       const_index_lists idx, tensor o_s, float* lse) {
  status s = detail::check_sparse_common(p, scale, q, k, v, idx);
  if (!s) return s;
  if (!(s = detail::check_tiled("o_s", o_s, p, p.q_heads))) return s;
  if (!(s = detail::check_array("lse", lse))) return s;
  if (!(s = check_sparse_forward_disjoint(p, q, k, v, idx, o_s, lse))) return s;
  return detail::guarded("sparse_attention_forward", [&]() {
    const int64_t slots = tile_geometry(p.grid).tiled_tokens();
    const int64_t q_size = p.batch * p.q_heads * slots * p.head_dim, k_size = p.batch * p.kv_heads * slots * p.head_dim;
    std::vector<double> qd(q_size), kd(k_size), vd(k_size), od(q_size), l(p.batch * p.q_heads * slots);
    detail::gather(p, p.q_heads, q, qd.data());
    detail::gather(p, p.kv_heads, k, kd.data());
    detail::gather(p, p.kv_heads, v, vd.data());
    detail::sparse_forward_core(p, scale, qd.data(), kd.data(), vd.data(), idx, od.data(), l.data());
    detail::scatter(p, p.q_heads, od.data(), o_s);
    for (std::size_t r = 0; r < l.size(); ++r) lse[r] = static_cast<float>(l[r]);
    return status::ok();
  });
}

inline status sparse_attention_backward(const problem& p, float scale, const_tensor q, const_tensor k, const_tensor v,
                                        const_tensor o_s, const_tensor d_o, const float* lse, const_index_lists idx,
                                        tensor dq, tensor dk, tensor dv) {
  status s = detail::check_sparse_common(p, scale, q, k, v, idx);
  if (!s) return s;
  if (!(s = detail::check_tiled("o_s", o_s, p, p.q_heads))) return s;
  if (!(s = detail::check_tiled("d_o", d_o, p, p.q_heads))) return s;
  if (!(s = detail::check_array("lse", lse))) return s;
  if (!(s = detail::check_tiled("dq", dq, p, p.q_heads))) return s;
  if (!(s = detail::check_tiled("dk", dk, p, p.kv_heads))) return s;
  if (!(s = detail::check_tiled("dv", dv, p, p.kv_heads))) return s;
  if (!(s = check_sparse_backward_disjoint(p, q, k, v, o_s, d_o, lse, idx, false, dq, dk, dv, nullptr, 0))) return s;
  return detail::guarded("sparse_attention_backward", [&]() {
    const int64_t slots = tile_geometry(p.grid).tiled_tokens();
    const int64_t q_size = p.batch * p.q_heads * slots * p.head_dim, k_size = p.batch * p.kv_heads * slots * p.head_dim;
    std::vector<double> qd(q_size), kd(k_size), vd(k_size), od(q_size), dod(q_size), l(p.batch * p.q_heads * slots);
    detail::gather(p, p.q_heads, q, qd.data());
    detail::gather(p, p.kv_heads, k, kd.data());
    detail::gather(p, p.kv_heads, v, vd.data());
    detail::gather(p, p.q_heads, o_s, od.data());
    detail::gather(p, p.q_heads, d_o, dod.data());
    for (std::size_t r = 0; r < l.size(); ++r) l[r] = lse[r];
    std::vector<double> dqd(q_size), dkd(k_size), dvd(k_size), delta(l.size());
    detail::sparse_backward_core(p, scale, qd.data(), kd.data(), vd.data(), od.data(), dod.data(), l.data(), idx,
                                 dqd.data(), dkd.data(), dvd.data(), delta.data());
    detail::scatter(p, p.q_heads, dqd.data(), dq);
    detail::scatter(p, p.kv_heads, dkd.data(), dk);
    detail::scatter(p, p.kv_heads, dvd.data(), dv);
    return status::ok();
  });
}

} // namespace reference
} // namespace vsa
