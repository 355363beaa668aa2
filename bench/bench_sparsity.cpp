// A sparsity sweep: the whole op and the sparse pass, forward and backward, at sparsities from 0.5 to 0.97 on
// wan2.1-1.3b-480p and hd64-32k, for the figures of time and speedup over dense attention against sparsity
// (bench/plot). k comes from the sparsity as the op derives it (options::sparsity, resolve_top_k); the sparse
// pass runs on uniform random lists of that k, the op on the lists it selects. TFLOP/s and `work` are counted as
// attention_inputs.hpp says. One set of inputs a shape serves every sparsity, so the sweep costs its timing and
// little else.
#include "attention_inputs.hpp"

#include <cstdio>
#include <cstring>
#include <string>

namespace vsa {
namespace bench {
namespace {

constexpr double sparsities[] = {0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 0.97};
constexpr const char* swept_shapes[] = {"wan2.1-1.3b-480p", "hd64-32k"};

options at_sparsity(double sparsity) {
  options opt;
  opt.sparsity = sparsity;
  return opt;
}

int64_t top_k(const shape& s, double sparsity) {
  return resolve_top_k(tile_geometry(s.grid).num_tiles(), at_sparsity(sparsity));
}

void sweep_sparse(benchmark::State& state, const shape& s, double sparsity, bool backward_pass) {
  inputs& in = inputs_of(s);
  const int64_t k = top_k(s, sparsity);
  const device_lists& lists = uniform_lists_of(s, k);
  backward_pass ? time_sparse_backward(state, in, lists, k) : time_sparse_forward(state, in, lists, k);
  state.counters["sparsity"] = sparsity;
}

void sweep_op(benchmark::State& state, const shape& s, double sparsity, bool backward_pass) {
  time_op(state, inputs_of(s), at_sparsity(sparsity), backward_pass, false);
  state.counters["sparsity"] = sparsity;
}

// Each kind in turn across the sparsities, so that the output reads as the figures' curves.
struct sweep_kind {
  const char* name;
  void (*run)(benchmark::State&, const shape&, double, bool);
  bool backward_pass;
};
constexpr sweep_kind kinds[] = {{"sweep_op_forward", sweep_op, false},
                                {"sweep_op_backward", sweep_op, true},
                                {"sweep_sparse_forward", sweep_sparse, false},
                                {"sweep_sparse_backward", sweep_sparse, true}};

const bool registered = [] {
  for (const shape& s : anchors()) {
    bool swept = false;
    for (const char* name : swept_shapes) swept = swept || std::strcmp(name, s.name) == 0;
    if (!swept) continue;
    for (const sweep_kind& kind : kinds)
      for (const double sparsity : sparsities) {
        char tag[16];
        std::snprintf(tag, sizeof tag, "/s%.2f", sparsity);
        const std::string name = std::string(kind.name) + "/" + s.name + tag;
        benchmark::RegisterBenchmark(name.c_str(), kind.run, s, sparsity, kind.backward_pass)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
  }
  return true;
}();

} // namespace
} // namespace bench
} // namespace vsa

BENCHMARK_MAIN();
