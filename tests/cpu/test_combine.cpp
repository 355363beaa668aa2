#include "support/host.hpp"

#include <vsa/reference.hpp>

#include <cmath>
#include <vector>

using namespace vsa;
using test::host_tensor;
using test::layout;
using test::make_problem;

TEST_CASE("combine adds the gated coarse output on valid slots and zeros padding", "[cpu][combine]") {
  VSA_TEST_RNG(g, "combine forward");
  for (bool gated : {true, false}) {
    INFO("gated " << gated);
    const problem p = make_problem({9, 13, 3}, 2, 3, 1, 5, dtype::f32);
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens();
    host_tensor o_s(p.type, 2, slots, 3, 5), gate(p.type, 2, slots, 3, 5, layout::bhsd),
        o_c(p.type, 2, n, 3, 5, layout::bhsd), o(p.type, 2, slots, 3, 5);
    o_s.fill_normal(g); // padding rows too: combine must not pass them through
    gate.fill_normal(g);
    o_c.fill_normal(g);
    o.fill_byte(test::poison_byte);
    const_tensor gv = gate.cview();
    if (!gated) gv.data = nullptr;
    REQUIRE(reference::combine(p, o_s.cview(), gv, o_c.data(), o.view()).is_ok());
    bool exact = true;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t s = 0; s < slots; ++s)
        for (int64_t h = 0; h < 3; ++h)
          for (int64_t d = 0; d < 5; ++d) {
            const bool valid = s % 64 < geo.valid(s / 64);
            const double gg = gated ? gate.get(b, s, h, d) : 1.0;
            const double want = valid ? round_to(o_s.get(b, s, h, d) + gg * o_c.get(b, s / 64, h, d), p.type) : 0.0;
            exact = exact && o.get(b, s, h, d) == want;
          }
    CHECK(exact);
  }
}

TEST_CASE("combine backward gives dgate and the per-tile gated sum, as finite differences do", "[cpu][combine][grad]") {
  VSA_TEST_RNG(g, "combine backward");
  const problem p = make_problem({5, 6, 7}, 1, 2, 2, 4, dtype::f64);
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens();
  host_tensor o_s(p.type, 1, slots, 2, 4), gate(p.type, 1, slots, 2, 4), o_c(p.type, 1, n, 2, 4, layout::bhsd),
      w(p.type, 1, slots, 2, 4, layout::bhsd);
  o_s.fill_normal(g);
  gate.fill_normal(g);
  o_c.fill_normal(g);
  w.fill_normal(g); // nonzero on padding rows: they must not count
  host_tensor dgate(p.type, 1, slots, 2, 4), d_o_c(p.type, 1, n, 2, 4, layout::bhsd);
  dgate.fill_byte(test::poison_byte);
  d_o_c.fill_byte(test::poison_byte);
  REQUIRE(reference::combine_backward(p, w.cview(), gate.cview(), o_c.data(), dgate.view(), d_o_c.data()).is_ok());

  host_tensor o(p.type, 1, slots, 2, 4);
  const auto loss = [&]() {
    REQUIRE(reference::combine(p, o_s.cview(), gate.cview(), o_c.data(), o.view()).is_ok());
    return test::inner(o, w);
  };
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t e = g.integer(0, gate.elements() - 1);
    CHECK(test::element_difference(gate, e, 1e-4, loss) == Approx(dgate.at(e)).epsilon(1e-7).margin(1e-9));
    const int64_t c = g.integer(0, o_c.elements() - 1);
    CHECK(test::element_difference(o_c, c, 1e-4, loss) == Approx(d_o_c.at(c)).epsilon(1e-7).margin(1e-9));
  }
  for (int64_t s = 0; s < slots; ++s)
    if (s % 64 >= geo.valid(s / 64))
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t d = 0; d < 4; ++d) REQUIRE(dgate.get(0, s, h, d) == 0.0);

  // Without a gate (g = 1) d_o_c is the plain per-tile sum of dO, and dgate must be absent.
  const_tensor no_gate = gate.cview();
  no_gate.data = nullptr;
  tensor no_dgate = dgate.view();
  no_dgate.data = nullptr;
  REQUIRE(reference::combine_backward(p, w.cview(), no_gate, o_c.data(), no_dgate, d_o_c.data()).is_ok());
  bool sums = true;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t d = 0; d < 4; ++d) {
        double want = 0.0;
        for (int64_t r = 0; r < geo.valid(i); ++r) want += w.get(0, i * 64 + r, h, d);
        sums = sums && std::fabs(d_o_c.get(0, i, h, d) - want) <= 1e-12 * (1 + std::fabs(want));
      }
  CHECK(sums);

  const std::vector<unsigned char> before = d_o_c.bytes;
  status s = reference::combine_backward(p, w.cview(), no_gate, o_c.data(), dgate.view(), d_o_c.data());
  CHECK(s.code() == errc::bad_argument);
  CHECK(test::mentions(s, "dgate"));
  s = reference::combine_backward(p, w.cview(), gate.cview(), o_c.data(), no_dgate, d_o_c.data());
  CHECK(s.code() == errc::null_pointer);
  CHECK(test::mentions(s, "dgate"));
  s = reference::combine_backward(p, w.cview(), gate.cview(), nullptr, dgate.view(), d_o_c.data());
  CHECK(s.code() == errc::null_pointer);
  CHECK(test::mentions(s, "o_c"));
  CHECK(d_o_c.bytes == before);
}
