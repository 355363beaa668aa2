// Probe (not part of the build): how fast an atomic-dq backward could add its dq contributions on the
// wan2.1-1.3b-480p shape (bench/NOTES.md, v12). Each (key tile, head) block visits 63 query tiles, as a dk/dv
// block walks its k2q list, and adds a 64 × 128 fp32 tile into an fp32 dq accumulator for each: 471,744 tiles,
// 15.5 GB of reduce-adds. No products are computed: the figure is the floor the adds alone set.
//
//   nvcc -O3 -arch=sm_90a -o dq_reduce bench/probes/dq_reduce.cu && ./dq_reduce
//
// Variants: red.global.add.v2.f32 from registers in the accumulator layout of a 64-row tile; the tile written
// to shared memory and added by the copy engine as one 32 KB bulk reduce (its 64 rows are contiguous in the
// accumulator); the shared-memory writes alone. Each variant's result is checked: element (row, column) of
// query tile i holds (times i was picked) × 10⁻³ × (column mod 8).
#include "probe_check.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

constexpr int N = 624, H = 12, D = 128, K = 63; // tiles, heads, head dim, query tiles per key tile

__device__ __forceinline__ float value(int col) { return 1e-3f * static_cast<float>(col & 7); }

// Thread t of warp w holds rows 16w + l/4 and 16w + l/4 + 8, columns 8c + 2(l mod 4) and the next (l = t mod 32).
__global__ void __launch_bounds__(128) add_from_registers(float* acc, const int* lists) {
  const int j = blockIdx.x, h = blockIdx.y, w = threadIdx.x / 32, l = threadIdx.x % 32;
  for (int e = 0; e < K; ++e) {
    const int i = lists[(h * N + j) * K + e];
    float* base = acc + (static_cast<size_t>(h) * N * 64 + static_cast<size_t>(i) * 64 + w * 16 + l / 4) * D;
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
      const int col = 8 * c + 2 * (l % 4);
      const float v0 = value(col), v1 = value(col + 1);
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(base + col), "f"(v0), "f"(v1) : "memory");
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(base + 8 * D + col), "f"(v0), "f"(v1) : "memory");
    }
  }
}

// Two shared tiles in turn: before a tile is rewritten, the bulk add issued from it two steps earlier has read it.
__global__ void __launch_bounds__(128) add_in_bulk(float* acc, const int* lists, int reduce) {
  __shared__ __align__(128) float tile[2][64 * D];
  const int j = blockIdx.x, h = blockIdx.y, t = threadIdx.x;
  for (int e = 0; e < K; ++e) {
    const int i = lists[(h * N + j) * K + e], b = e & 1;
    if (t == 0 && reduce) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    __syncthreads();
    for (int x = t; x < 64 * D; x += 128) tile[b][x] = value(x % D);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (t == 0 && reduce) {
      float* dst = acc + (static_cast<size_t>(h) * N * 64 + static_cast<size_t>(i) * 64) * D;
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
                   "r"(static_cast<uint32_t>(__cvta_generic_to_shared(tile[b]))), "r"(64 * D * 4)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (t == 0 && reduce) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
  // Uniform random lists: 63 distinct query tiles per (head, key tile), and how often each query tile is picked.
  std::vector<int> lists(static_cast<size_t>(H) * N * K), picks(static_cast<size_t>(H) * N, 0), perm(N);
  std::mt19937 g(7);
  for (int r = 0; r < H * N; ++r) {
    for (int x = 0; x < N; ++x) perm[x] = x;
    for (int t = 0; t < K; ++t) std::swap(perm[t], perm[t + g() % (N - t)]);
    for (int t = 0; t < K; ++t) {
      lists[static_cast<size_t>(r) * K + t] = perm[t];
      ++picks[(r / N) * N + perm[t]];
    }
  }
  const size_t elems = static_cast<size_t>(H) * N * 64 * D;
  int* dev_lists = nullptr;
  float* acc = nullptr;
  CHECK(cudaMalloc(&dev_lists, lists.size() * sizeof(int)));
  CHECK(cudaMalloc(&acc, elems * sizeof(float)));
  CHECK(cudaMemcpy(dev_lists, lists.data(), lists.size() * sizeof(int), cudaMemcpyHostToDevice));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const double bytes = static_cast<double>(H) * N * K * 64 * D * sizeof(float);
  const char* names[3] = {"red.global.add.v2.f32 from registers", "bulk reduce of 32 KB from shared memory",
                          "shared-memory writes alone"};
  std::vector<float> host(elems);
  int failed = 0;
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<float> ms;
    for (int rep = 0; rep < 12; ++rep) { // the first is a warm-up; the median of the rest is reported
      CHECK(cudaMemset(acc, 0, elems * sizeof(float)));
      CHECK(cudaEventRecord(start));
      if (variant == 0)
        add_from_registers<<<dim3(N, H), 128>>>(acc, dev_lists);
      else
        add_in_bulk<<<dim3(N, H), 128>>>(acc, dev_lists, variant == 1);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float t = 0.f;
      CHECK(cudaEventElapsedTime(&t, start, stop));
      if (rep > 0) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const float median = ms[ms.size() / 2];
    double worst = 0.0;
    if (variant < 2) {
      CHECK(cudaMemcpy(host.data(), acc, elems * sizeof(float), cudaMemcpyDeviceToHost));
      for (size_t x = 0; x < elems; ++x) {
        const size_t tile = x / (64 * D); // head · N + query tile
        const double want = picks[tile] * 1e-3 * static_cast<double>(static_cast<float>(x % D % 8));
        const double got = host[x];
        const double err = std::fabs(got - want) / std::max(1e-6, std::fabs(want));
        if (!(err <= worst)) worst = std::isnan(err) ? INFINITY : err;
      }
      if (!(worst < 1e-4)) ++failed;
    }
    std::printf("%-42s %.3f ms  %.2f TB/s of adds (%.1f GB)  max rel. error %.1e\n", names[variant], median,
                bytes / (median * 1e-3) / 1e12, bytes / 1e9, worst);
  }
  std::printf(failed ? "CHECK FAILED\n" : "sums checked\n");
  return failed;
}
