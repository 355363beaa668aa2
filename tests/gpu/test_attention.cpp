// Sparse attention (stage 6), coarse attention (stage 3) and the whole op on the GPU against the CPU
// reference, forward and backward, on fresh random problems with partial tiles, GQA, both layouts, bf16
// and fp16, k = 1 and k = N; outputs poisoned before every call and checked fully written. The whole op
// is also checked bitwise reproducible across runs and across streams, concurrent ones included.
#include "support/gpu.hpp"
#include "support/host.hpp"

#include <vsa/gpu/layout.hpp>
#include <vsa/gpu/op.hpp>
#include <vsa/numeric.hpp>
#include <vsa/reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
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

// The configurations every test runs: partial tiles on every axis, GQA, both layouts, both dtypes. The first
// four have tiles of 32 valid tokens or fewer, so the sparse kernels take narrow steps over them (widths 16, 32
// and 64, with and without masked columns); the last has partial tiles of 48 only and runs the kernels of one
// width (with_step_width).
std::vector<config> configs() {
  return {
      {{5, 6, 7}, 2, 4, 2, 64, dtype::bf16, layout::bshd},   {{9, 10, 11}, 1, 2, 2, 128, dtype::bf16, layout::bhsd},
      {{7, 5, 9}, 1, 4, 1, 128, dtype::fp16, layout::bshd},  {{4, 8, 13}, 2, 2, 1, 64, dtype::fp16, layout::bhsd},
      {{8, 7, 12}, 1, 2, 1, 128, dtype::bf16, layout::bshd},
  };
}

problem to_problem(const config& c) { return make_problem(c.grid, c.batch, c.q_heads, c.kv_heads, c.head_dim, c.type); }

// Host lists: q2k rows with `count(row)` distinct ascending tiles, and the reference's k2q.
struct host_lists {
  int64_t capacity;
  std::vector<int32_t> q2k, count, k2q, offset;
  index_lists view() { return {q2k.data(), count.data(), capacity, k2q.data(), offset.data()}; }
};

template <class Count> host_lists random_lists(const problem& p, int64_t capacity, rng& g, Count count) {
  const int64_t n = tile_geometry(p.grid).num_tiles(), rows = p.batch * p.q_heads * n;
  host_lists l{capacity, std::vector<int32_t>(rows * capacity, -1), std::vector<int32_t>(rows),
               std::vector<int32_t>(rows * capacity, -1), std::vector<int32_t>(p.batch * p.q_heads * (n + 1))};
  std::vector<int32_t> perm(n);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = count(r);
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t t = 0; t < c; ++t) std::swap(perm[t], perm[t + g.integer(0, n - 1 - t)]);
    std::sort(perm.begin(), perm.begin() + c);
    std::copy(perm.begin(), perm.begin() + c, l.q2k.begin() + r * capacity);
    l.count[r] = static_cast<int32_t>(c);
  }
  REQUIRE(reference::build_k2q(p, l.view()).is_ok());
  return l;
}

struct device_lists {
  device_buffer q2k, count, k2q, offset;
  int64_t capacity;
  explicit device_lists(const host_lists& h)
      : q2k(upload(h.q2k)), count(upload(h.count)), k2q(upload(h.k2q)), offset(upload(h.offset)), capacity(h.capacity) {
  }
  const_index_lists view() const {
    return {q2k.as<int32_t>(), count.as<int32_t>(), capacity, k2q.as<int32_t>(), offset.as<int32_t>()};
  }
};

// A tiled tensor of random values in valid slots, zeros in padding (as tile() leaves them).
host_tensor tiled_input(const config& c, int64_t heads, rng& g) {
  host_tensor x(c.type, c.batch, tile_geometry(c.grid).tiled_tokens(), heads, c.head_dim, c.order);
  fill_tiled_normal(x, c.grid, g);
  return x;
}

// The same tensor with NaN in every padding slot, as a caller's buffer may hold there: no output may depend on
// them (a zero probability times NaN is NaN, so the kernels must not multiply them in).
host_tensor with_nan_padding(const host_tensor& x, grid3 grid) {
  host_tensor y = x;
  const tile_geometry geo(grid);
  for (int64_t b = 0; b < y.batch; ++b)
    for (int64_t s = 0; s < y.tokens; ++s)
      if (s % tile_tokens >= geo.valid(s / tile_tokens))
        for (int64_t h = 0; h < y.heads; ++h)
          for (int64_t d = 0; d < y.dim; ++d) y.set(b, s, h, d, std::numeric_limits<double>::quiet_NaN());
  return y;
}

// Relative error of a GPU output against the reference, both read through their views.
double error_of(const device_tensor& gpu, const host_tensor& ref) { return rel_error(gpu.download(), ref); }

// The tolerance of a 16-bit output: rounding of the inputs and of the output itself.
constexpr double tolerance = 1e-2;

