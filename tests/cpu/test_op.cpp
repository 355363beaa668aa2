#include "support/host.hpp"

#include <vsa/reference.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace vsa;
using test::host_tensor;
using test::layout;
using test::make_problem;

namespace {

struct op_tensors {
  host_tensor q, k, v, gate;
};

op_tensors random_op(const problem& p, test::rng& g, layout order = layout::bshd) {
  const int64_t s = tile_geometry(p.grid).tiled_tokens();
  op_tensors x{host_tensor(p.type, p.batch, s, p.q_heads, p.head_dim, order),
               host_tensor(p.type, p.batch, s, p.kv_heads, p.head_dim, order),
               host_tensor(p.type, p.batch, s, p.kv_heads, p.head_dim, order),
               host_tensor(p.type, p.batch, s, p.q_heads, p.head_dim, order)};
  for (host_tensor* t : {&x.q, &x.k, &x.v, &x.gate}) test::fill_tiled_normal(*t, p.grid, g);
  return x;
}

// Runs the op forward (and backward when d_o is given) on its own workspace.
struct op_result {
  host_tensor o, dq, dk, dv, dgate;
  std::size_t forward_bytes = 0, backward_bytes = 0;
};

op_result run_op(const problem& p, const options& opt, const op_tensors& x, bool gated, const host_tensor* d_o,
                 layout order = layout::bshd) {
  const tile_geometry geo(p.grid);
  // The outputs' tokens: o and the gradients in options::output_order.
  const int64_t s = opt.output_order == token_order::raster ? geo.raster_tokens() : geo.tiled_tokens();
  op_result r;
  r.o = host_tensor(p.type, p.batch, s, p.q_heads, p.head_dim, order);
  r.o.fill_byte(test::poison_byte);
  forward_io io{x.q.cview(), x.k.cview(), x.v.cview(), x.gate.cview(), r.o.view()};
  if (!gated) io.gate.data = nullptr;
  REQUIRE(reference::forward(p, opt, io, nullptr, r.forward_bytes).is_ok());
  backward_io bio{x.q.cview(), x.k.cview(), x.v.cview(), io.gate, r.o.cview(), {}, {}, {}, {}, {}};
  r.dq = host_tensor(p.type, p.batch, s, p.q_heads, p.head_dim, order);
  r.dk = host_tensor(p.type, p.batch, s, p.kv_heads, p.head_dim, order);
  r.dv = host_tensor(p.type, p.batch, s, p.kv_heads, p.head_dim, order);
  r.dgate = host_tensor(p.type, p.batch, s, p.q_heads, p.head_dim, order);
  bio.d_o = d_o != nullptr ? d_o->cview() : r.o.cview();
  bio.dq = r.dq.view();
  bio.dk = r.dk.view();
  bio.dv = r.dv.view();
  bio.dgate = r.dgate.view();
  if (!gated) bio.dgate.data = nullptr;
  REQUIRE(reference::backward(p, opt, bio, nullptr, r.backward_bytes).is_ok());
  test::aligned_buffer ws(std::max(r.forward_bytes, r.backward_bytes));
  std::size_t bytes = r.forward_bytes;
  REQUIRE(reference::forward(p, opt, io, ws.data(), bytes).is_ok());
  if (d_o != nullptr) {
    for (host_tensor* t : {&r.dq, &r.dk, &r.dv, &r.dgate}) t->fill_byte(test::poison_byte);
    bytes = r.backward_bytes;
    REQUIRE(reference::backward(p, opt, bio, ws.data(), bytes).is_ok());
  }
  return r;
}

bool is_padding(const tile_geometry& geo, int64_t s) { return s % 64 >= geo.valid(s / 64); }

} // namespace

