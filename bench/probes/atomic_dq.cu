// Probe (not part of the build): an atomic-dq sparse backward against the library's deterministic one, on the
// wan2.1-1.3b-480p shape (bf16, D = 128, uniform random lists of 63 key tiles), H200 / sm_90a only. Issue 4 asks
// for such a variant as an option if it is faster; this measured it slower (bench/NOTES.md, v12).
//
// The variant folds dq into the dk/dv kernel, as FlashAttention-3 does: each (key tile, query tile) pair writes
// its dSᵀ to shared memory in bf16, forms dS·K (64 × 128, two wgmma chains of n64 reading dSᵀ transposed), stages
// it in fp32 and adds it to an fp32 dq accumulator with one 32 KB bulk reduce-add of the copy engine, which
// overlaps the next pair's products. Order, delta and the dk/dv loop are the library's; a last pass rounds dq.
// Checked against the library: dq within rounding (the adds land in any order), dk and dv bitwise equal.
//
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -arch=sm_90a -I include -o atomic_dq bench/probes/atomic_dq.cu
#include "vsa/vsa.hpp"
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

using namespace vsa;
namespace gd = vsa::gpu::detail;
#define CK(x)                                                                                                          \
  do {                                                                                                                 \
    auto e_ = (x);                                                                                                     \
    if (e_ != cudaSuccess) {                                                                                           \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));                                                \
      exit(1);                                                                                                         \
    }                                                                                                                  \
  } while (0)
#define CS(x)                                                                                                          \
  do {                                                                                                                 \
    status s_ = (x);                                                                                                   \
    if (!s_) {                                                                                                         \
      printf("%s:%d %s\n", __FILE__, __LINE__, s_.message());                                                          \
      exit(1);                                                                                                         \
    }                                                                                                                  \
  } while (0)

constexpr int D = 128;
using E = gpu::bf16_type;
using M = gpu::attention_mma<E, D>;
using Plan = gpu::smem_plan<D>;
constexpr int base_bytes_raw = (2 + 2 * 1) * 64 * D * 2 + 2 * 128 * 4; // K, V, Q, dO, stats (one stage)
constexpr int sds_off = (base_bytes_raw + 1023) / 1024 * 1024;
constexpr int stage_off = sds_off + 8192;
constexpr int smem_total = stage_off + 64 * D * 4 + 1024;

__global__ void __launch_bounds__(128)
    dkdv_atomic(const __grid_constant__ gd::backward_params p, gd::sparse_schedule s, float* dq_acc) {
#if VSA_WGMMA
  constexpr int nthreads = 128;
  constexpr float log2e = 1.4426950408889634f;
  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = gpu::aligned_smem(smem_raw);
  const gpu::smem_tile<D> sk{sm}, sv{sm + 64 * D};
  const auto sq = [&](int) { return gpu::smem_tile<D>{sm + 2 * 64 * D}; };
  const auto sdo = [&](int) { return gpu::smem_tile<D>{sm + 3 * 64 * D}; };
  float* stats = reinterpret_cast<float*>(sm + 4 * 64 * D);
  const gpu::smem_tile<D> sds{sm + sds_off / 2};
  float* stage = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sm) + stage_off);

  int64_t j = blockIdx.x, hk = 0, b = 0;
  {
    const int64_t item = p.order[blockIdx.x];
    j = item % s.tiles;
    hk = (item / s.tiles) % p.kv_heads;
    b = item / s.tiles / p.kv_heads;
  }
  const int tid = threadIdx.x, row0 = (tid / 32) * 16;
  const int kv = s.valid(j);
  const int64_t rows_total = s.rows_total();
  gpu::copy_tile(sk, p.k.tile(b, hk, j), p.k.token, kv, tid, nthreads);
  gpu::copy_tile(sv, p.v.tile(b, hk, j), p.v.token, kv, tid, nthreads);
  const auto locate = [&](int g, int64_t& begin, int64_t& end) {
    s.range(b * p.q_heads + hk * p.group + g, j, begin, end);
  };
  __shared__ __align__(8) uint64_t q_ready;
  gpu::tma::tile_pair q_pair{&q_ready, 0u};
  gpu::tma::init_barriers(&q_ready, 1, true, tid);
  const auto load_q = [&](int g, int64_t pos) {
    const int64_t h = hk * p.group + g, i = s.at(pos), bh = b * p.q_heads + h;
    const int qv = s.valid(i);
    if (tid == 0) q_pair.load<D>(sq(0), &p.q_map, sdo(0), &p.do_map, i * 64, h, b);
    if (tid < 64) {
      const bool live = tid < qv;
      stats[tid] = live ? p.lse[bh * rows_total + i * 64 + tid] * log2e : __builtin_huge_valf();
      stats[64 + tid] = live ? p.delta[bh * rows_total + i * 64 + tid] : 0.f;
    }
  };
  typename M::out_tile dk, dv;
