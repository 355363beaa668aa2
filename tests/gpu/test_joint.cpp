// The joint sparse pass on the GPU (joint_attention.hpp) against the CPU reference (reference/joint.hpp), forward
// and backward: extra counts 0, 1, 77, 256 and 333, before and after the video, partial tiles on every axis, GQA,
// both layouts, bf16 and fp16, head dims 64 and 128, ragged lists with empty rows; outputs poisoned before every
// call and checked fully written, the backward bitwise reproducible, and E = 0 bitwise the video-only pass. Then the
// whole op with extra tokens (joint_forward, joint_backward in op.hpp) against the reference on the GPU's selection.
#include "support/gpu.hpp"
#include "support/host.hpp"

#include <vsa/gpu/joint_attention.hpp>
#include <vsa/gpu/op.hpp>
#include <vsa/reference.hpp>

#include <algorithm>
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
};

std::string describe(const config& c, const extra_tokens& e) {
  return std::to_string(c.grid.t) + "x" + std::to_string(c.grid.h) + "x" + std::to_string(c.grid.w) + " B" +
         std::to_string(c.batch) + " Hq" + std::to_string(c.q_heads) + " Hkv" + std::to_string(c.kv_heads) + " D" +
         std::to_string(c.head_dim) + " " + dtype_name(c.type) + (c.order == layout::bshd ? " bshd" : " bhsd") + " E" +
         std::to_string(e.count) + (e.first ? " first" : " last");
}

// Partial tiles on every axis (narrow steps over tiles of 32 valid tokens or fewer in the first three), GQA, both
// layouts and dtypes, both head dims.
std::vector<config> configs() {
  return {
      {{5, 6, 7}, 2, 4, 2, 64, dtype::bf16, layout::bshd},
      {{9, 10, 11}, 1, 2, 2, 128, dtype::bf16, layout::bhsd},
      {{7, 5, 9}, 1, 4, 1, 128, dtype::fp16, layout::bshd},
      {{8, 7, 12}, 1, 2, 1, 64, dtype::fp16, layout::bhsd},
  };
}

// The token axis of a joint tensor as types.hpp lays it out.
struct joint_axis {
  tile_geometry geo;
  extra_tokens extra;
  int64_t slots, tokens;
  joint_axis(grid3 g, extra_tokens e) : geo(g), extra(e), slots(geo.tiled_tokens()), tokens(slots + e.count) {}
  bool is_extra(int64_t s) const { return extra.first ? s < extra.count : s >= slots; }
  bool is_padding(int64_t s) const {
    if (is_extra(s)) return false;
    const int64_t slot = extra.first ? s - extra.count : s;
    return slot % 64 >= geo.valid(slot / 64);
  }
};

// Normal values on every token, `padding` (zero, or NaN as a caller's buffer may hold) on the video's padding slots.
host_tensor joint_input(const config& c, const joint_axis& a, int64_t heads, rng& g, double padding = 0.0) {
  host_tensor x(c.type, c.batch, a.tokens, heads, c.head_dim, c.order);
  for (int64_t b = 0; b < x.batch; ++b)
    for (int64_t s = 0; s < x.tokens; ++s)
      for (int64_t h = 0; h < x.heads; ++h)
        for (int64_t d = 0; d < x.dim; ++d) x.set(b, s, h, d, a.is_padding(s) ? padding : g.normal());
  return x;
}

host_tensor with_nan_padding(const host_tensor& x, const joint_axis& a) {
  host_tensor y = x;
  for (int64_t b = 0; b < y.batch; ++b)
    for (int64_t s = 0; s < y.tokens; ++s)
      if (a.is_padding(s))
        for (int64_t h = 0; h < y.heads; ++h)
          for (int64_t d = 0; d < y.dim; ++d) y.set(b, s, h, d, std::numeric_limits<double>::quiet_NaN());
  return y;
}

double error_of(const device_tensor& gpu, const host_tensor& ref) { return rel_error(gpu.download(), ref); }
constexpr double tolerance = 1e-2;

