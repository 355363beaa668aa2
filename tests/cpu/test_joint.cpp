// Joint text + video attention (reference/joint.hpp): with no extra tokens it is the video-only reference bit for
// bit; its sparse pass is a masked dense attention over all N·64 + E keys, written here from the definition; the
// whole op adds the video-only coarse branch to the video rows alone and selects as the video-only op does.
#include "support/host.hpp"

#include <vsa/reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

using namespace vsa;
using test::host_tensor;
using test::layout;
using test::make_problem;
using test::q2k_lists;
using test::random_lists;

namespace {

// The token axis of a joint tensor, from the layout types.hpp describes (not from extra_tokens' own helpers).
struct joint_axis {
  tile_geometry geo;
  extra_tokens extra;
  int64_t slots, tokens;

  joint_axis(const problem& p, extra_tokens e)
      : geo(p.grid), extra(e), slots(geo.tiled_tokens()), tokens(geo.tiled_tokens() + e.count) {}
  bool is_extra(int64_t s) const { return extra.first ? s < extra.count : s >= slots; }
  int64_t slot(int64_t s) const { return extra.first ? s - extra.count : s; } // for a video token
  int64_t token(int64_t slot) const { return extra.first ? slot + extra.count : slot; }
  bool is_padding(int64_t s) const { return !is_extra(s) && slot(s) % 64 >= geo.valid(slot(s) / 64); }
};

host_tensor joint_tensor(const problem& p, const joint_axis& a, int64_t heads, layout order = layout::bshd) {
  return host_tensor(p.type, p.batch, a.tokens, heads, p.head_dim, order);
}

// Normal values on every token, zeros on the padding slots.
host_tensor random_joint(const problem& p, const joint_axis& a, int64_t heads, test::rng& g,
                         layout order = layout::bshd) {
  host_tensor x = joint_tensor(p, a, heads, order);
  for (int64_t b = 0; b < x.batch; ++b)
    for (int64_t s = 0; s < x.tokens; ++s)
      for (int64_t h = 0; h < x.heads; ++h)
        for (int64_t d = 0; d < x.dim; ++d) x.set(b, s, h, d, a.is_padding(s) ? 0.0 : g.normal());
  return x;
}

// The video part of a joint tensor, as a tensor of its own (N·64 slots).
host_tensor video_part(const host_tensor& x, const joint_axis& a) {
  host_tensor r(x.type, x.batch, a.slots, x.heads, x.dim, x.order);
  for (int64_t b = 0; b < x.batch; ++b)
    for (int64_t s = 0; s < a.slots; ++s)
      for (int64_t h = 0; h < x.heads; ++h)
        for (int64_t d = 0; d < x.dim; ++d) r.set(b, s, h, d, x.get(b, a.token(s), h, d));
  return r;
}

struct inputs {
  host_tensor q, k, v;
};

inputs random_inputs(const problem& p, const joint_axis& a, test::rng& g, layout order = layout::bshd) {
  return {random_joint(p, a, p.q_heads, g, order), random_joint(p, a, p.kv_heads, g, order),
          random_joint(p, a, p.kv_heads, g, order)};
}

struct fine_out {
  host_tensor o;
  std::vector<float> lse;
};

fine_out run_forward(const problem& p, const joint_axis& a, float scale, const inputs& x, const q2k_lists& lists) {
  fine_out r{joint_tensor(p, a, p.q_heads, x.q.order),
             std::vector<float>(static_cast<std::size_t>(p.batch * p.q_heads * a.tokens))};
  r.o.fill_byte(test::poison_byte);
  const status s = reference::joint_sparse_attention_forward(p, a.extra, scale, x.q.cview(), x.k.cview(), x.v.cview(),
                                                             lists.view(), r.o.view(), r.lse.data());
  INFO(s.message());
  REQUIRE(s.is_ok());
  return r;
}

struct grads {
  host_tensor dq, dk, dv;
};

grads run_backward(const problem& p, const joint_axis& a, float scale, const inputs& x, const fine_out& f,
                   const host_tensor& d_o, const q2k_lists& lists) {
  grads r{joint_tensor(p, a, p.q_heads, x.q.order), joint_tensor(p, a, p.kv_heads, x.q.order),
          joint_tensor(p, a, p.kv_heads, x.q.order)};
  for (host_tensor* t : {&r.dq, &r.dk, &r.dv}) t->fill_byte(test::poison_byte);
  const status s = reference::joint_sparse_attention_backward(p, a.extra, scale, x.q.cview(), x.k.cview(), x.v.cview(),
                                                              f.o.cview(), d_o.cview(), f.lse.data(), lists.view(),
                                                              r.dq.view(), r.dk.view(), r.dv.view());
  INFO(s.message());
  REQUIRE(s.is_ok());
  return r;
}

// Random inputs in `order`, random lists of `capacity` tiles and dL/do on every row (padding included: the pass
// must ignore it), through the joint sparse pass forward and backward.
struct sparse_run {
  inputs x;
  q2k_lists lists;
  host_tensor d_o;
  fine_out f;
  grads gr;
};

sparse_run run_sparse(const problem& p, const joint_axis& a, float scale, int64_t capacity, test::rng& g,
                      layout order = layout::bshd) {
  sparse_run r{
      random_inputs(p, a, g, order), random_lists(p, capacity, g), joint_tensor(p, a, p.q_heads, order), {}, {}};
  r.d_o.fill_normal(g);
  r.f = run_forward(p, a, scale, r.x, r.lists);
  r.gr = run_backward(p, a, scale, r.x, r.f, r.d_o, r.lists);
  return r;
}

// Attention over all S keys under a mask built from the definition: a video query sees the valid tokens of the
// tiles in its list and every extra token, an extra query every token that is not padding, a padding slot nothing.
// Forward and backward in double, values in [b][s][h][d] order (as test::values), lse [B, Hq, S]. The backward
// forms P from `lse_for_backward` where given: the sparse pass's backward reads the fp32 lse its forward stored, so
// in f64 that is the one difference from the exact gradients (about 1e-7 relative).
struct dense_out {
  std::vector<double> o, lse, dq, dk, dv;
};

dense_out masked_dense(const problem& p, const joint_axis& a, double scale, const inputs& x, const q2k_lists& lists,
                       const host_tensor& d_o, const std::vector<float>* lse_for_backward = nullptr) {
  const int64_t tokens = a.tokens, dim = p.head_dim, n = a.geo.num_tiles(), group = p.q_heads / p.kv_heads;
  const auto sees = [&](int64_t b, int64_t h, int64_t query, int64_t key) {
    if (a.is_padding(query) || a.is_padding(key)) return false;
    if (a.is_extra(query) || a.is_extra(key)) return true;
    const int64_t row = (b * p.q_heads + h) * n + a.slot(query) / 64;
    for (int32_t c = 0; c < lists.count[row]; ++c)
      if (lists.q2k[row * lists.capacity + c] == a.slot(key) / 64) return true;
    return false;
  };
  const auto at = [&](int64_t b, int64_t s, int64_t h, int64_t heads) { return ((b * tokens + s) * heads + h) * dim; };
  dense_out r;
  const std::size_t q_size = static_cast<std::size_t>(p.batch * tokens * p.q_heads * dim),
                    k_size = static_cast<std::size_t>(p.batch * tokens * p.kv_heads * dim);
  r.o.assign(q_size, 0.0);
  r.dq.assign(q_size, 0.0);
  r.dk.assign(k_size, 0.0);
  r.dv.assign(k_size, 0.0);
  r.lse.assign(static_cast<std::size_t>(p.batch * p.q_heads * tokens), INFINITY);
  std::vector<int64_t> keys;
  std::vector<double> prob;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.q_heads; ++h)
      for (int64_t qs = 0; qs < tokens; ++qs) {
        const int64_t hk = h / group;
        keys.clear();
        for (int64_t ks = 0; ks < tokens; ++ks)
          if (sees(b, h, qs, ks)) keys.push_back(ks);
        if (keys.empty()) continue;
        prob.assign(keys.size(), 0.0);
        double m = -INFINITY;
        for (std::size_t j = 0; j < keys.size(); ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < dim; ++d) dot += x.q.get(b, qs, h, d) * x.k.get(b, keys[j], hk, d);
          prob[j] = scale * dot;
          m = std::max(m, prob[j]);
        }
        double sum = 0.0;
        for (double s : prob) sum += std::exp(s - m);
        const std::size_t row = static_cast<std::size_t>((b * p.q_heads + h) * tokens + qs);
        r.lse[row] = m + std::log(sum);
        double* o = &r.o[at(b, qs, h, p.q_heads)];
        for (std::size_t j = 0; j < keys.size(); ++j)
          for (int64_t d = 0; d < dim; ++d) o[d] += std::exp(prob[j] - r.lse[row]) * x.v.get(b, keys[j], hk, d);
        const double lse = lse_for_backward != nullptr ? (*lse_for_backward)[row] : r.lse[row];
        for (double& s : prob) s = std::exp(s - lse);
        // dS = P ⊙ (dO·vᵀ - rowsum(dO ⊙ o)); dq = scale·dS·k, dk = scale·dSᵀ·q, dv = Pᵀ·dO.
        double delta = 0.0;
        for (int64_t d = 0; d < dim; ++d) delta += d_o.get(b, qs, h, d) * o[d];
        for (std::size_t j = 0; j < keys.size(); ++j) {
          double dp = 0.0;
          for (int64_t d = 0; d < dim; ++d) dp += d_o.get(b, qs, h, d) * x.v.get(b, keys[j], hk, d);
          const double ds = prob[j] * (dp - delta);
          for (int64_t d = 0; d < dim; ++d) {
            r.dq[at(b, qs, h, p.q_heads) + d] += scale * ds * x.k.get(b, keys[j], hk, d);
            r.dk[at(b, keys[j], hk, p.kv_heads) + d] += scale * ds * x.q.get(b, qs, h, d);
            r.dv[at(b, keys[j], hk, p.kv_heads) + d] += prob[j] * d_o.get(b, qs, h, d);
          }
        }
      }
  return r;
}

