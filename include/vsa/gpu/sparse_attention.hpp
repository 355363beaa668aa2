// Stage 6 on the GPU: block-sparse flash attention of every query tile over the key tiles of its q2k list,
// forward and backward.
#pragma once

#include "detail/attention_glue.hpp"

namespace vsa {

// o_s and the fp32 log-sum-exp lse [B, Hq, N·64] of every query token over the valid tokens of its
// selected key tiles. Padding rows, and rows whose list is empty, get o_s = 0 and lse = +inf.
inline status sparse_attention_forward(const problem& p, float scale, const_tensor q, const_tensor k, const_tensor v,
                                       const_index_lists idx, tensor o_s, float* lse, gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (!s) return s;
  const int64_t tokens = tile_geometry(p.grid).tiled_tokens();
  if (s) s = detail::check_inputs(p, scale, q, k, v, tokens);
  if (s) s = check_tensor("o_s", o_s, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_pointer("lse", lse, 4);
  if (s) s = detail::check_lists(p, idx, false);
  if (s) {
    s = check_sparse_forward_disjoint(p, q, k, v, idx, o_s, lse);
  }
  if (!s) return s;
  const gpu::detail::forward_params fp = detail::sparse_forward_params(p, scale, q, k, v, o_s, lse);
  return detail::run_forward(p, fp, detail::q2k_schedule(p, idx), stream);
}

// Workspace of the backward. The least it runs in: delta (one fp32 per query row) and the launch order of the dk/dv
// blocks; dq then recomputes each pair's dS (seven products a pair).
inline std::size_t sparse_attention_backward_workspace(const problem& p) {
  return detail::sparse_backward_scratch(p).bytes();
}
// What it runs fastest in for lists of this capacity, where the device's kernels take dq from stored dS (NVIDIA
// before Hopper; the current device is asked, and elsewhere this is the least): the least, plus the
// dS that dk/dv stores for dq (8 KB a pair, five products a pair; 3.9 GB on wan2.1-1.3b-480p), for every head where
// that fits in 8 GiB, else for as many kv heads as fit, which the backward then runs a group at a time. Any size
// from the least up works: a larger workspace holds more heads at a time, up to all of them.
inline std::size_t sparse_attention_backward_workspace(const problem& p, int64_t q2k_capacity) {
  return detail::sparse_backward_preferred_bytes(p, q2k_capacity, false);
}

// dq, dk, dv of the sparse attention, given dO and the forward's o_s and lse. dq walks the q2k lists, dk
// and dv the k2q lists (idx needs both), so no atomics are used and the result is bitwise reproducible.
// The size query (workspace == nullptr) answers sparse_attention_backward_workspace(p, idx.q2k_capacity); the
// call takes any workspace of at least sparse_attention_backward_workspace(p) bytes.
inline status sparse_attention_backward(const problem& p, float scale, const_tensor q, const_tensor k, const_tensor v,
                                        const_tensor o_s, const_tensor d_o, const float* lse, const_index_lists idx,
                                        tensor dq, tensor dk, tensor dv, void* workspace, std::size_t& workspace_bytes,
                                        gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (!s) return s;
  const std::size_t need = sparse_attention_backward_workspace(p);
  if (workspace == nullptr) {
    workspace_bytes = sparse_attention_backward_workspace(p, idx.q2k_capacity);
    return status::ok();
  }
  const int64_t tokens = tile_geometry(p.grid).tiled_tokens();
  if (s) s = detail::check_inputs(p, scale, q, k, v, tokens);
  if (s) s = check_tensor("o_s", o_s, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("d_o", d_o, p, p.q_heads, tokens, target::gpu);
  if (s) s = detail::check_gradients(p, dq, dk, dv, tokens);
  if (s) s = check_pointer("lse", lse, 4);
  if (s) s = detail::check_lists(p, idx, true);
  if (s) s = check_workspace(workspace, workspace_bytes, need);
  if (s) {
    const std::size_t used = detail::sparse_backward_scratch(p, idx.q2k_capacity, workspace_bytes, false).bytes();
    s = check_sparse_backward_disjoint(p, q, k, v, o_s, d_o, lse, idx, true, dq, dk, dv, workspace, used);
  }
  if (!s) return s;

  const auto qs = detail::q2k_schedule(p, idx);
  const auto ks = detail::k2q_schedule(p, idx);
  gpu::detail::backward_params bp = detail::sparse_backward_params(p, scale, q, k, v, d_o, dq, dk, dv, lse);
  gpu::detail::delta_params dp =
      detail::delta_base(p, gpu::detail::make_operand(o_s), gpu::detail::make_operand(d_o), qs);
  s = detail::prepare_sparse_backward(p, idx, workspace, workspace_bytes, bp, dp, stream, false);
  if (!s) return s;
  return detail::run_backward(p, dp, bp, qs, ks, stream);
}

} // namespace vsa