// A backward's dq, dk, dv: fully written, canaries intact, within rounding of the reference's; returns their raw
// values, one after another, for the bitwise comparison of runs.
std::vector<double> check_gradients(const device_tensor& dq, const device_tensor& dk, const device_tensor& dv,
                                    const host_tensor& dq_ref, const host_tensor& dk_ref, const host_tensor& dv_ref) {
  CHECK(dq.all_written());
  CHECK(dk.all_written());
  CHECK(dv.all_written());
  CHECK(dq.canaries_intact());
  CHECK(dk.canaries_intact());
  CHECK(dv.canaries_intact());
  CHECK(error_of(dq, dq_ref) < tolerance);
  CHECK(error_of(dk, dk_ref) < tolerance);
  CHECK(error_of(dv, dv_ref) < tolerance);
  std::vector<double> all = dq.download_raw(), kk = dk.download_raw(), vv = dv.download_raw();
  all.insert(all.end(), kk.begin(), kk.end());
  all.insert(all.end(), vv.begin(), vv.end());
  return all;
}

int64_t lse_mismatches(const std::vector<float>& gpu, const std::vector<float>& ref) {
  int64_t bad = 0;
  for (std::size_t r = 0; r < ref.size(); ++r) bad += lse_close(gpu[r], ref[r]) ? 0 : 1;
  return bad;
}