TEST_CASE("the op with every tile selected is dense attention plus the gated coarse output", "[cpu][op]") {
  VSA_TEST_RNG(g, "op dense");
  const problem p = make_problem({9, 10, 11}, 1, 2, 1, 64, dtype::f32);
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), raster = geo.raster_tokens();
  const op_tensors x = random_op(p, g);
  options opt;
  opt.sparsity = 0.0; // k = N
  const op_result r = run_op(p, opt, x, true, nullptr);

  // Independent: means by tile over raster positions, dense softmax on them, dense attention on tokens.
  const std::vector<int64_t> slot = test::tiled_slots(p.grid);
  const double scale = 1.0 / 8.0;
  std::vector<std::vector<double>> qc(2 * n, std::vector<double>(64)), kc(n, std::vector<double>(64)),
      vc(n, std::vector<double>(64));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < 64; ++d) {
      double sq0 = 0, sq1 = 0, sk = 0, sv = 0;
      int cnt = 0;
      for (int64_t t = 0; t < raster; ++t)
        if (slot[t] / 64 == i) {
          sq0 += x.q.get(0, slot[t], 0, d);
          sq1 += x.q.get(0, slot[t], 1, d);
          sk += x.k.get(0, slot[t], 0, d);
          sv += x.v.get(0, slot[t], 0, d);
          ++cnt;
        }
      qc[i][d] = round_to(sq0 / cnt, p.type);
      qc[n + i][d] = round_to(sq1 / cnt, p.type);
      kc[i][d] = round_to(sk / cnt, p.type);
      vc[i][d] = round_to(sv / cnt, p.type);
    }
  std::vector<double> want, got;
  std::vector<double> s(static_cast<std::size_t>(raster));
  for (int64_t h = 0; h < 2; ++h) {
    std::vector<std::vector<double>> oc(n, std::vector<double>(64, 0.0));
    for (int64_t i = 0; i < n; ++i) {
      std::vector<double> w(static_cast<std::size_t>(n));
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < 64; ++d) dot += qc[h * n + i][d] * kc[j][d];
        sum += (w[j] = std::exp(scale * dot));
      }
      for (int64_t d = 0; d < 64; ++d) {
        for (int64_t j = 0; j < n; ++j) oc[i][d] += w[j] / sum * vc[j][d];
        oc[i][d] = round_to(oc[i][d], p.type);
      }
    }
    for (int64_t t = 0; t < raster; ++t) {
      const int64_t st = slot[t];
      double m = -INFINITY;
      for (int64_t u = 0; u < raster; ++u) {
        double dot = 0;
        for (int64_t d = 0; d < 64; ++d) dot += x.q.get(0, st, h, d) * x.k.get(0, slot[u], 0, d);
        s[u] = scale * dot;
        m = std::max(m, s[u]);
      }
      double sum = 0;
      for (int64_t u = 0; u < raster; ++u) sum += std::exp(s[u] - m);
      for (int64_t d = 0; d < 64; ++d) {
        double o = 0;
        for (int64_t u = 0; u < raster; ++u) o += std::exp(s[u] - m) / sum * x.v.get(0, slot[u], 0, d);
        want.push_back(o + x.gate.get(0, st, h, d) * oc[st / 64][d]);
        got.push_back(r.o.get(0, st, h, d));
      }
    }
  }
  CHECK(test::rel_error(got, want) < 1e-6);
  bool padding_zero = true;
  for (int64_t st = 0; st < geo.tiled_tokens(); ++st)
    if (is_padding(geo, st))
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t d = 0; d < 64; ++d) padding_zero = padding_zero && r.o.get(0, st, h, d) == 0.0;
  CHECK(padding_zero);
}

