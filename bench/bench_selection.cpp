// The memory-bound stages and the selection on the anchor shapes at 90% sparsity: tile, untile, combine
// (forward and backward), block means, top-k, build_k2q, and the chain block means -> coarse attention ->
// top-k -> k2q that precedes the sparse pass. GB/s count the bytes a stage must move at least (read +
// written, padding slots only where they are written); a device-to-device copy in the same run gives the
// card's copy bandwidth to compare them with.
#include "common.hpp"

#include <vsa/gpu/block_means.hpp>
#include <vsa/gpu/coarse_attention.hpp>
#include <vsa/gpu/combine.hpp>
#include <vsa/gpu/index.hpp>
#include <vsa/gpu/layout.hpp>
#include <vsa/gpu/select.hpp>

#include <cmath>
#include <string>
#include <vector>

namespace vsa {
namespace bench {
namespace {

struct stage_inputs {
  problem p;
  int64_t n, k, tokens, raster_tokens;
  explicit stage_inputs(const shape& s)
      : p(anchor_problem(s)), n(tile_geometry(p.grid).num_tiles()), k(resolve_top_k(n, options{})),
        tokens(tile_geometry(p.grid).tiled_tokens()), raster_tokens(tile_geometry(p.grid).raster_tokens()) {}
  int64_t row_bytes() const { return p.head_dim * 2; }
  // Bytes of a [B, S, H, D] tensor of the q heads with `s` tokens.
  double bytes(int64_t s, int64_t heads) const { return double(p.batch) * s * heads * row_bytes(); }
  double means_bytes(int64_t heads) const { return double(p.batch) * heads * n * row_bytes(); }
  tensor view(const buffer& b, int64_t s, int64_t heads) const { return bshd(b.get(), p.batch, s, heads, p.head_dim); }
};

void set_rate(benchmark::State& state, double bytes) {
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// q-head tensors in raster and in tiled order.
struct layout_inputs {
  stage_inputs in;
  buffer raster, tiled;
  explicit layout_inputs(const shape& s)
      : in(s), raster(random_elements(in.p.batch * in.raster_tokens * in.p.q_heads * in.p.head_dim, in.p.type, 1)),
        tiled(random_elements(in.p.batch * in.tokens * in.p.q_heads * in.p.head_dim, in.p.type, 2)) {}
};

void tile_stage(benchmark::State& state, const shape& s, bool to_tiled) {
  const layout_inputs& l = kept<layout_inputs>(s.name, s);
  const stage_inputs& in = l.in;
  const int64_t heads = in.p.q_heads;
  const tensor r = in.view(l.raster, in.raster_tokens, heads), t = in.view(l.tiled, in.tokens, heads);
  time_on_stream(state, nullptr, [&] {
    if (to_tiled)
      check(tile(in.p, heads, as_const(r), t, nullptr), "tile");
    else
      check(untile(in.p, heads, as_const(t), r, nullptr), "untile");
  });
  // tile reads the raster tokens and writes every slot; untile reads and writes the valid tokens only.
  set_rate(state, to_tiled ? in.bytes(in.raster_tokens, heads) + in.bytes(in.tokens, heads)
                           : 2 * in.bytes(in.raster_tokens, heads));
}

// o_s (or dO), the gate, o_c, and room for o (or dgate) and d_o_c.
struct combine_inputs {
  stage_inputs in;
  int64_t elems, coarse;
  buffer x, gate, o_c, out, d_o_c;
  explicit combine_inputs(const shape& s)
      : in(s), elems(in.p.batch * in.tokens * in.p.q_heads * in.p.head_dim),
        coarse(in.p.batch * in.p.q_heads * in.n * in.p.head_dim), x(random_elements(elems, in.p.type, 3)),
        gate(random_elements(elems, in.p.type, 4)), o_c(random_elements(coarse, in.p.type, 5)), out(elems * 2),
        d_o_c(coarse * 2) {}
};

void combine_stage(benchmark::State& state, const shape& s, bool backward) {
  combine_inputs& c = kept<combine_inputs>(s.name, s);
  const stage_inputs& in = c.in;
  const int64_t h = in.p.q_heads;
  const buffer &x = c.x, &gate = c.gate, &o_c = c.o_c, &out = c.out, &d_o_c = c.d_o_c;
  const const_tensor xv = as_const(in.view(x, in.tokens, h)), gv = as_const(in.view(gate, in.tokens, h));
  const tensor ov = in.view(out, in.tokens, h);
  time_on_stream(state, nullptr, [&] {
    if (backward)
      check(combine_backward(in.p, xv, gv, o_c.get(), ov, d_o_c.get(), nullptr), "combine_backward");
    else
      check(combine(in.p, xv, gv, o_c.get(), ov, nullptr), "combine");
  });
  // Forward: o_s and gate (valid tokens) and o_c read, o written. Backward: dO and gate read, dgate and
  // d_o_c written, o_c read.
  const double valid = in.bytes(in.raster_tokens, h), all = in.bytes(in.tokens, h), coarse = in.means_bytes(h);
  set_rate(state, backward ? 2 * valid + all + 2 * coarse : 2 * valid + coarse + all);
}

struct means_inputs {
  stage_inputs in;
  buffer q, k, v, q_c, k_c, v_c, q_c32, k_c32;
  explicit means_inputs(const shape& s) : in(s) {
    const int64_t per_head = in.p.batch * in.tokens * in.p.head_dim;
    q = random_elements(per_head * in.p.q_heads, in.p.type, 6);
    k = random_elements(per_head * in.p.kv_heads, in.p.type, 7);
    v = random_elements(per_head * in.p.kv_heads, in.p.type, 8);
    q_c = buffer(static_cast<std::size_t>(in.means_bytes(in.p.q_heads)));
    k_c = buffer(static_cast<std::size_t>(in.means_bytes(in.p.kv_heads)));
    v_c = buffer(static_cast<std::size_t>(in.means_bytes(in.p.kv_heads)));
    const int64_t per_tile = in.p.batch * in.n * in.p.head_dim * 4;
    q_c32 = buffer(static_cast<std::size_t>(per_tile * in.p.q_heads));
    k_c32 = buffer(static_cast<std::size_t>(per_tile * in.p.kv_heads));
  }
  // As the op runs it: with the fp32 means of q and k that the coarse scores take.
  void run() {
    check(block_means(in.p, as_const(in.view(q, in.tokens, in.p.q_heads)),
                      as_const(in.view(k, in.tokens, in.p.kv_heads)), as_const(in.view(v, in.tokens, in.p.kv_heads)),
                      q_c.get(), k_c.get(), v_c.get(), q_c32.get<float>(), k_c32.get<float>(), nullptr),
          "block_means");
  }
  double bytes() const {
    const int64_t heads = in.p.q_heads + 2 * in.p.kv_heads;
    return in.bytes(in.raster_tokens, heads) + in.means_bytes(heads) +
           double(in.p.batch * in.n * in.p.head_dim * 4 * (in.p.q_heads + in.p.kv_heads));
  }
};

void means_stage(benchmark::State& state, const shape& s) {
  means_inputs& m = kept<means_inputs>(s.name, s);
  time_on_stream(state, nullptr, [&] { m.run(); });
  set_rate(state, m.bytes());
}

// Scores [B, Hq, N, N] of normal random values, and room for the lists.
struct selection_inputs {
  stage_inputs in;
  int64_t rows;
  buffer scores, q2k, count, k2q, offset, select_ws, index_ws;
  std::size_t select_bytes = 0, index_bytes = 0;
  explicit selection_inputs(const shape& s) : in(s), rows(in.p.batch * in.p.q_heads * in.n) {
    std::vector<float> host(static_cast<std::size_t>(rows * in.n));
    std::mt19937_64 g(11);
    std::normal_distribution<float> dist(0.f, 1.f);
    for (float& x : host) x = dist(g);
    scores = buffer(host.size() * 4);
    check(copy_to_device(scores.get(), host.data(), host.size() * 4), "upload");
    q2k = buffer(rows * in.k * 4);
    count = buffer(rows * 4);
    k2q = buffer(rows * in.k * 4);
    offset = buffer(in.p.batch * in.p.q_heads * (in.n + 1) * 4);
    check(select_top_k(in.p, in.k, nullptr, lists(), nullptr, select_bytes, nullptr), "select workspace");
    check(build_k2q(in.p, lists(), nullptr, index_bytes, nullptr), "k2q workspace");
    select_ws = buffer(select_bytes);
    index_ws = buffer(index_bytes);
  }
  index_lists lists() const {
    return {q2k.get<int32_t>(), count.get<int32_t>(), in.k, k2q.get<int32_t>(), offset.get<int32_t>()};
  }
  void select(const float* s) {
    check(select_top_k(in.p, in.k, s, lists(), select_ws.get(), select_bytes, nullptr), "select_top_k");
  }
  void index() { check(build_k2q(in.p, lists(), index_ws.get(), index_bytes, nullptr), "build_k2q"); }
};

void top_k_stage(benchmark::State& state, const shape& s) {
  selection_inputs& sel = kept<selection_inputs>(s.name, s);
  time_on_stream(state, nullptr, [&] { sel.select(sel.scores.get<float>()); });
  state.counters["N"] = double(sel.in.n);
  state.counters["k"] = double(sel.in.k);
  set_rate(state, 4.0 * sel.rows * (sel.in.n + sel.in.k + 1)); // scores read, lists written
}

void k2q_stage(benchmark::State& state, const shape& s) {
  selection_inputs& sel = kept<selection_inputs>(s.name, s);
  sel.select(sel.scores.get<float>());
  time_on_stream(state, nullptr, [&] { sel.index(); });
  state.counters["N"] = double(sel.in.n);
  state.counters["k"] = double(sel.in.k);
}

// Block means, then coarse attention on them (scores, o_c, lse_c): the head of the selection chain.
struct coarse_inputs {
  means_inputs m;
  selection_inputs sel;
  buffer o_c, lse_c;
  float scale;
  explicit coarse_inputs(const shape& s)
      : m(s), sel(s), o_c(static_cast<std::size_t>(m.in.means_bytes(m.in.p.q_heads))),
        lse_c(m.in.p.batch * m.in.p.q_heads * m.in.n * 4), scale(1.f / std::sqrt(float(m.in.p.head_dim))) {}
  // The scores from the fp32 means, then the attention over them: the coarse stage of the op.
  void coarse() {
    check(coarse_scores(m.in.p, scale, m.q_c32.get<float>(), m.k_c32.get<float>(), sel.scores.get<float>(), nullptr),
          "coarse_scores");
    check(
        coarse_attention(m.in.p, sel.scores.get<float>(), m.v_c.get(), o_c.get(), nullptr, lse_c.get<float>(), nullptr),
        "coarse_attention");
  }
};

// Coarse attention alone, on the means the block-means stage produced.
void coarse_stage(benchmark::State& state, const shape& s) {
  coarse_inputs& c = kept<coarse_inputs>(s.name, s);
  c.m.run();
  time_on_stream(state, nullptr, [&] { c.coarse(); });
  state.counters["N"] = double(c.m.in.n);
}

// Block means -> coarse attention (scores, o_c, lse_c) -> top-k -> k2q: everything before the sparse pass.
void chain_stage(benchmark::State& state, const shape& s) {
  coarse_inputs& c = kept<coarse_inputs>(s.name, s);
  time_on_stream(state, nullptr, [&] {
    c.m.run();
    c.coarse();
    c.sel.select(c.sel.scores.get<float>());
    c.sel.index();
  });
  state.counters["N"] = double(c.m.in.n);
  state.counters["k"] = double(c.m.in.k);
}

template <class F, class... Args> void add(const std::string& name, F f, Args... args) {
  benchmark::RegisterBenchmark(name.c_str(), f, args...)->UseManualTime()->Unit(benchmark::kMicrosecond);
}

const bool registered = [] {
  add("copy_bandwidth", copy_bandwidth);
  for (const shape& s : anchors()) {
    const std::string n = s.name;
    add("tile/" + n, tile_stage, s, true);
    add("untile/" + n, tile_stage, s, false);
    add("combine/" + n, combine_stage, s, false);
    add("combine_backward/" + n, combine_stage, s, true);
    add("block_means/" + n, means_stage, s);
    add("coarse_attention/" + n, coarse_stage, s);
    add("select_top_k/" + n, top_k_stage, s);
    add("build_k2q/" + n, k2q_stage, s);
    add("means_coarse_topk_k2q/" + n, chain_stage, s);
  }
  return true;
}();

} // namespace
} // namespace bench
} // namespace vsa

BENCHMARK_MAIN();
