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
// The forward runs an extra query tile's walk over every tile in pieces as long as a video tile's, each a block among
// its head's, and merges the pieces' rows (joint_merge_kernel; joint_schedule says why). Hopper's copy engine and its
// warp-specialized dk/dv take the joint schedule as the video's, and NVIDIA before Hopper takes dq from the dS that
// dk/dv stores, its slots by pair (joint_schedule::ds_slot). The backward's long walks are launched before every video
// tile's, across heads, so that they run beside the rest: an extra query tile's in dq by the schedule's query_block, an
// extra key tile's in dk/dv by the launch order (order_params::lead; bench/NOTES.md, v29). They are not split as the
// forward's are, which a problem of few heads would need.
#pragma once

#include "detail/attention_glue.hpp"
#include "index.hpp"
#include "sparse_attention.hpp"

#include <algorithm>

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

// The joint schedule's table of each tile's first row and valid count (joint_schedule::table).
template <int Threads = 256> __global__ void __launch_bounds__(Threads)
    joint_table_kernel(joint_schedule s, int2* table) {
  for (int64_t t = blockIdx.x * int64_t(Threads) + threadIdx.x; t < s.tiles; t += int64_t(gridDim.x) * Threads)
    table[t] = make_int2(static_cast<int>(s.row_of(t)), s.count_of(t));
}

struct joint_merge_params {
  const float* part_o;   // joint_schedule's: [B·Hq, X, pieces, 64, D]
  const float* part_lse; // [B·Hq, X, pieces, 64]
  operand o;
  float* lse;         // [B·Hq, rows]
  int8_t* o_residual; // [B·Hq, rows, D] or null (forward_params')
  int64_t q_heads, rows, extra_first, extra, pieces;
  int extra_last;
  int64_t items; // B·Hq · X · 64 · D/8
};

