// The whole video sparse attention op on the GPU, forward and backward, behind one workspace.
//
// Forward: block means (and the fp32 means of q and k) → coarse scores → coarse attention (o_c, lse_c) →
// top-k → q2k → k2q → sparse attention with o = o_s + g ⊙ o_c written by its epilogue. What the backward
// needs stays in the state (op_buffers; the start of the workspace in the one-workspace form): the means, o_c,
// lse_c, the index lists, the fine log-sum-exp and o's rounding residual.
// Backward: dgate and the tile sums of g ⊙ dO → coarse scores again → coarse attention backward (fp32 dq_c,
// dk_c, dv_c) → delta = rowsum(dO ⊙ (o + residual − g ⊙ o_c)) → dq walking q2k and dk, dv walking k2q, each
// adding the block-mean backward of the coarse gradients (d·_c / valid count, on every valid slot of the tile)
// in its epilogue. The coarse kernels still size shared memory for Q and K tiles they no longer copy (the
// dense schedule reads its scores); harmless, as they run under one wave.
//
// The residuals (one byte an element of o and of o_c, residual_encode in numeric.hpp) are what make each row
// term that of the output as the forward computed it, not after its rounding (and o's, after o_c's too): at
// large scores that difference was the whole op's largest gradient error (README.md, accuracy).
#pragma once

#include "block_means.hpp"
// The sparse stage first: its kernels are instantiated, and so emitted, before the coarse pass's, in the order
// the generated code has always had (which keeps it comparable across changes of the host code).
#include "sparse_attention.hpp"
#include "coarse_attention.hpp"
#include "combine.hpp"
#include "detail/attention_glue.hpp"
#include "index.hpp"
#include "joint_attention.hpp"
#include "layout.hpp"
#include "select.hpp"

namespace vsa {

namespace detail {

// Offsets of everything the op keeps: the state the forward leaves for the backward (offsets into
// op_buffers::state), then each pass's scratch (offsets into op_buffers::scratch). The one-workspace form
// lays the scratch right after the state.
struct op_workspace {
  bool coarse = false; // false when the caller supplied the q2k lists
  int64_t top_k = 0, capacity = 0;
  // Joint attention (joint_forward below): the extra tokens, and the sparse pass's tiles and rows, N and N·64 for
  // the video alone; with extra tokens, the joint lists (joint_attention.hpp) in the state, before k2q.
  extra_tokens extra{};
  int64_t tiles = 0, rows = 0;
  std::size_t joint_q2k = 0, joint_count = 0, joint_table = 0, joint_parts = 0; // joint_parts: forward scratch
  // state
  std::size_t q_c = 0, k_c = 0, v_c = 0, q_c32 = 0, k_c32 = 0, o_c = 0, lse_c = 0, q2k = 0, q2k_count = 0, k2q = 0,
              k2q_offset = 0, lse = 0, o_residual = 0, o_c_residual = 0, state_bytes = 0;
  // forward scratch
  std::size_t scores = 0, select_scratch = 0, index_scratch = 0, forward_scratch_bytes = 0;
  // backward scratch (d_o_tiled: options::input_order raster, d_o's tiled copy)
  std::size_t d_o_c = 0, dq_c = 0, dk_c = 0, dv_c = 0, b_scores = 0, coarse_scratch = 0, sparse_scratch = 0,
              d_o_tiled = 0, backward_scratch_bytes = 0;

  template <class T = void> T* at(void* base, std::size_t off) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(base) + off);
  }
  template <class T = void> const T* at(const void* base, std::size_t off) const {
    return reinterpret_cast<const T*>(static_cast<const unsigned char*>(base) + off);
  }
};

