// Stage 3 on the GPU: dense attention between the N tile means of each head, and its backward, in two pieces.
// coarse_scores forms the scaled scores from the fp32 means at about twice bf16's precision (detail/
// coarse_scores.hpp says why that precision is needed); the selection ranks them. coarse_attention and its
// backward are the same flash-attention kernels as the sparse pass, run over the means as a sequence of
// ⌈N/64⌉ row blocks in which every query block visits every key block, reading those scores instead of
// forming Q·Kᵀ (load_scores). The backward recomputes P from lse_c and the scores rather than keeping the
// N×N probabilities.
#pragma once

#include "detail/attention_glue.hpp"
#include "detail/coarse_scores.hpp"

namespace vsa {

namespace detail {

inline status check_means(const char* name, const void* ptr) { return check_pointer(name, ptr, 16); }

// coarse_scores_kernel on a grid of (key blocks, query blocks, B·Hq) blocks of the layout's scores.
template <class Layout> status launch_coarse_scores(const problem& p, const gpu::detail::coarse_scores_params& cp,
                                                    const Layout& layout, int64_t key_blocks, int64_t query_blocks,
                                                    gpu::stream_t stream) {
  namespace gd = gpu::detail;
  const dim3 grid(static_cast<unsigned>(key_blocks), static_cast<unsigned>(query_blocks),
                  static_cast<unsigned>(p.batch * p.q_heads));
  const int smem = gd::coarse_scores_smem(static_cast<int>(p.head_dim));
  const auto run = [&](auto kernel) {
    status st = gd::prepare(kernel, smem);
    if (!st) return st;
    return gpu::launch("coarse scores", kernel, grid, 4 * gpu::warp_mma<gpu::bf16_type, 64>::threads, smem, stream,
                       false, cp, layout);
  };
  return p.head_dim == 64 ? run(gd::coarse_scores_kernel<64, Layout>) : run(gd::coarse_scores_kernel<128, Layout>);
}

// The coarse backward on schedule `sched` (the one grid's dense_schedule, or a packed batch's packed_dense_schedule;
// sched.length rows of means a head), the arguments checked; delta: sched.length floats a query head.
template <class Sched> status run_coarse_backward(const problem& p, const Sched& sched, float scale, const void* q_c,
                                                  const void* k_c, const void* v_c, const float* scores,
                                                  const void* o_c, const int8_t* o_c_residual, const void* d_o_c,
                                                  const float* lse_c, float* dq_c, float* dk_c, float* dv_c,
                                                  float* delta, gpu::stream_t stream) {
  const int64_t n = sched.length;
  gpu::detail::delta_params dp = delta_base(p, gpu::detail::make_dense_operand(o_c, p.q_heads, n, p.head_dim),
                                            gpu::detail::make_dense_operand(d_o_c, p.q_heads, n, p.head_dim), sched);
  dp.o_residual = o_c_residual;
  dp.delta = delta;

  // The scores are scaled: scale only scales dq_c and dk_c.
  gpu::detail::backward_params bp = backward_base(p, scale, lse_c, scores);
  bp.q = gpu::detail::make_dense_operand(q_c, p.q_heads, n, p.head_dim);
  bp.k = gpu::detail::make_dense_operand(k_c, p.kv_heads, n, p.head_dim);
  bp.v = gpu::detail::make_dense_operand(v_c, p.kv_heads, n, p.head_dim);
  bp.d_o = gpu::detail::make_dense_operand(d_o_c, p.q_heads, n, p.head_dim);
  bp.dq_f32 = dq_c;
  bp.dk_f32 = dk_c;
  bp.dv_f32 = dv_c;
  bp.delta = delta;
  return run_backward(p, dp, bp, sched, sched, stream);
}

} // namespace detail

// scores [B, Hq, N, N] fp32 = scale · q_c · k_cᵀ (query head h against kv head h / (Hq / Hkv)), from the fp32
// means q_c [B, Hq, N, D] and k_c [B, Hkv, N, D] (block_means' q_c_f32 and k_c_f32), contiguous; relative
// error about 2^-16 of |q_c|·|k_c|.
inline status coarse_scores(const problem& p, float scale, const float* q_c, const float* k_c, float* scores,
                            gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (s) s = detail::check_scale(scale);
  if (s) s = detail::check_means("q_c", q_c);
  if (s) s = detail::check_means("k_c", k_c);
  if (s) s = check_pointer("scores", scores, 8);
  if (s) s = check_coarse_scores_disjoint(p, q_c, k_c, scores);
  if (!s) return s;
  namespace gd = gpu::detail;
  const auto sched = detail::means_schedule(p);
  const int64_t n = sched.length, blocks = sched.tiles;
  const gd::coarse_scores_params cp{q_c, k_c, scores, p.q_heads, p.q_heads / p.kv_heads, scale};
  return detail::launch_coarse_scores(p, cp, gd::dense_scores{n}, blocks, blocks, stream);
}

// o_c [B, Hq, N, D] in p.type and lse_c [B, Hq, N] fp32: the softmax of the scores [B, Hq, N, N] (coarse_scores)
// over the tiles' values v_c [B, Hkv, N, D] (p.type, contiguous). o_c_residual, when not null, receives what
// rounding o_c lost ([B, Hq, N, D] bytes, residual_encode in numeric.hpp), for coarse_attention_backward: with
// it the backward's row term is that of o_c before rounding, which matters where the softmax is sharp.
inline status coarse_attention(const problem& p, const float* scores, const void* v_c, void* o_c, int8_t* o_c_residual,
                               float* lse_c, gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (s) s = check_pointer("scores", scores, 4);
  if (s) s = detail::check_means("v_c", v_c);
  if (s) s = detail::check_means("o_c", o_c);
  if (s) s = check_pointer("lse_c", lse_c, 4);
  if (s) s = check_coarse_forward_disjoint(p, scores, v_c, o_c, o_c_residual, lse_c);
  if (!s) return s;
  const auto sched = detail::means_schedule(p);
  const int64_t n = sched.length;
  // The scores are scaled: the forward takes no scale of its own.
  gpu::detail::forward_params fp = detail::forward_base(p, 1.f, lse_c, scores);
  fp.v = gpu::detail::make_dense_operand(v_c, p.kv_heads, n, p.head_dim);
  fp.o = gpu::detail::make_dense_operand(o_c, p.q_heads, n, p.head_dim);
  fp.o_residual = o_c_residual;
  return detail::run_forward(p, fp, sched, stream);
}

inline std::size_t coarse_attention_backward_workspace(const problem& p) {
  return detail::align_up(sizeof(float) * p.batch * p.q_heads * tile_geometry(p.grid).num_tiles());
}

// dq_c [B, Hq, N, D], dk_c and dv_c [B, Hkv, N, D] in fp32 (dk_c, dv_c summed over each group), from the
// gradient d_o_c [B, Hq, N, D] (p.type) of o_c; scores are the forward's (coarse_scores), q_c and k_c the means
// in p.type, the operands of dq_c = scale · dS · k_c and dk_c = scale · dSᵀ · q_c; o_c_residual the forward's,
// or null.
inline status coarse_attention_backward(const problem& p, float scale, const void* q_c, const void* k_c,
                                        const void* v_c, const float* scores, const void* o_c,
                                        const int8_t* o_c_residual, const void* d_o_c, const float* lse_c, float* dq_c,
                                        float* dk_c, float* dv_c, void* workspace, std::size_t& workspace_bytes,
                                        gpu::stream_t stream) {
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
  if (s) s = check_pointer("scores", scores, 4);
  if (s) s = detail::check_means("o_c", o_c);
  if (s) s = detail::check_means("d_o_c", d_o_c);
  if (s) s = check_pointer("lse_c", lse_c, 4);
  if (s) s = check_pointer("dq_c", dq_c, 16);
  if (s) s = check_pointer("dk_c", dk_c, 16);
  if (s) s = check_pointer("dv_c", dv_c, 16);
  if (s) s = check_workspace(workspace, workspace_bytes, need);
  if (s) {
    s = check_coarse_backward_disjoint(p, q_c, k_c, v_c, scores, o_c, o_c_residual, d_o_c, lse_c, dq_c, dk_c, dv_c,
                                       workspace, need);
  }
  if (!s) return s;

  return detail::run_coarse_backward(p, detail::means_schedule(p), scale, q_c, k_c, v_c, scores, o_c, o_c_residual,
                                     d_o_c, lse_c, dq_c, dk_c, dv_c, static_cast<float*>(workspace), stream);
}

} // namespace vsa
