#include "support/host.hpp"

#include <vsa/reference.hpp>

#include <cmath>
#include <vector>

using namespace vsa;
using test::host_tensor;
using test::layout;
using test::make_problem;

namespace {

// A contiguous [B, H, n, D] array as a host tensor.
host_tensor per_tile(dtype t, int64_t batch, int64_t heads, int64_t n, int64_t dim) {
  return host_tensor(t, batch, n, heads, dim, layout::bhsd);
}

// Writes raster tensor x into a tiled tensor through the test's own slot map.
host_tensor tiled_from_raster(const host_tensor& x, grid3 g, layout order) {
  const tile_geometry geo(g);
  host_tensor r(x.type, x.batch, geo.tiled_tokens(), x.heads, x.dim, order);
  const std::vector<int64_t> slot = test::tiled_slots(g);
  for (int64_t b = 0; b < x.batch; ++b)
    for (int64_t t = 0; t < x.tokens; ++t)
      for (int64_t h = 0; h < x.heads; ++h)
        for (int64_t d = 0; d < x.dim; ++d) r.set(b, slot[t], h, d, x.get(b, t, h, d));
  return r;
}

} // namespace

TEST_CASE("block means match means computed by hand over raster tokens", "[cpu][means]") {
  VSA_TEST_RNG(g, "block means");
  for (dtype t : {dtype::f64, dtype::bf16, dtype::fp16})
    for (const grid3 grid : {grid3{5, 6, 7}, grid3{9, 13, 3}, grid3{1, 1, 1}}) {
      INFO("dtype " << dtype_name(t) << " grid " << grid.t << "x" << grid.h << "x" << grid.w);
      const problem p = make_problem(grid, 2, 4, 2, 6, t);
      const tile_geometry geo(grid);
      const int64_t n = geo.num_tiles();
      host_tensor rq(t, 2, geo.raster_tokens(), 4, 6), rk(t, 2, geo.raster_tokens(), 2, 6),
          rv(t, 2, geo.raster_tokens(), 2, 6);
      rq.fill_normal(g);
      rk.fill_normal(g);
      rv.fill_normal(g, 3.0);
      const host_tensor q = tiled_from_raster(rq, grid, layout::bshd), k = tiled_from_raster(rk, grid, layout::bhsd),
                        v = tiled_from_raster(rv, grid, layout::bshd);
      host_tensor q_c = per_tile(t, 2, 4, n, 6), k_c = per_tile(t, 2, 2, n, 6), v_c = per_tile(t, 2, 2, n, 6);
      for (host_tensor* x : {&q_c, &k_c, &v_c}) x->fill_byte(test::poison_byte);
      REQUIRE(reference::block_means(p, q.cview(), k.cview(), v.cview(), q_c.data(), k_c.data(), v_c.data()).is_ok());

      const std::vector<int64_t> slot = test::tiled_slots(grid);
      const auto check = [&](const host_tensor& raster, const host_tensor& means) {
        bool equal = true;
        for (int64_t b = 0; b < raster.batch; ++b)
          for (int64_t h = 0; h < raster.heads; ++h)
            for (int64_t d = 0; d < raster.dim; ++d) {
              std::vector<double> sum(static_cast<std::size_t>(n), 0.0), count(static_cast<std::size_t>(n), 0.0);
              for (int64_t r = 0; r < raster.tokens; ++r) {
                sum[slot[r] / 64] += raster.get(b, r, h, d);
                count[slot[r] / 64] += 1.0;
              }
              for (int64_t i = 0; i < n; ++i) {
                const double want = round_to(sum[i] / count[i], t), got = means.get(b, i, h, d);
                // Summation order differs from the reference's: allow a rounding step of the dtype.
                const double ulp = t == dtype::f64 ? 1e-14 : t == dtype::bf16 ? 1.0 / 128 : 1.0 / 1024;
                equal = equal && std::fabs(got - want) <= ulp * std::fabs(want) + 1e-300;
              }
            }
        return equal;
      };
      CHECK(check(rq, q_c));
      CHECK(check(rk, k_c));
      CHECK(check(rv, v_c));
    }
}

