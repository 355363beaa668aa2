// The whole op on the host: block means, coarse attention, top-k selection, sparse attention and the
// gated combination, forward and backward, with the two-phase workspace convention. The passes take the joint op's
// extra tokens (extra_tokens; none for the video-only op here, reference/joint.hpp for the joint op): the coarse
// stages and the gate see the video part of each tensor, the sparse pass the whole token axis.
//
// Values keep double precision between stages; they are rounded to p.type exactly where the GPU
// pipeline stores them (the means, o_c, the per-tile sum of g ⊙ dO, and the outputs), so for the f64
// dtype the whole op is a smooth function of its inputs (between selection changes) and its gradients
// can be checked against finite differences.
#pragma once

#include "block_means.hpp"
#include "coarse_attention.hpp"
#include "combine.hpp"
#include "layout.hpp"
#include "select.hpp"
#include "sparse_attention.hpp"

namespace vsa {
namespace reference {

namespace detail {

// Offsets of the op's memory: the state, written by the forward and read by the backward (offsets into
// op_buffers::state), and each pass's scratch (offsets into op_buffers::scratch). The one-workspace form
// lays the scratch right after the state. Arrays of tokens hold the video slots and the extra tokens.
struct op_layout {
  bool coarse = false;   // false when the caller supplied the q2k lists
  int64_t top_k = 0;     // capacity of the saved q2k lists (coarse path)
  std::size_t total = 0; // bytes so far
  bool overflow = false;

  // state, saved by the forward
  std::size_t q_c, k_c, v_c, q_cs, k_cs, o_c, o_c_exact, lse_c, q2k, q2k_count, o_s, lse;
  std::size_t state_bytes;
  // forward scratch
  std::size_t f_q, f_k, f_v, f_vc, f_scores, f_rank;
  std::size_t forward_scratch;
  // backward scratch
  std::size_t b_q, b_k, b_v, b_do, b_dq, b_dk, b_dv, b_delta, b_doc, b_qc, b_kc, b_vc, b_scores, b_dqc, b_dkc, b_dvc;
  std::size_t backward_scratch;

  std::size_t add(int64_t count, std::size_t element) {
    const std::size_t at = total;
    const int64_t bytes = vsa::detail::checked_mul(count, static_cast<int64_t>(element));
    const int64_t rounded = bytes < 0 || bytes > vsa::detail::size_limit ? -1 : vsa::detail::align_up(bytes);
    if (rounded < 0 || static_cast<uint64_t>(rounded) > static_cast<uint64_t>(SIZE_MAX) - total)
      overflow = true;
    else
      total += static_cast<std::size_t>(rounded);
    return at;
  }
  // The one-workspace size of a pass: the state, then that pass's scratch (the backward's at least the
  // forward's, so that one allocation serves both).
  std::size_t whole(bool backward) const {
    const std::size_t scratch = backward && backward_scratch > forward_scratch ? backward_scratch : forward_scratch;
    return scratch > SIZE_MAX - state_bytes ? SIZE_MAX : state_bytes + scratch;
  }