// The pass on one configuration and extra block; nan_padding: the GPU's k and v hold NaN in the video's padding
// slots (the reference's hold zeros).
void check_joint(const config& c, extra_tokens extra, int64_t capacity, const char* label, bool nan_padding = false) {
  const problem p = make_problem(c.grid, c.batch, c.q_heads, c.kv_heads, c.head_dim, c.type);
  VSA_TEST_RNG(g, label);
  INFO(describe(c, extra) << " capacity " << capacity << (nan_padding ? " NaN padding" : ""));
  const joint_axis a(c.grid, extra);
  const q2k_lists lists = random_lists(p, capacity, g); // ragged, every 7th row empty
  const host_tensor q = joint_input(c, a, p.q_heads, g), k = joint_input(c, a, p.kv_heads, g),
                    v = joint_input(c, a, p.kv_heads, g), d_o = joint_input(c, a, p.q_heads, g);
  const float scale = 1.f / std::sqrt(float(c.head_dim));

  host_tensor o_ref(c.type, c.batch, a.tokens, p.q_heads, c.head_dim, c.order);
  std::vector<float> lse_ref(p.batch * p.q_heads * a.tokens);
  REQUIRE(reference::joint_sparse_attention_forward(p, extra, scale, q.view(), k.view(), v.view(), lists.view(),
                                                    o_ref.view(), lse_ref.data())
              .is_ok());

  const device_tensor dq_in(q), ddo(d_o), dk_in(nan_padding ? with_nan_padding(k, a) : k),
      dv_in(nan_padding ? with_nan_padding(v, a) : v);
  const device_buffer q2k(upload(lists.q2k)), count(upload(lists.count));
  const const_index_lists dl{q2k.as<int32_t>(), count.as<int32_t>(), capacity, nullptr, nullptr};

  device_tensor o(o_ref, poisoned);
  device_buffer lse(lse_ref.size() * sizeof(float));
  lse.poison();
  const std::size_t fwd_bytes = joint_sparse_attention_forward_workspace(p, extra);
  CHECK((fwd_bytes == 0) == (extra.count == 0));
  device_buffer fwd_ws(fwd_bytes > 0 ? fwd_bytes : 1);
  const status st = joint_sparse_attention_forward(p, extra, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), dl,
                                                   o.view(), lse.as<float>(), fwd_ws.get(), fwd_bytes, nullptr);
  INFO(st.message());
  REQUIRE(st.is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(o.all_written());
  CHECK(o.canaries_intact());
  CHECK(lse.canaries_intact());
  CHECK(error_of(o, o_ref) < tolerance);
  CHECK(lse_mismatches(lse.download<float>(), lse_ref) == 0);

  host_tensor dq_ref(c.type, c.batch, a.tokens, p.q_heads, c.head_dim, c.order),
      dk_ref(c.type, c.batch, a.tokens, p.kv_heads, c.head_dim, c.order),
      dv_ref(c.type, c.batch, a.tokens, p.kv_heads, c.head_dim, c.order);
  REQUIRE(reference::joint_sparse_attention_backward(p, extra, scale, q.view(), k.view(), v.view(), o_ref.view(),
                                                     d_o.view(), lse_ref.data(), lists.view(), dq_ref.view(),
                                                     dk_ref.view(), dv_ref.view())
              .is_ok());
  std::size_t bytes = 0;
  REQUIRE(joint_sparse_attention_backward(p, extra, scale, {}, {}, {}, {}, {}, nullptr, dl, {}, {}, {}, nullptr, bytes,
                                          nullptr)
              .is_ok());
  CHECK(bytes == joint_sparse_attention_backward_workspace(p, extra, capacity));
  // The size the query asks (dq from the dS that dk/dv stores, every head at once where the platform stores it),
  // twice; then one kv head's slots at a time, and the least workspace, where dq recomputes dS.
  const std::size_t least = joint_sparse_attention_backward_least_workspace(p, extra, capacity);
  std::size_t one_head = least;
  if (extra.count > 0) {
    const vsa::detail::joint_tiles t(p, extra);
    const vsa::detail::joint_backward_scratch fewest(p, t);
    const std::size_t fixed = least - fewest.bytes();
    const vsa::detail::joint_backward_scratch full(p, t, capacity, bytes - fixed);
    CHECK(fixed + full.bytes() == bytes);
    CHECK((full.units == p.batch * p.kv_heads) == gpu::detail::stores_ds_for(p.type, p.head_dim, true));
    if (full.units > 0) one_head = least + full.map + full.slots / full.units;
    CHECK(vsa::detail::joint_backward_scratch(p, t, capacity, one_head - fixed).units == (full.units > 0 ? 1 : 0));
  }
  const std::size_t sizes[] = {bytes, bytes, one_head, least};
  device_buffer ws(bytes);
  std::vector<std::vector<double>> runs;
  std::size_t dq_elems = 0;
  for (std::size_t size : sizes) {
    INFO("workspace " << size << " of " << bytes);
    device_tensor dq(dq_ref, poisoned), dk(dk_ref, poisoned), dv(dv_ref, poisoned);
    ws.poison();
    const status sb = joint_sparse_attention_backward(p, extra, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(),
                                                      o.cview(), ddo.cview(), lse.as<float>(), dl, dq.view(), dk.view(),
                                                      dv.view(), ws.get(), size, nullptr);
    INFO(sb.message());
    REQUIRE(sb.is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(ws.canaries_intact());
    dq_elems = dq.download_raw().size();
    runs.push_back(check_gradients(dq, dk, dv, dq_ref, dk_ref, dv_ref));
  }
  const auto same = [&](int a, int b, std::size_t from) {
    return std::memcmp(runs[a].data() + from, runs[b].data() + from, (runs[a].size() - from) * sizeof(double)) == 0;
  };
  CHECK(same(0, 1, 0));        // bitwise reproducible
  CHECK(same(0, 2, 0));        // the groups of heads change no result
  CHECK(same(0, 3, dq_elems)); // dk and dv do not depend on dq's form
}

TEST_CASE("joint sparse attention matches the reference", "[gpu][joint]") {
  const int64_t counts[] = {0, 1, 77, 256, 333};
  int k = 0;
  for (const config& c : configs()) {
    const int64_t n = tile_geometry(c.grid).num_tiles();
    for (int64_t e : counts) {
      const bool first = (k++ % 2) == 1;
      check_joint(c, {e, first}, std::max<int64_t>(1, n / 3), "joint");
      check_joint(c, {e, !first}, n, "joint-kN"); // k = N: every video query attends to everything
    }
    check_joint(c, {77, true}, std::max<int64_t>(1, n / 3), "joint-nan-padding", true);
    check_joint(c, {1, false}, 1, "joint-k1");
  }
}

// E = 0 runs the video-only pass: the same outputs, bit for bit, as sparse_attention_forward and
// sparse_attention_backward on the same lists.
TEST_CASE("joint sparse attention without extra tokens is the video-only pass", "[gpu][joint]") {
  const config c = configs()[1];
  const problem p = make_problem(c.grid, c.batch, c.q_heads, c.kv_heads, c.head_dim, c.type);
  VSA_TEST_RNG(g, "joint-e0");
  const joint_axis a(c.grid, {});
  const int64_t n = tile_geometry(c.grid).num_tiles();
  const q2k_lists lists = random_lists(p, std::max<int64_t>(1, n / 3), g);
  index_lists full{const_cast<int32_t*>(lists.q2k.data()), const_cast<int32_t*>(lists.count.data()), lists.capacity,
                   nullptr, nullptr};
  std::vector<int32_t> k2q(lists.q2k.size()), offset(p.batch * p.q_heads * (n + 1));
  full.k2q = k2q.data();
  full.k2q_offset = offset.data();
  REQUIRE(reference::build_k2q(p, full).is_ok());
  const host_tensor q = joint_input(c, a, p.q_heads, g), k = joint_input(c, a, p.kv_heads, g),
                    v = joint_input(c, a, p.kv_heads, g), d_o = joint_input(c, a, p.q_heads, g);
  const float scale = 1.f / std::sqrt(float(c.head_dim));
  const device_tensor dq_in(q), dk_in(k), dv_in(v), ddo(d_o);
  const device_buffer q2k(upload(lists.q2k)), count(upload(lists.count)), dk2q(upload(k2q)), doff(upload(offset));
  const const_index_lists dl{q2k.as<int32_t>(), count.as<int32_t>(), lists.capacity, dk2q.as<int32_t>(),
                             doff.as<int32_t>()};

  device_tensor o1(q, poisoned), o2(q, poisoned);
  const std::size_t lse_size = sizeof(float) * p.batch * p.q_heads * a.tokens;
  device_buffer l1(lse_size), l2(lse_size);
  REQUIRE(sparse_attention_forward(p, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), dl, o1.view(), l1.as<float>(),
                                   nullptr)
              .is_ok());
  REQUIRE(joint_sparse_attention_forward(p, {}, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), dl, o2.view(),
                                         l2.as<float>(), nullptr, 0, nullptr)
              .is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(o1.download_raw() == o2.download_raw());
  CHECK(l1.download_bytes() == l2.download_bytes());

  device_tensor dq1(q, poisoned), dk1(k, poisoned), dv1(v, poisoned), dq2(q, poisoned), dk2(k, poisoned),
      dv2(v, poisoned);
  std::size_t b1 = 0, b2 = 0;
  REQUIRE(
      sparse_attention_backward(p, scale, {}, {}, {}, {}, {}, nullptr, dl, {}, {}, {}, nullptr, b1, nullptr).is_ok());
  REQUIRE(
      joint_sparse_attention_backward(p, {}, scale, {}, {}, {}, {}, {}, nullptr, dl, {}, {}, {}, nullptr, b2, nullptr)
          .is_ok());
  // The video-only pass in the least workspace, as the joint one runs it (dq recomputing dS).
  b1 = sparse_attention_backward_workspace(p);
  device_buffer w1(b1), w2(b2);
  REQUIRE(sparse_attention_backward(p, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), o1.cview(), ddo.cview(),
                                    l1.as<float>(), dl, dq1.view(), dk1.view(), dv1.view(), w1.get(), b1, nullptr)
              .is_ok());
  REQUIRE(joint_sparse_attention_backward(p, {}, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), o1.cview(),
                                          ddo.cview(), l1.as<float>(), dl, dq2.view(), dk2.view(), dv2.view(), w2.get(),
                                          b2, nullptr)
              .is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(dq1.download_raw() == dq2.download_raw());
  CHECK(dk1.download_raw() == dk2.download_raw());
  CHECK(dv1.download_raw() == dv2.download_raw());
}

