// Forward, second launch: state_reduce_kernel adds the state kernel's records in slice order and stores the
// state in the form the apply and gradient kernels read (state_view: KVn, z, m, σ).
#pragma once

#include "common.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// ---- forward: reduced state ------------------------------------------------------------------------------------

// The state of one kv head as the apply and gradient kernels read it.
struct state_view {
  uint16_t* kvn; // [heads_total, D, D] KVn
  float* vec;    // [heads_total, 3, D]: z, m, σ
};

struct state_reduce_params {
  const float* partial;
  int64_t slices, heads_total;
  float inv_count; // 1 / number of valid tokens
  state_view state;
};

// One block per (head, row d1 of the state), one thread per column d2: the block adds its row of every
// slice's record, z[d1] and Σ v in slice order. The slice loop is unrolled, so that the loads of several
// slices are in flight at once while the additions keep their order; with four rows a block and one load in
// flight a thread the kernel was bound by the latency of its loads (22 µs on wan2.1 for ~17 MB of records).
// Every block adds Σ v for m itself (its sum is the same in every block: same values, same order).
template <class E, int D> __global__ void __launch_bounds__(D) state_reduce_kernel(state_reduce_params p) {
  __shared__ float scratch[D / warp_size > 0 ? D / warp_size : 1];
  // Launched with overlap (runtime.hpp: launch): the records are the state kernel's.
  grid_dependents_launch();
  grid_dependency_wait();
  const int t = threadIdx.x;
  const int64_t bh = blockIdx.x / D;
  const int d1 = static_cast<int>(blockIdx.x % D);
  const float* base = p.partial + bh * record<D>::floats;
  const int64_t step = p.heads_total * record<D>::floats;

  float vs = 0.f, kv = 0.f, z = 0.f;
#pragma unroll 8
  for (int64_t s = 0; s < p.slices; ++s) {
    const float* r = base + s * step;
    vs += r[record<D>::second + t];
    kv += r[d1 * D + t];
    z += r[record<D>::first + d1];
  }
  const float m = vs * p.inv_count;
  float* vec = p.state.vec + bh * 3 * D;
  if (d1 == 0) vec[D + t] = m;
  const float centered = kv - z * m;
  const float sigma = block_max<D>(fabsf(centered), scratch);
  p.state.kvn[(bh * D + d1) * D + t] = E::from_float(sigma > 0.f ? centered / sigma : 0.f);
  if (t == 0) {
    vec[d1] = z;
    vec[2 * D + d1] = sigma;
  }
}

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