  op_layout(const problem& p, const extra_tokens& extra, bool with_coarse, int64_t k) : coarse(with_coarse), top_k(k) {
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens() + extra.count, dim = p.head_dim;
    const int64_t bq = p.batch * p.q_heads, bk = p.batch * p.kv_heads;
    const std::size_t ts = dtype_size(p.type), f64 = sizeof(double);
    const int64_t cn = coarse ? n : 0; // coarse regions vanish without the coarse branch
    q_c = add(bq * cn * dim, ts);
    k_c = add(bk * cn * dim, ts);
    v_c = add(bk * cn * dim, ts);
    // The means of q and k the scores are formed from, as the GPU keeps them: fp32 (f64 for the f64 type).
    q_cs = add(bq * cn * dim, f64);
    k_cs = add(bk * cn * dim, f64);
    o_c = add(bq * cn * dim, ts);
    // o_c unrounded: the GPU keeps its rounding residual, so the coarse backward's row term sees o_c as computed.
    o_c_exact = add(bq * cn * dim, f64);
    lse_c = add(bq * cn, f64);
    q2k = add(coarse ? bq * n * top_k : 0, sizeof(int32_t));
    q2k_count = add(bq * cn, sizeof(int32_t));
    // o_s unrounded: the GPU op keeps o's rounding residual, so its backward sees o_s as computed.
    o_s = add(bq * slots * dim, f64);
    lse = add(bq * slots, f64);
    state_bytes = total;
    total = 0;
    f_q = add(bq * slots * dim, f64);
    f_k = add(bk * slots * dim, f64);
    f_v = add(bk * slots * dim, f64);
    f_vc = add(bk * cn * dim, f64);
    f_scores = add(vsa::detail::checked_mul(bq * cn, cn), f64);
    f_rank = add(vsa::detail::checked_mul(bq * cn, cn), sizeof(float));
    forward_scratch = total;
    total = 0;
    b_q = add(bq * slots * dim, f64);
    b_k = add(bk * slots * dim, f64);
    b_v = add(bk * slots * dim, f64);
    b_do = add(bq * slots * dim, f64);
    b_dq = add(bq * slots * dim, f64);
    b_dk = add(bk * slots * dim, f64);
    b_dv = add(bk * slots * dim, f64);
    b_delta = add(bq * slots, f64);
    b_doc = add(bq * cn * dim, f64);
    b_qc = add(bq * cn * dim, f64);
    b_kc = add(bk * cn * dim, f64);
    b_vc = add(bk * cn * dim, f64);
    b_scores = add(vsa::detail::checked_mul(bq * cn, cn), f64);
    b_dqc = add(bq * cn * dim, f64);
    b_dkc = add(bk * cn * dim, f64);
    b_dvc = add(bk * cn * dim, f64);
    backward_scratch = total;
  }
};

template <class T> T* region(void* workspace, std::size_t offset) {
  return reinterpret_cast<T*>(static_cast<unsigned char*>(workspace) + offset);
}

// The type the GPU keeps the means of q and k in for the scores, and the scores themselves: fp32, or f64
// for the f64 type (where the op is then a smooth function of its inputs).
inline dtype means_type(const problem& p) { return p.type == dtype::f64 ? dtype::f64 : dtype::f32; }
inline void round_array(double* x, int64_t n, dtype t) {
  for (int64_t e = 0; e < n; ++e) x[e] = round_to(x[e], t);
}
// The coarse scores of the op from those means, rounded as the GPU stores them.
inline void op_scores(const problem& p, double scale, const double* q_cs, const double* k_cs, double* scores) {
  coarse_scores_core(p, scale, q_cs, k_cs, scores);
  const int64_t n = tile_geometry(p.grid).num_tiles();
  round_array(scores, p.batch * p.q_heads * n * n, means_type(p));
}

// What forward and backward share: the resolved scale, which branch runs, and the lists the sparse pass reads.
struct op_plan {
  float scale = 0.0f;
  bool coarse = true;
  int64_t top_k = 0;
};

// What the workspace size depends on: the problem, the extra tokens and how the lists are chosen (top_k /
// sparsity, or the capacity of the caller's lists). A size query checks only these, as the GPU op does.
inline status plan_op(const problem& p, const extra_tokens& extra, const options& opt, op_plan& plan) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  if (!(s = check_extra_tokens(p, extra))) return s;
  const int64_t n = tile_geometry(p.grid).num_tiles();
  plan.scale = resolve_scale(p, opt);
  plan.coarse = opt.q2k.q2k == nullptr;
  if (!plan.coarse) {
    if (opt.q2k.q2k_capacity < 1 || opt.q2k.q2k_capacity > n)
      return status::error(errc::bad_index, "q2k_capacity: must be in 1..%lld, got %lld", (long long)n,
                           (long long)opt.q2k.q2k_capacity);
    return status::ok();
  }
  return resolve_op_top_k(n, opt, plan.top_k);
}

// The checks of a real call that a size query skips: the scale, the gate against the branch, the caller's lists.
inline status check_op_options(const problem& p, const options& opt, const op_plan& plan, const const_tensor& gate) {
  status s = check_scale(plan.scale);
  if (!s) return s;
  if (plan.coarse) return s;
  if (gate.data != nullptr)
    return status::error(errc::bad_argument,
                         "gate: must be absent when options.q2k is given (the coarse branch does not run)");
  return check_q2k_host(p, opt.q2k);
}

inline status size_query(const op_layout& layout, std::size_t scratch_bytes, op_buffers& buffers) {
  if (layout.overflow) return status::error(errc::bad_grid, "grid: the workspace size overflows");
  buffers.state_bytes = layout.state_bytes;
  buffers.scratch_bytes = scratch_bytes;
  return status::ok();
}

inline status check_buffers(const op_layout& layout, const op_buffers& b, std::size_t scratch_bytes) {
  if (layout.overflow) return status::error(errc::bad_grid, "grid: the workspace size overflows");
  status s = check_buffer("state", b.state, b.state_bytes, layout.state_bytes);
  if (s) s = check_buffer("scratch", b.scratch, b.scratch_bytes, scratch_bytes);
  return s;
}

// The one-workspace form of a pass: the state at its start, the scratch after it.
template <class Pass> status in_one_workspace(const op_layout& layout, bool backward, void* workspace,
                                              std::size_t& workspace_bytes, const Pass& pass) {
  if (layout.overflow) return status::error(errc::bad_grid, "grid: the workspace size overflows");
  const std::size_t whole = layout.whole(backward);
  if (workspace == nullptr) {
    workspace_bytes = whole;
    return status::ok();
  }
  const status s = check_workspace(workspace, workspace_bytes, whole);
  if (!s) return s;
  op_buffers b;
  b.state = workspace;
  b.state_bytes = layout.state_bytes;
  b.scratch = static_cast<unsigned char*>(workspace) + layout.state_bytes;
  b.scratch_bytes = workspace_bytes - layout.state_bytes;
  return pass(b);
}

// The one-workspace form of a pass of the op as `opt` plans it.
template <class Pass> status in_planned_workspace(const problem& p, const extra_tokens& extra, const options& opt,
                                                  bool backward, void* workspace, std::size_t& workspace_bytes,
                                                  const Pass& pass) {
  op_plan plan;
  const status s = plan_op(p, extra, opt, plan);
  if (!s) return s;
  return in_one_workspace(op_layout(p, extra, plan.coarse, plan.top_k), backward, workspace, workspace_bytes, pass);
}

// The lists the sparse pass reads: the op's own (saved in the state) or the caller's.
inline const_index_lists op_lists(const op_plan& plan, const options& opt, const op_layout& layout, void* st) {
  if (!plan.coarse) return opt.q2k;
  return {region<int32_t>(st, layout.q2k), region<int32_t>(st, layout.q2k_count), plan.top_k, nullptr, nullptr};
}

// Tokens first .. first + count of a dense [B, heads, tokens, D] array of doubles, as a view.
inline const_tensor dense_tokens(const problem& p, int64_t heads, const double* x, int64_t tokens, int64_t first,
                                 int64_t count) {
  return token_range(bhsd<const void*>(x, p.batch, tokens, heads, p.head_dim), first, count, dtype::f64);
}

// An output of the op (o, a gradient) in options::output_order: its extra rows copied from `extras` (a view of as
// many rows of doubles), its video part filled by `write` through a tiled view; in raster order that view is a
// temporary of N·64 slots, untiled into the caller's tensor afterwards.
template <class F> status write_output(const problem& p, const extra_tokens& extra, int64_t heads, token_order order,
                                       const tensor& out, const const_tensor& extras, F&& write) {
  const int64_t video = out.tokens - extra.count;
  if (extra.count > 0)
    copy_rows(p, heads, extras, dtype::f64, token_range(out, extra.extra_start(video), extra.count, p.type));
  const tensor part = token_range(out, extra.video_start(), video, p.type);
  if (order == token_order::tiled) {
    write(part);
    return status::ok();
  }
  const int64_t slots = tile_geometry(p.grid).tiled_tokens();
  std::vector<unsigned char> bytes(static_cast<std::size_t>(p.batch * slots * heads * p.head_dim) * dtype_size(p.type));
  const tensor tiled = bshd<void*>(bytes.data(), p.batch, slots, heads, p.head_dim);
  write(tiled);
  return untile(p, heads, as_const(tiled), part);
}
// An output's tensor checked against the token count of options::output_order and the extra tokens.
template <class Ptr> status check_output(const char* name, const basic_tensor<Ptr>& x, const problem& p,
                                         const extra_tokens& extra, const options& opt, int64_t heads) {
  int64_t tokens = 0;
  const status s = output_tokens(p, opt, tokens);
  return s ? check_joint_tensor(name, x, p, heads, tokens, extra, target::cpu) : s;
}

// options::input_order: a valid value, and raster only for the video-only op.
inline status check_input_order(const problem& p, const extra_tokens& extra, const options& opt) {
  int64_t tokens = 0;
  const status s = input_tokens(p, opt, tokens);
  if (s && extra.count > 0 && opt.input_order == token_order::raster)
    return status::error(errc::unsupported, "input_order: raster is not offered with extra tokens yet");
  return s;
}

// The forward, with the selection's lists taken from `chosen` when it is set (q2k rows of capacity top_k;
// see forward_on_lists). With options::input_order raster the inputs are tiled into forward_io::tiled first, and
// the passes read those copies, as on the GPU.
inline status forward_impl(const problem& p, const extra_tokens& extra, const options& opt, const forward_io& io,
                           op_buffers& buffers, const const_index_lists* chosen) {
  detail::op_plan plan;
  status s = detail::plan_op(p, extra, opt, plan);
  if (!s) return s;
  const detail::op_layout layout(p, extra, plan.coarse, plan.top_k);
  if (buffers.state == nullptr) return detail::size_query(layout, layout.forward_scratch, buffers);
  if (!(s = detail::check_op_options(p, opt, plan, io.gate))) return s;
  if (!(s = detail::check_input_order(p, extra, opt))) return s;
  const bool raster_in = opt.input_order == token_order::raster;
  if (raster_in) {
    if (!(s = check_raster_inputs(p, io.q, io.k, io.v, io.gate, io.tiled, target::cpu))) return s;
  } else {
    if (!(s = detail::check_tiled("q", io.q, p, p.q_heads, extra))) return s;
    if (!(s = detail::check_tiled("k", io.k, p, p.kv_heads, extra))) return s;
    if (!(s = detail::check_tiled("v", io.v, p, p.kv_heads, extra))) return s;
    if (!(s = detail::check_gate(p, io.gate, nullptr, false, extra))) return s;
  }
  if (!(s = detail::check_output("o", io.o, p, extra, opt, p.q_heads))) return s;
  if (!(s = detail::check_buffers(layout, buffers, layout.forward_scratch))) return s;
  const const_index_lists lists = chosen != nullptr ? *chosen : plan.coarse ? const_index_lists{} : opt.q2k;
  if (!(s = check_forward_disjoint(p, io, buffers.state, layout.state_bytes, buffers.scratch, layout.forward_scratch,
                                   lists, raster_in)))
    return s;
  if (raster_in) {
    const std::pair<const_tensor, tensor> copies[] = {
        {io.q, io.tiled.q}, {io.k, io.tiled.k}, {io.v, io.tiled.v}, {io.gate, io.tiled.gate}};
    const int64_t heads[] = {p.q_heads, p.kv_heads, p.kv_heads, p.q_heads};
    for (int c = 0; c < 4; ++c)
      if (copies[c].first.data != nullptr && !(s = tile(p, heads[c], copies[c].first, copies[c].second))) return s;
  }
  const forward_io in = vsa::detail::tiled_view(io, raster_in);
  return detail::guarded("forward", [&]() {
    void* const st = buffers.state;
    void* const sc = buffers.scratch;
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens(), dim = p.head_dim;
    const int64_t tokens = slots + extra.count, video0 = extra.video_start();
    const int64_t bq = p.batch * p.q_heads, bk = p.batch * p.kv_heads;
    double* q = detail::region<double>(sc, layout.f_q);
    double* k = detail::region<double>(sc, layout.f_k);
    double* v = detail::region<double>(sc, layout.f_v);
    double* o_s = detail::region<double>(st, layout.o_s);
    detail::gather(p, p.q_heads, in.q, q);
    detail::gather(p, p.kv_heads, in.k, k);
    detail::gather(p, p.kv_heads, in.v, v);
    if (plan.coarse) {
      // The coarse branch and the selection see the video part only: extra keys never take a slot of the k.
      const const_tensor qv = detail::token_range(in.q, video0, slots, p.type),
                         kv = detail::token_range(in.k, video0, slots, p.type),
                         vv = detail::token_range(in.v, video0, slots, p.type);
      void* q_c = detail::region<void>(st, layout.q_c);
      void* k_c = detail::region<void>(st, layout.k_c);
      void* v_c = detail::region<void>(st, layout.v_c);
      detail::tile_means(p, p.q_heads, qv, q_c, p.type);
      detail::tile_means(p, p.kv_heads, kv, k_c, p.type);
      detail::tile_means(p, p.kv_heads, vv, v_c, p.type);
      double* qs = detail::region<double>(st, layout.q_cs);
      double* ks = detail::region<double>(st, layout.k_cs);
      detail::tile_means(p, p.q_heads, qv, qs, dtype::f64);
      detail::tile_means(p, p.kv_heads, kv, ks, dtype::f64);
      detail::round_array(qs, bq * n * dim, detail::means_type(p));
      detail::round_array(ks, bk * n * dim, detail::means_type(p));
      double* vc = detail::region<double>(sc, layout.f_vc);
      double* oc = detail::region<double>(st, layout.o_c_exact);
      detail::load_array(v_c, bk * n * dim, p.type, vc);
      double* scores = detail::region<double>(sc, layout.f_scores);
      detail::op_scores(p, plan.scale, qs, ks, scores);
      detail::coarse_forward_core(p, scores, vc, oc, detail::region<double>(st, layout.lse_c));
      detail::store_array(detail::region<void>(st, layout.o_c), bq * n * dim, p.type, oc);
      float* rank = detail::region<float>(sc, layout.f_rank);
      for (int64_t e = 0; e < bq * n * n; ++e) rank[e] = static_cast<float>(scores[e]);
      const index_lists own{detail::region<int32_t>(st, layout.q2k), detail::region<int32_t>(st, layout.q2k_count),
                            plan.top_k, nullptr, nullptr};
      if (chosen == nullptr) {
        detail::select_core(p, plan.top_k, rank, own);
      } else {
        std::copy(chosen->q2k, chosen->q2k + bq * n * plan.top_k, own.q2k);
        std::copy(chosen->q2k_count, chosen->q2k_count + bq * n, own.q2k_count);
      }
    }
    double* lse = detail::region<double>(st, layout.lse);
    detail::sparse_forward_core(p, plan.scale, q, k, v, detail::op_lists(plan, opt, layout, st), o_s, lse, extra);
    // The extra rows are their attention output alone: the gate and the coarse term are the video's.
    const const_tensor extra_rows =
        detail::dense_tokens(p, p.q_heads, o_s, tokens, extra.extra_start(slots), extra.count);
    return detail::write_output(p, extra, p.q_heads, opt.output_order, io.o, extra_rows, [&](const tensor& o) {
      const const_tensor fine = detail::dense_tokens(p, p.q_heads, o_s, tokens, video0, slots);
      if (plan.coarse) {
        const const_tensor gate = detail::token_range(in.gate, video0, slots, p.type);
        detail::combine_core(p, fine, gate, detail::region<void>(st, layout.o_c), o, dtype::f64);
      } else {
        detail::copy_rows(p, p.q_heads, fine, dtype::f64, o);
      }
    });
  });
}

// The one-workspace form of the forward (workspace == nullptr: sets workspace_bytes).
inline status forward_whole(const problem& p, const extra_tokens& extra, const options& opt, const forward_io& io,
                            void* workspace, std::size_t& workspace_bytes) {
  return detail::in_planned_workspace(p, extra, opt, false, workspace, workspace_bytes, [&](op_buffers& b) {
    return detail::forward_impl(p, extra, opt, io, b, nullptr);
  });
}

inline status forward_on_lists_impl(const problem& p, const extra_tokens& extra, const options& opt,
                                    const forward_io& io, const const_index_lists& lists, void* workspace,
                                    std::size_t& workspace_bytes) {
  detail::op_plan plan;
  status s = detail::plan_op(p, extra, opt, plan);
  if (!s) return s;
  if (!plan.coarse)
    return status::error(errc::bad_argument, "options.q2k: forward_on_lists takes its lists as an argument");
  if (lists.q2k_capacity != plan.top_k)
    return status::error(errc::bad_index, "lists: q2k_capacity %lld must be the op's k = %lld",
                         (long long)lists.q2k_capacity, (long long)plan.top_k);
  if (workspace != nullptr && !(s = check_q2k_host(p, lists))) return s;
  return detail::in_one_workspace(detail::op_layout(p, extra, plan.coarse, plan.top_k), false, workspace,
                                  workspace_bytes,
                                  [&](op_buffers& b) { return detail::forward_impl(p, extra, opt, io, b, &lists); });
}

inline status selected_lists_impl(const problem& p, const extra_tokens& extra, const options& opt, const void* state,
                                  const_index_lists& lists) {
  detail::op_plan plan;
  const status s = detail::plan_op(p, extra, opt, plan);
  if (!s) return s;
  lists = const_index_lists{};
  if (!plan.coarse) return status::ok();
  if (state == nullptr) return status::error(errc::null_pointer, "state: pointer is null");
  const detail::op_layout layout(p, extra, plan.coarse, plan.top_k);
  const unsigned char* base = static_cast<const unsigned char*>(state);
  lists.q2k = reinterpret_cast<const int32_t*>(base + layout.q2k);
  lists.q2k_count = reinterpret_cast<const int32_t*>(base + layout.q2k_count);
  lists.q2k_capacity = plan.top_k;
  return status::ok();
}

inline status backward_impl(const problem& p, const extra_tokens& extra, const options& opt, const backward_io& io,
                            op_buffers& buffers) {
  detail::op_plan plan;
  status s = detail::plan_op(p, extra, opt, plan);
  if (!s) return s;
  const detail::op_layout layout(p, extra, plan.coarse, plan.top_k);
  if (buffers.state == nullptr) return detail::size_query(layout, layout.backward_scratch, buffers);
  if (!(s = detail::check_op_options(p, opt, plan, io.gate))) return s;
  if (!(s = detail::check_input_order(p, extra, opt))) return s;
  const bool raster_in = opt.input_order == token_order::raster; // d_o in raster order; q, k, v and gate tiled
  if (!(s = detail::check_tiled("q", io.q, p, p.q_heads, extra))) return s;
  if (!(s = detail::check_tiled("k", io.k, p, p.kv_heads, extra))) return s;
  if (!(s = detail::check_tiled("v", io.v, p, p.kv_heads, extra))) return s;
  if (!(s = detail::check_output("o", io.o, p, extra, opt, p.q_heads))) return s;
  if (raster_in) {
    s = check_tensor("d_o", io.d_o, p, p.q_heads, tile_geometry(p.grid).raster_tokens(), target::cpu);
  } else {
    s = detail::check_tiled("d_o", io.d_o, p, p.q_heads, extra);
  }
  if (!s) return s;
  if (!(s = detail::check_output("dq", io.dq, p, extra, opt, p.q_heads))) return s;
  if (!(s = detail::check_output("dk", io.dk, p, extra, opt, p.kv_heads))) return s;
  if (!(s = detail::check_output("dv", io.dv, p, extra, opt, p.kv_heads))) return s;
  if (!(s = detail::check_gate(p, io.gate, io.dgate.data, true, extra))) return s;
  if (io.dgate.data != nullptr && !(s = detail::check_output("dgate", io.dgate, p, extra, opt, p.q_heads))) return s;
  if (!(s = detail::check_buffers(layout, buffers, layout.backward_scratch))) return s;
  if (!(s = check_backward_disjoint(p, io, buffers.state, layout.state_bytes, buffers.scratch, layout.backward_scratch,
                                    plan.coarse ? const_index_lists{} : opt.q2k)))
    return s;
  return detail::guarded("backward", [&]() {
    void* const st = buffers.state;
    void* const sc = buffers.scratch;
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), slots = geo.tiled_tokens(), dim = p.head_dim;
    const int64_t tokens = slots + extra.count, video0 = extra.video_start();
    const int64_t bq = p.batch * p.q_heads, bk = p.batch * p.kv_heads;
    double* q = detail::region<double>(sc, layout.b_q);
    double* k = detail::region<double>(sc, layout.b_k);
    double* v = detail::region<double>(sc, layout.b_v);
    const double* o_s = detail::region<double>(st, layout.o_s);
    double* d_o = detail::region<double>(sc, layout.b_do);
    double* dq = detail::region<double>(sc, layout.b_dq);
    double* dk = detail::region<double>(sc, layout.b_dk);
    double* dv = detail::region<double>(sc, layout.b_dv);
    detail::gather(p, p.q_heads, io.q, q);
    detail::gather(p, p.kv_heads, io.k, k);
    detail::gather(p, p.kv_heads, io.v, v);
    // d_o in raster order is tiled first, as the GPU's combine backward does (the extra tokens: none, then).
    std::vector<unsigned char> d_o_bytes(
        raster_in ? static_cast<std::size_t>(p.batch * slots * p.q_heads * dim) * dtype_size(p.type) : 0);
    const tensor d_o_tiled = bshd<void*>(d_o_bytes.data(), p.batch, slots, p.q_heads, dim);
    if (raster_in) {
      const status tiled = tile(p, p.q_heads, io.d_o, d_o_tiled);
      if (!tiled) return tiled;
    }
    const const_tensor d_o_in = raster_in ? as_const(d_o_tiled) : io.d_o;
    detail::gather(p, p.q_heads, d_o_in, d_o);
    detail::sparse_backward_core(p, plan.scale, q, k, v, o_s, d_o, detail::region<double>(st, layout.lse),
                                 detail::op_lists(plan, opt, layout, st), dq, dk, dv,
                                 detail::region<double>(sc, layout.b_delta), extra);
    if (plan.coarse) {
      const const_tensor d_o_video = detail::token_range(d_o_in, video0, slots, p.type),
                         gate = detail::token_range(io.gate, video0, slots, p.type);
      const void* o_c = detail::region<void>(st, layout.o_c);
      double* d_o_c = detail::region<double>(sc, layout.b_doc);
      if (io.dgate.data == nullptr) {
        detail::combine_backward_core(p, d_o_video, gate, o_c, io.dgate, d_o_c);
      } else {
        // The extra rows have no gate, so their dgate is 0: every row of a view of zero strides is one row of zeros.
        const std::vector<double> zero(static_cast<std::size_t>(dim), 0.0);
        const const_tensor zeros{zero.data(), extra.count, 0, 0, 0};
        const status written =
            detail::write_output(p, extra, p.q_heads, opt.output_order, io.dgate, zeros, [&](const tensor& dgate) {
              detail::combine_backward_core(p, d_o_video, gate, o_c, dgate, d_o_c);
            });
        if (!written) return written;
      }
      // The GPU stores the per-tile sum of g ⊙ dO in p.type; the reference rounds it the same way.
      detail::round_array(d_o_c, bq * n * dim, p.type);
      double* qc = detail::region<double>(sc, layout.b_qc);
      double* kc = detail::region<double>(sc, layout.b_kc);
      double* vc = detail::region<double>(sc, layout.b_vc);
      const double* oc = detail::region<double>(st, layout.o_c_exact);
      double* dqc = detail::region<double>(sc, layout.b_dqc);
      double* dkc = detail::region<double>(sc, layout.b_dkc);
      double* dvc = detail::region<double>(sc, layout.b_dvc);
      detail::load_array(detail::region<void>(st, layout.q_c), bq * n * dim, p.type, qc);
      detail::load_array(detail::region<void>(st, layout.k_c), bk * n * dim, p.type, kc);
      detail::load_array(detail::region<void>(st, layout.v_c), bk * n * dim, p.type, vc);
      double* scores = detail::region<double>(sc, layout.b_scores);
      detail::op_scores(p, plan.scale, detail::region<double>(st, layout.q_cs), detail::region<double>(st, layout.k_cs),
                        scores);
      detail::coarse_backward_core(p, plan.scale, qc, kc, vc, scores, oc, d_o_c,
                                   detail::region<double>(st, layout.lse_c), dqc, dkc, dvc);
      // Block-mean backward: each valid token of tile i receives 1/valid(i) of the tile's gradient.
      auto spread = [&](int64_t heads, const double* grad_c, double* grad) {
        detail::parallel_for(p.batch * heads * n, [&](int64_t begin, int64_t end) {
          for (int64_t row = begin; row < end; ++row) {
            const int64_t i = row % n, bh = row / n;
            const int valid = geo.valid(i);
            for (int r = 0; r < valid; ++r)
              detail::axpy(1.0 / valid, grad_c + row * dim, grad + (bh * tokens + video0 + i * tile_tokens + r) * dim,
                           dim);
          }
        });
      };
      spread(p.q_heads, dqc, dq);
      spread(p.kv_heads, dkc, dk);
      spread(p.kv_heads, dvc, dv);
    }
    const auto store = [&](int64_t heads, const double* grad, const tensor& out) {
      const const_tensor extra_rows =
          detail::dense_tokens(p, heads, grad, tokens, extra.extra_start(slots), extra.count);
      return detail::write_output(p, extra, heads, opt.output_order, out, extra_rows, [&](const tensor& t) {
        detail::copy_rows(p, heads, detail::dense_tokens(p, heads, grad, tokens, video0, slots), dtype::f64, t);
      });
    };
    status written = store(p.q_heads, dq, io.dq);
    if (written) written = store(p.kv_heads, dk, io.dk);
    if (written) written = store(p.kv_heads, dv, io.dv);
    return written;
  });
}

inline status backward_whole(const problem& p, const extra_tokens& extra, const options& opt, const backward_io& io,
                             void* workspace, std::size_t& workspace_bytes) {
  return detail::in_planned_workspace(p, extra, opt, true, workspace, workspace_bytes,
                                      [&](op_buffers& b) { return detail::backward_impl(p, extra, opt, io, b); });
}

} // namespace detail