TEST_CASE("the op equals its stages run one after another", "[cpu][op]") {
  VSA_TEST_RNG(g, "op stages");
  for (dtype t : {dtype::bf16, dtype::f32}) {
    INFO("dtype " << dtype_name(t));
    const problem p = make_problem({5, 6, 7}, 2, 4, 2, 16, t);
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens();
    const op_tensors x = random_op(p, g);
    host_tensor d_o(p.type, 2, slots, 4, 16);
    d_o.fill_normal(g);
    options opt;
    opt.sparsity = 0.6; // k = 4 of 8
    opt.scale = 0.3f;
    const op_result r = run_op(p, opt, x, true, &d_o);

    host_tensor q_c(t, 2, n, 4, 16, layout::bhsd), k_c(t, 2, n, 2, 16, layout::bhsd), v_c(t, 2, n, 2, 16, layout::bhsd),
        o_c(t, 2, n, 4, 16, layout::bhsd), q_c32(dtype::f32, 2, n, 4, 16, layout::bhsd),
        k_c32(dtype::f32, 2, n, 2, 16, layout::bhsd);
    REQUIRE(reference::block_means(p, x.q.cview(), x.k.cview(), x.v.cview(), q_c.data(), k_c.data(), v_c.data(),
                                   static_cast<float*>(q_c32.data()), static_cast<float*>(k_c32.data()))
                .is_ok());
    std::vector<float> scores(static_cast<std::size_t>(2 * 4 * n * n)), lse_c(static_cast<std::size_t>(2 * 4 * n)),
        lse(static_cast<std::size_t>(2 * 4 * slots));
    REQUIRE(reference::coarse_scores(p, 0.3f, static_cast<const float*>(q_c32.data()),
                                     static_cast<const float*>(k_c32.data()), scores.data())
                .is_ok());
    REQUIRE(reference::coarse_attention(p, scores.data(), v_c.data(), o_c.data(), nullptr, lse_c.data()).is_ok());
    std::vector<int32_t> q2k(static_cast<std::size_t>(2 * 4 * n * 4)), count(static_cast<std::size_t>(2 * 4 * n));
    const index_lists lists{q2k.data(), count.data(), 4, nullptr, nullptr};
    REQUIRE(reference::select_top_k(p, 4, scores.data(), lists).is_ok());
    host_tensor o_s(t, 2, slots, 4, 16);
    REQUIRE(reference::sparse_attention_forward(p, 0.3f, x.q.cview(), x.k.cview(), x.v.cview(), as_const(lists),
                                                o_s.view(), lse.data())
                .is_ok());
    // The op adds the coarse term to o_s before rounding it, as the GPU's epilogue does: its o is the f64
    // combination of the f64 fine pass, rounded once.
    {
      problem p64 = p;
      p64.type = dtype::f64;
      const auto f64 = [](const host_tensor& h) { return h.converted(dtype::f64, h.order); };
      host_tensor o_s64(dtype::f64, 2, slots, 4, 16), o64(dtype::f64, 2, slots, 4, 16);
      REQUIRE(reference::sparse_attention_forward(p64, 0.3f, f64(x.q).cview(), f64(x.k).cview(), f64(x.v).cview(),
                                                  as_const(lists), o_s64.view(), lse.data())
                  .is_ok());
      REQUIRE(reference::combine(p64, o_s64.cview(), f64(x.gate).cview(), f64(o_c).data(), o64.view()).is_ok());
      CHECK(o64.converted(t, layout::bshd).bytes == r.o.bytes);
    }

    if (t != dtype::f32) continue; // the stages round their gradients to p.type; compare where that is benign
    host_tensor dq(t, 2, slots, 4, 16), dk(t, 2, slots, 2, 16), dv(t, 2, slots, 2, 16), dgate(t, 2, slots, 4, 16),
        d_o_c(t, 2, n, 4, 16, layout::bhsd);
    REQUIRE(reference::sparse_attention_backward(p, 0.3f, x.q.cview(), x.k.cview(), x.v.cview(), o_s.cview(),
                                                 d_o.cview(), lse.data(), as_const(lists), dq.view(), dk.view(),
                                                 dv.view())
                .is_ok());
    REQUIRE(
        reference::combine_backward(p, d_o.cview(), x.gate.cview(), o_c.data(), dgate.view(), d_o_c.data()).is_ok());
    host_tensor dq_c(dtype::f32, 2, n, 4, 16, layout::bhsd), dk_c(dtype::f32, 2, n, 2, 16, layout::bhsd),
        dv_c(dtype::f32, 2, n, 2, 16, layout::bhsd);
    REQUIRE(reference::coarse_attention_backward(p, 0.3f, q_c.data(), k_c.data(), v_c.data(), scores.data(), o_c.data(),
                                                 nullptr, d_o_c.data(), lse_c.data(), static_cast<float*>(dq_c.data()),
                                                 static_cast<float*>(dk_c.data()), static_cast<float*>(dv_c.data()))
                .is_ok());
    const auto add_means = [&](host_tensor& grad, const host_tensor& grad_c) {
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t st = 0; st < slots; ++st)
          for (int64_t h = 0; h < grad.heads; ++h)
            for (int64_t d = 0; d < 16; ++d)
              if (!is_padding(geo, st))
                grad.set(b, st, h, d, grad.get(b, st, h, d) + grad_c.get(b, st / 64, h, d) / geo.valid(st / 64));
    };
    add_means(dq, dq_c);
    add_means(dk, dk_c);
    add_means(dv, dv_c);
    CHECK(test::rel_error(r.dq, dq) < 1e-5);
    CHECK(test::rel_error(r.dk, dk) < 1e-5);
    CHECK(test::rel_error(r.dv, dv) < 1e-5);
    CHECK(dgate.bytes == r.dgate.bytes);
  }
}