// The coarse pass's part of the state (the op's and the packed op's plans, W): the means, o_c and its residual, lse_c
// and the selected lists of capacity w.capacity, for n tiles of bh query heads and bhk kv heads; take(bytes) gives
// each its offset.
template <class W, class Take>
void take_coarse_state(W& w, const Take& take, const problem& p, std::size_t bh, std::size_t bhk, std::size_t n) {
  const std::size_t e = dtype_size(p.type), d = static_cast<std::size_t>(p.head_dim);
  w.q_c = take(bh * n * d * e);
  w.k_c = take(bhk * n * d * e);
  w.v_c = take(bhk * n * d * e);
  // The fp32 means of q and k, from which the scores are formed in the forward and again in the backward.
  w.q_c32 = take(bh * n * d * sizeof(float));
  w.k_c32 = take(bhk * n * d * sizeof(float));
  w.o_c = take(bh * n * d * e);
  w.o_c_residual = take(bh * n * d * sizeof(int8_t));
  w.lse_c = take(bh * n * sizeof(float));
  w.q2k = take(bh * n * static_cast<std::size_t>(w.capacity) * sizeof(int32_t));
  w.q2k_count = take(bh * n * sizeof(int32_t));
}

inline status plan_op(const problem& p, const extra_tokens& extra, const options& opt, op_workspace& w) {
  status s = check_problem(p, target::gpu);
  if (s) s = check_extra_tokens(p, extra);
  if (!s) return s;
  const int64_t n = tile_geometry(p.grid).num_tiles(), bh = p.batch * p.q_heads, bhk = p.batch * p.kv_heads;
  const joint_tiles jt(p, extra);
  const bool joint = extra.count > 0;
  w.extra = extra;
  w.tiles = jt.all;
  w.rows = jt.tokens;
  if (joint && !(s = check_joint_tiles(p, extra))) return s;
  const std::size_t e = dtype_size(p.type), d = static_cast<std::size_t>(p.head_dim);
  w.coarse = opt.q2k.q2k == nullptr;
  if (w.coarse) {
    s = resolve_op_top_k(n, opt, w.top_k);
    if (!s) return s;
    w.capacity = w.top_k;
  } else {
    w.capacity = opt.q2k.q2k_capacity;
    if (!(s = check_q2k_capacity(p, w.capacity))) return s;
  }
  std::size_t off = 0;
  const auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off += align_up(bytes);
    return at;
  };
  if (w.coarse) take_coarse_state(w, take, p, bh, bhk, static_cast<std::size_t>(n));
  const std::size_t t = static_cast<std::size_t>(w.tiles), rows = static_cast<std::size_t>(w.rows);
  if (joint) {
    w.joint_q2k = take(bh * t * t * sizeof(int32_t));
    w.joint_count = take(bh * t * sizeof(int32_t));
    w.joint_table = take(t * 2 * sizeof(int32_t));
  }
  w.k2q = take(bh * t * (joint ? t : w.capacity) * sizeof(int32_t));
  w.k2q_offset = take(bh * (t + 1) * sizeof(int32_t));
  w.lse = take(bh * rows * sizeof(float));
  w.o_residual = take(bh * rows * d * sizeof(int8_t));
  w.state_bytes = off;
  // Scratch of the forward: the joint pass's pieces (joint_pieces), the N×N scores and the selection's and index
  // builder's own workspaces.
  off = 0;
  if (joint) w.joint_parts = take(joint_pieces::bytes(p, jt));
  index_lists probe{};
  probe.q2k_capacity = w.capacity;
  std::size_t select_bytes = 0, index_bytes = 0;
  if (w.coarse) {
    w.scores = take(bh * n * n * sizeof(float));
    s = select_top_k(p, w.top_k, nullptr, probe, nullptr, select_bytes, nullptr);
    if (!s) return s;
    w.select_scratch = take(select_bytes);
  }
  if (joint) {
    gpu::detail::k2q_layout layout{};
    layout.init(w.tiles, bh);
    index_bytes = layout.total();
  } else {
    s = build_k2q(p, probe, nullptr, index_bytes, nullptr);
    if (!s) return s;
  }
  w.index_scratch = take(index_bytes);
  w.forward_scratch_bytes = off;

  // Scratch of the backward: d_o's tiled copy first (options::input_order raster), then the coarse pass's, then the
  // sparse pass's, which runs on all that is left (its region is the last: a larger one may change its plan).
  off = 0;
  if (opt.input_order == token_order::raster) w.d_o_tiled = take(bh * rows * d * e);
  if (w.coarse) {
    w.d_o_c = take(bh * n * d * e);
    w.dq_c = take(bh * n * d * sizeof(float));
    w.dk_c = take(bhk * n * d * sizeof(float));
    w.dv_c = take(bhk * n * d * sizeof(float));
    w.b_scores = take(bh * n * n * sizeof(float));
    w.coarse_scratch = take(coarse_attention_backward_workspace(p));
  }
  w.sparse_scratch = take(joint ? joint_backward_scratch::preferred(p, jt, w.capacity)
                                : sparse_attention_backward_workspace(p, w.capacity));
  w.backward_scratch_bytes = off;
  return status::ok();
}

