// The sparse pass over a packed batch on the GPU (packed_problem, types.hpp): samples of different grids in one
// sequence of tiled slots, one launch a stage for the whole batch, no host round trip and no padding of a sample to the
// largest grid.
//
// The batch is one index space of N = Σ N_s tiles, and the samples differ only in their tiles' valid counts. So the
// pass runs on the joint schedule (detail/attention_schedule.hpp) without extra tiles: its kernels take each tile's
// first row and valid count from a table of N entries, which packed_table_kernel writes from the samples' grids (passed
// by value, 64 samples a launch), and walk the caller's lists, whose entries are tiles of the same sample, exactly as
// the one-grid pass walks its own. The backward inverts the lists into k2q in its workspace as the joint backward
// does; dq from stored dS (NVIDIA before Hopper), Hopper's copy engine and its warp-specialized dk/dv take the batch as
// they take one grid.
//
// Each tile's outputs are to be those of its sample's own call, bit for bit, where that call takes the same kernel (the
// same arithmetic on the same rows; tests/gpu/test_packed.cpp asserts it): the narrow-step kernels (partial tiles of 32
// valid tokens or fewer, has_narrow_tiles) run the whole batch where any sample has such tiles, and on Hopper they form
// P's row sums on another unit than the wide ones (the tuning table's ones_narrow), so that a sample without narrow
// tiles in such a batch agrees with its own call within rounding only.
#pragma once

#include "joint_attention.hpp"
#include "select.hpp"

