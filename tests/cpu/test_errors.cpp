// Every kind of bad argument is rejected with its own error code and a message naming the argument,
// before anything is written.
#include "support/host.hpp"

#include <vsa/reference.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

using namespace vsa;
using test::host_tensor;
using test::layout;
using test::make_problem;

namespace {

// Buffers for every entry point, sized for one valid problem; the outputs are poisoned.
struct world {
  problem p;
  int64_t n, slots, raster, top_k = 3;
  host_tensor q, k, v, gate, d_o, o, dq, dk, dv, dgate, rq, q_c, k_c, v_c, o_c, d_o_c;
  std::vector<float> scores, lse_c, lse, dq_c, dk_c, dv_c;
  std::vector<int32_t> q2k, count, k2q, offset;
  test::aligned_buffer workspace;
  std::size_t workspace_bytes = 0;

  explicit world(const problem& valid, test::rng& g)
      : p(valid), n(tile_geometry(valid.grid).num_tiles()), slots(tile_geometry(valid.grid).tiled_tokens()),
        raster(tile_geometry(valid.grid).raster_tokens()) {
    const int64_t b = p.batch, hq = p.q_heads, hk = p.kv_heads, d = p.head_dim;
    q = host_tensor(p.type, b, slots, hq, d);
    k = host_tensor(p.type, b, slots, hk, d);
    v = host_tensor(p.type, b, slots, hk, d);
    gate = host_tensor(p.type, b, slots, hq, d);
    d_o = host_tensor(p.type, b, slots, hq, d);
    rq = host_tensor(p.type, b, raster, hq, d);
    for (host_tensor* t : {&q, &k, &v, &gate, &d_o, &rq}) t->fill_normal(g);
    o = host_tensor(p.type, b, slots, hq, d);
    dq = host_tensor(p.type, b, slots, hq, d);
    dk = host_tensor(p.type, b, slots, hk, d);
    dv = host_tensor(p.type, b, slots, hk, d);
    dgate = host_tensor(p.type, b, slots, hq, d);
    q_c = host_tensor(p.type, b, n, hq, d, layout::bhsd);
    k_c = host_tensor(p.type, b, n, hk, d, layout::bhsd);
    v_c = host_tensor(p.type, b, n, hk, d, layout::bhsd);
    o_c = host_tensor(p.type, b, n, hq, d, layout::bhsd);
    d_o_c = host_tensor(p.type, b, n, hq, d, layout::bhsd);
    for (host_tensor* t : {&o, &dq, &dk, &dv, &dgate, &q_c, &k_c, &v_c, &o_c, &d_o_c}) t->fill_byte(test::poison_byte);
    scores.assign(static_cast<std::size_t>(b * hq * n * n), NAN);
    lse_c.assign(static_cast<std::size_t>(b * hq * n), NAN);
    lse.assign(static_cast<std::size_t>(b * hq * slots), NAN);
    dq_c.assign(static_cast<std::size_t>(b * hq * n * d), NAN);
    dk_c.assign(static_cast<std::size_t>(b * hk * n * d), NAN);
    dv_c.assign(static_cast<std::size_t>(b * hk * n * d), NAN);
    // Valid lists (every row holds tiles 0..top_k-1), so that only the argument under test is wrong.
    count.assign(static_cast<std::size_t>(b * hq * n), static_cast<int32_t>(top_k));
    for (int64_t row = 0; row < b * hq * n; ++row)
      for (int64_t c = 0; c < top_k; ++c) q2k.push_back(static_cast<int32_t>(c));
    k2q.assign(static_cast<std::size_t>(b * hq * n * top_k), 0x7f7f7f7f);
    offset.assign(static_cast<std::size_t>(b * hq * (n + 1)), 0x7f7f7f7f);
    options opt;
    opt.top_k = top_k;
    std::size_t fb = 0, bb = 0;
    REQUIRE(reference::forward(p, opt, fwd(), nullptr, fb).is_ok());
    REQUIRE(reference::backward(p, opt, bwd(), nullptr, bb).is_ok());
    workspace_bytes = std::max(fb, bb);
    workspace = test::aligned_buffer(workspace_bytes);
  }

  index_lists lists() { return {q2k.data(), count.data(), top_k, k2q.data(), offset.data()}; }
  forward_io fwd() { return {q.cview(), k.cview(), v.cview(), gate.cview(), o.view()}; }
  backward_io bwd() {
    return {q.cview(),   k.cview(), v.cview(), gate.cview(), o.cview(),
            d_o.cview(), dq.view(), dk.view(), dv.view(),    dgate.view()};
  }

  // Everything an entry point may write, as bytes.
  std::vector<unsigned char> snapshot() const {
    std::vector<unsigned char> all;
    const auto add = [&](const void* data, std::size_t size) {
      const unsigned char* c = static_cast<const unsigned char*>(data);
      all.insert(all.end(), c, c + size);
    };
    for (const host_tensor* t : {&o, &dq, &dk, &dv, &dgate, &q_c, &k_c, &v_c, &o_c, &d_o_c, &q})
      add(t->data(), t->bytes.size());
    for (const std::vector<float>* f : {&scores, &lse_c, &lse, &dq_c, &dk_c, &dv_c})
      add(f->data(), f->size() * sizeof(float));
    for (const std::vector<int32_t>* i : {&q2k, &count, &k2q, &offset}) add(i->data(), i->size() * sizeof(int32_t));
    return all;
  }