// nan_padding: the GPU's k and v hold NaN in their padding slots (the reference's hold zeros).
void check_sparse(const config& c, int64_t capacity, const char* label, bool ragged, bool nan_padding = false) {
  const problem p = to_problem(c);
  VSA_TEST_RNG(g, label);
  INFO(describe(c) << " capacity " << capacity << (ragged ? " ragged" : "") << (nan_padding ? " NaN padding" : ""));
  const int64_t n = tile_geometry(p.grid).num_tiles();
  const int64_t tokens = tile_geometry(p.grid).tiled_tokens();
  host_lists lists = random_lists(p, capacity, g, [&](int64_t) { return ragged ? g.integer(0, capacity) : capacity; });
  const host_tensor q = tiled_input(c, p.q_heads, g), k = tiled_input(c, p.kv_heads, g),
                    v = tiled_input(c, p.kv_heads, g), d_o = tiled_input(c, p.q_heads, g);
  const float scale = 1.f / std::sqrt(float(c.head_dim));

  // Reference, in double internally, rounded to the dtype at its outputs.
  host_tensor o_ref(c.type, c.batch, tokens, p.q_heads, c.head_dim, c.order);
  std::vector<float> lse_ref(p.batch * p.q_heads * tokens);
  REQUIRE(reference::sparse_attention_forward(p, scale, q.view(), k.view(), v.view(), as_const(lists.view()),
                                              o_ref.view(), lse_ref.data())
              .is_ok());

  const device_tensor dq_in(q), dk_in(nan_padding ? with_nan_padding(k, c.grid) : k),
      dv_in(nan_padding ? with_nan_padding(v, c.grid) : v), ddo(d_o);
  device_tensor o(o_ref, poisoned);
  device_buffer lse(lse_ref.size() * sizeof(float));
  lse.poison();
  const device_lists dl(lists);
  const status st = sparse_attention_forward(p, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), dl.view(), o.view(),
                                             lse.as<float>(), nullptr);
  INFO(st.message());
  REQUIRE(st.is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(o.all_written());
  CHECK(o.canaries_intact());
  const double err = error_of(o, o_ref);
  CHECK(err < tolerance);
  const std::vector<float> lse_gpu = lse.download<float>();
  int64_t lse_bad = 0;
  for (std::size_t r = 0; r < lse_ref.size(); ++r) lse_bad += lse_close(lse_gpu[r], lse_ref[r]) ? 0 : 1;
  CHECK(lse_bad == 0);

  // Backward: reference, then the GPU twice (bitwise reproducible).
  host_tensor dq_ref(c.type, c.batch, tokens, p.q_heads, c.head_dim, c.order),
      dk_ref(c.type, c.batch, tokens, p.kv_heads, c.head_dim, c.order),
      dv_ref(c.type, c.batch, tokens, p.kv_heads, c.head_dim, c.order);
  REQUIRE(reference::sparse_attention_backward(p, scale, q.view(), k.view(), v.view(), o_ref.view(), d_o.view(),
                                               lse_ref.data(), as_const(lists.view()), dq_ref.view(), dk_ref.view(),
                                               dv_ref.view())
              .is_ok());
  // The workspace the size query asks (dq from the dS that dk/dv stores, every head at once where the platform
  // stores it), twice; then one kv head's slots at a time, and the least workspace, where dq recomputes dS.
  std::size_t bytes = 0;
  REQUIRE(
      sparse_attention_backward(p, scale, {}, {}, {}, {}, {}, nullptr, dl.view(), {}, {}, {}, nullptr, bytes, nullptr)
          .is_ok());
  const vsa::detail::sparse_backward_scratch least(p), full(p, capacity, bytes, false);
  CHECK(full.bytes() == bytes);
  CHECK((full.units == p.batch * p.kv_heads) == gpu::detail::stores_ds_for(p.type, p.head_dim, false));
  const std::size_t one_head = full.units > 0 ? least.bytes() + full.map + full.slots / full.units : least.bytes();
  CHECK(vsa::detail::sparse_backward_scratch(p, capacity, one_head, false).units == (full.units > 0 ? 1 : 0));
  std::size_t dq_elems = 0;
  const std::size_t sizes[] = {bytes, bytes, one_head, least.bytes()};
  device_buffer ws(bytes);
  std::vector<std::vector<double>> runs;
  for (std::size_t size : sizes) {
    INFO("workspace " << size << " of " << bytes);
    device_tensor dq(dq_ref, poisoned), dk(dk_ref, poisoned), dv(dv_ref, poisoned);
    const status sb =
        sparse_attention_backward(p, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), o.cview(), ddo.cview(),
                                  lse.as<float>(), dl.view(), dq.view(), dk.view(), dv.view(), ws.get(), size, nullptr);
    INFO(sb.message());
    REQUIRE(sb.is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(dq.all_written());
    CHECK(dk.all_written());
    CHECK(dv.all_written());
    CHECK(dq.canaries_intact());
    CHECK(dk.canaries_intact());
    CHECK(dv.canaries_intact());
    // The reference backward uses the reference o_s; the GPU its own: both within rounding of each other.
    CHECK(error_of(dq, dq_ref) < tolerance);
    CHECK(error_of(dk, dk_ref) < tolerance);
    CHECK(error_of(dv, dv_ref) < tolerance);
    std::vector<double> all = dq.download_raw(), kk = dk.download_raw(), vv = dv.download_raw();
    dq_elems = all.size();
    all.insert(all.end(), kk.begin(), kk.end());
    all.insert(all.end(), vv.begin(), vv.end());
    runs.push_back(all);
  }
  const auto same = [&](int a, int b, std::size_t from, std::size_t to) {
    return std::memcmp(runs[a].data() + from, runs[b].data() + from, (to - from) * sizeof(double)) == 0;
  };
  const std::size_t total = runs[0].size();
  CHECK(same(0, 1, 0, total));        // bitwise reproducible
  CHECK(same(0, 2, 0, total));        // the groups of heads change no result
  CHECK(same(0, 3, dq_elems, total)); // dk and dv do not depend on dq's form
  (void)n;
}

TEST_CASE("sparse attention matches the reference", "[gpu][attention]") {
  for (const config& c : configs()) {
    const int64_t n = tile_geometry(c.grid).num_tiles();
    check_sparse(c, std::max<int64_t>(1, n / 3), "sparse-k", false);
    check_sparse(c, 1, "sparse-k1", false);
    check_sparse(c, n, "sparse-kN", false); // k = N: dense attention
    check_sparse(c, n, "sparse-ragged", true);
    check_sparse(c, std::max<int64_t>(1, n / 3), "sparse-nan-padding", false, true);
  }
}

TEST_CASE("sparse attention with k = N is dense attention", "[gpu][attention]") {
  // Independent of the lists machinery: a dense softmax over all valid tokens, computed here.
  const config c{{6, 5, 7}, 1, 2, 1, 64, dtype::bf16, layout::bshd};
  const problem p = to_problem(c);
  VSA_TEST_RNG(g, "dense");
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), tokens = geo.tiled_tokens();
  host_lists lists = random_lists(p, n, g, [&](int64_t) { return n; });
  const host_tensor q = tiled_input(c, 2, g), k = tiled_input(c, 1, g), v = tiled_input(c, 1, g);
  host_tensor ref(c.type, 1, tokens, 2, 64, c.order);
  const double scale = 1.0 / 8.0;
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t s = 0; s < tokens; ++s) {
      if (s % 64 >= geo.valid(s / 64)) continue;
      std::vector<double> w;
      double mx = -1e300;
      for (int64_t t = 0; t < tokens; ++t) {
        double x = -1e300;
        if (t % 64 < geo.valid(t / 64)) {
          x = 0;
          for (int64_t d = 0; d < 64; ++d) x += q.get(0, s, h, d) * k.get(0, t, 0, d);
          x *= scale;
        }
        w.push_back(x);
        mx = std::max(mx, x);
      }
      double z = 0;
      for (double& x : w) z += (x = x > -1e299 ? std::exp(x - mx) : 0.0);
      for (int64_t d = 0; d < 64; ++d) {
        double acc = 0;
        for (int64_t t = 0; t < tokens; ++t) acc += w[t] * v.get(0, t, 0, d);
        ref.set(0, s, h, d, acc / z);
      }
    }
  const device_tensor dq(q), dk(k), dv(v);
  device_tensor o(ref, poisoned);
  device_buffer lse(sizeof(float) * 2 * tokens);
  const device_lists dl(lists);
  REQUIRE(sparse_attention_forward(p, float(scale), dq.cview(), dk.cview(), dv.cview(), dl.view(), o.view(),
                                   lse.as<float>(), nullptr)
              .is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(o.all_written());
  CHECK(error_of(o, ref) < tolerance);
}

