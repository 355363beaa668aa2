// Probe (not part of the build): the forward on the joint schedule against the one-grid pass, for the banded forward
// of the mma.sync backend (bench/NOTES.md, v30 and v31). On one grid at a time: the sparse pass twice, the packed pass
// (packed_attention.hpp: the joint schedule with no extra tiles) of a batch of that grid alone twice, their outputs
// compared bit for bit, and written to $OUT for a comparison across builds; then the joint forward with one extra
// token first, and which rows of o it leaves unwritten (poisoned before the call). Build it twice for sm_80, once as
// the table stands and once with the mma.sync table's forward at two bands (bands = {2, 1}, min_blocks = {4, 3}),
// and run each with a tag:
//
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -arch=sm_80 -I include -o banded_joint bench/probes/banded_joint.cu
//   OUT=out ./banded_joint off
#include "probe_inputs.hpp"

#include <vsa/vsa.hpp>
#include <vsa/gpu/packed_attention.hpp>
#include <vsa/gpu/joint_attention.hpp>
#include <cuda_runtime.h>
#include <cstdio>
#include <cmath>
#include <vector>
#include <random>
#include <algorithm>
#include <numeric>
#include <cstring>
#include <string>
static const char* g_tag = "x";
using namespace vsa;
#define CK(x)                                                                                                          \
  do {                                                                                                                 \
    auto e_ = (x);                                                                                                     \
    if (e_ != cudaSuccess) {                                                                                           \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));                                                \
      return 1;                                                                                                        \
    }                                                                                                                  \
  } while (0)
#define CS(x)                                                                                                          \
  do {                                                                                                                 \
    status s_ = (x);                                                                                                   \
    if (!s_) {                                                                                                         \
      printf("%s:%d %s\n", __FILE__, __LINE__, s_.message());                                                          \
      return 1;                                                                                                        \
    }                                                                                                                  \
  } while (0)