  // Calls every entry point with problem pp (buffers as allocated for p).
  std::vector<std::pair<const char*, status>> call_all(const problem& pp) {
    options opt;
    opt.top_k = top_k;
    std::size_t bytes = workspace_bytes;
    const float scale = 0.5f;
    const index_lists idx = lists();
    std::vector<std::pair<const char*, status>> r;
    r.emplace_back("tile", reference::tile(pp, pp.q_heads, rq.cview(), q.view()));
    r.emplace_back("untile", reference::untile(pp, pp.q_heads, q.cview(), rq.view()));
    r.emplace_back("block_means",
                   reference::block_means(pp, q.cview(), k.cview(), v.cview(), q_c.data(), k_c.data(), v_c.data()));
    // The fp32 means of the scores: any float arrays of their size (the calls must reject before reading them).
    r.emplace_back("coarse_scores", reference::coarse_scores(pp, scale, dq_c.data(), dk_c.data(), scores.data()));
    r.emplace_back("coarse_attention",
                   reference::coarse_attention(pp, scores.data(), v_c.data(), o_c.data(), nullptr, lse_c.data()));
    r.emplace_back("coarse_attention_backward",
                   reference::coarse_attention_backward(pp, scale, q_c.data(), k_c.data(), v_c.data(), scores.data(),
                                                        o_c.data(), nullptr, d_o_c.data(), lse_c.data(), dq_c.data(),
                                                        dk_c.data(), dv_c.data()));
    r.emplace_back("select_top_k", reference::select_top_k(pp, top_k, scores.data(), idx));
    r.emplace_back("build_k2q", reference::build_k2q(pp, idx));
    r.emplace_back("sparse_attention_forward",
                   reference::sparse_attention_forward(pp, scale, q.cview(), k.cview(), v.cview(), as_const(idx),
                                                       o.view(), lse.data()));
    r.emplace_back("sparse_attention_backward", reference::sparse_attention_backward(
                                                    pp, scale, q.cview(), k.cview(), v.cview(), o.cview(), d_o.cview(),
                                                    lse.data(), as_const(idx), dq.view(), dk.view(), dv.view()));
    r.emplace_back("combine", reference::combine(pp, o.cview(), gate.cview(), o_c.data(), o.view()));
    r.emplace_back("combine_backward",
                   reference::combine_backward(pp, d_o.cview(), gate.cview(), o_c.data(), dgate.view(), d_o_c.data()));
    r.emplace_back("linear_attention_forward",
                   reference::linear_attention_forward(pp, feature_map::elu1, 1e-3f, token_order::tiled, q.cview(),
                                                       k.cview(), v.cview(), o.view()));
    r.emplace_back("linear_attention_backward",
                   reference::linear_attention_backward(pp, feature_map::elu1, 1e-3f, token_order::tiled, q.cview(),
                                                        k.cview(), v.cview(), d_o.cview(), dq.view(), dk.view(),
                                                        dv.view()));
    r.emplace_back("forward", reference::forward(pp, opt, fwd(), workspace.data(), bytes));
    r.emplace_back("backward", reference::backward(pp, opt, bwd(), workspace.data(), bytes));
    // The joint op with no extra tokens takes the same tensors.
    const extra_tokens none{};
    r.emplace_back("joint_sparse_attention_forward",
                   reference::joint_sparse_attention_forward(pp, none, scale, q.cview(), k.cview(), v.cview(),
                                                             as_const(idx), o.view(), lse.data()));
    r.emplace_back("joint_sparse_attention_backward",
                   reference::joint_sparse_attention_backward(pp, none, scale, q.cview(), k.cview(), v.cview(),
                                                              o.cview(), d_o.cview(), lse.data(), as_const(idx),
                                                              dq.view(), dk.view(), dv.view()));
    r.emplace_back("joint_forward", reference::joint_forward(pp, none, opt, fwd(), workspace.data(), bytes));
    r.emplace_back("joint_backward", reference::joint_backward(pp, none, opt, bwd(), workspace.data(), bytes));
    return r;
  }
};

void expect_all_rejected(world& w, const problem& bad, errc code, const char* word) {
  const std::vector<unsigned char> before = w.snapshot();
  for (const auto& call : w.call_all(bad)) {
    INFO(call.first << ": " << errc_name(call.second.code()) << ": " << call.second.message());
    CHECK(call.second.code() == code);
    CHECK(test::mentions(call.second, word));
  }
  CHECK(w.snapshot() == before);
}

// A call rejected for aliasing, with the output and the argument it meets both named, as that pair (a name's
// presence alone would also pass for a longer name that contains it: o_c in o_c_residual or d_o_c).
void expect_aliased(const status& s, const char* output, const char* other) {
  INFO(errc_name(s.code()) << ": " << s.message());
  CHECK(s.code() == errc::aliased);
  CHECK(test::mentions(s, output));
  CHECK(test::mentions(s, other));
  const std::string two_outputs = std::string(output) + " and " + other + ":",
                    over_input = std::string(output) + ": shares memory with " + other + ",";
  CHECK((test::mentions(s, two_outputs.c_str()) || test::mentions(s, over_input.c_str())));
}

} // namespace

