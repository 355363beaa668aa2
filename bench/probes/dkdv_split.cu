// Probe (not part of the build): the sparse dk/dv kernels on the wan2.1-1.3b-480p shape (bf16, D = 128, uniform
// random lists), H200 / sm_90a only: the portable one-warpgroup kernel (attention_backward.hpp) against the
// warp-specialized Hopper kernel (hopper/dkdv.hpp), each launched alone on the library's order and delta, and the
// library's whole sparse backward. Checks the Hopper kernel's dk and dv against the portable kernel's (dV bitwise,
// dK within the rounding of P's fp16 hand-over). The variants the Hopper kernel came from, and their figures, are
// in bench/NOTES.md (v17).
//
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -arch=sm_90a -I include -o dkdv_split bench/probes/dkdv_split.cu
//   ./dkdv_split [scale]            # times, and the comparison (scale: of the random inputs, default 1)
//   ./dkdv_split [scale] once       # one launch of each kernel, for a profiler
#include "vsa/vsa.hpp"

#include "probe_check.hpp"

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

__global__ void fill(uint16_t* x, int64_t n, uint32_t seed, float amp) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  h *= 3266489917u;
  h ^= h >> 16;
  x[i] = E::pack(amp * ((h & 0xffff) / 32768.f - 1.f), 0.f) & 0xffff;
}

int main(int argc, char** argv) {
  const float amp = argc > 1 ? std::atof(argv[1]) : 1.f; // input scale (scores grow with its square)
  problem p;
  p.batch = 1;
  p.q_heads = p.kv_heads = 12;
  p.head_dim = D;
  p.grid = {21, 30, 52};
  p.type = dtype::bf16;
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), S = geo.tiled_tokens(), rows = p.q_heads * n, K = (n + 5) / 10;
  const int64_t elems = S * p.q_heads * D;
  std::vector<int32_t> q2k(rows * K), count(rows, static_cast<int32_t>(K)), k2q(rows * K), offset(p.q_heads * (n + 1));
  std::mt19937_64 g(7);
  std::vector<int32_t> perm(n);
  for (int64_t r = 0; r < rows; ++r) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t t = 0; t < K; ++t) std::swap(perm[t], perm[t + g() % (n - t)]);
    std::sort(perm.begin(), perm.begin() + K);
    std::copy(perm.begin(), perm.begin() + K, q2k.begin() + r * K);
  }
  if (!reference::build_k2q(p, {q2k.data(), count.data(), K, k2q.data(), offset.data()})) return 1;
  int32_t *dq2k, *dcount, *dk2q, *doff;
  CHECK(cudaMalloc(&dq2k, q2k.size() * 4));
  CHECK(cudaMalloc(&dcount, count.size() * 4));
  CHECK(cudaMalloc(&dk2q, k2q.size() * 4));
  CHECK(cudaMalloc(&doff, offset.size() * 4));
  CHECK(cudaMemcpy(dq2k, q2k.data(), q2k.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dcount, count.data(), count.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk2q, k2q.data(), k2q.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(doff, offset.data(), offset.size() * 4, cudaMemcpyHostToDevice));
  const const_index_lists idx{dq2k, dcount, K, dk2q, doff};
  uint16_t *q, *k, *v, *o, *dO, *dq, *dk, *dv, *dk2, *dv2;
  float* lse;
  for (uint16_t** x : {&q, &k, &v, &o, &dO, &dq, &dk, &dv, &dk2, &dv2}) CHECK(cudaMalloc(x, elems * 2));
  CHECK(cudaMalloc(&lse, rows * 64 * 4));
  uint32_t seed = 1;
  for (uint16_t* x : {q, k, v, dO}) fill<<<(elems + 255) / 256, 256>>>(x, elems, seed++ * 0x9e3779b9u, amp);
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
                                     as_const(view(dO)), view(dq), view(dk2), view(dv2), lse);
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
  const auto lib_kernel = gd::attention_dkdv_kernel<E, D, gd::sparse_schedule>;
  const int lib_smem = gpu::smem_plan<D>::dkdv_bytes(true);
  CHECK(cudaFuncSetAttribute(lib_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lib_smem));
  const auto lib_dkdv = [&] { lib_kernel<<<blocks, 128, lib_smem>>>(bp, ks); };
  const auto hop_kernel = gd::hopper::hopper_dkdv_kernel<E, D>;
  const int hop_smem = gd::hopper::dkdv_plan<D>::bytes;
  CHECK(cudaFuncSetAttribute(hop_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hop_smem));
  const auto hop_dkdv = [&] { hop_kernel<<<blocks, gd::hopper::dkdv_threads, hop_smem>>>(bp, ks); };

  if (argc > 2) { // one launch of each kernel, for a profiler
    lib_dkdv();
    hop_dkdv();
    CHECK(cudaDeviceSynchronize());
    return 0;
  }
  cudaEvent_t a, z;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&z));
  const auto timeit = [&](auto f) {
    std::vector<float> ms;
    for (int r = 0; r < 21; ++r) {
      cudaEventRecord(a);
      f();
      cudaEventRecord(z);
      cudaEventSynchronize(z);
      float t = 0.f;
      cudaEventElapsedTime(&t, a, z);
      if (r > 0) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const double flops = 4.0 * 2 * 64 * 64 * D * static_cast<double>(K) * rows; // dk/dv's four products
  std::vector<uint16_t> h1(elems), h2(elems);
  const auto compare = [&](const char* name, const uint16_t* x, const uint16_t* y) {
    if (cudaMemcpy(h1.data(), x, elems * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(h2.data(), y, elems * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
      return std::printf("copy failed\n"), void();
    double num = 0, den = 0;
    int64_t nan = 0, diff = 0;
    for (int64_t e = 0; e < elems; ++e) {
      const double r = bf16_to_float(h1[e]), t = bf16_to_float(h2[e]);
      if (std::isnan(t) || std::isnan(r)) ++nan;
      num += (t - r) * (t - r);
      den += r * r;
      diff += h1[e] != h2[e];
    }
    std::printf("  %s: rel. error %.2e, %lld of %lld elements differ, %lld NaN\n", name,
                std::sqrt(num / std::max(den, 1e-30)), (long long)diff, (long long)elems, (long long)nan);
  };
  for (int round = 0; round < 2; ++round) {
    const float tb = timeit([&] { (void)library(); }), tl = timeit(lib_dkdv), th = timeit(hop_dkdv);
    std::printf("round %d: library backward %.3f ms | dk/dv: portable %.3f ms (%.0f TFLOP/s), Hopper %.3f (%.0f)\n",
                round, tb, tl, flops / tl * 1e-9, th, flops / th * 1e-9);
  }
  CHECK(cudaGetLastError());
  // The portable kernel's dk, dv (poisoned first), then the Hopper kernel's into the library's outputs.
  CHECK(cudaMemset(dk2, 0xff, elems * 2));
  CHECK(cudaMemset(dv2, 0xff, elems * 2));
  lib_dkdv();
  CHECK(cudaDeviceSynchronize());
  bp.dk = gd::make_operand(view(dk));
  bp.dv = gd::make_operand(view(dv));
  CHECK(cudaMemset(dk, 0xff, elems * 2));
  CHECK(cudaMemset(dv, 0xff, elems * 2));
  hop_dkdv();
  CHECK(cudaDeviceSynchronize());
  std::printf("Hopper kernel against the portable one:\n");
  compare("dk", dk2, dk);
  compare("dv", dv2, dv);
  return 0;
}
