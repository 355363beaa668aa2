// Probe (not part of the build): the sparse backward's kernels on the wan2.1-1.3b-480p shape (bf16, D = 128, uniform
// random lists), H200 / sm_90a only: the portable one-warpgroup dk/dv (attention_backward.hpp) against the
// warp-specialized Hopper kernel (hopper/dkdv.hpp), each launched alone on the library's order and delta; the dq
// kernel alone (its share of the backward); and the library's whole sparse backward. Checks the Hopper kernel's dk
// and dv against the portable kernel's (dV bitwise, dK within the rounding of P's fp16 hand-over). The variants
// the Hopper kernel came from, and their figures, are in bench/NOTES.md (v17, v18); its stage counts, v19; its
// producer warps (variants below) and a form whose consumers take the pairs in turn, v20.
//
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -arch=sm_90a -I include -o hopper_backward
//   bench/probes/hopper_backward.cu
//   ./hopper_backward [scale]            # times, and the comparison (scale: of the random inputs, default 1)
//   ./hopper_backward [scale] once       # one launch of each kernel, for a profiler
#include "vsa/vsa.hpp"

#include "probe_check.hpp"
#include "probe_backward.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

using namespace vsa;
namespace gd = vsa::gpu::detail;

constexpr int D = 128;
using E = gpu::bf16_type;

// Tunings of the Hopper dk/dv timed beside the library's (hopper::dkdv_tuning): its producer warps. Other tunings
// tried (head dim 64, two blocks an SM) are on the branch the notes name (bench/NOTES.md, v19).
template <int Stages, int Warps> struct tuning : gd::hopper::dkdv_tuning {
  static constexpr int stages = Stages, producer_warps = Warps;
};
using variants = std::tuple<tuning<4, 1>, tuning<4, 4>>;

int main(int argc, char** argv) {
  const float amp = argc > 1 ? std::atof(argv[1]) : 1.f; // input scale (scores grow with its square)
  probe::backward_setup<E, D> x;
  if (!x.make(probe::wan21(), amp)) return 1;
  const int64_t n = x.n, elems = x.elems;
  uint16_t *dk = x.dk, *dv = x.dv, *dk2 = x.dk2, *dv2 = x.dv2; // the library's, then the kernels' alone
  gd::backward_params& bp = x.bp;
  const auto qs = x.q_schedule();
  const auto ks = x.k_schedule();
  const auto view = [&](void* d) { return x.view(d); };
  const auto library = [&] { return x.library(); };
  const unsigned blocks = static_cast<unsigned>(n * x.p.kv_heads);
  const dim3 qgrid(static_cast<unsigned>(n), static_cast<unsigned>(x.p.q_heads), 1);
  const auto lib_dq_kernel = gd::attention_dq_kernel<E, D, gd::sparse_schedule, true>;
  const int lib_dq_smem = gpu::smem_plan<D>::backward_bytes(true);
  CHECK(cudaFuncSetAttribute(lib_dq_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lib_dq_smem));
  const auto lib_dq = [&] { lib_dq_kernel<<<qgrid, 128, lib_dq_smem>>>(bp, qs); };
  const auto lib_kernel = gd::attention_dkdv_kernel<E, D, gd::sparse_schedule>;
  const int lib_smem = gpu::smem_plan<D>::dkdv_bytes(true);
  CHECK(cudaFuncSetAttribute(lib_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lib_smem));
  const auto lib_dkdv = [&] { lib_kernel<<<blocks, 128, lib_smem>>>(bp, ks); };
  const auto hop_kernel = gd::hopper::hopper_dkdv_kernel<E, D>;
  const int hop_smem = gd::hopper::dkdv_plan<D>::bytes;
  CHECK(cudaFuncSetAttribute(hop_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hop_smem));
  const auto hop_dkdv = [&] { hop_kernel<<<blocks, gd::hopper::block_threads, hop_smem>>>(bp, ks); };

  if (argc > 2) { // one launch of each kernel, for a profiler
    lib_dq();
    lib_dkdv();
    hop_dkdv();
    CHECK(cudaDeviceSynchronize());
    return 0;
  }
  const double pairs = x.pairs(), product = 2.0 * 64 * 64 * D;
  const double dkdv_flops = 4 * product * pairs, dq_flops = 3 * product * pairs;
  const auto compare = [&](const char* name, const uint16_t* a, const uint16_t* b) {
    probe::compare_bf16(name, a, b, elems);
  };

  // Each tuning of `variants`: timed after the library's kernels in each round, then checked bitwise against the
  // library's tuning (the tuning changes no arithmetic).
  const auto each_variant = [&](auto&& f) { std::apply([&](auto... t) { (f(t), ...); }, variants{}); };
  const auto variant_launch = [&](auto t) {
    using T = decltype(t);
    const auto kern = gd::hopper::hopper_dkdv_kernel<E, D, T>;
    const int smem = gd::hopper::dkdv_plan<D, T>::bytes;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
      std::printf("setting a variant's shared memory failed\n");
    return [=] { kern<<<blocks, gd::hopper::block_threads, smem>>>(bp, ks); };
  };
  for (int round = 0; round < 2; ++round) {
    const float tb = probe::median_ms([&] { (void)library(); });
    const float tq = probe::median_ms(lib_dq);
    const float tl = probe::median_ms(lib_dkdv), th = probe::median_ms(hop_dkdv);
    std::printf("round %d: library backward %.3f ms | dq %.3f ms (%.0f TFLOP/s) | dk/dv: portable %.3f (%.0f), "
                "Hopper %.3f (%.0f)\n",
                round, tb, tq, dq_flops / tq * 1e-9, tl, dkdv_flops / tl * 1e-9, th, dkdv_flops / th * 1e-9);
    each_variant([&](auto t) {
      using T = decltype(t);
      const float tv = probe::median_ms(variant_launch(t));
      std::printf("  Hopper, %d stages, %d producer warps: %.3f ms (%.0f)\n", T::stages, T::producer_warps, tv,
                  dkdv_flops / tv * 1e-9);
    });
  }
  CHECK(cudaGetLastError());
  // The portable kernel's dk, dv (poisoned first), then the Hopper kernel's into the library's outputs.
  for (uint16_t* t : {dk2, dv2, dk, dv}) CHECK(cudaMemset(t, 0xff, elems * 2));
  lib_dkdv();
  CHECK(cudaDeviceSynchronize());
  bp.dk = gd::make_operand(view(dk));
  bp.dv = gd::make_operand(view(dv));
  hop_dkdv();
  CHECK(cudaDeviceSynchronize());
  std::printf("Hopper kernel against the portable one:\n");
  compare("dk", dk2, dk);
  compare("dv", dv2, dv);
  each_variant([&](auto t) {
    using T = decltype(t);
    // (no CHECK here: it returns an int, and this lambda returns nothing)
    bool ok = cudaMemset(dk2, 0xff, elems * 2) == cudaSuccess && cudaMemset(dv2, 0xff, elems * 2) == cudaSuccess;
    gd::backward_params saved = bp;
    bp.dk = gd::make_operand(view(dk2));
    bp.dv = gd::make_operand(view(dv2));
    variant_launch(t)();
    bp = saved;
    ok = ok && cudaDeviceSynchronize() == cudaSuccess;
    if (!ok) return (void)std::printf("a variant's launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    std::printf("Hopper, %d stages, %d producer warps, against the library's tuning:\n", T::stages, T::producer_warps);
    compare("dk", dk, dk2);
    compare("dv", dv, dv2);
  });
  return 0;
}