TEST_CASE("coarse scores and coarse attention match the reference", "[gpu][coarse]") {
  for (const config& c : configs()) {
    const problem p = to_problem(c);
    VSA_TEST_RNG(g, "coarse");
    INFO(describe(c));
    const int64_t n = tile_geometry(p.grid).num_tiles();
    const int64_t eq = p.batch * p.q_heads * n * p.head_dim, ek = p.batch * p.kv_heads * n * p.head_dim;
    // Means as the GPU would produce them, contiguous [B, H, N, D]: q and k in fp32 for the scores and the same
    // values in the dtype for the products of the backward, at the size of the means of few large tokens
    // (scores in the hundreds), where one bf16 product of them would miss by whole units.
    host_tensor q32(dtype::f32, p.batch, n, p.q_heads, p.head_dim, layout::bhsd),
        k32(dtype::f32, p.batch, n, p.kv_heads, p.head_dim, layout::bhsd),
        v_c(c.type, p.batch, n, p.kv_heads, p.head_dim, layout::bhsd),
        d_o_c(c.type, p.batch, n, p.q_heads, p.head_dim, layout::bhsd);
    q32.fill_normal(g, 8.0);
    k32.fill_normal(g, 8.0);
    v_c.fill_normal(g);
    d_o_c.fill_normal(g);
    const host_tensor q_c = q32.converted(c.type, layout::bhsd), k_c = k32.converted(c.type, layout::bhsd);
    const float scale = 1.f / std::sqrt(float(c.head_dim));
    host_tensor o_ref(c.type, p.batch, n, p.q_heads, p.head_dim, layout::bhsd);
    std::vector<float> scores_ref(p.batch * p.q_heads * n * n), lse_ref(p.batch * p.q_heads * n);
    const auto f32 = [](const host_tensor& x) { return static_cast<const float*>(x.data()); };
    REQUIRE(reference::coarse_scores(p, scale, f32(q32), f32(k32), scores_ref.data()).is_ok());
    const device_tensor dq32(q32), dk32(k32), dqc(q_c), dkc(k_c), dvc(v_c), ddoc(d_o_c);
    device_buffer scores(scores_ref.size() * 4), lse(lse_ref.size() * 4);
    scores.poison();
    lse.poison();
    REQUIRE(coarse_scores(p, scale, static_cast<const float*>(dq32.raw()), static_cast<const float*>(dk32.raw()),
                          scores.as<float>(), nullptr)
                .is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(scores.canaries_intact());
    const auto s_gpu = scores.download<float>();
    const auto as_double = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
    CHECK(count_poisoned_elements(scores.download_bytes(), 4) == 0);
    CHECK(rel_error(as_double(s_gpu), as_double(scores_ref)) < 3e-5);

    // The attention over the GPU's scores, on both sides, with o_c's rounding residual (poisoned with -128, a
    // code the encoding never gives).
    std::vector<int8_t> res_ref(eq);
    REQUIRE(
        reference::coarse_attention(p, s_gpu.data(), v_c.data(), o_ref.data(), res_ref.data(), lse_ref.data()).is_ok());
    device_tensor o(o_ref, poisoned);
    device_buffer res(eq);
    res.fill(0x80);
    REQUIRE(coarse_attention(p, scores.as<float>(), dvc.raw(), o.raw(), res.as<int8_t>(), lse.as<float>(), nullptr)
                .is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(o.all_written());
    CHECK(o.canaries_intact());
    CHECK(res.canaries_intact());
    const std::vector<int8_t> res_gpu = res.download<int8_t>();
    CHECK(std::count(res_gpu.begin(), res_gpu.end(), int8_t(-128)) == 0);
    CHECK(error_of(o, o_ref) < tolerance);
    const auto l_gpu = lse.download<float>();
    CHECK(rel_error(as_double(l_gpu), as_double(lse_ref)) < 1e-5);

    std::vector<float> dq_ref(eq), dk_ref(ek), dv_ref(ek);
    REQUIRE(reference::coarse_attention_backward(p, scale, q_c.data(), k_c.data(), v_c.data(), s_gpu.data(),
                                                 o_ref.data(), res_ref.data(), d_o_c.data(), lse_ref.data(),
                                                 dq_ref.data(), dk_ref.data(), dv_ref.data())
                .is_ok());
    std::size_t bytes = 0;
    REQUIRE(coarse_attention_backward(p, scale, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      nullptr, nullptr, nullptr, nullptr, bytes, nullptr)
                .is_ok());
    device_buffer ws(bytes), dq(eq * 4), dk(ek * 4), dv(ek * 4);
    dq.poison();
    dk.poison();
    dv.poison();
    REQUIRE(coarse_attention_backward(p, scale, dqc.raw(), dkc.raw(), dvc.raw(), scores.as<float>(), o.raw(),
                                      res.as<int8_t>(), ddoc.raw(), lse.as<float>(), dq.as<float>(), dk.as<float>(),
                                      dv.as<float>(), ws.get(), bytes, nullptr)
                .is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(rel_error(as_double(dq.download<float>()), as_double(dq_ref)) < tolerance);
    CHECK(rel_error(as_double(dk.download<float>()), as_double(dk_ref)) < tolerance);
    CHECK(rel_error(as_double(dv.download<float>()), as_double(dv_ref)) < tolerance);
  }
}

// The op's forward, then its backward, on one poisoned workspace of the size the backward asks (which holds the
// forward's too: the backward reads the state the forward left in it); every call's status and the device checked.
void forward_then_backward(const problem& p, const options& opt, const forward_io& fio, const backward_io& bio) {
  std::size_t fbytes = 0, bbytes = 0;
  REQUIRE(forward(p, opt, fio, nullptr, fbytes, nullptr).is_ok());
  REQUIRE(backward(p, opt, bio, nullptr, bbytes, nullptr).is_ok());
  CHECK(bbytes >= fbytes);
  device_buffer ws(bbytes);
  ws.poison();
  std::size_t bytes = bbytes;
  const status sf = forward(p, opt, fio, ws.get(), bytes, nullptr);
  INFO(sf.message());
  REQUIRE(sf.is_ok());
  const status sb = backward(p, opt, bio, ws.get(), bytes, nullptr);
  INFO(sb.message());
  REQUIRE(sb.is_ok());
  VSA_REQUIRE_RT(gpu_sync());
}

// Adds the block-mean backward of a coarse gradient [B, H, N, D] (fp32) to a tiled gradient.
void fold_means(const problem& p, const std::vector<float>& d_c, int64_t heads, host_tensor& grad) {
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles();
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t s = 0; s < geo.valid(t); ++s)
          for (int64_t d = 0; d < p.head_dim; ++d)
            grad.set(b, t * 64 + s, h, d,
                     grad.get(b, t * 64 + s, h, d) + d_c[((b * heads + h) * n + t) * p.head_dim + d] / geo.valid(t));
}

TEST_CASE("the whole op matches the reference stages", "[gpu][op]") {
  for (const config& c : configs()) {
    for (const bool gated : {true, false}) {
      const problem p = to_problem(c);
      VSA_TEST_RNG(g, "op");
      INFO(describe(c) << (gated ? " gated" : " ungated"));
      const tile_geometry geo(p.grid);
      const int64_t n = geo.num_tiles(), tokens = geo.tiled_tokens();
      options opt{};
      opt.sparsity = 0.6;
      const host_tensor q = tiled_input(c, p.q_heads, g), k = tiled_input(c, p.kv_heads, g),
                        v = tiled_input(c, p.kv_heads, g), d_o = tiled_input(c, p.q_heads, g),
                        gate = tiled_input(c, p.q_heads, g);
      const device_tensor dq_in(q), dk_in(k), dv_in(v), ddo(d_o), dgate_in(gate);
      host_tensor shape_q(c.type, c.batch, tokens, p.q_heads, c.head_dim, c.order),
          shape_kv(c.type, c.batch, tokens, p.kv_heads, c.head_dim, c.order);
      device_tensor o(shape_q, poisoned);
      const const_tensor gate_view = gated ? dgate_in.cview() : const_tensor{};
      const forward_io fio{dq_in.cview(), dk_in.cview(), dv_in.cview(), gate_view, o.view()};
      std::size_t fbytes = 0, bbytes = 0;
      REQUIRE(forward(p, opt, fio, nullptr, fbytes, nullptr).is_ok());
      device_buffer ws(fbytes);
      ws.poison();
      const status sf = forward(p, opt, fio, ws.get(), fbytes, nullptr);
      INFO(sf.message());
      REQUIRE(sf.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(o.all_written());
      CHECK(o.canaries_intact());

      // The reference pipeline, stage by stage, with the GPU's selection: the selection itself is checked
      // against the reference top-k of the GPU's own scores, exactly.
      detail::op_workspace w;
      REQUIRE(detail::plan_op(p, opt, w).is_ok());
      const int64_t k_sel = w.top_k;
      // The one-workspace form: the scratch, where the scores are, follows the state.
      const std::vector<float> scores = ws.download<float>(w.state_bytes + w.scores, p.batch * p.q_heads * n * n);
      host_lists sel{k_sel, ws.download<int32_t>(w.q2k, p.batch * p.q_heads * n * k_sel),
                     ws.download<int32_t>(w.q2k_count, p.batch * p.q_heads * n),
                     ws.download<int32_t>(w.k2q, p.batch * p.q_heads * n * k_sel),
                     ws.download<int32_t>(w.k2q_offset, p.batch * p.q_heads * (n + 1))};
      host_lists expect{k_sel, std::vector<int32_t>(sel.q2k.size()), std::vector<int32_t>(sel.count.size()),
                        std::vector<int32_t>(sel.k2q.size()), std::vector<int32_t>(sel.offset.size())};
      REQUIRE(reference::select_top_k(p, k_sel, scores.data(), expect.view()).is_ok());
      REQUIRE(reference::build_k2q(p, expect.view()).is_ok());
      CHECK(sel.q2k == expect.q2k);
      CHECK(sel.count == expect.count);
      CHECK(sel.offset == expect.offset);
      for (int64_t hh = 0; hh < p.batch * p.q_heads; ++hh) {
        const int64_t total = expect.offset[hh * (n + 1) + n], base = hh * n * k_sel;
        CHECK(std::equal(sel.k2q.begin() + base, sel.k2q.begin() + base + total, expect.k2q.begin() + base));
      }

      const float scale = 1.f / std::sqrt(float(c.head_dim));
      const int64_t eq = p.batch * p.q_heads * n * p.head_dim, ek = p.batch * p.kv_heads * n * p.head_dim;
      const std::size_t es = dtype_size(c.type);
      std::vector<unsigned char> q_c(eq * es), k_c(ek * es), v_c(ek * es), o_c(eq * es);
      std::vector<float> q_c32(eq), k_c32(ek), scores_ref(p.batch * p.q_heads * n * n), lse_c(p.batch * p.q_heads * n),
          lse(p.batch * p.q_heads * tokens);
      REQUIRE(reference::block_means(p, q.view(), k.view(), v.view(), q_c.data(), k_c.data(), v_c.data(), q_c32.data(),
                                     k_c32.data())
                  .is_ok());
      REQUIRE(reference::coarse_scores(p, scale, q_c32.data(), k_c32.data(), scores_ref.data()).is_ok());
      CHECK(rel_error(std::vector<double>(scores.begin(), scores.end()),
                      std::vector<double>(scores_ref.begin(), scores_ref.end())) < 3e-5);
      // The rest on the GPU's scores, so that the selection above and the coarse branch below see the same.
      REQUIRE(reference::coarse_attention(p, scores.data(), v_c.data(), o_c.data(), nullptr, lse_c.data()).is_ok());
      host_tensor o_s(c.type, c.batch, tokens, p.q_heads, c.head_dim, c.order),
          o_ref(c.type, c.batch, tokens, p.q_heads, c.head_dim, c.order);
      REQUIRE(reference::sparse_attention_forward(p, scale, q.view(), k.view(), v.view(), as_const(sel.view()),
                                                  o_s.view(), lse.data())
                  .is_ok());
      REQUIRE(
          reference::combine(p, o_s.view(), gated ? gate.cview() : const_tensor{}, o_c.data(), o_ref.view()).is_ok());
      CHECK(error_of(o, o_ref) < tolerance);

      // Backward, twice: bitwise the same.
      host_tensor dq_ref(c.type, c.batch, tokens, p.q_heads, c.head_dim, c.order),
          dk_ref(c.type, c.batch, tokens, p.kv_heads, c.head_dim, c.order),
          dv_ref(c.type, c.batch, tokens, p.kv_heads, c.head_dim, c.order),
          dg_ref(c.type, c.batch, tokens, p.q_heads, c.head_dim, c.order);
      std::vector<unsigned char> d_o_c(eq * es);
      std::vector<float> dq_c(eq), dk_c(ek), dv_c(ek);
      REQUIRE(reference::combine_backward(p, d_o.view(), gated ? gate.cview() : const_tensor{}, o_c.data(),
                                          gated ? dg_ref.view() : tensor{}, d_o_c.data())
                  .is_ok());
      REQUIRE(reference::coarse_attention_backward(p, scale, q_c.data(), k_c.data(), v_c.data(), scores.data(),
                                                   o_c.data(), nullptr, d_o_c.data(), lse_c.data(), dq_c.data(),
                                                   dk_c.data(), dv_c.data())
                  .is_ok());
      REQUIRE(reference::sparse_attention_backward(p, scale, q.view(), k.view(), v.view(), o_s.view(), d_o.view(),
                                                   lse.data(), as_const(sel.view()), dq_ref.view(), dk_ref.view(),
                                                   dv_ref.view())
                  .is_ok());
      // Fold the coarse gradients in double on top of the (rounded) fine ones.
      host_tensor dq_sum = dq_ref.converted(dtype::f64, c.order), dk_sum = dk_ref.converted(dtype::f64, c.order),
                  dv_sum = dv_ref.converted(dtype::f64, c.order);
      fold_means(p, dq_c, p.q_heads, dq_sum);
      fold_means(p, dk_c, p.kv_heads, dk_sum);
      fold_means(p, dv_c, p.kv_heads, dv_sum);

      const backward_io shape_io{};
      (void)shape_io;
      REQUIRE(backward(p, opt, backward_io{}, nullptr, bbytes, nullptr).is_ok());
      REQUIRE(bbytes >= fbytes);
      device_buffer wsb(bbytes);
      VSA_REQUIRE_RT(copy_device_to_device(wsb.get(), ws.get(), fbytes));
      std::vector<std::vector<double>> runs;
      for (int run = 0; run < 2; ++run) {
        device_tensor dq(shape_q, poisoned), dk(shape_kv, poisoned), dv(shape_kv, poisoned), dg(shape_q, poisoned);
        const backward_io bio{dq_in.cview(), dk_in.cview(), dv_in.cview(), gate_view, o.cview(),
                              ddo.cview(),   dq.view(),     dk.view(),     dv.view(), gated ? dg.view() : tensor{}};
        const status sb = backward(p, opt, bio, wsb.get(), bbytes, nullptr);
        INFO(sb.message());
        REQUIRE(sb.is_ok());
        VSA_REQUIRE_RT(gpu_sync());
        CHECK(dq.all_written());
        CHECK(dk.all_written());
        CHECK(dv.all_written());
        CHECK(dq.canaries_intact());
        CHECK(error_of(dq, dq_sum) < tolerance);
        CHECK(error_of(dk, dk_sum) < tolerance);
        CHECK(error_of(dv, dv_sum) < tolerance);
        if (gated) {
          CHECK(dg.all_written());
          CHECK(error_of(dg, dg_ref) < tolerance);
        }
        std::vector<double> all = dq.download_raw(), kk = dk.download_raw(), vv = dv.download_raw();
        all.insert(all.end(), kk.begin(), kk.end());
        all.insert(all.end(), vv.begin(), vv.end());
        runs.push_back(all);
      }
      CHECK(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(double)) == 0);
    }
  }
}

TEST_CASE("the whole op with k = N and k = 1", "[gpu][op]") {
  const config c{{5, 9, 6}, 1, 2, 2, 128, dtype::bf16, layout::bshd};
  const problem p = to_problem(c);
  const int64_t n = tile_geometry(p.grid).num_tiles(), tokens = tile_geometry(p.grid).tiled_tokens();
  for (const int64_t k : {int64_t(1), n}) {
    VSA_TEST_RNG(g, "op-k");
    INFO("k = " << k);
    options opt{};
    opt.top_k = k;
    const host_tensor q = tiled_input(c, 2, g), kk = tiled_input(c, 2, g), v = tiled_input(c, 2, g);
    const device_tensor dq(q), dk(kk), dv(v);
    device_tensor o(q, poisoned);
    const forward_io fio{dq.cview(), dk.cview(), dv.cview(), const_tensor{}, o.view()};
    std::size_t bytes = 0;
    REQUIRE(forward(p, opt, fio, nullptr, bytes, nullptr).is_ok());
    device_buffer ws(bytes);
    REQUIRE(forward(p, opt, fio, ws.get(), bytes, nullptr).is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(o.all_written());
    // Against the reference op (whose selection agrees for k = N trivially, and for k = 1 on the clear
    // winner of random data; a tie within rounding would show up as a large error here).
    host_tensor o_ref(c.type, 1, tokens, 2, 128, c.order);
    std::size_t rbytes = 0;
    const forward_io rio{q.view(), kk.view(), v.view(), const_tensor{}, o_ref.view()};
    REQUIRE(reference::forward(p, opt, rio, nullptr, rbytes).is_ok());
    aligned_buffer rws(rbytes);
    REQUIRE(reference::forward(p, opt, rio, rws.data(), rbytes).is_ok());
    CHECK(error_of(o, o_ref) < tolerance);
  }
}

// How far apart two 16-bit float tensors of one shape are: the elements that differ, and the largest distance in
// units in the last place (the bit patterns as ordered integers, so that -0 and +0 are one value).
struct ulp_gap {
  int64_t differ = 0, max_ulps = 0;
};
ulp_gap ulp_gap_of(const host_tensor& a, const host_tensor& b) {
  REQUIRE(a.bytes.size() == b.bytes.size());
  const auto ordered = [](const std::vector<unsigned char>& x, std::size_t e) {
    const int v = x[2 * e] | (x[2 * e + 1] << 8);
    return (v & 0x8000) != 0 ? -(v & 0x7fff) : v;
  };
  ulp_gap g;
  for (std::size_t e = 0; e < a.bytes.size() / 2; ++e) {
    const int64_t d = std::abs(ordered(a.bytes, e) - ordered(b.bytes, e));
    g.differ += d != 0 ? 1 : 0;
    g.max_ulps = std::max(g.max_ulps, d);
  }
  return g;
}

// The whole op with options::output_order raster: o written in raster order and read so by the backward, every
// gradient stored at its token. Against the same op in tiled order with its outputs untiled afterwards (the GPU's
// untile), over grids with partial tiles on every axis, GQA, both layouts, both head dims and types: o, dk, dv and
// dgate bit for bit; dq within rounding. dq's raster kernel is an instantiation of its own (RasterOut, with_out_rows
// says why), and the compiler fuses its epilogue's products and sums into FMAs differently: on the H200 1-7 elements
// of 107,520-253,440 came out one unit in the last place apart, nothing more.
TEST_CASE("the whole op in raster output order is the tiled op untiled", "[gpu][op]") {
  for (const config& c : configs()) {
    for (const bool gated : {true, false}) {
      const problem p = to_problem(c);
      VSA_TEST_RNG(g, "op-raster");
      INFO(describe(c) << (gated ? " gated" : " ungated"));
      const tile_geometry geo(p.grid);
      const int64_t slots = geo.tiled_tokens(), tokens = geo.raster_tokens();
      const host_tensor q = tiled_input(c, p.q_heads, g), k = tiled_input(c, p.kv_heads, g),
                        v = tiled_input(c, p.kv_heads, g), d_o = tiled_input(c, p.q_heads, g),
                        gate = tiled_input(c, p.q_heads, g);
      const device_tensor q_in(q), k_in(k), v_in(v), do_in(d_o), gate_in(gate);
      const const_tensor gate_view = gated ? gate_in.cview() : const_tensor{};
      const auto shape = [&](int64_t s, int64_t heads) {
        return host_tensor(c.type, c.batch, s, heads, c.head_dim, c.order);
      };
      const host_tensor tiled_q = shape(slots, p.q_heads), tiled_kv = shape(slots, p.kv_heads),
                        raster_q = shape(tokens, p.q_heads), raster_kv = shape(tokens, p.kv_heads);
      device_tensor o_t(tiled_q, poisoned), dq_t(tiled_q, poisoned), dk_t(tiled_kv, poisoned), dv_t(tiled_kv, poisoned),
          dg_t(tiled_q, poisoned);
      device_tensor o_r(raster_q, poisoned), dq_r(raster_q, poisoned), dk_r(raster_kv, poisoned),
          dv_r(raster_kv, poisoned), dg_r(raster_q, poisoned);
      const auto run = [&](token_order order, device_tensor& o, device_tensor& dq, device_tensor& dk, device_tensor& dv,
                           device_tensor& dg) {
        options opt{};
        opt.sparsity = 0.6;
        opt.output_order = order;
        const forward_io fio{q_in.cview(), k_in.cview(), v_in.cview(), gate_view, o.view()};
        const backward_io bio{q_in.cview(),  k_in.cview(), v_in.cview(), gate_view, o.cview(),
                              do_in.cview(), dq.view(),    dk.view(),    dv.view(), gated ? dg.view() : tensor{}};
        forward_then_backward(p, opt, fio, bio);
      };
      run(token_order::tiled, o_t, dq_t, dk_t, dv_t, dg_t);
      run(token_order::raster, o_r, dq_r, dk_r, dv_r, dg_r);
      // max_ulps 0: bit for bit; 1: within rounding, on at most one element in a thousand.
      const auto same_as_untiled = [&](const device_tensor& tiled, const device_tensor& raster, int64_t heads,
                                       const host_tensor& raster_shape, const char* name, int64_t max_ulps) {
        INFO(name);
        CHECK(raster.all_written()); // a raster tensor has no padding: every element is a valid token's
        CHECK(raster.canaries_intact());
        device_tensor want(raster_shape, poisoned);
        REQUIRE(untile(p, heads, tiled.cview(), want.view(), nullptr).is_ok());
        VSA_REQUIRE_RT(gpu_sync());
        const host_tensor w = want.download(), r = raster.download();
        const ulp_gap gap = ulp_gap_of(w, r);
        INFO(gap.differ << " of " << w.elements() << " elements differ, by up to " << gap.max_ulps << " ulps");
        CHECK(gap.max_ulps <= max_ulps);
        CHECK(gap.differ * 1000 <= w.elements());
      };
      same_as_untiled(o_t, o_r, p.q_heads, raster_q, "o", 0);
      same_as_untiled(dq_t, dq_r, p.q_heads, raster_q, "dq", 1);
      same_as_untiled(dk_t, dk_r, p.kv_heads, raster_kv, "dk", 0);
      same_as_untiled(dv_t, dv_r, p.kv_heads, raster_kv, "dv", 0);
      if (gated) same_as_untiled(dg_t, dg_r, p.q_heads, raster_q, "dgate", 0);
    }
  }
}

// One forward + backward of the whole op: its outputs, poisoned, and its own workspace, filled with `fill`
// (runs fill it differently, so that a result depending on what an earlier run left there shows up).
struct op_run {
  device_tensor o, dq, dk, dv, dgate;
  device_buffer ws;
  op_run(const host_tensor& shape_q, const host_tensor& shape_kv, std::size_t bytes, unsigned char fill)
      : o(shape_q, poisoned), dq(shape_q, poisoned), dk(shape_kv, poisoned), dv(shape_kv, poisoned),
        dgate(shape_q, poisoned), ws(bytes) {
    ws.fill(fill);
  }
  std::vector<const device_tensor*> outputs() const { return {&o, &dq, &dk, &dv, &dgate}; }
};

// The whole op with options::input_order raster: q, k, v and the gate read in raster order, their tiled copies written
// by the block means (on the caller's lists, by tile passes), d_o read in raster order and tiled by the combine's
// backward (or a tile pass). Against the op on the tiled inputs (tiled on the host by the reference): the copies, o
// and every gradient bit for bit, since the same kernels then read the same tiles. Gated runs put o and the gradients
// in raster order, ungated ones in tiled order; the lists case runs the tile passes.
TEST_CASE("the whole op in raster input order is the op on its inputs tiled", "[gpu][op]") {
  for (const config& c : configs()) {
    for (const int mode : {0, 1, 2}) { // 0 gated, raster outputs; 1 ungated, tiled outputs; 2 the caller's lists
      const bool gated = mode == 0, lists = mode == 2;
      const problem p = to_problem(c);
      VSA_TEST_RNG(g, "op-raster-input");
      INFO(describe(c) << " mode " << mode);
      const tile_geometry geo(p.grid);
      const int64_t slots = geo.tiled_tokens(), tokens = geo.raster_tokens();
      const auto shape = [&](int64_t s, int64_t heads) {
        return host_tensor(c.type, c.batch, s, heads, c.head_dim, c.order);
      };
      // Raster inputs of random values in every token, and the reference's tiling of each.
      host_tensor raster[5] = {shape(tokens, p.q_heads), shape(tokens, p.kv_heads), shape(tokens, p.kv_heads),
                               shape(tokens, p.q_heads), shape(tokens, p.q_heads)}; // q, k, v, gate, d_o
      host_tensor tiled[5] = {shape(slots, p.q_heads), shape(slots, p.kv_heads), shape(slots, p.kv_heads),
                              shape(slots, p.q_heads), shape(slots, p.q_heads)};
      const int64_t heads[5] = {p.q_heads, p.kv_heads, p.kv_heads, p.q_heads, p.q_heads};
      for (int t = 0; t < 5; ++t) {
        raster[t].fill_normal(g);
        REQUIRE(reference::tile(p, heads[t], raster[t].cview(), tiled[t].view()).is_ok());
      }
      const device_tensor q_r(raster[0]), k_r(raster[1]), v_r(raster[2]), gate_r(raster[3]), do_r(raster[4]);
      const device_tensor q_t(tiled[0]), k_t(tiled[1]), v_t(tiled[2]), gate_t(tiled[3]), do_t(tiled[4]);
      host_lists hl = random_lists(p, 3, g, [&](int64_t) { return 1 + g.integer(0, 2); });
      const device_lists dl(hl);
      options opt{};
      opt.sparsity = 0.6;
      opt.output_order = gated ? token_order::raster : token_order::tiled;
      if (lists) opt.q2k = {dl.view().q2k, dl.view().q2k_count, dl.capacity};
      const int64_t out = gated ? tokens : slots;
      const host_tensor out_q = shape(out, p.q_heads), out_kv = shape(out, p.kv_heads);
      op_run want(out_q, out_kv, 16, 0), got(out_q, out_kv, 16, 0); // their own workspaces unused here
      device_tensor copies[4] = {device_tensor(tiled[0], poisoned), device_tensor(tiled[1], poisoned),
                                 device_tensor(tiled[2], poisoned), device_tensor(tiled[3], poisoned)};
      {
        const const_tensor gate = gated ? gate_t.cview() : const_tensor{};
        const forward_io fio{q_t.cview(), k_t.cview(), v_t.cview(), gate, want.o.view()};
        const backward_io bio{
            q_t.cview(),  k_t.cview(),    v_t.cview(),    gate,           want.o.cview(),
            do_t.cview(), want.dq.view(), want.dk.view(), want.dv.view(), gated ? want.dgate.view() : tensor{}};
        forward_then_backward(p, opt, fio, bio);
      }
      {
        options raster_in = opt;
        raster_in.input_order = token_order::raster;
        forward_io fio{q_r.cview(), k_r.cview(), v_r.cview(), gated ? gate_r.cview() : const_tensor{}, got.o.view()};
        fio.tiled = {copies[0].view(), copies[1].view(), copies[2].view(), gated ? copies[3].view() : tensor{}};
        // The backward takes the forward's tiled copies, and d_o in raster order.
        const backward_io bio{copies[0].cview(), copies[1].cview(),
                              copies[2].cview(), as_const(fio.tiled.gate),
                              got.o.cview(),     do_r.cview(),
                              got.dq.view(),     got.dk.view(),
                              got.dv.view(),     gated ? got.dgate.view() : tensor{}};
        forward_then_backward(p, raster_in, fio, bio);
      }
      for (int t = 0; t < (gated ? 4 : 3); ++t) {
        INFO("tiled copy " << t);
        CHECK(copies[t].canaries_intact());
        CHECK(copies[t].download().bytes == tiled[t].bytes); // padding slots zero, as the reference's tile()
      }
      const char* names[5] = {"o", "dq", "dk", "dv", "dgate"};
      const auto outputs_want = want.outputs(), outputs_got = got.outputs();
      for (int t = 0; t < (gated ? 5 : 4); ++t) {
        INFO(names[t]);
        CHECK(outputs_got[t]->canaries_intact());
        CHECK(outputs_got[t]->download().bytes == outputs_want[t]->download().bytes);
      }
    }
  }
}

TEST_CASE("the whole op is bitwise reproducible across runs and streams", "[gpu][op]") {
  const config c{{9, 10, 11}, 2, 4, 2, 128, dtype::bf16, layout::bshd};
  const problem p = to_problem(c);
  VSA_TEST_RNG(g, "op-streams");
  INFO(describe(c));
  const int64_t tokens = tile_geometry(p.grid).tiled_tokens();
  options opt{};
  opt.sparsity = 0.6;
  const host_tensor q = tiled_input(c, p.q_heads, g), k = tiled_input(c, p.kv_heads, g),
                    v = tiled_input(c, p.kv_heads, g), d_o = tiled_input(c, p.q_heads, g),
                    gate = tiled_input(c, p.q_heads, g);
  const device_tensor dq_in(q), dk_in(k), dv_in(v), ddo(d_o), dgate_in(gate);
  const host_tensor shape_q(c.type, c.batch, tokens, p.q_heads, c.head_dim, c.order),
      shape_kv(c.type, c.batch, tokens, p.kv_heads, c.head_dim, c.order);
  std::size_t fbytes = 0, bytes = 0;
  REQUIRE(forward(p, opt, forward_io{}, nullptr, fbytes, nullptr).is_ok());
  REQUIRE(backward(p, opt, backward_io{}, nullptr, bytes, nullptr).is_ok());
  REQUIRE(bytes >= fbytes); // one workspace serves both: the backward reads what the forward left in it

  const auto run_forward = [&](op_run& r, gpu::stream_t s) {
    const forward_io io{dq_in.cview(), dk_in.cview(), dv_in.cview(), dgate_in.cview(), r.o.view()};
    std::size_t n = r.ws.bytes();
    const status st = forward(p, opt, io, r.ws.get(), n, s);
    INFO(st.message());
    REQUIRE(st.is_ok());
  };
  const auto run_backward = [&](op_run& r, gpu::stream_t s) {
    const backward_io io{dq_in.cview(), dk_in.cview(), dv_in.cview(), dgate_in.cview(), r.o.cview(),
                         ddo.cview(),   r.dq.view(),   r.dk.view(),   r.dv.view(),      r.dgate.view()};
    std::size_t n = r.ws.bytes();
    const status st = backward(p, opt, io, r.ws.get(), n, s);
    INFO(st.message());
    REQUIRE(st.is_ok());
  };

  // Every output of every run, as bytes: o, dq, dk, dv, dgate.
  const char* const output_names[] = {"o", "dq", "dk", "dv", "dgate"};
  std::vector<std::string> run_names;
  std::vector<std::vector<std::vector<unsigned char>>> results;
  const auto collect = [&](const op_run& r, const char* name) {
    INFO(name);
    std::vector<std::vector<unsigned char>> bytes_of;
    for (const device_tensor* t : r.outputs()) {
      CHECK(t->all_written());
      CHECK(t->canaries_intact());
      bytes_of.push_back(t->download().bytes);
    }
    CHECK(r.ws.canaries_intact());
    run_names.push_back(name);
    results.push_back(std::move(bytes_of));
  };

  // The null stream, twice.
  for (const unsigned char fill : {poison_byte, static_cast<unsigned char>(0x00)}) {
    op_run r(shape_q, shape_kv, bytes, fill);
    run_forward(r, nullptr);
    run_backward(r, nullptr);
    VSA_REQUIRE_RT(gpu_sync());
    collect(r, fill == poison_byte ? "null stream" : "null stream, again");
  }

  // Two non-blocking streams, each alone. They do not wait for the null stream, on which the synchronous
  // copies that poison the outputs ran: the device is synchronized before anything is launched on them.
  device_stream s1, s2;
  {
    op_run r(shape_q, shape_kv, bytes, 0x5a);
    VSA_REQUIRE_RT(gpu_sync());
    run_forward(r, s1.get());
    run_backward(r, s1.get());
    VSA_REQUIRE_RT(s1.sync());
    collect(r, "stream 1");
  }
  {
    op_run r(shape_q, shape_kv, bytes, 0xa5);
    VSA_REQUIRE_RT(gpu_sync());
    run_forward(r, s2.get());
    run_backward(r, s2.get());
    VSA_REQUIRE_RT(s2.sync());
    collect(r, "stream 2");
  }

  // Both streams at once, separate outputs and workspaces: every launch is queued before either stream is
  // waited for, forwards and backwards interleaved so that the two runs overlap on the device.
  {
    op_run a(shape_q, shape_kv, bytes, 0x3c), b(shape_q, shape_kv, bytes, 0xc3);
    VSA_REQUIRE_RT(gpu_sync());
    run_forward(a, s1.get());
    run_forward(b, s2.get());
    run_backward(a, s1.get());
    run_backward(b, s2.get());
    VSA_REQUIRE_RT(s1.sync());
    VSA_REQUIRE_RT(s2.sync());
    collect(a, "stream 1, concurrent with stream 2");
    collect(b, "stream 2, concurrent with stream 1");
  }
  // The memory in two parts (op_buffers): the state kept alone between the passes, the forward's scratch
  // freed before the backward, whose scratch is a fresh poisoned buffer.
  {
    op_buffers fq, bq;
    REQUIRE(forward(p, opt, forward_io{}, fq, nullptr).is_ok());
    REQUIRE(backward(p, opt, backward_io{}, bq, nullptr).is_ok());
    REQUIRE(fq.state_bytes == bq.state_bytes);
    CHECK(fq.state_bytes + fq.scratch_bytes == fbytes);
    CHECK(bq.state_bytes + std::max(fq.scratch_bytes, bq.scratch_bytes) == bytes);
    op_run r(shape_q, shape_kv, 0, poison_byte);
    device_buffer state(fq.state_bytes);
    state.poison();
    {
      device_buffer scratch(fq.scratch_bytes);
      scratch.poison();
      const forward_io io{dq_in.cview(), dk_in.cview(), dv_in.cview(), dgate_in.cview(), r.o.view()};
      op_buffers b{state.get(), state.bytes(), scratch.get(), scratch.bytes()};
      const status st = forward(p, opt, io, b, nullptr);
      INFO(st.message());
      REQUIRE(st.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(scratch.canaries_intact());
    }
    device_buffer scratch(bq.scratch_bytes);
    scratch.fill(0x77);
    const backward_io io{dq_in.cview(), dk_in.cview(), dv_in.cview(), dgate_in.cview(), r.o.cview(),
                         ddo.cview(),   r.dq.view(),   r.dk.view(),   r.dv.view(),      r.dgate.view()};
    op_buffers b{state.get(), state.bytes(), scratch.get(), scratch.bytes()};
    const std::vector<unsigned char> state_before = state.download_bytes();
    const status st = backward(p, opt, io, b, nullptr);
    INFO(st.message());
    REQUIRE(st.is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(state.canaries_intact());
    CHECK(scratch.canaries_intact());
    CHECK(state.download_bytes() == state_before); // the backward only reads the state
    collect(r, "state and scratch apart");
  }
  VSA_REQUIRE_RT(s1.destroy());
  VSA_REQUIRE_RT(s2.destroy());

  REQUIRE(results.size() == 7);
  for (std::size_t i = 1; i < results.size(); ++i)
    for (std::size_t t = 0; t < results[i].size(); ++t) {
      INFO(output_names[t] << ": " << run_names[i] << " against " << run_names[0]);
      const std::vector<unsigned char>& got = results[i][t];
      const std::vector<unsigned char>& first = results[0][t];
      REQUIRE(got.size() == first.size());
      int64_t differ = 0; // a count, not the vectors: Catch would print megabytes
      for (std::size_t e = 0; e < got.size(); ++e) differ += got[e] != first[e] ? 1 : 0;
      CHECK(differ == 0);
    }
}

} // namespace
} // namespace test
} // namespace vsa