#pragma unroll
  for (int e = 0; e < M::out_elems; ++e) dk.x[e] = 0.f, dv.x[e] = 0.f;
  int g = 0;
  int64_t pos = 0, end = 0;
  locate(0, pos, end);
  while (pos == end && ++g < p.group) locate(g, pos, end);
  if (g < p.group) load_q(g, pos);
  gpu::copy_commit();
  gpu::copy_wait<0>();
  if (g < p.group) q_pair.wait<D>(sq(0), sdo(0), s.valid(s.at(pos)), tid, nthreads);
  __syncthreads();
  while (g < p.group) {
    int ng = g;
    int64_t npos = pos + 1, nend = end;
    while (npos == nend && ++ng < p.group) locate(ng, npos, nend);
    const int64_t cur_i = s.at(pos), cur_bh = b * p.q_heads + hk * p.group + g;
    typename M::score_tile st, dp;
#pragma unroll
    for (int e = 0; e < M::score_elems; ++e) st.x[e] = 0.f, dp.x[e] = 0.f;
    M::nt(st, sk, row0, sq(0));
    M::nt(dp, sv, row0, sdo(0));
#pragma unroll
    for (int e = 0; e < M::score_elems; ++e) {
      const int c = M::elem_col(e);
      const float pr = gpu::fast_exp2(st.x[e] * p.scale_log2 - stats[c]);
      st.x[e] = pr;
      dp.x[e] = pr * (dp.x[e] - stats[64 + c]);
    }
    M::nn(dv, st, sdo(0));
    M::nn(dk, dp, sq(0));
    // dSᵀ (rows keys, columns queries) into sds's first panel, rounded to bf16.
#pragma unroll
    for (int e = 0; e < M::score_elems; e += 2) {
      const int r = row0 + M::elem_row(e), c = M::elem_col(e);
      *reinterpret_cast<uint32_t*>(sds.at(r, c)) = E::pack(dp.x[e], dp.x[e + 1]);
    }
    gpu::stores_to_matrix_fence();
    if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); // the stage's last reduce has read it
    __syncthreads();
    // dQ part (64 queries × D) = dS · K in two halves of 64 columns, into the fp32 stage.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      typename M::score_tile acc;
      gpu::wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        gpu::wgmma::mma_ss<true, 64, 1, 1>(
            acc.x, gpu::wgmma::descriptor(sds.base, gpu::wgmma_layout::mn_major_panel(0, kk)),
            M::mn_major(gpu::smem_tile<D>{sk.base + half * gpu::smem_layout::panel}, kk), kk > 0 ? 1 : 0);
      gpu::wgmma::commit();
      gpu::wgmma::wait<0>();
      gpu::wgmma::pin(acc.x);
#pragma unroll
      for (int e = 0; e < M::score_elems; e += 2) {
        const int r = row0 + M::elem_row(e), c = half * 64 + M::elem_col(e);
        *reinterpret_cast<float2*>(stage + r * D + c) = make_float2(acc.x[e], acc.x[e + 1]);
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads(); // every warp's products have read Q, dO, sds; the stage is complete
    if (tid == 0) {
      float* dst = dq_acc + (cur_bh * rows_total + cur_i * 64) * D;
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
                   "r"(static_cast<uint32_t>(__cvta_generic_to_shared(stage))), "r"(64 * D * 4)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      if (ng < p.group) load_q(ng, npos);
    } else if (ng < p.group) {
      load_q(ng, npos);
    }
    gpu::copy_commit();
    gpu::copy_wait<0>();
    if (ng < p.group) q_pair.wait<D>(sq(0), sdo(0), s.valid(s.at(npos)), tid, nthreads);
    __syncthreads();
    g = ng, pos = npos, end = nend;
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  const int64_t bhk = b * p.kv_heads + hk;
  gd::store_band<E, D, M, gd::sparse_schedule>(dk, p.scale, row0, kv, p.dk, p.dk.tile(b, hk, j), nullptr, nullptr,
                                               bhk * s.tiles + j);
  gd::store_band<E, D, M, gd::sparse_schedule>(dv, 1.f, row0, kv, p.dv, p.dv.tile(b, hk, j), nullptr, nullptr,
                                               bhk * s.tiles + j);
#endif
}

