// The whole op over a packed batch on the GPU (packed_op.hpp) against each sample's own forward() and backward() on the
// same slots: the selected lists equal (as tiles of the batch), o, dq, dk, dv and dgate bit for bit where the samples
// agree on the sparse kernels' kind, within rounding where they do not; the means, o_c and lse_c bit for bit; one
// sample's o against the CPU reference (the one-grid op's backward has its own).
// The packed configurations of test_packed.cpp (partial tiles on every axis, GQA, both layouts, dtypes and head dims,
// 70 samples) and samples past one coarse block (up to 1,152 tiles), with a gate and without (in turn), poisoned
// outputs and workspace, canaries; options and gradients the batch cannot take rejected with their message. And the
// op on caller-supplied lists against each sample's own op on the same lists.
#include "support/gpu.hpp"
#include "support/host.hpp"
#include "support/packed.hpp"

#include <vsa/gpu/packed_op.hpp>
#include <vsa/reference.hpp>

#include <algorithm>
#include <cstring>
#include <vector>

namespace vsa {
namespace test {
namespace {

// Sample s's rows of a packed lists' buffer, its entries as tiles of its own.
std::vector<int32_t> own_rows(const std::vector<int32_t>& q2k, const std::vector<int32_t>& count, int64_t capacity,
                              const packed_config& c, const batch_layout& b, std::size_t s) {
  std::vector<int32_t> r;
  for (int64_t h = 0; h < c.q_heads; ++h)
    for (int64_t i = 0; i < b.tiles[s]; ++i) {
      const int64_t row = h * b.total + b.first[s] + i;
      r.push_back(count[row]);
      for (int32_t e = 0; e < count[row]; ++e) r.push_back(q2k[row * capacity + e] - static_cast<int32_t>(b.first[s]));
    }
  return r;
}

// Bytes [at, at + n) of device memory.
std::vector<unsigned char> bytes_at(const void* base, std::size_t at, std::size_t n) {
  std::vector<unsigned char> r(n);
  VSA_REQUIRE_RT(copy_to_host(r.data(), static_cast<const unsigned char*>(base) + at, n));
  return r;
}

// Whether sample s's rows of a packed state array ([heads, N, row_bytes] at `packed`) equal its own call's ([heads,
// N_s, row_bytes] at `own`), bit for bit.
bool same_rows(const void* packed_state, std::size_t packed, const void* own_state, std::size_t own, int64_t heads,
               std::size_t row_bytes, const batch_layout& b, std::size_t s) {
  const std::size_t n = static_cast<std::size_t>(b.total), ns = static_cast<std::size_t>(b.tiles[s]);
  const std::vector<unsigned char> x = bytes_at(packed_state, packed, heads * n * row_bytes),
                                   y = bytes_at(own_state, own, heads * ns * row_bytes);
  for (int64_t h = 0; h < heads; ++h)
    if (std::memcmp(x.data() + (h * n + b.first[s]) * row_bytes, y.data() + h * ns * row_bytes, ns * row_bytes) != 0)
      return false;
  return true;
}

// One workspace for both passes of the packed op, poisoned: the backward's size, which holds the forward's.
device_buffer op_workspace(const packed_problem& pp, const options& opt, std::size_t& bytes) {
  std::size_t forward_bytes = 0;
  bytes = 0;
  REQUIRE(packed_backward(pp, opt, backward_io{}, nullptr, bytes, nullptr).is_ok());
  REQUIRE(packed_forward(pp, opt, forward_io{}, nullptr, forward_bytes, nullptr).is_ok());
  CHECK(bytes >= forward_bytes);
  device_buffer ws(bytes);
  ws.poison();
  return ws;
}

// The same of one sample's own lists.
std::vector<int32_t> rows_of(const std::vector<int32_t>& q2k, const std::vector<int32_t>& count, int64_t capacity,
                             int64_t rows) {
  std::vector<int32_t> r;
  for (int64_t row = 0; row < rows; ++row) {
    r.push_back(count[row]);
    for (int32_t e = 0; e < count[row]; ++e) r.push_back(q2k[row * capacity + e]);
  }
  return r;
}

// gated: with a gate (and its gradient), else g = 1.
void check_packed_op(const packed_config& c, bool gated) {
  INFO(describe(c) << (gated ? " gated" : " g = 1"));
  VSA_TEST_RNG(g, "packed op");
  const packed_problem pp = make_packed(c);
  const batch_layout b(c.grids);
  const host_tensor q = packed_input(c, b, c.q_heads, g), k = packed_input(c, b, c.kv_heads, g),
                    v = packed_input(c, b, c.kv_heads, g), gate = packed_input(c, b, c.q_heads, g),
                    d_o = packed_input(c, b, c.q_heads, g);
  const device_tensor dq_in(q), dk_in(k), dv_in(v), dgate(gate), dd_o(d_o);
  options opt;
  opt.sparsity = 0.75;

  device_tensor o(q, poisoned), o_own(q, poisoned);
  // The gradients, poisoned: the packed call's, and each sample's own in its slots of the second set.
  device_tensor dq(q, poisoned), dk(k, poisoned), dv(v, poisoned), dg(gate, poisoned), dq_own(q, poisoned),
      dk_own(k, poisoned), dv_own(v, poisoned), dg_own(gate, poisoned);
  std::size_t bytes = 0;
  const device_buffer ws = op_workspace(pp, opt, bytes);
  const const_tensor gate_in = gated ? dgate.cview() : const_tensor{};
  const tensor dg_out = gated ? dg.view() : tensor{};
  const forward_io io{dq_in.cview(), dk_in.cview(), dv_in.cview(), gate_in, o.view()};
  status st = packed_forward(pp, opt, io, ws.get(), bytes, nullptr);
  INFO(st.message());
  REQUIRE(st.is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(o.all_written());
  CHECK(o.canaries_intact());
  CHECK(ws.canaries_intact());
  const_index_lists lists;
  REQUIRE(packed_selected_lists(pp, opt, ws.get(), lists).is_ok());
  const int64_t rows = c.q_heads * b.total;
  std::vector<int32_t> q2k(static_cast<std::size_t>(rows * lists.q2k_capacity)), count(static_cast<std::size_t>(rows));
  VSA_REQUIRE_RT(copy_to_host(q2k.data(), lists.q2k, q2k.size() * sizeof(int32_t)));
  VSA_REQUIRE_RT(copy_to_host(count.data(), lists.q2k_count, count.size() * sizeof(int32_t)));
  const backward_io bio{dq_in.cview(), dk_in.cview(), dv_in.cview(), gate_in,   o.cview(),
                        dd_o.cview(),  dq.view(),     dk.view(),     dv.view(), dg_out};
  st = packed_backward(pp, opt, bio, ws.get(), bytes, nullptr);
  INFO(st.message());
  REQUIRE(st.is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  for (const device_tensor* x : {&dq, &dk, &dv, &dg}) {
    if (x == &dg && !gated) continue;
    CHECK(x->all_written());
    CHECK(x->canaries_intact());
  }
  CHECK(ws.canaries_intact());

  detail::packed_op_workspace pw;
  REQUIRE(detail::plan_packed_op(pp, opt, pw).is_ok());
  const std::size_t e = dtype_size(c.type), d = static_cast<std::size_t>(c.head_dim);
  std::vector<int32_t> q2k0, count0; // the first sample's own lists, for the reference
  int64_t capacity0 = 0;
  for (std::size_t s = 0; s < c.grids.size(); ++s) {
    INFO("sample " << s);
    const problem ps = make_problem(c.grids[s], 1, c.q_heads, c.kv_heads, c.head_dim, c.type);
    std::size_t own_bytes = 0;
    REQUIRE(backward(ps, opt, backward_io{}, nullptr, own_bytes, nullptr).is_ok());
    device_buffer own_ws(own_bytes);
    const const_tensor own_gate = gated ? sample_view(dgate.cview(), b, s, c.type) : const_tensor{};
    const forward_io own{sample_view(dq_in.cview(), b, s, c.type), sample_view(dk_in.cview(), b, s, c.type),
                         sample_view(dv_in.cview(), b, s, c.type), own_gate, sample_view(o_own.view(), b, s, c.type)};
    st = forward(ps, opt, own, own_ws.get(), own_bytes, nullptr);
    INFO(st.message());
    REQUIRE(st.is_ok());
    const auto in = [&](const device_tensor& x) { return sample_view(x.cview(), b, s, c.type); };
    const auto out = [&](device_tensor& x) { return sample_view(x.view(), b, s, c.type); };
    const backward_io own_b{in(dq_in), in(dk_in),   in(dv_in),   own_gate,    in(o_own),
                            in(dd_o),  out(dq_own), out(dk_own), out(dv_own), gated ? out(dg_own) : tensor{}};
    st = backward(ps, opt, own_b, own_ws.get(), own_bytes, nullptr);
    INFO(st.message());
    REQUIRE(st.is_ok());
    const_index_lists own_lists;
    REQUIRE(selected_lists(ps, opt, own_ws.get(), own_lists).is_ok());
    const int64_t own_rows_n = c.q_heads * b.tiles[s];
    std::vector<int32_t> own_q2k(static_cast<std::size_t>(own_rows_n * own_lists.q2k_capacity)),
        own_count(static_cast<std::size_t>(own_rows_n));
    VSA_REQUIRE_RT(copy_to_host(own_q2k.data(), own_lists.q2k, own_q2k.size() * sizeof(int32_t)));
    VSA_REQUIRE_RT(copy_to_host(own_count.data(), own_lists.q2k_count, own_count.size() * sizeof(int32_t)));
    // The selection is exact: the same tiles, whatever the kernels.
    CHECK(own_rows(q2k, count, lists.q2k_capacity, c, b, s) ==
          rows_of(own_q2k, own_count, own_lists.q2k_capacity, own_rows_n));
    if (s == 0) q2k0 = own_q2k, count0 = own_count, capacity0 = own_lists.q2k_capacity;
    // The coarse pass's state: the means, o_c and lse_c, bit for bit.
    detail::op_workspace ow;
    REQUIRE(detail::plan_op(ps, extra_tokens{}, opt, ow).is_ok());
    CHECK(same_rows(ws.get(), pw.q_c, own_ws.get(), ow.q_c, c.q_heads, d * e, b, s));
    CHECK(same_rows(ws.get(), pw.k_c, own_ws.get(), ow.k_c, c.kv_heads, d * e, b, s));
    CHECK(same_rows(ws.get(), pw.v_c, own_ws.get(), ow.v_c, c.kv_heads, d * e, b, s));
    CHECK(same_rows(ws.get(), pw.o_c, own_ws.get(), ow.o_c, c.q_heads, d * e, b, s));
    CHECK(same_rows(ws.get(), pw.lse_c, own_ws.get(), ow.lse_c, c.q_heads, sizeof(float), b, s));
  }
  VSA_REQUIRE_RT(gpu_sync());
  check_against_samples(c, b, "o", o, o_own);
  check_against_samples(c, b, "dq", dq, dq_own);
  check_against_samples(c, b, "dk", dk, dk_own);
  check_against_samples(c, b, "dv", dv, dv_own);
  if (gated) check_against_samples(c, b, "dgate", dg, dg_own);

  // The first sample against the CPU reference of the whole op, on the lists the GPU selected (near-tied coarse
  // scores may rank differently in the reference's double precision).
  const problem p0 = make_problem(c.grids[0], 1, c.q_heads, c.kv_heads, c.head_dim, c.type);
  const host_tensor q0 = sample_of(q, b, 0), k0 = sample_of(k, b, 0), v0 = sample_of(v, b, 0),
                    g0 = sample_of(gate, b, 0);
  host_tensor o_ref = q0;
  const const_index_lists lists0{q2k0.data(), count0.data(), capacity0, nullptr, nullptr};
  const forward_io rio{q0.view(), k0.view(), v0.view(), gated ? g0.view() : const_tensor{}, o_ref.view()};
  std::size_t ref_bytes = 0;
  REQUIRE(reference::forward_on_lists(p0, opt, rio, lists0, nullptr, ref_bytes).is_ok());
  aligned_buffer ref_ws(ref_bytes);
  st = reference::forward_on_lists(p0, opt, rio, lists0, ref_ws.data(), ref_bytes);
  INFO(st.message());
  REQUIRE(st.is_ok());
  CHECK(rel_error(sample_of(o.download(), b, 0), o_ref) < 1e-2);
}

// The packed op on caller-supplied lists (options::q2k: no coarse branch, o = o_s) against each sample's own op on
// the same lists as tiles of its own: o, dq, dk and dv bit for bit where the samples' kernels agree.
void check_packed_op_given_lists(const packed_config& c) {
  INFO(describe(c) << " caller lists");
  VSA_TEST_RNG(g, "packed op lists");
  const packed_problem pp = make_packed(c);
  const batch_layout b(c.grids);
  const host_tensor q = packed_input(c, b, c.q_heads, g), k = packed_input(c, b, c.kv_heads, g),
                    v = packed_input(c, b, c.kv_heads, g), d_o = packed_input(c, b, c.q_heads, g);
  const device_tensor dq_in(q), dk_in(k), dv_in(v), dd_o(d_o);
  // Each sample's rows hold up to min(4, N_s) entries (its own call's capacity); the batch's rows take 4.
  constexpr int64_t capacity = 4;
  std::vector<q2k_lists> own(c.grids.size());
  std::vector<int32_t> q2k(static_cast<std::size_t>(c.q_heads * b.total * capacity), -1),
      count(static_cast<std::size_t>(c.q_heads * b.total));
  for (std::size_t s = 0; s < c.grids.size(); ++s) {
    const int64_t own_capacity = std::min(capacity, b.tiles[s]);
    own[s] = random_lists(make_problem(c.grids[s], 1, c.q_heads, c.kv_heads, c.head_dim, c.type), own_capacity, g);
    for (int64_t h = 0; h < c.q_heads; ++h)
      for (int64_t i = 0; i < b.tiles[s]; ++i) {
        const int64_t row = h * b.total + b.first[s] + i, own_row = h * b.tiles[s] + i;
        count[row] = own[s].count[own_row];
        for (int32_t e = 0; e < count[row]; ++e)
          q2k[row * capacity + e] = own[s].q2k[own_row * own_capacity + e] + static_cast<int32_t>(b.first[s]);
      }
  }
  const device_buffer d_q2k = upload(q2k), d_count = upload(count);
  options opt;
  opt.q2k = const_index_lists{d_q2k.as<int32_t>(), d_count.as<int32_t>(), capacity, nullptr, nullptr};

  device_tensor o(q, poisoned), o_own(q, poisoned), dq(q, poisoned), dk(k, poisoned), dv(v, poisoned),
      dq_own(q, poisoned), dk_own(k, poisoned), dv_own(v, poisoned);
  std::size_t bytes = 0;
  const device_buffer ws = op_workspace(pp, opt, bytes);
  status st = packed_forward(pp, opt, forward_io{dq_in.cview(), dk_in.cview(), dv_in.cview(), {}, o.view()}, ws.get(),
                             bytes, nullptr);
  INFO(st.message());
  REQUIRE(st.is_ok());
  const backward_io bio{dq_in.cview(), dk_in.cview(), dv_in.cview(), {},        o.cview(),
                        dd_o.cview(),  dq.view(),     dk.view(),     dv.view(), {}};
  st = packed_backward(pp, opt, bio, ws.get(), bytes, nullptr);
  INFO(st.message());
  REQUIRE(st.is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  for (const device_tensor* x : {&o, &dq, &dk, &dv}) {
    CHECK(x->all_written());
    CHECK(x->canaries_intact());
  }
  CHECK(ws.canaries_intact());

  for (std::size_t s = 0; s < c.grids.size(); ++s) {
    INFO("sample " << s);
    const problem ps = make_problem(c.grids[s], 1, c.q_heads, c.kv_heads, c.head_dim, c.type);
    const device_buffer s_q2k = upload(own[s].q2k), s_count = upload(own[s].count);
    options own_opt;
    own_opt.q2k = const_index_lists{s_q2k.as<int32_t>(), s_count.as<int32_t>(), own[s].capacity, nullptr, nullptr};
    std::size_t own_bytes = 0;
    REQUIRE(backward(ps, own_opt, backward_io{}, nullptr, own_bytes, nullptr).is_ok());
    device_buffer own_ws(own_bytes);
    const auto in = [&](const device_tensor& x) { return sample_view(x.cview(), b, s, c.type); };
    const auto out = [&](device_tensor& x) { return sample_view(x.view(), b, s, c.type); };
    st = forward(ps, own_opt, forward_io{in(dq_in), in(dk_in), in(dv_in), {}, out(o_own)}, own_ws.get(), own_bytes,
                 nullptr);
    INFO(st.message());
    REQUIRE(st.is_ok());
    const backward_io own_b{in(dq_in), in(dk_in),   in(dv_in),   {},          in(o_own),
                            in(dd_o),  out(dq_own), out(dk_own), out(dv_own), {}};
    st = backward(ps, own_opt, own_b, own_ws.get(), own_bytes, nullptr);
    INFO(st.message());
    REQUIRE(st.is_ok());
    VSA_REQUIRE_RT(gpu_sync()); // the sample's lists and workspace are freed at the end of this iteration
  }
  check_against_samples(c, b, "o", o, o_own);
  check_against_samples(c, b, "dq", dq, dq_own);
  check_against_samples(c, b, "dk", dk, dk_own);
  check_against_samples(c, b, "dv", dv, dv_own);
}

// The sparse pass's configurations, and samples past one coarse block of 64 tiles: key blocks past the first and
// partial last blocks (216 and 125 tiles, every sample narrow), and a sample of 1,152 tiles, whose rows take the block
// top-k kernel, beside one of 3.
std::vector<packed_config> op_configs() {
  std::vector<packed_config> c = packed_configs();
  c.push_back({{{5, 6, 7}, {21, 22, 23}, {17, 18, 18}}, 2, 1, 64, dtype::bf16, layout::bshd, true});
  c.push_back({{{3, 4, 9}, {48, 48, 32}}, 2, 2, 128, dtype::fp16, layout::bhsd, false});
  return c;
}

TEST_CASE("a packed batch's whole op, forward and backward, is its samples' own", "[gpu][packed][op]") {
  const std::vector<packed_config> configs = op_configs();
  for (std::size_t i = 0; i < configs.size(); ++i) check_packed_op(configs[i], i % 2 == 0);
}

TEST_CASE("a packed batch's whole op on the caller's lists is its samples' own", "[gpu][packed][op]") {
  for (const packed_config& c : packed_configs()) check_packed_op_given_lists(c);
}

TEST_CASE("the packed op rejects what a packed batch cannot take", "[gpu][packed][op]") {
  const packed_config c = packed_configs()[0];
  const packed_problem pp = make_packed(c);
  std::size_t bytes = 0;
  options opt;
  opt.top_k = 1000; // past every sample's tiles
  status st = packed_forward(pp, opt, forward_io{}, nullptr, bytes, nullptr);
  CHECK(st.code() == errc::bad_top_k);
  CHECK(mentions(st, "grids[0]"));
  opt = options{};
  opt.output_order = token_order::raster;
  st = packed_forward(pp, opt, forward_io{}, nullptr, bytes, nullptr);
  CHECK(st.code() == errc::unsupported);
  CHECK(mentions(st, "output_order"));
  st = packed_backward(pp, opt, backward_io{}, nullptr, bytes, nullptr);
  CHECK(st.code() == errc::unsupported);
  CHECK(mentions(st, "output_order"));
  packed_problem none = pp;
  none.samples = 0;
  CHECK(packed_forward(none, options{}, forward_io{}, nullptr, bytes, nullptr).code() == errc::bad_batch);

  // A gate without its gradient, and a gradient without a gate: rejected before anything runs, the outputs untouched.
  VSA_TEST_RNG(g, "packed op rejects");
  const batch_layout b(c.grids);
  const host_tensor q = packed_input(c, b, c.q_heads, g), k = packed_input(c, b, c.kv_heads, g);
  const device_tensor dq_in(q), dk_in(k), gate(q);
  device_tensor o(q, poisoned), dq(q, poisoned), dk(k, poisoned), dv(k, poisoned), dg(q, poisoned);
  REQUIRE(packed_backward(pp, options{}, backward_io{}, nullptr, bytes, nullptr).is_ok());
  device_buffer ws(bytes);
  REQUIRE(packed_forward(pp, options{}, forward_io{dq_in.cview(), dk_in.cview(), dk_in.cview(), gate.cview(), o.view()},
                         ws.get(), bytes, nullptr)
              .is_ok());
  backward_io bio{dq_in.cview(), dk_in.cview(), dk_in.cview(), gate.cview(), o.cview(),
                  dq_in.cview(), dq.view(),     dk.view(),     dv.view(),    tensor{}};
  st = packed_backward(pp, options{}, bio, ws.get(), bytes, nullptr);
  CHECK(st.code() == errc::null_pointer);
  CHECK(mentions(st, "dgate"));
  bio.gate = const_tensor{};
  bio.dgate = dg.view();
  st = packed_backward(pp, options{}, bio, ws.get(), bytes, nullptr);
  CHECK(st.code() == errc::bad_argument);
  CHECK(mentions(st, "dgate"));
  VSA_REQUIRE_RT(gpu_sync());
  for (const device_tensor* x : {&dq, &dk, &dv, &dg}) CHECK(x->poisoned_elements() == x->shape().elements());
}

} // namespace
} // namespace test
} // namespace vsa
