// The sparse pass of joint text + video attention on the GPU (extra_tokens, types.hpp; the CPU reference is
// reference/joint.hpp): one sequence of the video's N·64 tiled slots and E extra (text, condition) tokens, before or
// after them. A video query attends to the valid tokens of the key tiles selected for it and to every extra token; an
// extra query to every valid video token and every extra token.
//
// Inside the sparse kernels, not beside them: the extra tokens are X = ⌈E/64⌉ more tiles of the same index space
// (joint_schedule, detail/attention_schedule.hpp), tiles N … N+X−1, the last holding E − 64(X−1) rows, read and written
// where the tensors hold them (unpadded). Each video query tile's list is its selected tiles with the X extra tiles
// appended, each extra query tile's list is every tile; a small kernel writes these lists into the workspace (rows
// of N + X entries), and the backward inverts them into k2q as build_k2q does. The forward, dq and dk/dv kernels then
// walk them exactly as the video's own lists: an extra key tile is an always-selected block with its own valid count,
// an extra query tile a dense row of blocks. E = 0 runs the video-only pass, bit for bit.
//
// Hopper's copy engine and its warp-specialized dk/dv take the joint schedule as the video's. Not yet: dq from stored
// dS (NVIDIA before Hopper, where the video-only backward takes it: the joint backward recomputes dS there), and a
// split of an extra query tile's long walk, whose L2 traffic costs the forward ~10% on Hopper (bench/NOTES.md, v26).
#pragma once

#include "detail/attention_glue.hpp"
#include "index.hpp"
#include "sparse_attention.hpp"