TEST_CASE("every entry point rejects a bad problem and writes nothing", "[cpu][errors]") {
  VSA_TEST_RNG(g, "errors problem");
  const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, dtype::bf16);
  world w(p, g);
  {
    INFO("the valid problem passes everywhere");
    for (const auto& call : w.call_all(p)) {
      INFO(call.first << ": " << call.second.message());
      CHECK(call.second.is_ok());
    }
  }
  // Re-poison what the valid calls wrote.
  world fresh(p, g);
  problem bad = p;
  bad.head_dim = 0;
  expect_all_rejected(fresh, bad, errc::bad_head_dim, "head_dim");
  bad.head_dim = 257;
  expect_all_rejected(fresh, bad, errc::bad_head_dim, "head_dim");
  bad = p;
  bad.type = static_cast<dtype>(7);
  expect_all_rejected(fresh, bad, errc::bad_dtype, "type");
  bad = p;
  bad.q_heads = 3; // kv_heads 2 does not divide it
  expect_all_rejected(fresh, bad, errc::bad_heads, "kv_heads");
  bad = p;
  bad.kv_heads = 0;
  expect_all_rejected(fresh, bad, errc::bad_heads, "heads");
  bad = p;
  bad.batch = 0;
  expect_all_rejected(fresh, bad, errc::bad_batch, "batch");
  bad = p;
  bad.grid.w = 0;
  expect_all_rejected(fresh, bad, errc::bad_grid, "grid");
  bad.grid = {-4, 6, 7};
  expect_all_rejected(fresh, bad, errc::bad_grid, "grid");
  bad.grid = {int64_t(1) << 30, int64_t(1) << 30, int64_t(1) << 30};
  expect_all_rejected(fresh, bad, errc::bad_grid, "grid");
  bad.grid = {int64_t(1) << 21, int64_t(1) << 21, 64}; // 2^48 tokens fit in int64, 2^42 tiles do not fit the lists
  expect_all_rejected(fresh, bad, errc::bad_grid, "grid");
}

TEST_CASE("the GPU target and the CPU reference accept different dtypes and head dims", "[cpu][errors]") {
  problem p = make_problem({5, 6, 7}, 1, 2, 2, 96, dtype::f32);
  CHECK(check_problem(p, target::cpu).is_ok());
  status s = check_problem(p, target::gpu);
  CHECK(s.code() == errc::bad_head_dim);
  CHECK(test::mentions(s, "head_dim"));
  p.head_dim = 64;
  s = check_problem(p, target::gpu);
  CHECK(s.code() == errc::bad_dtype);
  CHECK(test::mentions(s, "type"));
  p.type = dtype::f64;
  CHECK(check_problem(p, target::gpu).code() == errc::bad_dtype);
  CHECK(check_problem(p, target::cpu).is_ok());
  p.type = dtype::fp16;
  CHECK(check_problem(p, target::gpu).is_ok());

  // The reference runs what only it accepts: f64 and head dim 3.
  VSA_TEST_RNG(g, "errors cpu only");
  const problem odd = make_problem({5, 6, 7}, 1, 2, 1, 3, dtype::f64);
  world w(odd, g);
  for (const auto& call : w.call_all(odd)) {
    INFO(call.first << ": " << call.second.message());
    CHECK(call.second.is_ok());
  }
}