int run(grid3 grid, int64_t D, int64_t hq, int64_t hkv, int64_t cap) {
  problem p;
  p.batch = 1;
  p.q_heads = hq;
  p.kv_heads = hkv;
  p.head_dim = D;
  p.grid = grid;
  p.type = dtype::bf16;
  const tile_geometry geo(grid);
  const int64_t n = geo.num_tiles(), S = geo.tiled_tokens(), rows = hq * n;
  std::vector<int32_t> q2k(rows * cap, -1), count(rows);
  std::mt19937_64 g(11);
  std::vector<int32_t> perm(n);
  for (int64_t r = 0; r < rows; ++r) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), g);
    const int64_t c = r % 7 == 3 ? 0 : 1 + g() % cap;
    std::sort(perm.begin(), perm.begin() + c);
    std::copy(perm.begin(), perm.begin() + c, q2k.begin() + r * cap);
    count[r] = (int32_t)c;
  }
  int32_t *dq2k, *dcount;
  CK(cudaMalloc(&dq2k, q2k.size() * 4));
  CK(cudaMalloc(&dcount, count.size() * 4));
  CK(cudaMemcpy(dq2k, q2k.data(), q2k.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dcount, count.data(), count.size() * 4, cudaMemcpyHostToDevice));
  const const_index_lists idx{dq2k, dcount, cap, nullptr, nullptr};
  const int64_t eq = S * hq * D, ek = S * hkv * D;
  uint16_t *q, *k, *v, *o[4];
  float* lse[4];
  CK(cudaMalloc(&q, eq * 2));
  CK(cudaMalloc(&k, ek * 2));
  CK(cudaMalloc(&v, ek * 2));
  for (int r = 0; r < 4; ++r) {
    CK(cudaMalloc(&o[r], eq * 2));
    CK(cudaMemset(o[r], 0xff, eq * 2));
    CK(cudaMalloc(&lse[r], rows * 64 * 4));
    CK(cudaMemset(lse[r], 0xff, rows * 256));
  }
  probe::fill<gpu::bf16_type><<<(eq + 255) / 256, 256>>>(q, eq, 1, 1.f);
  probe::fill<gpu::bf16_type><<<(ek + 255) / 256, 256>>>(k, ek, 2, 1.f);
  probe::fill<gpu::bf16_type><<<(ek + 255) / 256, 256>>>(v, ek, 3, 1.f);
  // zero padding slots? the kernels mask them; leave random.
  const auto view = [&](void* d, int64_t h) { return bshd<void*>(d, 1, S, h, D); };
  const float scale = 1.f / std::sqrt(float(D));
  packed_problem pp;
  pp.q_heads = hq;
  pp.kv_heads = hkv;
  pp.head_dim = D;
  pp.grids = &grid;
  pp.samples = 1;
  const std::size_t wb = packed_sparse_attention_forward_workspace(pp);
  void* ws;
  CK(cudaMalloc(&ws, wb));
  for (int r = 0; r < 2; ++r)
    CS(sparse_attention_forward(p, scale, as_const(view(q, hq)), as_const(view(k, hkv)), as_const(view(v, hkv)), idx,
                                view(o[r], hq), lse[r], nullptr));
  for (int r = 2; r < 4; ++r)
    CS(packed_sparse_attention_forward(pp, scale, as_const(view(q, hq)), as_const(view(k, hkv)), as_const(view(v, hkv)),
                                       idx, view(o[r], hq), lse[r], ws, wb, nullptr));
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> h[4];
  std::vector<float> l[4];
  for (int r = 0; r < 4; ++r) {
    h[r].resize(eq);
    l[r].resize(rows * 64);
    CK(cudaMemcpy(h[r].data(), o[r], eq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(l[r].data(), lse[r], rows * 256, cudaMemcpyDeviceToHost));
  }
  const auto cmp = [&](int a, int b, const char* what) {
    int64_t diff = 0, poison = 0, first = -1;
    double mx = 0;
    for (int64_t e = 0; e < eq; ++e) {
      if (h[b][e] == 0xffff) ++poison;
      if (h[a][e] != h[b][e]) {
        if (first < 0) first = e;
        ++diff;
        mx = std::max(mx, (double)std::fabs(bf16_to_float(h[a][e]) - bf16_to_float(h[b][e])));
      }
    }
    int64_t ld = 0;
    for (int64_t r = 0; r < rows * 64; ++r) ld += std::memcmp(&l[a][r], &l[b][r], 4) != 0;
    printf("  %s: %lld of %lld elements differ (max %.3g), %lld poisoned in %d, lse %lld differ", what, (long long)diff,
           (long long)eq, mx, (long long)poison, b, (long long)ld);
    if (first >= 0) {
      const int64_t tok = first / (hq * D), hh = (first / D) % hq, d = first % D;
      printf("; first: slot %lld (tile %lld row %lld) head %lld col %lld", (long long)tok, (long long)tok / 64,
             (long long)tok % 64, (long long)hh, (long long)d);
    }
    printf("\n");
  };
  printf("grid %lldx%lldx%lld D%lld Hq%lld Hkv%lld cap %lld\n", (long long)grid.t, (long long)grid.h, (long long)grid.w,
         (long long)D, (long long)hq, (long long)hkv, (long long)cap);
  cmp(0, 1, "sparse twice");
  cmp(2, 3, "packed twice");
  cmp(0, 2, "sparse vs packed");
  const std::string base = std::string(getenv("OUT") ? getenv("OUT") : ".") + "/" + std::to_string(grid.t) + "x" +
                           std::to_string(grid.h) + "x" + std::to_string(grid.w) + "-D" + std::to_string(D) + "-" +
                           g_tag;
  for (int r : {0, 2}) {
    FILE* f = fopen((base + (r == 0 ? "-sparse.bin" : "-packed.bin")).c_str(), "wb");
    if (f) {
      fwrite(h[r].data(), 2, eq, f);
      fclose(f);
    }
  }
  // The joint forward with one extra token first: rows left unwritten.
  {
    const extra_tokens ex{1, true};
    const int64_t St = S + 1, et = St * hq * D, etk = St * hkv * D;
    uint16_t *jq, *jk, *jv, *jo;
    float* jl;
    CK(cudaMalloc(&jq, et * 2));
    CK(cudaMalloc(&jk, etk * 2));
    CK(cudaMalloc(&jv, etk * 2));
    CK(cudaMalloc(&jo, et * 2));
    CK(cudaMalloc(&jl, hq * St * 4));
    probe::fill<gpu::bf16_type><<<(et + 255) / 256, 256>>>(jq, et, 5, 1.f);
    probe::fill<gpu::bf16_type><<<(etk + 255) / 256, 256>>>(jk, etk, 6, 1.f);
    probe::fill<gpu::bf16_type><<<(etk + 255) / 256, 256>>>(jv, etk, 7, 1.f);
    CK(cudaMemset(jo, 0xff, et * 2));
    const std::size_t jb = joint_sparse_attention_forward_workspace(p, ex);
    void* jw;
    CK(cudaMalloc(&jw, jb));
    const auto jview = [&](void* d, int64_t hh) { return bshd<void*>(d, 1, St, hh, D); };
    CS(joint_sparse_attention_forward(p, ex, scale, as_const(jview(jq, hq)), as_const(jview(jk, hkv)),
                                      as_const(jview(jv, hkv)), idx, jview(jo, hq), jl, jw, jb, nullptr));
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> ho(et);
    CK(cudaMemcpy(ho.data(), jo, et * 2, cudaMemcpyDeviceToHost));
    int64_t unwritten = 0;
    std::vector<int64_t> per_row(64, 0), per_head(hq, 0), per_tile(n + 2, 0);
    for (int64_t e = 0; e < et; ++e)
      if (ho[e] == 0xffff) {
        ++unwritten;
        const int64_t tok = e / (hq * D), hh = (e / D) % hq;
        per_head[hh]++;
        if (tok >= 1) {
          per_row[(tok - 1) % 64]++;
          per_tile[(tok - 1) / 64]++;
        }
      }
    printf("  joint E=1 first: %lld of %lld elements unwritten\n", (long long)unwritten, (long long)et);
    if (unwritten) {
      printf("   by row in tile:");
      for (int r = 0; r < 64; ++r)
        if (per_row[r]) printf(" %d:%lld", r, (long long)per_row[r]);
      printf("\n");
      printf("   by head:");
      for (int hh = 0; hh < hq; ++hh) printf(" %lld", (long long)per_head[hh]);
      printf("\n");
      printf("   by tile:");
      for (int64_t t = 0; t < n; ++t) printf(" %lld", (long long)per_tile[t]);
      printf("\n");
    }
  }
  return 0;
}
int main(int argc, char** argv) {
  if (argc > 1) g_tag = argv[1];
  int r = 0;
  r |= run({5, 6, 7}, 64, 4, 2, 3);
  r |= run({9, 10, 11}, 64, 4, 2, 9);
  r |= run({8, 8, 8}, 64, 4, 2, 3);
  r |= run({5, 6, 7}, 128, 4, 2, 3);
  return r;
}
