#include "support/host.hpp"

#include <vsa/reference.hpp>

#include <vector>

using namespace vsa;
using test::host_tensor;
using test::layout;

using test::make_problem;

TEST_CASE("tile places every token by the definition and untile inverts it", "[cpu][layout]") {
  const grid3 grids[] = {{5, 6, 7}, {9, 13, 3}, {1, 1, 1}, {4, 4, 4}, {8, 5, 4}, {3, 1, 9}};
  VSA_TEST_RNG(g, "layout roundtrip");
  for (const grid3 grid : grids)
    for (dtype t : {dtype::bf16, dtype::f32})
      for (layout raster_order : {layout::bshd, layout::bhsd})
        for (layout tiled_order : {layout::bshd, layout::bhsd}) {
          INFO("grid " << grid.t << "x" << grid.h << "x" << grid.w << " dtype " << dtype_name(t) << " raster "
                       << (raster_order == layout::bshd ? "bshd" : "bhsd") << " tiled "
                       << (tiled_order == layout::bshd ? "bshd" : "bhsd"));
          const problem p = make_problem(grid, 2, 3, 3, 5, t);
          const tile_geometry geo(grid);
          host_tensor raster(t, p.batch, geo.raster_tokens(), 3, p.head_dim, raster_order);
          raster.fill_normal(g);
          host_tensor tiled(t, p.batch, geo.tiled_tokens(), 3, p.head_dim, tiled_order);
          tiled.fill_byte(test::poison_byte);
          const status s = reference::tile(p, 3, raster.cview(), tiled.view());
          REQUIRE(s.is_ok());

          const std::vector<int64_t> slot = test::tiled_slots(grid);
          std::vector<bool> filled(static_cast<std::size_t>(geo.tiled_tokens()), false);
          for (int64_t r = 0; r < geo.raster_tokens(); ++r) filled[static_cast<std::size_t>(slot[r])] = true;
          bool placed = true, padded = true;
          for (int64_t b = 0; b < p.batch; ++b)
            for (int64_t h = 0; h < 3; ++h)
              for (int64_t d = 0; d < p.head_dim; ++d) {
                for (int64_t r = 0; r < geo.raster_tokens(); ++r)
                  placed = placed && tiled.get(b, slot[r], h, d) == raster.get(b, r, h, d);
                for (int64_t s2 = 0; s2 < geo.tiled_tokens(); ++s2)
                  if (!filled[static_cast<std::size_t>(s2)]) {
                    const double x = tiled.get(b, s2, h, d);
                    padded = padded && x == 0.0 && !std::signbit(x);
                  }
              }
          CHECK(placed);
          CHECK(padded);

          host_tensor back(t, p.batch, geo.raster_tokens(), 3, p.head_dim, raster_order);
          back.fill_byte(test::poison_byte);
          REQUIRE(reference::untile(p, 3, tiled.cview(), back.view()).is_ok());
          CHECK(back.bytes == raster.bytes);
        }
}

TEST_CASE("tile geometry agrees with the definition", "[cpu][layout]") {
  for (const grid3 grid : {grid3{5, 6, 7}, grid3{9, 13, 3}, grid3{1, 1, 1}, grid3{12, 8, 16}}) {
    const tile_geometry geo(grid);
    const std::vector<int64_t> slot = test::tiled_slots(grid);
    int64_t valid_total = 0;
    for (int64_t n = 0; n < geo.num_tiles(); ++n) valid_total += geo.valid(n);
    CHECK(valid_total == geo.raster_tokens());
    for (int64_t r = 0; r < geo.raster_tokens(); ++r) {
      REQUIRE(geo.slot_of_raster(r) == slot[r]);
      REQUIRE(geo.raster_of_slot(slot[r] / tile_tokens, static_cast<int>(slot[r] % tile_tokens)) == r);
      REQUIRE(slot[r] % tile_tokens < geo.valid(slot[r] / tile_tokens));
    }
  }
}

TEST_CASE("the kernels' valid counts by multiplication agree with the geometry", "[cpu][layout]") {
  // fast_divider against machine division: small divisors over a range of dividends, large ones at the edges.
  for (uint32_t d = 1; d < 600; ++d) {
    const fast_divider f(d);
    for (uint32_t n = 0; n < 5000; ++n) REQUIRE(f.div(n) == n / d);
    for (uint32_t n : {0x3fffffffu, 0x40000000u, 0x7fffffffu}) REQUIRE(f.div(n) == n / d);
  }
  for (uint32_t d : {1023u, 1024u, 1025u, 65535u, 65536u, 65537u, 0x3fffffffu, 0x40000000u}) {
    const fast_divider f(d);
    for (uint32_t n : {0u, d - 1, d, d + 1, 2 * d - 1, 0x7ffffffeu, 0x7fffffffu}) REQUIRE(f.div(n) == n / d);
  }
  for (const grid3 grid :
       {grid3{5, 6, 7}, grid3{21, 30, 52}, grid3{1, 1, 1}, grid3{12, 8, 16}, grid3{3, 1, 4097}, grid3{31, 45, 80}}) {
    const tile_geometry geo(grid);
    const tile_valid_counter counter(geo);
    for (int64_t n = 0; n < geo.num_tiles(); ++n) REQUIRE(counter.valid(n) == geo.valid(n));
  }
}

TEST_CASE("tile and untile reject bad arguments and leave outputs untouched", "[cpu][layout][errors]") {
  const problem p = make_problem({5, 6, 7}, 1, 2, 2, 4, dtype::f32);
  const tile_geometry geo(p.grid);
  VSA_TEST_RNG(g, "layout errors");
  host_tensor raster(p.type, 1, geo.raster_tokens(), 2, 4);
  raster.fill_normal(g);
  host_tensor tiled(p.type, 1, geo.tiled_tokens(), 2, 4);
  tiled.fill_byte(test::poison_byte);
  const std::vector<unsigned char> poisoned = tiled.bytes;

  tensor short_tiled = tiled.view();
  short_tiled.tokens -= 64;
  status s = reference::tile(p, 2, raster.cview(), short_tiled);
  CHECK(s.code() == errc::bad_tokens);
  CHECK(test::mentions(s, "tiled"));

  const_tensor null_raster = raster.cview();
  null_raster.data = nullptr;
  s = reference::tile(p, 2, null_raster, tiled.view());
  CHECK(s.code() == errc::null_pointer);
  CHECK(test::mentions(s, "raster"));

  s = reference::tile(p, 0, raster.cview(), tiled.view());
  CHECK(s.code() == errc::bad_heads);
  CHECK(test::mentions(s, "heads"));

  tensor overlapping = tiled.view();
  overlapping.token_stride = 2; // rows of 4 elements 2 apart overlap
  s = reference::tile(p, 2, raster.cview(), overlapping);
  CHECK(s.code() == errc::bad_strides);

  problem bad_grid = p;
  bad_grid.grid.h = 0;
  CHECK(reference::tile(bad_grid, 2, raster.cview(), tiled.view()).code() == errc::bad_grid);
  CHECK(tiled.bytes == poisoned);

  host_tensor raster_out(p.type, 1, geo.raster_tokens(), 2, 4);
  raster_out.fill_byte(test::poison_byte);
  const std::vector<unsigned char> raster_poisoned = raster_out.bytes;
  tensor wrong = raster_out.view();
  wrong.tokens = geo.tiled_tokens();
  CHECK(reference::untile(p, 2, tiled.cview(), wrong).code() == errc::bad_tokens);
  CHECK(raster_out.bytes == raster_poisoned);
}