TEST_CASE("bad tensors, options and lists are rejected by name with outputs untouched", "[cpu][errors]") {
  VSA_TEST_RNG(g, "errors arguments");
  const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, dtype::fp16);
  world w(p, g);
  const std::vector<unsigned char> before = w.snapshot();
  std::size_t bytes = w.workspace_bytes;
  const auto forward_with = [&](const options& opt, const forward_io& io) {
    std::size_t b = w.workspace_bytes;
    return reference::forward(p, opt, io, w.workspace.data(), b);
  };
  const auto expect = [&](const status& s, errc code, const char* word) {
    INFO(errc_name(s.code()) << ": " << s.message());
    CHECK(s.code() == code);
    CHECK(test::mentions(s, word));
    CHECK(w.snapshot() == before);
  };
  options opt;
  opt.top_k = 3;

  forward_io io = w.fwd();
  io.k.data = nullptr;
  expect(forward_with(opt, io), errc::null_pointer, "k");
  io = w.fwd();
  io.o.data = nullptr;
  expect(forward_with(opt, io), errc::null_pointer, "o");
  io = w.fwd();
  io.q.tokens = w.raster; // raster-sized tensor where tiled is expected
  expect(forward_with(opt, io), errc::bad_tokens, "q");
  io = w.fwd();
  io.v.head_stride = 4; // head rows of 8 elements 4 apart overlap
  expect(forward_with(opt, io), errc::bad_strides, "v");
  io = w.fwd();
  io.gate.token_stride = -io.gate.token_stride;
  expect(forward_with(opt, io), errc::bad_strides, "gate");
  io = w.fwd();
  io.o.batch_stride = 8; // batches overlapping the tokens of the first
  expect(forward_with(opt, io), errc::bad_strides, "o");

  for (int64_t k : {int64_t(-1), w.n + 1}) {
    options bad = opt;
    bad.top_k = k;
    expect(forward_with(bad, w.fwd()), errc::bad_top_k, "top_k");
    // Only the option that was used is named, with its range.
    const status s = forward_with(bad, w.fwd());
    CHECK(!test::mentions(s, "sparsity"));
    CHECK(test::mentions(s, ("1.." + std::to_string(w.n)).c_str()));
  }
  for (double sparsity : {1.0, -0.1, static_cast<double>(NAN)}) {
    options bad;
    bad.sparsity = sparsity;
    expect(forward_with(bad, w.fwd()), errc::bad_top_k, "sparsity");
  }
  for (float scale : {-1.0f, NAN, INFINITY}) {
    options bad = opt;
    bad.scale = scale;
    expect(forward_with(bad, w.fwd()), errc::bad_argument, "scale");
  }
  {
    std::size_t small = 1024;
    expect(reference::forward(p, opt, w.fwd(), w.workspace.data(), small), errc::bad_workspace, "workspace");
  }

  // Caller-supplied lists: out of range, repeated, not ascending; through the op and the sparse stage.
  std::vector<std::vector<int32_t>> defects;
  for (int kind = 0; kind < 4; ++kind) {
    std::vector<int32_t> lists = w.q2k;
    const std::size_t row = static_cast<std::size_t>(5 * w.top_k);
    if (kind == 0) lists[row + 2] = static_cast<int32_t>(w.n);
    if (kind == 1) lists[row + 1] = -3;
    if (kind == 2) lists[row + 2] = lists[row + 1];
    if (kind == 3) std::swap(lists[row], lists[row + 2]);
    defects.push_back(lists);
  }
  for (const std::vector<int32_t>& lists : defects) {
    options given;
    given.q2k = {lists.data(), w.count.data(), w.top_k, nullptr, nullptr};
    forward_io plain = w.fwd();
    plain.gate.data = nullptr;
    expect(forward_with(given, plain), errc::bad_index, "q2k");
    expect(reference::sparse_attention_forward(p, 0.5f, w.q.cview(), w.k.cview(), w.v.cview(), given.q2k, w.o.view(),
                                               w.lse.data()),
           errc::bad_index, "q2k");
  }
  {
    options given;
    std::vector<int32_t> counts = w.count;
    counts[7] = static_cast<int32_t>(w.top_k + 1);
    given.q2k = {w.q2k.data(), counts.data(), w.top_k, nullptr, nullptr};
    forward_io plain = w.fwd();
    plain.gate.data = nullptr;
    expect(forward_with(given, plain), errc::bad_index, "q2k_count");
    given.q2k = {w.q2k.data(), nullptr, w.top_k, nullptr, nullptr};
    expect(forward_with(given, plain), errc::null_pointer, "q2k");
  }

  // Backward: the gradient of an absent gate, a missing gradient, a bad stage scale.
  backward_io bio = w.bwd();
  bio.gate.data = nullptr;
  expect(reference::backward(p, opt, bio, w.workspace.data(), bytes), errc::bad_argument, "dgate");
  bio = w.bwd();
  bio.dgate.data = nullptr;
  expect(reference::backward(p, opt, bio, w.workspace.data(), bytes), errc::null_pointer, "dgate");
  bio = w.bwd();
  bio.dv.tokens = w.slots - 1;
  expect(reference::backward(p, opt, bio, w.workspace.data(), bytes), errc::bad_tokens, "dv");
  bio = w.bwd();
  bio.d_o.data = nullptr;
  expect(reference::backward(p, opt, bio, w.workspace.data(), bytes), errc::null_pointer, "d_o");
  expect(reference::sparse_attention_forward(p, 0.0f, w.q.cview(), w.k.cview(), w.v.cview(), as_const(w.lists()),
                                             w.o.view(), w.lse.data()),
         errc::bad_argument, "scale");
  expect(reference::sparse_attention_forward(p, 0.5f, w.q.cview(), w.k.cview(), w.v.cview(), as_const(w.lists()),
                                             w.o.view(), nullptr),
         errc::null_pointer, "lse");
  expect(reference::block_means(p, w.q.cview(), w.k.cview(), w.v.cview(), w.q_c.data(), nullptr, w.v_c.data()),
         errc::null_pointer, "k_c");
  expect(reference::coarse_scores(p, 0.5f, w.dq_c.data(), w.dk_c.data(), nullptr), errc::null_pointer, "scores");
  expect(reference::coarse_scores(p, 0.5f, nullptr, w.dk_c.data(), w.scores.data()), errc::null_pointer, "q_c");
  expect(reference::coarse_attention(p, nullptr, w.v_c.data(), w.o_c.data(), nullptr, w.lse_c.data()),
         errc::null_pointer, "scores");
  expect(reference::coarse_attention(p, w.scores.data(), w.v_c.data(), w.o_c.data(), nullptr,
                                     reinterpret_cast<float*>(reinterpret_cast<char*>(w.lse_c.data()) + 1)),
         errc::misaligned_pointer, "lse_c");
}

