// The sparse backward as the probes time its kernels alone: a problem's uniform lists (and their k2q) on the
// device, random q, k, v and dO, the library's forward (o, lse) and backward (dq, dk, dv: what the probes compare
// their kernels with), and the parameters the library's kernels get, delta and order from that backward's
// workspace and the tiles' maps encoded. Kernels launched on `bp` write dq2, dk2 and dv2.
#pragma once

#include "probe_inputs.hpp"

namespace probe {

template <class E, int D> struct backward_setup {
  vsa::problem p;
  int64_t n = 0, S = 0, rows = 0, K = 0, elems = 0;
  float scale = 0.f;
  vsa::const_index_lists idx{};
  uint16_t *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *dO = nullptr, *dq = nullptr, *dk = nullptr,
           *dv = nullptr, *dq2 = nullptr, *dk2 = nullptr, *dv2 = nullptr;
  float* lse = nullptr;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;
  vsa::gpu::detail::backward_params bp{};

  vsa::tensor view(void* d) const { return vsa::bshd<void*>(d, 1, S, p.q_heads, D); }
  vsa::status library() {
    using vsa::as_const;
    return vsa::sparse_attention_backward(p, scale, as_const(view(q)), as_const(view(k)), as_const(view(v)),
                                          as_const(view(o)), as_const(view(dO)), lse, idx, view(dq), view(dk), view(dv),
                                          ws, ws_bytes, nullptr);
  }
  // The schedules of the dq kernel (q2k) and the dk/dv kernels (k2q).
  auto q_schedule() const { return vsa::detail::q2k_schedule(p, idx); }
  auto k_schedule() const { return vsa::detail::k2q_schedule(p, idx); }
  // Pair counts of the kernels' flops: K selected key tiles for each of `rows` query tiles.
  double pairs() const { return static_cast<double>(K) * rows; }

  // False, with what failed printed, if any step did. Inputs are amp times uniform values in [-1, 1).
  bool make(const vsa::problem& problem, float amp) {
    using vsa::as_const;
    namespace gd = vsa::gpu::detail;
    const auto ok = [](cudaError_t e, const char* what) {
      if (e != cudaSuccess) std::printf("%s: %s\n", what, cudaGetErrorString(e));
      return e == cudaSuccess;
    };
    p = problem;
    const vsa::tile_geometry geo(p.grid);
    n = geo.num_tiles(), S = geo.tiled_tokens(), rows = p.q_heads * n, K = (n + 5) / 10, elems = S * p.q_heads * D;
    scale = 1.f / std::sqrt(float(D));
    std::vector<int32_t> q2k = uniform_q2k(rows, n, K), count(rows, static_cast<int32_t>(K)), k2q(rows * K),
                         offset(p.q_heads * (n + 1));
    if (!vsa::reference::build_k2q(p, {q2k.data(), count.data(), K, k2q.data(), offset.data()}))
      return std::printf("k2q failed\n"), false;
    idx = {to_device(q2k), to_device(count), K, to_device(k2q), to_device(offset)};
    if (!idx.q2k || !idx.q2k_count || !idx.k2q || !idx.k2q_offset)
      return std::printf("copying the lists failed\n"), false;
    for (uint16_t** x : {&q, &k, &v, &o, &dO, &dq, &dk, &dv, &dq2, &dk2, &dv2})
      if (!ok(cudaMalloc(x, elems * 2), "cudaMalloc")) return false;
    if (!ok(cudaMalloc(&lse, rows * 64 * 4), "cudaMalloc")) return false;
    uint32_t seed = 1;
    for (uint16_t* x : {q, k, v, dO}) fill<E><<<(elems + 255) / 256, 256>>>(x, elems, seed++ * 0x9e3779b9u, amp);
    if (!ok(cudaGetLastError(), "fill")) return false;
    vsa::status st = vsa::sparse_attention_forward(p, scale, as_const(view(q)), as_const(view(k)), as_const(view(v)),
                                                   idx, view(o), lse, nullptr);
    if (!st) return std::printf("%s\n", st.message()), false;
    ws_bytes = vsa::sparse_attention_backward_workspace(p);
    if (!ok(cudaMalloc(&ws, ws_bytes), "cudaMalloc")) return false;
    st = library();
    if (!st) return std::printf("%s\n", st.message()), false;
    if (!ok(cudaDeviceSynchronize(), "the library's backward")) return false;

    bp = vsa::detail::sparse_backward_params(p, scale, as_const(view(q)), as_const(view(k)), as_const(view(v)),
                                             as_const(view(dO)), view(dq2), view(dk2), view(dv2), lse);
    const vsa::detail::sparse_backward_scratch pieces(p);
    unsigned char* at = static_cast<unsigned char*>(ws);
    bp.delta = reinterpret_cast<float*>(at);
    bp.order = reinterpret_cast<int32_t*>(at + pieces.delta + pieces.counts);
    const auto map = [&](vsa::gpu::tma_map& m, const gd::operand& x) {
      return vsa::gpu::encode_tile_map(m, x.data, 1, S, p.q_heads, D, x.batch, x.token, x.head);
    };
    if (!(map(bp.k_map, bp.k) && map(bp.v_map, bp.v) && map(bp.q_map, bp.q) && map(bp.do_map, bp.d_o)))
      return std::printf("encoding the tiles' maps failed\n"), false;
    bp.tma = 1;
    return true;
  }
};

} // namespace probe
