// Stage 6 on the GPU: block-sparse flash attention of every query tile over the key tiles of its q2k list,
// forward and backward.
#pragma once

#include "../validate.hpp"
#include "detail/attention_launch.hpp"

#include <cmath>

namespace vsa {

namespace detail {

inline status check_scale(float scale) {
  if (!(scale > 0.f) || !std::isfinite(scale))
    return status::error(errc::bad_argument, "scale: must be positive and finite, got %g", double(scale));
  return status::ok();
}

inline status check_lists(const problem& p, const const_index_lists& idx, bool need_k2q) {
  const int64_t n = tile_geometry(p.grid).num_tiles();
  status s = check_pointer("q2k", idx.q2k, 4);
  if (s) s = check_pointer("q2k_count", idx.q2k_count, 4);
  if (s && need_k2q) s = check_pointer("k2q", idx.k2q, 4);
  if (s && need_k2q) s = check_pointer("k2q_offset", idx.k2q_offset, 4);
  if (s && (idx.q2k_capacity < 1 || idx.q2k_capacity > n))
    s = status::error(errc::bad_index, "q2k_capacity: must be in 1..%lld, got %lld", (long long)n,
                      (long long)idx.q2k_capacity);
  return s;
}

inline gpu::detail::sparse_schedule q2k_schedule(const problem& p, const const_index_lists& idx) {
  const tile_geometry geo(p.grid);
  return {geo, idx.q2k, idx.q2k_count, nullptr, idx.q2k_capacity, geo.num_tiles()};
}
inline gpu::detail::sparse_schedule k2q_schedule(const problem& p, const const_index_lists& idx) {
  const tile_geometry geo(p.grid);
  return {geo, idx.k2q, nullptr, idx.k2q_offset, idx.q2k_capacity, geo.num_tiles()};
}

} // namespace detail

// o_s and the fp32 log-sum-exp lse [B, Hq, N·64] of every query token over the valid tokens of its
// selected key tiles. Padding rows, and rows whose list is empty, get o_s = 0 and lse = +inf.
inline status sparse_attention_forward(const problem& p, float scale, const_tensor q, const_tensor k, const_tensor v,
                                       const_index_lists idx, tensor o_s, float* lse, gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (!s) return s;
  const int64_t tokens = tile_geometry(p.grid).tiled_tokens();
  if (s) s = detail::check_scale(scale);
  if (s) s = check_tensor("q", q, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("k", k, p, p.kv_heads, tokens, target::gpu);
  if (s) s = check_tensor("v", v, p, p.kv_heads, tokens, target::gpu);
  if (s) s = check_tensor("o_s", o_s, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_pointer("lse", lse, 4);
  if (s) s = detail::check_lists(p, idx, false);
  if (s) {
    s = check_sparse_forward_disjoint(p, q, k, v, idx, o_s, lse);
  }
  if (!s) return s;
  gpu::detail::forward_params fp{};
  fp.q = gpu::detail::make_operand(q);
  fp.k = gpu::detail::make_operand(k);
  fp.v = gpu::detail::make_operand(v);
  fp.o = gpu::detail::make_operand(o_s);
  fp.lse = lse;
  fp.scores = nullptr;
  fp.q_heads = p.q_heads;
  fp.group = p.q_heads / p.kv_heads;
  fp.scale = scale;
  fp.scale_log2 = scale * log2_e;
  const auto sched = detail::q2k_schedule(p, idx);
  return gpu::detail::dispatch(p.type, p.head_dim, [&](auto cfg) {
    using C = decltype(cfg);
    return gpu::detail::launch_forward<typename C::element, C::head_dim>(fp, sched, p.batch, p.q_heads, stream);
  });
}

// Workspace of the backward: delta (one fp32 per query row) and the launch order of the dk/dv blocks.
inline std::size_t sparse_attention_backward_workspace(const problem& p) {
  const int64_t n = tile_geometry(p.grid).num_tiles();
  return detail::align_up(sizeof(float) * p.batch * p.q_heads * n * 64) +
         detail::align_up(sizeof(int32_t) * 2 * gpu::detail::order_buckets * p.batch * p.kv_heads) +
         detail::align_up(sizeof(int32_t) * p.batch * p.kv_heads * n);
}

namespace detail {

// Carves the backward's scratch, points bp at it and launches what fills the dk/dv launch order.
inline status prepare_sparse_backward(const problem& p, const const_index_lists& idx, void* scratch,
                                      gpu::detail::backward_params& bp, gpu::stream_t stream) {
  const int64_t n = tile_geometry(p.grid).num_tiles();
  unsigned char* at = static_cast<unsigned char*>(scratch);
  float* delta = reinterpret_cast<float*>(at);
  at += align_up(sizeof(float) * p.batch * p.q_heads * n * 64);
  gpu::detail::order_params op{};
  op.counts = reinterpret_cast<int32_t*>(at);
  at += align_up(sizeof(int32_t) * 2 * gpu::detail::order_buckets * p.batch * p.kv_heads);
  op.order = reinterpret_cast<int32_t*>(at);
  op.k2q_offset = idx.k2q_offset;
  op.tiles = n;
  op.q_heads = p.q_heads;
  op.kv_heads = p.kv_heads;
  op.group = p.q_heads / p.kv_heads;
  op.items = p.batch * p.kv_heads * n;
  bp.delta = delta;
  bp.order = op.order;
  return gpu::detail::launch_order(op, stream);
}

} // namespace detail

// dq, dk, dv of the sparse attention, given dO and the forward's o_s and lse. dq walks the q2k lists, dk
// and dv the k2q lists (idx needs both), so no atomics are used and the result is bitwise reproducible.
inline status sparse_attention_backward(const problem& p, float scale, const_tensor q, const_tensor k, const_tensor v,
                                        const_tensor o_s, const_tensor d_o, const float* lse, const_index_lists idx,
                                        tensor dq, tensor dk, tensor dv, void* workspace, std::size_t& workspace_bytes,
                                        gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (!s) return s;
  const std::size_t need = sparse_attention_backward_workspace(p);
  if (workspace == nullptr) {
    workspace_bytes = need;
    return status::ok();
  }
  const int64_t tokens = tile_geometry(p.grid).tiled_tokens();
  if (s) s = detail::check_scale(scale);
  if (s) s = check_tensor("q", q, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("k", k, p, p.kv_heads, tokens, target::gpu);
  if (s) s = check_tensor("v", v, p, p.kv_heads, tokens, target::gpu);
  if (s) s = check_tensor("o_s", o_s, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("d_o", d_o, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("dq", dq, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("dk", dk, p, p.kv_heads, tokens, target::gpu);
  if (s) s = check_tensor("dv", dv, p, p.kv_heads, tokens, target::gpu);
  if (s) s = check_pointer("lse", lse, 4);
  if (s) s = detail::check_lists(p, idx, true);
  if (s) s = check_workspace(workspace, workspace_bytes, need);
  if (s) {
    s = check_sparse_backward_disjoint(p, q, k, v, o_s, d_o, lse, idx, true, dq, dk, dv, workspace, need);
  }
  if (!s) return s;

  gpu::detail::backward_params bp{};
  s = detail::prepare_sparse_backward(p, idx, workspace, bp, stream);
  if (!s) return s;
  float* delta = const_cast<float*>(bp.delta);
  const auto qs = detail::q2k_schedule(p, idx);
  const auto ks = detail::k2q_schedule(p, idx);
  gpu::detail::delta_params dp{};
  dp.o = gpu::detail::make_operand(o_s);
  dp.d_o = gpu::detail::make_operand(d_o);
  dp.gate = {nullptr, 0, 0, 0};
  dp.o_c = nullptr;
  dp.delta = delta;
  dp.q_heads = p.q_heads;
  dp.rows_total = tokens;
  dp.tiles = qs.tiles;

  bp.q = gpu::detail::make_operand(q);
  bp.k = gpu::detail::make_operand(k);
  bp.v = gpu::detail::make_operand(v);
  bp.d_o = gpu::detail::make_operand(d_o);
  bp.dq = gpu::detail::make_operand(dq);
  bp.dk = gpu::detail::make_operand(dk);
  bp.dv = gpu::detail::make_operand(dv);
  bp.lse = lse;
  bp.q_heads = p.q_heads;
  bp.kv_heads = p.kv_heads;
  bp.group = p.q_heads / p.kv_heads;
  bp.scale = scale;
  bp.scale_log2 = scale * log2_e;
  return gpu::detail::dispatch(p.type, p.head_dim, [&](auto cfg) {
    using C = decltype(cfg);
    using E = typename C::element;
    status st = gpu::detail::launch_delta<E, C::head_dim>(dp, qs, p.batch, stream);
    if (!st) return st;
    return gpu::detail::launch_backward<E, C::head_dim>(bp, qs, ks, p.batch, stream);
  });
}

} // namespace vsa