TEST_CASE("an output sharing memory with another argument is rejected by name, interleaved views are not",
          "[cpu][errors]") {
  VSA_TEST_RNG(g, "errors aliasing");
  const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, dtype::fp16);
  world w(p, g);
  const std::vector<unsigned char> before = w.snapshot();
  options opt;
  opt.top_k = 3;
  const auto forward_with = [&](const forward_io& io) {
    std::size_t b = w.workspace_bytes;
    return reference::forward(p, opt, io, w.workspace.data(), b);
  };
  const auto backward_with = [&](const backward_io& io) {
    std::size_t b = w.workspace_bytes;
    return reference::backward(p, opt, io, w.workspace.data(), b);
  };
  const auto expect = [&](const status& s, const char* output, const char* other) {
    INFO(errc_name(s.code()) << ": " << s.message());
    CHECK(s.code() == errc::aliased);
    CHECK(test::mentions(s, output));
    CHECK(test::mentions(s, other));
    CHECK(w.snapshot() == before);
  };
  const auto shifted = [&](tensor t, const void* base, int64_t elements) {
    t.data = static_cast<char*>(const_cast<void*>(base)) + elements * static_cast<int64_t>(dtype_size(p.type));
    return t;
  };

  // The forward: o over q, o overlapping k by one token, o inside the workspace (the op's state).
  forward_io io = w.fwd();
  io.o = shifted(io.o, w.q.data(), 0);
  expect(forward_with(io), "o", "q");
  io = w.fwd();
  io.o = shifted(io.o, w.q.data(), w.q.cview().token_stride); // all but q's first token row
  expect(forward_with(io), "o", "q");
  io = w.fwd();
  io.k.data = w.o.data(); // an input read from inside the output
  expect(forward_with(io), "o", "k");
  io = w.fwd();
  io.o = shifted(io.o, w.workspace.data(), 0);
  expect(forward_with(io), "o", "state");
  // The backward: an output over an input, two outputs over each other, an output over the gate.
  backward_io bio = w.bwd();
  bio.dq = shifted(bio.dq, w.d_o.data(), 0);
  expect(backward_with(bio), "dq", "d_o");
  bio = w.bwd();
  bio.dv = shifted(bio.dv, w.dk.data(), 0);
  expect(backward_with(bio), "dk", "dv");
  bio = w.bwd();
  bio.dgate = shifted(bio.dgate, w.gate.data(), 0);
  expect(backward_with(bio), "dgate", "gate");
  // The sparse stage: lse over o_s, dk over v.
  const const_index_lists lists = as_const(w.lists());
  expect(reference::sparse_attention_forward(p, 0.5f, w.q.cview(), w.k.cview(), w.v.cview(), lists, w.o.view(),
                                             reinterpret_cast<float*>(w.o.data())),
         "o_s", "lse");
  expect(reference::sparse_attention_backward(p, 0.5f, w.q.cview(), w.k.cview(), w.v.cview(), w.o.cview(),
                                              w.d_o.cview(), w.lse.data(), lists, w.dq.view(),
                                              shifted(w.dk.view(), w.v.data(), 0), w.dv.view()),
         "dk", "v");

  // The layout passes: the output over the input, either way.
  const int64_t heads = p.q_heads;
  expect(reference::tile(p, heads, w.rq.cview(), shifted(w.o.view(), w.rq.data(), 0)), "tiled", "raster");
  tensor raster_over_q = w.rq.view();
  raster_over_q.data = w.q.data();
  expect(reference::untile(p, heads, w.q.cview(), raster_over_q), "raster", "tiled");
  // combine: o over the gate, over o_c, and over o_s one token off (o over o_s exactly is in place: below).
  expect(reference::combine(p, w.q.cview(), w.gate.cview(), w.o_c.data(), shifted(w.o.view(), w.gate.data(), 0)), "o",
         "gate");
  expect(reference::combine(p, w.q.cview(), w.gate.cview(), w.o.data(), w.o.view()), "o", "o_c"); // o_c inside o
  expect(reference::combine(p, w.q.cview(), w.gate.cview(), w.o_c.data(),
                            shifted(w.o.view(), w.q.data(), w.q.cview().token_stride)),
         "o", "o_s");
  // combine_backward: its two outputs over each other, dgate over dO.
  expect(reference::combine_backward(p, w.d_o.cview(), w.gate.cview(), w.o_c.data(), w.dgate.view(), w.dgate.data()),
         "dgate", "d_o_c");
  expect(reference::combine_backward(p, w.d_o.cview(), w.gate.cview(), w.o_c.data(),
                                     shifted(w.dgate.view(), w.d_o.data(), 0), w.d_o_c.data()),
         "dgate", "d_o");

  // q, k, v interleaved in one packed [B, S, Hq + 2·Hk, D] buffer and dq, dk, dv in another, as a framework's
  // fused projection gives them: accepted, and the gradients are those of separate tensors.
  const int64_t hq = p.q_heads, hk = p.kv_heads, d = p.head_dim;
  host_tensor qkv(p.type, p.batch, w.slots, hq + 2 * hk, d), grads(p.type, p.batch, w.slots, hq + 2 * hk, d);
  grads.fill_byte(test::poison_byte);
  const auto part = [&](host_tensor& t, int64_t head0) { return shifted(t.view(), t.data(), head0 * d); };
  tensor pq = part(qkv, 0), pk = part(qkv, hq), pv = part(qkv, hq + hk);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t s = 0; s < w.slots; ++s)
      for (int64_t c = 0; c < d; ++c) {
        for (int64_t h = 0; h < hq; ++h) qkv.set(b, s, h, c, w.q.get(b, s, h, c));
        for (int64_t h = 0; h < hk; ++h) {
          qkv.set(b, s, hq + h, c, w.k.get(b, s, h, c));
          qkv.set(b, s, hq + hk + h, c, w.v.get(b, s, h, c));
        }
      }
  pq.tokens = pk.tokens = pv.tokens = w.slots;
  forward_io packed{as_const(pq), as_const(pk), as_const(pv), w.gate.cview(), w.o.view()};
  REQUIRE(forward_with(packed).is_ok());
  backward_io pb{as_const(pq),  as_const(pk),   as_const(pv),    w.gate.cview(),       w.o.cview(),
                 w.d_o.cview(), part(grads, 0), part(grads, hq), part(grads, hq + hk), w.dgate.view()};
  {
    // The same interleaving one head off: dk's first head is dq's last. Disjoint intervals are not required,
    // disjoint elements are.
    backward_io off = pb;
    off.dk = part(grads, hq - 1);
    const status s = backward_with(off);
    INFO(s.message());
    CHECK(s.code() == errc::aliased);
    CHECK(test::mentions(s, "dq"));
    CHECK(test::mentions(s, "dk"));
    CHECK(std::all_of(grads.bytes.begin(), grads.bytes.end(), [](unsigned char c) { return c == test::poison_byte; }));
  }
  REQUIRE(backward_with(pb).is_ok());
  REQUIRE(forward_with(w.fwd()).is_ok());
  REQUIRE(backward_with(w.bwd()).is_ok());
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t s = 0; s < w.slots; ++s)
      for (int64_t c = 0; c < d; ++c) {
        for (int64_t h = 0; h < hq; ++h) REQUIRE(grads.get(b, s, h, c) == w.dq.get(b, s, h, c));
        for (int64_t h = 0; h < hk; ++h) {
          REQUIRE(grads.get(b, s, hq + h, c) == w.dk.get(b, s, h, c));
          REQUIRE(grads.get(b, s, hq + hk + h, c) == w.dv.get(b, s, h, c));
        }
      }

  // combine in place (o the same view as o_s) is accepted and gives what it gives into a separate o.
  w.o_c.fill_normal(g);
  REQUIRE(reference::combine(p, w.q.cview(), w.gate.cview(), w.o_c.data(), w.o.view()).is_ok());
  host_tensor in_place = w.q;
  REQUIRE(reference::combine(p, in_place.cview(), w.gate.cview(), w.o_c.data(), in_place.view()).is_ok());
  CHECK(in_place.bytes == w.o.bytes);
}

