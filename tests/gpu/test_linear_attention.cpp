// The linear-attention branch on the GPU against the CPU reference, forward and backward, for every feature
// map: tiled order with partial tiles (padding slots of the inputs hold NaN, so any read of them shows) and
// raster order with a short last block of 64, batch > 1, GQA, both layouts, bf16 and fp16, head dims 64 and
// 128. Outputs are poisoned before every call and checked fully written, canaries intact, padding slots 0,
// and each call is run twice and compared bit for bit; a forward that keeps its state and a backward that
// takes it give the same bits as the calls without.
#include "support/gpu.hpp"
#include "support/host.hpp"

#include <vsa/gpu/linear_attention.hpp>
#include <vsa/numeric.hpp>
#include <vsa/reference.hpp>

#include <cmath>
#include <cstring>
#include <limits>
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
  token_order tokens;
  float eps;
  double v_mean;         // a common offset of v, which the kernels' centering must absorb
  double qk_scale = 1.0; // q and k multiplied by it: activations at the scales models produce
};

std::string describe(const config& c) {
  return std::to_string(c.grid.t) + "x" + std::to_string(c.grid.h) + "x" + std::to_string(c.grid.w) + " B" +
         std::to_string(c.batch) + " Hq" + std::to_string(c.q_heads) + " Hkv" + std::to_string(c.kv_heads) + " D" +
         std::to_string(c.head_dim) + " " + dtype_name(c.type) + (c.order == layout::bshd ? " bshd" : " bhsd") +
         (c.tokens == token_order::tiled ? " tiled" : " raster") + " eps " + std::to_string(c.eps) + " v mean " +
         std::to_string(c.v_mean) + " q, k scale " + std::to_string(c.qk_scale);
}

std::vector<config> configs() {
  return {
      {{5, 6, 7}, 2, 4, 2, 64, dtype::bf16, layout::bshd, token_order::tiled, 1e-3f, 0.0},
      {{9, 10, 11}, 1, 2, 2, 128, dtype::bf16, layout::bhsd, token_order::tiled, 0.0f, 0.0},
      {{7, 5, 9}, 1, 4, 1, 128, dtype::fp16, layout::bshd, token_order::raster, 1e-3f, 0.0},
      {{4, 8, 13}, 2, 2, 1, 64, dtype::fp16, layout::bhsd, token_order::raster, 1e-2f, 0.0},
      {{6, 7, 5}, 1, 2, 1, 128, dtype::bf16, layout::bshd, token_order::raster, 1e-3f, 3.0},
      {{5, 9, 6}, 1, 3, 1, 64, dtype::fp16, layout::bhsd, token_order::tiled, 1e-3f, 3.0},
      {{3, 5, 6}, 1, 1, 1, 128, dtype::fp16, layout::bshd, token_order::tiled, 1e-3f, 0.0},
      // More heads × chunks than a large GPU keeps resident: blocks walk several chunks (the prefetch path).
      {{15, 16, 17}, 2, 8, 4, 64, dtype::bf16, layout::bshd, token_order::tiled, 1e-3f, 1.0},
      {{12, 16, 20}, 1, 8, 8, 128, dtype::fp16, layout::bhsd, token_order::raster, 1e-3f, 0.0},
  };
}

problem to_problem(const config& c) { return make_problem(c.grid, c.batch, c.q_heads, c.kv_heads, c.head_dim, c.type); }

int64_t token_count(const config& c) {
  const tile_geometry geo(c.grid);
  return c.tokens == token_order::tiled ? geo.tiled_tokens() : geo.raster_tokens();
}

bool is_padding(const config& c, int64_t s) {
  const tile_geometry geo(c.grid);
  return c.tokens == token_order::tiled && (s % tile_tokens) >= geo.valid(s / tile_tokens);
}

// Normal values (plus `mean`) in every token, NaN in the padding slots of a tiled tensor: those must never
// be read.
host_tensor input(const config& c, int64_t heads, rng& g, double mean = 0.0, double scale = 1.0) {
  host_tensor x(c.type, c.batch, token_count(c), heads, c.head_dim, c.order);
  for (int64_t b = 0; b < x.batch; ++b)
    for (int64_t s = 0; s < x.tokens; ++s)
      for (int64_t h = 0; h < x.heads; ++h)
        for (int64_t d = 0; d < x.dim; ++d)
          x.set(b, s, h, d, is_padding(c, s) ? std::numeric_limits<double>::quiet_NaN() : mean + scale * g.normal());
  return x;
}