// The largest difference between the pass's fp32 lse and the dense one, relative to max(1, |lse|); +inf where
// one is +inf and the other is not.
double lse_error(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0.0;
  for (std::size_t r = 0; r < want.size(); ++r) {
    if (std::isinf(want[r]) || std::isinf(got[r])) {
      if (!(std::isinf(want[r]) && std::isinf(got[r]) && got[r] > 0)) return INFINITY;
      continue;
    }
    worst = std::max(worst, std::fabs(got[r] - want[r]) / std::max(1.0, std::fabs(want[r])));
  }
  return worst;
}

// The whole op's tensors with extra tokens: the gate's extra rows hold NaN, which the op must not read.
struct op_tensors {
  host_tensor q, k, v, gate;
};

op_tensors random_op(const problem& p, const joint_axis& a, test::rng& g) {
  op_tensors x{random_joint(p, a, p.q_heads, g), random_joint(p, a, p.kv_heads, g), random_joint(p, a, p.kv_heads, g),
               random_joint(p, a, p.q_heads, g)};
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t s = 0; s < a.tokens; ++s)
      for (int64_t h = 0; h < p.q_heads; ++h)
        for (int64_t d = 0; d < p.head_dim; ++d)
          if (a.is_extra(s)) x.gate.set(b, s, h, d, NAN);
  return x;
}

