// The linear-attention branch, forward and backward, on the anchor shapes (tiled order, bf16), for the
// cheapest feature map (elu+1) and the costliest (softmax over the head dim).
//
// GB/s counts the bytes the op cannot avoid: q, k, v read and o_l written in the forward; q, k, v, dO read
// and dq, dk, dv written in the backward (all N·64 slots, as the tensors are laid out). copy_GB/s is a large
// device-to-device copy measured in the same run (bytes read + written), and of_copy the ratio of the two.
#include "common.hpp"

#include <vsa/gpu/linear_attention.hpp>

#include <algorithm>
#include <string>
#include <vector>

namespace vsa {
namespace bench {
namespace {

constexpr float eps = 1e-6f;

// Bytes read + written per second of a 2 GiB device-to-device copy: the median of 9 timed copies, measured
// once per run.
double copy_gbps() {
  static const double gbps = [] {
    const std::size_t bytes = std::size_t(1) << 31;
    buffer a(bytes), b(bytes);
    event_t start, stop;
    check(event_create(&start), "event");
    check(event_create(&stop), "event");
    for (int i = 0; i < 3; ++i) check(copy_device(b.get(), a.get(), bytes, nullptr), "copy");
    std::vector<float> ms;
    for (int i = 0; i < 9; ++i) {
      check(event_record(start, nullptr), "record");
      check(copy_device(b.get(), a.get(), bytes, nullptr), "copy");
      check(event_record(stop, nullptr), "record");
      check(event_sync(stop), "sync");
      float t = 0.f;
      check(event_elapsed(&t, start, stop), "elapsed");
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return 2.0 * double(bytes) / (double(ms[ms.size() / 2]) * 1e-3) * 1e-9;
  }();
  return gbps;
}

struct inputs {
  problem p;
  int64_t tokens;
  buffer q, k, v, o, d_o, dq, dk, dv;
  explicit inputs(const shape& s) : p(anchor_problem(s)), tokens(tile_geometry(p.grid).tiled_tokens()) {
    const int64_t nq = p.batch * tokens * p.q_heads * p.head_dim, nk = p.batch * tokens * p.kv_heads * p.head_dim;
    q = random_elements(nq, p.type, 11);
    k = random_elements(nk, p.type, 12);
    v = random_elements(nk, p.type, 13);
    d_o = random_elements(nq, p.type, 14);
    o = buffer(nq * 2);
    dq = buffer(nq * 2);
    dk = buffer(nk * 2);
    dv = buffer(nk * 2);
  }
  tensor view(const buffer& b, int64_t heads) const { return bshd(b.get(), p.batch, tokens, heads, p.head_dim); }
  double tensor_bytes(int64_t heads) const { return 2.0 * double(p.batch * tokens * heads * p.head_dim); }
};

void report(benchmark::State& state, double bytes) {
  const double copy = copy_gbps();
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["copy_GB/s"] = copy;
  // of_copy = (bytes / time) / copy rate, as an iteration-invariant rate of bytes / copy rate.
  state.counters["of_copy"] = benchmark::Counter(bytes * 1e-9 / copy, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["floor_us"] = bytes * 1e-9 / copy * 1e6;
}

void linear_forward(benchmark::State& state, const shape& s, feature_map phi) {
  inputs& in = kept<inputs>(s.name, s);
  const auto q = as_const(in.view(in.q, in.p.q_heads)), k = as_const(in.view(in.k, in.p.kv_heads)),
             v = as_const(in.view(in.v, in.p.kv_heads));
  const tensor o = in.view(in.o, in.p.q_heads);
  std::size_t bytes = 0;
  check(linear_attention_forward(in.p, phi, eps, token_order::tiled, q, k, v, o, nullptr, bytes, nullptr),
        "workspace size");
  buffer ws(bytes);
  time_on_stream(state, nullptr, [&] {
    check(linear_attention_forward(in.p, phi, eps, token_order::tiled, q, k, v, o, ws.get(), bytes, nullptr),
          "linear forward");
  });
  report(state, 2 * in.tensor_bytes(in.p.q_heads) + 2 * in.tensor_bytes(in.p.kv_heads));
  state.counters["workspace_MB"] = double(bytes) * 1e-6;
}

void linear_backward(benchmark::State& state, const shape& s, feature_map phi) {
  inputs& in = kept<inputs>(s.name, s);
  const auto q = as_const(in.view(in.q, in.p.q_heads)), k = as_const(in.view(in.k, in.p.kv_heads)),
             v = as_const(in.view(in.v, in.p.kv_heads)), d_o = as_const(in.view(in.d_o, in.p.q_heads));
  const tensor dq = in.view(in.dq, in.p.q_heads), dk = in.view(in.dk, in.p.kv_heads),
               dv = in.view(in.dv, in.p.kv_heads);
  std::size_t bytes = 0;
  check(
      linear_attention_backward(in.p, phi, eps, token_order::tiled, q, k, v, d_o, dq, dk, dv, nullptr, bytes, nullptr),
      "workspace size");
  buffer ws(bytes);
  time_on_stream(state, nullptr, [&] {
    check(linear_attention_backward(in.p, phi, eps, token_order::tiled, q, k, v, d_o, dq, dk, dv, ws.get(), bytes,
                                    nullptr),
          "linear backward");
  });
  report(state, 3 * in.tensor_bytes(in.p.q_heads) + 4 * in.tensor_bytes(in.p.kv_heads));
  state.counters["workspace_MB"] = double(bytes) * 1e-6;
}

// The backward given the state its forward kept (linear_state): no pass over k and v for the state.
void linear_backward_saved(benchmark::State& state, const shape& s, feature_map phi) {
  inputs& in = kept<inputs>(s.name, s);
  const auto q = as_const(in.view(in.q, in.p.q_heads)), k = as_const(in.view(in.k, in.p.kv_heads)),
             v = as_const(in.view(in.v, in.p.kv_heads)), d_o = as_const(in.view(in.d_o, in.p.q_heads));
  const tensor o = in.view(in.o, in.p.q_heads), dq = in.view(in.dq, in.p.q_heads), dk = in.view(in.dk, in.p.kv_heads),
               dv = in.view(in.dv, in.p.kv_heads);
  const std::size_t state_bytes = linear_state_bytes(in.p);
  buffer saved(state_bytes);
  const linear_state kept{saved.get(), state_bytes};
  std::size_t fwd = 0, bytes = 0;
  check(linear_attention_forward(in.p, phi, eps, token_order::tiled, q, k, v, o, kept, nullptr, fwd, nullptr),
        "forward workspace size");
  check(linear_attention_backward(in.p, phi, eps, token_order::tiled, q, k, v, d_o, dq, dk, dv, kept, nullptr, bytes,
                                  nullptr),
        "workspace size");
  buffer ws(std::max(fwd, bytes));
  check(linear_attention_forward(in.p, phi, eps, token_order::tiled, q, k, v, o, kept, ws.get(), fwd, nullptr),
        "linear forward");
  time_on_stream(state, nullptr, [&] {
    check(linear_attention_backward(in.p, phi, eps, token_order::tiled, q, k, v, d_o, dq, dk, dv, kept, ws.get(), bytes,
                                    nullptr),
          "linear backward");
  });
  report(state, 3 * in.tensor_bytes(in.p.q_heads) + 4 * in.tensor_bytes(in.p.kv_heads));
  state.counters["workspace_MB"] = double(bytes) * 1e-6;
  state.counters["state_MB"] = double(state_bytes) * 1e-6;
}

const bool registered = [] {
  benchmark::RegisterBenchmark("copy_bandwidth", copy_bandwidth)->UseManualTime()->Unit(benchmark::kMicrosecond);
  const std::pair<const char*, feature_map> maps[] = {{"elu1", feature_map::elu1}, {"softmax", feature_map::softmax}};
  for (const shape& s : anchors())
    for (const auto& m : maps) {
      const std::string n = std::string(m.first) + "/" + s.name;
      benchmark::RegisterBenchmark(("linear_forward/" + n).c_str(), linear_forward, s, m.second)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("linear_backward/" + n).c_str(), linear_backward, s, m.second)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("linear_backward_saved/" + n).c_str(), linear_backward_saved, s, m.second)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  return true;
}();

} // namespace
} // namespace bench
} // namespace vsa

BENCHMARK_MAIN();