// The whole op with extra tokens (joint_forward, joint_backward) against the reference's on the GPU's own selection
// (reference::joint_forward_on_lists: the coarse branch and gate computed there, the fine pass on the GPU's lists),
// gated and not, the backward bitwise reproducible; an extra row of dgate must be 0.
TEST_CASE("the joint whole op matches the reference on its selection", "[gpu][joint][op]") {
  const extra_tokens extras[] = {{77, true}, {256, false}, {1, true}};
  int k = 0;
  for (const config& c : configs()) {
    const extra_tokens extra = extras[k % 3];
    const bool gated = (k++ % 2) == 0;
    const problem p = make_problem(c.grid, c.batch, c.q_heads, c.kv_heads, c.head_dim, c.type);
    VSA_TEST_RNG(g, "joint-op");
    INFO(describe(c, extra) << (gated ? " gated" : " ungated"));
    const joint_axis a(c.grid, extra);
    options opt{};
    opt.sparsity = 0.6;
    const host_tensor q = joint_input(c, a, p.q_heads, g), k_ = joint_input(c, a, p.kv_heads, g),
                      v = joint_input(c, a, p.kv_heads, g), d_o = joint_input(c, a, p.q_heads, g),
                      gate = joint_input(c, a, p.q_heads, g);
    const device_tensor dq_in(q), dk_in(k_), dv_in(v), ddo(d_o), dgate_in(gate);
    device_tensor o(q, poisoned);
    const const_tensor gate_view = gated ? dgate_in.cview() : const_tensor{};
    const forward_io fio{dq_in.cview(), dk_in.cview(), dv_in.cview(), gate_view, o.view()};
    std::size_t fbytes = 0, bbytes = 0;
    REQUIRE(joint_forward(p, extra, opt, fio, nullptr, fbytes, nullptr).is_ok());
    REQUIRE(joint_backward(p, extra, opt, backward_io{}, nullptr, bbytes, nullptr).is_ok());
    REQUIRE(bbytes >= fbytes);
    device_buffer ws(bbytes);
    ws.poison();
    const status sf = joint_forward(p, extra, opt, fio, ws.get(), bbytes, nullptr);
    INFO(sf.message());
    REQUIRE(sf.is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(o.all_written());
    CHECK(o.canaries_intact());

    // The GPU's selection, read back through joint_selected_lists' views of the workspace.
    const_index_lists sel{};
    REQUIRE(joint_selected_lists(p, extra, opt, ws.get(), sel).is_ok());
    const int64_t rows = p.batch * p.q_heads * tile_geometry(c.grid).num_tiles();
    const auto offset_of = [&](const void* x) {
      return static_cast<int64_t>(static_cast<const unsigned char*>(x) - static_cast<const unsigned char*>(ws.get()));
    };
    q2k_lists lists{sel.q2k_capacity, ws.download<int32_t>(offset_of(sel.q2k), rows * sel.q2k_capacity),
                    ws.download<int32_t>(offset_of(sel.q2k_count), rows)};
    host_tensor o_ref(c.type, c.batch, a.tokens, p.q_heads, c.head_dim, c.order);
    const forward_io rio{q.view(), k_.view(), v.view(), gated ? gate.view() : const_tensor{}, o_ref.view()};
    std::size_t rbytes = 0;
    REQUIRE(reference::joint_forward_on_lists(p, extra, opt, rio, lists.view(), nullptr, rbytes).is_ok());
    std::size_t rbbytes = 0;
    REQUIRE(reference::joint_backward(p, extra, opt, backward_io{}, nullptr, rbbytes).is_ok());
    aligned_buffer rws(std::max(rbytes, rbbytes));
    rbytes = rws.size();
    const status rf = reference::joint_forward_on_lists(p, extra, opt, rio, lists.view(), rws.data(), rbytes);
    INFO(rf.message());
    REQUIRE(rf.is_ok());
    CHECK(error_of(o, o_ref) < tolerance);

    host_tensor dq_ref(c.type, c.batch, a.tokens, p.q_heads, c.head_dim, c.order),
        dk_ref(c.type, c.batch, a.tokens, p.kv_heads, c.head_dim, c.order),
        dv_ref(c.type, c.batch, a.tokens, p.kv_heads, c.head_dim, c.order),
        dg_ref(c.type, c.batch, a.tokens, p.q_heads, c.head_dim, c.order);
    const backward_io rbio{
        q.view(),      k_.view(),     v.view(),      gated ? gate.view() : const_tensor{}, o_ref.view(), d_o.view(),
        dq_ref.view(), dk_ref.view(), dv_ref.view(), gated ? dg_ref.view() : tensor{}};
    const status rb = reference::joint_backward(p, extra, opt, rbio, rws.data(), rbytes);
    INFO(rb.message());
    REQUIRE(rb.is_ok());

    std::vector<std::vector<double>> runs;
    for (int run = 0; run < 2; ++run) {
      device_tensor dq(q, poisoned), dk(k_, poisoned), dv(v, poisoned), dg(q, poisoned);
      const backward_io bio{dq_in.cview(), dk_in.cview(), dv_in.cview(), gate_view, o.cview(),
                            ddo.cview(),   dq.view(),     dk.view(),     dv.view(), gated ? dg.view() : tensor{}};
      const status sb = joint_backward(p, extra, opt, bio, ws.get(), bbytes, nullptr);
      INFO(sb.message());
      REQUIRE(sb.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      runs.push_back(check_gradients(dq, dk, dv, dq_ref, dk_ref, dv_ref));
      if (gated) {
        CHECK(dg.all_written());
        CHECK(dg.canaries_intact());
        CHECK(error_of(dg, dg_ref) < tolerance);
        const host_tensor dgh = dg.download();
        int64_t nonzero = 0;
        for (int64_t b = 0; b < dgh.batch; ++b)
          for (int64_t t = 0; t < dgh.tokens; ++t)
            if (a.is_extra(t))
              for (int64_t h = 0; h < dgh.heads; ++h)
                for (int64_t d = 0; d < dgh.dim; ++d) nonzero += dgh.get(b, t, h, d) != 0.0;
        CHECK(nonzero == 0);
      }
    }
    CHECK(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(double)) == 0);
  }
  // Raster output is not offered with extra tokens yet: refused, with its own code.
  const config c = configs()[0];
  const problem p = make_problem(c.grid, c.batch, c.q_heads, c.kv_heads, c.head_dim, c.type);
  options raster{};
  raster.output_order = token_order::raster;
  std::size_t bytes = 0;
  const host_tensor shape(c.type, c.batch, joint_axis(c.grid, {77, true}).tokens, p.q_heads, c.head_dim, c.order);
  device_tensor x(shape, poisoned), o(shape, poisoned);
  REQUIRE(joint_forward(p, {77, true}, raster, forward_io{}, nullptr, bytes, nullptr).is_ok());
  device_buffer ws(bytes);
  CHECK(joint_forward(p, {77, true}, raster, forward_io{x.cview(), x.cview(), x.cview(), {}, o.view()}, ws.get(), bytes,
                      nullptr)
            .code() == errc::unsupported);
}

// Bad arguments: each call returns its own code and leaves every output as it was (poisoned).
TEST_CASE("joint sparse attention rejects bad arguments untouched", "[gpu][joint][errors]") {
  const config c = configs()[0];
  const problem p = make_problem(c.grid, c.batch, c.q_heads, c.kv_heads, c.head_dim, c.type);
  VSA_TEST_RNG(g, "joint-errors");
  const extra_tokens extra{77, true};
  const joint_axis a(c.grid, extra);
  const int64_t n = tile_geometry(c.grid).num_tiles();
  const q2k_lists lists = random_lists(p, n / 3, g);
  const host_tensor q = joint_input(c, a, p.q_heads, g), k = joint_input(c, a, p.kv_heads, g),
                    v = joint_input(c, a, p.kv_heads, g);
  device_tensor dq_in(q); // also the output that overlaps q
  const device_tensor dk_in(k), dv_in(v);
  const device_buffer q2k(upload(lists.q2k)), count(upload(lists.count));
  const const_index_lists dl{q2k.as<int32_t>(), count.as<int32_t>(), lists.capacity, nullptr, nullptr};
  device_tensor o(q, poisoned), dq(q, poisoned), dk(k, poisoned), dv(v, poisoned);
  device_buffer lse(sizeof(float) * p.batch * p.q_heads * a.tokens);
  lse.poison();
  const std::size_t fbytes = joint_sparse_attention_forward_workspace(p, extra);
  std::size_t bbytes = 0;
  REQUIRE(joint_sparse_attention_backward(p, extra, 0.125f, {}, {}, {}, {}, {}, nullptr, dl, {}, {}, {}, nullptr,
                                          bbytes, nullptr)
              .is_ok());
  device_buffer fws(fbytes), bws(bbytes);
  const float scale = 0.125f;
  const auto forward = [&](extra_tokens e, const_tensor qv, tensor ov, void* ws, std::size_t bytes, float* l) {
    return joint_sparse_attention_forward(p, e, scale, qv, dk_in.cview(), dv_in.cview(), dl, ov, l, ws, bytes, nullptr)
        .code();
  };
  const auto backward = [&](extra_tokens e, tensor dqv, void* ws, std::size_t bytes) {
    std::size_t b = bytes;
    return joint_sparse_attention_backward(p, e, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), o.cview(),
                                           dq_in.cview(), lse.as<float>(), dl, dqv, dk.view(), dv.view(), ws, b,
                                           nullptr)
        .code();
  };
  // The video-only tensors (N·64 tokens) are not joint ones.
  const host_tensor video_only(c.type, c.batch, a.slots, p.q_heads, c.head_dim, c.order);
  const device_tensor short_q(video_only);
  CHECK(forward({-1, false}, dq_in.cview(), o.view(), fws.get(), fbytes, lse.as<float>()) == errc::bad_argument);
  CHECK(forward(extra, short_q.cview(), o.view(), fws.get(), fbytes, lse.as<float>()) == errc::bad_tokens);
  CHECK(forward(extra, dq_in.cview(), o.view(), fws.get(), fbytes - 1, lse.as<float>()) == errc::bad_workspace);
  CHECK(forward(extra, dq_in.cview(), o.view(), nullptr, fbytes, lse.as<float>()) == errc::bad_workspace);
  CHECK(forward(extra, dq_in.cview(), o.view(), fws.get(), fbytes, nullptr) == errc::null_pointer);
  CHECK(forward(extra, dq_in.cview(), o.view(), o.raw(), fbytes, lse.as<float>()) == errc::aliased); // workspace in o
  CHECK(forward(extra, dq_in.cview(), dq_in.view(), fws.get(), fbytes, lse.as<float>()) == errc::aliased); // o over q
  CHECK(backward({-1, false}, dq.view(), bws.get(), bbytes) == errc::bad_argument);
  // Any size from the least works (dq then recomputes dS); one byte under it does not.
  const std::size_t least = joint_sparse_attention_backward_least_workspace(p, extra, lists.capacity);
  CHECK(least <= bbytes);
  CHECK(backward(extra, dq.view(), bws.get(), least - 1) == errc::bad_workspace);
  CHECK(backward(extra, dq_in.view(), bws.get(), bbytes) == errc::aliased); // dq over q
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(o.poisoned_elements() == o.shape().elements());
  CHECK(dq.poisoned_elements() == dq.shape().elements());
  CHECK(dk.poisoned_elements() == dk.shape().elements());
  CHECK(dq_in.download_raw() == device_tensor(q).download_raw()); // q, which two calls were given as an output
  CHECK(count_poisoned_elements(lse.download_bytes(), 4) == p.batch * p.q_heads * a.tokens);
}

} // namespace
} // namespace test
} // namespace vsa