forward_io forward_args(const op_tensors& x, host_tensor& o) {
  return {x.q.cview(), x.k.cview(), x.v.cview(), x.gate.cview(), o.view()};
}

struct op_grads {
  host_tensor dq, dk, dv, dgate;
};

op_grads op_grad_tensors(const problem& p, const joint_axis& a) {
  op_grads r{joint_tensor(p, a, p.q_heads), joint_tensor(p, a, p.kv_heads), joint_tensor(p, a, p.kv_heads),
             joint_tensor(p, a, p.q_heads)};
  for (host_tensor* t : {&r.dq, &r.dk, &r.dv, &r.dgate}) t->fill_byte(test::poison_byte);
  return r;
}

backward_io backward_args(const op_tensors& x, const host_tensor& o, const host_tensor& d_o, op_grads& r) {
  return {x.q.cview(), x.k.cview(), x.v.cview(), x.gate.cview(), o.cview(),
          d_o.cview(), r.dq.view(), r.dk.view(), r.dv.view(),    r.dgate.view()};
}

bool has_nan(const host_tensor& t) {
  for (int64_t e = 0; e < t.elements(); ++e)
    if (std::isnan(t.at(e))) return true;
  return false;
}

} // namespace

// Both sides run the same reference cores (the video-only entry points pass no extra tokens), so this case checks
// the joint entry points' plumbing at E = 0; that the cores themselves still compute the video-only op is what
// test_sparse.cpp and test_op.cpp check, against their own independent references.
TEST_CASE("with no extra tokens the joint sparse pass and the joint op are the video-only ones, bit for bit",
          "[cpu][joint]") {
  VSA_TEST_RNG(g, "joint none");
  for (const dtype t : {dtype::f64, dtype::bf16}) {
    for (const bool first : {false, true}) {
      INFO(dtype_name(t) << (first ? ", first" : ", last"));
      const problem p = make_problem({5, 6, 7}, 2, 4, 2, 16, t);
      const joint_axis a(p, {0, first});
      const float scale = 0.3f;
      const sparse_run run = run_sparse(p, a, scale, 5, g);
      const inputs& x = run.x;
      const q2k_lists& lists = run.lists;
      const host_tensor& d_o = run.d_o;
      host_tensor o(t, 2, a.slots, 4, 16), dq(t, 2, a.slots, 4, 16), dk(t, 2, a.slots, 2, 16), dv(t, 2, a.slots, 2, 16);
      std::vector<float> lse(run.f.lse.size());
      REQUIRE(reference::sparse_attention_forward(p, scale, x.q.cview(), x.k.cview(), x.v.cview(), lists.view(),
                                                  o.view(), lse.data())
                  .is_ok());
      REQUIRE(reference::sparse_attention_backward(p, scale, x.q.cview(), x.k.cview(), x.v.cview(), o.cview(),
                                                   d_o.cview(), lse.data(), lists.view(), dq.view(), dk.view(),
                                                   dv.view())
                  .is_ok());
      CHECK(run.f.o.bytes == o.bytes);
      CHECK(run.f.lse == lse);
      CHECK(run.gr.dq.bytes == dq.bytes);
      CHECK(run.gr.dk.bytes == dk.bytes);
      CHECK(run.gr.dv.bytes == dv.bytes);

      // The whole op, gated, in one workspace each.
      const op_tensors y{x.q, x.k, x.v, random_joint(p, a, p.q_heads, g)};
      options opt;
      opt.top_k = 3;
      host_tensor o_video(t, 2, a.slots, 4, 16), o_joint(t, 2, a.slots, 4, 16);
      op_grads video = op_grad_tensors(p, a), joint = op_grad_tensors(p, a);
      std::size_t video_bytes = 0, joint_bytes = 0, bytes = 0;
      REQUIRE(reference::backward(p, opt, backward_args(y, o_video, d_o, video), nullptr, video_bytes).is_ok());
      REQUIRE(reference::joint_backward(p, a.extra, opt, backward_args(y, o_joint, d_o, joint), nullptr, joint_bytes)
                  .is_ok());
      CHECK(joint_bytes == video_bytes);
      test::aligned_buffer ws_video(video_bytes), ws_joint(joint_bytes);
      bytes = video_bytes;
      REQUIRE(reference::forward(p, opt, forward_args(y, o_video), ws_video.data(), bytes).is_ok());
      REQUIRE(reference::backward(p, opt, backward_args(y, o_video, d_o, video), ws_video.data(), bytes).is_ok());
      bytes = joint_bytes;
      REQUIRE(reference::joint_forward(p, a.extra, opt, forward_args(y, o_joint), ws_joint.data(), bytes).is_ok());
      REQUIRE(reference::joint_backward(p, a.extra, opt, backward_args(y, o_joint, d_o, joint), ws_joint.data(), bytes)
                  .is_ok());
      CHECK(o_joint.bytes == o_video.bytes);
      CHECK(joint.dq.bytes == video.dq.bytes);
      CHECK(joint.dk.bytes == video.dk.bytes);
      CHECK(joint.dv.bytes == video.dv.bytes);
      CHECK(joint.dgate.bytes == video.dgate.bytes);
    }
  }
}