// The rows of the extra query tiles from their pieces: lse = log Σ exp(lse_p), o = Σ exp(lse_p − lse) o_p, each thread
// eight columns of a row, the pieces summed in order (bitwise reproducible). Writes o, lse and o's rounding residual
// where the forward's epilogue would have.
template <class E, int D, int Threads = 256> __global__ void __launch_bounds__(Threads)
    joint_merge_kernel(const VSA_GRID_CONSTANT joint_merge_params p) {
  constexpr int chunks = D / 8;
  for (int64_t e = blockIdx.x * int64_t(Threads) + threadIdx.x; e < p.items; e += int64_t(gridDim.x) * Threads) {
    const int chunk = static_cast<int>(e % chunks), row = static_cast<int>((e / chunks) % tile_rows);
    const int64_t x = (e / chunks / tile_rows) % p.extra, bh = e / chunks / tile_rows / p.extra;
    if (row >= (x < p.extra - 1 ? tile_rows : p.extra_last)) continue;
    const int64_t first = (bh * p.extra + x) * p.pieces;
    float top = -__builtin_huge_valf();
    for (int64_t k = 0; k < p.pieces; ++k) top = fmaxf(top, p.part_lse[(first + k) * tile_rows + row]);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, sum = 0.f;
    if (top > -__builtin_huge_valf()) {
      for (int64_t k = 0; k < p.pieces; ++k) {
        const float w = __expf(p.part_lse[(first + k) * tile_rows + row] - top);
        const float4* part =
            reinterpret_cast<const float4*>(p.part_o + ((first + k) * tile_rows + row) * D + chunk * 8);
        const float4 a = part[0], b = part[1];
        sum += w;
        acc[0] += w * a.x, acc[1] += w * a.y, acc[2] += w * a.z, acc[3] += w * a.w;
        acc[4] += w * b.x, acc[5] += w * b.y, acc[6] += w * b.z, acc[7] += w * b.w;
      }
    }
    const bool live = sum > 0.f;
    const float inv = live ? 1.f / sum : 0.f;
    const int64_t token = p.extra_first + x * tile_rows + row, b = bh / p.q_heads, h = bh % p.q_heads;
    uint32_t packed[4];
    uint8_t residual[8];
#pragma unroll
    for (int c = 0; c < 8; c += 2) {
      const float x0 = acc[c] * inv, x1 = acc[c + 1] * inv;
      packed[c / 2] = E::pack(x0, x1);
      residual[c] = static_cast<uint8_t>(
          residual_encode(x0, E::to_float(static_cast<uint16_t>(packed[c / 2] & 0xffffu)), E::type));
      residual[c + 1] =
          static_cast<uint8_t>(residual_encode(x1, E::to_float(static_cast<uint16_t>(packed[c / 2] >> 16)), E::type));
    }
    *reinterpret_cast<uint4*>(p.o.at(b, h, token) + chunk * 8) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    if (chunk == 0) p.lse[bh * p.rows + token] = live ? top + __logf(sum) : __builtin_huge_valf();
    if (p.o_residual != nullptr) {
      uint2 r;
      __builtin_memcpy(&r, residual, sizeof(r));
      *reinterpret_cast<uint2*>(p.o_residual + (bh * p.rows + token) * D + chunk * 8) = r;
    }
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

// The forward's pieces of an extra query tile's walk over all T tiles (joint_schedule): about 64 entries each, the
// length of a video tile's walk at 90% sparsity and k ≈ 64, and at least two where T allows, so that small grids run
// the merge too. They depend on the tiles alone, so that the forward's workspace does not depend on the lists.
struct joint_pieces {
  int64_t split, pieces;
  explicit joint_pieces(const joint_tiles& t) {
    const int64_t want = std::max<int64_t>(2, (t.all + 63) / 64);
    split = (t.all + want - 1) / want;
    pieces = (t.all + split - 1) / split;
  }
  // Bytes of the pieces' rows: o (fp32, D a row), then lse.
  static std::size_t bytes(const problem& p, const joint_tiles& t) {
    return sizeof(float) * static_cast<std::size_t>(p.batch * p.q_heads * t.extra * joint_pieces(t).pieces *
                                                    gpu::tile_rows * (p.head_dim + 1));
  }
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

// The most pairs of a query head in the joint lists of video lists of `capacity` entries a row: N rows of at most
// capacity + X entries, X rows of T. The joint schedule's ds_pairs.
inline int64_t joint_ds_pairs(const joint_tiles& t, int64_t capacity) {
  return t.video * (capacity + t.extra) + t.extra * t.all;
}

// The joint backward's own scratch (sparse_backward_scratch): delta over the S rows of a query head, the order over its
// T key tiles, and with the video lists' capacity dq's stored dS where the device takes it: the map of the joint q2k
// entries (T² a query head) and the slots of joint_ds_pairs a query head.
struct joint_backward_scratch : sparse_backward_scratch {
  joint_backward_scratch(const problem& p, const joint_tiles& t) : sparse_backward_scratch(p, t.tokens, t.all) {
    lead = t.extra;
  }
  joint_backward_scratch(const problem& p, const joint_tiles& t, int64_t capacity, std::size_t available)
      : joint_backward_scratch(p, t) {
    if (capacity >= 1 && capacity <= t.video) add_slots(p, joint_ds_pairs(t, capacity), t.all * t.all, available, true);
  }
  // The size query's answer: every kv head's slots where they fit in stored_ds_budget, else as many as fit.
  static std::size_t preferred(const problem& p, const joint_tiles& t, int64_t capacity) {
    return joint_backward_scratch(p, t, capacity, joint_backward_scratch(p, t).bytes() + stored_ds_budget).bytes();
  }
};

// Carves a joint_backward_scratch of `available` bytes at `scratch` (capacity: the video lists'), as
// prepare_sparse_backward does the video pass's.
inline status prepare_joint_backward(const problem& p, const joint_tiles& t, int64_t capacity,
                                     const int32_t* k2q_offset, void* scratch, std::size_t available,
                                     gpu::detail::backward_params& bp, gpu::detail::delta_params& dp,
                                     gpu::stream_t stream) {
  return carve_backward_scratch(p, joint_backward_scratch(p, t, capacity, available), k2q_offset, scratch, bp, dp,
                                stream);
}

// Its schedule over lists of T = N + X entries a row: q2k (counts) for the forward and dq, k2q (offsets) for dk/dv;
// `table` is where launch_joint_lists wrote the tile table.
inline gpu::detail::joint_schedule joint_schedule_of(const problem& p, const extra_tokens& e, const int32_t* list,
                                                     const int32_t* count, const int32_t* offset, const int2* table) {
  const joint_tiles t(p, e);
  const tile_geometry geo(p.grid);
  gpu::detail::joint_schedule s{
      {geo, list, count, offset, t.all, t.all}, t.video,  e.video_start(),
      e.extra_start(geo.tiled_tokens()),        t.tokens, static_cast<int>(e.count - (t.extra - 1) * gpu::tile_rows)};
  s.table = table;
  return s;
}

// The workspace of the joint pass (E ≥ 1), each piece aligned to workspace_alignment. The forward: the q2k lists and
// counts over T tiles, the schedule's tile table, and the rows of its pieces (joint_pieces). The backward, instead of
// the pieces, adds their k2q lists and offsets, build_k2q's scratch, and its own scratch (joint_backward_scratch).
struct joint_workspace {
  std::size_t lists, counts, table, parts = 0, k2q = 0, offsets = 0, k2q_scratch = 0, scratch = 0;
  gpu::detail::k2q_layout layout{};
  joint_workspace(const problem& p, const joint_tiles& t, bool backward) {
    const std::size_t heads = static_cast<std::size_t>(p.batch * p.q_heads), all = static_cast<std::size_t>(t.all);
    lists = align_up(sizeof(int32_t) * heads * all * all);
    counts = align_up(sizeof(int32_t) * heads * all);
    table = align_up(sizeof(int32_t) * 2 * all);
    if (!backward) {
      parts = align_up(joint_pieces::bytes(p, t));
      return;
    }
    k2q = lists;
    offsets = align_up(sizeof(int32_t) * heads * (all + 1));
    layout.init(t.all, p.batch * p.q_heads);
    k2q_scratch = layout.total();
    scratch = joint_backward_scratch(p, t).bytes();
  }
  // The backward's with dq's stored dS for lists of `capacity` entries a row (joint_backward_scratch::preferred).
  joint_workspace(const problem& p, const joint_tiles& t, int64_t capacity) : joint_workspace(p, t, true) {
    scratch = joint_backward_scratch::preferred(p, t, capacity);
  }
  std::size_t bytes() const { return lists + counts + table + parts + k2q + offsets + k2q_scratch + scratch; }
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

// Writes the joint q2k lists and the schedule's tile table (joint_schedule::table).
inline status launch_joint_lists(const problem& p, const extra_tokens& extra, const const_index_lists& idx,
                                 int32_t* list, int32_t* count, int2* table, gpu::stream_t stream) {
  const joint_tiles t(p, extra);
  gpu::detail::joint_lists_params jp{idx.q2k, idx.q2k_count, idx.q2k_capacity,           list, count,
                                     t.video, t.all,         p.batch * p.q_heads * t.all};
  status s = gpu::launch("joint lists", gpu::detail::joint_lists_kernel<>, gpu::detail::grid_blocks(jp.rows), 128, 0,
                         stream, false, jp);
  if (!s) return s;
  return gpu::launch("joint lists (tiles)", gpu::detail::joint_table_kernel<>,
                     gpu::detail::grid_blocks((t.all + 255) / 256), 256, 0, stream, false,
                     joint_schedule_of(p, extra, nullptr, nullptr, nullptr, nullptr), table);
}

// The joint forward on schedule s: the sparse pass, each extra query tile's walk in pieces whose rows go to `parts`
// (joint_pieces::bytes of them), then their merge into o, lse and o's residual. A template as the entry points below.
template <class = void> status run_joint_forward(const problem& p, const extra_tokens& extra,
                                                 const gpu::detail::forward_params& fp, gpu::detail::joint_schedule s,
                                                 float* parts, gpu::stream_t stream) {
  const joint_tiles t(p, extra);
  const joint_pieces pieces(t);
  s.split = pieces.split;
  s.pieces = pieces.pieces;
  s.part_o = parts;
  s.part_lse = parts + p.batch * p.q_heads * t.extra * pieces.pieces * gpu::tile_rows * p.head_dim;
  status st = run_forward(p, fp, s, stream);
  if (!st) return st;
  const gpu::detail::joint_merge_params mp{
      s.part_o,      s.part_lse, fp.o,         fp.lse,
      fp.o_residual, p.q_heads,  s.rows,       s.extra_first,
      t.extra,       s.pieces,   s.extra_last, p.batch * p.q_heads * t.extra * gpu::tile_rows * (p.head_dim / 8)};
  return gpu::detail::dispatch(p.type, p.head_dim, [&](auto cfg) {
    using C = decltype(cfg);
    return gpu::launch("joint merge", gpu::detail::joint_merge_kernel<typename C::element, C::head_dim>,
                       gpu::detail::grid_blocks((mp.items + 255) / 256), 256, 0, stream, false, mp);
  });
}

} // namespace detail

// Workspace of joint_sparse_attention_forward: none for E = 0, else the joint lists, 4·(N + X)² bytes a query head
// (1.6 MB on wan2.1-1.3b-480p with 256 extra tokens), and the rows of the extra query tiles' pieces, 4·X·pieces·64·(D +
// 1) bytes a query head (1.3 MB there).
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

  unsigned char* const at = static_cast<unsigned char*>(workspace);
  int32_t* list = reinterpret_cast<int32_t*>(at);
  int32_t* count = reinterpret_cast<int32_t*>(at + w.lists);
  int2* table = reinterpret_cast<int2*>(at + w.lists + w.counts);
  if (!(s = detail::launch_joint_lists(p, extra, idx, list, count, table, stream))) return s;
  const gpu::detail::forward_params fp = detail::sparse_forward_params(p, scale, q, k, v, o_s, lse);
  return detail::run_joint_forward(p, extra, fp, detail::joint_schedule_of(p, extra, list, count, nullptr, table),
                                   reinterpret_cast<float*>(at + w.lists + w.counts + w.table), stream);
}

// Workspace of joint_sparse_attention_backward. For E ≥ 1 the joint lists both ways, build_k2q's scratch and the
// backward's own: where the device's kernels take dq from stored dS (NVIDIA before Hopper), the slots of every head's
// pairs where they fit in 8 GiB (0.36 GB a query head on wan2.1-1.3b-480p with E = 256), else of as many kv heads as
// fit; the call takes any size from the least (joint_sparse_attention_backward_least_workspace: dq recomputes dS, seven
// products a pair) up. For E = 0 the k2q lists of the caller's, build_k2q's scratch and the least of
// sparse_attention_backward.
inline std::size_t joint_sparse_attention_backward_workspace(const problem& p, extra_tokens extra,
                                                             int64_t q2k_capacity) {
  if (extra.count > 0) return detail::joint_workspace(p, detail::joint_tiles(p, extra), q2k_capacity).bytes();
  return detail::video_backward_workspace(p, q2k_capacity).bytes();
}
inline std::size_t joint_sparse_attention_backward_least_workspace(const problem& p, extra_tokens extra,
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
  if (workspace == nullptr) {
    workspace_bytes = joint_sparse_attention_backward_workspace(p, extra, idx.q2k_capacity);
    return status::ok();
  }
  const std::size_t need = joint_sparse_attention_backward_least_workspace(p, extra, idx.q2k_capacity);
  if (!(s = detail::check_joint_common(p, extra, scale, q, k, v, idx))) return s;
  const detail::joint_tiles t(p, extra);
  const int64_t tokens = t.tokens;
  if (s) s = check_tensor("o_s", o_s, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("d_o", d_o, p, p.q_heads, tokens, target::gpu);
  if (s) s = detail::check_gradients(p, dq, dk, dv, tokens);
  if (s) s = check_pointer("lse", lse, 4);
  if (s) s = check_workspace(workspace, workspace_bytes, need);
  // With extra tokens: the lists and their k2q (fixed), then the backward's scratch in whatever is left.
  const detail::joint_workspace w(p, t, true);
  const std::size_t fixed = extra.count > 0 ? w.bytes() - w.scratch : need;
  const std::size_t used =
      extra.count > 0 ? fixed + detail::joint_backward_scratch(p, t, idx.q2k_capacity, workspace_bytes - fixed).bytes()
                      : need;
  if (s) s = check_sparse_backward_disjoint(p, q, k, v, o_s, d_o, lse, idx, false, dq, dk, dv, workspace, used, extra);
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

  index_lists lists{};
  lists.q2k = reinterpret_cast<int32_t*>(at);
  lists.q2k_count = reinterpret_cast<int32_t*>(at += w.lists);
  lists.q2k_capacity = t.all;
  int2* const table = reinterpret_cast<int2*>(at += w.counts);
  lists.k2q = reinterpret_cast<int32_t*>(at += w.table);
  lists.k2q_offset = reinterpret_cast<int32_t*>(at += w.k2q);
  void* k2q_scratch = (at += w.offsets);
  void* backward_scratch = (at += w.k2q_scratch);
  if (!(s = detail::launch_joint_lists(p, extra, idx, lists.q2k, lists.q2k_count, table, stream))) return s;
  if (!(s = gpu::detail::launch_k2q(t.all, w.layout, lists, k2q_scratch, stream))) return s;

  auto qs = detail::joint_schedule_of(p, extra, lists.q2k, lists.q2k_count, nullptr, table);
  auto ks = detail::joint_schedule_of(p, extra, lists.k2q, nullptr, lists.k2q_offset, table);
  qs.ds_pairs = ks.ds_pairs = detail::joint_ds_pairs(t, idx.q2k_capacity);
  gpu::detail::backward_params bp = detail::sparse_backward_params(p, scale, q, k, v, d_o, dq, dk, dv, lse);
  gpu::detail::delta_params dp =
      detail::delta_base(p, gpu::detail::make_operand(o_s), gpu::detail::make_operand(d_o), qs);
  if (!(s = detail::prepare_joint_backward(p, t, idx.q2k_capacity, lists.k2q_offset, backward_scratch,
                                           workspace_bytes - fixed, bp, dp, stream)))
    return s;
  return detail::run_backward(p, dp, bp, qs, ks, stream);
}

} // namespace vsa