// bf16 keeps 8 bits, fp16 11: the tolerance covers the rounding of inputs, of the 16-bit matrix operands
// and of the outputs (a host emulation of the kernels' arithmetic gives at most 5e-3 and 6e-4).
double tolerance(dtype t) { return t == dtype::bf16 ? 1e-2 : 2e-3; }

double error_of(const device_tensor& gpu, const host_tensor& ref) { return rel_error(gpu.download(), ref); }

// Padding slots of a tiled output that are not exactly 0.
int64_t nonzero_padding(const config& c, const host_tensor& x) {
  int64_t bad = 0;
  for (int64_t b = 0; b < x.batch; ++b)
    for (int64_t s = 0; s < x.tokens; ++s)
      if (is_padding(c, s))
        for (int64_t h = 0; h < x.heads; ++h)
          for (int64_t d = 0; d < x.dim; ++d) bad += x.get(b, s, h, d) != 0.0 ? 1 : 0;
  return bad;
}

std::vector<unsigned char> bytes_of(const device_tensor& x) { return x.download().bytes; }

void check_feature(const config& c, feature_map phi) {
  const problem p = to_problem(c);
  const std::string label = "linear " + describe(c) + " phi " + std::to_string(static_cast<int>(phi));
  VSA_TEST_RNG(g, label.c_str());
  INFO(label);
  const int64_t tokens = token_count(c);
  const host_tensor q = input(c, p.q_heads, g, 0.0, c.qk_scale), k = input(c, p.kv_heads, g, 0.0, c.qk_scale),
                    v = input(c, p.kv_heads, g, c.v_mean), d_o = input(c, p.q_heads, g);
  const device_tensor q_d(q), k_d(k), v_d(v), d_o_d(d_o);

  // Forward.
  host_tensor o_ref(c.type, c.batch, tokens, p.q_heads, c.head_dim, c.order);
  REQUIRE(
      reference::linear_attention_forward(p, phi, c.eps, c.tokens, q.view(), k.view(), v.view(), o_ref.view()).is_ok());
  std::size_t bytes = 0;
  {
    const status st =
        linear_attention_forward(p, phi, c.eps, c.tokens, {}, {}, {}, {}, nullptr, bytes, gpu::stream_t{});
    INFO(st.message());
    REQUIRE(st.is_ok());
  }
  // Three runs: the second must give the first's bits, and so must the third, which also keeps the state for the
  // backward.
  const std::size_t state_bytes = linear_state_bytes(p);
  REQUIRE(state_bytes > 0);
  device_buffer saved(state_bytes);
  saved.poison();
  const linear_state kept{saved.get(), state_bytes};
  std::vector<unsigned char> first;
  for (int run = 0; run < 3; ++run) {
    device_buffer ws(bytes);
    ws.poison();
    device_tensor o(o_ref, poisoned);
    const status st = run < 2 ? linear_attention_forward(p, phi, c.eps, c.tokens, q_d.cview(), k_d.cview(), v_d.cview(),
                                                         o.view(), ws.get(), bytes, gpu::stream_t{})
                              : linear_attention_forward(p, phi, c.eps, c.tokens, q_d.cview(), k_d.cview(), v_d.cview(),
                                                         o.view(), kept, ws.get(), bytes, gpu::stream_t{});
    INFO(st.message());
    REQUIRE(st.is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(o.all_written());
    CHECK(o.canaries_intact());
    CHECK(ws.canaries_intact());
    const double err = error_of(o, o_ref);
    INFO("forward relative error " << err);
    CHECK(err < tolerance(c.type));
    CHECK(nonzero_padding(c, o.download()) == 0);
    if (run == 0)
      first = bytes_of(o);
    else
      CHECK(first == bytes_of(o));
  }
  CHECK(saved.canaries_intact());

  // Backward.
  host_tensor dq_ref(c.type, c.batch, tokens, p.q_heads, c.head_dim, c.order),
      dk_ref(c.type, c.batch, tokens, p.kv_heads, c.head_dim, c.order),
      dv_ref(c.type, c.batch, tokens, p.kv_heads, c.head_dim, c.order);
  REQUIRE(reference::linear_attention_backward(p, phi, c.eps, c.tokens, q.view(), k.view(), v.view(), d_o.view(),
                                               dq_ref.view(), dk_ref.view(), dv_ref.view())
              .is_ok());
  bytes = 0;
  {
    const status st =
        linear_attention_backward(p, phi, c.eps, c.tokens, {}, {}, {}, {}, {}, {}, {}, nullptr, bytes, gpu::stream_t{});
    INFO(st.message());
    REQUIRE(st.is_ok());
  }
  // Three runs again, the third taking the kept state instead of recomputing it. Its workspace's own state stays
  // poisoned, so a read of that instead of the kept one would show.
  std::vector<unsigned char> first_dq, first_dk, first_dv;
  for (int run = 0; run < 3; ++run) {
    device_buffer ws(bytes);
    ws.poison();
    device_tensor dq(dq_ref, poisoned), dk(dk_ref, poisoned), dv(dv_ref, poisoned);
    const status st =
        run < 2
            ? linear_attention_backward(p, phi, c.eps, c.tokens, q_d.cview(), k_d.cview(), v_d.cview(), d_o_d.cview(),
                                        dq.view(), dk.view(), dv.view(), ws.get(), bytes, gpu::stream_t{})
            : linear_attention_backward(p, phi, c.eps, c.tokens, q_d.cview(), k_d.cview(), v_d.cview(), d_o_d.cview(),
                                        dq.view(), dk.view(), dv.view(), kept, ws.get(), bytes, gpu::stream_t{});
    INFO(st.message());
    REQUIRE(st.is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(dq.all_written());
    CHECK(dk.all_written());
    CHECK(dv.all_written());
    CHECK(dq.canaries_intact());
    CHECK(dk.canaries_intact());
    CHECK(dv.canaries_intact());
    CHECK(ws.canaries_intact());
    const double eq = error_of(dq, dq_ref), ek = error_of(dk, dk_ref), ev = error_of(dv, dv_ref);
    INFO("relative errors: dq " << eq << ", dk " << ek << ", dv " << ev);
    CHECK(eq < tolerance(c.type));
    CHECK(ek < tolerance(c.type));
    CHECK(ev < tolerance(c.type));
    CHECK(nonzero_padding(c, dq.download()) == 0);
    CHECK(nonzero_padding(c, dk.download()) == 0);
    CHECK(nonzero_padding(c, dv.download()) == 0);
    if (run == 0) {
      first_dq = bytes_of(dq);
      first_dk = bytes_of(dk);
      first_dv = bytes_of(dv);
    } else {
      CHECK(first_dq == bytes_of(dq));
      CHECK(first_dk == bytes_of(dk));
      CHECK(first_dv == bytes_of(dv));
    }
  }
  CHECK(saved.canaries_intact());
}

TEST_CASE("linear attention matches the reference", "[gpu][linear]") {
  for (const config& c : configs())
    for (const feature_map phi : {feature_map::softmax, feature_map::elu1, feature_map::relu}) check_feature(c, phi);
}

// The scale sweep of the accuracy tests (test_accuracy.cpp) for the linear branch: q and k multiplied by s, every
// feature map, tiled and raster order, the same tolerances as at unit scale.
TEST_CASE("linear attention at the scales models produce", "[gpu][linear][accuracy]") {
  for (const double s : {4.0, 16.0, 32.0, 64.0}) {
    const std::vector<config> sweep = {
        {{5, 9, 13}, 1, 4, 2, 128, dtype::bf16, layout::bshd, token_order::tiled, 1e-3f, 0.0, s},
        {{8, 8, 8}, 1, 2, 2, 64, dtype::fp16, layout::bhsd, token_order::raster, 1e-3f, 0.0, s},
    };
    for (const config& c : sweep)
      for (const feature_map phi : {feature_map::softmax, feature_map::elu1, feature_map::relu}) check_feature(c, phi);
  }
}

TEST_CASE("linear attention rejects bad arguments", "[gpu][linear]") {
  const config c{{5, 6, 7}, 1, 2, 1, 64, dtype::bf16, layout::bshd, token_order::tiled, 1e-3f, 0.0};
  const problem p = to_problem(c);
  VSA_TEST_RNG(g, "linear arguments");
  const int64_t tokens = token_count(c);
  const host_tensor q = input(c, 2, g), k = input(c, 1, g);
  const device_tensor q_d(q), k_d(k);
  host_tensor o_shape(c.type, 1, tokens, 2, 64, c.order);
  device_tensor o(o_shape, poisoned);
  std::size_t bytes = 0;
  REQUIRE(
      linear_attention_forward(p, feature_map::elu1, 1e-3f, c.tokens, {}, {}, {}, {}, nullptr, bytes, gpu::stream_t{})
          .is_ok());
  device_buffer ws(bytes);
  const auto forward = [&](const problem& pp, feature_map phi, float eps, token_order order, const_tensor qq,
                           const_tensor kk, tensor oo, void* w, std::size_t n) {
    return linear_attention_forward(pp, phi, eps, order, qq, kk, kk, oo, w, n, gpu::stream_t{});
  };

  problem bad = p;
  bad.head_dim = 96;
  CHECK(forward(bad, feature_map::elu1, 1e-3f, c.tokens, q_d.cview(), k_d.cview(), o.view(), ws.get(), bytes).code() ==
        errc::bad_head_dim);
  bad = p;
  bad.type = dtype::f32;
  CHECK(forward(bad, feature_map::elu1, 1e-3f, c.tokens, q_d.cview(), k_d.cview(), o.view(), ws.get(), bytes).code() ==
        errc::bad_dtype);
  bad = p;
  bad.kv_heads = 3;
  CHECK(forward(bad, feature_map::elu1, 1e-3f, c.tokens, q_d.cview(), k_d.cview(), o.view(), ws.get(), bytes).code() ==
        errc::bad_heads);
  CHECK(forward(p, static_cast<feature_map>(7), 1e-3f, c.tokens, q_d.cview(), k_d.cview(), o.view(), ws.get(), bytes)
            .code() == errc::bad_argument);
  CHECK(forward(p, feature_map::elu1, -1.f, c.tokens, q_d.cview(), k_d.cview(), o.view(), ws.get(), bytes).code() ==
        errc::bad_argument);
  CHECK(forward(p, feature_map::elu1, std::numeric_limits<float>::quiet_NaN(), c.tokens, q_d.cview(), k_d.cview(),
                o.view(), ws.get(), bytes)
            .code() == errc::bad_argument);
  CHECK(forward(p, feature_map::elu1, std::numeric_limits<float>::infinity(), c.tokens, q_d.cview(), k_d.cview(),
                o.view(), ws.get(), bytes)
            .code() == errc::bad_argument);
  CHECK(forward(p, feature_map::elu1, 1e-3f, static_cast<token_order>(5), q_d.cview(), k_d.cview(), o.view(), ws.get(),
                bytes)
            .code() == errc::bad_argument);
  // Tiled tensors given as raster: the token counts differ.
  CHECK(forward(p, feature_map::elu1, 1e-3f, token_order::raster, q_d.cview(), k_d.cview(), o.view(), ws.get(), bytes)
            .code() == errc::bad_tokens);
  const_tensor null_q = q_d.cview();
  null_q.data = nullptr;
  CHECK(forward(p, feature_map::elu1, 1e-3f, c.tokens, null_q, k_d.cview(), o.view(), ws.get(), bytes).code() ==
        errc::null_pointer);
  const_tensor odd_q = q_d.cview();
  odd_q.data = static_cast<const uint16_t*>(odd_q.data) + 1;
  CHECK(forward(p, feature_map::elu1, 1e-3f, c.tokens, odd_q, k_d.cview(), o.view(), ws.get(), bytes).code() ==
        errc::misaligned_pointer);
  if (bytes > 0) {
    CHECK(forward(p, feature_map::elu1, 1e-3f, c.tokens, q_d.cview(), k_d.cview(), o.view(), ws.get(), bytes - 1)
              .code() == errc::bad_workspace);
  }
  // A kept state too small or misaligned.
  const std::size_t state_bytes = linear_state_bytes(p);
  device_buffer saved(state_bytes + 256);
  CHECK(linear_attention_forward(p, feature_map::elu1, 1e-3f, c.tokens, q_d.cview(), k_d.cview(), k_d.cview(), o.view(),
                                 linear_state{saved.get(), state_bytes - 1}, ws.get(), bytes, gpu::stream_t{})
            .code() == errc::bad_workspace);
  CHECK(linear_attention_forward(p, feature_map::elu1, 1e-3f, c.tokens, q_d.cview(), k_d.cview(), k_d.cview(), o.view(),
                                 linear_state{static_cast<unsigned char*>(saved.get()) + 16, state_bytes}, ws.get(),
                                 bytes, gpu::stream_t{})
            .code() == errc::misaligned_pointer);
  VSA_REQUIRE_RT(gpu_sync());
  // Nothing was written by any rejected call.
  CHECK(o.poisoned_elements() == o_shape.elements());
  CHECK(o.canaries_intact());

  std::size_t back = 0;
  REQUIRE(linear_attention_backward(p, feature_map::relu, 0.f, c.tokens, {}, {}, {}, {}, {}, {}, {}, nullptr, back,
                                    gpu::stream_t{})
              .is_ok());
  device_buffer wsb(back);
  const status sb =
      linear_attention_backward(p, feature_map::relu, 0.f, c.tokens, q_d.cview(), k_d.cview(), k_d.cview(), q_d.cview(),
                                o.view(), tensor{}, tensor{}, wsb.get(), back, gpu::stream_t{});
  CHECK(sb.code() == errc::null_pointer);
  CHECK(mentions(sb, "dk"));
}

} // namespace
} // namespace test
} // namespace vsa
