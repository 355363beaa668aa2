#include "support/host.hpp"

#include <vsa/reference.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace vsa;
using test::host_tensor;
using test::layout;
using test::make_problem;
using test::q2k_lists;
using test::random_lists;

namespace {

q2k_lists full_lists(const problem& p) {
  const int64_t n = tile_geometry(p.grid).num_tiles(), rows = p.batch * p.q_heads * n;
  q2k_lists x{n, {}, std::vector<int32_t>(static_cast<std::size_t>(rows), static_cast<int32_t>(n))};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) x.q2k.push_back(static_cast<int32_t>(j));
  return x;
}

struct inputs {
  host_tensor q, k, v;
};

inputs random_tiled(const problem& p, test::rng& g, layout order = layout::bshd) {
  const int64_t s = tile_geometry(p.grid).tiled_tokens();
  inputs x{host_tensor(p.type, p.batch, s, p.q_heads, p.head_dim, order),
           host_tensor(p.type, p.batch, s, p.kv_heads, p.head_dim, order),
           host_tensor(p.type, p.batch, s, p.kv_heads, p.head_dim, order)};
  test::fill_tiled_normal(x.q, p.grid, g);
  test::fill_tiled_normal(x.k, p.grid, g);
  test::fill_tiled_normal(x.v, p.grid, g);
  return x;
}

struct fine_out {
  host_tensor o;
  std::vector<float> lse;
};

fine_out run_forward(const problem& p, float scale, const inputs& x, const q2k_lists& lists,
                     layout order = layout::bshd) {
  const int64_t s = tile_geometry(p.grid).tiled_tokens();
  fine_out r{host_tensor(p.type, p.batch, s, p.q_heads, p.head_dim, order),
             std::vector<float>(static_cast<std::size_t>(p.batch * p.q_heads * s))};
  r.o.fill_byte(test::poison_byte);
  const status st = reference::sparse_attention_forward(p, scale, x.q.cview(), x.k.cview(), x.v.cview(), lists.view(),
                                                        r.o.view(), r.lse.data());
  REQUIRE(st.is_ok());
  return r;
}

struct grads {
  host_tensor dq, dk, dv;
};

grads run_backward(const problem& p, float scale, const inputs& x, const fine_out& f, const host_tensor& d_o,
                   const q2k_lists& lists) {
  const int64_t s = tile_geometry(p.grid).tiled_tokens();
  grads r{host_tensor(p.type, p.batch, s, p.q_heads, p.head_dim),
          host_tensor(p.type, p.batch, s, p.kv_heads, p.head_dim),
          host_tensor(p.type, p.batch, s, p.kv_heads, p.head_dim)};
  for (host_tensor* t : {&r.dq, &r.dk, &r.dv}) t->fill_byte(test::poison_byte);
  const status st =
      reference::sparse_attention_backward(p, scale, x.q.cview(), x.k.cview(), x.v.cview(), f.o.cview(), d_o.cview(),
                                           f.lse.data(), lists.view(), r.dq.view(), r.dk.view(), r.dv.view());
  REQUIRE(st.is_ok());
  return r;
}

} // namespace

TEST_CASE("sparse attention with every tile selected is dense attention", "[cpu][sparse]") {
  VSA_TEST_RNG(g, "sparse dense");
  const problem p = make_problem({9, 10, 11}, 1, 2, 1, 64, dtype::f32);
  const tile_geometry geo(p.grid);
  const int64_t raster = geo.raster_tokens();
  host_tensor rq(p.type, 1, raster, 2, 64), rk(p.type, 1, raster, 1, 64), rv(p.type, 1, raster, 1, 64);
  rq.fill_normal(g);
  rk.fill_normal(g);
  rv.fill_normal(g);
  inputs x{host_tensor(p.type, 1, geo.tiled_tokens(), 2, 64), host_tensor(p.type, 1, geo.tiled_tokens(), 1, 64),
           host_tensor(p.type, 1, geo.tiled_tokens(), 1, 64, layout::bhsd)};
  REQUIRE(reference::tile(p, 2, rq.cview(), x.q.view()).is_ok());
  REQUIRE(reference::tile(p, 1, rk.cview(), x.k.view()).is_ok());
  REQUIRE(reference::tile(p, 1, rv.cview(), x.v.view()).is_ok());
  const float scale = 0.125f;
  const fine_out f = run_forward(p, scale, x, full_lists(p));

  // Dense softmax attention over the raster tokens, written independently of the tiled code.
  std::vector<double> want, got;
  double worst_lse = 0.0;
  std::vector<double> s(static_cast<std::size_t>(raster));
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < raster; ++i) {
      double m = -INFINITY;
      for (int64_t j = 0; j < raster; ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < 64; ++d) dot += rq.get(0, i, h, d) * rk.get(0, j, 0, d);
        s[j] = scale * dot;
        m = std::max(m, s[j]);
      }
      double sum = 0.0;
      for (int64_t j = 0; j < raster; ++j) sum += std::exp(s[j] - m);
      const int64_t slot = geo.slot_of_raster(i);
      worst_lse = std::max(worst_lse, std::fabs(f.lse[h * geo.tiled_tokens() + slot] - (m + std::log(sum))));
      for (int64_t d = 0; d < 64; ++d) {
        double o = 0.0;
        for (int64_t j = 0; j < raster; ++j) o += std::exp(s[j] - m) / sum * rv.get(0, j, 0, d);
        want.push_back(o);
        got.push_back(f.o.get(0, slot, h, d));
      }
    }
  CHECK(test::rel_error(got, want) < 1e-6);
  CHECK(worst_lse < 1e-5);
  // Padding rows: zero output, lse = +inf.
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t slot = 0; slot < geo.tiled_tokens(); ++slot)
      if (slot % 64 >= geo.valid(slot / 64)) {
        REQUIRE(std::isinf(f.lse[h * geo.tiled_tokens() + slot]));
        for (int64_t d = 0; d < 64; ++d) REQUIRE(f.o.get(0, slot, h, d) == 0.0);
      }
}

