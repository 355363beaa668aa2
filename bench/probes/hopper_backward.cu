// Probe (not part of the build): the sparse backward's kernels on the wan2.1-1.3b-480p shape (bf16, D = 128, uniform
// random lists), H200 / sm_90a only: the portable one-warpgroup dk/dv (attention_backward.hpp) against the
// warp-specialized Hopper kernel (hopper/dkdv.hpp), each launched alone on the library's order and delta; the dq
// kernel alone (its share of the backward); and the library's whole sparse backward. Checks the Hopper kernel's dk
// and dv against the portable kernel's (dV bitwise, dK within the rounding of P's fp16 hand-over). The variants
// the Hopper kernel came from, and their figures, are in bench/NOTES.md (v17, v18).
//
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -arch=sm_90a -I include -o hopper_backward
//   bench/probes/hopper_backward.cu
//   ./hopper_backward [scale]            # times, and the comparison (scale: of the random inputs, default 1)
//   ./hopper_backward [scale] once       # one launch of each kernel, for a profiler
#include "vsa/vsa.hpp"

#include "probe_check.hpp"
#include "probe_inputs.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

using namespace vsa;
namespace gd = vsa::gpu::detail;

constexpr int D = 128;
using E = gpu::bf16_type;
using M = gpu::attention_mma<E, D>;

int main(int argc, char** argv) {
  const float amp = argc > 1 ? std::atof(argv[1]) : 1.f; // input scale (scores grow with its square)
  const problem p = probe::wan21();
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), S = geo.tiled_tokens(), rows = p.q_heads * n, K = (n + 5) / 10;
  const int64_t elems = S * p.q_heads * D;
  std::vector<int32_t> q2k = probe::uniform_q2k(rows, n, K), count(rows, static_cast<int32_t>(K)), k2q(rows * K),
                       offset(p.q_heads * (n + 1));
  if (!reference::build_k2q(p, {q2k.data(), count.data(), K, k2q.data(), offset.data()})) return 1;
  const int32_t *dq2k = probe::to_device(q2k), *dcount = probe::to_device(count), *dk2q = probe::to_device(k2q),
                *doff = probe::to_device(offset);
  if (!dq2k || !dcount || !dk2q || !doff) return std::printf("copying the lists failed\n"), 1;
  const const_index_lists idx{dq2k, dcount, K, dk2q, doff};
  uint16_t *q, *k, *v, *o, *dO, *dq, *dk, *dv, *dq2, *dk2, *dv2; // dq2: the dq kernel's, alone
  float* lse;
  for (uint16_t** x : {&q, &k, &v, &o, &dO, &dq, &dk, &dv, &dq2, &dk2, &dv2}) CHECK(cudaMalloc(x, elems * 2));
  CHECK(cudaMalloc(&lse, rows * 64 * 4));
  uint32_t seed = 1;
  for (uint16_t* x : {q, k, v, dO}) probe::fill<E><<<(elems + 255) / 256, 256>>>(x, elems, seed++ * 0x9e3779b9u, amp);
  CHECK(cudaGetLastError());
  const auto view = [&](void* d) { return bshd<void*>(d, 1, S, p.q_heads, D); };
  const float scale = 1.f / std::sqrt(float(D));
  status st = sparse_attention_forward(p, scale, as_const(view(q)), as_const(view(k)), as_const(view(v)), idx, view(o),
                                       lse, nullptr);
  if (!st) return std::printf("%s\n", st.message()), 1;
  std::size_t ws_bytes = sparse_attention_backward_workspace(p);
  void* ws;
  CHECK(cudaMalloc(&ws, ws_bytes));
  const auto library = [&] {
    return sparse_attention_backward(p, scale, as_const(view(q)), as_const(view(k)), as_const(view(v)),
                                     as_const(view(o)), as_const(view(dO)), lse, idx, view(dq), view(dk), view(dv), ws,
                                     ws_bytes, nullptr);
  };
  st = library();
  if (!st) return std::printf("%s\n", st.message()), 1;
  CHECK(cudaDeviceSynchronize());

  // The parameters the library's dk/dv kernel gets (delta and order: the workspace the call above filled).
  const auto ks = detail::k2q_schedule(p, idx);
  gd::backward_params bp =
      detail::sparse_backward_params(p, scale, as_const(view(q)), as_const(view(k)), as_const(view(v)),
                                     as_const(view(dO)), view(dq2), view(dk2), view(dv2), lse);
  {
    const detail::sparse_backward_scratch pieces(p);
    unsigned char* at = static_cast<unsigned char*>(ws);
    bp.delta = reinterpret_cast<float*>(at);
    bp.order = reinterpret_cast<int32_t*>(at + pieces.delta + pieces.counts);
  }
  const auto map = [&](gpu::tma_map& m, const gd::operand& x, int64_t heads) {
    return gpu::encode_tile_map(m, x.data, 1, S, heads, D, x.batch, x.token, x.head);
  };
  if (!(map(bp.k_map, bp.k, 12) && map(bp.v_map, bp.v, 12) && map(bp.q_map, bp.q, 12) && map(bp.do_map, bp.d_o, 12)))
    return std::printf("map\n"), 1;
  bp.tma = 1;
  const unsigned blocks = static_cast<unsigned>(n * p.kv_heads);
  const auto qs = detail::q2k_schedule(p, idx);
  const dim3 qgrid(static_cast<unsigned>(n), static_cast<unsigned>(p.q_heads), 1);
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
  const double pairs = static_cast<double>(K) * rows, product = 2.0 * 64 * 64 * D;
  const double dkdv_flops = 4 * product * pairs, dq_flops = 3 * product * pairs;
  const auto compare = [&](const char* name, const uint16_t* x, const uint16_t* y) {
    probe::compare_bf16(name, x, y, elems);
  };

  for (int round = 0; round < 2; ++round) {
    const float tb = probe::median_ms([&] { (void)library(); });
    const float tq = probe::median_ms(lib_dq);
    const float tl = probe::median_ms(lib_dkdv), th = probe::median_ms(hop_dkdv);
    std::printf("round %d: library backward %.3f ms | dq %.3f ms (%.0f TFLOP/s) | dk/dv: portable %.3f (%.0f), "
                "Hopper %.3f (%.0f)\n",
                round, tb, tq, dq_flops / tq * 1e-9, tl, dkdv_flops / tl * 1e-9, th, dkdv_flops / th * 1e-9);
  }
  CHECK(cudaGetLastError());
  // The portable kernel's dk, dv (poisoned first), then the Hopper kernel's into the library's outputs.
  for (uint16_t* x : {dk2, dv2, dk, dv}) CHECK(cudaMemset(x, 0xff, elems * 2));
  lib_dkdv();
  CHECK(cudaDeviceSynchronize());
  bp.dk = gd::make_operand(view(dk));
  bp.dv = gd::make_operand(view(dv));
  hop_dkdv();
  CHECK(cudaDeviceSynchronize());
  std::printf("Hopper kernel against the portable one:\n");
  compare("dk", dk2, dk);
  compare("dv", dv2, dv);
  return 0;
}