namespace vsa {
namespace gpu {
namespace detail {

inline constexpr int packed_table_samples = 64; // samples a launch of packed_table_kernel takes, by value

struct packed_table_params {
  int2* table;                             // joint_schedule::table of the batch
  int32_t first[packed_table_samples + 1]; // the launch's samples' first tiles, and the tile after the last
  int32_t t[packed_table_samples], h[packed_table_samples], w[packed_table_samples]; // their grids
  int samples;
  // The whole op's tables (packed_op.hpp), where not null: `info`, top_k_params::info of each tile (with k and z, each
  // sample's top k and first guess); `blocks`, packed_dense_schedule::blocks of the coarse pass (block_first: the
  // launch's samples' first blocks, and the block after the last).
  int4* info;
  int4* blocks;
  int32_t k[packed_table_samples];
  float z[packed_table_samples];
  int32_t block_first[packed_table_samples + 1];
};

// Tile t's first row (t·64: the samples' slots follow each other) and its valid count in its sample's grid; the
// whole op's tables where asked.
template <int Threads = 256> __global__ void __launch_bounds__(Threads)
    packed_table_kernel(const VSA_GRID_CONSTANT packed_table_params p) {
  const int64_t end = p.first[p.samples];
  for (int64_t t = p.first[0] + blockIdx.x * int64_t(Threads) + threadIdx.x; t < end;
       t += int64_t(gridDim.x) * Threads) {
    int s = 0;
    while (t >= p.first[s + 1]) ++s;
    const tile_geometry geo(grid3{p.t[s], p.h[s], p.w[s]});
    p.table[t] = make_int2(static_cast<int>(t * tile_rows), geo.valid(t - p.first[s]));
    if (p.info != nullptr)
      p.info[t] = make_int4(p.first[s], p.first[s + 1] - p.first[s], p.k[s], __float_as_int(p.z[s]));
  }
  if (p.blocks == nullptr) return;
  for (int64_t c = p.block_first[0] + blockIdx.x * int64_t(Threads) + threadIdx.x; c < p.block_first[p.samples];
       c += int64_t(gridDim.x) * Threads) {
    int s = 0;
    while (c >= p.block_first[s + 1]) ++s;
    const int n = p.first[s + 1] - p.first[s], row = static_cast<int>(c - p.block_first[s]) * tile_rows;
    p.blocks[c] = make_int4(p.first[s] + row, n - row < tile_rows ? n - row : tile_rows, p.block_first[s], n);
  }
}

} // namespace detail
} // namespace gpu

namespace detail {

inline int64_t packed_tiles(const problem& whole) { return tile_geometry(whole.grid).num_tiles(); }
inline std::size_t packed_table_bytes(const problem& whole) { return align_up(sizeof(int2) * packed_tiles(whole)); }

// The whole op's tables beside the tile table (packed_table_params), null where not asked; opt: the op's options, which
// give each sample its top k (resolve_op_top_k, checked before).
struct packed_op_tables {
  int4* info = nullptr;
  int4* blocks = nullptr;
  const options* opt = nullptr;
};

// Writes the batch's tile table (a checked packed_problem), and the whole op's where asked.
inline status launch_packed_table(const packed_problem& pp, int2* table, gpu::stream_t stream,
                                  const packed_op_tables& op = {}) {
  int64_t first = 0, block = 0;
  for (int64_t s0 = 0; s0 < pp.samples; s0 += gpu::detail::packed_table_samples) {
    gpu::detail::packed_table_params tp{};
    tp.table = table;
    tp.info = op.info;
    tp.blocks = op.blocks;
    tp.samples = static_cast<int>(std::min<int64_t>(gpu::detail::packed_table_samples, pp.samples - s0));
    tp.first[0] = static_cast<int32_t>(first);
    tp.block_first[0] = static_cast<int32_t>(block);
    for (int i = 0; i < tp.samples; ++i) { // check_packed_problem: every size below 2^31
      const grid3 g = pp.grids[s0 + i];
      tp.t[i] = static_cast<int32_t>(g.t), tp.h[i] = static_cast<int32_t>(g.h), tp.w[i] = static_cast<int32_t>(g.w);
      const int64_t n = tile_geometry(g).num_tiles();
      first += n;
      block += (n + gpu::tile_rows - 1) / gpu::tile_rows;
      tp.first[i + 1] = static_cast<int32_t>(first);
      tp.block_first[i + 1] = static_cast<int32_t>(block);
      int64_t k = 0;
      if (op.info != nullptr && resolve_op_top_k(n, *op.opt, k)) {
        tp.k[i] = static_cast<int32_t>(k);
        tp.z[i] = gpu::detail::top_k_first_guess(n, k);
      }
    }
    // A grid over the tiles covers the coarse blocks too: a sample has at most as many blocks as tiles.
    const int64_t tiles = tp.first[tp.samples] - tp.first[0];
    const status s = gpu::launch("packed tiles", gpu::detail::packed_table_kernel<>,
                                 gpu::detail::grid_blocks((tiles + 255) / 256), 256, 0, stream, false, tp);
    if (!s) return s;
  }
  return status::ok();
}

// Whether any sample has tiles that narrow steps pay on (has_narrow_tiles): the kernels' choice for the whole batch.
inline bool packed_narrow(const packed_problem& pp) {
  for (int64_t s = 0; s < pp.samples; ++s)
    if (gpu::detail::has_narrow_tiles(tile_geometry(pp.grids[s]))) return true;
  return false;
}

// The batch's schedule over lists of `capacity` entries a row: the joint schedule of N tiles and no extra ones, its
// valid counts from `table`. Its geometry is read on the host alone (narrow_pays, and joint_table_kernel, which the
// batch does not launch): N tiles, the last holding 16 tokens where `narrow`, so that narrow_pays gives the batch's
// choice.
inline gpu::detail::joint_schedule packed_schedule_of(const problem& whole, bool narrow, const int32_t* list,
                                                      const int32_t* count, const int32_t* offset, int64_t capacity,
                                                      const int2* table) {
  const int64_t n = packed_tiles(whole), rows = n * gpu::tile_rows;
  const tile_geometry geo(narrow ? grid3{tile_edge, tile_edge, tile_edge * (n - 1) + 1} : whole.grid);
  gpu::detail::joint_schedule s{{geo, list, count, offset, capacity, n}, n, 0, rows, rows, gpu::tile_rows};
  s.table = table;
  s.ds_pairs = n * capacity;
  return s;
}

// The backward's workspace: the tile table, the k2q lists and offsets and build_k2q's scratch (video_backward_workspace
// of the batch's problem), then the one-grid backward's scratch: the least, or with `preferred` what the size query
// asks (dq's stored dS where the device takes it on the joint schedule, which the batch runs on).
// Its fixed part, ahead of the one-grid backward's scratch: the table, the k2q lists and offsets, build_k2q's scratch.
inline std::size_t packed_backward_fixed_bytes(const problem& whole, int64_t capacity) {
  const video_backward_workspace w(whole, capacity);
  return packed_table_bytes(whole) + w.bytes() - w.rest;
}
inline std::size_t packed_backward_bytes(const problem& whole, int64_t capacity, bool preferred) {
  return packed_backward_fixed_bytes(whole, capacity) + (preferred
                                                             ? sparse_backward_preferred_bytes(whole, capacity, true)
                                                             : sparse_attention_backward_workspace(whole));
}

} // namespace detail

// Workspace of packed_sparse_attention_forward: the batch's tile table, 8 bytes a tile (0 for a problem that
// check_packed_problem rejects; the call then says why).
inline std::size_t packed_sparse_attention_forward_workspace(const packed_problem& pp) {
  problem whole;
  if (!check_packed_problem(pp, target::gpu, whole)) return 0;
  return detail::packed_table_bytes(whole);
}

// o_s and lse of the sparse pass over a packed batch: q, o_s [1, N·64, Hq, D] and k, v [1, N·64, Hkv, D] views, the
// samples' tiled slots one after another; lse [Hq, N·64] fp32; idx: q2k lists over the batch's tiles (q2k, q2k_count,
// q2k_capacity as for sparse_attention_forward, N the batch's; k2q unused). Padding slots, and rows with an empty list,
// get o_s = 0 and lse = +inf. A template only so that the joint kernels are instantiated where it is called.
template <class = void> status packed_sparse_attention_forward(const packed_problem& pp, float scale, const_tensor q,
                                                               const_tensor k, const_tensor v, const_index_lists idx,
                                                               tensor o_s, float* lse, void* workspace,
                                                               std::size_t workspace_bytes, gpu::stream_t stream) {
  problem p;
  status s = check_packed_problem(pp, target::gpu, p);
  if (!s) return s;
  const int64_t tokens = tile_geometry(p.grid).tiled_tokens();
  const std::size_t need = detail::packed_table_bytes(p);
  s = detail::check_inputs(p, scale, q, k, v, tokens);
  if (s) s = check_tensor("o_s", o_s, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_pointer("lse", lse, 4);
  if (s) s = detail::check_lists(p, idx, false);
  if (s) s = check_workspace(workspace, workspace_bytes, need);
  if (s) s = check_joint_forward_disjoint(p, q, k, v, idx, o_s, lse, {}, workspace, need);
  if (!s) return s;
  int2* const table = static_cast<int2*>(workspace);
  if (!(s = detail::launch_packed_table(pp, table, stream))) return s;
  const gpu::detail::forward_params fp = detail::sparse_forward_params(p, scale, q, k, v, o_s, lse);
  return detail::run_forward(p, fp,
                             detail::packed_schedule_of(p, detail::packed_narrow(pp), idx.q2k, idx.q2k_count, nullptr,
                                                        idx.q2k_capacity, table),
                             stream);
}

// Workspace of packed_sparse_attention_backward: the tile table, the k2q lists of the caller's q2k lists (built here)
// and build_k2q's scratch, then the one-grid backward's scratch for the batch as one grid of N tiles, with dq's stored
// dS where the device takes it on the joint schedule (8 KB a pair of every head where they fit in 8 GiB); the call
// takes any size from packed_sparse_attention_backward_least_workspace up (dq then recomputes dS). 0 for a rejected
// problem.
inline std::size_t packed_sparse_attention_backward_workspace(const packed_problem& pp, int64_t q2k_capacity) {
  problem whole;
  if (!check_packed_problem(pp, target::gpu, whole) || !check_q2k_capacity(whole, q2k_capacity)) return 0;
  return detail::packed_backward_bytes(whole, q2k_capacity, true);
}
inline std::size_t packed_sparse_attention_backward_least_workspace(const packed_problem& pp, int64_t q2k_capacity) {
  problem whole;
  if (!check_packed_problem(pp, target::gpu, whole) || !check_q2k_capacity(whole, q2k_capacity)) return 0;
  return detail::packed_backward_bytes(whole, q2k_capacity, false);
}

// dq, dk, dv of the sparse pass over a packed batch (padding slots 0; dk and dv summed over each kv head's group), from
// dO and the forward's o_s and lse on the same q2k lists (k2q is built here). Bitwise reproducible, as the one-grid
// backward. workspace == nullptr asks for packed_sparse_attention_backward_workspace(pp, idx.q2k_capacity). A template
// as the forward.
template <class = void>
status packed_sparse_attention_backward(const packed_problem& pp, float scale, const_tensor q, const_tensor k,
                                        const_tensor v, const_tensor o_s, const_tensor d_o, const float* lse,
                                        const_index_lists idx, tensor dq, tensor dk, tensor dv, void* workspace,
                                        std::size_t& workspace_bytes, gpu::stream_t stream) {
  problem p;
  status s = check_packed_problem(pp, target::gpu, p);
  if (s) s = check_q2k_capacity(p, idx.q2k_capacity);
  if (!s) return s;
  const int64_t n = detail::packed_tiles(p), tokens = n * gpu::tile_rows, capacity = idx.q2k_capacity;
  if (n * capacity > int64_t(INT32_MAX))
    return status::error(errc::bad_index, "q2k_capacity: N·capacity = %lld overflows the int32 offsets",
                         (long long)(n * capacity));
  if (n > int64_t(gpu::detail::k2q_max_count_blocks) * gpu::detail::k2q_count_columns)
    return status::error(errc::unsupported, "grids: the batch's %lld tiles are more than the k2q lists hold",
                         (long long)n);
  if (workspace == nullptr) {
    workspace_bytes = detail::packed_backward_bytes(p, capacity, true);
    return status::ok();
  }
  s = detail::check_inputs(p, scale, q, k, v, tokens);
  if (s) s = check_tensor("o_s", o_s, p, p.q_heads, tokens, target::gpu);
  if (s) s = check_tensor("d_o", d_o, p, p.q_heads, tokens, target::gpu);
  if (s) s = detail::check_gradients(p, dq, dk, dv, tokens);
  if (s) s = check_pointer("lse", lse, 4);
  if (s) s = detail::check_lists(p, idx, false);
  if (s) s = check_workspace(workspace, workspace_bytes, detail::packed_backward_bytes(p, capacity, false));
  // The table and the k2q lists (fixed), then the one-grid backward's scratch in whatever is left.
  const detail::video_backward_workspace w(p, capacity);
  const std::size_t table_bytes = detail::packed_table_bytes(p),
                    fixed = detail::packed_backward_fixed_bytes(p, capacity);
  const std::size_t used = fixed + detail::sparse_backward_scratch(p, capacity, workspace_bytes - fixed, true).bytes();
  if (s) s = check_sparse_backward_disjoint(p, q, k, v, o_s, d_o, lse, idx, false, dq, dk, dv, workspace, used);
  if (!s) return s;

  unsigned char* const at = static_cast<unsigned char*>(workspace);
  int2* const table = reinterpret_cast<int2*>(at);
  index_lists lists{const_cast<int32_t*>(idx.q2k), const_cast<int32_t*>(idx.q2k_count), capacity};
  lists.k2q = reinterpret_cast<int32_t*>(at + table_bytes);
  lists.k2q_offset = reinterpret_cast<int32_t*>(at + table_bytes + w.k2q);
  void* const k2q_scratch = at + table_bytes + w.k2q + w.offsets;
  void* const backward_scratch = at + fixed;
  if (!(s = detail::launch_packed_table(pp, table, stream))) return s;
  if (!(s = gpu::detail::launch_k2q(n, w.layout, lists, k2q_scratch, stream))) return s;

  const bool narrow = detail::packed_narrow(pp);
  const auto qs = detail::packed_schedule_of(p, narrow, lists.q2k, lists.q2k_count, nullptr, capacity, table);
  const auto ks = detail::packed_schedule_of(p, narrow, lists.k2q, nullptr, lists.k2q_offset, capacity, table);
  gpu::detail::backward_params bp = detail::sparse_backward_params(p, scale, q, k, v, d_o, dq, dk, dv, lse);
  gpu::detail::delta_params dp =
      detail::delta_base(p, gpu::detail::make_operand(o_s), gpu::detail::make_operand(d_o), qs);
  if (!(s = detail::prepare_sparse_backward(p, as_const(lists), backward_scratch, workspace_bytes - fixed, bp, dp,
                                            stream, true)))
    return s;
  return detail::run_backward(p, dp, bp, qs, ks, stream);
}

} // namespace vsa
