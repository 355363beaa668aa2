// Sparse attention (stage 6) forward and backward, and the whole op, on the anchor shapes at 90% sparsity.
// TFLOP/s count only the computed blocks: 4·B·H·S·(k·64)·D for the forward, 2.5× that for the backward,
// S the padded token count, as the peers' figures do. On grids with partial tiles the kernels cut a step over
// a tile of few valid tokens to its valid rows rounded up to 16 (with_step_width), so they do less than
// that count: `work` is the fraction of the forward's block products they compute on the timed lists (dq's
// three products follow the same fraction; dk/dv's four are whole), and TFLOP/s times work is the rate of
// the arithmetic actually done.
#include "common.hpp"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <numeric>

namespace vsa {
namespace bench {
namespace {

// Device copies of random q2k lists (k distinct key tiles per row, ascending) and the k2q lists built
// from them by the CPU reference, so the sparse kernels can be timed apart from the selection.
struct device_lists {
  buffer q2k, count, k2q, offset;
  index_lists view(int64_t k) const {
    return {q2k.get<int32_t>(), count.get<int32_t>(), k, k2q.get<int32_t>(), offset.get<int32_t>()};
  }
};

device_lists random_lists(const problem& p, int64_t k, uint64_t seed) {
  const int64_t n = tile_geometry(p.grid).num_tiles(), rows = p.batch * p.q_heads * n;
  std::vector<int32_t> q2k(rows * k), count(rows, static_cast<int32_t>(k)), k2q(rows * k),
      offset(p.batch * p.q_heads * (n + 1));
  std::mt19937_64 g(seed);
  std::vector<int32_t> perm(n);
  for (int64_t r = 0; r < rows; ++r) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t t = 0; t < k; ++t) std::swap(perm[t], perm[t + g() % (n - t)]);
    std::sort(perm.begin(), perm.begin() + k);
    std::copy(perm.begin(), perm.begin() + k, q2k.begin() + r * k);
  }
  check(reference::build_k2q(p, {q2k.data(), count.data(), k, k2q.data(), offset.data()}), "reference k2q");
  device_lists d{buffer(q2k.size() * 4), buffer(count.size() * 4), buffer(k2q.size() * 4), buffer(offset.size() * 4)};
  check(copy_to_device(d.q2k.get(), q2k.data(), q2k.size() * 4), "upload");
  check(copy_to_device(d.count.get(), count.data(), count.size() * 4), "upload");
  check(copy_to_device(d.k2q.get(), k2q.data(), k2q.size() * 4), "upload");
  check(copy_to_device(d.offset.get(), offset.data(), offset.size() * 4), "upload");
  return d;
}

// The fraction of the selected blocks' products the narrow steps compute: the mean of W/64 over the list
// entries, W the rows a step covers for the key tile (step_rows; 64 on a grid without narrow tiles), as the
// kernels choose it.
double narrow_work(const problem& p, const device_lists& l, int64_t k) {
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), rows = p.batch * p.q_heads * n;
  if (!gpu::detail::has_narrow_tiles(geo)) return 1.0;
  std::vector<int32_t> q2k(rows * k), count(rows);
  check(copy_to_host(q2k.data(), l.q2k.get(), q2k.size() * 4), "download");
  check(copy_to_host(count.data(), l.count.get(), count.size() * 4), "download");
  double sum = 0.0, entries = 0.0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < count[r]; ++e) {
      sum += gpu::detail::step_rows(geo.valid(q2k[r * k + e])) / 64.0;
      entries += 1.0;
    }
  return entries > 0.0 ? sum / entries : 1.0;
}

double forward_flops(const problem& p, int64_t k) {
  const double s = static_cast<double>(tile_geometry(p.grid).tiled_tokens());
  return 4.0 * p.batch * p.q_heads * s * (k * 64.0) * p.head_dim;
}

struct inputs {
  problem p;
  int64_t k, tokens;
  buffer q, kk, v, o, d_o, dq, dk, dv;
  tensor view(const buffer& b, int64_t heads) const { return bshd(b.get(), p.batch, tokens, heads, p.head_dim); }
  explicit inputs(const shape& s)
      : p(anchor_problem(s)), k(resolve_top_k(tile_geometry(p.grid).num_tiles(), options{})),
        tokens(tile_geometry(p.grid).tiled_tokens()) {
    const int64_t n = p.batch * tokens * p.q_heads * p.head_dim;
    q = random_elements(n, p.type, 1);
    kk = random_elements(n, p.type, 2);
    v = random_elements(n, p.type, 3);
    d_o = random_elements(n, p.type, 4);
    o = buffer(n * 2);
    dq = buffer(n * 2);
    dk = buffer(n * 2);
    dv = buffer(n * 2);
  }
};

// Inputs and lists are drawn once per shape and shared by every benchmark of that shape.
inputs& inputs_of(const shape& s) { return kept<inputs>(s.name, s); }
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