TEST_CASE("sparse attention over ragged lists matches a direct computation", "[cpu][sparse]") {
  VSA_TEST_RNG(g, "sparse ragged");
  for (dtype t : {dtype::f32, dtype::bf16}) {
    INFO("dtype " << dtype_name(t));
    const problem p = make_problem({5, 6, 7}, 2, 4, 2, 16, t);
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens();
    const inputs x = random_tiled(p, g);
    const q2k_lists lists = random_lists(p, 5, g);
    const float scale = 0.3f;
    const fine_out f = run_forward(p, scale, x, lists);
    std::vector<double> want, got;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t i = 0; i < n; ++i) {
          const int64_t row = (b * 4 + h) * n + i;
          std::vector<int64_t> keys;
          for (int32_t c = 0; c < lists.count[row]; ++c)
            for (int64_t t2 = 0; t2 < geo.valid(lists.q2k[row * lists.capacity + c]); ++t2)
              keys.push_back(lists.q2k[row * lists.capacity + c] * 64 + t2);
          for (int64_t r = 0; r < 64; ++r) {
            const int64_t slot = i * 64 + r;
            const float lse = f.lse[(b * 4 + h) * slots + slot];
            if (r >= geo.valid(i) || keys.empty()) {
              REQUIRE(std::isinf(lse));
              REQUIRE(lse > 0);
              for (int64_t d = 0; d < 16; ++d) REQUIRE(f.o.get(b, slot, h, d) == 0.0);
              continue;
            }
            std::vector<double> w;
            double sum = 0.0;
            for (int64_t key : keys) {
              double dot = 0.0;
              for (int64_t d = 0; d < 16; ++d) dot += x.q.get(b, slot, h, d) * x.k.get(b, key, h / 2, d);
              w.push_back(std::exp(scale * dot));
              sum += w.back();
            }
            REQUIRE(lse == Approx(std::log(sum)).epsilon(1e-6).margin(1e-6));
            for (int64_t d = 0; d < 16; ++d) {
              double o = 0.0;
              for (std::size_t e = 0; e < keys.size(); ++e) o += w[e] / sum * x.v.get(b, keys[e], h / 2, d);
              want.push_back(o);
              got.push_back(f.o.get(b, slot, h, d));
            }
          }
        }
    CHECK(test::rel_error(got, want) < (t == dtype::f32 ? 1e-6 : 4e-3));
  }
}