TEST_CASE("the op backward matches finite differences of the whole op", "[cpu][op][grad]") {
  VSA_TEST_RNG(g, "op backward");
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 8, dtype::f64);
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens();
  options opt;
  opt.top_k = 3;
  // Inputs whose selection has a clear margin, so that the small steps below never change it.
  op_tensors x;
  for (int attempt = 0;; ++attempt) {
    REQUIRE(attempt < 20);
    x = random_op(p, g);
    host_tensor q_c(p.type, 1, n, 2, 8, layout::bhsd), k_c(p.type, 1, n, 1, 8, layout::bhsd),
        v_c(p.type, 1, n, 1, 8, layout::bhsd), q_c32(dtype::f32, 1, n, 2, 8, layout::bhsd),
        k_c32(dtype::f32, 1, n, 1, 8, layout::bhsd);
    REQUIRE(reference::block_means(p, x.q.cview(), x.k.cview(), x.v.cview(), q_c.data(), k_c.data(), v_c.data(),
                                   static_cast<float*>(q_c32.data()), static_cast<float*>(k_c32.data()))
                .is_ok());
    std::vector<float> scores(static_cast<std::size_t>(2 * n * n));
    REQUIRE(reference::coarse_scores(p, reference::resolve_scale(p, opt), static_cast<const float*>(q_c32.data()),
                                     static_cast<const float*>(k_c32.data()), scores.data())
                .is_ok());
    double margin = INFINITY;
    for (int64_t row = 0; row < 2 * n; ++row) {
      std::vector<float> sorted(scores.begin() + row * n, scores.begin() + (row + 1) * n);
      std::sort(sorted.rbegin(), sorted.rend());
      margin = std::min(margin, static_cast<double>(sorted[2] - sorted[3]));
    }
    if (margin > 1e-4) break;
  }
  host_tensor w(p.type, 1, slots, 2, 8);
  w.fill_normal(g);
  const op_result r = run_op(p, opt, x, true, &w);
  const auto loss = [&]() { return test::inner(run_op(p, opt, x, true, nullptr).o, w); };

  const std::pair<host_tensor*, const host_tensor*> pairs[] = {
      {&x.q, &r.dq}, {&x.k, &r.dk}, {&x.v, &r.dv}, {&x.gate, &r.dgate}};
  for (const auto& pr : pairs) {
    for (int direction = 0; direction < 2; ++direction) {
      host_tensor u(dtype::f64, 1, slots, pr.first->heads, 8);
      test::fill_tiled_normal(u, p.grid, g);
      const double fd = test::directional_difference(*pr.first, u, 1e-6, loss);
      const double analytic = test::inner(*pr.second, u);
      // Relative to ||grad||·||u||, the size a sum of rounding errors over all elements can reach.
      CHECK(std::fabs(fd - analytic) <= 1e-6 * test::norm(*pr.second) * test::norm(u));
    }
    for (int trial = 0; trial < 6; ++trial) {
      int64_t s = g.integer(0, slots - 1);
      while (is_padding(geo, s)) s = g.integer(0, slots - 1);
      const int64_t h = g.integer(0, pr.first->heads - 1), d = g.integer(0, 7);
      const double fd = test::element_difference(*pr.first, pr.first->index(0, s, h, d), 1e-6, loss);
      CHECK(fd == Approx(pr.second->get(0, s, h, d)).epsilon(1e-5).margin(1e-7));
    }
  }
  for (const host_tensor* t : {&r.dq, &r.dk, &r.dv, &r.dgate})
    for (int64_t s = 0; s < slots; ++s)
      if (is_padding(geo, s))
        for (int64_t h = 0; h < t->heads; ++h)
          for (int64_t d = 0; d < 8; ++d) REQUIRE(t->get(0, s, h, d) == 0.0);
}

TEST_CASE("the op with caller-supplied lists is the sparse pass alone", "[cpu][op]") {
  VSA_TEST_RNG(g, "op q2k");
  const problem p = make_problem({9, 13, 3}, 1, 2, 2, 8, dtype::f32);
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens(), rows = 2 * n;
  std::vector<int32_t> q2k(static_cast<std::size_t>(rows * 3), -1), count(static_cast<std::size_t>(rows));
  for (int64_t row = 0; row < rows; ++row) {
    count[row] = static_cast<int32_t>(row % 4); // ragged: 0..3
    for (int32_t c = 0; c < count[row]; ++c) q2k[row * 3 + c] = static_cast<int32_t>((row + 2 * c) % n);
    std::sort(q2k.begin() + row * 3, q2k.begin() + row * 3 + count[row]);
  }
  options opt;
  opt.q2k = {q2k.data(), count.data(), 3, nullptr, nullptr};
  opt.top_k = 1000; // ignored with caller lists
  const op_tensors x = random_op(p, g);
  host_tensor d_o(p.type, 1, slots, 2, 8);
  d_o.fill_normal(g);
  const op_result r = run_op(p, opt, x, false, &d_o);

  const float scale = reference::resolve_scale(p, opt);
  host_tensor o_s(p.type, 1, slots, 2, 8), dq(p.type, 1, slots, 2, 8), dk(p.type, 1, slots, 2, 8),
      dv(p.type, 1, slots, 2, 8);
  std::vector<float> lse(static_cast<std::size_t>(2 * slots));
  REQUIRE(reference::sparse_attention_forward(p, scale, x.q.cview(), x.k.cview(), x.v.cview(), opt.q2k, o_s.view(),
                                              lse.data())
              .is_ok());
  CHECK(o_s.bytes == r.o.bytes);
  REQUIRE(reference::sparse_attention_backward(p, scale, x.q.cview(), x.k.cview(), x.v.cview(), o_s.cview(),
                                               d_o.cview(), lse.data(), opt.q2k, dq.view(), dk.view(), dv.view())
              .is_ok());
  CHECK(test::rel_error(r.dq, dq) < 1e-6);
  CHECK(test::rel_error(r.dk, dk) < 1e-6);
  CHECK(test::rel_error(r.dv, dv) < 1e-6);

  // A gate makes no sense without the coarse branch.
  host_tensor o(p.type, 1, slots, 2, 8);
  o.fill_byte(test::poison_byte);
  const std::vector<unsigned char> before = o.bytes;
  std::size_t bytes = r.forward_bytes;
  test::aligned_buffer ws(bytes);
  const status s =
      reference::forward(p, opt, {x.q.cview(), x.k.cview(), x.v.cview(), x.gate.cview(), o.view()}, ws.data(), bytes);
  CHECK(s.code() == errc::bad_argument);
  CHECK(test::mentions(s, "gate"));
  CHECK(o.bytes == before);
}

