// combine (o = o_s + g ⊙ o_c) and its backward on the GPU against the CPU reference: gated and ungated,
// partial tiles on every axis, B > 1, both layouts, bf16 and fp16, D = 64 and 128, in place. Outputs are
// poisoned before every call and checked fully written, with their canaries intact.
#include "support/gpu.hpp"
#include "support/host.hpp"

#include <vsa/gpu/combine.hpp>
#include <vsa/reference/combine.hpp>
#include <vsa/reference/layout.hpp>

#include <cmath>
#include <string>
#include <vector>

namespace vsa {
namespace test {
namespace {

struct config {
  grid3 grid;
  int64_t batch, heads, head_dim;
  dtype type;
  layout order;
};

std::string describe(const config& c) {
  return std::to_string(c.grid.t) + "x" + std::to_string(c.grid.h) + "x" + std::to_string(c.grid.w) + " B" +
         std::to_string(c.batch) + " H" + std::to_string(c.heads) + " D" + std::to_string(c.head_dim) + " " +
         dtype_name(c.type) + (c.order == layout::bshd ? " bshd" : " bhsd");
}

std::vector<config> configs(rng& g) {
  std::vector<config> c = {
      {{5, 6, 7}, 2, 3, 64, dtype::bf16, layout::bshd},   {{9, 10, 11}, 1, 2, 128, dtype::fp16, layout::bhsd},
      {{4, 8, 13}, 2, 1, 128, dtype::bf16, layout::bhsd}, {{8, 8, 8}, 1, 2, 64, dtype::fp16, layout::bshd},
      {{1, 1, 1}, 1, 1, 128, dtype::bf16, layout::bshd},
  };
  for (int i = 0; i < 2; ++i)
    c.push_back({{g.integer(1, 14), g.integer(1, 14), g.integer(1, 14)},
                 g.integer(1, 2),
                 g.integer(1, 4),
                 g.integer(0, 1) ? 64 : 128,
                 g.integer(0, 1) ? dtype::bf16 : dtype::fp16,
                 g.integer(0, 1) ? layout::bshd : layout::bhsd});
  return c;
}

problem to_problem(const config& c) { return make_problem(c.grid, c.batch, c.heads, c.heads, c.head_dim, c.type); }

// Elements further apart than one rounding of the output (the GPU computes in fp32, the reference in
// double, both round once), with an absolute floor for results that cancel to near zero.
int64_t mismatches(const host_tensor& gpu, const host_tensor& ref, double floor) {
  const std::vector<double> a = values(gpu), b = values(ref);
  if (a.size() != b.size()) return -1;
  const double ulp = ref.type == dtype::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  int64_t off = 0;
  for (std::size_t e = 0; e < a.size(); ++e)
    if (!(std::fabs(a[e] - b[e]) <= 2 * ulp * std::fabs(b[e]) + floor)) ++off;
  return off;
}

// Number of padding-slot elements of a tiled tensor that are not exactly zero.
int64_t nonzero_padding(const host_tensor& x, grid3 grid) {
  const tile_geometry geo(grid);
  int64_t bad = 0;
  for (int64_t b = 0; b < x.batch; ++b)
    for (int64_t s = 0; s < x.tokens; ++s)
      if (s % tile_tokens >= geo.valid(s / tile_tokens))
        for (int64_t h = 0; h < x.heads; ++h)
          for (int64_t d = 0; d < x.dim; ++d) bad += x.get(b, s, h, d) != 0.0 ? 1 : 0;
  return bad;
}

TEST_CASE("combine matches the reference", "[gpu][combine]") {
  VSA_TEST_RNG(g, "combine");
  for (const config& c : configs(g)) {
    const problem p = to_problem(c);
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), tokens = geo.tiled_tokens();
    // o_s holds values in its padding slots too: combine must write zeros there regardless.
    host_tensor o_s(c.type, c.batch, tokens, c.heads, c.head_dim, c.order),
        gate(c.type, c.batch, tokens, c.heads, c.head_dim, c.order),
        o_c(c.type, c.batch, n, c.heads, c.head_dim, layout::bhsd);
    o_s.fill_normal(g);
    gate.fill_normal(g);
    o_c.fill_normal(g);
    const device_tensor d_o_s(o_s), d_gate(gate), d_o_c(o_c);
    for (const bool gated : {true, false}) {
      INFO(describe(c) << (gated ? " gated" : " ungated"));
      host_tensor ref(c.type, c.batch, tokens, c.heads, c.head_dim, c.order);
      REQUIRE(
          reference::combine(p, o_s.cview(), gated ? gate.cview() : const_tensor{}, o_c.data(), ref.view()).is_ok());
      device_tensor o(ref, poisoned);
      const status st =
          combine(p, d_o_s.cview(), gated ? d_gate.cview() : const_tensor{}, d_o_c.raw(), o.view(), nullptr);
      INFO(st.message());
      REQUIRE(st.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(o.all_written());
      CHECK(o.canaries_intact());
      const host_tensor got = o.download();
      CHECK(mismatches(got, ref, 1e-5) == 0);
      CHECK(rel_error(got, ref) < 1e-2);
      CHECK(nonzero_padding(got, c.grid) == 0);

      // In place: o is the same view as o_s.
      device_tensor inplace(o_s);
      REQUIRE(combine(p, inplace.cview(), gated ? d_gate.cview() : const_tensor{}, d_o_c.raw(), inplace.view(), nullptr)
                  .is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(mismatches(inplace.download(), ref, 1e-5) == 0);
      CHECK(inplace.canaries_intact());
    }
  }
}

TEST_CASE("combine_backward matches the reference", "[gpu][combine]") {
  VSA_TEST_RNG(g, "combine-backward");
  for (const config& c : configs(g)) {
    const problem p = to_problem(c);
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), tokens = geo.tiled_tokens();
    host_tensor d_o(c.type, c.batch, tokens, c.heads, c.head_dim, c.order),
        gate(c.type, c.batch, tokens, c.heads, c.head_dim, c.order),
        o_c(c.type, c.batch, n, c.heads, c.head_dim, layout::bhsd);
    d_o.fill_normal(g); // padding slots too: they must not reach d_o_c
    gate.fill_normal(g);
    o_c.fill_normal(g);
    const device_tensor dd_o(d_o), d_gate(gate), d_o_c(o_c);
    for (const bool gated : {true, false}) {
      INFO(describe(c) << (gated ? " gated" : " ungated"));
      host_tensor dgate_ref(c.type, c.batch, tokens, c.heads, c.head_dim, c.order),
          doc_ref(c.type, c.batch, n, c.heads, c.head_dim, layout::bhsd);
      REQUIRE(reference::combine_backward(p, d_o.cview(), gated ? gate.cview() : const_tensor{}, o_c.data(),
                                          gated ? dgate_ref.view() : tensor{}, doc_ref.data())
                  .is_ok());
      device_tensor dgate(dgate_ref, poisoned), doc(doc_ref, poisoned);
      const status st = combine_backward(p, dd_o.cview(), gated ? d_gate.cview() : const_tensor{}, d_o_c.raw(),
                                         gated ? dgate.view() : tensor{}, doc.raw(), nullptr);
      INFO(st.message());
      REQUIRE(st.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(doc.all_written());
      CHECK(doc.canaries_intact());
      const host_tensor got_doc = doc.download();
      CHECK(mismatches(got_doc, doc_ref, 1e-4) == 0);
      CHECK(rel_error(got_doc, doc_ref) < 1e-2);
      CHECK(dgate.canaries_intact());
      if (gated) {
        CHECK(dgate.all_written());
        const host_tensor got = dgate.download();
        CHECK(mismatches(got, dgate_ref, 1e-5) == 0);
        CHECK(rel_error(got, dgate_ref) < 1e-2);
        CHECK(nonzero_padding(got, c.grid) == 0);
      } else {
        // No gate, no gradient for it: the buffer is left as it was.
        CHECK(dgate.poisoned_elements() == dgate.shape().elements());
      }
    }
  }
}

// d_o in raster order with its tiled copy asked for (the whole op's input_order): the copy bit for bit the reference's
// tile() of d_o, and d_o_c and dgate bit for bit those of the same call on that tiled d_o; dgate in either order.
TEST_CASE("combine_backward from raster order writes the tiled d_o", "[gpu][combine]") {
  VSA_TEST_RNG(g, "combine-backward-raster");
  for (const config& c : configs(g)) {
    const problem p = to_problem(c);
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens(), tokens = geo.raster_tokens();
    host_tensor d_o(c.type, c.batch, tokens, c.heads, c.head_dim, c.order),
        tiled(c.type, c.batch, slots, c.heads, c.head_dim, c.order),
        gate(c.type, c.batch, slots, c.heads, c.head_dim, c.order),
        o_c(c.type, c.batch, n, c.heads, c.head_dim, layout::bhsd);
    d_o.fill_normal(g);
    gate.fill_normal(g);
    o_c.fill_normal(g);
    REQUIRE(reference::tile(p, c.heads, d_o.cview(), tiled.view()).is_ok());
    const device_tensor dd_o(d_o), dtiled(tiled), d_gate(gate), d_o_c(o_c);
    for (const bool gated : {true, false}) {
      for (const token_order order : {token_order::tiled, token_order::raster}) {
        INFO(describe(c) << (gated ? " gated" : " ungated") << " dgate " << static_cast<int>(order));
        const int64_t s = order == token_order::raster ? tokens : slots;
        const host_tensor dgate_shape(c.type, c.batch, s, c.heads, c.head_dim, c.order),
            doc_shape(c.type, c.batch, n, c.heads, c.head_dim, layout::bhsd);
        device_tensor want_dgate(dgate_shape, poisoned), want_doc(doc_shape, poisoned), dgate(dgate_shape, poisoned),
            doc(doc_shape, poisoned), copy(tiled, poisoned);
        const const_tensor gv = gated ? d_gate.cview() : const_tensor{};
        REQUIRE(combine_backward(p, dtiled.cview(), gv, d_o_c.raw(), gated ? want_dgate.view() : tensor{},
                                 want_doc.raw(), nullptr, order)
                    .is_ok());
        const status st = combine_backward(p, dd_o.cview(), gv, d_o_c.raw(), gated ? dgate.view() : tensor{}, doc.raw(),
                                           nullptr, order, copy.view());
        INFO(st.message());
        REQUIRE(st.is_ok());
        VSA_REQUIRE_RT(gpu_sync());
        CHECK(copy.canaries_intact());
        CHECK(copy.download().bytes == tiled.bytes);
        CHECK(doc.download().bytes == want_doc.download().bytes);
        if (gated) CHECK(dgate.download().bytes == want_dgate.download().bytes);
      }
    }
  }
  // A tiled d_o where the raster one belongs, and the copy over d_o itself.
  const config c = configs(g)[0];
  const problem p = to_problem(c);
  const tile_geometry geo(p.grid);
  host_tensor tiled(c.type, c.batch, geo.tiled_tokens(), c.heads, c.head_dim, c.order),
      o_c(c.type, c.batch, geo.num_tiles(), c.heads, c.head_dim, layout::bhsd);
  device_tensor dt(tiled), copy(tiled, poisoned), doc(o_c, poisoned);
  const device_tensor dc(o_c);
  CHECK(combine_backward(p, dt.cview(), {}, dc.raw(), tensor{}, doc.raw(), nullptr, token_order::tiled, copy.view())
            .code() == errc::bad_tokens);
  CHECK(copy.poisoned_elements() == copy.shape().elements());
}

TEST_CASE("combine and combine_backward reject bad arguments", "[gpu][combine]") {
  const problem p = make_problem({5, 6, 7}, 1, 2, 2, 64, dtype::bf16);
  const tile_geometry geo(p.grid);
  const host_tensor x(p.type, 1, geo.tiled_tokens(), 2, 64), coarse(p.type, 1, geo.num_tiles(), 2, 64, layout::bhsd);
  const device_tensor d_x(x), d_gate(x), d_coarse(coarse);
  device_tensor out(x, poisoned), dgate(x, poisoned), doc(coarse, poisoned);
  CHECK(combine(p, d_x.cview(), {}, nullptr, out.view(), nullptr).code() == errc::null_pointer);
  CHECK(combine(p, d_x.cview(), {}, static_cast<const char*>(d_coarse.raw()) + 2, out.view(), nullptr).code() ==
        errc::misaligned_pointer);
  tensor short_out = out.view();
  short_out.tokens = geo.raster_tokens();
  CHECK(combine(p, d_x.cview(), {}, d_coarse.raw(), short_out, nullptr).code() == errc::bad_tokens);
  CHECK(combine_backward(p, d_x.cview(), {}, d_coarse.raw(), dgate.view(), doc.raw(), nullptr).code() ==
        errc::bad_argument);
  CHECK(combine_backward(p, d_x.cview(), d_gate.cview(), d_coarse.raw(), tensor{}, doc.raw(), nullptr).code() ==
        errc::null_pointer);
  CHECK(combine_backward(p, d_x.cview(), d_gate.cview(), d_coarse.raw(), dgate.view(), nullptr, nullptr).code() ==
        errc::null_pointer);
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(out.poisoned_elements() == out.shape().elements());
  CHECK(dgate.poisoned_elements() == dgate.shape().elements());
  CHECK(doc.poisoned_elements() == doc.shape().elements());
}

} // namespace
} // namespace test
} // namespace vsa