// Forward of the whole op, its memory in two parts (op_buffers): buffers.state == nullptr sets both sizes
// and returns. Otherwise the state must stay untouched until backward() has run on it.
inline status forward(const problem& p, const options& opt, const forward_io& io, op_buffers& buffers) {
  return detail::forward_impl(p, extra_tokens{}, opt, io, buffers, nullptr);
}

// Forward of the whole op in one workspace. workspace == nullptr: sets workspace_bytes and returns.
// Otherwise the workspace must stay untouched until backward() has run on it.
inline status forward(const problem& p, const options& opt, const forward_io& io, void* workspace,
                      std::size_t& workspace_bytes) {
  return detail::forward_whole(p, extra_tokens{}, opt, io, workspace, workspace_bytes);
}

// The whole op's forward (coarse branch and gate included) on given lists instead of its own selection: q2k
// rows of capacity top_k, as the op would select them (checked like caller-supplied lists). For comparing
// another implementation of the op with this one on that implementation's selection: in f64 it is the exact
// op, and near-tied scores can rank differently at another precision. backward() then runs on these lists.
inline status forward_on_lists(const problem& p, const options& opt, const forward_io& io, const_index_lists lists,
                               void* workspace, std::size_t& workspace_bytes) {
  return detail::forward_on_lists_impl(p, extra_tokens{}, opt, io, lists, workspace, workspace_bytes);
}

// The q2k lists the forward selected, as views into its state (capacity k; valid while the state is). Null
// lists when the caller supplied its own.
inline status selected_lists(const problem& p, const options& opt, const void* state, const_index_lists& lists) {
  return detail::selected_lists_impl(p, extra_tokens{}, opt, state, lists);
}

// Backward of the whole op, on the state the forward filled and scratch of its own (buffers.state == nullptr:
// sets both sizes and returns). Writes dq, dk, dv (padding slots 0) and dgate when the gate is given.
inline status backward(const problem& p, const options& opt, const backward_io& io, op_buffers& buffers) {
  return detail::backward_impl(p, extra_tokens{}, opt, io, buffers);
}

// Backward of the whole op in one workspace, the one the forward filled (ask its size with workspace ==
// nullptr; it is at least the forward's).
inline status backward(const problem& p, const options& opt, const backward_io& io, void* workspace,
                       std::size_t& workspace_bytes) {
  return detail::backward_whole(p, extra_tokens{}, opt, io, workspace, workspace_bytes);
}

} // namespace reference
} // namespace vsa