TEST_CASE("the op: GQA equals repeated kv heads, and layouts agree", "[cpu][op][gqa]") {
  VSA_TEST_RNG(g, "op gqa");
  const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, dtype::f64);
  problem rep = p;
  rep.kv_heads = 4;
  const int64_t slots = tile_geometry(p.grid).tiled_tokens();
  const op_tensors x = random_op(p, g);
  op_tensors xr{x.q, host_tensor(p.type, 2, slots, 4, 8), host_tensor(p.type, 2, slots, 4, 8), x.gate};
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t s = 0; s < slots; ++s)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t d = 0; d < 8; ++d) {
          xr.k.set(b, s, h, d, x.k.get(b, s, h / 2, d));
          xr.v.set(b, s, h, d, x.v.get(b, s, h / 2, d));
        }
  host_tensor d_o(p.type, 2, slots, 4, 8);
  d_o.fill_normal(g);
  options opt;
  opt.top_k = 3;
  const op_result r = run_op(p, opt, x, true, &d_o), rr = run_op(rep, opt, xr, true, &d_o);
  CHECK(r.o.bytes == rr.o.bytes);
  CHECK(test::rel_error(r.dq, rr.dq) < 1e-13);
  CHECK(test::rel_error(r.dgate, rr.dgate) == 0.0);
  host_tensor dk_sum(p.type, 2, slots, 2, 8), dv_sum(p.type, 2, slots, 2, 8);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t s = 0; s < slots; ++s)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t d = 0; d < 8; ++d) {
          dk_sum.set(b, s, h, d, rr.dk.get(b, s, 2 * h, d) + rr.dk.get(b, s, 2 * h + 1, d));
          dv_sum.set(b, s, h, d, rr.dv.get(b, s, 2 * h, d) + rr.dv.get(b, s, 2 * h + 1, d));
        }
  CHECK(test::rel_error(r.dk, dk_sum) < 1e-13);
  CHECK(test::rel_error(r.dv, dv_sum) < 1e-13);

  const op_tensors xb{x.q.converted(p.type, layout::bhsd), x.k.converted(p.type, layout::bhsd),
                      x.v.converted(p.type, layout::bhsd), x.gate.converted(p.type, layout::bhsd)};
  const host_tensor d_ob = d_o.converted(p.type, layout::bhsd);
  const op_result rb = run_op(p, opt, xb, true, &d_ob, layout::bhsd);
  CHECK(test::rel_error(rb.o, r.o) == 0.0);
  CHECK(test::rel_error(rb.dq, r.dq) == 0.0);
  CHECK(test::rel_error(rb.dk, r.dk) == 0.0);
  CHECK(test::rel_error(rb.dv, r.dv) == 0.0);
  CHECK(test::rel_error(rb.dgate, r.dgate) == 0.0);
}

TEST_CASE("the op in raster output order is the tiled op untiled", "[cpu][op][raster]") {
  VSA_TEST_RNG(g, "op raster");
  for (const dtype type : {dtype::f64, dtype::bf16}) {
    for (const bool gated : {true, false}) {
      INFO(dtype_name(type) << (gated ? " gated" : " ungated"));
      const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, type);
      const tile_geometry geo(p.grid);
      const op_tensors x = random_op(p, g);
      host_tensor d_o(p.type, 2, geo.tiled_tokens(), 4, 8);
      test::fill_tiled_normal(d_o, p.grid, g);
      options opt;
      opt.top_k = 3;
      const op_result tiled = run_op(p, opt, x, gated, &d_o);
      opt.output_order = token_order::raster;
      const op_result raster = run_op(p, opt, x, gated, &d_o);
      const auto same = [&](const host_tensor& t, const host_tensor& r, int64_t heads) {
        host_tensor want(p.type, 2, geo.raster_tokens(), heads, 8);
        REQUIRE(reference::untile(p, heads, t.cview(), want.view()).is_ok());
        CHECK(want.bytes == r.bytes);
      };
      same(tiled.o, raster.o, 4);
      same(tiled.dq, raster.dq, 4);
      same(tiled.dk, raster.dk, 2);
      same(tiled.dv, raster.dv, 2);
      if (gated) same(tiled.dgate, raster.dgate, 4);
    }
  }
}

