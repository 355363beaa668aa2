// Sparse attention (stage 6) forward and backward, and the whole op, on the anchor shapes at 90% sparsity.
// TFLOP/s and `work` are counted as attention_inputs.hpp says.
#include "attention_inputs.hpp"

#include <vsa/gpu/joint_attention.hpp>
#include <vsa/gpu/packed_attention.hpp>
#include <vsa/gpu/packed_op.hpp>

#include <string>

namespace vsa {
namespace bench {
namespace {

// The lists the whole op would select from the inputs themselves (block means, coarse scores, top-k, k2q,
// through the library's GPU stages). On random normal inputs that selection is skewed: a few key tiles are
// chosen by most query tiles. The sparse kernels are timed on both kinds of lists, so that what the op adds
// to them can be told apart from how they run on its lists.
device_lists data_lists(const inputs& in) {
  const problem& p = in.p;
  const int64_t n = tile_geometry(p.grid).num_tiles(), rows = p.batch * p.q_heads * n, d = p.head_dim;
  const float scale = 1.f / std::sqrt(float(d));
  buffer q_c(p.batch * p.q_heads * n * d * 2), k_c(p.batch * p.kv_heads * n * d * 2),
      v_c(p.batch * p.kv_heads * n * d * 2), o_c(p.batch * p.q_heads * n * d * 2), lse_c(rows * 4),
      scores(rows * n * 4), q_c32(p.batch * p.q_heads * n * d * 4), k_c32(p.batch * p.kv_heads * n * d * 4);
  check(block_means(p, as_const(in.view(in.q, p.q_heads)), as_const(in.view(in.kk, p.kv_heads)),
                    as_const(in.view(in.v, p.kv_heads)), q_c.get(), k_c.get(), v_c.get(), q_c32.get<float>(),
                    k_c32.get<float>(), nullptr),
        "block_means");
  check(coarse_scores(p, scale, q_c32.get<float>(), k_c32.get<float>(), scores.get<float>(), nullptr), "coarse_scores");
  check(coarse_attention(p, scores.get<float>(), v_c.get(), o_c.get(), nullptr, lse_c.get<float>(), nullptr),
        "coarse_attention");
  device_lists l{buffer(rows * in.k * 4), buffer(rows * 4), buffer(rows * in.k * 4),
                 buffer(p.batch * p.q_heads * (n + 1) * 4)};
  std::size_t select_bytes = 0, index_bytes = 0;
  check(select_top_k(p, in.k, nullptr, l.view(in.k), nullptr, select_bytes, nullptr), "select workspace");
  check(build_k2q(p, l.view(in.k), nullptr, index_bytes, nullptr), "k2q workspace");
  buffer select_ws(select_bytes), index_ws(index_bytes);
  check(select_top_k(p, in.k, scores.get<float>(), l.view(in.k), select_ws.get(), select_bytes, nullptr),
        "select_top_k");
  check(build_k2q(p, l.view(in.k), index_ws.get(), index_bytes, nullptr), "build_k2q");
  check(device_sync(), "selection"); // before the scratch buffers are freed
  return l;
}

// data_lists as a type kept<> can make from its arguments.
struct selected_lists : device_lists {
  explicit selected_lists(const inputs& in) : device_lists(data_lists(in)) {}
};

const device_lists& lists_of(const shape& s, bool from_data) {
  const inputs& in = inputs_of(s);
  return from_data ? kept<selected_lists>(s.name, in) : uniform_lists_of(s, in.k);
}

void sparse_forward(benchmark::State& state, const shape& s, bool from_data) {
  inputs& in = inputs_of(s);
  time_sparse_forward(state, in, lists_of(s, from_data), in.k);
}

void sparse_backward(benchmark::State& state, const shape& s, bool from_data) {
  inputs& in = inputs_of(s);
  time_sparse_backward(state, in, lists_of(s, from_data), in.k);
}

// In the least workspace, where dq recomputes dS instead of reading what dk/dv stored.
void sparse_backward_recompute(benchmark::State& state, const shape& s) {
  inputs& in = inputs_of(s);
  time_sparse_backward(state, in, lists_of(s, false), in.k, true);
}

// The joint pass (joint_attention.hpp) with `count` extra tokens after the video, on the uniform lists of the video
// tiles (k a row), forward or backward (after one forward): inputs of its own, N·64 + count tokens. TFLOP/s over the
// computed blocks, as for the video-only pass: N·(k + X) + X·(N + X) block pairs a head, X = ⌈count/64⌉.
void joint_pass(benchmark::State& state, const shape& s, int64_t count, bool backward_pass) {
  inputs& in = kept<inputs>(std::string(s.name) + "/E" + std::to_string(count), s, count);
  const problem& p = in.p;
  const extra_tokens extra{count, false};
  const device_lists& lists = uniform_lists_of(s, in.k);
  const const_index_lists idx = as_const(lists.view(in.k));
  const float scale = 1.f / std::sqrt(float(p.head_dim));
  const auto q = as_const(in.view(in.q, p.q_heads)), k = as_const(in.view(in.kk, p.kv_heads)),
             v = as_const(in.view(in.v, p.kv_heads));
  buffer lse(p.batch * p.q_heads * in.tokens * 4);
  const std::size_t fbytes = joint_sparse_attention_forward_workspace(p, extra);
  buffer fws(fbytes > 0 ? fbytes : 1);
  const auto forward_call = [&] {
    check(joint_sparse_attention_forward(p, extra, scale, q, k, v, idx, in.view(in.o, p.q_heads), lse.get<float>(),
                                         fws.get(), fbytes, nullptr),
          "joint forward");
  };
  if (!backward_pass) {
    time_on_stream(state, nullptr, forward_call);
  } else {
    forward_call();
    std::size_t bbytes = 0;
    check(joint_sparse_attention_backward(p, extra, scale, q, k, v, q, q, nullptr, idx, {}, {}, {}, nullptr, bbytes,
                                          nullptr),
          "joint workspace size");
    buffer ws(bbytes);
    time_on_stream(state, nullptr, [&] {
      check(joint_sparse_attention_backward(p, extra, scale, q, k, v, as_const(in.view(in.o, p.q_heads)),
                                            as_const(in.view(in.d_o, p.q_heads)), lse.get<float>(), idx,
                                            in.view(in.dq, p.q_heads), in.view(in.dk, p.kv_heads),
                                            in.view(in.dv, p.kv_heads), ws.get(), bbytes, nullptr),
            "joint backward");
    });
  }
  const double n = double(tile_geometry(p.grid).num_tiles()), x = double((count + 63) / 64);
  const double pairs = n * (double(in.k) + x) + x * (n + x);
  const double flops = 4.0 * p.batch * p.q_heads * pairs * 64.0 * 64.0 * p.head_dim * (backward_pass ? 2.5 : 1.0);
  state.counters["pairs"] = pairs / (n * double(in.k)); // against the video-only pass's
  state.counters["TFLOP/s"] = benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
}

void op_forward_backward(benchmark::State& state, const shape& s, bool backward_pass, bool host) {
  time_op(state, inputs_of(s), options{}, backward_pass, host);
}

// The same with o and the gradients in raster order (options::output_order): the epilogues place each row at its token.
void op_raster(benchmark::State& state, const shape& s, bool backward_pass) {
  options opt;
  opt.output_order = token_order::raster;
  time_op(state, inputs_of(s), opt, backward_pass, false);
}

// A layer's attention as a model in raster order calls it, with a gate, o and the gradients in raster order (the op's
// output_order), forward or backward. How its inputs come to be tiled: `fused`, the op tiles them itself
// (options::input_order raster: the block means write the tiled q, k, v and gate, the combine's backward the tiled
// d_o); `passes`, tile passes run before each call on tiled inputs (four before the forward, d_o's before the
// backward); `untimed`, the same passes run once before the timing (the op on tiled inputs alone, the reference the
// other two are measured against). The forward's tiled copies are kept for the backward (the binding's keep_tiled).
enum class input_tiling { untimed, passes, fused };
void op_raster_inputs(benchmark::State& state, const shape& s, bool backward_pass, input_tiling how) {
  const bool fused = how == input_tiling::fused;
  inputs& in = inputs_of(s);
  const problem& p = in.p;
  const int64_t raster = tile_geometry(p.grid).raster_tokens(), n = p.batch * in.tokens * p.q_heads * p.head_dim;
  const buffer gate = random_elements(n, p.type, 5);
  buffer tq(n * 2), tk(n * 2), tv(n * 2), tg(n * 2), tdo(n * 2), dgate(n * 2);
  options opt;
  opt.output_order = token_order::raster;
  if (fused) opt.input_order = token_order::raster;
  const auto rows = [&](const buffer& b, int64_t heads) { return as_const(in.view(b, heads, raster)); };
  const auto tiled = [&](const buffer& b, int64_t heads) { return in.view(b, heads); };
  const tiled_inputs copies{tiled(tq, p.q_heads), tiled(tk, p.kv_heads), tiled(tv, p.kv_heads), tiled(tg, p.q_heads)};
  forward_io fio{rows(in.q, p.q_heads), rows(in.kk, p.kv_heads), rows(in.v, p.kv_heads), rows(gate, p.q_heads),
                 in.view(in.o, p.q_heads, raster)};
  if (fused) fio.tiled = copies;
  const forward_io tiled_fio{as_const(copies.q), as_const(copies.k), as_const(copies.v), as_const(copies.gate), fio.o};
  const backward_io bio{as_const(copies.q),
                        as_const(copies.k),
                        as_const(copies.v),
                        as_const(copies.gate),
                        as_const(fio.o),
                        fused ? rows(in.d_o, p.q_heads) : as_const(tiled(tdo, p.q_heads)),
                        in.view(in.dq, p.q_heads, raster),
                        in.view(in.dk, p.kv_heads, raster),
                        in.view(in.dv, p.kv_heads, raster),
                        in.view(dgate, p.q_heads, raster)};
  std::size_t fbytes = 0, bbytes = 0;
  check(forward(p, opt, fio, nullptr, fbytes, nullptr), "forward workspace size");
  check(backward(p, opt, bio, nullptr, bbytes, nullptr), "backward workspace size");
  buffer ws(std::max(fbytes, bbytes));
  const auto tile_inputs = [&] {
    check(tile(p, p.q_heads, fio.q, copies.q, nullptr), "tile q");
    check(tile(p, p.kv_heads, fio.k, copies.k, nullptr), "tile k");
    check(tile(p, p.kv_heads, fio.v, copies.v, nullptr), "tile v");
    check(tile(p, p.q_heads, fio.gate, copies.gate, nullptr), "tile gate");
  };
  const auto tile_d_o = [&] {
    check(tile(p, p.q_heads, rows(in.d_o, p.q_heads), tiled(tdo, p.q_heads), nullptr), "tile d_o");
  };
  const auto run_forward = [&] {
    if (fused) {
      check(forward(p, opt, fio, ws.get(), fbytes, nullptr), "op forward");
      return;
    }
    if (how == input_tiling::passes) tile_inputs();
    check(forward(p, opt, tiled_fio, ws.get(), fbytes, nullptr), "op forward");
  };
  const auto run_backward = [&] {
    if (how == input_tiling::passes) tile_d_o();
    check(backward(p, opt, bio, ws.get(), bbytes, nullptr), "op backward");
  };
  if (how == input_tiling::untimed) {
    tile_inputs();
    tile_d_o();
  }
  if (backward_pass) run_forward();
  backward_pass ? time_on_stream(state, nullptr, run_backward) : time_on_stream(state, nullptr, run_forward);
}

// The whole op with `count` extra tokens after the video (joint_forward, joint_backward).
void joint_op(benchmark::State& state, const shape& s, int64_t count, bool backward_pass) {
  inputs& in = kept<inputs>(std::string(s.name) + "/E" + std::to_string(count), s, count);
  time_op(state, in, options{}, backward_pass, false, extra_tokens{count, false});
}

// A packed batch (packed_problem): samples of different grids, 12 heads, D = 128, bf16, each with uniform lists of
// k_s = ⌈0.1·N_s⌉ key tiles a row (its own seed); the batch's lists are the samples' in the batch's tile numbering.
struct packed_batch {
  std::vector<grid3> grids;
  packed_problem pp;
  problem whole;
  std::vector<problem> own;        // each sample as a problem of its own
  std::vector<device_lists> lists; // each sample's, k2q included
  std::vector<int64_t> first, k;   // each sample's first tile and list length
  device_lists packed;             // the batch's q2k lists (k2q built by the backward)
  int64_t capacity = 0, tiles = 0;
  buffer q, kk, v, o, d_o, dq, dk, dv, lse;
  explicit packed_batch(std::vector<grid3> g) : grids(std::move(g)) {
    pp.q_heads = pp.kv_heads = 12;
    pp.head_dim = 128;
    pp.grids = grids.data();
    pp.samples = static_cast<int64_t>(grids.size());
    check(check_packed_problem(pp, target::gpu, whole), "packed problem");
    std::vector<int32_t> q2k, count;
    for (std::size_t s = 0; s < grids.size(); ++s) {
      problem p = whole;
      p.grid = grids[s];
      own.push_back(p);
      const int64_t n = tile_geometry(p.grid).num_tiles();
      first.push_back(tiles);
      k.push_back(resolve_top_k(n, options{}));
      capacity = std::max(capacity, k.back());
      lists.push_back(random_lists(p, k.back(), 7 + s));
      tiles += n;
    }
    q2k.assign(12 * tiles * capacity, -1);
    count.assign(12 * tiles, 0);
    for (std::size_t s = 0; s < grids.size(); ++s) {
      const int64_t n = tile_geometry(grids[s]).num_tiles(), rows = 12 * n;
      std::vector<int32_t> own_q2k(rows * k[s]);
      check(copy_to_host(own_q2k.data(), lists[s].q2k.get(), own_q2k.size() * 4), "download");
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t to = (r / n) * tiles + first[s] + r % n;
        count[to] = static_cast<int32_t>(k[s]);
        for (int64_t e = 0; e < k[s]; ++e)
          q2k[to * capacity + e] = own_q2k[r * k[s] + e] + static_cast<int32_t>(first[s]);
      }
    }
    packed = device_lists{buffer(q2k.size() * 4), buffer(count.size() * 4), buffer(4), buffer(4)};
    check(copy_to_device(packed.q2k.get(), q2k.data(), q2k.size() * 4), "upload");
    check(copy_to_device(packed.count.get(), count.data(), count.size() * 4), "upload");
    const int64_t n = tiles * 64 * 12 * 128;
    q = random_elements(n, dtype::bf16, 1);
    kk = random_elements(n, dtype::bf16, 2);
    v = random_elements(n, dtype::bf16, 3);
    d_o = random_elements(n, dtype::bf16, 4);
    o = buffer(n * 2), dq = buffer(n * 2), dk = buffer(n * 2), dv = buffer(n * 2), lse = buffer(12 * tiles * 64 * 4);
  }
  // A view of buffer b: the whole batch, or sample s's slots.
  tensor view(const buffer& b, int64_t s = -1) const {
    const int64_t from = s < 0 ? 0 : first[s] * 64,
                  slots = s < 0 ? tiles * 64 : (tile_geometry(grids[s]).num_tiles() * 64);
    tensor t = bshd(b.get(), 1, slots, 12, 128);
    t.data = static_cast<unsigned char*>(t.data) + from * 12 * 128 * 2;
    return t;
  }
  double flops() const {
    double f = 0.0;
    for (std::size_t s = 0; s < grids.size(); ++s) f += forward_flops(own[s], k[s]);
    return f;
  }
};

// One packed call for the whole batch, or (`packed` false) each sample's own call one after another on the same
// stream, as an engine without packed batches runs them (each backward after its sample's build_k2q, as the packed
// backward builds its lists inside the call); forward, or backward after one forward.
void packed_pass(benchmark::State& state, const char* name, const std::vector<grid3>& grids, bool packed,
                 bool backward_pass) {
  packed_batch& b = kept<packed_batch>(std::string("packed/") + name, grids);
  const float scale = 1.f / std::sqrt(128.f);
  std::size_t fbytes = packed_sparse_attention_forward_workspace(b.pp), bbytes = 0;
  check(packed_sparse_attention_backward(b.pp, scale, {}, {}, {}, {}, {}, nullptr, as_const(b.packed.view(b.capacity)),
                                         {}, {}, {}, nullptr, bbytes, nullptr),
        "packed workspace size");
  // Each sample's own backward builds its k2q lists first, as the packed one does inside its call.
  std::size_t kbytes = 0;
  for (std::size_t s = 0; s < b.grids.size(); ++s) {
    bbytes = std::max(bbytes, sparse_attention_backward_workspace(b.own[s], b.k[s]));
    std::size_t x = 0;
    check(build_k2q(b.own[s], b.lists[s].view(b.k[s]), nullptr, x, nullptr), "k2q workspace size");
    kbytes = std::max(kbytes, x);
  }
  buffer ws(std::max(fbytes, bbytes)), k2q_ws(kbytes);
  // lse of sample s: its rows of every head (the batch's lse is [H, N·64]; a sample's own call writes [H, N_s·64]).
  buffer own_lse(12 * b.tiles * 64 * 4);
  const auto forward = [&] {
    if (packed) {
      check(packed_sparse_attention_forward(b.pp, scale, as_const(b.view(b.q)), as_const(b.view(b.kk)),
                                            as_const(b.view(b.v)), as_const(b.packed.view(b.capacity)), b.view(b.o),
                                            b.lse.get<float>(), ws.get(), fbytes, nullptr),
            "packed forward");
      return;
    }
    for (std::size_t s = 0; s < b.grids.size(); ++s)
      check(sparse_attention_forward(b.own[s], scale, as_const(b.view(b.q, s)), as_const(b.view(b.kk, s)),
                                     as_const(b.view(b.v, s)), as_const(b.lists[s].view(b.k[s])), b.view(b.o, s),
                                     own_lse.get<float>() + 12 * b.first[s] * 64, nullptr),
            "sample forward");
  };
  const auto backward = [&] {
    if (packed) {
      std::size_t given = bbytes;
      check(packed_sparse_attention_backward(b.pp, scale, as_const(b.view(b.q)), as_const(b.view(b.kk)),
                                             as_const(b.view(b.v)), as_const(b.view(b.o)), as_const(b.view(b.d_o)),
                                             b.lse.get<float>(), as_const(b.packed.view(b.capacity)), b.view(b.dq),
                                             b.view(b.dk), b.view(b.dv), ws.get(), given, nullptr),
            "packed backward");
      return;
    }
    for (std::size_t s = 0; s < b.grids.size(); ++s) {
      std::size_t given = bbytes, k2q_given = kbytes;
      check(build_k2q(b.own[s], b.lists[s].view(b.k[s]), k2q_ws.get(), k2q_given, nullptr), "sample k2q");
      check(sparse_attention_backward(b.own[s], scale, as_const(b.view(b.q, s)), as_const(b.view(b.kk, s)),
                                      as_const(b.view(b.v, s)), as_const(b.view(b.o, s)), as_const(b.view(b.d_o, s)),
                                      own_lse.get<float>() + 12 * b.first[s] * 64, as_const(b.lists[s].view(b.k[s])),
                                      b.view(b.dq, s), b.view(b.dk, s), b.view(b.dv, s), ws.get(), given, nullptr),
            "sample backward");
    }
  };
  if (backward_pass) {
    forward();
    time_on_stream(state, nullptr, backward);
  } else {
    time_on_stream(state, nullptr, forward);
  }
  state.counters["tiles"] = double(b.tiles);
  state.counters["TFLOP/s"] = benchmark::Counter(b.flops() * (backward_pass ? 2.5 : 1.0) * 1e-12,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// The whole op's forward (block means, coarse pass, selection at 90% sparsity, the sparse pass with the combine
// epilogue) over the batch in one call, or (`packed` false) each sample's own forward() in turn, on the same tensors.
void packed_op_forward(benchmark::State& state, const char* name, const std::vector<grid3>& grids, bool packed) {
  packed_batch& b = kept<packed_batch>(std::string("packed/") + name, grids);
  const options opt{};
  const auto io = [&](int64_t s) {
    return forward_io{
        as_const(b.view(b.q, s)), as_const(b.view(b.kk, s)), as_const(b.view(b.v, s)), {}, b.view(b.o, s)};
  };
  std::size_t bytes = 0;
  check(packed_forward(b.pp, opt, forward_io{}, nullptr, bytes, nullptr), "packed op workspace size");
  for (const problem& p : b.own) {
    std::size_t x = 0;
    check(forward(p, opt, forward_io{}, nullptr, x, nullptr), "op workspace size");
    bytes = std::max(bytes, x);
  }
  buffer ws(bytes);
  time_on_stream(state, nullptr, [&] {
    if (packed) {
      std::size_t given = bytes;
      check(packed_forward(b.pp, opt, io(-1), ws.get(), given, nullptr), "packed op forward");
      return;
    }
    for (std::size_t s = 0; s < b.grids.size(); ++s) {
      std::size_t given = bytes;
      check(forward(b.own[s], opt, io(static_cast<int64_t>(s)), ws.get(), given, nullptr), "sample op forward");
    }
  });
  state.counters["tiles"] = double(b.tiles);
}

// The whole op's backward over the batch in one call, or (`packed` false) each sample's own backward() in turn, after
// one forward of the same kind (each sample's state in a workspace of its own).
void packed_op_backward(benchmark::State& state, const char* name, const std::vector<grid3>& grids, bool packed) {
  packed_batch& b = kept<packed_batch>(std::string("packed/") + name, grids);
  const options opt{};
  const auto in = [&](const buffer& x, int64_t s) { return as_const(b.view(x, s)); };
  const std::size_t calls = packed ? 1 : b.grids.size();
  std::vector<buffer> ws;
  std::vector<std::size_t> bytes(calls);
  for (std::size_t c = 0; c < calls; ++c) {
    const int64_t s = packed ? -1 : static_cast<int64_t>(c);
    const forward_io f{in(b.q, s), in(b.kk, s), in(b.v, s), {}, b.view(b.o, s)};
    if (packed) {
      check(packed_backward(b.pp, opt, backward_io{}, nullptr, bytes[c], nullptr), "packed op workspace size");
      ws.emplace_back(bytes[c]);
      check(packed_forward(b.pp, opt, f, ws.back().get(), bytes[c], nullptr), "packed op forward");
    } else {
      check(backward(b.own[c], opt, backward_io{}, nullptr, bytes[c], nullptr), "op workspace size");
      ws.emplace_back(bytes[c]);
      check(forward(b.own[c], opt, f, ws.back().get(), bytes[c], nullptr), "sample op forward");
    }
  }
  time_on_stream(state, nullptr, [&] {
    for (std::size_t c = 0; c < calls; ++c) {
      const int64_t s = packed ? -1 : static_cast<int64_t>(c);
      const backward_io io{in(b.q, s),      in(b.kk, s),     in(b.v, s),      {}, in(b.o, s), in(b.d_o, s),
                           b.view(b.dq, s), b.view(b.dk, s), b.view(b.dv, s), {}};
      std::size_t given = bytes[c];
      if (packed)
        check(packed_backward(b.pp, opt, io, ws[c].get(), given, nullptr), "packed op backward");
      else
        check(backward(b.own[c], opt, io, ws[c].get(), given, nullptr), "sample op backward");
    }
  });
  state.counters["tiles"] = double(b.tiles);
}

// 480p-class clips of Wan 2.1 (landscape, portrait, square, shorter), and eight small ones that alone fill little of
// the GPU.
const std::vector<grid3>& batch_480p() {
  static const std::vector<grid3> g = {{21, 30, 52}, {21, 52, 30}, {21, 40, 40}, {13, 30, 52}};
  return g;
}
const std::vector<grid3>& batch_small() {
  static const std::vector<grid3> g = {{5, 16, 16}, {9, 12, 20}, {5, 20, 12}, {3, 16, 28},
                                       {7, 16, 16}, {5, 12, 12}, {9, 8, 16},  {5, 24, 16}};
  return g;
}

const bool registered = [] {
  benchmark::RegisterBenchmark("copy_bandwidth", copy_bandwidth)->UseManualTime()->Unit(benchmark::kMillisecond);
  for (const shape& s : anchors()) {
    const std::string n = s.name;
    // sparse_*: random lists; sparse_*_data: the lists the op selects from these inputs.
    for (const bool data : {false, true}) {
      const std::string tag = data ? "_data/" : "/";
      benchmark::RegisterBenchmark(("sparse_forward" + tag + n).c_str(), sparse_forward, s, data)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("sparse_backward" + tag + n).c_str(), sparse_backward, s, data)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
    benchmark::RegisterBenchmark(("sparse_backward_recompute/" + n).c_str(), sparse_backward_recompute, s)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    // The joint pass with 256 extra tokens (a text prompt) after the video.
    for (const bool backward_pass : {false, true})
      benchmark::RegisterBenchmark(((backward_pass ? "joint_backward/" : "joint_forward/") + n + "/E256").c_str(),
                                   joint_pass, s, int64_t{256}, backward_pass)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    for (const bool backward_pass : {false, true})
      benchmark::RegisterBenchmark(((backward_pass ? "joint_op_backward/" : "joint_op_forward/") + n + "/E256").c_str(),
                                   joint_op, s, int64_t{256}, backward_pass)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("op_forward/" + n).c_str(), op_forward_backward, s, false, false)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("op_backward/" + n).c_str(), op_forward_backward, s, true, false)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    for (const bool backward_pass : {false, true})
      benchmark::RegisterBenchmark(((backward_pass ? "op_backward_raster/" : "op_forward_raster/") + n).c_str(),
                                   op_raster, s, backward_pass)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    for (const bool backward_pass : {false, true})
      for (const auto how : {input_tiling::untimed, input_tiling::passes, input_tiling::fused})
        benchmark::RegisterBenchmark((std::string(backward_pass ? "op_backward_" : "op_forward_") +
                                      (how == input_tiling::untimed  ? "tiled_inputs/"
                                       : how == input_tiling::passes ? "tile_passes/"
                                                                     : "raster_inputs/") +
                                      n)
                                         .c_str(),
                                     op_raster_inputs, s, backward_pass, how)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
    // The host's cost of one call (the GPU kept busy), which a binding adds to.
    // (A few iterations: each waits for its calls' GPU work, a thousand times the time it measures.)
    benchmark::RegisterBenchmark(("op_forward_host/" + n).c_str(), op_forward_backward, s, false, true)
        ->UseManualTime()
        ->Iterations(5)
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("op_backward_host/" + n).c_str(), op_forward_backward, s, true, true)
        ->UseManualTime()
        ->Iterations(5)
        ->Unit(benchmark::kMicrosecond);
  }
  // Packed batches against their samples' own calls, the same lists and tensors.
  for (const bool backward_pass : {false, true})
    for (const bool packed : {true, false})
      for (const auto& batch : {std::make_pair("4x480p", &batch_480p()), std::make_pair("8xsmall", &batch_small())}) {
        const std::string n = std::string(backward_pass ? "packed_backward" : "packed_forward") +
                              (packed ? "/" : "_samples/") + batch.first;
        benchmark::RegisterBenchmark(n.c_str(), packed_pass, batch.first, *batch.second, packed, backward_pass)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
  for (const bool packed : {true, false})
    for (const auto& batch : {std::make_pair("4x480p", &batch_480p()), std::make_pair("8xsmall", &batch_small())})
      benchmark::RegisterBenchmark(
          ((packed ? "packed_op_forward/" : "packed_op_forward_samples/") + std::string(batch.first)).c_str(),
          packed_op_forward, batch.first, *batch.second, packed)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
  for (const bool packed : {true, false})
    for (const auto& batch : {std::make_pair("4x480p", &batch_480p()), std::make_pair("8xsmall", &batch_small())})
      benchmark::RegisterBenchmark(
          ((packed ? "packed_op_backward/" : "packed_op_backward_samples/") + std::string(batch.first)).c_str(),
          packed_op_backward, batch.first, *batch.second, packed)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
  return true;
}();

} // namespace
} // namespace bench
} // namespace vsa

BENCHMARK_MAIN();
