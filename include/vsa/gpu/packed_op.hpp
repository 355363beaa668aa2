// The whole op's forward over a packed batch (packed_problem, types.hpp): samples of different grids in one sequence,
// one launch a stage for the whole batch, no host round trip, and every sample's outputs those of its own call.
//
// Each stage keeps its one-grid kernel and takes the batch through what it reads of the grid:
// - block means: each tile's valid count from the batch's tile table (gpu::detail::packed_tiles);
// - coarse scores: a head's scores are [N, width] (width: the largest sample's tile count), row i holding its sample's
//   N_s scores first, so that each sample's block of them is that of its own call (gpu::detail::packed_scores);
// - coarse attention: the dense kernels over each sample's means as a sequence of its own ⌈N_s/64⌉ blocks, whose query
//   blocks visit the key blocks of their sample only (gpu::detail::packed_dense_schedule);
// - selection: each row the top k_s of its sample's N_s scores, k_s from the sample's own tile count (options'
//   sparsity, or top_k where every sample has that many tiles), written as tiles of the batch (top_k_params::info);
// - the sparse pass with the combine epilogue: packed_attention.hpp's, on the joint schedule.
// The tables are written by one small kernel from the samples' grids, passed by value (packed_table_kernel). Block
// means, scores, selection and the coarse pass then equal each sample's own call bit for bit; the sparse pass does
// where its kernels are the sample's (packed_attention.hpp says when they are not).
//
// The state holds what the backward needs (the means, o_c, the lists both ways, the log-sum-exps and residuals, the
// tables). The backward (packed_backward) runs the one-grid backward's stages on the same types: the combine's backward
// over the tile table, the coarse backward over packed_dense_schedule, the packed sparse backward with the coarse
// gradients folded in and the combine's row terms in delta; each sample's gradients those of its own backward() where
// the kernels are the same. Outputs in tiled order only.
#pragma once

#include "op.hpp"
#include "packed_attention.hpp"

namespace vsa {

namespace detail {

// The plan of the packed op: the batch as one problem of N tiles (check_packed_problem), the coarse pass's blocks and
// the scores' row width, and the offsets of the state and of the forward's scratch.
struct packed_op_workspace {
  problem whole;
  bool coarse = false; // false when the caller supplied the q2k lists
  int64_t tiles = 0, blocks = 0, width = 0, capacity = 0;
  // state
  std::size_t table = 0, info = 0, block_table = 0, q_c = 0, k_c = 0, v_c = 0, q_c32 = 0, k_c32 = 0, o_c = 0,
              o_c_residual = 0, lse_c = 0, q2k = 0, q2k_count = 0, k2q = 0, k2q_offset = 0, lse = 0, o_residual = 0,
              state_bytes = 0;
  // forward scratch
  std::size_t scores = 0, index_scratch = 0, forward_scratch_bytes = 0;
  // backward scratch
  std::size_t d_o_c = 0, dq_c = 0, dk_c = 0, dv_c = 0, b_scores = 0, coarse_delta = 0, sparse_scratch = 0,
              backward_scratch_bytes = 0;

  template <class T = void> T* at(void* base, std::size_t off) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(base) + off);
  }
  template <class T = void> const T* at(const void* base, std::size_t off) const {
    return reinterpret_cast<const T*>(static_cast<const unsigned char*>(base) + off);
  }
};