TEST_CASE("sparse attention: GQA equals repeated kv heads, and layouts agree", "[cpu][sparse][gqa]") {
  VSA_TEST_RNG(g, "sparse gqa");
  const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, dtype::f64);
  problem rep = p;
  rep.kv_heads = 4;
  const int64_t slots = tile_geometry(p.grid).tiled_tokens();
  const inputs x = random_tiled(p, g);
  inputs xr{x.q, host_tensor(p.type, 2, slots, 4, 8), host_tensor(p.type, 2, slots, 4, 8)};
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t s = 0; s < slots; ++s)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t d = 0; d < 8; ++d) {
          xr.k.set(b, s, h, d, x.k.get(b, s, h / 2, d));
          xr.v.set(b, s, h, d, x.v.get(b, s, h / 2, d));
        }
  const q2k_lists lists = random_lists(p, 4, g);
  const float scale = 0.4f;
  host_tensor d_o(p.type, 2, slots, 4, 8);
  d_o.fill_normal(g);

  const fine_out f = run_forward(p, scale, x, lists), fr = run_forward(rep, scale, xr, lists);
  CHECK(f.o.bytes == fr.o.bytes);
  CHECK(f.lse == fr.lse);
  const grads gq = run_backward(p, scale, x, f, d_o, lists), gr = run_backward(rep, scale, xr, fr, d_o, lists);
  CHECK(gq.dq.bytes == gr.dq.bytes);
  host_tensor dk_sum(p.type, 2, slots, 2, 8), dv_sum(p.type, 2, slots, 2, 8);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t s = 0; s < slots; ++s)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t d = 0; d < 8; ++d) {
          dk_sum.set(b, s, h, d, gr.dk.get(b, s, 2 * h, d) + gr.dk.get(b, s, 2 * h + 1, d));
          dv_sum.set(b, s, h, d, gr.dv.get(b, s, 2 * h, d) + gr.dv.get(b, s, 2 * h + 1, d));
        }
  CHECK(test::rel_error(gq.dk, dk_sum) < 1e-13);
  CHECK(test::rel_error(gq.dv, dv_sum) < 1e-13);

  // [B, H, S, D] inputs and outputs give the same numbers as [B, S, H, D].
  const inputs xb{x.q.converted(p.type, layout::bhsd), x.k.converted(p.type, layout::bhsd),
                  x.v.converted(p.type, layout::bhsd)};
  const fine_out fb = run_forward(p, scale, xb, lists, layout::bhsd);
  CHECK(test::rel_error(fb.o, f.o) == 0.0);
  CHECK(fb.lse == f.lse);
  const grads gb = run_backward(p, scale, xb, fb, d_o.converted(p.type, layout::bhsd), lists);
  CHECK(test::rel_error(gb.dq, gq.dq) == 0.0);
  CHECK(test::rel_error(gb.dk, gq.dk) == 0.0);
  CHECK(test::rel_error(gb.dv, gq.dv) == 0.0);
}

TEST_CASE("sparse attention backward matches finite differences", "[cpu][sparse][grad]") {
  VSA_TEST_RNG(g, "sparse backward");
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 8, dtype::f64);
  const tile_geometry geo(p.grid);
  const int64_t slots = geo.tiled_tokens();
  inputs x = random_tiled(p, g);
  const q2k_lists lists = random_lists(p, 4, g);
  const float scale = 0.6f;
  host_tensor w(p.type, 1, slots, 2, 8); // dL/do_s, nonzero on padding rows too: they must be ignored
  w.fill_normal(g);
  const auto loss = [&]() { return test::inner(run_forward(p, scale, x, lists).o, w); };
  const fine_out f = run_forward(p, scale, x, lists);
  const grads gr = run_backward(p, scale, x, f, w, lists);

  const std::pair<host_tensor*, const host_tensor*> pairs[] = {{&x.q, &gr.dq}, {&x.k, &gr.dk}, {&x.v, &gr.dv}};
  for (const auto& pr : pairs) {
    for (int direction = 0; direction < 3; ++direction) {
      host_tensor u(dtype::f64, 1, slots, pr.first->heads, 8);
      test::fill_tiled_normal(u, p.grid, g);
      const double fd = test::directional_difference(*pr.first, u, 1e-5, loss);
      const double analytic = test::inner(*pr.second, u);
      // Relative to ||grad||·||u||, the size a sum of rounding errors over all elements can reach.
      CHECK(std::fabs(fd - analytic) <= 1e-5 * test::norm(*pr.second) * test::norm(u));
    }
    for (int trial = 0; trial < 12; ++trial) {
      const int64_t s = g.integer(0, slots - 1), h = g.integer(0, pr.first->heads - 1), d = g.integer(0, 7);
      if (s % 64 >= geo.valid(s / 64)) {
        CHECK(pr.second->get(0, s, h, d) == 0.0); // padding slots get no gradient
        continue;
      }
      const double fd = test::element_difference(*pr.first, pr.first->index(0, s, h, d), 1e-5, loss);
      CHECK(fd == Approx(pr.second->get(0, s, h, d)).epsilon(1e-4).margin(1e-6));
    }
  }
  // Every padding slot of every gradient is exactly 0.
  for (const host_tensor* t : {&gr.dq, &gr.dk, &gr.dv})
    for (int64_t s = 0; s < slots; ++s)
      if (s % 64 >= geo.valid(s / 64))
        for (int64_t h = 0; h < t->heads; ++h)
          for (int64_t d = 0; d < 8; ++d) REQUIRE(t->get(0, s, h, d) == 0.0);
}