inline status plan_op(const problem& p, const options& opt, op_workspace& w) { return plan_op(p, {}, opt, w); }

// The one-workspace size of a pass: the state, then the larger of the scratch regions (so that the backward's
// size is at least the forward's, and one allocation serves both).
template <class W> std::size_t whole_workspace_bytes(const W& w, bool backward) {
  const std::size_t scratch = backward && w.backward_scratch_bytes > w.forward_scratch_bytes ? w.backward_scratch_bytes
                                                                                             : w.forward_scratch_bytes;
  return w.state_bytes + scratch;
}

// The one-workspace form of a pass: a size query, or `pass` run with the plan on the state at the workspace's
// start and the scratch after it.
// The one-workspace form on a plan of `state_bytes` of state and `whole` bytes in all: the size query, or pass(buffers)
// with the state at the workspace's start and the scratch after it.
template <class Pass> status split_workspace(void* workspace, std::size_t& workspace_bytes, std::size_t state_bytes,
                                             std::size_t whole, const Pass& pass) {
  if (workspace == nullptr) {
    workspace_bytes = whole;
    return status::ok();
  }
  const status s = check_workspace(workspace, workspace_bytes, whole);
  if (!s) return s;
  op_buffers b{workspace, state_bytes, static_cast<unsigned char*>(workspace) + state_bytes,
               workspace_bytes - state_bytes};
  return pass(b);
}

template <class Pass> status in_one_workspace(const problem& p, const extra_tokens& extra, const options& opt,
                                              bool backward, void* workspace, std::size_t& workspace_bytes,
                                              const Pass& pass) {
  op_workspace w;
  const status s = plan_op(p, extra, opt, w);
  if (!s) return s;
  return split_workspace(workspace, workspace_bytes, w.state_bytes, whole_workspace_bytes(w, backward),
                         [&](op_buffers& b) { return pass(w, b); });
}

inline status check_buffers(const op_buffers& b, std::size_t state_bytes, std::size_t scratch_bytes) {
  status s = check_buffer("state", b.state, b.state_bytes, state_bytes);
  if (s) s = check_buffer("scratch", b.scratch, b.scratch_bytes, scratch_bytes);
  return s;
}

// The gate: absent, or of the op's own selection (W: the op's or the packed op's plan).
template <class W> status check_gate(const problem& p, const W& w, const const_tensor& gate, int64_t tokens) {
  if (gate.data == nullptr) return status::ok();
  if (!w.coarse)
    return status::error(errc::bad_argument, "gate: must be absent when the caller supplies the q2k lists");
  return check_tensor("gate", gate, p, p.q_heads, tokens, target::gpu);
}

} // namespace detail