TEST_CASE("the selection stages reject an output over another argument, by name", "[cpu][errors]") {
  VSA_TEST_RNG(g, "errors selection aliasing");
  const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, dtype::fp16);
  world w(p, g);
  const std::vector<unsigned char> before = w.snapshot();
  // block_means: a mean over the tensor it is taken of, over another mean, an fp32 copy over a mean.
  void* q_bytes = const_cast<void*>(static_cast<const void*>(w.q.data()));
  expect_aliased(reference::block_means(p, w.q.cview(), w.k.cview(), w.v.cview(), q_bytes, w.k_c.data(), w.v_c.data()),
                 "q_c", "q");
  expect_aliased(
      reference::block_means(p, w.q.cview(), w.k.cview(), w.v.cview(), w.q_c.data(), w.k_c.data(), w.k_c.data()), "k_c",
      "v_c");
  expect_aliased(reference::block_means(p, w.q.cview(), w.k.cview(), w.v.cview(), w.q_c.data(), w.k_c.data(),
                                        w.v_c.data(), w.dq_c.data(), reinterpret_cast<float*>(w.q_c.data())),
                 "q_c", "k_c_f32");
  // select_top_k: the lists over the scores or over each other.
  index_lists idx = w.lists();
  index_lists over_scores = idx;
  over_scores.q2k = reinterpret_cast<int32_t*>(w.scores.data());
  expect_aliased(reference::select_top_k(p, w.top_k, w.scores.data(), over_scores), "q2k", "scores");
  index_lists counts_over_lists = idx;
  counts_over_lists.q2k_count = idx.q2k + 1;
  expect_aliased(reference::select_top_k(p, w.top_k, w.scores.data(), counts_over_lists), "q2k", "q2k_count");
  // build_k2q: its outputs over the q2k lists they are built from, or over each other.
  index_lists k2q_over_q2k = idx;
  k2q_over_q2k.k2q = idx.q2k;
  expect_aliased(reference::build_k2q(p, k2q_over_q2k), "k2q", "q2k");
  index_lists offset_over_counts = idx;
  offset_over_counts.k2q_offset = idx.q2k_count;
  expect_aliased(reference::build_k2q(p, offset_over_counts), "k2q_offset", "q2k_count");
  index_lists offset_over_k2q = idx;
  offset_over_k2q.k2q_offset = idx.k2q + 2;
  expect_aliased(reference::build_k2q(p, offset_over_k2q), "k2q", "k2q_offset");
  CHECK(w.snapshot() == before);
  // Disjoint arguments still work.
  CHECK(reference::block_means(p, w.q.cview(), w.k.cview(), w.v.cview(), w.q_c.data(), w.k_c.data(), w.v_c.data(),
                               w.dq_c.data(), w.dk_c.data())
            .is_ok());
  CHECK(reference::build_k2q(p, idx).is_ok());
}

TEST_CASE("the coarse pass rejects an output over another argument, by name", "[cpu][errors]") {
  VSA_TEST_RNG(g, "errors coarse aliasing");
  const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, dtype::fp16);
  world w(p, g);
  const float scale = 0.5f;
  // One residual byte an element of o_c.
  std::vector<int8_t> residual(w.o_c.bytes.size() / dtype_size(p.type), 0);
  const std::vector<unsigned char> before = w.snapshot();
  const std::vector<int8_t> residual_before = residual;
  // Each overlap lies inside the larger buffer's own allocation, so that no neighbour in memory meets it first.
  // coarse_scores (the fp32 means in dq_c and dk_c, which have their size): the scores over either mean.
  expect_aliased(reference::coarse_scores(p, scale, w.dq_c.data(), w.dk_c.data(), w.dq_c.data()), "scores", "q_c");
  expect_aliased(reference::coarse_scores(p, scale, w.dq_c.data(), w.scores.data() + 5, w.scores.data()), "scores",
                 "k_c");
  // coarse_attention: v_c inside o_c, lse_c inside o_c, lse_c inside the residual.
  float* inside_o_c = reinterpret_cast<float*>(w.o_c.data());
  expect_aliased(reference::coarse_attention(p, w.scores.data(), w.o_c.data(), w.o_c.data(), nullptr, w.lse_c.data()),
                 "o_c", "v_c");
  expect_aliased(reference::coarse_attention(p, w.scores.data(), w.v_c.data(), w.o_c.data(), nullptr, inside_o_c),
                 "o_c", "lse_c");
  expect_aliased(reference::coarse_attention(p, w.scores.data(), w.v_c.data(), w.o_c.data(), residual.data(),
                                             reinterpret_cast<float*>(residual.data())),
                 "o_c_residual", "lse_c");
  // coarse_attention_backward: d_o_c inside dq_c, dv_c over dk_c, the residual it reads inside dq_c.
  const auto backward_with = [&](const int8_t* o_c_residual, const void* d_o_c, float* dk_c, float* dv_c) {
    return reference::coarse_attention_backward(p, scale, w.q_c.data(), w.k_c.data(), w.v_c.data(), w.scores.data(),
                                                w.o_c.data(), o_c_residual, d_o_c, w.lse_c.data(), w.dq_c.data(), dk_c,
                                                dv_c);
  };
  expect_aliased(backward_with(nullptr, w.dq_c.data(), w.dk_c.data(), w.dv_c.data()), "dq_c", "d_o_c");
  expect_aliased(backward_with(nullptr, w.d_o_c.data(), w.dk_c.data(), w.dk_c.data()), "dk_c", "dv_c");
  expect_aliased(
      backward_with(reinterpret_cast<const int8_t*>(w.dq_c.data() + 3), w.d_o_c.data(), w.dk_c.data(), w.dv_c.data()),
      "dq_c", "o_c_residual");
  CHECK(w.snapshot() == before);
  CHECK(residual == residual_before);

  // Disjoint arguments still work, the pass in order: the means, the scores from their fp32 copies, the forward
  // with its residual, the backward from it.
  w.d_o_c.fill_normal(g);
  REQUIRE(reference::block_means(p, w.q.cview(), w.k.cview(), w.v.cview(), w.q_c.data(), w.k_c.data(), w.v_c.data(),
                                 w.dq_c.data(), w.dk_c.data())
              .is_ok());
  CHECK(reference::coarse_scores(p, scale, w.dq_c.data(), w.dk_c.data(), w.scores.data()).is_ok());
  CHECK(reference::coarse_attention(p, w.scores.data(), w.v_c.data(), w.o_c.data(), residual.data(), w.lse_c.data())
            .is_ok());
  CHECK(backward_with(residual.data(), w.d_o_c.data(), w.dk_c.data(), w.dv_c.data()).is_ok());
  CHECK(std::all_of(w.dv_c.begin(), w.dv_c.end(), [](float x) { return std::isfinite(x); }));
}