inline status plan_packed_op(const packed_problem& pp, const options& opt, packed_op_workspace& w) {
  status s = check_packed_problem(pp, target::gpu, w.whole);
  if (!s) return s;
  if (opt.output_order != token_order::tiled)
    return status::error(errc::unsupported, "output_order: a packed batch's outputs are in tiled order only");
  if (opt.input_order != token_order::tiled)
    return status::error(errc::unsupported, "input_order: a packed batch's inputs are in tiled order only");
  const problem& p = w.whole;
  w.tiles = packed_tiles(p);
  w.coarse = opt.q2k.q2k == nullptr;
  w.blocks = w.width = 0;
  w.capacity = 0;
  for (int64_t i = 0; i < pp.samples; ++i) {
    const int64_t n = tile_geometry(pp.grids[i]).num_tiles();
    w.blocks += (n + gpu::tile_rows - 1) / gpu::tile_rows;
    w.width = std::max(w.width, n);
    if (w.coarse) {
      int64_t k = 0;
      if (!(s = resolve_op_top_k(n, opt, k)))
        return status::error(s.code(), "grids[%lld]: %s", (long long)i, s.message());
      w.capacity = std::max(w.capacity, k);
    }
  }
  // The coarse scores' grid takes the query blocks as its y dimension (launch_coarse_scores).
  if (w.coarse && w.blocks > 65535)
    return status::error(errc::unsupported,
                         "grids: the samples' %lld blocks of 64 tiles exceed the coarse pass's 65535",
                         (long long)w.blocks);
  if (!w.coarse) {
    w.capacity = opt.q2k.q2k_capacity;
    if (!(s = check_q2k_capacity(p, w.capacity))) return s;
  }
  const std::size_t bh = static_cast<std::size_t>(p.q_heads), bhk = static_cast<std::size_t>(p.kv_heads),
                    n = static_cast<std::size_t>(w.tiles), d = static_cast<std::size_t>(p.head_dim);
  std::size_t off = 0;
  const auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off += align_up(bytes);
    return at;
  };
  w.table = take(packed_table_bytes(p));
  if (w.coarse) {
    w.info = take(n * sizeof(int4));
    w.block_table = take(static_cast<std::size_t>(w.blocks) * sizeof(int4));
    take_coarse_state(w, take, p, bh, bhk, n);
  }
  // k2q over the batch's tiles (each key tile's list holds query tiles of its own sample), built by the forward.
  index_lists probe{};
  probe.q2k_capacity = w.capacity;
  std::size_t index_bytes = 0;
  if (!(s = build_k2q(p, probe, nullptr, index_bytes, nullptr))) return s;
  w.k2q = take(bh * n * static_cast<std::size_t>(w.capacity) * sizeof(int32_t));
  w.k2q_offset = take(bh * (n + 1) * sizeof(int32_t));
  w.lse = take(bh * n * gpu::tile_rows * sizeof(float));
  w.o_residual = take(bh * n * gpu::tile_rows * d * sizeof(int8_t));
  w.state_bytes = off;
  // Forward scratch: the scores, [Hq, N, width] (the selection takes no scratch), and build_k2q's.
  off = 0;
  const std::size_t scores_bytes = bh * n * static_cast<std::size_t>(w.width) * sizeof(float);
  if (w.coarse) w.scores = take(scores_bytes);
  w.index_scratch = take(index_bytes);
  w.forward_scratch_bytes = off;
  // Backward scratch: the coarse gradients and the scores again, as the one-grid op's (plan_op), then the sparse
  // backward's (with dq's stored dS where the device takes it).
  off = 0;
  if (w.coarse) {
    const std::size_t e = dtype_size(p.type);
    w.d_o_c = take(bh * n * d * e);
    w.dq_c = take(bh * n * d * sizeof(float));
    w.dk_c = take(bhk * n * d * sizeof(float));
    w.dv_c = take(bhk * n * d * sizeof(float));
    w.b_scores = take(scores_bytes);
    w.coarse_delta = take(bh * n * sizeof(float));
  }
  // The batch runs on the joint schedule, whose table entry decides its slots (not the one grid's it is stated as).
  w.sparse_scratch = take(sparse_backward_preferred_bytes(p, w.capacity, true));
  w.backward_scratch_bytes = off;
  return status::ok();
}