namespace detail {

// The backward's tensors (W: the op's or the packed op's plan): the inputs of `tokens` rows, d_o of `d_o_tokens`
// (options::input_order), o and the gradients of `out_tokens` (options::output_order), the gate and its gradient.
template <class W> status check_backward_io(const problem& p, const W& w, float scale, const backward_io& io,
                                            int64_t tokens, int64_t out_tokens, int64_t d_o_tokens) {
  status s = check_inputs(p, scale, io.q, io.k, io.v, tokens);
  if (s) s = check_tensor("o", io.o, p, p.q_heads, out_tokens, target::gpu);
  if (s) s = check_tensor("d_o", io.d_o, p, p.q_heads, d_o_tokens, target::gpu);
  if (s) s = check_gradients(p, io.dq, io.dk, io.dv, out_tokens);
  if (s) s = check_gate(p, w, io.gate, tokens);
  if (s && io.dgate.data != nullptr && io.gate.data == nullptr)
    s = status::error(errc::bad_argument, "dgate: given without a gate");
  if (s) s = gpu::detail::check_gate_pair(io.gate, io.dgate.data); // a gate's gradient is written
  if (s && io.dgate.data != nullptr) s = check_tensor("dgate", io.dgate, p, p.q_heads, out_tokens, target::gpu);
  return s;
}

// The video part of a tensor of the op: all of it, or with extra tokens (joint attention) its N·64 slots.
template <class Ptr> basic_tensor<Ptr> video_rows(const basic_tensor<Ptr>& x, const problem& p, const extra_tokens& e) {
  using byte = std::conditional_t<std::is_const<std::remove_pointer_t<Ptr>>::value, const unsigned char, unsigned char>;
  const int64_t offset = e.video_start() * x.token_stride * static_cast<int64_t>(dtype_size(p.type));
  const Ptr data = x.data == nullptr ? x.data : static_cast<Ptr>(static_cast<byte*>(x.data) + offset);
  return {data, x.tokens - e.count, x.batch_stride, x.token_stride, x.head_stride};
}

// The token count of o and the gradients (options::output_order), or of the inputs (options::input_order), plus the
// extra tokens: raster order only without them so far (the raster epilogues and the fused tiling passes do not place
// the extra tokens).
inline status op_tokens(const problem& p, token_order order, const char* name, const op_workspace& w, int64_t& tokens) {
  if (w.extra.count > 0 && order == token_order::raster)
    return status::error(errc::unsupported, "%s: raster is not offered with extra tokens yet", name);
  const status s = tokens_in_order(p, order, name, tokens);
  tokens += w.extra.count;
  return s;
}
inline status op_output_tokens(const problem& p, const options& opt, const op_workspace& w, int64_t& tokens) {
  return op_tokens(p, opt.output_order, "output_order", w, tokens);
}
inline status op_input_tokens(const problem& p, const options& opt, const op_workspace& w, int64_t& tokens) {
  return op_tokens(p, opt.input_order, "input_order", w, tokens);
}

// The forward on its plan (both forms of forward() below plan once). Joint: with extra tokens (w.extra), the
// sparse pass over the joint schedule; instantiated by joint_forward only.
template <bool Joint = false> status forward_planned(const problem& p, const options& opt, const op_workspace& w,
                                                     const forward_io& io, op_buffers& buffers, gpu::stream_t stream) {
  if constexpr (Joint) {
    if (w.extra.count == 0) return forward_planned<false>(p, opt, w, io, buffers, stream); // the video-only op
  }
  status s = status::ok();
  if (buffers.state == nullptr) {
    buffers.state_bytes = w.state_bytes;
    buffers.scratch_bytes = w.forward_scratch_bytes;
    return status::ok();
  }
  void* const state = buffers.state;
  void* const scratch = buffers.scratch;
  const float scale = detail::resolve_scale(p, opt);
  const bool raster_in = opt.input_order == token_order::raster;
  int64_t out_tokens = 0, in_tokens = 0;
  if (s) s = op_output_tokens(p, opt, w, out_tokens);
  if (s) s = op_input_tokens(p, opt, w, in_tokens);
  if (s) s = detail::check_inputs(p, scale, io.q, io.k, io.v, in_tokens);
  if (s) s = check_tensor("o", io.o, p, p.q_heads, out_tokens, target::gpu);
  if (s) s = detail::check_gate(p, w, io.gate, in_tokens);
  if (s && raster_in) s = check_raster_inputs(p, io.q, io.k, io.v, io.gate, io.tiled, target::gpu);
  if (s && !w.coarse) s = detail::check_lists(p, opt.q2k, false);
  if (s) s = detail::check_buffers(buffers, w.state_bytes, w.forward_scratch_bytes);
  if (s) {
    s = check_forward_disjoint(p, io, state, w.state_bytes, scratch, w.forward_scratch_bytes,
                               w.coarse ? const_index_lists{} : opt.q2k, raster_in);
  }
  if (!s) return s;
  const forward_io in = tiled_view(io, raster_in);

  index_lists idx{};
  idx.q2k_capacity = w.capacity;
  idx.k2q = w.at<int32_t>(state, w.k2q);
  idx.k2q_offset = w.at<int32_t>(state, w.k2q_offset);
  if (w.coarse) {
    idx.q2k = w.at<int32_t>(state, w.q2k);
    idx.q2k_count = w.at<int32_t>(state, w.q2k_count);
    void *qc = w.at(state, w.q_c), *kc = w.at(state, w.k_c), *vc = w.at(state, w.v_c);
    float* scores = w.at<float>(scratch, w.scores);
    float *qc32 = w.at<float>(state, w.q_c32), *kc32 = w.at<float>(state, w.k_c32);
    // The coarse branch and the selection see the video part only: extra keys never take one of the k slots.
    const auto video = [&](const const_tensor& x) { return video_rows(x, p, w.extra); };
    if (raster_in) { // (no extra tokens: op_input_tokens)
      s = block_means_tiling(p, io.q, io.k, io.v, io.gate, io.tiled, qc, kc, vc, qc32, kc32, stream);
    } else {
      s = block_means(p, video(io.q), video(io.k), video(io.v), qc, kc, vc, qc32, kc32, stream);
    }
    if (s) s = coarse_scores(p, scale, qc32, kc32, scores, stream);
    if (s)
      s = coarse_attention(p, scores, vc, w.at(state, w.o_c), w.at<int8_t>(state, w.o_c_residual),
                           w.at<float>(state, w.lse_c), stream);
    std::size_t select_bytes = w.index_scratch - w.select_scratch;
    if (s) s = select_top_k(p, w.top_k, scores, idx, w.at(scratch, w.select_scratch), select_bytes, stream);
  } else {
    idx.q2k = const_cast<int32_t*>(opt.q2k.q2k);
    idx.q2k_count = const_cast<int32_t*>(opt.q2k.q2k_count);
    if (raster_in) { // no pass of the op reads every token here: plain tile passes (there is no gate)
      if (s) s = tile(p, p.q_heads, io.q, io.tiled.q, stream);
      if (s) s = tile(p, p.kv_heads, io.k, io.tiled.k, stream);
      if (s) s = tile(p, p.kv_heads, io.v, io.tiled.v, stream);
    }
  }
  std::size_t index_bytes = w.forward_scratch_bytes - w.index_scratch;
  index_lists joint{}; // the joint lists: the video's with the extra tiles (joint_attention.hpp)
  int2* const table = w.at<int2>(state, w.joint_table);
  if constexpr (Joint) {
    joint = {w.at<int32_t>(state, w.joint_q2k), w.at<int32_t>(state, w.joint_count), w.tiles, idx.k2q, idx.k2q_offset};
    if (s) s = launch_joint_lists(p, w.extra, as_const(idx), joint.q2k, joint.q2k_count, table, stream);
    gpu::detail::k2q_layout layout{};
    layout.init(w.tiles, p.batch * p.q_heads);
    if (s) s = gpu::detail::launch_k2q(w.tiles, layout, joint, w.at(scratch, w.index_scratch), stream);
  } else {
    if (s) s = build_k2q(p, idx, w.at(scratch, w.index_scratch), index_bytes, stream);
  }
  if (!s) return s;

  // The sparse pass with the combine epilogue (o_c and the gate, when the op selected the lists) and o's
  // rounding residual, which the backward reads.
  gpu::detail::forward_params fp =
      detail::sparse_forward_params(p, scale, in.q, in.k, in.v, io.o, w.at<float>(state, w.lse));
  fp.raster_out = opt.output_order == token_order::raster;
  fp.o_residual = w.at<int8_t>(state, w.o_residual);
  fp.o_c = w.coarse ? w.at<const uint16_t>(state, w.o_c) : nullptr;
  fp.gate = gpu::detail::make_operand(in.gate);
  if constexpr (Joint) {
    return run_joint_forward(p, w.extra, fp, joint_schedule_of(p, w.extra, joint.q2k, joint.q2k_count, nullptr, table),
                             w.at<float>(scratch, w.joint_parts), stream);
  } else {
    return detail::run_forward(p, fp, detail::q2k_schedule(p, as_const(idx)), stream);
  }
}

} // namespace detail

