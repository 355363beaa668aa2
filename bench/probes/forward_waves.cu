// Probe (not part of the build): how the sparse forward's time grows with its block count, to see what the last,
// partial wave of blocks costs (bench/NOTES.md, v42). The forward runs a block a (query tile, head), four blocks an SM
// at D = 128 on Hopper, so wan2.1-1.3b-480p's 12 heads are 7,488 blocks, 14.2 waves of 528 on 132 SMs. Here the same
// grid with 8 to 16 heads (uniform random lists of 63 tiles, bf16): were the time linear in the heads, the last wave
// would cost its share only; if it steps at whole waves, a partial one costs a whole one. fastvideo-bench-49k's grid
// (no partial tiles, 768 tiles a head, 77 picks) likewise.
//
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -arch=sm_90a -I include -o forward_waves bench/probes/forward_waves.cu
//   ./forward_waves
#include "vsa/vsa.hpp"

#include "probe_inputs.hpp"

#include <cstdio>
#include <vector>

namespace {

// ms of the forward of problem p with K picks a query tile, or a negative figure where a call failed.
float forward_ms(vsa::problem p, int64_t K) {
  const int64_t n = vsa::tile_geometry(p.grid).num_tiles(), S = n * 64, D = p.head_dim;
  const int64_t elems = p.batch * S * p.q_heads * D, rows = p.batch * p.q_heads * n;
  std::vector<int32_t> count(rows, static_cast<int32_t>(K));
  const int32_t* q2k = probe::to_device(probe::uniform_q2k(rows, n, K));
  const int32_t* cnt = probe::to_device(count);
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float* lse = nullptr;
  if (!q2k || !cnt || cudaMalloc(&q, elems * 2) || cudaMalloc(&k, elems * 2) || cudaMalloc(&v, elems * 2) ||
      cudaMalloc(&o, elems * 2) || cudaMalloc(&lse, rows * 64 * 4))
    return -1.f;
  const unsigned fill_blocks = static_cast<unsigned>((elems + 255) / 256);
  probe::fill<vsa::gpu::bf16_type><<<fill_blocks, 256>>>(static_cast<uint16_t*>(q), elems, 1u, 1.f);
  probe::fill<vsa::gpu::bf16_type><<<fill_blocks, 256>>>(static_cast<uint16_t*>(k), elems, 2u, 1.f);
  probe::fill<vsa::gpu::bf16_type><<<fill_blocks, 256>>>(static_cast<uint16_t*>(v), elems, 3u, 1.f);
  const auto view = [&](void* d) { return vsa::bshd<void*>(d, p.batch, S, p.q_heads, D); };
  const vsa::const_index_lists idx{q2k, cnt, K};
  const float scale = 1.f / std::sqrt(float(D));
  bool ok = true;
  const float ms = probe::median_ms([&] {
    ok = ok && vsa::sparse_attention_forward(p, scale, as_const(view(q)), as_const(view(k)), as_const(view(v)), idx,
                                             view(o), lse, nullptr);
  });
  ok = ok && cudaDeviceSynchronize() == cudaSuccess;
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(lse);
  cudaFree(const_cast<int32_t*>(q2k)), cudaFree(const_cast<int32_t*>(cnt));
  return ok ? ms : -1.f;
}

void sweep(const char* name, vsa::problem p, int64_t K, int sms) {
  const int64_t n = vsa::tile_geometry(p.grid).num_tiles();
  std::printf("%s (%lld tiles a head, %lld picks):\n", name, (long long)n, (long long)K);
  for (int heads = 8; heads <= 16; ++heads) {
    p.q_heads = p.kv_heads = heads;
    const float ms = forward_ms(p, K);
    const double waves = double(n * heads) / (4.0 * sms);
    std::printf("  heads %2d: %7.3f ms, %.4f ms a head, %5.2f waves, %.4f ms a wave\n", heads, ms, ms / heads, waves,
                ms / waves);
  }
}

} // namespace

int main() {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) return 1;
  vsa::problem p = probe::wan21();
  sweep("wan2.1-1.3b-480p grid", p, 63, sms);
  p.grid = {48, 32, 32};
  sweep("fastvideo-bench-49k grid", p, 77, sms);
  return 0;
}
