// Joint text + video attention (HunyuanVideo and the like): the sparse pass and the whole op over one token axis
// that holds the video's N·64 tiled slots and E extra (text, condition) tokens, before or after them
// (extra_tokens, types.hpp, gives the layout). Every tensor, o, lse and every gradient included, holds
// S = N·64 + E tokens (an output of the whole op in raster order T·H·W + E); its video part is laid out exactly as
// the video-only op's tensors.
//
// What each query attends to:
//  - a valid video query: the valid tokens of the key tiles selected for its tile, and all E extra tokens;
//  - an extra query: every valid video token and all E extra tokens (dense);
//  - a padding slot of a partial tile: nothing, o = 0 and lse = +inf, as in the video-only op.
// lse is the log-sum-exp over exactly those keys. The block means, the coarse attention and the top-k selection
// are over the video tiles only (extra keys never take one of the k slots), and the gated coarse term of
// o = o_s + g ⊙ o_c is added to the video rows only: an extra row of o is its attention output, and its row of
// dgate is 0 (the gate, [B, S, Hq, D] like q, is not read there). E = 0 is the video-only op, bit for bit.
//
// The computation is the video-only reference's, which takes the extra tokens throughout
// (sparse_attention.hpp, op.hpp); these are its entry points with extra tokens, the same arguments and workspace
// conventions as sparse_attention_forward/backward and forward/backward, plus `extra`.
#pragma once

#include "op.hpp"
#include "sparse_attention.hpp"

namespace vsa {
namespace reference {

// The sparse pass with extra tokens on the caller's q2k lists. q, o_s [B, S, Hq, D] and k, v [B, S, Hkv, D] views
// (tokens = N·64 + extra.count), lse [B, Hq, S] fp32.
inline status joint_sparse_attention_forward(const problem& p, extra_tokens extra, float scale, const_tensor q,
                                             const_tensor k, const_tensor v, const_index_lists idx, tensor o_s,
                                             float* lse) {
  return detail::sparse_forward_pass("joint_sparse_attention_forward", p, extra, scale, q, k, v, idx, o_s, lse);
}

// Its backward: dq, dk, dv (padding slots 0; dk and dv summed over each kv head's group) from the forward's o_s
// and lse.
inline status joint_sparse_attention_backward(const problem& p, extra_tokens extra, float scale, const_tensor q,
                                              const_tensor k, const_tensor v, const_tensor o_s, const_tensor d_o,
                                              const float* lse, const_index_lists idx, tensor dq, tensor dk,
                                              tensor dv) {
  return detail::sparse_backward_pass("joint_sparse_attention_backward", p, extra, scale, q, k, v, o_s, d_o, lse, idx,
                                      dq, dk, dv);
}

// The whole op with extra tokens, forward, its memory in two parts (op_buffers; buffers.state == nullptr sets both
// sizes). q, k, v, gate, d_o hold S = N·64 + E tokens; o and the gradients N·64 + E, or T·H·W + E in raster order
// (options::output_order orders their video part; the extra tokens stay where `extra` puts them).
inline status joint_forward(const problem& p, extra_tokens extra, const options& opt, const forward_io& io,
                            op_buffers& buffers) {
  return detail::forward_impl(p, extra, opt, io, buffers, nullptr);
}

// In one workspace (workspace == nullptr: sets workspace_bytes).
inline status joint_forward(const problem& p, extra_tokens extra, const options& opt, const forward_io& io,
                            void* workspace, std::size_t& workspace_bytes) {
  return detail::forward_whole(p, extra, opt, io, workspace, workspace_bytes);
}

// On given lists instead of its own selection (forward_on_lists says when that is wanted).
inline status joint_forward_on_lists(const problem& p, extra_tokens extra, const options& opt, const forward_io& io,
                                     const_index_lists lists, void* workspace, std::size_t& workspace_bytes) {
  return detail::forward_on_lists_impl(p, extra, opt, io, lists, workspace, workspace_bytes);
}

// The q2k lists joint_forward selected, as views into its state (null lists with the caller's own).
inline status joint_selected_lists(const problem& p, extra_tokens extra, const options& opt, const void* state,
                                   const_index_lists& lists) {
  return detail::selected_lists_impl(p, extra, opt, state, lists);
}

// The whole op with extra tokens, backward, on the state joint_forward filled (buffers.state == nullptr: sets both
// sizes). `extra` must be the forward's: it places o_s and lse in the state, which records neither. Writes dq, dk, dv
// (padding slots 0) and dgate (its extra rows 0) when the gate is given.
inline status joint_backward(const problem& p, extra_tokens extra, const options& opt, const backward_io& io,
                             op_buffers& buffers) {
  return detail::backward_impl(p, extra, opt, io, buffers);
}

// In one workspace, the one joint_forward filled (workspace == nullptr: sets workspace_bytes).
inline status joint_backward(const problem& p, extra_tokens extra, const options& opt, const backward_io& io,
                             void* workspace, std::size_t& workspace_bytes) {
  return detail::backward_whole(p, extra, opt, io, workspace, workspace_bytes);
}

} // namespace reference
} // namespace vsa
