// Backward: grad_reduce_kernel adds query_grad's records over the slices and the q heads of each group, in a
// fixed order, and stores the gradient of the state (grad_view: dKVn, dz̄, σ').
#pragma once

#include "common.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// ---- backward: reduced state gradient ---------------------------------------------------------------------

// Gradient of the state of one kv head, summed over its group: dKVn = dKV / σ' (σ'[d1] = max_d2 |dKV|),
// rounded to E, and the fp32 vectors dz̄, σ'.
struct grad_view {
  uint16_t* kvn; // [batch · kv_heads, D, D]
  float* vec;    // [batch · kv_heads, 2, D]: dz̄, σ'
};

struct grad_reduce_params {
  const float* partial; // query_grad records
  int64_t slices, q_heads, kv_heads, group;
  int64_t heads_total; // batch · q_heads (the records' head count)
  const float* state_vec;
  grad_view grad;
};

// One block per (kv head, row d1 of the gradient), one thread per column d2: the block adds its row of the
// records of every q head of the group and every slice, in that order (q head, then slice), as grad_reduce
// always has. The slice loop is unrolled, so that the loads of several records are in flight at once while the
// additions keep their order; with four rows a block and one load in flight a thread the kernel was bound by
// the latency of its loads (25 µs on wan2.1 for ~9 MB of records, 12% of issue slots used), as state_reduce
// was.
template <class E, int D> __global__ void __launch_bounds__(D) grad_reduce_kernel(grad_reduce_params p) {
  __shared__ float scratch[D / warp_size > 0 ? D / warp_size : 1];
  // Launched with overlap (runtime.hpp: launch): the records are query_grad's.
  grid_dependents_launch();
  grid_dependency_wait();
  const int t = threadIdx.x;
  const int64_t bhk = blockIdx.x / D;
  const int d1 = static_cast<int>(blockIdx.x % D);
  const int64_t b = bhk / p.kv_heads, hk = bhk % p.kv_heads;
  const int64_t step = p.heads_total * record<D>::floats;
  const float* z = p.state_vec + bhk * 3 * D;
  float* vec = p.grad.vec + bhk * 2 * D;
  float dkv = 0.f, dz = 0.f;
  for (int64_t g = 0; g < p.group; ++g) {
    const float* base = p.partial + (b * p.q_heads + hk * p.group + g) * record<D>::floats;
#pragma unroll 8
    for (int64_t s = 0; s < p.slices; ++s) {
      const float* r = base + s * step;
      dkv += r[d1 * D + t];
      dz += r[record<D>::first + d1];
    }
  }
  // A channel that no key reaches (z = 0: relu only) has φ(k_j)[d1] = 0 and φ'(k_j)[d1] = 0 for every key, so
  // its row of the gradient is never used; it is stored as 0.
  const float unscale = z[d1] > 0.f ? 1.f / z[d1] : 0.f;
  dkv *= unscale;
  const float sigma = block_max<D>(fabsf(dkv), scratch);
  p.grad.kvn[(bhk * D + d1) * D + t] = E::from_float(sigma > 0.f ? dkv / sigma : 0.f);
  if (t == 0) {
    vec[d1] = dz * unscale;
    vec[D + d1] = sigma;
  }
}

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
