// Block-sparse attention over the key tiles each query tile selected, and its backward. With extra tokens
// (extra_tokens, types.hpp) the same pass is the joint attention of reference/joint.hpp: a video query also attends
// to every extra token, an extra query to every valid video token and every extra token.
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

// The token axis of a pass over N·64 video slots and `extra` tokens, S = N·64 + extra.count rows, and its work
// items: the N tiles, then the extra tokens in blocks of up to 64 rows (the same items for queries and keys).
struct joint_rows {
  tile_geometry geo;
  extra_tokens extra;
  int64_t tiles, tokens, video0, extra0, items;

  joint_rows(const problem& p, const extra_tokens& e)
      : geo(p.grid), extra(e), tiles(geo.num_tiles()), tokens(geo.tiled_tokens() + e.count), video0(e.video_start()),
        extra0(e.extra_start(geo.tiled_tokens())), items(tiles + (e.count + tile_tokens - 1) / tile_tokens) {}

  // Row of item i's first token, its rows (a tile's 64 slots, or what is left of the extra tokens) and how many
  // of them are tokens rather than padding.
  int64_t first(int64_t i) const { return i < tiles ? video0 + i * tile_tokens : extra0 + (i - tiles) * tile_tokens; }
  int rows(int64_t i) const {
    return i < tiles ? static_cast<int>(tile_tokens)
                     : static_cast<int>(std::min(tile_tokens, extra.count - (i - tiles) * tile_tokens));
  }
  int valid(int64_t i) const { return i < tiles ? geo.valid(i) : rows(i); }
};

// Dense rows, in kv head (b, hk), of the keys that query item i of head bh attends to: for a tile the valid tokens
// of its selected tiles, for a block of extra rows every valid video token; then every extra token.
inline void item_keys(const joint_rows& jr, const const_index_lists& idx, const dense_shape& ks, int64_t b, int64_t hk,
                      int64_t bh, int64_t i, std::vector<int64_t>& keys) {
  keys.clear();
  if (i < jr.tiles) {
    const int64_t row = bh * jr.tiles + i;
    const int32_t* list = idx.q2k + row * idx.q2k_capacity;
    for (int32_t c = 0; c < idx.q2k_count[row]; ++c)
      for (int t = 0; t < jr.geo.valid(list[c]); ++t)
        keys.push_back(ks.row(b, hk, jr.video0 + list[c] * tile_tokens + t));
  } else {
    for (int64_t j = 0; j < jr.tiles; ++j)
      for (int t = 0; t < jr.geo.valid(j); ++t) keys.push_back(ks.row(b, hk, jr.video0 + j * tile_tokens + t));
  }
  for (int64_t e = 0; e < jr.extra.count; ++e) keys.push_back(ks.row(b, hk, jr.extra0 + e));
}