TEST_CASE("the linear branch rejects an output over another argument, by name", "[cpu][errors]") {
  VSA_TEST_RNG(g, "errors linear aliasing");
  const problem p = make_problem({5, 6, 7}, 2, 4, 2, 8, dtype::fp16);
  world w(p, g);
  const feature_map phi = feature_map::elu1;
  const float eps = 1e-3f;
  const auto forward_with = [&](const_tensor q, const_tensor k, const_tensor v, tensor o_l) {
    return reference::linear_attention_forward(p, phi, eps, token_order::tiled, q, k, v, o_l);
  };
  const auto backward_with = [&](const_tensor q, const_tensor v, const_tensor d_o, tensor dq, tensor dk, tensor dv) {
    return reference::linear_attention_backward(p, phi, eps, token_order::tiled, q, w.k.cview(), v, d_o, dq, dk, dv);
  };
  // A view of t's strides `elements` elements into base.
  const auto at = [&](tensor t, void* base, int64_t elements) {
    t.data = static_cast<char*>(base) + elements * static_cast<int64_t>(dtype_size(p.type));
    return t;
  };
  const std::vector<unsigned char> before = w.snapshot();
  // Each overlap lies inside the larger buffer's own allocation: o holds twice a kv tensor's elements, so a kv view
  // fits in it one token row on.
  const int64_t q_row = w.o.token_stride(), kv_row = w.dk.token_stride();
  // linear_attention_forward: o_l over q, k inside o_l, v inside o_l one token row on (a partial overlap).
  expect_aliased(forward_with(w.q.cview(), w.k.cview(), w.v.cview(), at(w.o.view(), w.q.data(), 0)), "o_l", "q");
  expect_aliased(forward_with(w.q.cview(), as_const(at(w.dk.view(), w.o.data(), 0)), w.v.cview(), w.o.view()), "o_l",
                 "k");
  expect_aliased(forward_with(w.q.cview(), w.k.cview(), as_const(at(w.dv.view(), w.o.data(), q_row)), w.o.view()),
                 "o_l", "v");
  // linear_attention_backward: dq over d_o, q inside dq, dk over v, dv over dk, and dk and dv one token row apart in
  // one buffer (a partial overlap of views of the same strides).
  expect_aliased(backward_with(w.q.cview(), w.v.cview(), w.d_o.cview(), at(w.dq.view(), w.d_o.data(), 0), w.dk.view(),
                               w.dv.view()),
                 "dq", "d_o");
  expect_aliased(backward_with(w.dq.cview(), w.v.cview(), w.d_o.cview(), w.dq.view(), w.dk.view(), w.dv.view()), "dq",
                 "q");
  expect_aliased(
      backward_with(w.q.cview(), w.v.cview(), w.d_o.cview(), w.dq.view(), at(w.dk.view(), w.v.data(), 0), w.dv.view()),
      "dk", "v");
  expect_aliased(backward_with(w.q.cview(), w.v.cview(), w.d_o.cview(), w.dq.view(), w.dk.view(), w.dk.view()), "dk",
                 "dv");
  expect_aliased(backward_with(w.q.cview(), w.v.cview(), w.d_o.cview(), w.dq.view(), at(w.dk.view(), w.o.data(), 0),
                               at(w.dv.view(), w.o.data(), kv_row)),
                 "dk", "dv");
  CHECK(w.snapshot() == before);

  // The GPU calls' state and workspace, which no reference call takes: the checks those calls run, on host buffers.
  test::aligned_buffer state(4096), scratch(4096);
  char* const state_at = static_cast<char*>(state.data());
  const auto forward_check = [&](const void* kept, const void* workspace) {
    return check_linear_forward_disjoint(p, w.q.cview(), w.k.cview(), w.v.cview(), w.o.view(), kept, state.size(),
                                         workspace, scratch.size());
  };
  expect_aliased(forward_check(w.o.data(), scratch.data()), "o_l", "state");
  expect_aliased(forward_check(state_at, state_at + 256), "state", "workspace");
  expect_aliased(forward_check(state_at, w.k.data()), "workspace", "k");
  CHECK(forward_check(state_at, scratch.data()).is_ok());
  CHECK(forward_check(nullptr, scratch.data()).is_ok()); // no state kept
  // The backward reads the state: an output over it is rejected, as over any input.
  const auto backward_check = [&](const void* kept, tensor dv, const void* workspace) {
    return check_linear_backward_disjoint(p, w.q.cview(), w.k.cview(), w.v.cview(), w.d_o.cview(), kept, state.size(),
                                          w.dq.view(), w.dk.view(), dv, workspace, scratch.size());
  };
  expect_aliased(backward_check(w.dq.data(), w.dv.view(), scratch.data()), "dq", "state");
  expect_aliased(backward_check(state_at, at(w.dv.view(), scratch.data(), 0), scratch.data()), "dv", "workspace");
  expect_aliased(backward_check(state_at, w.dv.view(), w.d_o.data()), "workspace", "d_o");
  expect_aliased(backward_check(state_at, w.dv.view(), state_at + 256), "workspace", "state");
  CHECK(backward_check(state_at, w.dv.view(), scratch.data()).is_ok());
  CHECK(backward_check(nullptr, w.dv.view(), scratch.data()).is_ok()); // the state recomputed

  // Disjoint arguments still work, and views interleaved in one buffer give what separate tensors give: q and o_l
  // as the two halves of each token row of one [B, S, 2·Hq, D] buffer, dk and dv of one [B, S, 2·Hkv, D].
  REQUIRE(forward_with(w.q.cview(), w.k.cview(), w.v.cview(), w.o.view()).is_ok());
  REQUIRE(backward_with(w.q.cview(), w.v.cview(), w.d_o.cview(), w.dq.view(), w.dk.view(), w.dv.view()).is_ok());
  const int64_t hq = p.q_heads, hk = p.kv_heads, d = p.head_dim;
  host_tensor qo(p.type, p.batch, w.slots, 2 * hq, d), grads(p.type, p.batch, w.slots, 2 * hk, d),
      dq(p.type, p.batch, w.slots, hq, d);
  for (host_tensor* t : {&qo, &grads, &dq}) t->fill_byte(test::poison_byte);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t s = 0; s < w.slots; ++s)
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t c = 0; c < d; ++c) qo.set(b, s, h, c, w.q.get(b, s, h, c));
  const const_tensor packed_q = qo.cview();
  REQUIRE(forward_with(packed_q, w.k.cview(), w.v.cview(), at(qo.view(), qo.data(), hq * d)).is_ok());
  REQUIRE(backward_with(packed_q, w.v.cview(), w.d_o.cview(), dq.view(), grads.view(),
                        at(grads.view(), grads.data(), hk * d))
              .is_ok());
  // The heads h0.. h0 + heads - 1 of t, in order.
  const auto heads_of = [&](const host_tensor& t, int64_t h0, int64_t heads) {
    std::vector<double> r;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t s = 0; s < w.slots; ++s)
        for (int64_t h = h0; h < h0 + heads; ++h)
          for (int64_t c = 0; c < d; ++c) r.push_back(t.get(b, s, h, c));
    return r;
  };
  CHECK(heads_of(qo, 0, hq) == heads_of(w.q, 0, hq));
  CHECK(heads_of(qo, hq, hq) == heads_of(w.o, 0, hq));
  CHECK(dq.bytes == w.dq.bytes);
  CHECK(heads_of(grads, 0, hk) == heads_of(w.dk, 0, hk));
  CHECK(heads_of(grads, hk, hk) == heads_of(w.dv, 0, hk));
}