// dq = bf16(dq_acc · scale) on valid rows, 0 on padding rows; dq_acc [B·H, rows, D], dq [B, S, H, D].
__global__ void round_dq(const float* acc, uint16_t* dq, int64_t rows, int heads, float scale, gd::sparse_schedule s) {
  const int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; // one thread per 2 elements
  const int64_t total = (int64_t)heads * rows * D / 2;
  if (x >= total) return;
  const int64_t e = 2 * x, d = e % D, row = (e / D) % rows, h = e / D / rows;
  const bool live = (row % 64) < s.valid(row / 64);
  const float2 v = *reinterpret_cast<const float2*>(acc + e);
  *reinterpret_cast<uint32_t*>(dq + (row * heads + h) * D + d) = live ? E::pack(v.x * scale, v.y * scale) : 0u;
}

__global__ void fill(uint16_t* x, int64_t n, uint32_t seed) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t h = (uint32_t)i * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  h *= 3266489917u;
  h ^= h >> 16;
  x[i] = E::pack((h & 0xffff) / 32768.f - 1.f, 0.f) & 0xffff;
}

int main() {
  problem p;
  p.batch = 1;
  p.q_heads = p.kv_heads = 12;
  p.head_dim = D;
  p.grid = {21, 30, 52};
  p.type = dtype::bf16;
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), S = geo.tiled_tokens(), rows = p.q_heads * n, K = 63;
  const int64_t elems = S * p.q_heads * D;
  std::vector<int32_t> q2k(rows * K), count(rows, K), k2q(rows * K), offset(p.q_heads * (n + 1));
  std::mt19937_64 g(7);
  std::vector<int32_t> perm(n);
  for (int64_t r = 0; r < rows; ++r) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t t = 0; t < K; ++t) std::swap(perm[t], perm[t + g() % (n - t)]);
    std::sort(perm.begin(), perm.begin() + K);
    std::copy(perm.begin(), perm.begin() + K, q2k.begin() + r * K);
  }
  CS(reference::build_k2q(p, {q2k.data(), count.data(), K, k2q.data(), offset.data()}));
  int32_t *dq2k, *dcount, *dk2q, *doff;
  CK(cudaMalloc(&dq2k, q2k.size() * 4));
  CK(cudaMalloc(&dcount, count.size() * 4));
  CK(cudaMalloc(&dk2q, k2q.size() * 4));
  CK(cudaMalloc(&doff, offset.size() * 4));
  CK(cudaMemcpy(dq2k, q2k.data(), q2k.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dcount, count.data(), count.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk2q, k2q.data(), k2q.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(doff, offset.data(), offset.size() * 4, cudaMemcpyHostToDevice));
  const const_index_lists idx{dq2k, dcount, K, dk2q, doff};
  uint16_t *q, *k, *v, *o, *dO, *dq, *dk, *dv, *dq2, *dk2, *dv2;
  float *lse, *acc;
  for (uint16_t** b : {&q, &k, &v, &o, &dO, &dq, &dk, &dv, &dq2, &dk2, &dv2}) CK(cudaMalloc(b, elems * 2));
  CK(cudaMalloc(&lse, rows * 64 * 4));
  CK(cudaMalloc(&acc, elems * 4));
  uint32_t seed = 1;
  for (uint16_t* b : {q, k, v, dO}) fill<<<(elems + 255) / 256, 256>>>(b, elems, seed++ * 0x9e3779b9u);
  const auto view = [&](void* d) { return bshd<void*>(d, 1, S, p.q_heads, D); };
  const float scale = 1.f / std::sqrt(float(D));
  CS(sparse_attention_forward(p, scale, as_const(view(q)), as_const(view(k)), as_const(view(v)), idx, view(o), lse,
                              nullptr));
  std::size_t ws_bytes = 0;
  CS(sparse_attention_backward(p, scale, {}, {}, {}, {}, {}, nullptr, {}, {}, {}, {}, nullptr, ws_bytes, nullptr));
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  const auto lib = [&] {
    CS(sparse_attention_backward(p, scale, as_const(view(q)), as_const(view(k)), as_const(view(v)), as_const(view(o)),
                                 as_const(view(dO)), lse, idx, view(dq), view(dk), view(dv), ws, ws_bytes, nullptr));
  };
  // The atomic path: the library's order and delta, then dk/dv with dq's adds, then dq rounded.
  const auto atomic = [&] {
    gd::backward_params bp{};
    CS(detail::prepare_sparse_backward(p, idx, ws, bp, nullptr));
    const auto qs = detail::q2k_schedule(p, idx);
    const auto ks = detail::k2q_schedule(p, idx);
    gd::delta_params dp{};
    dp.o = gd::make_operand(as_const(view(o)));
    dp.d_o = gd::make_operand(as_const(view(dO)));
    dp.gate = {nullptr, 0, 0, 0};
    dp.o_c = nullptr;
    dp.delta = const_cast<float*>(bp.delta);
    dp.q_heads = p.q_heads;
    dp.rows_total = S;
    dp.tiles = qs.tiles;
    CS((gd::launch_delta<E, D>(dp, qs, p.batch, nullptr)));
    bp.q = gd::make_operand(as_const(view(q)));
    bp.k = gd::make_operand(as_const(view(k)));
    bp.v = gd::make_operand(as_const(view(v)));
    bp.d_o = gd::make_operand(as_const(view(dO)));
    bp.dk = gd::make_operand(view(dk2));
    bp.dv = gd::make_operand(view(dv2));
    bp.lse = lse;
    bp.q_heads = p.q_heads;
    bp.kv_heads = p.kv_heads;
    bp.group = 1;
    bp.scale = scale;
    bp.scale_log2 = scale * 1.4426950408889634f;
    const auto map = [&](gpu::tma_map& m, const gd::operand& x) {
      return gpu::encode_tile_map(m, x.data, 1, S, p.q_heads, D, x.batch, x.token, x.head);
    };
    if (!(map(bp.q_map, bp.q) && map(bp.do_map, bp.d_o))) {
      printf("map\n");
      exit(1);
    }
    CK(cudaMemsetAsync(acc, 0, elems * 4, nullptr));
    dkdv_atomic<<<n * p.kv_heads, 128, smem_total>>>(bp, ks, acc);
    CK(cudaGetLastError());
    round_dq<<<(elems / 2 + 255) / 256, 256>>>(acc, dq2, S, p.q_heads, scale, qs);
    CK(cudaGetLastError());
  };
  CK(cudaFuncSetAttribute(dkdv_atomic, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_total));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const auto timeit = [&](auto f) {
    std::vector<float> ms;
    for (int r = 0; r < 11; ++r) {
      CK(cudaEventRecord(a));
      f();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float t;
      CK(cudaEventElapsedTime(&t, a, b));
      if (r) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  for (int round = 0; round < 2; ++round) {
    const float tl = timeit(lib), ta = timeit(atomic);
    printf("deterministic backward %.3f ms   atomic-dq backward %.3f ms\n", tl, ta);
  }
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> h1(elems), h2(elems);
  const auto cmp = [&](const char* name, uint16_t* x, uint16_t* y) {
    CK(cudaMemcpy(h1.data(), x, elems * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h2.data(), y, elems * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    int64_t nan = 0, diff = 0;
    for (int64_t e = 0; e < elems; ++e) {
      const double r = bf16_to_float(h1[e]), t = bf16_to_float(h2[e]);
      if (std::isnan(t) || std::isnan(r)) ++nan;
      num += (t - r) * (t - r);
      den += r * r;
      diff += h1[e] != h2[e];
    }
    printf("%s: rel. error %.2e, %lld elements differ, %lld NaN\n", name, std::sqrt(num / std::max(den, 1e-30)),
           (long long)diff, (long long)nan);
  };
  cmp("dq", dq, dq2);
  cmp("dk", dk, dk2);
  cmp("dv", dv, dv2);
  return 0;
}