// The whole op's forward: o = o_s + g ⊙ o_c, with its memory in two parts (op_buffers): with
// buffers.state == nullptr only the sizes are set. The state then holds what backward() needs: keep it
// unchanged until then; the scratch is free once the call's work on the stream is done.
inline status forward(const problem& p, const options& opt, const forward_io& io, op_buffers& buffers,
                      gpu::stream_t stream) {
  detail::op_workspace w;
  const status s = detail::plan_op(p, extra_tokens{}, opt, w);
  return s ? detail::forward_planned(p, opt, w, io, buffers, stream) : s;
}

// The whole op's forward in one workspace: with workspace == nullptr only workspace_bytes is set. The
// workspace then holds what backward() needs: keep it unchanged until then.
inline status forward(const problem& p, const options& opt, const forward_io& io, void* workspace,
                      std::size_t& workspace_bytes, gpu::stream_t stream) {
  return detail::in_one_workspace(
      p, extra_tokens{}, opt, false, workspace, workspace_bytes,
      [&](const detail::op_workspace& w, op_buffers& b) { return detail::forward_planned(p, opt, w, io, b, stream); });
}

// The q2k lists the forward selected, as views into its state (capacity k; valid while the state is), for a
// caller that inspects them or passes them back through options::q2k on a later call. Null lists when the
// caller supplied its own. The state may be device memory: nothing is read here.
inline status joint_selected_lists(const problem& p, extra_tokens extra, const options& opt, const void* state,
                                   const_index_lists& lists) {
  detail::op_workspace w;
  const status s = detail::plan_op(p, extra, opt, w);
  if (!s) return s;
  lists = const_index_lists{};
  if (!w.coarse) return status::ok();
  if (state == nullptr) return status::error(errc::null_pointer, "state: pointer is null");
  lists.q2k = w.at<const int32_t>(state, w.q2k);
  lists.q2k_count = w.at<const int32_t>(state, w.q2k_count);
  lists.q2k_capacity = w.capacity;
  return status::ok();
}
inline status selected_lists(const problem& p, const options& opt, const void* state, const_index_lists& lists) {
  return joint_selected_lists(p, extra_tokens{}, opt, state, lists);
}