// A packed batch's descriptor (packed_problem): the checks the GPU entry points run first, on the host.
TEST_CASE("a packed batch's descriptor is rejected by name, and stands for one problem of its tiles", "[cpu][errors]") {
  const grid3 grids[] = {{5, 6, 7}, {8, 8, 8}, {1, 1, 1}};
  packed_problem pp;
  pp.q_heads = 4;
  pp.kv_heads = 2;
  pp.head_dim = 64;
  pp.grids = grids;
  pp.samples = 3;
  problem whole;
  REQUIRE(check_packed_problem(pp, target::gpu, whole).is_ok());
  const int64_t tiles = tile_geometry(grids[0]).num_tiles() + tile_geometry(grids[1]).num_tiles() + 1;
  CHECK(tile_geometry(whole.grid).num_tiles() == tiles);
  CHECK(tile_geometry(whole.grid).tiled_tokens() == tiles * 64);
  CHECK(whole.batch == 1);
  CHECK(whole.q_heads == 4);
  CHECK(whole.kv_heads == 2);

  packed_problem x = pp;
  x.samples = 0;
  CHECK(check_packed_problem(x, target::gpu, whole).code() == errc::bad_batch);
  x = pp;
  x.grids = nullptr;
  CHECK(check_packed_problem(x, target::gpu, whole).code() == errc::null_pointer);
  const grid3 bad[] = {{5, 6, 7}, {8, 0, 8}};
  x = pp;
  x.grids = bad;
  x.samples = 2;
  const status s = check_packed_problem(x, target::gpu, whole);
  CHECK(s.code() == errc::bad_grid);
  CHECK(test::mentions(s, "grids[1]"));
  const grid3 huge[] = {{5, 6, 7}, {int64_t(1) << 12, int64_t(1) << 12, int64_t(1) << 10}};
  x.grids = huge;
  CHECK(check_packed_problem(x, target::gpu, whole).code() == errc::unsupported);
  const grid3 vast[] = {{1, 1, int64_t(1) << 60}, {1, 1, 4}}; // 2^58 tiles: the running count must not overflow
  x.grids = vast;
  CHECK(check_packed_problem(x, target::gpu, whole).code() == errc::unsupported);
  x = pp;
  x.kv_heads = 3;
  CHECK(check_packed_problem(x, target::gpu, whole).code() == errc::bad_heads);
  x = pp;
  x.head_dim = 96;
  CHECK(check_packed_problem(x, target::gpu, whole).code() == errc::bad_head_dim);
}
