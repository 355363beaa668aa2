// Probe (not part of the build): the floor the K/V tile stream sets for the Hopper sparse forward on the
// wan2.1-1.3b-480p shape (bench/NOTES.md, v14). Every (query tile, head) walks a list of 63 distinct key tiles
// out of 624, uniform at random as in the benchmark, and for each entry the copy engine brings its K and V
// tiles (2 × 16 KB) from memory into shared memory: 471,744 pairs, 15.5 GB, nearly all from L2 (one head's K
// and V are 20 MB). No products are computed; a consumer warp waits for each tile and gives its stage back.
// The block shape is the forward's (two query tiles a block, one ring of stages each), with the ring's depth
// varied, so the figure is what the copy engine and L2 can deliver to that structure.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -I include -o kv_stream bench/probes/kv_stream.cu && ./kv_stream
#include <vsa/gpu/arch/matrix.hpp>

#include "probe_check.hpp"
#include "probe_stream.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

using vsa::gpu::smem_tile;
using vsa::gpu::tma_map;

constexpr int N = 624, H = 12, D = 128, K = 63;

// Streams a block runs (each a query tile's list), and tiles in flight per stream (K and V alternate).
template <int Streams, int Tiles> __global__ void __launch_bounds__(32 * (Streams + 1), 1)
    stream_kernel(const __grid_constant__ tma_map kmap, const __grid_constant__ tma_map vmap, const int32_t* lists,
                  unsigned* sink) {
#if VSA_WGMMA
  probe::stream_block<Streams, Tiles, D, N, K>(
      lists, sink, [&](smem_tile<D> t, int value, int j, int h, uint64_t* bar) {
        vsa::gpu::tma::load_tile<D>(t, value ? &vmap : &kmap, bar, j * 64, h, 0);
      });
#else
  (void)kmap, (void)vmap, (void)lists, (void)sink;
#endif
}

template <int Streams, int Tiles> int run(const tma_map& km, const tma_map& vm, const int32_t* lists, unsigned* sink) {
  const auto kernel = stream_kernel<Streams, Tiles>;
  const int smem = Streams * Tiles * 64 * D * 2 + 1024;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(N / Streams, H);
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r < 25; ++r) {
    CHECK(cudaEventRecord(a));
    kernel<<<grid, 32 * (Streams + 1), smem>>>(km, vm, lists, sink);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (r >= 5) ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  const double t = ms[ms.size() / 2], bytes = double(N) * H * K * 2 * 64 * D * 2;
  std::printf("streams %d, tiles in flight a stream %d (%3d KB): %.3f ms, %.2f TB/s\n", Streams, Tiles, smem / 1024, t,
              bytes / t / 1e9);
  return 0;
}

int main() {
  const size_t elems = size_t(N) * 64 * H * D;
  uint16_t *k, *v;
  int32_t* lists;
  unsigned* sink;
  CHECK(cudaMalloc(&k, elems * 2));
  CHECK(cudaMalloc(&v, elems * 2));
  CHECK(cudaMemset(k, 0x3c, elems * 2));
  CHECK(cudaMemset(v, 0x3c, elems * 2));
  CHECK(cudaMalloc(&sink, 4));
  std::vector<int32_t> host(size_t(H) * N * K);
  std::mt19937 rng(7);
  std::vector<int32_t> all(N);
  for (int i = 0; i < N; ++i) all[i] = i;
  for (size_t row = 0; row < size_t(H) * N; ++row) {
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + K, host.begin() + row * K);
  }
  CHECK(cudaMalloc(&lists, host.size() * 4));
  CHECK(cudaMemcpy(lists, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  tma_map km, vm; // [1, S, H, D], token stride H·D
  if (!vsa::gpu::encode_tile_map(km, k, 1, N * 64, H, D, elems, H * D, D) ||
      !vsa::gpu::encode_tile_map(vm, v, 1, N * 64, H, D, elems, H * D, D)) {
    std::printf("tensor maps did not encode\n");
    return 1;
  }
  int rc = 0;
  rc |= run<2, 4>(km, vm, lists, sink);
  rc |= run<2, 5>(km, vm, lists, sink);
  rc |= run<2, 6>(km, vm, lists, sink);
  rc |= run<2, 7>(km, vm, lists, sink);
  rc |= run<3, 4>(km, vm, lists, sink);
  return rc;
}