TEST_CASE("the joint sparse pass is masked dense attention over the video and the extra tokens", "[cpu][joint]") {
  VSA_TEST_RNG(g, "joint dense");
  // Partial tiles in every shape; GQA and [B, H, S, D] in some cases; extra counts that are no multiple of 64.
  struct shape {
    grid3 grid;
    int64_t batch, q_heads, kv_heads, dim, capacity;
    layout order;
  };
  const shape shapes[] = {{{5, 6, 7}, 2, 4, 2, 16, 5, layout::bshd},
                          {{4, 8, 5}, 1, 2, 1, 32, 3, layout::bhsd},
                          {{5, 6, 7}, 1, 3, 3, 16, 4, layout::bhsd},
                          {{4, 8, 5}, 2, 2, 2, 16, 2, layout::bshd}};
  int c = 0;
  for (const int64_t count : {1, 77, 256, 333})
    for (const bool first : {true, false}) {
      const shape& sh = shapes[c++ % 4];
      INFO("E = " << count << (first ? " first" : " last") << ", grid " << sh.grid.t << "x" << sh.grid.h << "x"
                  << sh.grid.w << ", heads " << sh.q_heads << "/" << sh.kv_heads << ", D " << sh.dim
                  << (sh.order == layout::bhsd ? ", bhsd" : ", bshd"));
      const problem p = make_problem(sh.grid, sh.batch, sh.q_heads, sh.kv_heads, sh.dim, dtype::f64);
      const joint_axis a(p, {count, first});
      const float scale = 0.35f;
      const sparse_run run = run_sparse(p, a, scale, sh.capacity, g, sh.order);
      const fine_out& f = run.f;
      const grads& gr = run.gr;
      const dense_out want = masked_dense(p, a, scale, run.x, run.lists, run.d_o),
                      given = masked_dense(p, a, scale, run.x, run.lists, run.d_o, &f.lse);
      CHECK(test::rel_error(test::values(f.o), want.o) < 1e-12);
      CHECK(lse_error(f.lse, want.lse) < 1e-6); // the lse is stored in fp32
      CHECK(test::rel_error(test::values(gr.dq), given.dq) < 1e-10);
      CHECK(test::rel_error(test::values(gr.dk), given.dk) < 1e-10);
      CHECK(test::rel_error(test::values(gr.dv), given.dv) < 1e-10);
      CHECK(test::rel_error(test::values(gr.dq), want.dq) < 1e-5);
      CHECK(test::rel_error(test::values(gr.dk), want.dk) < 1e-5);
      CHECK(test::rel_error(test::values(gr.dv), want.dv) < 1e-5);
      // Padding rows: o = 0, lse = +inf and no gradient, exactly.
      bool padding_zero = true;
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t s = 0; s < a.tokens; ++s)
          if (a.is_padding(s))
            for (int64_t h = 0; h < p.q_heads; ++h) {
              padding_zero = padding_zero && std::isinf(f.lse[(b * p.q_heads + h) * a.tokens + s]);
              for (int64_t d = 0; d < p.head_dim; ++d) {
                padding_zero = padding_zero && f.o.get(b, s, h, d) == 0.0 && gr.dq.get(b, s, h, d) == 0.0;
                if (h < p.kv_heads)
                  padding_zero = padding_zero && gr.dk.get(b, s, h, d) == 0.0 && gr.dv.get(b, s, h, d) == 0.0;
              }
            }
      CHECK(padding_zero);
    }

  {
    INFO("bf16");
    const problem p = make_problem({5, 6, 7}, 1, 4, 2, 16, dtype::bf16);
    const joint_axis a(p, {77, true});
    const float scale = 0.35f;
    const sparse_run run = run_sparse(p, a, scale, 4, g);
    const fine_out& f = run.f;
    const grads& gr = run.gr;
    const dense_out want = masked_dense(p, a, scale, run.x, run.lists, run.d_o);
    // One bf16 rounding of o (2^-9), and the backward reads that o and the fp32 lse.
    CHECK(test::rel_error(test::values(f.o), want.o) < 4e-3);
    CHECK(lse_error(f.lse, want.lse) < 1e-6);
    CHECK(test::rel_error(test::values(gr.dq), want.dq) < 6e-3);
    CHECK(test::rel_error(test::values(gr.dk), want.dk) < 6e-3);
    CHECK(test::rel_error(test::values(gr.dv), want.dv) < 4e-3);
  }
}