namespace detail {

// The backward on its plan (both forms of backward() below plan once); Joint as for forward_planned.
template <bool Joint = false> status backward_planned(const problem& p, const options& opt, const op_workspace& w,
                                                      const backward_io& io, op_buffers& buffers,
                                                      gpu::stream_t stream) {
  if constexpr (Joint) {
    if (w.extra.count == 0) return backward_planned<false>(p, opt, w, io, buffers, stream); // the video-only op
  }
  status s = status::ok();
  if (buffers.state == nullptr) {
    buffers.state_bytes = w.state_bytes;
    buffers.scratch_bytes = w.backward_scratch_bytes;
    return status::ok();
  }
  const void* const state = buffers.state;
  void* const scratch = buffers.scratch;
  const int64_t tokens = w.rows;
  const float scale = detail::resolve_scale(p, opt);
  int64_t out_tokens = 0, d_o_tokens = 0;
  if (s) s = op_output_tokens(p, opt, w, out_tokens);
  if (s) s = op_input_tokens(p, opt, w, d_o_tokens);
  if (s) s = check_backward_io(p, w, scale, io, tokens, out_tokens, d_o_tokens);
  if (s && !w.coarse) s = detail::check_lists(p, opt.q2k, false);
  if (s) s = detail::check_buffers(buffers, w.state_bytes, w.backward_scratch_bytes);
  if (s) {
    s = check_backward_disjoint(p, io, state, w.state_bytes, scratch, w.backward_scratch_bytes,
                                w.coarse ? const_index_lists{} : opt.q2k);
  }
  if (!s) return s;

  const_index_lists idx{};
  idx.q2k_capacity = w.capacity;
  idx.k2q = w.at<const int32_t>(state, w.k2q);
  idx.k2q_offset = w.at<const int32_t>(state, w.k2q_offset);
  idx.q2k = w.coarse ? w.at<const int32_t>(state, w.q2k) : opt.q2k.q2k;
  idx.q2k_count = w.coarse ? w.at<const int32_t>(state, w.q2k_count) : opt.q2k.q2k_count;

  // d_o as the kernels read it: the caller's, or with options::input_order raster its tiled copy in the scratch,
  // written by the combine's backward (which reads every row of d_o anyway) or, on the caller's lists, a tile pass.
  const bool raster_in = opt.input_order == token_order::raster;
  const tensor d_o_tiled =
      raster_in ? bshd<void*>(w.at(scratch, w.d_o_tiled), p.batch, tokens, p.q_heads, p.head_dim) : tensor{};
  const const_tensor d_o = raster_in ? as_const(d_o_tiled) : io.d_o;
  const uint16_t* o_c = nullptr;
  if (w.coarse) {
    void* d_o_c = w.at(scratch, w.d_o_c);
    o_c = w.at<const uint16_t>(state, w.o_c);
    float* scores = w.at<float>(scratch, w.b_scores); // formed again: N² floats are not worth keeping
    // The gate and the coarse term are the video rows'; an extra row of dgate is 0.
    s = combine_backward(p, video_rows(io.d_o, p, w.extra), video_rows(io.gate, p, w.extra), o_c,
                         video_rows(io.dgate, p, w.extra), d_o_c, stream, opt.output_order, d_o_tiled);
    if constexpr (Joint) {
      if (s && io.dgate.data != nullptr)
        s = zero_token_rows(p, io.dgate, w.extra.extra_start(w.rows - w.extra.count), w.extra.count, p.q_heads, stream);
    }
    if (s)
      s = coarse_scores(p, scale, w.at<const float>(state, w.q_c32), w.at<const float>(state, w.k_c32), scores, stream);
    std::size_t coarse_bytes = w.sparse_scratch - w.coarse_scratch;
    if (s)
      s = coarse_attention_backward(p, scale, w.at(state, w.q_c), w.at(state, w.k_c), w.at(state, w.v_c), scores, o_c,
                                    w.at<const int8_t>(state, w.o_c_residual), d_o_c, w.at<const float>(state, w.lse_c),
                                    w.at<float>(scratch, w.dq_c), w.at<float>(scratch, w.dk_c),
                                    w.at<float>(scratch, w.dv_c), w.at(scratch, w.coarse_scratch), coarse_bytes,
                                    stream);
    if (!s) return s;
  } else if (raster_in) {
    if (!(s = tile(p, p.q_heads, io.d_o, d_o_tiled, stream))) return s;
  }

  // The sparse pass's backward, dq, dk and dv adding the block-mean backward of the coarse gradients.
  gpu::detail::backward_params bp = detail::sparse_backward_params(p, scale, io.q, io.k, io.v, d_o, io.dq, io.dk, io.dv,
                                                                   w.at<const float>(state, w.lse));
  const bool raster = opt.output_order == token_order::raster;
  bp.raster_out = raster;
  if (w.coarse) {
    bp.fold_q = w.at<const float>(scratch, w.dq_c);
    bp.fold_k = w.at<const float>(scratch, w.dk_c);
    bp.fold_v = w.at<const float>(scratch, w.dv_c);
  }
  // Its row terms are those of o_s = o − g ⊙ o_c, o as the forward computed it (o + its residual).
  gpu::detail::delta_params dp = detail::delta_base(p, gpu::detail::make_operand(io.o), gpu::detail::make_operand(d_o),
                                                    detail::q2k_schedule(p, idx));
  dp.rows_total = w.rows;
  dp.o_raster = raster;
  dp.gate = gpu::detail::make_operand(io.gate);
  dp.o_c = o_c;
  dp.o_residual = w.at<const int8_t>(state, w.o_residual);
  if constexpr (Joint) {
    const int32_t *list = w.at<const int32_t>(state, w.joint_q2k), *count = w.at<const int32_t>(state, w.joint_count);
    const int2* table = w.at<const int2>(state, w.joint_table);
    const joint_tiles jt(p, w.extra);
    auto qs = joint_schedule_of(p, w.extra, list, count, nullptr, table);
    auto ks = joint_schedule_of(p, w.extra, idx.k2q, nullptr, idx.k2q_offset, table);
    qs.ds_pairs = ks.ds_pairs = joint_ds_pairs(jt, w.capacity);
    s = prepare_joint_backward(p, jt, w.capacity, idx.k2q_offset, w.at(scratch, w.sparse_scratch),
                               w.backward_scratch_bytes - w.sparse_scratch, bp, dp, stream);
    return s ? detail::run_backward(p, dp, bp, qs, ks, stream) : s;
  } else {
    const auto qs = detail::q2k_schedule(p, idx);
    const auto ks = detail::k2q_schedule(p, idx);
    s = detail::prepare_sparse_backward(p, idx, w.at(scratch, w.sparse_scratch),
                                        w.backward_scratch_bytes - w.sparse_scratch, bp, dp, stream, false);
    return s ? detail::run_backward(p, dp, bp, qs, ks, stream) : s;
  }
}

} // namespace detail

