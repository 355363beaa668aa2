// Sparse attention (stage 6) forward and backward, and the whole op, on the anchor shapes at 90% sparsity.
// TFLOP/s and `work` are counted as attention_inputs.hpp says.
#include "attention_inputs.hpp"

#include <vsa/gpu/joint_attention.hpp>

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

// The whole op with `count` extra tokens after the video (joint_forward, joint_backward).
void joint_op(benchmark::State& state, const shape& s, int64_t count, bool backward_pass) {
  inputs& in = kept<inputs>(std::string(s.name) + "/E" + std::to_string(count), s, count);
  time_op(state, in, options{}, backward_pass, false, extra_tokens{count, false});
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
  return true;
}();

} // namespace
} // namespace bench
} // namespace vsa

BENCHMARK_MAIN();