// A template only so that its kernels are instantiated where the packed op is called (packed_forward).
template <class = void> status packed_forward_planned(const packed_problem& pp, const options& opt,
                                                      const packed_op_workspace& w, const forward_io& io,
                                                      op_buffers& buffers, gpu::stream_t stream) {
  if (buffers.state == nullptr) {
    buffers.state_bytes = w.state_bytes;
    buffers.scratch_bytes = w.forward_scratch_bytes;
    return status::ok();
  }
  const problem& p = w.whole;
  void* const state = buffers.state;
  void* const scratch = buffers.scratch;
  const int64_t tokens = w.tiles * gpu::tile_rows;
  const float scale = resolve_scale(p, opt);
  status s = check_inputs(p, scale, io.q, io.k, io.v, tokens);
  if (s) s = check_tensor("o", io.o, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_gate(p, w, io.gate, tokens);
  if (s && !w.coarse) s = check_lists(p, opt.q2k, false);
  if (s) s = check_buffers(buffers, w.state_bytes, w.forward_scratch_bytes);
  if (s) {
    s = check_forward_disjoint(p, io, state, w.state_bytes, scratch, w.forward_scratch_bytes,
                               w.coarse ? const_index_lists{} : opt.q2k);
  }
  if (!s) return s;

  namespace gd = gpu::detail;
  int2* const table = w.at<int2>(state, w.table);
  int4* const blocks = w.coarse ? w.at<int4>(state, w.block_table) : nullptr;
  int4* const info = w.coarse ? w.at<int4>(state, w.info) : nullptr;
  if (!(s = launch_packed_table(pp, table, stream, {info, blocks, &opt}))) return s;

  const_index_lists lists = opt.q2k;
  void* const oc = w.coarse ? w.at(state, w.o_c) : nullptr;
  if (w.coarse) {
    void *qc = w.at(state, w.q_c), *kc = w.at(state, w.k_c), *vc = w.at(state, w.v_c);
    float *qc32 = w.at<float>(state, w.q_c32), *kc32 = w.at<float>(state, w.k_c32);
    float* const scores = w.at<float>(scratch, w.scores);
    s = launch_block_means(p, gd::packed_tiles{table, w.tiles}, io.q, io.k, io.v, qc, kc, vc, qc32, kc32, stream);
    if (s) {
      const gd::coarse_scores_params cp{qc32, kc32, scores, p.q_heads, p.q_heads / p.kv_heads, scale};
      s = launch_coarse_scores(p, cp, gd::packed_scores{blocks, w.tiles, w.width},
                               (w.width + gpu::tile_rows - 1) / gpu::tile_rows, w.blocks, stream);
    }
    if (s) { // the scores are scaled: the coarse forward takes no scale of its own
      gd::forward_params fp = forward_base(p, 1.f, w.at<float>(state, w.lse_c), scores);
      fp.v = gd::make_dense_operand(vc, p.kv_heads, w.tiles, p.head_dim);
      fp.o = gd::make_dense_operand(oc, p.q_heads, w.tiles, p.head_dim);
      fp.o_residual = w.at<int8_t>(state, w.o_c_residual);
      s = run_forward(p, fp, gd::packed_dense_schedule{{w.tiles, w.blocks}, blocks, w.width}, stream);
    }
    int32_t *q2k = w.at<int32_t>(state, w.q2k), *count = w.at<int32_t>(state, w.q2k_count);
    if (s) {
      // Each row's N_s scores and k_s from `info`; the row stride is the width.
      const gd::top_k_params tp{scores,
                                p.q_heads * w.tiles,
                                static_cast<int>(w.width),
                                0,
                                q2k,
                                count,
                                w.capacity,
                                w.width % 4 == 0 && reinterpret_cast<std::uintptr_t>(scores) % 16 == 0,
                                0.f,
                                info,
                                w.tiles};
      s = gd::launch_top_k<true>(tp, stream);
    }
    lists = {q2k, count, w.capacity, nullptr, nullptr};
  }
  // k2q for the backward.
  index_lists both{const_cast<int32_t*>(lists.q2k), const_cast<int32_t*>(lists.q2k_count), lists.q2k_capacity,
                   w.at<int32_t>(state, w.k2q), w.at<int32_t>(state, w.k2q_offset)};
  std::size_t index_bytes = w.forward_scratch_bytes - w.index_scratch;
  if (s) s = build_k2q(p, both, w.at(scratch, w.index_scratch), index_bytes, stream);
  if (!s) return s;

  // The sparse pass with the combine epilogue (o_c and the gate, where the op selected the lists) and o's rounding
  // residual.
  gd::forward_params fp = sparse_forward_params(p, scale, io.q, io.k, io.v, io.o, w.at<float>(state, w.lse));
  fp.o_residual = w.at<int8_t>(state, w.o_residual);
  fp.o_c = static_cast<const uint16_t*>(oc);
  fp.gate = gd::make_operand(io.gate);
  return run_forward(
      p, fp, packed_schedule_of(p, packed_narrow(pp), lists.q2k, lists.q2k_count, nullptr, lists.q2k_capacity, table),
      stream);
}

// The backward on its plan, as backward_planned (op.hpp) for one grid. A template as packed_forward_planned.
template <class = void> status packed_backward_planned(const packed_problem& pp, const options& opt,
                                                       const packed_op_workspace& w, const backward_io& io,
                                                       op_buffers& buffers, gpu::stream_t stream) {
  if (buffers.state == nullptr) {
    buffers.state_bytes = w.state_bytes;
    buffers.scratch_bytes = w.backward_scratch_bytes;
    return status::ok();
  }
  const problem& p = w.whole;
  const void* const state = buffers.state;
  void* const scratch = buffers.scratch;
  const int64_t tokens = w.tiles * gpu::tile_rows;
  const float scale = resolve_scale(p, opt);
  status s = check_backward_io(p, w, scale, io, tokens, tokens, tokens);
  if (s && !w.coarse) s = check_lists(p, opt.q2k, false);
  if (s) s = check_buffers(buffers, w.state_bytes, w.backward_scratch_bytes);
  if (s) {
    s = check_backward_disjoint(p, io, state, w.state_bytes, scratch, w.backward_scratch_bytes,
                                w.coarse ? const_index_lists{} : opt.q2k);
  }
  if (!s) return s;

  namespace gd = gpu::detail;
  const int2* const table = w.at<const int2>(state, w.table);
  const_index_lists idx{};
  idx.q2k_capacity = w.capacity;
  idx.q2k = w.coarse ? w.at<const int32_t>(state, w.q2k) : opt.q2k.q2k;
  idx.q2k_count = w.coarse ? w.at<const int32_t>(state, w.q2k_count) : opt.q2k.q2k_count;
  idx.k2q = w.at<const int32_t>(state, w.k2q);
  idx.k2q_offset = w.at<const int32_t>(state, w.k2q_offset);

  // The combine's backward (dgate, and d_o_c: each tile's sum of g ⊙ dO), then the coarse backward over each sample's
  // blocks on the scores formed again.
  const uint16_t* o_c = nullptr;
  if (w.coarse) {
    const int4* const blocks = w.at<const int4>(state, w.block_table);
    void* const d_o_c = w.at(scratch, w.d_o_c);
    float* const scores = w.at<float>(scratch, w.b_scores);
    o_c = w.at<const uint16_t>(state, w.o_c);
    s = launch_combine_backward(p, gd::packed_tiles{table, w.tiles}, io.d_o, io.gate, o_c, io.dgate, d_o_c, false,
                                stream);
    if (s) {
      const gd::coarse_scores_params cp{w.at<const float>(state, w.q_c32),
                                        w.at<const float>(state, w.k_c32),
                                        scores,
                                        p.q_heads,
                                        p.q_heads / p.kv_heads,
                                        scale};
      s = launch_coarse_scores(p, cp, gd::packed_scores{blocks, w.tiles, w.width},
                               (w.width + gpu::tile_rows - 1) / gpu::tile_rows, w.blocks, stream);
    }
    if (s) {
      s = run_coarse_backward(p, gd::packed_dense_schedule{{w.tiles, w.blocks}, blocks, w.width}, scale,
                              w.at(state, w.q_c), w.at(state, w.k_c), w.at(state, w.v_c), scores, o_c,
                              w.at<const int8_t>(state, w.o_c_residual), d_o_c, w.at<const float>(state, w.lse_c),
                              w.at<float>(scratch, w.dq_c), w.at<float>(scratch, w.dk_c), w.at<float>(scratch, w.dv_c),
                              w.at<float>(scratch, w.coarse_delta), stream);
    }
    if (!s) return s;
  }

  // The packed sparse pass's backward, dq, dk and dv adding the block-mean backward of the coarse gradients, its row
  // terms those of o_s = o − g ⊙ o_c (o restored by its residual).
  gd::backward_params bp =
      sparse_backward_params(p, scale, io.q, io.k, io.v, io.d_o, io.dq, io.dk, io.dv, w.at<const float>(state, w.lse));
  if (w.coarse) {
    bp.fold_q = w.at<const float>(scratch, w.dq_c);
    bp.fold_k = w.at<const float>(scratch, w.dk_c);
    bp.fold_v = w.at<const float>(scratch, w.dv_c);
  }
  const bool narrow = packed_narrow(pp);
  const auto qs = packed_schedule_of(p, narrow, idx.q2k, idx.q2k_count, nullptr, w.capacity, table);
  const auto ks = packed_schedule_of(p, narrow, idx.k2q, nullptr, idx.k2q_offset, w.capacity, table);
  gd::delta_params dp = delta_base(p, gd::make_operand(io.o), gd::make_operand(io.d_o), qs);
  dp.gate = gd::make_operand(io.gate);
  dp.o_c = o_c;
  dp.o_residual = w.at<const int8_t>(state, w.o_residual);
  s = prepare_sparse_backward(p, idx, w.at(scratch, w.sparse_scratch), w.backward_scratch_bytes - w.sparse_scratch, bp,
                              dp, stream, true);
  return s ? run_backward(p, dp, bp, qs, ks, stream) : s;
}

// A pass of the packed op planned and run in one workspace (in_one_workspace's, op.hpp): pass(plan, buffers).
template <class Pass> status packed_in_one_workspace(const packed_problem& pp, const options& opt, bool backward,
                                                     void* workspace, std::size_t& workspace_bytes, const Pass& pass) {
  packed_op_workspace w;
  const status s = plan_packed_op(pp, opt, w);
  if (!s) return s;
  return split_workspace(workspace, workspace_bytes, w.state_bytes, whole_workspace_bytes(w, backward),
                         [&](op_buffers& b) { return pass(w, b); });
}

} // namespace detail