namespace vsa {
namespace gpu {
namespace detail {

struct joint_lists_params {
  const int32_t* q2k; // the caller's video lists [B·Hq, N, capacity] and counts [B·Hq, N]
  const int32_t* q2k_count;
  int64_t capacity;
  int32_t* list;              // [B·Hq, T, T], T = N + X: row t holds its count's entries, the rest untouched
  int32_t* count;             // [B·Hq, T]
  int64_t video, tiles, rows; // N, T, B·Hq·T
};

// A block a (head, tile) row, grid-strided. A video row: its entries (clamped to the capacity; an entry outside the
// video's tiles becomes −1, which the kernels treat as an empty tile, as they treat it in the video-only pass), then
// the extra tiles N … T−1. An extra row: every tile 0 … T−1.
template <int Threads = 128> __global__ void __launch_bounds__(Threads) joint_lists_kernel(joint_lists_params p) {
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t head = row / p.tiles, t = row % p.tiles;
    int32_t* out = p.list + row * p.tiles;
    int64_t own = 0;
    if (t < p.video) {
      const int64_t video_row = head * p.video + t;
      const int32_t c = p.q2k_count[video_row];
      own = c < 0 ? 0 : (c > p.capacity ? p.capacity : c);
      const int32_t* in = p.q2k + video_row * p.capacity;
      for (int64_t e = threadIdx.x; e < own; e += Threads) {
        const int32_t j = in[e];
        out[e] = j >= 0 && j < p.video ? j : -1;
      }
    }
    const int64_t first = t < p.video ? p.video : 0, appended = p.tiles - first;
    for (int64_t e = threadIdx.x; e < appended; e += Threads) out[own + e] = static_cast<int32_t>(first + e);
    if (threadIdx.x == 0) p.count[row] = static_cast<int32_t>(own + appended);
  }
}

struct zero_rows_params {
  operand x;
  int64_t first, rows, heads, chunks; // chunks: 16-byte pieces of a row of one head (D / 8)
  int64_t items;                      // B · rows · heads · chunks
};

// Zeroes rows first … first + rows − 1 of every head and batch of a tensor (the extra rows of the whole op's dgate).
template <int Threads = 256> __global__ void __launch_bounds__(Threads) zero_rows_kernel(zero_rows_params p) {
  for (int64_t e = blockIdx.x * int64_t(Threads) + threadIdx.x; e < p.items; e += int64_t(gridDim.x) * Threads) {
    const int64_t c = e % p.chunks, h = (e / p.chunks) % p.heads, r = (e / p.chunks / p.heads) % p.rows,
                  b = e / p.chunks / p.heads / p.rows;
    *reinterpret_cast<uint4*>(p.x.at(b, h, p.first + r) + c * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
}

} // namespace detail
} // namespace gpu

namespace detail {

// Zeroes `rows` rows of x from row `first` (x a checked [B, S, heads, D] view of 16-bit elements).
inline status zero_token_rows(const problem& p, const tensor& x, int64_t first, int64_t rows, int64_t heads,
                              gpu::stream_t stream) {
  const int64_t chunks = p.head_dim / 8;
  gpu::detail::zero_rows_params zp{gpu::detail::make_operand(x),   first, rows, heads, chunks,
                                   p.batch * rows * heads * chunks};
  if (zp.items == 0) return status::ok();
  return gpu::launch("zero rows", gpu::detail::zero_rows_kernel<>, gpu::detail::grid_blocks((zp.items + 255) / 256),
                     256, 0, stream, false, zp);
}

// The joint pass's tiles: N video tiles and X = ⌈E/64⌉ extra ones (none for E = 0).
struct joint_tiles {
  int64_t video, extra, all, tokens;
  joint_tiles(const problem& p, const extra_tokens& e)
      : video(tile_geometry(p.grid).num_tiles()), extra((e.count + gpu::tile_rows - 1) / gpu::tile_rows),
        all(video + extra), tokens(tile_geometry(p.grid).tiled_tokens() + e.count) {}
};

// The joint lists' rows of T = N + X entries, counted and offset by int32 as build_k2q's (E ≥ 1).
inline status check_joint_tiles(const problem& p, const extra_tokens& extra) {
  const joint_tiles t(p, extra);
  if (t.all * t.all > int64_t(INT32_MAX) ||
      t.all > int64_t(gpu::detail::k2q_max_count_blocks) * gpu::detail::k2q_count_columns)
    return status::error(errc::unsupported,
                         "extra.count: %lld video tiles and %lld extra ones are more than the lists hold",
                         (long long)t.video, (long long)t.extra);
  return status::ok();
}

// The joint backward's own scratch, each piece aligned to workspace_alignment: delta (one fp32 a row of S), the
// order kernels' counts and the dk/dv launch order (one int a kv head's tile).
struct joint_backward_scratch {
  std::size_t delta, order_counts, order;
  joint_backward_scratch(const problem& p, const joint_tiles& t)
      : delta(align_up(sizeof(float) * p.batch * p.q_heads * t.tokens)),
        order_counts(align_up(sizeof(int32_t) * 2 * gpu::detail::order_buckets * p.batch * p.kv_heads)),
        order(align_up(sizeof(int32_t) * p.batch * p.kv_heads * t.all)) {}
  std::size_t bytes() const { return delta + order_counts + order; }
};

// Carves a joint_backward_scratch at `scratch`, points bp and dp at its delta and launches what fills the dk/dv
// launch order from the joint k2q lists' offsets.
inline status prepare_joint_backward(const problem& p, const joint_tiles& t, const int32_t* k2q_offset, void* scratch,
                                     gpu::detail::backward_params& bp, gpu::detail::delta_params& dp,
                                     gpu::stream_t stream) {
  const joint_backward_scratch pieces(p, t);
  unsigned char* at = static_cast<unsigned char*>(scratch);
  float* delta = reinterpret_cast<float*>(at);
  const gpu::detail::order_params op =
      order_params_of(p, t.all, k2q_offset, reinterpret_cast<int32_t*>(at + pieces.delta),
                      reinterpret_cast<int32_t*>(at + pieces.delta + pieces.order_counts));
  dp.delta = delta;
  bp.delta = delta;
  bp.order = op.order;
  return gpu::detail::launch_order(op, stream);
}

// Its schedule over lists of T = N + X entries a row: q2k (counts) for the forward and dq, k2q (offsets) for dk/dv.
inline gpu::detail::joint_schedule joint_schedule_of(const problem& p, const extra_tokens& e, const int32_t* list,
                                                     const int32_t* count, const int32_t* offset) {
  const joint_tiles t(p, e);
  const tile_geometry geo(p.grid);
  return {
      {geo, list, count, offset, t.all, t.all}, t.video,  e.video_start(),
      e.extra_start(geo.tiled_tokens()),        t.tokens, static_cast<int>(e.count - (t.extra - 1) * gpu::tile_rows)};
}

// The workspace of the joint pass (E ≥ 1), each piece aligned to workspace_alignment. The forward: the q2k lists and
// counts over T tiles. The backward adds their k2q lists and offsets, build_k2q's scratch, and its own scratch
// (joint_backward_scratch).
struct joint_workspace {
  std::size_t lists, counts, k2q = 0, offsets = 0, k2q_scratch = 0, scratch = 0;
  gpu::detail::k2q_layout layout{};
  joint_workspace(const problem& p, const joint_tiles& t, bool backward) {
    const std::size_t heads = static_cast<std::size_t>(p.batch * p.q_heads), all = static_cast<std::size_t>(t.all);
    lists = align_up(sizeof(int32_t) * heads * all * all);
    counts = align_up(sizeof(int32_t) * heads * all);
    if (!backward) return;
    k2q = lists;
    offsets = align_up(sizeof(int32_t) * heads * (all + 1));
    layout.init(t.all, p.batch * p.q_heads);
    k2q_scratch = layout.total();
    scratch = joint_backward_scratch(p, t).bytes();
  }
  std::size_t bytes() const { return lists + counts + k2q + offsets + k2q_scratch + scratch; }
};

// The workspace of the backward without extra tokens, which runs the video-only pass: the k2q lists of the caller's
// q2k lists and their offsets, build_k2q's scratch, then the least of sparse_attention_backward.
struct video_backward_workspace {
  std::size_t k2q, offsets, rest;
  gpu::detail::k2q_layout layout{};
  video_backward_workspace(const problem& p, int64_t capacity) : rest(sparse_attention_backward_workspace(p)) {
    const int64_t n = tile_geometry(p.grid).num_tiles(), heads = p.batch * p.q_heads;
    k2q = align_up(sizeof(int32_t) * heads * n * capacity);
    offsets = align_up(sizeof(int32_t) * heads * (n + 1));
    layout.init(n, heads);
  }
  std::size_t bytes() const { return k2q + offsets + layout.total() + rest; }
};

// The checks both joint entry points share, in the order of the video-only pass's; tokens is S = N·64 + E.
inline status check_joint_common(const problem& p, const extra_tokens& extra, float scale, const const_tensor& q,
                                 const const_tensor& k, const const_tensor& v, const const_index_lists& idx) {
  status s = check_problem(p, target::gpu);
  if (s) s = check_extra_tokens(p, extra);
  if (!s) return s;
  const int64_t tokens = tile_geometry(p.grid).tiled_tokens() + extra.count;
  if (s) s = check_inputs(p, scale, q, k, v, tokens);
  if (s) s = check_lists(p, idx, false);
  if (s && extra.count > 0) s = check_joint_tiles(p, extra);
  return s;
}

// Writes the joint q2k lists into the workspace's first two pieces.
inline status launch_joint_lists(const problem& p, const joint_tiles& t, const const_index_lists& idx, int32_t* list,
                                 int32_t* count, gpu::stream_t stream) {
  gpu::detail::joint_lists_params jp{idx.q2k, idx.q2k_count, idx.q2k_capacity,           list, count,
                                     t.video, t.all,         p.batch * p.q_heads * t.all};
  return gpu::launch("joint lists", gpu::detail::joint_lists_kernel<>, gpu::detail::grid_blocks(jp.rows), 128, 0,
                     stream, false, jp);
}

} // namespace detail

// Workspace of joint_sparse_attention_forward: none for E = 0, else the joint lists, 4·(N + X)² bytes a query head
// (1.6 MB on wan2.1-1.3b-480p with 256 extra tokens).
inline std::size_t joint_sparse_attention_forward_workspace(const problem& p, extra_tokens extra) {
  if (extra.count <= 0) return 0;
  return detail::joint_workspace(p, detail::joint_tiles(p, extra), false).bytes();
}

// o_s and lse of the joint pass on the caller's q2k lists of the video tiles (idx: q2k, q2k_count, q2k_capacity as
// for sparse_attention_forward; k2q unused). q, o_s [B, S, Hq, D] and k, v [B, S, Hkv, D] views, S = N·64 + E, the
// extra tokens where `extra` places them; lse [B, Hq, S] fp32. Padding slots of the video, and rows with no key,
// get o_s = 0 and lse = +inf. The workspace holds at least joint_sparse_attention_forward_workspace(p, extra) bytes
// (none for E = 0: then it may be null). A template only so that the joint kernels are instantiated where it is called
// (op.hpp's joint_forward says why).
template <class = void>
status joint_sparse_attention_forward(const problem& p, extra_tokens extra, float scale, const_tensor q, const_tensor k,
                                      const_tensor v, const_index_lists idx, tensor o_s, float* lse, void* workspace,
                                      std::size_t workspace_bytes, gpu::stream_t stream) {
  status s = detail::check_joint_common(p, extra, scale, q, k, v, idx);
  if (!s) return s;
  if (extra.count == 0) return sparse_attention_forward(p, scale, q, k, v, idx, o_s, lse, stream);
  const detail::joint_tiles t(p, extra);
  const detail::joint_workspace w(p, t, false);
  if (s) s = check_tensor("o_s", o_s, p, p.q_heads, t.tokens, target::gpu);
  if (s) s = check_pointer("lse", lse, 4);
  if (s) s = check_workspace(workspace, workspace_bytes, w.bytes());
  if (s) s = check_joint_forward_disjoint(p, q, k, v, idx, o_s, lse, extra, workspace, w.bytes());
  if (!s) return s;

  int32_t* list = static_cast<int32_t*>(workspace);
  int32_t* count = reinterpret_cast<int32_t*>(static_cast<unsigned char*>(workspace) + w.lists);
  if (!(s = detail::launch_joint_lists(p, t, idx, list, count, stream))) return s;
  const gpu::detail::forward_params fp = detail::sparse_forward_params(p, scale, q, k, v, o_s, lse);
  return detail::run_forward(p, fp, detail::joint_schedule_of(p, extra, list, count, nullptr), stream);
}

// Workspace of joint_sparse_attention_backward: for E ≥ 1 the joint lists both ways, build_k2q's scratch and the
// backward's own (dq recomputes dS: seven products a pair); for E = 0 the k2q lists of the caller's, build_k2q's
// scratch and the least of sparse_attention_backward.
inline std::size_t joint_sparse_attention_backward_workspace(const problem& p, extra_tokens extra,
                                                             int64_t q2k_capacity) {
  if (extra.count > 0) return detail::joint_workspace(p, detail::joint_tiles(p, extra), true).bytes();
  return detail::video_backward_workspace(p, q2k_capacity).bytes();
}

// dq, dk, dv of the joint pass (padding slots 0; dk and dv summed over each kv head's group), from dO and the
// forward's o_s and lse, on the same q2k lists of the video tiles (k2q is built here). Bitwise reproducible, as the
// video-only backward. The workspace holds at least joint_sparse_attention_backward_workspace(p, extra,
// idx.q2k_capacity) bytes; workspace == nullptr asks for that size. A template as the forward.
template <class = void>
status joint_sparse_attention_backward(const problem& p, extra_tokens extra, float scale, const_tensor q,
                                       const_tensor k, const_tensor v, const_tensor o_s, const_tensor d_o,
                                       const float* lse, const_index_lists idx, tensor dq, tensor dk, tensor dv,
                                       void* workspace, std::size_t& workspace_bytes, gpu::stream_t stream) {
  // The size query needs the problem, the extra tokens and the lists' capacity only, as sparse_attention_backward's.
  status s = check_problem(p, target::gpu);
  if (s) s = check_extra_tokens(p, extra);
  if (s) s = check_q2k_capacity(p, idx.q2k_capacity);
  if (!s) return s;
  const std::size_t need = joint_sparse_attention_backward_workspace(p, extra, idx.q2k_capacity);
  if (workspace == nullptr) {
    workspace_bytes = need;
    return status::ok();
  }
  if (!(s = detail::check_joint_common(p, extra, scale, q, k, v, idx))) return s;
  const detail::joint_tiles t(p, extra);
  const int64_t tokens = t.tokens;
  if (s) s = check_tensor("o_s", o_s, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("d_o", d_o, p, p.q_heads, tokens, target::gpu);
  if (s) s = detail::check_gradients(p, dq, dk, dv, tokens);
  if (s) s = check_pointer("lse", lse, 4);
  if (s) s = check_workspace(workspace, workspace_bytes, need);
  if (s) s = check_sparse_backward_disjoint(p, q, k, v, o_s, d_o, lse, idx, false, dq, dk, dv, workspace, need, extra);
  if (!s) return s;
  unsigned char* at = static_cast<unsigned char*>(workspace);

  if (extra.count == 0) { // the video-only backward on k2q built here
    const detail::video_backward_workspace w(p, idx.q2k_capacity);
    index_lists lists{const_cast<int32_t*>(idx.q2k), const_cast<int32_t*>(idx.q2k_count), idx.q2k_capacity,
                      reinterpret_cast<int32_t*>(at), reinterpret_cast<int32_t*>(at + w.k2q)};
    at += w.k2q + w.offsets;
    if (!(s = gpu::detail::launch_k2q(t.video, w.layout, lists, at, stream))) return s;
    std::size_t rest = w.rest;
    return sparse_attention_backward(p, scale, q, k, v, o_s, d_o, lse, as_const(lists), dq, dk, dv,
                                     at + w.layout.total(), rest, stream);
  }

  const detail::joint_workspace w(p, t, true);
  index_lists lists{};
  lists.q2k = reinterpret_cast<int32_t*>(at);
  lists.q2k_count = reinterpret_cast<int32_t*>(at += w.lists);
  lists.q2k_capacity = t.all;
  lists.k2q = reinterpret_cast<int32_t*>(at += w.counts);
  lists.k2q_offset = reinterpret_cast<int32_t*>(at += w.k2q);
  void* k2q_scratch = (at += w.offsets);
  void* backward_scratch = (at += w.k2q_scratch);
  if (!(s = detail::launch_joint_lists(p, t, idx, lists.q2k, lists.q2k_count, stream))) return s;
  if (!(s = gpu::detail::launch_k2q(t.all, w.layout, lists, k2q_scratch, stream))) return s;

  const auto qs = detail::joint_schedule_of(p, extra, lists.q2k, lists.q2k_count, nullptr);
  const auto ks = detail::joint_schedule_of(p, extra, lists.k2q, nullptr, lists.k2q_offset);
  gpu::detail::backward_params bp = detail::sparse_backward_params(p, scale, q, k, v, d_o, dq, dk, dv, lse);
  gpu::detail::delta_params dp =
      detail::delta_base(p, gpu::detail::make_operand(o_s), gpu::detail::make_operand(d_o), qs);
  if (!(s = detail::prepare_joint_backward(p, t, lists.k2q_offset, backward_scratch, bp, dp, stream))) return s;
  return detail::run_backward(p, dp, bp, qs, ks, stream);
}

} // namespace vsa