TEST_CASE("the op in raster input order is the op on the tiled inputs", "[cpu][op][raster]") {
  VSA_TEST_RNG(g, "op raster input");
  for (const dtype type : {dtype::f64, dtype::bf16}) {
    for (const bool gated : {true, false}) {
      for (const token_order out : {token_order::tiled, token_order::raster}) {
        INFO(dtype_name(type) << (gated ? " gated" : " ungated") << " output " << static_cast<int>(out));
        const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, type);
        const tile_geometry geo(p.grid);
        const int64_t raster = geo.raster_tokens(), slots = geo.tiled_tokens();
        // Raster inputs, and what tile() makes of them: the tiled op's inputs.
        op_tensors r{host_tensor(type, 2, raster, 4, 8), host_tensor(type, 2, raster, 2, 8),
                     host_tensor(type, 2, raster, 2, 8), host_tensor(type, 2, raster, 4, 8)};
        op_tensors x{host_tensor(type, 2, slots, 4, 8), host_tensor(type, 2, slots, 2, 8),
                     host_tensor(type, 2, slots, 2, 8), host_tensor(type, 2, slots, 4, 8)};
        host_tensor d_o_r(type, 2, raster, 4, 8), d_o(type, 2, slots, 4, 8);
        const int64_t heads[] = {4, 2, 2, 4, 4};
        host_tensor* raster_of[] = {&r.q, &r.k, &r.v, &r.gate, &d_o_r};
        host_tensor* tiled_of[] = {&x.q, &x.k, &x.v, &x.gate, &d_o};
        for (int t = 0; t < 5; ++t) {
          raster_of[t]->fill_normal(g);
          REQUIRE(reference::tile(p, heads[t], raster_of[t]->cview(), tiled_of[t]->view()).is_ok());
        }
        options opt;
        opt.top_k = 3;
        opt.output_order = out;
        const op_result want = run_op(p, opt, x, gated, &d_o);

        opt.input_order = token_order::raster;
        const int64_t s = out == token_order::raster ? raster : slots;
        host_tensor o(type, 2, s, 4, 8), dq(type, 2, s, 4, 8), dk(type, 2, s, 2, 8), dv(type, 2, s, 2, 8),
            dgate(type, 2, s, 4, 8);
        op_tensors copies{host_tensor(type, 2, slots, 4, 8), host_tensor(type, 2, slots, 2, 8),
                          host_tensor(type, 2, slots, 2, 8), host_tensor(type, 2, slots, 4, 8)};
        for (host_tensor* t : {&o, &dq, &dk, &dv, &dgate, &copies.q, &copies.k, &copies.v, &copies.gate})
          t->fill_byte(test::poison_byte);
        forward_io io{r.q.cview(), r.k.cview(), r.v.cview(), r.gate.cview(), o.view()};
        io.tiled = {copies.q.view(), copies.k.view(), copies.v.view(), copies.gate.view()};
        if (!gated) io.gate.data = io.tiled.gate.data = nullptr;
        std::size_t bytes = 0;
        REQUIRE(reference::forward(p, opt, io, nullptr, bytes).is_ok());
        CHECK(bytes == want.forward_bytes);
        std::size_t backward_bytes = 0;
        backward_io bio{copies.q.cview(), copies.k.cview(), copies.v.cview(), as_const(io.tiled.gate),
                        o.cview(),        d_o_r.cview(),    dq.view(),        dk.view(),
                        dv.view(),        dgate.view()};
        if (!gated) bio.dgate.data = nullptr;
        REQUIRE(reference::backward(p, opt, bio, nullptr, backward_bytes).is_ok());
        test::aligned_buffer ws(std::max(bytes, backward_bytes));
        REQUIRE(reference::forward(p, opt, io, ws.data(), bytes).is_ok());
        CHECK(copies.q.bytes == x.q.bytes);
        CHECK(copies.k.bytes == x.k.bytes);
        CHECK(copies.v.bytes == x.v.bytes);
        if (gated) CHECK(copies.gate.bytes == x.gate.bytes);
        CHECK(o.bytes == want.o.bytes);
        bytes = backward_bytes;
        REQUIRE(reference::backward(p, opt, bio, ws.data(), bytes).is_ok());
        CHECK(dq.bytes == want.dq.bytes);
        CHECK(dk.bytes == want.dk.bytes);
        CHECK(dv.bytes == want.dv.bytes);
        if (gated) CHECK(dgate.bytes == want.dgate.bytes);
      }
    }
  }
}