// Dense doubles: q, o [B, Hq, S, D], k, v [B, Hkv, S, D], lse [B, Hq, S] with S = N·64 + extra.count, the video
// slots and the extra tokens where `extra` places them. Padding query rows and rows with no key (an empty list and
// no extra tokens) get o = 0 and lse = +inf.
inline void sparse_forward_core(const problem& p, double scale, const double* q, const double* k, const double* v,
                                const const_index_lists& idx, double* o, double* lse, const extra_tokens& extra = {}) {
  const joint_rows jr(p, extra);
  const int64_t dim = p.head_dim, group = p.q_heads / p.kv_heads;
  const dense_shape qs{p.batch, p.q_heads, jr.tokens, dim}, ks{p.batch, p.kv_heads, jr.tokens, dim};
  parallel_for(p.batch * p.q_heads * jr.items, [&](int64_t begin, int64_t end) {
    std::vector<double> s;
    std::vector<int64_t> keys; // dense rows of the keys the item's rows attend to
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item % jr.items, bh = item / jr.items, b = bh / p.q_heads, h = bh % p.q_heads, hk = h / group;
      item_keys(jr, idx, ks, b, hk, bh, i, keys);
      s.resize(keys.size());
      const int valid = jr.valid(i);
      for (int r = 0; r < jr.rows(i); ++r) {
        const int64_t token = jr.first(i) + r;
        double* out = o + qs.row(b, h, token);
        std::fill(out, out + dim, 0.0);
        double& l = lse[bh * jr.tokens + token];
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
// over each group), padding slots 0; S and `extra` as in sparse_forward_core. delta is scratch of [B, Hq, S].
// Two passes, as the kernels do: one over query items for dq, one over key items for dk and dv, so that no two
// threads add into one row.
inline void sparse_backward_core(const problem& p, double scale, const double* q, const double* k, const double* v,
                                 const double* o, const double* d_o, const double* lse, const const_index_lists& idx,
                                 double* dq, double* dk, double* dv, double* delta, const extra_tokens& extra = {}) {
  const joint_rows jr(p, extra);
  const int64_t dim = p.head_dim, group = p.q_heads / p.kv_heads;
  const dense_shape qs{p.batch, p.q_heads, jr.tokens, dim}, ks{p.batch, p.kv_heads, jr.tokens, dim};
  parallel_for(p.batch * p.q_heads * jr.items, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item % jr.items, bh = item / jr.items, b = bh / p.q_heads, h = bh % p.q_heads, hk = h / group;
      item_keys(jr, idx, ks, b, hk, bh, i, keys);
      const int valid = jr.valid(i);
      for (int r = 0; r < jr.rows(i); ++r) {
        const int64_t token = jr.first(i) + r, at = qs.row(b, h, token);
        double* g = dq + at;
        std::fill(g, g + dim, 0.0);
        const double l = lse[bh * jr.tokens + token];
        double& dl = delta[bh * jr.tokens + token];
        dl = 0.0;
        if (r >= valid || is_plus_inf(l)) continue;
        dl = dot(d_o + at, o + at, dim);
        for (const int64_t kt : keys) {
          const double prob = std::exp(scale * dot(q + at, k + kt, dim) - l);
          const double ds = prob * (dot(d_o + at, v + kt, dim) - dl);
          axpy(scale * ds, k + kt, g, dim);
        }
      }
    }
  });
  parallel_for(p.batch * p.kv_heads * jr.items, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t j = item % jr.items, bk = item / jr.items, b = bk / p.kv_heads, hk = bk % p.kv_heads;
      const int64_t key0 = jr.first(j);
      const int kv_valid = jr.valid(j);
      std::fill(dk + ks.row(b, hk, key0), dk + ks.row(b, hk, key0 + jr.rows(j)), 0.0);
      std::fill(dv + ks.row(b, hk, key0), dv + ks.row(b, hk, key0 + jr.rows(j)), 0.0);
      // Query row `token` of head h's share of the gradients of item j's keys.
      const auto add_row = [&](int64_t h, int64_t token) {
        const int64_t bh = b * p.q_heads + h, at = qs.row(b, h, token);
        const double l = lse[bh * jr.tokens + token];
        if (is_plus_inf(l)) return;
        const double dl = delta[bh * jr.tokens + token];
        for (int t = 0; t < kv_valid; ++t) {
          const int64_t kt = ks.row(b, hk, key0 + t);
          const double prob = std::exp(scale * dot(q + at, k + kt, dim) - l);
          const double ds = prob * (dot(d_o + at, v + kt, dim) - dl);
          axpy(scale * ds, q + at, dk + kt, dim);
          axpy(prob, d_o + at, dv + kt, dim);
        }
      };
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const int64_t bh = b * p.q_heads + h;
        // The video queries whose tile selected key tile j; every one of them for an extra key.
        for (int64_t i = 0; i < jr.tiles; ++i) {
          if (j < jr.tiles && !list_holds(idx, bh * jr.tiles + i, static_cast<int32_t>(j))) continue;
          for (int r = 0; r < jr.geo.valid(i); ++r) add_row(h, jr.video0 + i * tile_tokens + r);
        }
        // The extra queries attend to every key.
        for (int64_t e = 0; e < extra.count; ++e) add_row(h, jr.extra0 + e);
      }
    }
  });
}

inline status check_sparse_common(const problem& p, const extra_tokens& extra, float scale, const const_tensor& q,
                                  const const_tensor& k, const const_tensor& v, const const_index_lists& idx) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  if (!(s = check_extra_tokens(p, extra))) return s;
  if (!(s = check_scale(scale))) return s;
  if (!(s = check_tiled("q", q, p, p.q_heads, extra))) return s;
  if (!(s = check_tiled("k", k, p, p.kv_heads, extra))) return s;
  if (!(s = check_tiled("v", v, p, p.kv_heads, extra))) return s;
  return check_q2k_host(p, idx);
}