TEST_CASE("the joint op takes its coarse branch, gate and selection from the video, its extra rows attention alone",
          "[cpu][joint][op]") {
  VSA_TEST_RNG(g, "joint op");
  for (const extra_tokens extra : {extra_tokens{77, true}, extra_tokens{333, false}}) {
    INFO("E = " << extra.count << (extra.first ? " first" : " last"));
    const problem p = make_problem({5, 6, 7}, 2, 2, 1, 8, dtype::f64);
    const joint_axis a(p, extra);
    const op_tensors x = random_op(p, a, g);
    host_tensor d_o = random_joint(p, a, p.q_heads, g);
    options opt;
    opt.top_k = 3;

    // The joint op, its memory in two parts.
    host_tensor o = joint_tensor(p, a, p.q_heads);
    o.fill_byte(test::poison_byte);
    op_grads gr = op_grad_tensors(p, a);
    op_buffers fq, bq;
    REQUIRE(reference::joint_forward(p, extra, opt, forward_args(x, o), fq).is_ok());
    REQUIRE(reference::joint_backward(p, extra, opt, backward_args(x, o, d_o, gr), bq).is_ok());
    test::aligned_buffer state(fq.state_bytes), forward_scratch(fq.scratch_bytes), backward_scratch(bq.scratch_bytes);
    op_buffers fb{state.data(), fq.state_bytes, forward_scratch.data(), fq.scratch_bytes};
    op_buffers bb{state.data(), bq.state_bytes, backward_scratch.data(), bq.scratch_bytes};
    REQUIRE(reference::joint_forward(p, extra, opt, forward_args(x, o), fb).is_ok());
    REQUIRE(reference::joint_backward(p, extra, opt, backward_args(x, o, d_o, gr), bb).is_ok());
    CHECK(!has_nan(o)); // the gate's extra rows (NaN) are never read
    for (const host_tensor* t : {&gr.dq, &gr.dk, &gr.dv, &gr.dgate}) CHECK(!has_nan(*t));

    // The video-only op on the video parts selects the same tiles: extra keys take no slot of the k.
    const op_tensors xv{video_part(x.q, a), video_part(x.k, a), video_part(x.v, a), video_part(x.gate, a)};
    host_tensor o_video(p.type, p.batch, a.slots, p.q_heads, p.head_dim), o_plain = o_video;
    std::size_t bytes = 0;
    REQUIRE(reference::forward(p, opt, forward_args(xv, o_video), nullptr, bytes).is_ok());
    test::aligned_buffer ws(bytes), ws_plain(bytes);
    REQUIRE(reference::forward(p, opt, forward_args(xv, o_video), ws.data(), bytes).is_ok());
    const_index_lists joint_sel, video_sel;
    REQUIRE(reference::joint_selected_lists(p, extra, opt, state.data(), joint_sel).is_ok());
    REQUIRE(reference::selected_lists(p, opt, ws.data(), video_sel).is_ok());
    const int64_t rows = p.batch * p.q_heads * a.geo.num_tiles();
    REQUIRE(joint_sel.q2k_capacity == video_sel.q2k_capacity);
    CHECK(std::vector<int32_t>(joint_sel.q2k, joint_sel.q2k + rows * 3) ==
          std::vector<int32_t>(video_sel.q2k, video_sel.q2k + rows * 3));
    CHECK(std::vector<int32_t>(joint_sel.q2k_count, joint_sel.q2k_count + rows) ==
          std::vector<int32_t>(video_sel.q2k_count, video_sel.q2k_count + rows));

    // o_c broadcast over its tile, from the video-only op: its output with g = 1 less its sparse pass.
    forward_io plain = forward_args(xv, o_plain);
    plain.gate.data = nullptr;
    REQUIRE(reference::forward(p, opt, plain, ws_plain.data(), bytes).is_ok());
    const float scale = reference::resolve_scale(p, opt);
    host_tensor o_s_video(p.type, p.batch, a.slots, p.q_heads, p.head_dim);
    std::vector<float> lse_video(static_cast<std::size_t>(rows * 64));
    REQUIRE(reference::sparse_attention_forward(p, scale, xv.q.cview(), xv.k.cview(), xv.v.cview(), video_sel,
                                                o_s_video.view(), lse_video.data())
                .is_ok());
    // The joint sparse pass on the same lists.
    host_tensor o_s = joint_tensor(p, a, p.q_heads);
    std::vector<float> lse(static_cast<std::size_t>(p.batch * p.q_heads * a.tokens));
    REQUIRE(reference::joint_sparse_attention_forward(p, extra, scale, x.q.cview(), x.k.cview(), x.v.cview(), joint_sel,
                                                      o_s.view(), lse.data())
                .is_ok());

    std::vector<double> want_o, got_o, want_dgate, got_dgate;
    bool extra_rows_exact = true, padding_zero = true;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t s = 0; s < a.tokens; ++s)
        for (int64_t h = 0; h < p.q_heads; ++h)
          for (int64_t d = 0; d < p.head_dim; ++d) {
            if (a.is_extra(s)) {
              extra_rows_exact =
                  extra_rows_exact && o.get(b, s, h, d) == o_s.get(b, s, h, d) && gr.dgate.get(b, s, h, d) == 0.0;
            } else if (a.is_padding(s)) {
              padding_zero = padding_zero && o.get(b, s, h, d) == 0.0 && gr.dgate.get(b, s, h, d) == 0.0;
            } else {
              const int64_t slot = a.slot(s);
              const double o_c = o_plain.get(b, slot, h, d) - o_s_video.get(b, slot, h, d);
              want_o.push_back(o_s.get(b, s, h, d) + x.gate.get(b, s, h, d) * o_c);
              got_o.push_back(o.get(b, s, h, d));
              want_dgate.push_back(d_o.get(b, s, h, d) * o_c);
              got_dgate.push_back(gr.dgate.get(b, s, h, d));
            }
          }
    CHECK(test::rel_error(got_o, want_o) < 1e-13);
    CHECK(test::rel_error(got_dgate, want_dgate) < 1e-12);
    CHECK(extra_rows_exact);
    CHECK(padding_zero);

    // In raster order the video part of o and of every gradient is the tiled one untiled; the extra rows stay.
    options raster = opt;
    raster.output_order = token_order::raster;
    const int64_t raster_tokens = a.geo.raster_tokens() + extra.count;
    const auto raster_tensor = [&](int64_t heads) {
      return host_tensor(p.type, p.batch, raster_tokens, heads, p.head_dim);
    };
    host_tensor o_r = raster_tensor(p.q_heads);
    op_grads gr_r{raster_tensor(p.q_heads), raster_tensor(p.kv_heads), raster_tensor(p.kv_heads),
                  raster_tensor(p.q_heads)};
    bytes = 0;
    REQUIRE(reference::joint_backward(p, extra, raster, backward_args(x, o_r, d_o, gr_r), nullptr, bytes).is_ok());
    test::aligned_buffer ws_r(bytes);
    REQUIRE(reference::joint_forward(p, extra, raster, forward_args(x, o_r), ws_r.data(), bytes).is_ok());
    REQUIRE(reference::joint_backward(p, extra, raster, backward_args(x, o_r, d_o, gr_r), ws_r.data(), bytes).is_ok());
    const std::vector<int64_t> slot_of = test::tiled_slots(p.grid);
    const auto same = [&](const host_tensor& tiled, const host_tensor& r) {
      bool equal = true;
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t s = 0; s < raster_tokens; ++s) {
          // Raster token s of the joint tensor: an extra token, or video token s - first's count.
          const int64_t video = extra.first ? s - extra.count : s;
          const bool is_extra = video < 0 || video >= a.geo.raster_tokens();
          const int64_t from = is_extra ? (extra.first ? s : a.slots + (s - a.geo.raster_tokens()))
                                        : a.token(slot_of[static_cast<std::size_t>(video)]);
          for (int64_t h = 0; h < tiled.heads; ++h)
            for (int64_t d = 0; d < p.head_dim; ++d) equal = equal && r.get(b, s, h, d) == tiled.get(b, from, h, d);
        }
      return equal;
    };
    CHECK(same(o, o_r));
    CHECK(same(gr.dq, gr_r.dq));
    CHECK(same(gr.dk, gr_r.dk));
    CHECK(same(gr.dv, gr_r.dv));
    CHECK(same(gr.dgate, gr_r.dgate));
  }
}

