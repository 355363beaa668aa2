// The binding's ops, written once over a backend: the CPU reference (ops.cpp) or the GPU entry points
// (ops_cuda.cpp). A backend is made for each call from its first tensor (device guard, current stream) and
// takes the library's arguments; the ops here turn torch tensors into them, allocate the outputs and any
// scratch through torch's allocator, and raise the library's message when it rejects an argument.
#pragma once

#include "common.hpp"

#include <torch/library.h>

#include <string>
#include <tuple>

namespace vsa_torch {

using tensor_pair = std::tuple<at::Tensor, at::Tensor>;
using tensor_triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using tensor_quad = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using tensor_oct =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

inline vsa::problem layout_problem(const at::Tensor& x, at::IntArrayRef grid, const char* op) {
  check_bshd(x, x, op, "x");
  vsa::problem p;
  p.batch = x.size(0);
  p.q_heads = p.kv_heads = x.size(2);
  p.head_dim = x.size(3);
  p.grid = to_grid(grid, op);
  p.type = to_dtype(x, op, "x");
  return p;
}

// ToTiled: raster [B, T·H·W, H, D] -> tiled [B, N·64, H, D] (padding slots zero); otherwise back (padding
// slots dropped). The output is laid out as x is.
template <class Backend, bool ToTiled> at::Tensor layout_op(const at::Tensor& x, at::IntArrayRef grid) {
  const char* op = ToTiled ? "tile" : "untile";
  const vsa::problem p = layout_problem(x, grid, op);
  Backend be(x);
  check(vsa::check_problem(p, Backend::target), op);
  const vsa::tile_geometry geo(p.grid);
  at::Tensor y = empty_like_layout(x, ToTiled ? geo.tiled_tokens() : geo.raster_tokens(), p.q_heads);
  check(ToTiled ? be.tile(p, p.q_heads, in(x), out(y)) : be.untile(p, p.q_heads, in(x), out(y)), op);
  return y;
}

inline at::Tensor no_tensor(const at::Tensor& like, at::ScalarType type) {
  return at::empty({0}, like.options().dtype(type));
}

inline void check_state(const at::Tensor& state, const at::Tensor& q, std::size_t bytes, const char* op) {
  TORCH_CHECK_VALUE(state.scalar_type() == at::kByte && state.dim() == 1 && state.is_contiguous(), "vsa.", op,
                    ": state: must be the uint8 tensor the forward returned");
  TORCH_CHECK_VALUE(state.device() == q.device(), "vsa.", op, ": state: on ", state.device(), ", q on ", q.device());
  const int64_t given = state.numel(), needed = static_cast<int64_t>(bytes);
  if (given != needed) {
    const std::string message = std::string("vsa.") + op + ": state: " + std::to_string(given) +
                                " bytes, the forward of this problem leaves " + std::to_string(needed);
    TORCH_CHECK_VALUE(false, message);
  }
}

// The whole op's forward: o (in raster order when raster_out: the library's output_order), the state its backward
// reads, and (return_selection) copies of the selected q2k lists [B, Hq, N, k] and counts [B, Hq, N]; empty tensors
// otherwise. extra, extra_first: joint attention's extra tokens (the library's extra_tokens), whose rows every tensor
// holds beside the video's. raster_in: q, k, v and the gate in raster order (the library's input_order), and then
// also the tiled copies of them the op wrote (the gate's empty without one), which the backward takes.
template <class Backend>
tensor_oct forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& gate, at::IntArrayRef grid, int64_t top_k, double sparsity,
                        double scale, const c10::optional<at::Tensor>& q2k, const c10::optional<at::Tensor>& q2k_count,
                        bool return_selection, bool raster_out, int64_t extra, bool extra_first, bool raster_in,
                        const char* op) {
  const vsa::problem p = make_problem(q, k, grid, op);
  check_bshd(v, q, op, "v");
  if (present(gate)) check_bshd(*gate, q, op, "gate");
  Backend be(q);
  check(vsa::check_problem(p, Backend::target), op);
  const vsa::options opt = make_options(p, q, top_k, sparsity, scale, q2k, q2k_count, op, raster_out, raster_in);
  const vsa::extra_tokens ex{extra, extra_first};
  vsa::op_buffers mem;
  check(be.forward(p, ex, opt, vsa::forward_io{}, mem), op);
  const vsa::tile_geometry geo(p.grid);
  at::Tensor o = empty_like_layout(q, (raster_out ? geo.raster_tokens() : geo.tiled_tokens()) + extra, p.q_heads);
  at::Tensor state = bytes_tensor(mem.state_bytes, q), scratch = bytes_tensor(mem.scratch_bytes, q);
  mem.state = state.data_ptr();
  mem.scratch = data_or_null(scratch);
  vsa::forward_io io{in(q), in(k), in(v), in(gate), out(o)};
  at::Tensor tq = no_tensor(q, q.scalar_type()), tk = tq, tv = tq, tgate = tq;
  if (raster_in) {
    tq = empty_like_layout(q, geo.tiled_tokens(), p.q_heads);
    tk = empty_like_layout(k, geo.tiled_tokens(), p.kv_heads);
    tv = empty_like_layout(v, geo.tiled_tokens(), p.kv_heads);
    if (present(gate)) tgate = empty_like_layout(*gate, geo.tiled_tokens(), p.q_heads);
    io.tiled = {out(tq), out(tk), out(tv), present(gate) ? out(tgate) : vsa::tensor{}};
  }
  check(be.forward(p, ex, opt, io, mem), op);
  at::Tensor lists = no_tensor(q, at::kInt), counts = no_tensor(q, at::kInt);
  vsa::const_index_lists sel;
  if (return_selection) check(be.selected_lists(p, ex, opt, state.data_ptr(), sel), op);
  if (sel.q2k != nullptr) {
    const auto int32 = q.options().dtype(at::kInt);
    const int64_t n = geo.num_tiles();
    lists = at::from_blob(const_cast<int32_t*>(sel.q2k), {p.batch, p.q_heads, n, sel.q2k_capacity}, int32).clone();
    counts = at::from_blob(const_cast<int32_t*>(sel.q2k_count), {p.batch, p.q_heads, n}, int32).clone();
  }
  return {o, state, lists, counts, tq, tk, tv, tgate};
}