// The sparse pass's entry points, video-only (no extra tokens) and joint: `what` names the call in its errors.
inline status sparse_forward_pass(const char* what, const problem& p, const extra_tokens& extra, float scale,
                                  const const_tensor& q, const const_tensor& k, const const_tensor& v,
                                  const const_index_lists& idx, const tensor& o_s, float* lse) {
  status s = check_sparse_common(p, extra, scale, q, k, v, idx);
  if (!s) return s;
  if (!(s = check_tiled("o_s", o_s, p, p.q_heads, extra))) return s;
  if (!(s = check_array("lse", lse))) return s;
  if (!(s = check_sparse_forward_disjoint(p, q, k, v, idx, o_s, lse, extra))) return s;
  return guarded(what, [&]() {
    const int64_t tokens = q.tokens;
    const int64_t q_size = p.batch * p.q_heads * tokens * p.head_dim,
                  k_size = p.batch * p.kv_heads * tokens * p.head_dim;
    std::vector<double> qd(q_size), kd(k_size), vd(k_size), od(q_size), l(p.batch * p.q_heads * tokens);
    gather(p, p.q_heads, q, qd.data());
    gather(p, p.kv_heads, k, kd.data());
    gather(p, p.kv_heads, v, vd.data());
    sparse_forward_core(p, scale, qd.data(), kd.data(), vd.data(), idx, od.data(), l.data(), extra);
    scatter(p, p.q_heads, od.data(), o_s);
    for (std::size_t r = 0; r < l.size(); ++r) lse[r] = static_cast<float>(l[r]);
    return status::ok();
  });
}

inline status sparse_backward_pass(const char* what, const problem& p, const extra_tokens& extra, float scale,
                                   const const_tensor& q, const const_tensor& k, const const_tensor& v,
                                   const const_tensor& o_s, const const_tensor& d_o, const float* lse,
                                   const const_index_lists& idx, const tensor& dq, const tensor& dk, const tensor& dv) {
  status s = check_sparse_common(p, extra, scale, q, k, v, idx);
  if (!s) return s;
  if (!(s = check_tiled("o_s", o_s, p, p.q_heads, extra))) return s;
  if (!(s = check_tiled("d_o", d_o, p, p.q_heads, extra))) return s;
  if (!(s = check_array("lse", lse))) return s;
  if (!(s = check_tiled("dq", dq, p, p.q_heads, extra))) return s;
  if (!(s = check_tiled("dk", dk, p, p.kv_heads, extra))) return s;
  if (!(s = check_tiled("dv", dv, p, p.kv_heads, extra))) return s;
  if (!(s = check_sparse_backward_disjoint(p, q, k, v, o_s, d_o, lse, idx, false, dq, dk, dv, nullptr, 0, extra)))
    return s;
  return guarded(what, [&]() {
    const int64_t tokens = q.tokens;
    const int64_t q_size = p.batch * p.q_heads * tokens * p.head_dim,
                  k_size = p.batch * p.kv_heads * tokens * p.head_dim;
    std::vector<double> qd(q_size), kd(k_size), vd(k_size), od(q_size), dod(q_size), l(p.batch * p.q_heads * tokens);
    gather(p, p.q_heads, q, qd.data());
    gather(p, p.kv_heads, k, kd.data());
    gather(p, p.kv_heads, v, vd.data());
    gather(p, p.q_heads, o_s, od.data());
    gather(p, p.q_heads, d_o, dod.data());
    for (std::size_t r = 0; r < l.size(); ++r) l[r] = lse[r];
    std::vector<double> dqd(q_size), dkd(k_size), dvd(k_size), delta(l.size());
    sparse_backward_core(p, scale, qd.data(), kd.data(), vd.data(), od.data(), dod.data(), l.data(), idx, dqd.data(),
                         dkd.data(), dvd.data(), delta.data(), extra);
    scatter(p, p.q_heads, dqd.data(), dq);
    scatter(p, p.kv_heads, dkd.data(), dk);
    scatter(p, p.kv_heads, dvd.data(), dv);
    return status::ok();
  });
}

} // namespace detail

inline status sparse_attention_forward(const problem& p, float scale, const_tensor q, const_tensor k, const_tensor v,
                                       const_index_lists idx, tensor o_s, float* lse) {
  return detail::sparse_forward_pass("sparse_attention_forward", p, extra_tokens{}, scale, q, k, v, idx, o_s, lse);
}

inline status sparse_attention_backward(const problem& p, float scale, const_tensor q, const_tensor k, const_tensor v,
                                        const_tensor o_s, const_tensor d_o, const float* lse, const_index_lists idx,
                                        tensor dq, tensor dk, tensor dv) {
  return detail::sparse_backward_pass("sparse_attention_backward", p, extra_tokens{}, scale, q, k, v, o_s, d_o, lse,
                                      idx, dq, dk, dv);
}

} // namespace reference
} // namespace vsa
