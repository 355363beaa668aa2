// The inputs and timed calls of the attention benchmarks, shared by bench_attention (the anchor shapes at the op's
// default sparsity) and bench_sparsity (a sweep of sparsities on two of them), so that both time the same calls
// on the same tensors and count their TFLOP/s alike.
//
// TFLOP/s count only the computed blocks: 4·B·H·S·(k·64)·D for the forward, 2.5× that for the backward,
// S the padded token count, as the peers' figures do. On grids with partial tiles the kernels cut a step over
// a tile of few valid tokens to its valid rows rounded up to 16 (with_step_width), so they do less than
// that count: `work` is the fraction of the forward's block products they compute on the timed lists (dq's
// three products follow the same fraction; dk/dv's four are whole), and TFLOP/s times work is the rate of
// the arithmetic actually done.
#pragma once

#include "common.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace vsa {
namespace bench {

// Device copies of q2k lists (k key tiles per row) and of their k2q lists.
struct device_lists {
  buffer q2k, count, k2q, offset;
  index_lists view(int64_t k) const {
    return {q2k.get<int32_t>(), count.get<int32_t>(), k, k2q.get<int32_t>(), offset.get<int32_t>()};
  }
};

// Random q2k lists (k distinct key tiles per row, ascending) and the k2q lists built from them by the CPU
// reference, so the sparse kernels can be timed apart from the selection.
inline device_lists random_lists(const problem& p, int64_t k, uint64_t seed) {
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
// random_lists as a type kept<> can make from its arguments.
struct uniform_lists : device_lists {
  uniform_lists(const problem& p, int64_t k, uint64_t seed) : device_lists(random_lists(p, k, seed)) {}
};
// The uniform lists of k entries a row for an anchor shape: drawn once per (shape, k), for its forward and
// backward benchmarks alike.
inline const device_lists& uniform_lists_of(const shape& s, int64_t k) {
  return kept<uniform_lists>(std::string(s.name) + "/k" + std::to_string(k), anchor_problem(s), k, uint64_t{7});
}

// The fraction of the selected blocks' products the narrow steps compute: the mean of W/64 over the list
// entries, W the rows a step covers for the key tile (step_rows; 64 on a grid without narrow tiles), as the
// kernels choose it.
inline double narrow_work(const problem& p, const device_lists& l, int64_t k) {
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

inline double forward_flops(const problem& p, int64_t k) {
  const double s = static_cast<double>(tile_geometry(p.grid).tiled_tokens());
  return 4.0 * p.batch * p.q_heads * s * (k * 64.0) * p.head_dim;
}

// q, k, v and dO of a shape, and room for o and the gradients; k is the op's at its default sparsity. With `extra`
// tokens, the tensors of the joint pass: N·64 + extra tokens.
struct inputs {
  problem p;
  int64_t k, tokens;
  buffer q, kk, v, o, d_o, dq, dk, dv;
  tensor view(const buffer& b, int64_t heads, int64_t rows = 0) const {
    return bshd(b.get(), p.batch, rows > 0 ? rows : tokens, heads, p.head_dim);
  }
  explicit inputs(const shape& s, int64_t extra = 0)
      : p(anchor_problem(s)), k(resolve_top_k(tile_geometry(p.grid).num_tiles(), options{})),
        tokens(tile_geometry(p.grid).tiled_tokens() + extra) {
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

// Inputs are drawn once per shape and shared by every benchmark of that shape, whatever its lists or sparsity.
inline inputs& inputs_of(const shape& s) { return kept<inputs>(s.name, s); }

// The sparse pass's forward on `lists` (k entries a row).
inline void time_sparse_forward(benchmark::State& state, inputs& in, const device_lists& lists, int64_t k) {
  buffer lse(in.p.batch * in.p.q_heads * in.tokens * 4);
  const float scale = 1.f / std::sqrt(float(in.p.head_dim));
  time_on_stream(state, nullptr, [&] {
    check(sparse_attention_forward(in.p, scale, as_const(in.view(in.q, in.p.q_heads)),
                                   as_const(in.view(in.kk, in.p.kv_heads)), as_const(in.view(in.v, in.p.kv_heads)),
                                   as_const(lists.view(k)), in.view(in.o, in.p.q_heads), lse.get<float>(), nullptr),
          "sparse forward");
  });
  state.counters["k"] = double(k);
  state.counters["TFLOP/s"] =
      benchmark::Counter(forward_flops(in.p, k) * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["work"] = narrow_work(in.p, lists, k);
}

// The sparse pass's backward on `lists` (k entries a row), after one forward on them for o and lse; in the workspace
// the size query asks, or with `least` the least one (dq then recomputes dS).
inline void time_sparse_backward(benchmark::State& state, inputs& in, const device_lists& lists, int64_t k,
                                 bool least = false) {
  buffer lse(in.p.batch * in.p.q_heads * in.tokens * 4);
  const float scale = 1.f / std::sqrt(float(in.p.head_dim));
  const auto q = as_const(in.view(in.q, in.p.q_heads)), kt = as_const(in.view(in.kk, in.p.kv_heads)),
             v = as_const(in.view(in.v, in.p.kv_heads));
  check(sparse_attention_forward(in.p, scale, q, kt, v, as_const(lists.view(k)), in.view(in.o, in.p.q_heads),
                                 lse.get<float>(), nullptr),
        "sparse forward");
  std::size_t bytes = 0;
  check(sparse_attention_backward(in.p, scale, q, kt, v, q, q, nullptr, as_const(lists.view(k)), {}, {}, {}, nullptr,
                                  bytes, nullptr),
        "workspace size");
  if (least) bytes = sparse_attention_backward_workspace(in.p);
  buffer ws(bytes);
  time_on_stream(state, nullptr, [&] {
    check(sparse_attention_backward(in.p, scale, q, kt, v, as_const(in.view(in.o, in.p.q_heads)),
                                    as_const(in.view(in.d_o, in.p.q_heads)), lse.get<float>(), as_const(lists.view(k)),
                                    in.view(in.dq, in.p.q_heads), in.view(in.dk, in.p.kv_heads),
                                    in.view(in.dv, in.p.kv_heads), ws.get(), bytes, nullptr),
          "sparse backward");
  });
  state.counters["k"] = double(k);
  state.counters["TFLOP/s"] =
      benchmark::Counter(2.5 * forward_flops(in.p, k) * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["work"] = narrow_work(in.p, lists, k);
}

// The whole op with `opt` (selection from the inputs, no gate), forward or backward (after one forward), on the
// GPU's clock or, with `host`, on the caller's (time_on_host); with `extra` tokens (inputs made with as many) the
// joint op (joint_forward, joint_backward).
inline void time_op(benchmark::State& state, inputs& in, const options& opt, bool backward_pass, bool host,
                    extra_tokens extra = {}) {
  // o and the gradients hold the raster tokens where the options ask for raster order (options::output_order).
  const int64_t out = opt.output_order == token_order::raster ? tile_geometry(in.p.grid).raster_tokens() : 0;
  forward_io fio{as_const(in.view(in.q, in.p.q_heads)), as_const(in.view(in.kk, in.p.kv_heads)),
                 as_const(in.view(in.v, in.p.kv_heads)), const_tensor{}, in.view(in.o, in.p.q_heads, out)};
  std::size_t fbytes = 0, bbytes = 0;
  check(joint_forward(in.p, extra, opt, fio, nullptr, fbytes, nullptr), "forward workspace size");
  backward_io bio{fio.q,
                  fio.k,
                  fio.v,
                  const_tensor{},
                  as_const(fio.o),
                  as_const(in.view(in.d_o, in.p.q_heads)),
                  in.view(in.dq, in.p.q_heads, out),
                  in.view(in.dk, in.p.kv_heads, out),
                  in.view(in.dv, in.p.kv_heads, out),
                  tensor{}};
  check(joint_backward(in.p, extra, opt, bio, nullptr, bbytes, nullptr), "backward workspace size");
  buffer ws(std::max(fbytes, bbytes));
  const auto run_forward = [&] {
    check(joint_forward(in.p, extra, opt, fio, ws.get(), fbytes, nullptr), "op forward");
  };
  const auto run_backward = [&] {
    check(joint_backward(in.p, extra, opt, bio, ws.get(), bbytes, nullptr), "op backward");
  };
  if (backward_pass) run_forward();
  if (host)
    backward_pass ? time_on_host(state, nullptr, run_backward) : time_on_host(state, nullptr, run_forward);
  else
    backward_pass ? time_on_stream(state, nullptr, run_backward) : time_on_stream(state, nullptr, run_forward);
  state.counters["k"] = double(resolve_top_k(tile_geometry(in.p.grid).num_tiles(), opt));
}

} // namespace bench
} // namespace vsa