// On tiled tensors: o, the state, the lists and counts.
template <class Backend>
tensor_quad forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& gate, at::IntArrayRef grid, int64_t top_k, double sparsity,
                       double scale, const c10::optional<at::Tensor>& q2k, const c10::optional<at::Tensor>& q2k_count,
                       bool return_selection, bool raster_out, int64_t extra, bool extra_first) {
  const auto r = forward_impl<Backend>(q, k, v, gate, grid, top_k, sparsity, scale, q2k, q2k_count, return_selection,
                                       raster_out, extra, extra_first, false, "forward");
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

// On raster tensors (the video-only op): those and the tiled q, k, v and gate.
template <class Backend>
tensor_oct forward_raster_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& gate, at::IntArrayRef grid, int64_t top_k,
                             double sparsity, double scale, const c10::optional<at::Tensor>& q2k,
                             const c10::optional<at::Tensor>& q2k_count, bool return_selection, bool raster_out) {
  return forward_impl<Backend>(q, k, v, gate, grid, top_k, sparsity, scale, q2k, q2k_count, return_selection,
                               raster_out, 0, false, true, "forward_raster");
}

// The whole op's backward: dq, dk, dv, and dgate (empty without a gate), from the forward's state; with raster_out,
// o as the forward wrote it and the gradients in raster order; with raster_in, d_o in raster order (q, k, v and the
// gate tiled: forward_raster's copies).
template <class Backend>
tensor_quad backward_op(const at::Tensor& d_o, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& gate, const at::Tensor& o, const at::Tensor& state,
                        at::IntArrayRef grid, int64_t top_k, double sparsity, double scale,
                        const c10::optional<at::Tensor>& q2k, const c10::optional<at::Tensor>& q2k_count,
                        bool raster_out, int64_t extra, bool extra_first, bool raster_in) {
  const char* op = "backward";
  const vsa::problem p = make_problem(q, k, grid, op);
  check_bshd(v, q, op, "v");
  check_bshd(o, q, op, "o");
  check_bshd(d_o, q, op, "d_o");
  if (present(gate)) check_bshd(*gate, q, op, "gate");
  Backend be(q);
  check(vsa::check_problem(p, Backend::target), op);
  const vsa::options opt = make_options(p, q, top_k, sparsity, scale, q2k, q2k_count, op, raster_out, raster_in);
  const vsa::extra_tokens ex{extra, extra_first};
  vsa::op_buffers mem;
  check(be.backward(p, ex, opt, vsa::backward_io{}, mem), op);
  check_state(state, q, mem.state_bytes, op);
  const vsa::tile_geometry geo(p.grid);
  const int64_t tokens = (raster_out ? geo.raster_tokens() : geo.tiled_tokens()) + extra;
  at::Tensor dq = empty_like_layout(q, tokens, p.q_heads), dk = empty_like_layout(k, tokens, p.kv_heads),
             dv = empty_like_layout(v, tokens, p.kv_heads);
  at::Tensor dgate = present(gate) ? empty_like_layout(*gate, tokens, p.q_heads) : no_tensor(q, q.scalar_type());
  at::Tensor scratch = bytes_tensor(mem.scratch_bytes, q);
  mem.state = state.data_ptr();
  mem.scratch = data_or_null(scratch);
  const vsa::backward_io io{in(q),   in(k),   in(v),   in(gate), in(o),
                            in(d_o), out(dq), out(dk), out(dv),  present(gate) ? out(dgate) : vsa::tensor{}};
  check(be.backward(p, ex, opt, io, mem), op);
  return {dq, dk, dv, dgate};
}