TEST_CASE("the joint op on caller lists is the joint sparse pass", "[cpu][joint][op]") {
  VSA_TEST_RNG(g, "joint op lists");
  for (const dtype t : {dtype::f64, dtype::bf16})
    for (const extra_tokens extra : {extra_tokens{77, false}, extra_tokens{5, true}}) {
      INFO(dtype_name(t) << ", E = " << extra.count << (extra.first ? " first" : " last"));
      const problem p = make_problem({5, 6, 7}, 1, 4, 2, 16, t);
      const joint_axis a(p, extra);
      const op_tensors x = random_op(p, a, g);
      const host_tensor d_o = random_joint(p, a, p.q_heads, g);
      const test::q2k_lists lists = test::random_lists(p, 3, g);
      options opt;
      opt.q2k = lists.view();

      host_tensor o = joint_tensor(p, a, p.q_heads);
      o.fill_byte(test::poison_byte);
      op_grads gr = op_grad_tensors(p, a);
      forward_io fio = forward_args(x, o);
      backward_io bio = backward_args(x, o, d_o, gr);
      fio.gate = {}; // the op on caller lists takes no gate
      bio.gate = {};
      bio.dgate = {};
      std::size_t bytes = 0, back_bytes = 0;
      REQUIRE(reference::joint_forward(p, extra, opt, fio, nullptr, bytes).is_ok());
      REQUIRE(reference::joint_backward(p, extra, opt, bio, nullptr, back_bytes).is_ok());
      test::aligned_buffer ws(std::max(bytes, back_bytes));
      REQUIRE(reference::joint_forward(p, extra, opt, fio, ws.data(), bytes).is_ok());
      REQUIRE(reference::joint_backward(p, extra, opt, bio, ws.data(), back_bytes).is_ok());

      const float scale = reference::resolve_scale(p, opt);
      host_tensor o_s = joint_tensor(p, a, p.q_heads);
      std::vector<float> lse(static_cast<std::size_t>(p.batch * p.q_heads * a.tokens));
      REQUIRE(reference::joint_sparse_attention_forward(p, extra, scale, x.q.cview(), x.k.cview(), x.v.cview(),
                                                        lists.view(), o_s.view(), lse.data())
                  .is_ok());
      op_grads want = op_grad_tensors(p, a);
      REQUIRE(reference::joint_sparse_attention_backward(p, extra, scale, x.q.cview(), x.k.cview(), x.v.cview(),
                                                         o_s.cview(), d_o.cview(), lse.data(), lists.view(),
                                                         want.dq.view(), want.dk.view(), want.dv.view())
                  .is_ok());
      // o is the sparse pass's; the gradients differ by the fp32 rounding of the sparse pass's stored lse (the op
      // keeps its own in double), and in bf16 by the rounding of the outputs.
      const double tol = t == dtype::f64 ? 1e-5 : 1e-2;
      CHECK(test::rel_error(test::values(o), test::values(o_s)) < (t == dtype::f64 ? 1e-12 : 1e-2));
      CHECK(test::rel_error(test::values(gr.dq), test::values(want.dq)) < tol);
      CHECK(test::rel_error(test::values(gr.dk), test::values(want.dk)) < tol);
      CHECK(test::rel_error(test::values(gr.dv), test::values(want.dv)) < tol);
      for (const host_tensor* r : {&o, &gr.dq, &gr.dk, &gr.dv}) CHECK(!has_nan(*r));
    }
}