TEST_CASE("coarse scores and attention match a direct softmax over the tile means", "[cpu][coarse]") {
  VSA_TEST_RNG(g, "coarse forward");
  const problem p = make_problem({8, 8, 12}, 2, 4, 2, 8, dtype::f64); // 12 tiles
  const int64_t n = tile_geometry(p.grid).num_tiles();
  const float scale = 0.37f;
  // The scores take fp32 means; the values are of p.type.
  host_tensor q_c = per_tile(dtype::f32, 2, 4, n, 8), k_c = per_tile(dtype::f32, 2, 2, n, 8),
              v_c = per_tile(p.type, 2, 2, n, 8);
  q_c.fill_normal(g, 20.0); // scores in the hundreds, as tiles of few tokens at large activations give
  k_c.fill_normal(g);
  v_c.fill_normal(g);
  host_tensor o_c = per_tile(p.type, 2, 4, n, 8);
  std::vector<float> scores(static_cast<std::size_t>(2 * 4 * n * n)), lse(static_cast<std::size_t>(2 * 4 * n));
  REQUIRE(reference::coarse_scores(p, scale, static_cast<const float*>(q_c.data()),
                                   static_cast<const float*>(k_c.data()), scores.data())
              .is_ok());
  REQUIRE(reference::coarse_attention(p, scores.data(), v_c.data(), o_c.data(), nullptr, lse.data()).is_ok());
  double worst_score = 0, worst_lse = 0;
  std::vector<double> want_o, got_o;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < n; ++i) {
        const float* row = scores.data() + ((b * 4 + h) * n + i) * n;
        double m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          double x = 0;
          for (int64_t d = 0; d < 8; ++d) x += q_c.get(b, i, h, d) * k_c.get(b, j, h / 2, d);
          worst_score = std::max(worst_score, std::fabs(row[j] - scale * x) / (1.0 + std::fabs(scale * x)));
          m = std::max(m, double(row[j]));
        }
        // The softmax of the scores as given.
        double denominator = 0;
        for (int64_t j = 0; j < n; ++j) denominator += std::exp(row[j] - m);
        worst_lse = std::max(worst_lse, std::fabs(lse[(b * 4 + h) * n + i] - (m + std::log(denominator))));
        for (int64_t d = 0; d < 8; ++d) {
          double o = 0;
          for (int64_t j = 0; j < n; ++j) o += std::exp(row[j] - m) / denominator * v_c.get(b, j, h / 2, d);
          want_o.push_back(o);
          got_o.push_back(o_c.get(b, i, h, d));
        }
      }
  CHECK(worst_score < 1e-6);
  CHECK(worst_lse < 1e-4);
  CHECK(test::rel_error(got_o, want_o) < 1e-12);

  for (float bad : {0.0f, -1.0f, NAN, INFINITY}) {
    const status s = reference::coarse_scores(p, bad, static_cast<const float*>(q_c.data()),
                                              static_cast<const float*>(k_c.data()), scores.data());
    CHECK(s.code() == errc::bad_argument);
    CHECK(test::mentions(s, "scale"));
  }
}

// In double through the stages' cores: the public stages take fp32 scores, as the GPU's do.
TEST_CASE("coarse attention backward matches finite differences", "[cpu][coarse][grad]") {
  VSA_TEST_RNG(g, "coarse backward");
  const problem p = make_problem({8, 8, 12}, 2, 4, 2, 8, dtype::f64);
  const int64_t n = tile_geometry(p.grid).num_tiles();
  const double scale = 0.5;
  host_tensor q_c = per_tile(p.type, 2, 4, n, 8), k_c = per_tile(p.type, 2, 2, n, 8),
              v_c = per_tile(p.type, 2, 2, n, 8);
  q_c.fill_normal(g);
  k_c.fill_normal(g);
  v_c.fill_normal(g);
  host_tensor w = per_tile(p.type, 2, 4, n, 8); // dL/do_c
  w.fill_normal(g);
  std::vector<double> scores(static_cast<std::size_t>(2 * 4 * n * n)), lse(static_cast<std::size_t>(2 * 4 * n));
  host_tensor o_c = per_tile(p.type, 2, 4, n, 8);
  const auto at = [](host_tensor& x) { return static_cast<double*>(x.data()); };
  const auto loss = [&]() {
    reference::detail::coarse_scores_core(p, scale, at(q_c), at(k_c), scores.data());
    reference::detail::coarse_forward_core(p, scores.data(), at(v_c), at(o_c), lse.data());
    return test::inner(o_c, w);
  };
  loss();
  host_tensor dq = per_tile(p.type, 2, 4, n, 8), dk = per_tile(p.type, 2, 2, n, 8), dv = per_tile(p.type, 2, 2, n, 8);
  reference::detail::coarse_backward_core(p, scale, at(q_c), at(k_c), at(v_c), scores.data(), at(o_c), at(w),
                                          lse.data(), at(dq), at(dk), at(dv));
  const std::pair<host_tensor*, host_tensor*> pairs[] = {{&q_c, &dq}, {&k_c, &dk}, {&v_c, &dv}};
  for (const auto& pr : pairs) {
    for (int direction = 0; direction < 3; ++direction) {
      host_tensor u = per_tile(dtype::f64, pr.first->batch, pr.first->heads, n, 8);
      u.fill_normal(g);
      const double fd = test::directional_difference(*pr.first, u, 1e-5, loss);
      const double analytic = test::inner(*pr.second, u);
      // Relative to ||grad||·||u||, the size a sum of rounding errors over all elements can reach.
      CHECK(std::fabs(fd - analytic) <= 1e-5 * test::norm(*pr.second) * test::norm(u));
    }
    for (int trial = 0; trial < 10; ++trial) {
      const int64_t e = g.integer(0, pr.first->elements() - 1);
      const double fd = test::element_difference(*pr.first, e, 1e-5, loss);
      CHECK(fd == Approx(pr.second->at(e)).epsilon(1e-4).margin(1e-6));
    }
  }
}