inline vsa::const_index_lists caller_lists(const vsa::problem& p, const at::Tensor& q, const at::Tensor& q2k,
                                           const at::Tensor& q2k_count, const char* op) {
  return make_options(p, q, 0, 0.0, 0.0, q2k, q2k_count, op).q2k;
}

// Sparse attention alone on caller lists: o_s and the fp32 log-sum-exp [B, Hq, N·64].
template <class Backend> tensor_pair sparse_forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& q2k, const at::Tensor& q2k_count,
                                                       at::IntArrayRef grid, double scale) {
  const char* op = "sparse_attention";
  const vsa::problem p = make_problem(q, k, grid, op);
  check_bshd(v, q, op, "v");
  Backend be(q);
  check(vsa::check_problem(p, Backend::target), op);
  const vsa::const_index_lists lists = caller_lists(p, q, q2k, q2k_count, op);
  const int64_t tokens = vsa::tile_geometry(p.grid).tiled_tokens();
  at::Tensor o = empty_like_layout(q, tokens, p.q_heads);
  at::Tensor lse = at::empty({p.batch, p.q_heads, tokens}, q.options().dtype(at::kFloat));
  check(be.sparse_forward(p, static_cast<float>(scale), in(q), in(k), in(v), lists, out(o), lse.data_ptr<float>()), op);
  return {o, lse};
}

template <class Backend>
tensor_triple sparse_backward_op(const at::Tensor& d_o, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& o, const at::Tensor& lse, const at::Tensor& q2k,
                                 const at::Tensor& q2k_count, at::IntArrayRef grid, double scale) {
  const char* op = "sparse_attention_backward";
  const vsa::problem p = make_problem(q, k, grid, op);
  check_bshd(v, q, op, "v");
  check_bshd(o, q, op, "o");
  check_bshd(d_o, q, op, "d_o");
  Backend be(q);
  check(vsa::check_problem(p, Backend::target), op);
  const vsa::const_index_lists lists = caller_lists(p, q, q2k, q2k_count, op);
  const int64_t tokens = vsa::tile_geometry(p.grid).tiled_tokens();
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.device() == q.device() &&
                        lse.numel() == p.batch * p.q_heads * tokens,
                    "vsa.", op, ": lse: must be the contiguous float32 [B, Hq, N·64] the forward returned");
  at::Tensor dq = empty_like_layout(q, tokens, p.q_heads), dk = empty_like_layout(k, tokens, p.kv_heads),
             dv = empty_like_layout(v, tokens, p.kv_heads);
  check(be.sparse_backward(p, static_cast<float>(scale), in(q), in(k), in(v), in(o), in(d_o), lse.data_ptr<float>(),
                           lists, out(dq), out(dk), out(dv)),
        op);
  return {dq, dk, dv};
}