TEST_CASE("the op in raster input order rejects what it cannot take", "[cpu][op][raster][errors]") {
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 8, dtype::bf16);
  const tile_geometry geo(p.grid);
  const int64_t raster = geo.raster_tokens(), slots = geo.tiled_tokens();
  host_tensor q(p.type, 1, raster, 2, 8), k(p.type, 1, raster, 1, 8), v(p.type, 1, raster, 1, 8),
      o(p.type, 1, slots, 2, 8);
  host_tensor tq(p.type, 1, slots, 2, 8), tk(p.type, 1, slots, 1, 8), tv(p.type, 1, slots, 1, 8);
  options opt;
  opt.top_k = 2;
  opt.input_order = token_order::raster;
  std::size_t bytes = 0;
  REQUIRE(reference::forward(p, opt, forward_io{}, nullptr, bytes).is_ok());
  test::aligned_buffer ws(bytes);
  const auto run = [&](const forward_io& io, const options& o2) {
    std::size_t b = bytes;
    return reference::forward(p, o2, io, ws.data(), b);
  };
  forward_io io{q.cview(), k.cview(), v.cview(), {}, o.view()};
  io.tiled = {tq.view(), tk.view(), tv.view(), {}};
  REQUIRE(run(io, opt).is_ok());
  forward_io no_copy = io;
  no_copy.tiled.k = {};
  CHECK(run(no_copy, opt).code() == errc::null_pointer);
  forward_io tiled_q = io;
  tiled_q.q = as_const(tq.view());
  CHECK(run(tiled_q, opt).code() == errc::bad_tokens);
  forward_io over = io;
  over.tiled.v = tk.view(); // two copies into one tensor
  CHECK(run(over, opt).code() == errc::aliased);
  forward_io onto_input = io;
  onto_input.tiled.q = tensor{q.data(), slots, q.view().batch_stride, q.view().token_stride, q.view().head_stride};
  CHECK(run(onto_input, opt).code() != errc::ok);
  forward_io stray_gate = io;
  stray_gate.tiled.gate = tq.view();
  CHECK(run(stray_gate, opt).code() == errc::bad_argument);
  options bad = opt;
  bad.input_order = static_cast<token_order>(5);
  CHECK(run(io, bad).code() == errc::bad_argument);
  // Not yet with extra tokens (joint attention), whose tensors are tiled only.
  std::size_t joint_bytes = 0;
  REQUIRE(reference::joint_forward(p, {7, false}, opt, forward_io{}, nullptr, joint_bytes).is_ok());
  test::aligned_buffer joint_ws(joint_bytes);
  const status joint = reference::joint_forward(p, {7, false}, opt, io, joint_ws.data(), joint_bytes);
  CHECK(joint.code() == errc::unsupported);
  CHECK(std::string(joint.message()).find("input_order") != std::string::npos);
}

TEST_CASE("the op's two-phase workspace", "[cpu][op][workspace]") {
  VSA_TEST_RNG(g, "op workspace");
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 8, dtype::bf16);
  const int64_t slots = tile_geometry(p.grid).tiled_tokens();
  const op_tensors x = random_op(p, g);
  host_tensor o(p.type, 1, slots, 2, 8);
  o.fill_byte(test::poison_byte);
  const std::vector<unsigned char> before = o.bytes;
  options opt;
  const forward_io io{x.q.cview(), x.k.cview(), x.v.cview(), x.gate.cview(), o.view()};
  std::size_t forward_bytes = 0, backward_bytes = 0;
  REQUIRE(reference::forward(p, opt, io, nullptr, forward_bytes).is_ok());
  CHECK(forward_bytes > 0);
  CHECK(o.bytes == before); // a size query writes nothing
  host_tensor dq(p.type, 1, slots, 2, 8), dk(p.type, 1, slots, 1, 8), dv(p.type, 1, slots, 1, 8),
      dgate(p.type, 1, slots, 2, 8);
  const backward_io bio{x.q.cview(), x.k.cview(), x.v.cview(), x.gate.cview(), o.cview(),
                        o.cview(),   dq.view(),   dk.view(),   dv.view(),      dgate.view()};
  REQUIRE(reference::backward(p, opt, bio, nullptr, backward_bytes).is_ok());
  CHECK(backward_bytes >= forward_bytes);
  // The sizes depend on the problem and options only: a query needs no tensors.
  std::size_t bare_forward = 0, bare_backward = 0;
  REQUIRE(reference::forward(p, opt, forward_io{}, nullptr, bare_forward).is_ok());
  REQUIRE(reference::backward(p, opt, backward_io{}, nullptr, bare_backward).is_ok());
  CHECK(bare_forward == forward_bytes);
  CHECK(bare_backward == backward_bytes);
  options too_many = opt;
  too_many.top_k = 1000;
  CHECK(reference::forward(p, too_many, forward_io{}, nullptr, bare_forward).code() == errc::bad_top_k);

  test::aligned_buffer ws(backward_bytes + 512);
  std::size_t bytes = forward_bytes - 1;
  status s = reference::forward(p, opt, io, ws.data(), bytes);
  CHECK(s.code() == errc::bad_workspace);
  CHECK(test::mentions(s, "workspace"));
  bytes = forward_bytes;
  s = reference::forward(p, opt, io, static_cast<unsigned char*>(ws.data()) + 8, bytes);
  CHECK(s.code() == errc::misaligned_pointer);
  CHECK(test::mentions(s, "workspace"));
  CHECK(o.bytes == before);

  REQUIRE(reference::forward(p, opt, io, ws.data(), bytes).is_ok());
  CHECK(o.bytes != before);
  for (host_tensor* t : {&dq, &dk, &dv, &dgate}) t->fill_byte(test::poison_byte);
  const std::vector<unsigned char> dq_before = dq.bytes;
  bytes = forward_bytes; // enough for the forward, not for the backward
  if (backward_bytes > forward_bytes) {
    s = reference::backward(p, opt, bio, ws.data(), bytes);
    CHECK(s.code() == errc::bad_workspace);
    CHECK(dq.bytes == dq_before);
  }
  bytes = backward_bytes;
  REQUIRE(reference::backward(p, opt, bio, ws.data(), bytes).is_ok());
  // Every element of every output written (no poison left).
  for (const host_tensor* t : {&o, &dq, &dk, &dv, &dgate})
    for (int64_t e = 0; e < t->elements(); ++e) REQUIRE(!std::isnan(t->at(e)));
}

