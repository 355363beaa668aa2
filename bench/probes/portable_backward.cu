// Probe (not part of the build): the portable backward kernels (attention_backward.hpp) at head dim 64 on hd64-32k
// (bf16, uniform random lists), H200 / sm_90a only, at the blocks an SM their registers are capped for: the library's
// dq and dk/dv each launched alone on the library's order and delta, then each with the cap of `MinBlocks` blocks an
// SM, checked bitwise against the library's (a cap changes no arithmetic). Figures in bench/NOTES.md (v19).
//
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -arch=sm_90a -I include -Xptxas -v -o portable_backward
//   bench/probes/portable_backward.cu
#include "vsa/vsa.hpp"

#include "probe_check.hpp"
#include "probe_backward.hpp"

#include <cmath>
#include <cstdio>
#include <tuple>
#include <type_traits>
#include <vector>

using namespace vsa;
namespace gd = vsa::gpu::detail;

constexpr int D = 64;
using E = gpu::bf16_type;
template <int N> using blocks = std::integral_constant<int, N>;
using dq_caps = std::tuple<blocks<5>>;
using dkdv_caps = std::tuple<blocks<4>>;

int main() {
  probe::backward_setup<E, D> x;
  if (!x.make(probe::hd64(), 1.f)) return 1;
  const int64_t n = x.n, elems = x.elems;
  const uint16_t *dq = x.dq, *dk = x.dk, *dv = x.dv; // the library's
  uint16_t *dq2 = x.dq2, *dk2 = x.dk2, *dv2 = x.dv2; // the capped kernels'
  const gd::backward_params& bp = x.bp;
  const auto qs = x.q_schedule();
  const auto ks = x.k_schedule();
  const auto library = [&] { return x.library(); };
  const dim3 qgrid(static_cast<unsigned>(n), static_cast<unsigned>(x.p.q_heads), 1);
  const unsigned kblocks = static_cast<unsigned>(n * x.p.kv_heads);
  const int dq_smem = gpu::smem_plan<D>::backward_bytes(true), dkdv_smem = gpu::smem_plan<D>::dkdv_bytes(true);
  // hd64-32k has no partial tiles: the library takes the dq kernel of one width.
  const auto dq_launch = [&](auto cap) {
    const auto kern = gd::attention_dq_kernel<E, D, gd::sparse_schedule, false, decltype(cap)::value>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, dq_smem) != cudaSuccess)
      std::printf("setting shared memory failed\n");
    return [=] { kern<<<qgrid, 128, dq_smem>>>(bp, qs); };
  };
  const auto dkdv_launch = [&](auto cap) {
    const auto kern = gd::attention_dkdv_kernel<E, D, gd::sparse_schedule, decltype(cap)::value>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, dkdv_smem) != cudaSuccess)
      std::printf("setting shared memory failed\n");
    return [=] { kern<<<kblocks, 128, dkdv_smem>>>(bp, ks); };
  };
  const double pairs = x.pairs(), product = 2.0 * 64 * 64 * D;
  const double dq_flops = 3 * product * pairs, dkdv_flops = 4 * product * pairs;
  const auto each = [](auto tuple, auto&& f) { std::apply([&](auto... t) { (f(t), ...); }, tuple); };

  for (int round = 0; round < 2; ++round) {
    const float tb = probe::median_ms([&] { (void)library(); });
    const float tq = probe::median_ms(dq_launch(blocks<0>{})), tk = probe::median_ms(dkdv_launch(blocks<0>{}));
    std::printf("round %d: library backward %.3f ms | dq %.3f ms (%.0f TFLOP/s) | dk/dv %.3f (%.0f)\n", round, tb, tq,
                dq_flops / tq * 1e-9, tk, dkdv_flops / tk * 1e-9);
    each(dq_caps{}, [&](auto cap) {
      const float t = probe::median_ms(dq_launch(cap));
      std::printf("  dq capped for %d blocks an SM: %.3f ms (%.0f)\n", decltype(cap)::value, t, dq_flops / t * 1e-9);
    });
    each(dkdv_caps{}, [&](auto cap) {
      const float t = probe::median_ms(dkdv_launch(cap));
      std::printf("  dk/dv capped for %d blocks an SM: %.3f ms (%.0f)\n", decltype(cap)::value, t,
                  dkdv_flops / t * 1e-9);
    });
  }
  CHECK(cudaGetLastError());
  // Each capped kernel's outputs (poisoned first) against the library's call above.
  const auto fresh = [&] {
    for (uint16_t* t : {dq2, dk2, dv2}) (void)cudaMemset(t, 0xff, elems * 2);
  };
  each(dq_caps{}, [&](auto cap) {
    fresh();
    dq_launch(cap)();
    (void)cudaDeviceSynchronize();
    std::printf("dq capped for %d blocks an SM, against the library's:\n", decltype(cap)::value);
    probe::compare_bf16("dq", dq, dq2, elems);
  });
  each(dkdv_caps{}, [&](auto cap) {
    fresh();
    dkdv_launch(cap)();
    (void)cudaDeviceSynchronize();
    std::printf("dk/dv capped for %d blocks an SM, against the library's:\n", decltype(cap)::value);
    probe::compare_bf16("dk", dk, dk2, elems);
    probe::compare_bf16("dv", dv, dv2, elems);
  });
  CHECK(cudaGetLastError());
  return 0;
}
