#include "support/host.hpp"

#include <vsa/reference.hpp>

#include <cmath>
#include <vector>

using namespace vsa;
using test::host_tensor;
using test::layout;
using test::make_problem;

namespace {

const char* phi_name(feature_map f) {
  return f == feature_map::softmax ? "softmax" : f == feature_map::elu1 ? "elu+1" : "relu";
}

std::vector<double> phi_of(feature_map f, const host_tensor& x, int64_t b, int64_t s, int64_t h) {
  std::vector<double> y(static_cast<std::size_t>(x.dim));
  double sum = 0.0;
  for (int64_t d = 0; d < x.dim; ++d) {
    const double v = x.get(b, s, h, d);
    y[d] = f == feature_map::softmax ? std::exp(v)
           : f == feature_map::elu1  ? (v > 0 ? v + 1 : std::exp(v))
                                     : std::max(v, 0.0);
    sum += y[d];
  }
  if (f == feature_map::softmax)
    for (double& v : y) v /= sum;
  return y;
}

// o_i = Σ_j (φ(q_i)·φ(k_j)) v_j / (Σ_j φ(q_i)·φ(k_j) + eps), the quadratic form of the same quantity.
host_tensor direct(const problem& p, feature_map f, double eps, const std::vector<bool>& valid, const host_tensor& q,
                   const host_tensor& k, const host_tensor& v) {
  host_tensor o(dtype::f64, q.batch, q.tokens, q.heads, q.dim);
  const int64_t group = p.q_heads / p.kv_heads;
  for (int64_t b = 0; b < q.batch; ++b)
    for (int64_t h = 0; h < q.heads; ++h) {
      std::vector<std::vector<double>> phk;
      for (int64_t j = 0; j < k.tokens; ++j) phk.push_back(phi_of(f, k, b, j, h / group));
      for (int64_t i = 0; i < q.tokens; ++i) {
        if (!valid[i]) {
          for (int64_t d = 0; d < q.dim; ++d) o.set(b, i, h, d, 0.0);
          continue;
        }
        const std::vector<double> a = phi_of(f, q, b, i, h);
        std::vector<double> num(static_cast<std::size_t>(q.dim), 0.0);
        double den = eps;
        for (int64_t j = 0; j < k.tokens; ++j) {
          if (!valid[j]) continue;
          double w = 0.0;
          for (int64_t d = 0; d < q.dim; ++d) w += a[d] * phk[j][d];
          den += w;
          for (int64_t d = 0; d < q.dim; ++d) num[d] += w * v.get(b, j, h / group, d);
        }
        for (int64_t d = 0; d < q.dim; ++d) o.set(b, i, h, d, num[d] / den);
      }
    }
  return o;
}

std::vector<bool> valid_tokens(const problem& p, token_order order) {
  const tile_geometry geo(p.grid);
  if (order == token_order::raster) return std::vector<bool>(static_cast<std::size_t>(geo.raster_tokens()), true);
  std::vector<bool> v(static_cast<std::size_t>(geo.tiled_tokens()));
  for (int64_t s = 0; s < geo.tiled_tokens(); ++s) v[s] = s % 64 < geo.valid(s / 64);
  return v;
}

} // namespace

TEST_CASE("linear attention matches its quadratic form, in raster and tiled order", "[cpu][linear]") {
  VSA_TEST_RNG(g, "linear forward");
  const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, dtype::f64);
  const tile_geometry geo(p.grid);
  for (feature_map f : {feature_map::softmax, feature_map::elu1, feature_map::relu}) {
    INFO("phi " << phi_name(f));
    const float eps = 1e-3f;
    host_tensor q(p.type, 2, geo.raster_tokens(), 4, 8), k(p.type, 2, geo.raster_tokens(), 2, 8, layout::bhsd),
        v(p.type, 2, geo.raster_tokens(), 2, 8);
    q.fill_normal(g);
    k.fill_normal(g);
    v.fill_normal(g);
    host_tensor o(p.type, 2, geo.raster_tokens(), 4, 8);
    o.fill_byte(test::poison_byte);
    REQUIRE(
        reference::linear_attention_forward(p, f, eps, token_order::raster, q.cview(), k.cview(), v.cview(), o.view())
            .is_ok());
    CHECK(test::rel_error(o, direct(p, f, eps, valid_tokens(p, token_order::raster), q, k, v)) < 1e-12);

    // Tiled order: the same values, padding rows 0, and padding tokens (nonzero here) excluded from the sums.
    host_tensor tq(p.type, 2, geo.tiled_tokens(), 4, 8), tk(p.type, 2, geo.tiled_tokens(), 2, 8),
        tv(p.type, 2, geo.tiled_tokens(), 2, 8, layout::bhsd);
    for (host_tensor* t : {&tq, &tk, &tv}) t->fill_normal(g);
    REQUIRE(reference::tile(p, 4, q.cview(), tq.view()).is_ok());
    REQUIRE(reference::tile(p, 2, k.cview(), tk.view()).is_ok());
    REQUIRE(reference::tile(p, 2, v.cview(), tv.view()).is_ok());
    const std::vector<bool> valid = valid_tokens(p, token_order::tiled);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t s = 0; s < geo.tiled_tokens(); ++s)
        if (!valid[s])
          for (int64_t d = 0; d < 8; ++d) {
            tk.set(b, s, 1, d, 50.0);
            tv.set(b, s, 0, d, -7.0);
          }
    host_tensor to(p.type, 2, geo.tiled_tokens(), 4, 8), back(p.type, 2, geo.raster_tokens(), 4, 8);
    to.fill_byte(test::poison_byte);
    REQUIRE(reference::linear_attention_forward(p, f, eps, token_order::tiled, tq.cview(), tk.cview(), tv.cview(),
                                                to.view())
                .is_ok());
    CHECK(test::rel_error(to, direct(p, f, eps, valid, tq, tk, tv)) < 1e-12);
    REQUIRE(reference::untile(p, 4, to.cview(), back.view()).is_ok());
    CHECK(test::rel_error(back, o) < 1e-12);
  }
}