TEST_CASE("the op's memory in two parts: a state kept between the passes and scratch of each", "[cpu][op][workspace]") {
  VSA_TEST_RNG(g, "op buffers");
  const problem p = make_problem({5, 6, 7}, 2, 2, 1, 8, dtype::bf16);
  const int64_t slots = tile_geometry(p.grid).tiled_tokens();
  const op_tensors x = random_op(p, g);
  host_tensor d_o(p.type, 2, slots, 2, 8);
  test::fill_tiled_normal(d_o, p.grid, g);
  options opt;
  const op_result whole = run_op(p, opt, x, true, &d_o);

  host_tensor o(p.type, 2, slots, 2, 8), dq(p.type, 2, slots, 2, 8), dk(p.type, 2, slots, 1, 8),
      dv(p.type, 2, slots, 1, 8), dgate(p.type, 2, slots, 2, 8);
  for (host_tensor* t : {&o, &dq, &dk, &dv, &dgate}) t->fill_byte(test::poison_byte);
  const forward_io io{x.q.cview(), x.k.cview(), x.v.cview(), x.gate.cview(), o.view()};
  const backward_io bio{x.q.cview(), x.k.cview(), x.v.cview(), x.gate.cview(), o.cview(),
                        d_o.cview(), dq.view(),   dk.view(),   dv.view(),      dgate.view()};
  op_buffers fq, bq;
  REQUIRE(reference::forward(p, opt, io, fq).is_ok());
  REQUIRE(reference::backward(p, opt, bio, bq).is_ok());
  CHECK(fq.state_bytes > 0);
  CHECK(fq.state_bytes == bq.state_bytes);
  // The one-workspace sizes are the state and the larger scratch, laid one after the other.
  CHECK(whole.forward_bytes == fq.state_bytes + fq.scratch_bytes);
  CHECK(whole.backward_bytes == bq.state_bytes + std::max(fq.scratch_bytes, bq.scratch_bytes));

  test::aligned_buffer state(fq.state_bytes), forward_scratch(fq.scratch_bytes), backward_scratch(bq.scratch_bytes);
  op_buffers fb{state.data(), fq.state_bytes, forward_scratch.data(), fq.scratch_bytes};
  REQUIRE(reference::forward(p, opt, io, fb).is_ok());
  // The backward reads the state only: its scratch is a different buffer, still holding poison.
  op_buffers bb{state.data(), bq.state_bytes, backward_scratch.data(), bq.scratch_bytes};
  REQUIRE(reference::backward(p, opt, bio, bb).is_ok());
  CHECK(o.bytes == whole.o.bytes);
  CHECK(dq.bytes == whole.dq.bytes);
  CHECK(dk.bytes == whole.dk.bytes);
  CHECK(dv.bytes == whole.dv.bytes);
  CHECK(dgate.bytes == whole.dgate.bytes);

  // The selected lists, read from the state: k ascending tiles in every row, and the backward's input when
  // passed back (no coarse branch then: o is o_s alone).
  const_index_lists sel;
  REQUIRE(reference::selected_lists(p, opt, state.data(), sel).is_ok());
  const int64_t n = tile_geometry(p.grid).num_tiles(), k = sel.q2k_capacity;
  CHECK(k == static_cast<int64_t>(std::ceil(0.1 * static_cast<double>(n) - 1e-9)));
  CHECK(check_q2k_host(p, sel).is_ok());
  for (int64_t row = 0; row < p.batch * p.q_heads * n; ++row) CHECK(sel.q2k_count[row] == k);
  options given;
  given.q2k = sel;
  const_index_lists none;
  REQUIRE(reference::selected_lists(p, given, state.data(), none).is_ok());
  CHECK(none.q2k == nullptr);
  CHECK(reference::selected_lists(p, opt, nullptr, none).code() == errc::null_pointer);

  // Each part is checked on its own, by name, before anything is written.
  const std::vector<unsigned char> dq_done = dq.bytes;
  op_buffers small = bb;
  small.scratch_bytes -= 1;
  status s = reference::backward(p, opt, bio, small);
  CHECK(s.code() == errc::bad_workspace);
  CHECK(test::mentions(s, "scratch"));
  small = bb;
  small.state_bytes -= 1;
  s = reference::backward(p, opt, bio, small);
  CHECK(s.code() == errc::bad_workspace);
  CHECK(test::mentions(s, "state"));
  small = fb;
  small.scratch = nullptr;
  s = reference::forward(p, opt, io, small);
  CHECK(s.code() == errc::bad_workspace);
  CHECK(test::mentions(s, "scratch"));
  CHECK(dq.bytes == dq_done);
}
