// Tiling, untiling and block means on the GPU against the CPU reference: partial tiles on every axis,
// B > 1, several heads, GQA for the means, both layouts (also mixed between input and output), bf16 and
// fp16, D = 64 and 128. Outputs are poisoned before every call and checked fully written, with their
// canaries intact.
#include "support/gpu.hpp"
#include "support/host.hpp"

#include <vsa/gpu/block_means.hpp>
#include <vsa/gpu/layout.hpp>
#include <vsa/reference/block_means.hpp>
#include <vsa/reference/layout.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace vsa {
namespace test {
namespace {

struct config {
  grid3 grid;
  int64_t batch, q_heads, kv_heads, head_dim;
  dtype type;
  layout order;
};

std::string describe(const config& c) {
  return std::to_string(c.grid.t) + "x" + std::to_string(c.grid.h) + "x" + std::to_string(c.grid.w) + " B" +
         std::to_string(c.batch) + " Hq" + std::to_string(c.q_heads) + " Hkv" + std::to_string(c.kv_heads) + " D" +
         std::to_string(c.head_dim) + " " + dtype_name(c.type) + (c.order == layout::bshd ? " bshd" : " bhsd");
}

layout other(layout o) { return o == layout::bshd ? layout::bhsd : layout::bshd; }

// Fixed shapes (partial tiles on every axis, exact tiles, a single token, one tile row) and a few drawn at
// random, so every run also sees shapes nobody picked.
std::vector<config> configs(rng& g) {
  std::vector<config> c = {
      {{5, 6, 7}, 2, 4, 2, 64, dtype::bf16, layout::bshd},   {{9, 10, 11}, 1, 2, 2, 128, dtype::fp16, layout::bhsd},
      {{4, 8, 13}, 2, 3, 1, 128, dtype::bf16, layout::bhsd}, {{8, 8, 8}, 1, 2, 1, 64, dtype::fp16, layout::bshd},
      {{1, 1, 1}, 1, 1, 1, 64, dtype::bf16, layout::bshd},   {{3, 1, 17}, 3, 2, 2, 128, dtype::bf16, layout::bshd},
  };
  for (int i = 0; i < 3; ++i) {
    const int64_t kv = g.integer(1, 3);
    c.push_back({{g.integer(1, 14), g.integer(1, 14), g.integer(1, 14)},
                 g.integer(1, 2),
                 kv * g.integer(1, 2),
                 kv,
                 g.integer(0, 1) ? 64 : 128,
                 g.integer(0, 1) ? dtype::bf16 : dtype::fp16,
                 g.integer(0, 1) ? layout::bshd : layout::bhsd});
  }
  return c;
}

problem to_problem(const config& c) { return make_problem(c.grid, c.batch, c.q_heads, c.kv_heads, c.head_dim, c.type); }

bool same_bytes(const host_tensor& a, const host_tensor& b) {
  return a.bytes.size() == b.bytes.size() && std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
}

TEST_CASE("tile and untile match the reference bit for bit", "[gpu][layout]") {
  VSA_TEST_RNG(g, "layout");
  for (const config& c : configs(g)) {
    const problem p = to_problem(c);
    const tile_geometry geo(p.grid);
    const int64_t heads = c.q_heads;
    for (const layout tiled_order : {c.order, other(c.order)}) {
      INFO(describe(c) << ", tiled side " << (tiled_order == layout::bshd ? "bshd" : "bhsd"));
      host_tensor raster(c.type, c.batch, geo.raster_tokens(), heads, c.head_dim, c.order);
      raster.fill_normal(g);
      host_tensor tiled_ref(c.type, c.batch, geo.tiled_tokens(), heads, c.head_dim, tiled_order);
      REQUIRE(reference::tile(p, heads, raster.cview(), tiled_ref.view()).is_ok());

      const device_tensor d_raster(raster);
      device_tensor d_tiled(tiled_ref, poisoned);
      const status st = tile(p, heads, d_raster.cview(), d_tiled.view(), nullptr);
      INFO(st.message());
      REQUIRE(st.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(d_tiled.all_written());
      CHECK(d_tiled.canaries_intact());
      CHECK(same_bytes(d_tiled.download(), tiled_ref));

      // Untile a tiled tensor whose padding slots hold values: they must be dropped, not copied.
      host_tensor tiled(c.type, c.batch, geo.tiled_tokens(), heads, c.head_dim, tiled_order);
      tiled.fill_normal(g);
      host_tensor raster_ref(c.type, c.batch, geo.raster_tokens(), heads, c.head_dim, c.order);
      REQUIRE(reference::untile(p, heads, tiled.cview(), raster_ref.view()).is_ok());
      const device_tensor d_tiled_in(tiled);
      device_tensor d_raster_out(raster_ref, poisoned);
      const status su = untile(p, heads, d_tiled_in.cview(), d_raster_out.view(), nullptr);
      INFO(su.message());
      REQUIRE(su.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(d_raster_out.all_written());
      CHECK(d_raster_out.canaries_intact());
      CHECK(same_bytes(d_raster_out.download(), raster_ref));

      // And back: untile(tile(x)) = x, all on the device.
      device_tensor round(raster, poisoned);
      REQUIRE(untile(p, heads, d_tiled.cview(), round.view(), nullptr).is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(same_bytes(round.download(), raster));
    }
  }
}

TEST_CASE("tile and untile reject bad arguments without touching memory", "[gpu][layout]") {
  const problem p = make_problem({5, 6, 7}, 1, 2, 2, 64, dtype::bf16);
  const tile_geometry geo(p.grid);
  host_tensor raster(p.type, 1, geo.raster_tokens(), 2, 64), tiled(p.type, 1, geo.tiled_tokens(), 2, 64);
  const device_tensor d_raster(raster);
  device_tensor d_tiled(tiled, poisoned);
  CHECK(tile(p, 2, {}, d_tiled.view(), nullptr).code() == errc::null_pointer);
  CHECK(tile(p, 0, d_raster.cview(), d_tiled.view(), nullptr).code() == errc::bad_heads);
  const_tensor short_raster = d_raster.cview();
  short_raster.tokens -= 1;
  CHECK(tile(p, 2, short_raster, d_tiled.view(), nullptr).code() == errc::bad_tokens);
  const_tensor odd = d_raster.cview();
  odd.data = static_cast<const char*>(odd.data) + 2;
  CHECK(tile(p, 2, odd, d_tiled.view(), nullptr).code() == errc::misaligned_pointer);
  problem p96 = p;
  p96.head_dim = 96;
  CHECK(tile(p96, 2, d_raster.cview(), d_tiled.view(), nullptr).code() == errc::bad_head_dim);
  problem pf = p;
  pf.type = dtype::f32;
  CHECK(untile(pf, 2, d_tiled.cview(), {}, nullptr).code() == errc::bad_dtype);
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(d_tiled.poisoned_elements() == d_tiled.shape().elements());
  CHECK(d_tiled.canaries_intact());
}

// Means agree with the reference to within one rounding of the output: the GPU sums in fp32, the
// reference in double, and both round the mean once.
void check_means(const host_tensor& gpu, const host_tensor& ref, dtype t) {
  const std::vector<double> a = values(gpu), b = values(ref);
  REQUIRE(a.size() == b.size());
  const double ulp = t == dtype::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  int64_t off = 0;
  for (std::size_t e = 0; e < a.size(); ++e)
    if (!(std::fabs(a[e] - b[e]) <= 2 * ulp * std::fabs(b[e]) + 1e-4)) ++off;
  CHECK(off == 0);
  CHECK(rel_error(a, b) < (t == dtype::bf16 ? 1e-2 : 1e-3));
}

TEST_CASE("block means match the reference", "[gpu][means]") {
  VSA_TEST_RNG(g, "means");
  for (const config& c : configs(g)) {
    INFO(describe(c));
    const problem p = to_problem(c);
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), tokens = geo.tiled_tokens();
    // Padding slots hold large values: a kernel that read them would be far off.
    const auto input = [&](int64_t heads) {
      host_tensor x(c.type, c.batch, tokens, heads, c.head_dim, c.order);
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t s = 0; s < tokens; ++s)
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t d = 0; d < c.head_dim; ++d)
              x.set(b, s, h, d, s % tile_tokens < geo.valid(s / tile_tokens) ? g.normal(0.5, 1.0) : 1000.0);
      return x;
    };
    const host_tensor q = input(c.q_heads), k = input(c.kv_heads), v = input(c.kv_heads);
    host_tensor q_ref(c.type, c.batch, n, c.q_heads, c.head_dim, layout::bhsd),
        k_ref(c.type, c.batch, n, c.kv_heads, c.head_dim, layout::bhsd),
        v_ref(c.type, c.batch, n, c.kv_heads, c.head_dim, layout::bhsd);
    REQUIRE(
        reference::block_means(p, q.cview(), k.cview(), v.cview(), q_ref.data(), k_ref.data(), v_ref.data()).is_ok());

    const device_tensor dq(q), dk(k), dv(v);
    device_tensor q_c(q_ref, poisoned), k_c(k_ref, poisoned), v_c(v_ref, poisoned);
    const status st = block_means(p, dq.cview(), dk.cview(), dv.cview(), q_c.raw(), k_c.raw(), v_c.raw(), nullptr);
    INFO(st.message());
    REQUIRE(st.is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    for (const device_tensor* out : {&q_c, &k_c, &v_c}) {
      CHECK(out->all_written());
      CHECK(out->canaries_intact());
    }
    check_means(q_c.download(), q_ref, c.type);
    check_means(k_c.download(), k_ref, c.type);
    check_means(v_c.download(), v_ref, c.type);
  }
}

// From raster order (block_means_tiling): the means bit for bit those of block_means on the reference's tiling of the
// same tokens, and the tiled copies of q, k, v and the gate (copied only) bit for bit that tiling, padding slots zero.
TEST_CASE("block means from raster order write the tiled copies", "[gpu][means]") {
  VSA_TEST_RNG(g, "means-tiling");
  for (const config& c : configs(g)) {
    for (const bool gated : {true, false}) {
      INFO(describe(c) << (gated ? " gated" : ""));
      const problem p = to_problem(c);
      const tile_geometry geo(p.grid);
      const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens(), tokens = geo.raster_tokens();
      const int64_t heads[4] = {c.q_heads, c.kv_heads, c.kv_heads, c.q_heads}; // q, k, v, gate
      std::vector<host_tensor> raster, tiled;
      for (int t = 0; t < 4; ++t) {
        raster.emplace_back(c.type, c.batch, tokens, heads[t], c.head_dim, c.order);
        raster.back().fill_normal(g);
        tiled.emplace_back(c.type, c.batch, slots, heads[t], c.head_dim, c.order);
        REQUIRE(reference::tile(p, heads[t], raster.back().cview(), tiled.back().view()).is_ok());
      }
      const device_tensor rq(raster[0]), rk(raster[1]), rv(raster[2]), rg(raster[3]), tq(tiled[0]), tk(tiled[1]),
          tv(tiled[2]);
      const host_tensor means_q(c.type, c.batch, n, c.q_heads, c.head_dim, layout::bhsd),
          means_kv(c.type, c.batch, n, c.kv_heads, c.head_dim, layout::bhsd);
      device_tensor want_q(means_q, poisoned), want_k(means_kv, poisoned), want_v(means_kv, poisoned);
      device_tensor q_c(means_q, poisoned), k_c(means_kv, poisoned), v_c(means_kv, poisoned);
      device_tensor copies[4] = {device_tensor(tiled[0], poisoned), device_tensor(tiled[1], poisoned),
                                 device_tensor(tiled[2], poisoned), device_tensor(tiled[3], poisoned)};
      REQUIRE(block_means(p, tq.cview(), tk.cview(), tv.cview(), want_q.raw(), want_k.raw(), want_v.raw(), nullptr)
                  .is_ok());
      const tiled_inputs to{copies[0].view(), copies[1].view(), copies[2].view(), gated ? copies[3].view() : tensor{}};
      const status st = block_means_tiling(p, rq.cview(), rk.cview(), rv.cview(), gated ? rg.cview() : const_tensor{},
                                           to, q_c.raw(), k_c.raw(), v_c.raw(), nullptr, nullptr, nullptr);
      INFO(st.message());
      REQUIRE(st.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(q_c.download().bytes == want_q.download().bytes);
      CHECK(k_c.download().bytes == want_k.download().bytes);
      CHECK(v_c.download().bytes == want_v.download().bytes);
      for (int t = 0; t < (gated ? 4 : 3); ++t) {
        INFO("copy " << t);
        CHECK(copies[t].canaries_intact());
        CHECK(copies[t].download().bytes == tiled[t].bytes);
      }
      if (!gated) CHECK(copies[3].poisoned_elements() == copies[3].shape().elements()); // no gate: nothing copied
    }
  }
  // What it refuses: a tiled tensor where the raster one belongs, a missing copy, a copy of a gate not given, a copy
  // over an input.
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 128, dtype::bf16);
  const tile_geometry geo(p.grid);
  host_tensor rq(p.type, 1, geo.raster_tokens(), 2, 128), rkv(p.type, 1, geo.raster_tokens(), 1, 128),
      tq(p.type, 1, geo.tiled_tokens(), 2, 128), tkv(p.type, 1, geo.tiled_tokens(), 1, 128);
  const device_tensor dq(rq), dk(rkv), dv(rkv);
  device_tensor cq(tq), ck(tkv), cv(tkv);
  device_buffer out(1 << 16);
  void* o = out.get();
  const tiled_inputs to{cq.view(), ck.view(), cv.view(), {}};
  CHECK(block_means_tiling(p, dq.cview(), dk.cview(), dv.cview(), {}, to, o, o, o, nullptr, nullptr, nullptr).code() ==
        errc::aliased); // the three means in one buffer
  device_buffer mq(1 << 14), mk(1 << 14), mv(1 << 14);
  const auto call = [&](const_tensor q, const tiled_inputs& t, const_tensor gate = {}) {
    return block_means_tiling(p, q, dk.cview(), dv.cview(), gate, t, mq.get(), mk.get(), mv.get(), nullptr, nullptr,
                              nullptr)
        .code();
  };
  CHECK(call(dq.cview(), to) == errc::ok);
  CHECK(call(cq.cview(), to) == errc::bad_tokens);
  tiled_inputs missing = to;
  missing.v = {};
  CHECK(call(dq.cview(), missing) == errc::null_pointer);
  tiled_inputs stray = to;
  stray.gate = cq.view();
  CHECK(call(dq.cview(), stray) == errc::bad_argument);
  tiled_inputs onto_input = to;
  onto_input.k = tensor{const_cast<void*>(dk.cview().data), geo.tiled_tokens(), ck.view().batch_stride,
                        ck.view().token_stride, ck.view().head_stride};
  CHECK(call(dq.cview(), onto_input) != errc::ok);
  VSA_REQUIRE_RT(gpu_sync());
}

TEST_CASE("block means reject bad arguments", "[gpu][means]") {
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 128, dtype::fp16);
  const tile_geometry geo(p.grid);
  host_tensor q(p.type, 1, geo.tiled_tokens(), 2, 128), kv(p.type, 1, geo.tiled_tokens(), 1, 128);
  const device_tensor dq(q), dk(kv), dv(kv);
  device_buffer out(4096);
  void* o = out.get();
  CHECK(block_means(p, dq.cview(), dk.cview(), dv.cview(), nullptr, o, o, nullptr).code() == errc::null_pointer);
  const_tensor short_v = dv.cview();
  short_v.tokens = geo.raster_tokens(); // a raster-order tensor where the tiled one belongs
  CHECK(block_means(p, dq.cview(), dk.cview(), short_v, o, o, o, nullptr).code() == errc::bad_tokens);
  CHECK(block_means(p, dq.cview(), dk.cview(), dv.cview(), static_cast<char*>(o) + 8, o, o, nullptr).code() ==
        errc::misaligned_pointer);
  problem bad = p;
  bad.kv_heads = 3;
  CHECK(block_means(bad, dq.cview(), dk.cview(), dv.cview(), o, o, o, nullptr).code() == errc::bad_heads);
}

} // namespace
} // namespace test
} // namespace vsa