// The whole op's backward: dq, dk, dv (and dgate when a gate was given) from dO, with the state the forward
// filled and scratch of its own (buffers.state == nullptr: only the sizes are set).
inline status backward(const problem& p, const options& opt, const backward_io& io, op_buffers& buffers,
                       gpu::stream_t stream) {
  detail::op_workspace w;
  const status s = detail::plan_op(p, extra_tokens{}, opt, w);
  return s ? detail::backward_planned(p, opt, w, io, buffers, stream) : s;
}

// The whole op's backward in one workspace, the one the forward filled (its bytes, asked with
// workspace == nullptr, are at least the forward's).
inline status backward(const problem& p, const options& opt, const backward_io& io, void* workspace,
                       std::size_t& workspace_bytes, gpu::stream_t stream) {
  return detail::in_one_workspace(
      p, extra_tokens{}, opt, true, workspace, workspace_bytes,
      [&](const detail::op_workspace& w, op_buffers& b) { return detail::backward_planned(p, opt, w, io, b, stream); });
}

// Joint text + video attention, the whole op (extra_tokens, types.hpp; the CPU reference is reference/joint.hpp): q,
// k, v, the gate, dO, o and the gradients hold N·64 + extra.count tokens, tiled, the extra tokens where `extra` puts
// them. Block means, the coarse branch, the selection and the gate see the video part; the sparse pass is the joint
// one (joint_attention.hpp), its combine epilogue on the video rows alone; an extra row of dgate is 0. The same two
// memory forms as forward() and backward(); extra.count = 0 is the video-only op. Not yet: output_order raster.
// Templates only so that the joint kernels are instantiated where the joint op is called, not in every translation
// unit that includes this header (an inline function is compiled, and its kernels emitted, wherever it is seen).
template <class = void> status joint_forward(const problem& p, extra_tokens extra, const options& opt,
                                             const forward_io& io, op_buffers& buffers, gpu::stream_t stream) {
  detail::op_workspace w;
  const status s = detail::plan_op(p, extra, opt, w);
  return s ? detail::forward_planned<true>(p, opt, w, io, buffers, stream) : s;
}
template <class = void> status joint_forward(const problem& p, extra_tokens extra, const options& opt,
                                             const forward_io& io, void* workspace, std::size_t& workspace_bytes,
                                             gpu::stream_t stream) {
  return detail::in_one_workspace(p, extra, opt, false, workspace, workspace_bytes,
                                  [&](const detail::op_workspace& w, op_buffers& b) {
                                    return detail::forward_planned<true>(p, opt, w, io, b, stream);
                                  });
}
template <class = void> status joint_backward(const problem& p, extra_tokens extra, const options& opt,
                                              const backward_io& io, op_buffers& buffers, gpu::stream_t stream) {
  detail::op_workspace w;
  const status s = detail::plan_op(p, extra, opt, w);
  return s ? detail::backward_planned<true>(p, opt, w, io, buffers, stream) : s;
}
template <class = void> status joint_backward(const problem& p, extra_tokens extra, const options& opt,
                                              const backward_io& io, void* workspace, std::size_t& workspace_bytes,
                                              gpu::stream_t stream) {
  return detail::in_one_workspace(p, extra, opt, true, workspace, workspace_bytes,
                                  [&](const detail::op_workspace& w, op_buffers& b) {
                                    return detail::backward_planned<true>(p, opt, w, io, b, stream);
                                  });
}

} // namespace vsa