const device_lists& lists_of(const shape& s, bool from_data) {
  static std::map<std::string, std::unique_ptr<device_lists>> cache;
  auto& slot = cache[std::string(s.name) + (from_data ? "/data" : "/random")];
  if (!slot) {
    const inputs& in = inputs_of(s);
    slot = std::make_unique<device_lists>(from_data ? data_lists(in) : random_lists(in.p, in.k, 7));
  }
  return *slot;
}

void sparse_forward(benchmark::State& state, const shape& s, bool from_data) {
  inputs& in = inputs_of(s);
  const device_lists& lists = lists_of(s, from_data);
  buffer lse(in.p.batch * in.p.q_heads * in.tokens * 4);
  const float scale = 1.f / std::sqrt(float(in.p.head_dim));
  time_on_stream(state, nullptr, [&] {
    check(sparse_attention_forward(in.p, scale, as_const(in.view(in.q, in.p.q_heads)),
                                   as_const(in.view(in.kk, in.p.kv_heads)), as_const(in.view(in.v, in.p.kv_heads)),
                                   as_const(lists.view(in.k)), in.view(in.o, in.p.q_heads), lse.get<float>(), nullptr),
          "sparse forward");
  });
  state.counters["k"] = double(in.k);
  state.counters["TFLOP/s"] =
      benchmark::Counter(forward_flops(in.p, in.k) * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["work"] = narrow_work(in.p, lists, in.k);
}

void sparse_backward(benchmark::State& state, const shape& s, bool from_data) {
  inputs& in = inputs_of(s);
  const device_lists& lists = lists_of(s, from_data);
  buffer lse(in.p.batch * in.p.q_heads * in.tokens * 4);
  const float scale = 1.f / std::sqrt(float(in.p.head_dim));
  const auto q = as_const(in.view(in.q, in.p.q_heads)), k = as_const(in.view(in.kk, in.p.kv_heads)),
             v = as_const(in.view(in.v, in.p.kv_heads));
  check(sparse_attention_forward(in.p, scale, q, k, v, as_const(lists.view(in.k)), in.view(in.o, in.p.q_heads),
                                 lse.get<float>(), nullptr),
        "sparse forward");
  std::size_t bytes = 0;
  check(sparse_attention_backward(in.p, scale, q, k, v, q, q, nullptr, {}, {}, {}, {}, nullptr, bytes, nullptr),
        "workspace size");
  buffer ws(bytes);
  time_on_stream(state, nullptr, [&] {
    check(sparse_attention_backward(
              in.p, scale, q, k, v, as_const(in.view(in.o, in.p.q_heads)), as_const(in.view(in.d_o, in.p.q_heads)),
              lse.get<float>(), as_const(lists.view(in.k)), in.view(in.dq, in.p.q_heads), in.view(in.dk, in.p.kv_heads),
              in.view(in.dv, in.p.kv_heads), ws.get(), bytes, nullptr),
          "sparse backward");
  });
  state.counters["k"] = double(in.k);
  state.counters["TFLOP/s"] =
      benchmark::Counter(2.5 * forward_flops(in.p, in.k) * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["work"] = narrow_work(in.p, lists, in.k);
}

void op_forward_backward(benchmark::State& state, const shape& s, bool backward_pass, bool host) {
  inputs& in = inputs_of(s);
  const options opt{};
  forward_io fio{as_const(in.view(in.q, in.p.q_heads)), as_const(in.view(in.kk, in.p.kv_heads)),
                 as_const(in.view(in.v, in.p.kv_heads)), const_tensor{}, in.view(in.o, in.p.q_heads)};
  std::size_t fbytes = 0, bbytes = 0;
  check(forward(in.p, opt, fio, nullptr, fbytes, nullptr), "forward workspace size");
  backward_io bio{fio.q,
                  fio.k,
                  fio.v,
                  const_tensor{},
                  as_const(fio.o),
                  as_const(in.view(in.d_o, in.p.q_heads)),
                  in.view(in.dq, in.p.q_heads),
                  in.view(in.dk, in.p.kv_heads),
                  in.view(in.dv, in.p.kv_heads),
                  tensor{}};
  check(backward(in.p, opt, bio, nullptr, bbytes, nullptr), "backward workspace size");
  buffer ws(std::max(fbytes, bbytes));
  const auto run_forward = [&] { check(forward(in.p, opt, fio, ws.get(), fbytes, nullptr), "op forward"); };
  const auto run_backward = [&] { check(backward(in.p, opt, bio, ws.get(), bbytes, nullptr), "op backward"); };
  if (backward_pass) run_forward();
  if (host)
    backward_pass ? time_on_host(state, nullptr, run_backward) : time_on_host(state, nullptr, run_forward);
  else
    backward_pass ? time_on_stream(state, nullptr, run_backward) : time_on_stream(state, nullptr, run_forward);
  state.counters["k"] = double(in.k);
}

void copy_bandwidth(benchmark::State& state) {
  const std::size_t bytes = std::size_t(2) << 30;
  buffer a = random_elements(bytes / 2, dtype::bf16, 9), b(bytes);
  time_on_stream(state, nullptr, [&] { check(copy_device(b.get(), a.get(), bytes, nullptr), "copy"); });
  state.counters["GB/s"] =
      benchmark::Counter(2.0 * bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate); // read + written
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