TEST_CASE("the joint op backward matches finite differences of the whole op", "[cpu][joint][op][grad]") {
  VSA_TEST_RNG(g, "joint op backward");
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 8, dtype::f64);
  const joint_axis a(p, {77, true});
  op_tensors x = random_op(p, a, g);
  options opt;
  opt.top_k = 3;
  // Fixed lists (joint_forward_on_lists), so that the op is a smooth function of its inputs: a step of the
  // differences below could otherwise change the selection.
  const q2k_lists lists = random_lists(p, 3, g);
  host_tensor w = random_joint(p, a, p.q_heads, g); // dL/do, on padding rows too: they must be ignored
  std::size_t bytes = 0;
  host_tensor o = joint_tensor(p, a, p.q_heads);
  op_grads gr = op_grad_tensors(p, a);
  REQUIRE(reference::joint_backward(p, a.extra, opt, backward_args(x, o, w, gr), nullptr, bytes).is_ok());
  test::aligned_buffer ws(bytes);
  const auto forward = [&]() {
    std::size_t size = bytes;
    REQUIRE(
        reference::joint_forward_on_lists(p, a.extra, opt, forward_args(x, o), lists.view(), ws.data(), size).is_ok());
  };
  const auto loss = [&]() {
    forward();
    return test::inner(o, w);
  };
  forward();
  REQUIRE(reference::joint_backward(p, a.extra, opt, backward_args(x, o, w, gr), ws.data(), bytes).is_ok());

  const std::pair<host_tensor*, const host_tensor*> pairs[] = {
      {&x.q, &gr.dq}, {&x.k, &gr.dk}, {&x.v, &gr.dv}, {&x.gate, &gr.dgate}};
  for (const auto& pr : pairs) {
    const bool gate = pr.first == &x.gate;
    for (int direction = 0; direction < 2; ++direction) {
      host_tensor u = random_joint(p, a, pr.first->heads, g);
      if (gate) // the gate's extra rows are NaN, and not read: move the video rows only
        for (int64_t s = 0; s < a.tokens; ++s)
          for (int64_t h = 0; h < u.heads; ++h)
            for (int64_t d = 0; d < 8; ++d)
              if (a.is_extra(s)) u.set(0, s, h, d, 0.0);
      const double fd = test::directional_difference(*pr.first, u, 1e-6, loss);
      const double analytic = test::inner(*pr.second, u);
      // Relative to ||grad||·||u||, the size a sum of rounding errors over all elements can reach.
      CHECK(std::fabs(fd - analytic) <= 1e-6 * test::norm(*pr.second) * test::norm(u));
    }
    // Single elements, half of them on extra rows (but not the gate's).
    for (int trial = 0; trial < 8; ++trial) {
      const bool on_extra = trial % 2 == 1 && !gate;
      int64_t s = g.integer(0, a.tokens - 1);
      while (a.is_padding(s) || a.is_extra(s) != on_extra) s = g.integer(0, a.tokens - 1);
      const int64_t h = g.integer(0, pr.first->heads - 1), d = g.integer(0, 7);
      const double fd = test::element_difference(*pr.first, pr.first->index(0, s, h, d), 1e-6, loss);
      CHECK(fd == Approx(pr.second->get(0, s, h, d)).epsilon(1e-5).margin(1e-7));
    }
  }
  // Padding slots of every gradient and the extra rows of dgate are exactly 0.
  for (const host_tensor* t : {&gr.dq, &gr.dk, &gr.dv, &gr.dgate})
    for (int64_t s = 0; s < a.tokens; ++s)
      if (a.is_padding(s) || (t == &gr.dgate && a.is_extra(s)))
        for (int64_t h = 0; h < t->heads; ++h)
          for (int64_t d = 0; d < 8; ++d) REQUIRE(t->get(0, s, h, d) == 0.0);
}

