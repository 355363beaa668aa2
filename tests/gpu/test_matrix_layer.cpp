// The warp-level matrix layer on the real matrix instructions: nt (S = A·Bᵀ) and nn (O = S·C, S rounded to
// the element type) of one 64-row tile, every element placed through the layer's own lane layout
// (lane_layout.hpp), against a plain product on the host. The CPU model of the same layouts is checked in
// tests/cpu/test_lane_layout.cpp; this test is what ties that model to the hardware. It runs both backends
// the attention kernels may take: warp_mma everywhere, and the layer they actually get (attention_mma: the
// wgmma backend when the device code is Hopper's), including nt with both operands in shared memory, and
// nn_sums (O = S·C and S's row sums in one chain) where the backend has it.
#include "support/gpu.hpp"
#include "support/host.hpp"

#include <vsa/gpu/arch/matrix.hpp>
#include <vsa/gpu/runtime.hpp>

#include <cmath>
#include <type_traits>
#include <vector>

namespace vsa {
namespace test {
namespace {

// Backend is chosen inside the kernel: attention_mma names a different type in the host and device passes,
// so it cannot be a template argument of a kernel.
template <class E, int D, bool Attention>
__global__ void matrix_probe_kernel(const uint16_t* a, const uint16_t* b, const uint16_t* c, float* s_out,
                                    float* s2_out, float* o_out, float* o2_out, float* sums_out) {
  using M = std::conditional_t<Attention, gpu::attention_mma<E, D>, gpu::warp_mma<E, D>>;
  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = gpu::aligned_smem(smem_raw);
  const gpu::smem_tile<D> ta{sm}, tb{sm + 64 * D}, tc{sm + 2 * 64 * D};
  const int tid = threadIdx.x, nthreads = blockDim.x;
  gpu::copy_tile(ta, a, D, 64, tid, nthreads);
  gpu::copy_tile(tb, b, D, 64, tid, nthreads);
  gpu::copy_tile(tc, c, D, 64, tid, nthreads);
  // The block of ones that the wgmma backend's nn_sums reads (the mma.sync backend's are registers).
  uint16_t* const ones = sm + 3 * 64 * D;
  if (tid < 1024 / 16) {
    const uint32_t one = E::pack(1.f, 1.f);
    reinterpret_cast<uint4*>(ones)[tid] = make_uint4(one, one, one, one);
  }
  gpu::stores_to_matrix_fence();
  gpu::copy_commit();
  gpu::copy_wait<0>();
  __syncthreads();
  const int row0 = (tid / M::threads) * 16;
  // nt with A from registers where the backend offers it, and with A from shared memory.
  typename M::score_tile s, s2;
  for (int e = 0; e < M::score_elems; ++e) s.x[e] = 0.f, s2.x[e] = 0.f;
  M::nt(s2, ta, row0, tb);
  if constexpr (M::rows_in_registers) {
    typename M::row_frag f;
    M::load_rows(f, ta, row0);
    M::nt(s, f, tb);
  } else {
    s = s2;
  }
  for (int e = 0; e < M::score_elems; ++e) s_out[(row0 + M::elem_row(e)) * 64 + M::elem_col(e)] = s.x[e];
  for (int e = 0; e < M::score_elems; ++e) s2_out[(row0 + M::elem_row(e)) * 64 + M::elem_col(e)] = s2.x[e];
  typename M::out_tile o;
  for (int e = 0; e < M::out_elems; ++e) o.x[e] = 0.f;
  M::nn(o, s, tc);
  for (int e = 0; e < M::out_elems; ++e) o_out[(row0 + M::elem_row(e)) * D + M::elem_col(e)] = o.x[e];
  // sums_out[64] says whether the backend has nn_sums (the host cannot name the device pass's attention_mma).
  if constexpr (gpu::row_sums_by_product<M>::value) {
    typename M::out_tile o2;
    typename M::sum_tile l;
    for (int e = 0; e < M::out_elems; ++e) o2.x[e] = 0.f;
    for (int e = 0; e < 4; ++e) l.x[e] = 0.f;
    M::nn_sums(o2, l, s, tc, ones);
    for (int e = 0; e < M::out_elems; ++e) o2_out[(row0 + M::elem_row(e)) * D + M::elem_col(e)] = o2.x[e];
    for (int r = 0; r < M::rows_per_lane; ++r)
      if (M::row_leader()) sums_out[row0 + M::slot_row(r)] = l.x[2 * r];
    if (tid == 0) sums_out[64] = 1.f;
  } else {
    if (tid == 0) sums_out[64] = 0.f;
  }
}

template <class E, int D, bool Attention> void probe(dtype t) {
  VSA_TEST_RNG(g, "matrix-layer");
  INFO(dtype_name(t) << " D " << D << (Attention ? " attention_mma" : " warp_mma"));
  std::vector<uint16_t> a(64 * D), b(64 * D), c(64 * D);
  for (auto* m : {&a, &b, &c})
    for (auto& x : *m) store(&x, 0, g.normal(), t);
  device_buffer da = upload(a), db = upload(b), dc = upload(c), ds(64 * 64 * 4), ds2(64 * 64 * 4), dout(64 * D * 4),
                dout2(64 * D * 4), dsums(65 * 4);
  for (auto* buf : {&ds, &ds2, &dout, &dout2, &dsums}) buf->poison();
  const int threads = 4 * gpu::warp_mma<E, D>::threads, smem = 3 * 64 * D * 2 + 1024 + gpu::smem_slack;
  const auto kernel = matrix_probe_kernel<E, D, Attention>;
  VSA_REQUIRE_RT(gpu::allow_dynamic_shared(kernel, smem));
  kernel<<<1, threads, smem>>>(da.as<uint16_t>(), db.as<uint16_t>(), dc.as<uint16_t>(), ds.as<float>(), ds2.as<float>(),
                               dout.as<float>(), dout2.as<float>(), dsums.as<float>());
  VSA_REQUIRE_RT(gpu::last_error());
  VSA_REQUIRE_RT(gpu_sync());
  const std::vector<float> s = ds.download<float>(), s2 = ds2.download<float>(), o = dout.download<float>();
  // S = A·Bᵀ in double from the 16-bit inputs: fp32 accumulation of exact products stays within ~1e-6.
  std::vector<double> s_ref(64 * 64), s_gpu(s.begin(), s.end());
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j) {
      double acc = 0;
      for (int d = 0; d < D; ++d) acc += load(a.data(), i * D + d, t) * load(b.data(), j * D + d, t);
      s_ref[i * 64 + j] = acc;
    }
  CHECK(rel_error(s_gpu, s_ref) < 1e-5);
  const std::vector<double> s2_gpu(s2.begin(), s2.end());
  CHECK(rel_error(s2_gpu, s_ref) < 1e-5);
  // O = S·C with S rounded to the element type as the layer does; built from the GPU's own S.
  std::vector<double> o_ref(64 * D), o_gpu(o.begin(), o.end());
  for (int i = 0; i < 64; ++i)
    for (int d = 0; d < D; ++d) {
      double acc = 0;
      for (int j = 0; j < 64; ++j) acc += round_to(s[i * 64 + j], t) * load(c.data(), j * D + d, t);
      o_ref[i * D + d] = acc;
    }
  CHECK(rel_error(o_gpu, o_ref) < 1e-5);
  // nn_sums: the same O, and each row's sum of S as rounded for the product.
  const std::vector<float> sums = dsums.download<float>();
  REQUIRE((sums[64] == 0.f || sums[64] == 1.f));
  if (sums[64] == 1.f) {
    const std::vector<float> o2 = dout2.download<float>();
    CHECK(rel_error(std::vector<double>(o2.begin(), o2.end()), o_ref) < 1e-5);
    std::vector<double> l_ref(64), l_gpu(sums.begin(), sums.begin() + 64);
    for (int i = 0; i < 64; ++i) {
      double acc = 0;
      for (int j = 0; j < 64; ++j) acc += round_to(s[i * 64 + j], t);
      l_ref[i] = acc;
    }
    CHECK(rel_error(l_gpu, l_ref) < 1e-5);
  }
  CHECK(dout2.canaries_intact());
  CHECK(dsums.canaries_intact());
  CHECK(ds.canaries_intact());
  CHECK(ds2.canaries_intact());
  CHECK(dout.canaries_intact());
}

TEST_CASE("the matrix layer computes A·Bᵀ and S·C on the real instructions", "[gpu][matrix]") {
  probe<gpu::bf16_type, 64, false>(dtype::bf16);
  probe<gpu::bf16_type, 128, false>(dtype::bf16);
  probe<gpu::fp16_type, 64, false>(dtype::fp16);
  probe<gpu::fp16_type, 128, false>(dtype::fp16);
  probe<gpu::bf16_type, 64, true>(dtype::bf16);
  probe<gpu::bf16_type, 128, true>(dtype::bf16);
  probe<gpu::fp16_type, 64, true>(dtype::fp16);
  probe<gpu::fp16_type, 128, true>(dtype::fp16);
}

// What the device pass compiled: hopper_code decides a kernel's pipeline and so its shared memory, and the host
// sizes that memory from runs_as_hopper. A build for sm_80 alone runs on Hopper as its compute_80 PTX compiled by
// the driver, whose binary version says 90 while every branch of the device code took sm_80's.
__global__ void hopper_code_probe_kernel(int* out) { *out = gpu::hopper_code ? 1 : 0; }

TEST_CASE("the host knows which code a kernel runs as", "[gpu][matrix]") {
  device_buffer out(sizeof(int));
  out.poison();
  hopper_code_probe_kernel<<<1, 1>>>(out.as<int>());
  VSA_REQUIRE_RT(gpu::last_error());
  VSA_REQUIRE_RT(gpu_sync());
  const int device_says = out.download<int>()[0];
  REQUIRE((device_says == 0 || device_says == 1));
  bool host_says = false;
  REQUIRE(gpu::runs_as_hopper(hopper_code_probe_kernel, host_says).is_ok());
  CHECK(host_says == (device_says == 1));
  CHECK(out.canaries_intact());
}

} // namespace
} // namespace test
} // namespace vsa