// The linear-attention branch, in tiled or raster order (the token count of q says which it must be).
template <class Backend> at::Tensor linear_forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      at::IntArrayRef grid, int64_t phi, double eps, bool raster) {
  const char* op = "linear_attention";
  const vsa::problem p = make_problem(q, k, grid, op);
  check_bshd(v, q, op, "v");
  Backend be(q);
  check(vsa::check_problem(p, Backend::target), op);
  at::Tensor o = empty_like_layout(q, q.size(1), p.q_heads);
  check(be.linear_forward(p, to_feature_map(phi, op), static_cast<float>(eps),
                          raster ? vsa::token_order::raster : vsa::token_order::tiled, in(q), in(k), in(v), out(o)),
        op);
  return o;
}

template <class Backend> tensor_triple linear_backward_op(const at::Tensor& d_o, const at::Tensor& q,
                                                          const at::Tensor& k, const at::Tensor& v,
                                                          at::IntArrayRef grid, int64_t phi, double eps, bool raster) {
  const char* op = "linear_attention_backward";
  const vsa::problem p = make_problem(q, k, grid, op);
  check_bshd(v, q, op, "v");
  check_bshd(d_o, q, op, "d_o");
  Backend be(q);
  check(vsa::check_problem(p, Backend::target), op);
  at::Tensor dq = empty_like_layout(q, q.size(1), p.q_heads), dk = empty_like_layout(k, k.size(1), p.kv_heads),
             dv = empty_like_layout(v, v.size(1), p.kv_heads);
  check(be.linear_backward(p, to_feature_map(phi, op), static_cast<float>(eps),
                           raster ? vsa::token_order::raster : vsa::token_order::tiled, in(q), in(k), in(v), in(d_o),
                           out(dq), out(dk), out(dv)),
        op);
  return {dq, dk, dv};
}

// Registers every op's kernel of one backend under a dispatch key.
template <class Backend> void register_kernels(torch::Library& m) {
  m.impl("tile", &layout_op<Backend, true>);
  m.impl("untile", &layout_op<Backend, false>);
  m.impl("forward", &forward_op<Backend>);
  m.impl("forward_raster", &forward_raster_op<Backend>);
  m.impl("backward", &backward_op<Backend>);
  m.impl("sparse_attention", &sparse_forward_op<Backend>);
  m.impl("sparse_attention_backward", &sparse_backward_op<Backend>);
  m.impl("linear_attention", &linear_forward_op<Backend>);
  m.impl("linear_attention_backward", &linear_backward_op<Backend>);
}

// The sizes a call's fake kernel needs (torch.compile): the op's state bytes and its k, on one backend.
struct op_sizes {
  int64_t state_bytes = 0, top_k = 0;
};
using op_sizes_fn = op_sizes (*)(const vsa::problem&, const vsa::extra_tokens&, const vsa::options&);
template <class Backend>
op_sizes sizes_of(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt) {
  vsa::op_buffers mem;
  check(Backend::forward_query(p, extra, opt, mem), "forward");
  int64_t k = 0;
  if (opt.q2k.q2k == nullptr) check(vsa::resolve_op_top_k(vsa::tile_geometry(p.grid).num_tiles(), opt, k), "forward");
  return {static_cast<int64_t>(mem.state_bytes), k};
}

// Set by ops_cuda.cpp where the build has CUDA.
inline op_sizes_fn& cuda_sizes() {
  static op_sizes_fn fn = nullptr;
  return fn;
}

} // namespace vsa_torch
