// The probes' inputs: the wan2.1-1.3b-480p problem (bf16, D = 128) and hd64-32k (D = 64), uniform random q2k lists of a
// tenth of the tiles, and random 16-bit elements written on the device; and their timing: the median of 20 runs after
// one.
#pragma once

#include "vsa/vsa.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace probe {

inline vsa::problem wan21() {
  vsa::problem p;
  p.batch = 1;
  p.q_heads = p.kv_heads = 12;
  p.head_dim = 128;
  p.grid = {21, 30, 52};
  p.type = vsa::dtype::bf16;
  return p;
}

// hd64-32k: 16 heads of head dim 64 over a 32 × 32 × 32 grid (no partial tiles).
inline vsa::problem hd64() {
  vsa::problem p = wan21();
  p.q_heads = p.kv_heads = 16;
  p.head_dim = 64;
  p.grid = {32, 32, 32};
  return p;
}

// K sorted distinct key tiles of n for each of `rows` query rows, row after row.
inline std::vector<int32_t> uniform_q2k(int64_t rows, int64_t n, int64_t K) {
  std::vector<int32_t> q2k(rows * K), perm(n);
  std::mt19937_64 g(7);
  for (int64_t r = 0; r < rows; ++r) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t t = 0; t < K; ++t) std::swap(perm[t], perm[t + g() % (n - t)]);
    std::sort(perm.begin(), perm.begin() + K);
    std::copy(perm.begin(), perm.begin() + K, q2k.begin() + r * K);
  }
  return q2k;
}

// x[i] = amp · u, u uniform in [-1, 1) from a hash of i and seed, rounded to E.
template <class E> __global__ void fill(uint16_t* x, int64_t n, uint32_t seed, float amp) {
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

// A device copy of h (never freed: a probe's arrays live as long as it does), or null if the runtime failed.
template <class T> T* to_device(const std::vector<T>& h) {
  void* d = nullptr;
  if (cudaMalloc(&d, h.size() * sizeof(T)) != cudaSuccess) return nullptr;
  if (cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess) return nullptr;
  return static_cast<T*>(d);
}

// Prints how far the n bf16 elements at test (device) are from those at ref (device): relative L2 error, how many
// differ bitwise, how many are NaN in either.
inline void compare_bf16(const char* name, const uint16_t* ref, const uint16_t* test, int64_t n) {
  std::vector<uint16_t> h1(n), h2(n);
  if (cudaMemcpy(h1.data(), ref, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(h2.data(), test, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
    std::printf("copy failed\n");
    return;
  }
  double num = 0, den = 0;
  int64_t nan = 0, diff = 0;
  for (int64_t e = 0; e < n; ++e) {
    const double r = vsa::bf16_to_float(h1[e]), t = vsa::bf16_to_float(h2[e]);
    if (std::isnan(t) || std::isnan(r)) ++nan;
    num += (t - r) * (t - r);
    den += r * r;
    diff += h1[e] != h2[e];
  }
  std::printf("  %s: rel. error %.2e, %lld of %lld elements differ, %lld NaN\n", name,
              std::sqrt(num / std::max(den, 1e-30)), (long long)diff, (long long)n, (long long)nan);
}

// Milliseconds of f() on the default stream, the median of 20 runs after a first one.
template <class F> float median_ms(F f) {
  cudaEvent_t a, z;
  cudaEventCreate(&a);
  cudaEventCreate(&z);
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
  cudaEventDestroy(a);
  cudaEventDestroy(z);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

} // namespace probe