// The whole op's forward over a packed batch: o = o_s + g ⊙ o_c for every sample, each with its own coarse pass and
// selection (k_s from its own tile count). q, gate and o are [1, N·64, Hq, D] views, k and v [1, N·64, Hkv, D], the
// samples' tiled slots one after another (packed_problem); output_order and input_order must be tiled. Memory in two
// parts (op_buffers; with buffers.state == nullptr only the sizes are set), as forward(). A template only so that the
// joint kernels are instantiated where it is called.
template <class = void> status packed_forward(const packed_problem& pp, const options& opt, const forward_io& io,
                                              op_buffers& buffers, gpu::stream_t stream) {
  detail::packed_op_workspace w;
  const status s = detail::plan_packed_op(pp, opt, w);
  return s ? detail::packed_forward_planned(pp, opt, w, io, buffers, stream) : s;
}

// The same in one workspace: with workspace == nullptr only workspace_bytes is set.
template <class = void> status packed_forward(const packed_problem& pp, const options& opt, const forward_io& io,
                                              void* workspace, std::size_t& workspace_bytes, gpu::stream_t stream) {
  return detail::packed_in_one_workspace(pp, opt, false, workspace, workspace_bytes, [&](const auto& w, op_buffers& b) {
    return detail::packed_forward_planned(pp, opt, w, io, b, stream);
  });
}