TEST_CASE("linear attention backward matches finite differences for every feature map", "[cpu][linear][grad]") {
  VSA_TEST_RNG(g, "linear backward");
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 8, dtype::f64);
  const tile_geometry geo(p.grid);
  for (feature_map f : {feature_map::softmax, feature_map::elu1, feature_map::relu})
    for (token_order order : {token_order::raster, token_order::tiled}) {
      INFO("phi " << phi_name(f) << (order == token_order::tiled ? " tiled" : " raster"));
      const int64_t tokens = order == token_order::tiled ? geo.tiled_tokens() : geo.raster_tokens();
      const std::vector<bool> valid = valid_tokens(p, order);
      const float eps = 0.25f;
      host_tensor q(p.type, 1, tokens, 2, 8), k(p.type, 1, tokens, 1, 8), v(p.type, 1, tokens, 1, 8),
          w(p.type, 1, tokens, 2, 8);
      for (host_tensor* t : {&q, &k, &v, &w}) t->fill_normal(g);
      // Keep q and k off relu's kink, so that no finite-difference step crosses it.
      for (host_tensor* t : {&q, &k})
        for (int64_t e = 0; e < t->elements(); ++e) t->put(e, t->at(e) + (t->at(e) >= 0 ? 1e-2 : -1e-2));
      host_tensor o(p.type, 1, tokens, 2, 8);
      const auto loss = [&]() {
        REQUIRE(
            reference::linear_attention_forward(p, f, eps, order, q.cview(), k.cview(), v.cview(), o.view()).is_ok());
        return test::inner(o, w);
      };
      host_tensor dq(p.type, 1, tokens, 2, 8), dk(p.type, 1, tokens, 1, 8), dv(p.type, 1, tokens, 1, 8);
      for (host_tensor* t : {&dq, &dk, &dv}) t->fill_byte(test::poison_byte);
      REQUIRE(reference::linear_attention_backward(p, f, eps, order, q.cview(), k.cview(), v.cview(), w.cview(),
                                                   dq.view(), dk.view(), dv.view())
                  .is_ok());
      const std::pair<host_tensor*, host_tensor*> pairs[] = {{&q, &dq}, {&k, &dk}, {&v, &dv}};
      for (const auto& pr : pairs) {
        for (int direction = 0; direction < 2; ++direction) {
          host_tensor u(dtype::f64, 1, tokens, pr.first->heads, 8);
          u.fill_normal(g);
          const double fd = test::directional_difference(*pr.first, u, 1e-5, loss);
          const double analytic = test::inner(*pr.second, u);
          // Relative to ||grad||·||u||, the size a sum of rounding errors over all elements can reach.
          CHECK(std::fabs(fd - analytic) <= 1e-6 * test::norm(*pr.second) * test::norm(u));
        }
        for (int trial = 0; trial < 8; ++trial) {
          const int64_t s = g.integer(0, tokens - 1), h = g.integer(0, pr.first->heads - 1), d = g.integer(0, 7);
          const double analytic = pr.second->get(0, s, h, d);
          if (!valid[s]) {
            CHECK(analytic == 0.0);
            continue;
          }
          const double fd = test::element_difference(*pr.first, pr.first->index(0, s, h, d), 1e-5, loss);
          CHECK(fd == Approx(analytic).epsilon(1e-5).margin(1e-8));
        }
      }
    }
}

TEST_CASE("linear attention rejects bad arguments", "[cpu][linear][errors]") {
  VSA_TEST_RNG(g, "linear errors");
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 8, dtype::bf16);
  const tile_geometry geo(p.grid);
  host_tensor q(p.type, 1, geo.raster_tokens(), 2, 8), k(p.type, 1, geo.raster_tokens(), 1, 8),
      v(p.type, 1, geo.raster_tokens(), 1, 8), o(p.type, 1, geo.raster_tokens(), 2, 8);
  for (host_tensor* t : {&q, &k, &v}) t->fill_normal(g);
  o.fill_byte(test::poison_byte);
  const std::vector<unsigned char> before = o.bytes;
  const auto run = [&](feature_map f, float eps, token_order order) {
    return reference::linear_attention_forward(p, f, eps, order, q.cview(), k.cview(), v.cview(), o.view());
  };
  for (float eps : {-1e-3f, NAN, INFINITY}) {
    const status s = run(feature_map::elu1, eps, token_order::raster);
    CHECK(s.code() == errc::bad_argument);
    CHECK(test::mentions(s, "eps"));
  }
  status s = run(static_cast<feature_map>(3), 0.0f, token_order::raster);
  CHECK(s.code() == errc::bad_argument);
  CHECK(test::mentions(s, "phi"));
  s = run(feature_map::relu, 0.0f, static_cast<token_order>(-1));
  CHECK(s.code() == errc::bad_argument);
  CHECK(test::mentions(s, "order"));
  s = run(feature_map::relu, 0.0f, token_order::tiled); // raster-sized tensors in tiled order
  CHECK(s.code() == errc::bad_tokens);
  CHECK(test::mentions(s, "q"));
  CHECK(o.bytes == before);
  REQUIRE(run(feature_map::relu, 0.0f, token_order::raster).is_ok());
}
