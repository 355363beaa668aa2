// Stage 3 on the GPU: dense attention between the N tile means of each head, and its backward. It is the
// same flash-attention kernel as the sparse pass, run over the means as a sequence of ⌈N/64⌉ row blocks
// in which every query block visits every key block; the forward also writes the scaled scores that the
// selection ranks. The backward recomputes P from lse_c rather than keeping the N×N probabilities.
#pragma once

#include "sparse_attention.hpp"

namespace vsa {

namespace detail {

inline gpu::detail::dense_schedule means_schedule(const problem& p) {
  const int64_t n = tile_geometry(p.grid).num_tiles();
  return {n, (n + 63) / 64};
}

inline status check_means(const char* name, const void* ptr) { return check_pointer(name, ptr, 16); }

} // namespace detail

// scores [B, Hq, N, N] fp32 (scale·q_c·k_cᵀ; may be null when only o_c is wanted), o_c [B, Hq, N, D] in
// p.type, lse_c [B, Hq, N] fp32. q_c [B, Hq, N, D], k_c and v_c [B, Hkv, N, D], contiguous, in p.type.
inline status coarse_attention(const problem& p, float scale, const void* q_c, const void* k_c, const void* v_c,
                               float* scores, void* o_c, float* lse_c, gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (s) s = detail::check_scale(scale);
  if (s) s = detail::check_means("q_c", q_c);
  if (s) s = detail::check_means("k_c", k_c);
  if (s) s = detail::check_means("v_c", v_c);
  if (s) s = detail::check_means("o_c", o_c);
  if (s) s = check_pointer("lse_c", lse_c, 4);
  if (s && scores != nullptr) s = check_pointer("scores", scores, 4);
  if (!s) return s;
  const auto sched = detail::means_schedule(p);
  const int64_t n = sched.length;
  gpu::detail::forward_params fp{};
  fp.q = gpu::detail::make_dense_operand(q_c, p.q_heads, n, p.head_dim);
  fp.k = gpu::detail::make_dense_operand(k_c, p.kv_heads, n, p.head_dim);
  fp.v = gpu::detail::make_dense_operand(v_c, p.kv_heads, n, p.head_dim);
  fp.o = gpu::detail::make_dense_operand(o_c, p.q_heads, n, p.head_dim);
  fp.lse = lse_c;
  fp.scores = scores;
  fp.q_heads = p.q_heads;
  fp.group = p.q_heads / p.kv_heads;
  fp.scale = scale;
  fp.scale_log2 = scale * 1.4426950408889634f;
  return gpu::detail::dispatch(p.type, p.head_dim, [&](auto cfg) {
    using C = decltype(cfg);
    return gpu::detail::launch_forward<typename C::element, C::head_dim>(fp, sched, p.batch, p.q_heads, stream);
  });
}

inline std::size_t coarse_attention_backward_workspace(const problem& p) {
  return detail::align_up(sizeof(float) * p.batch * p.q_heads * tile_geometry(p.grid).num_tiles());
}

// dq_c [B, Hq, N, D], dk_c and dv_c [B, Hkv, N, D] in fp32 (dk_c, dv_c summed over each group), from the
// gradient d_o_c [B, Hq, N, D] (p.type) of o_c.
inline status coarse_attention_backward(const problem& p, float scale, const void* q_c, const void* k_c,
                                        const void* v_c, const void* o_c, const void* d_o_c, const float* lse_c,
                                        float* dq_c, float* dk_c, float* dv_c, void* workspace,
                                        std::size_t& workspace_bytes, gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (!s) return s;
  const std::size_t need = coarse_attention_backward_workspace(p);
  if (workspace == nullptr) {
    workspace_bytes = need;
    return status::ok();
  }
  if (s) s = detail::check_scale(scale);
  if (s) s = detail::check_means("q_c", q_c);
  if (s) s = detail::check_means("k_c", k_c);
  if (s) s = detail::check_means("v_c", v_c);
  if (s) s = detail::check_means("o_c", o_c);
  if (s) s = detail::check_means("d_o_c", d_o_c);
  if (s) s = check_pointer("lse_c", lse_c, 4);
  if (s) s = check_pointer("dq_c", dq_c, 16);
  if (s) s = check_pointer("dk_c", dk_c, 16);
  if (s) s = check_pointer("dv_c", dv_c, 16);
  if (s) s = check_workspace(workspace, workspace_bytes, need);
  if (!s) return s;

  const auto sched = detail::means_schedule(p);
  const int64_t n = sched.length;
  float* delta = static_cast<float*>(workspace);
  gpu::detail::delta_params dp{};
  dp.o = gpu::detail::make_dense_operand(o_c, p.q_heads, n, p.head_dim);
  dp.d_o = gpu::detail::make_dense_operand(d_o_c, p.q_heads, n, p.head_dim);
  dp.gate = {nullptr, 0, 0, 0};
  dp.o_c = nullptr;
  dp.delta = delta;
  dp.q_heads = p.q_heads;
  dp.rows_total = n;
  dp.tiles = sched.tiles;

  gpu::detail::backward_params bp{};
  bp.q = gpu::detail::make_dense_operand(q_c, p.q_heads, n, p.head_dim);
  bp.k = gpu::detail::make_dense_operand(k_c, p.kv_heads, n, p.head_dim);
  bp.v = gpu::detail::make_dense_operand(v_c, p.kv_heads, n, p.head_dim);
  bp.d_o = gpu::detail::make_dense_operand(d_o_c, p.q_heads, n, p.head_dim);
  bp.dq_f32 = dq_c;
  bp.dk_f32 = dk_c;
  bp.dv_f32 = dv_c;
  bp.lse = lse_c;
  bp.delta = delta;
  bp.q_heads = p.q_heads;
  bp.kv_heads = p.kv_heads;
  bp.group = p.q_heads / p.kv_heads;
  bp.scale = scale;
  bp.scale_log2 = scale * 1.4426950408889634f;
  return gpu::detail::dispatch(p.type, p.head_dim, [&](auto cfg) {
    using C = decltype(cfg);
    using E = typename C::element;
    status st = gpu::detail::launch_delta<E, C::head_dim>(dp, sched, p.batch, stream);
    if (!st) return st;
    return gpu::detail::launch_backward<E, C::head_dim>(bp, sched, sched, p.batch, stream);
  });
}

} // namespace vsa