TEST_CASE("the joint entry points reject bad extra tokens and token counts by name, writing nothing",
          "[cpu][joint][errors]") {
  VSA_TEST_RNG(g, "joint errors");
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 8, dtype::bf16);
  const extra_tokens extra{77, true};
  const joint_axis a(p, extra);
  const op_tensors x = random_op(p, a, g);
  const q2k_lists lists = random_lists(p, 3, g);
  host_tensor d_o = random_joint(p, a, p.q_heads, g), o = joint_tensor(p, a, p.q_heads);
  op_grads gr = op_grad_tensors(p, a);
  o.fill_byte(test::poison_byte);
  std::vector<float> lse(static_cast<std::size_t>(p.q_heads * a.tokens), NAN);
  options opt;
  opt.top_k = 3;
  std::size_t fb = 0, bb = 0;
  REQUIRE(reference::joint_forward(p, extra, opt, forward_args(x, o), nullptr, fb).is_ok());
  REQUIRE(reference::joint_backward(p, extra, opt, backward_args(x, o, d_o, gr), nullptr, bb).is_ok());
  test::aligned_buffer ws(std::max(fb, bb));
  const auto outputs = [&]() {
    std::vector<unsigned char> all = o.bytes;
    for (const host_tensor* t : {&gr.dq, &gr.dk, &gr.dv, &gr.dgate})
      all.insert(all.end(), t->bytes.begin(), t->bytes.end());
    const unsigned char* l = reinterpret_cast<const unsigned char*>(lse.data());
    all.insert(all.end(), l, l + lse.size() * sizeof(float));
    return all;
  };
  const std::vector<unsigned char> before = outputs();
  // Every joint entry point with extra tokens e and q as given, the rest as allocated.
  const auto call_all = [&](extra_tokens e, const_tensor q) {
    std::vector<std::pair<const char*, status>> r;
    const float scale = 0.5f;
    std::size_t bytes = std::max(fb, bb);
    forward_io io = forward_args(x, o);
    io.q = q;
    backward_io bio = backward_args(x, o, d_o, gr);
    bio.q = q;
    r.emplace_back("joint_sparse_attention_forward",
                   reference::joint_sparse_attention_forward(p, e, scale, q, x.k.cview(), x.v.cview(), lists.view(),
                                                             o.view(), lse.data()));
    r.emplace_back("joint_sparse_attention_backward",
                   reference::joint_sparse_attention_backward(p, e, scale, q, x.k.cview(), x.v.cview(), o.cview(),
                                                              d_o.cview(), lse.data(), lists.view(), gr.dq.view(),
                                                              gr.dk.view(), gr.dv.view()));
    r.emplace_back("joint_forward", reference::joint_forward(p, e, opt, io, ws.data(), bytes));
    r.emplace_back("joint_backward", reference::joint_backward(p, e, opt, bio, ws.data(), bytes));
    return r;
  };
  const auto expect_all = [&](extra_tokens e, const_tensor q, errc code, const char* message) {
    for (const auto& call : call_all(e, q)) {
      INFO(call.first << ": " << errc_name(call.second.code()) << ": " << call.second.message());
      CHECK(call.second.code() == code);
      CHECK(std::string(call.second.message()) == message);
    }
    CHECK(outputs() == before);
  };
  expect_all({-1, true}, x.q.cview(), errc::bad_argument, "extra.count: must be >= 0, got -1");
  expect_all({int64_t(1) << 60, false}, x.q.cview(), errc::bad_argument,
             "extra.count: 1152921504606846976 tokens with batch 1 and 2 heads overflow");
  // 512 video slots and 77 extra tokens: q of the video alone, or one token too many.
  const host_tensor video_q = video_part(x.q, a);
  expect_all(extra, video_q.cview(), errc::bad_tokens, "q: holds 512 tokens, 512 video and 77 extra tokens need 589");
  host_tensor long_q(p.type, 1, a.tokens + 1, 2, 8);
  expect_all(extra, long_q.cview(), errc::bad_tokens, "q: holds 590 tokens, 512 video and 77 extra tokens need 589");
  // Extra tokens on tensors that hold none.
  expect_all({5, false}, x.q.cview(), errc::bad_tokens, "q: holds 589 tokens, 512 video and 5 extra tokens need 517");

  // The size queries check the extra tokens too, and need no tensors.
  std::size_t bytes = 0;
  status s = reference::joint_forward(p, {-3, false}, opt, forward_io{}, nullptr, bytes);
  CHECK(s.code() == errc::bad_argument);
  CHECK(test::mentions(s, "extra.count"));
  s = reference::joint_backward(p, {-3, false}, opt, backward_io{}, nullptr, bytes);
  CHECK(s.code() == errc::bad_argument);
  const_index_lists sel;
  CHECK(reference::joint_selected_lists(p, {-3, false}, opt, ws.data(), sel).code() == errc::bad_argument);

  // The outputs and the other inputs are checked against the extra tokens as q is; in raster order the video part
  // of o counts T·H·W tokens.
  host_tensor short_o = video_part(o, a), short_d_o = video_part(d_o, a), short_gate = video_part(x.gate, a);
  bytes = std::max(fb, bb);
  forward_io io = forward_args(x, short_o);
  s = reference::joint_forward(p, extra, opt, io, ws.data(), bytes);
  CHECK(s.code() == errc::bad_tokens);
  CHECK(std::string(s.message()) == "o: holds 512 tokens, 512 video and 77 extra tokens need 589");
  io = forward_args(x, o);
  io.gate = short_gate.cview();
  s = reference::joint_forward(p, extra, opt, io, ws.data(), bytes);
  CHECK(s.code() == errc::bad_tokens);
  CHECK(test::mentions(s, "gate: holds 512 tokens"));
  backward_io bio = backward_args(x, o, short_d_o, gr);
  s = reference::joint_backward(p, extra, opt, bio, ws.data(), bytes);
  CHECK(s.code() == errc::bad_tokens);
  CHECK(test::mentions(s, "d_o: holds 512 tokens"));
  options raster = opt;
  raster.output_order = token_order::raster;
  s = reference::joint_forward(p, extra, raster, forward_args(x, o), ws.data(), bytes);
  CHECK(s.code() == errc::bad_tokens);
  CHECK(std::string(s.message()) == "o: holds 589 tokens, 210 video and 77 extra tokens need 287");
  s = reference::joint_sparse_attention_forward(p, extra, 0.5f, x.q.cview(), x.k.cview(), x.v.cview(), lists.view(),
                                                short_o.view(), lse.data());
  CHECK(s.code() == errc::bad_tokens);
  CHECK(test::mentions(s, "o_s: holds 512 tokens"));
  CHECK(outputs() == before);

  // The lse holds N·64 + E rows per head: one that runs into q only past its first N·64 rows overlaps it.
  const std::size_t lse_video_bytes = sizeof(float) * static_cast<std::size_t>(p.q_heads * a.slots);
  std::vector<unsigned char> shared(lse_video_bytes + x.q.bytes.size());
  std::copy(x.q.bytes.begin(), x.q.bytes.end(), shared.begin() + static_cast<std::ptrdiff_t>(lse_video_bytes));
  const_tensor q_after = x.q.cview();
  q_after.data = shared.data() + lse_video_bytes;
  s = reference::joint_sparse_attention_forward(p, extra, 0.5f, q_after, x.k.cview(), x.v.cview(), lists.view(),
                                                o.view(), reinterpret_cast<float*>(shared.data()));
  CHECK(s.code() == errc::aliased);
  CHECK(std::string(s.message()) == "lse: shares memory with q, which the call reads");
  CHECK(outputs() == before);
}
