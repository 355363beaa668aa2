// Host side of the attention entry points (sparse_attention.hpp, coarse_attention.hpp and the whole op in
// op.hpp): the checks they share, the schedules, the kernels' parameters filled from the public arguments,
// the sparse backward's scratch, and the dispatched launches. Each parameter struct is filled here once; an
// entry point adds only what is its own (the op's combine epilogue, residuals and coarse gradients, the coarse
// pass's dense operands).
#pragma once

#include "../../validate.hpp"
#include "attention_launch.hpp"

#include <type_traits>

namespace vsa {
namespace detail {

// The scale and q, k, v of the fine attention (the sparse stage and the whole op, forward and backward), checked
// in that order.
inline status check_inputs(const problem& p, float scale, const const_tensor& q, const const_tensor& k,
                           const const_tensor& v, int64_t tokens) {
  status s = check_scale(scale);
  if (s) s = check_tensor("q", q, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("k", k, p, p.kv_heads, tokens, target::gpu);
  if (s) s = check_tensor("v", v, p, p.kv_heads, tokens, target::gpu);
  return s;
}

// The gradients of q, k and v, as both backward entry points of the fine attention check them.
inline status check_gradients(const problem& p, const tensor& dq, const tensor& dk, const tensor& dv, int64_t tokens) {
  status s = check_tensor("dq", dq, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("dk", dk, p, p.kv_heads, tokens, target::gpu);
  if (s) s = check_tensor("dv", dv, p, p.kv_heads, tokens, target::gpu);
  return s;
}

// The q2k lists a caller supplies, and the k2q lists where the pass walks them (the sparse backward).
inline status check_lists(const problem& p, const const_index_lists& idx, bool need_k2q) {
  status s = check_pointer("q2k", idx.q2k, 4);
  if (s) s = check_pointer("q2k_count", idx.q2k_count, 4);
  if (s && need_k2q) s = check_pointer("k2q", idx.k2q, 4);
  if (s && need_k2q) s = check_pointer("k2q_offset", idx.k2q_offset, 4);
  if (s) s = check_q2k_capacity(p, idx.q2k_capacity);
  return s;
}

// The fine pass walks the q2k lists (forward, dq) and the k2q lists (dk, dv) over the tiles of the grid.
inline gpu::detail::sparse_schedule q2k_schedule(const problem& p, const const_index_lists& idx) {
  const tile_geometry geo(p.grid);
  return {geo, idx.q2k, idx.q2k_count, nullptr, idx.q2k_capacity, geo.num_tiles()};
}
inline gpu::detail::sparse_schedule k2q_schedule(const problem& p, const const_index_lists& idx) {
  const tile_geometry geo(p.grid);
  return {geo, idx.k2q, nullptr, idx.k2q_offset, idx.q2k_capacity, geo.num_tiles()};
}
// The coarse pass runs over the N tile means as ⌈N/64⌉ row blocks.
inline gpu::detail::dense_schedule means_schedule(const problem& p) {
  const int64_t n = tile_geometry(p.grid).num_tiles();
  return {n, (n + 63) / 64};
}

// What the forward and backward kernels take as the softmax scale: `scale` (the backward's factor of dq
// and dk) and the base-2 exponent's factor. `scores` are the coarse pass's scores, scaled already and read
// instead of Q·Kᵀ, so that the exponent then takes log2(e) alone; without them it takes scale · log2(e).
template <class Params> void set_scale(Params& x, float scale, const float* scores) {
  x.scores = scores;
  x.scale = scale;
  x.scale_log2 = scores != nullptr ? log2_e : scale * log2_e;
}

// The forward's heads, log-sum-exp and scale; the caller sets the operands (and any epilogue).
inline gpu::detail::forward_params forward_base(const problem& p, float scale, float* lse, const float* scores) {
  gpu::detail::forward_params fp{};
  fp.lse = lse;
  fp.q_heads = p.q_heads;
  fp.group = p.q_heads / p.kv_heads;
  set_scale(fp, scale, scores);
  return fp;
}

// The fine forward over tiled q, k, v into o (o_s of the sparse stage, or the op's o, whose combine epilogue
// and residual the op adds).
inline gpu::detail::forward_params sparse_forward_params(const problem& p, float scale, const const_tensor& q,
                                                         const const_tensor& k, const const_tensor& v, const tensor& o,
                                                         float* lse) {
  gpu::detail::forward_params fp = forward_base(p, scale, lse, nullptr);
  fp.q = gpu::detail::make_operand(q);
  fp.k = gpu::detail::make_operand(k);
  fp.v = gpu::detail::make_operand(v);
  fp.o = gpu::detail::make_operand(o);
  return fp;
}

// The backward's heads, statistics and scale; the caller sets the operands (and any fold of coarse gradients).
inline gpu::detail::backward_params backward_base(const problem& p, float scale, const float* lse,
                                                  const float* scores) {
  gpu::detail::backward_params bp{};
  bp.lse = lse;
  bp.q_heads = p.q_heads;
  bp.kv_heads = p.kv_heads;
  bp.group = p.q_heads / p.kv_heads;
  set_scale(bp, scale, scores);
  return bp;
}

// The fine backward over tiled tensors; delta and the dk/dv launch order come from prepare_sparse_backward.
inline gpu::detail::backward_params sparse_backward_params(const problem& p, float scale, const const_tensor& q,
                                                           const const_tensor& k, const const_tensor& v,
                                                           const const_tensor& d_o, const tensor& dq, const tensor& dk,
                                                           const tensor& dv, const float* lse) {
  gpu::detail::backward_params bp = backward_base(p, scale, lse, nullptr);
  bp.q = gpu::detail::make_operand(q);
  bp.k = gpu::detail::make_operand(k);
  bp.v = gpu::detail::make_operand(v);
  bp.d_o = gpu::detail::make_operand(d_o);
  bp.dq = gpu::detail::make_operand(dq);
  bp.dk = gpu::detail::make_operand(dk);
  bp.dv = gpu::detail::make_operand(dv);
  return bp;
}

// The row terms delta = rowsum(dO ⊙ o), a row of each of the schedule's tiles; no gate, o_c or residual (the
// op and the coarse pass add theirs) and no delta yet (prepare_sparse_backward, or the coarse pass's workspace).
template <class Sched> gpu::detail::delta_params delta_base(const problem& p, const gpu::detail::operand& o,
                                                            const gpu::detail::operand& d_o, const Sched& sched) {
  gpu::detail::delta_params dp{};
  dp.o = o;
  dp.d_o = d_o;
  dp.gate = {nullptr, 0, 0, 0};
  dp.o_c = nullptr;
  dp.q_heads = p.q_heads;
  dp.rows_total = sched.rows_total();
  dp.tiles = sched.video_tiles(); // o_c's rows: the video tiles'
  return dp;
}

// The most workspace the size query asks for the stored dS of dq (attention_dq_stored.hpp) unless every head's
// slots fit under it: 8 KB a pair, 3.9 GB on wan2.1-1.3b-480p, which fits whole; a longer clip runs over groups of
// heads, and one whose single kv head's slots exceed it recomputes dS in dq, unless the caller gives more.
inline constexpr std::size_t stored_ds_budget = std::size_t(8) << 30;

// The fine backward's scratch, each piece aligned to workspace_alignment: delta (one fp32 a query row), the order
// kernels' counts (2·order_buckets ints a kv head), the launch order of the dk/dv blocks (one int a kv head's key
// tile), and for dq from stored dS the map of q2k entries (one int each) and the slots of `units` kv heads at a time
// (the group's pairs a kv head, 64 · 64 elements a pair). The minimum has no slots; with the lists' capacity, as many
// kv heads' slots as `available` bytes hold, at most all of them; where not one fits, or where the device's kernels
// recompute dS (stores_ds_for), none. The video's pass: rows N·64 and N key tiles a head, N·capacity pairs and map
// entries a query head; the joint pass (joint_backward_scratch) its own.
struct sparse_backward_scratch {
  std::size_t delta, counts, order, map = 0, slots = 0;
  int64_t units = 0;
  int64_t tiles;    // key tiles a kv head, which the order covers
  int64_t lead = 0; // the last `lead` of them the joint pass's extra tiles (order_params::lead)
  sparse_backward_scratch(const problem& p, int64_t rows, int64_t tiles_)
      : delta(align_up(sizeof(float) * p.batch * p.q_heads * rows)),
        counts(align_up(sizeof(int32_t) * 2 * gpu::detail::order_buckets * p.batch * p.kv_heads)),
        order(align_up(sizeof(int32_t) * p.batch * p.kv_heads * tiles_)), tiles(tiles_) {}
  explicit sparse_backward_scratch(const problem& p)
      : sparse_backward_scratch(p, tile_geometry(p.grid).num_tiles() * 64, tile_geometry(p.grid).num_tiles()) {}
  // joint_schedule: the pass runs on the joint schedule (a packed batch stated as one grid), whose own table entry
  // (joint_dq_from_stored_ds) says whether dq takes stored dS; given, never defaulted, so that a size query and the
  // launcher of one pass cannot disagree about the slots.
  sparse_backward_scratch(const problem& p, int64_t capacity, std::size_t available, bool joint_schedule)
      : sparse_backward_scratch(p) {
    const int64_t n = tile_geometry(p.grid).num_tiles();
    if (capacity >= 1 && capacity <= n) add_slots(p, n * capacity, n * capacity, available, joint_schedule);
  }
  std::size_t bytes() const { return delta + counts + order + map + slots; }

protected:
  // The map (map_entries a query head) and the slots of as many kv heads as fit (pairs a query head).
  void add_slots(const problem& p, int64_t pairs, int64_t map_entries, std::size_t available, bool joint_schedule) {
    if (!gpu::detail::stores_ds_for(p.type, p.head_dim, joint_schedule)) return;
    const std::size_t unit = align_up(static_cast<std::size_t>(p.q_heads / p.kv_heads) * pairs * gpu::tile_rows *
                                      gpu::tile_rows * dtype_size(p.type));
    const std::size_t map_bytes = align_up(sizeof(int32_t) * p.batch * p.q_heads * map_entries), base = bytes();
    if (available < base + map_bytes + unit) return;
    const std::size_t fit = (available - base - map_bytes) / unit, all = static_cast<std::size_t>(p.batch * p.kv_heads);
    units = static_cast<int64_t>(fit < all ? fit : all);
    map = map_bytes;
    slots = units * unit;
  }
};
// The size query's answer: the slots of every kv head where they fit in stored_ds_budget, else as many as fit.
inline std::size_t sparse_backward_preferred_bytes(const problem& p, int64_t capacity, bool joint_schedule) {
  const sparse_backward_scratch minimum(p);
  return sparse_backward_scratch(p, capacity, minimum.bytes() + stored_ds_budget, joint_schedule).bytes();
}

// The order kernels' parameters over `tiles` key tiles a kv head, from the k2q lists' offsets (launch_order); the last
// `lead` of them (the joint pass's extra tiles) first in each launch of `run` kv heads.
inline gpu::detail::order_params order_params_of(const problem& p, int64_t tiles, int64_t lead, int64_t run,
                                                 const int32_t* k2q_offset, int32_t* counts, int32_t* order) {
  gpu::detail::order_params op{};
  op.lead = lead;
  op.run = run;
  op.k2q_offset = k2q_offset;
  op.counts = counts;
  op.order = order;
  op.tiles = tiles;
  op.q_heads = p.q_heads;
  op.kv_heads = p.kv_heads;
  op.group = p.q_heads / p.kv_heads;
  op.items = p.batch * p.kv_heads * tiles;
  return op;
}

// Carves `pieces` at `scratch`, points bp and dp at its delta and stored dS and launches what fills the dk/dv launch
// order from the k2q lists' offsets. The backward launches dk/dv over groups of pieces.units kv heads where it stores
// dS, else over all.
inline status carve_backward_scratch(const problem& p, const sparse_backward_scratch& pieces, const int32_t* k2q_offset,
                                     void* scratch, gpu::detail::backward_params& bp, gpu::detail::delta_params& dp,
                                     gpu::stream_t stream) {
  unsigned char* at = static_cast<unsigned char*>(scratch);
  float* delta = reinterpret_cast<float*>(at);
  at += pieces.delta;
  const int64_t run = pieces.units > 0 ? pieces.units : p.batch * p.kv_heads;
  const gpu::detail::order_params op =
      order_params_of(p, pieces.tiles, pieces.lead, run, k2q_offset, reinterpret_cast<int32_t*>(at),
                      reinterpret_cast<int32_t*>(at + pieces.counts));
  at += pieces.counts + pieces.order;
  dp.delta = delta;
  bp.delta = delta;
  bp.order = op.order;
  bp.ds_map = pieces.units > 0 ? reinterpret_cast<int32_t*>(at) : nullptr;
  bp.ds = pieces.units > 0 ? reinterpret_cast<uint16_t*>(at + pieces.map) : nullptr;
  bp.ds_units = pieces.units;
  return gpu::detail::launch_order(op, stream);
}

// The video pass's (or a packed batch's: joint_schedule): its scratch of scratch_bytes.
inline status prepare_sparse_backward(const problem& p, const const_index_lists& idx, void* scratch,
                                      std::size_t scratch_bytes, gpu::detail::backward_params& bp,
                                      gpu::detail::delta_params& dp, gpu::stream_t stream, bool joint_schedule) {
  return carve_backward_scratch(p, sparse_backward_scratch(p, idx.q2k_capacity, scratch_bytes, joint_schedule),
                                idx.k2q_offset, scratch, bp, dp, stream);
}

// The forward kernels for the problem's dtype and head dim.
template <class Sched>
status run_forward(const problem& p, const gpu::detail::forward_params& fp, const Sched& sched, gpu::stream_t stream) {
  return gpu::detail::dispatch(p.type, p.head_dim, [&](auto cfg) {
    using C = decltype(cfg);
    return gpu::detail::launch_forward<typename C::element, C::head_dim>(fp, sched, p.batch, p.q_heads, stream);
  });
}

// The backward kernels for the problem's dtype and head dim: delta, then dq over q_sched and dk, dv over
// k_sched.
template <class Sched> status run_backward(const problem& p, const gpu::detail::delta_params& dp,
                                           const gpu::detail::backward_params& bp, const Sched& q_sched,
                                           const Sched& k_sched, gpu::stream_t stream) {
  return gpu::detail::dispatch(p.type, p.head_dim, [&](auto cfg) {
    using C = decltype(cfg);
    using E = typename C::element;
    status st = gpu::detail::launch_delta<E, C::head_dim>(dp, q_sched, p.batch, stream);
    if (!st) return st;
    return gpu::detail::launch_backward<E, C::head_dim>(bp, q_sched, k_sched, p.batch, stream);
  });
}

} // namespace detail
} // namespace vsa