// The whole op's backward over a packed batch: dq, dk, dv (and dgate where a gate was given) of every sample, from dO
// and the state packed_forward filled, with scratch of its own (buffers.state == nullptr: only the sizes are set).
// Tensors as packed_forward's, dgate as the gate; the same options. A template as packed_forward.
template <class = void> status packed_backward(const packed_problem& pp, const options& opt, const backward_io& io,
                                               op_buffers& buffers, gpu::stream_t stream) {
  detail::packed_op_workspace w;
  const status s = detail::plan_packed_op(pp, opt, w);
  return s ? detail::packed_backward_planned(pp, opt, w, io, buffers, stream) : s;
}

// The same in one workspace, the one the forward filled: with workspace == nullptr only workspace_bytes is set, which
// is the state and the larger of the two passes' scratch, so that one allocation of this size serves both calls.
template <class = void> status packed_backward(const packed_problem& pp, const options& opt, const backward_io& io,
                                               void* workspace, std::size_t& workspace_bytes, gpu::stream_t stream) {
  return detail::packed_in_one_workspace(pp, opt, true, workspace, workspace_bytes, [&](const auto& w, op_buffers& b) {
    return detail::packed_backward_planned(pp, opt, w, io, b, stream);
  });
}

// The q2k lists the packed forward selected (tiles of the batch; capacity the largest k_s, each row's count its
// sample's k_s), as views into its state; null lists when the caller supplied its own. Nothing is read here.
inline status packed_selected_lists(const packed_problem& pp, const options& opt, const void* state,
                                    const_index_lists& lists) {
  detail::packed_op_workspace w;
  const status s = detail::plan_packed_op(pp, opt, w);
  if (!s) return s;
  lists = const_index_lists{};
  if (!w.coarse) return status::ok();
  if (state == nullptr) return status::error(errc::null_pointer, "state: pointer is null");
  const unsigned char* base = static_cast<const unsigned char*>(state);
  lists.q2k = reinterpret_cast<const int32_t*>(base + w.q2k);
  lists.q2k_count = reinterpret_cast<const int32_t*>(base + w.q2k_count);
  lists.q2k_capacity = w.capacity;
  return status::ok();
}

} // namespace vsa
