// What an attention kernel walks: which key tiles each query tile visits, and how many rows of each tile
// are valid. Two schedules share every kernel:
//   sparse_schedule  the fine pass: tiles of the video grid, key tiles from the q2k (or k2q) lists, valid
//                    counts from the grid;
//   dense_schedule   the coarse pass: the N tile means as a sequence of ⌈N/64⌉ row blocks, every query
//                    block visiting every key block, the last block holding N mod 64 rows.
#pragma once

#include "../../geometry.hpp"
#include "../../numeric.hpp"
#include "../runtime.hpp"

#include <type_traits>

namespace vsa {
namespace gpu {
namespace detail {

// A [B, S, H, D] operand as the kernels address it (element strides, head dim contiguous).
struct operand {
  uint16_t* data;
  int64_t batch, token, head;
  __device__ __forceinline__ uint16_t* tile(int64_t b, int64_t h, int64_t tile_index) const {
    return data + b * batch + h * head + tile_index * 64 * token;
  }
  // The row of token `first` (a schedule's token0 of a tile): tile(b, h, i) is at(b, h, 64·i).
  __device__ __forceinline__ uint16_t* at(int64_t b, int64_t h, int64_t first) const {
    return data + b * batch + h * head + first * token;
  }
};
template <class P> inline operand make_operand(const basic_tensor<P>& t) {
  return {static_cast<uint16_t*>(const_cast<void*>(static_cast<const void*>(t.data))), t.batch_stride, t.token_stride,
          t.head_stride};
}
// Contiguous [B, H, rows, D] (the tile means and coarse outputs).
inline operand make_dense_operand(const void* data, int64_t heads, int64_t rows, int64_t head_dim) {
  return {static_cast<uint16_t*>(const_cast<void*>(data)), heads * rows * head_dim, head_dim, rows * head_dim};
}

// How many of a tile's 64 rows a step's products cover: its valid rows rounded up to 16, the matrix
// instructions' step, as 16, 32 or 64 (33 to 48 round to 64, which keeps the variants of a loop to three). A
// partial tile at the edge of the video holds 1 to 48 valid tokens (its extent along each axis is 1 to 4; on
// wan2.1's 21 × 30 × 52 grid 169 of the 624 tiles hold 8, 16 or 32), and past them there is only padding,
// whose scores the kernels would mask to a zero probability: cut there, a step's products and exponentials
// shrink to a quarter or a half. The forward and dq narrow their steps by the key tile. with_step_width calls
// f with the width as a type (step_width<W>), so that each width is its own unrolled code. Narrow = false
// keeps one width, 64: the kernels take it as a template parameter, set only where the grid has such tiles,
// because the loop of three widths measured 2% slower on a grid without them (fastvideo-bench-49k forward;
// bench/NOTES.md, v12). The coarse pass (dense_schedule) never narrows: it has one partial block a row and
// column.
// step_rows is the rule, for whoever counts the kernels' work (the benchmarks); with_step_width branches on it.
VSA_HOST_DEVICE constexpr int step_rows(int valid) { return valid <= 16 ? 16 : valid <= 32 ? 32 : tile_rows; }
// Whether a grid has tiles that narrow steps pay on: its last tile, at the far edge of every axis, holds the fewest.
inline bool has_narrow_tiles(const tile_geometry& geo) { return step_rows(geo.valid(geo.num_tiles() - 1)) < tile_rows; }

struct sparse_schedule {
  static constexpr bool joint = false;           // joint_schedule below
  static constexpr bool has_padding_rows = true; // tiled tensors hold all 64 slots of every tile
  static constexpr bool listed_rows = false;     // a tile's first row is 64·t (with_out_rows; else token0(t))
  static constexpr bool few_blocks = false;      // a block per query tile and head: many waves
  tile_geometry geo;
  const int32_t* list;   // q2k rows (forward, dq) or packed k2q lists (dk, dv)
  const int32_t* count;  // q2k_count, or null when offsets are used
  const int32_t* offset; // k2q_offset, or null
  int64_t capacity;      // q2k_capacity
  int64_t tiles;         // N

  __host__ __device__ __forceinline__ int64_t rows_total() const { return tiles * 64; }
  // Row of tile t's first slot in the tensors (and in lse and delta); whether its padding slots are rows of them.
  __device__ __forceinline__ int64_t token0(int64_t t) const { return t * 64; }
  __device__ __forceinline__ static constexpr bool padding_stored(int64_t) { return true; }
  // The query tile, head and batch of a block of the forward or dq: its grid's (tiles, heads, batch) coordinates.
  __device__ __forceinline__ static void query_block(int64_t& i, int64_t& h, int64_t& b) {
    i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  }
  // The forward's blocks a head (the grid's x): a block a query tile.
  __host__ __device__ __forceinline__ int64_t query_grid() const { return tiles; }
  // dq from stored dS (attention_dq_stored.hpp): the slots a query head takes (its k2q lists' span), and the slot of
  // the pair at k2q position pos of query head bh, where the slots start at query head head0.
  __host__ __device__ __forceinline__ int64_t ds_stride() const { return tiles * capacity; }
  __device__ __forceinline__ int64_t ds_slot(int64_t pos, int64_t, int64_t head0) const {
    return pos - head0 * tiles * capacity;
  }
  // The tiles of the video grid, which have coarse rows (o_c) and folds and raster positions: every tile here.
  __device__ __forceinline__ static constexpr bool video_tile(int64_t) { return true; }
  __host__ __device__ __forceinline__ int64_t video_tiles() const { return tiles; }
  // Range [begin, end) of list entries of (head bh, tile i). Counts and offsets come from the caller or
  // from earlier kernels; they are clamped so that a corrupt list can cost results, never memory safety.
  __device__ __forceinline__ void range(int64_t bh, int64_t i, int64_t& begin, int64_t& end) const {
    const int64_t head = bh * tiles * capacity;
    if (offset != nullptr) {
      const int32_t* o = offset + bh * (tiles + 1) + i;
      begin = head + clamp(o[0], 0, tiles * capacity);
      end = head + clamp(o[1], 0, tiles * capacity);
      if (end < begin) end = begin;
    } else {
      begin = (bh * tiles + i) * capacity;
      end = begin + clamp(count[bh * tiles + i], 0, capacity);
    }
  }
  // Entry at list position pos; -1 (a tile with no valid rows, never dereferenced) when out of range.
  __device__ __forceinline__ int64_t at(int64_t pos) const {
    const int64_t t = list[pos];
    return t >= 0 && t < tiles ? t : -1;
  }
  __device__ __forceinline__ int valid(int64_t tile) const { return tile < 0 ? 0 : geo.valid(tile); }
  // valid() through multiplications (tile_valid_counter, geometry.hpp), for a kernel that counts every tile it
  // visits; each thread builds it once. Not a member of the schedule: a larger schedule changes how every
  // kernel taking one reads its parameters (the backward kernels took up to 60 more registers).
  struct fast_valid {
    tile_valid_counter counter;
    __device__ __forceinline__ int valid(int64_t tile) const { return tile < 0 ? 0 : counter.valid(tile); }
  };
  __device__ __forceinline__ fast_valid valid_counter() const { return {tile_valid_counter(geo)}; }

  // Whether the grid has tiles that narrow steps pay on (the host's choice of kernel: narrow_or_not).
  bool narrow_pays() const { return has_narrow_tiles(geo); }

private:
  __device__ __forceinline__ static int64_t clamp(int64_t x, int64_t lo, int64_t hi) {
    return x < lo ? lo : (x > hi ? hi : x);
  }
};

// The sparse pass of joint attention (extra_tokens, types.hpp). One tile index space: the N video tiles, then the
// X = ⌈E/64⌉ blocks of extra tokens as tiles N … N+X−1, the last holding E − 64(X−1) of them. The lists are the
// video tiles' own with every extra tile appended, and every tile for an extra query tile (joint_attention.hpp builds
// them, and k2q from them), so that the kernels walk lists and count valid rows as for the video alone. What differs
// is where a tile's rows are: video tile t at the video's first slot + 64t, extra tile N + x at the extra tokens' first
// row + 64x, unpadded. The last extra tile's rows past E belong to something else (the video's first slots, or
// nothing past the end of the tensor), so they are not written (padding_stored) and what is read there is never used:
// copy_tile reads valid rows only; the copy engine's box reads the video's slots (masked and zeroed as any padding
// rows) or, past the end of the tensor, which its map ends at S, zeros.
struct joint_schedule : sparse_schedule {
  static constexpr bool joint = true;
  static constexpr bool listed_rows = true;
  int64_t video;       // N
  int64_t video_first; // row of the first video slot (E where the extra tokens come first, else 0)
  int64_t extra_first; // row of the first extra token (0, or N·64)
  int64_t rows;        // S = N·64 + E
  int extra_last;      // valid rows of tile tiles − 1 (X ≥ 1)

  __host__ __device__ __forceinline__ int64_t rows_total() const { return rows; }
  // Each tile's first row and valid count, {row_of(t), count_of(t)}, from a table of T entries that
  // joint_table_kernel writes with the lists (joint_attention.hpp), not from their arithmetic in the loops: the
  // arithmetic kept the split, the offsets and the video's tile counter live in registers, and at the Hopper forward's
  // 128 registers (four blocks an SM) ptxas spilled 100-170 bytes of the D = 128 loops, 2.5 GB of local loads a pass at
  // wan2.1 (bench/NOTES.md, v27). Through the table: no spill, one L1-resident load a use.
  const int2* table = nullptr;
  __device__ __forceinline__ int64_t token0(int64_t t) const { return table[t].x; }
  __host__ __device__ __forceinline__ int64_t row_of(int64_t t) const {
    return t < video ? video_first + t * 64 : extra_first + (t - video) * 64;
  }
  __device__ __forceinline__ int count_of(int64_t t) const {
    return t < video ? geo.valid(t) : (t < tiles - 1 ? 64 : extra_last);
  }
  __device__ __forceinline__ bool padding_stored(int64_t t) const { return t < video; }
  __device__ __forceinline__ bool video_tile(int64_t t) const { return t < video; }
  // The forward splits each extra query tile's walk (every tile) into `pieces` walks of at most `split` entries, each a
  // block of its own, which writes its rows' o (normalized by its own row sums) and log-sum-exp to part_o and part_lse;
  // joint_merge_kernel (joint_attention.hpp) sums them. Whole, the walks were N/k times a video tile's steps (10x at
  // 90% sparsity): launched after their head's video tiles they ran on alone at the end of the kernel (the sm_80
  // build on wan2.1 with E = 256: 1.34x the video-only time for 1.13x its block pairs); launched before every head's
  // video tiles, they swept every head's K and V through the L2 at once (Hopper: 10% over the pass's floor; DRAM
  // reads 0.67 → 1.39 GB; bench/NOTES.md, v26). A piece is as long as a video tile's walk and runs among its own
  // head's blocks. split = 0 (dq): whole walks, the extra tiles of every head and batch first.
  int64_t split = 0, pieces = 1;
  float* part_o = nullptr;   // [B·Hq, X, pieces, 64, D]
  float* part_lse = nullptr; // [B·Hq, X, pieces, 64], natural log; −inf where a row's piece saw nothing
  // dq from stored dS: a query head's slots are its pairs, at most N·(capacity + X) + X·T (ds_pairs; the host's
  // joint_ds_pairs), not its k2q lists' span of T² entries (3.2 GB a head at wan2.1 with E = 256, against 0.36 GB).
  int64_t ds_pairs = 0;
  __host__ __device__ __forceinline__ int64_t ds_stride() const { return ds_pairs; }
  __device__ __forceinline__ int64_t ds_slot(int64_t pos, int64_t bh, int64_t head0) const {
    return (bh - head0) * ds_pairs + (pos - bh * tiles * capacity);
  }
  __host__ __device__ __forceinline__ int64_t extra_tiles() const { return tiles - video; }
  __host__ __device__ __forceinline__ int64_t query_grid() const {
    return split > 0 ? video + extra_tiles() * pieces : tiles;
  }
  // With split: the grid (X·pieces + N, heads, batch), each head's pieces before its video tiles. Without: the grid
  // (tiles, heads, batch), the extra query tiles of every head and batch first, then the video tiles in grid order.
  __device__ __forceinline__ void query_block(int64_t& i, int64_t& h, int64_t& b) const {
    if (split > 0) {
      const int64_t x = static_cast<int64_t>(blockIdx.x), first = extra_tiles() * pieces;
      i = x < first ? video + x / pieces : x - first;
      h = blockIdx.y, b = blockIdx.z;
      return;
    }
    const uint64_t heads = gridDim.y, x = static_cast<uint64_t>(tiles - video);
    const uint64_t linear = blockIdx.x + uint64_t(gridDim.x) * (blockIdx.y + heads * blockIdx.z);
    const uint64_t extras = x * heads * gridDim.z;
    const uint64_t per = linear < extras ? x : static_cast<uint64_t>(video),
                   at = linear < extras ? linear : linear - extras;
    const uint64_t rest = at / per;
    i = static_cast<int64_t>(at - rest * per) + (linear < extras ? video : 0);
    h = static_cast<int64_t>(rest % heads);
    b = static_cast<int64_t>(rest / heads);
  }
  // Whether this block runs a piece of query tile i's walk, and which.
  __device__ __forceinline__ bool piece_of(int64_t i, int64_t& piece) const {
    if (split <= 0 || i < video) return false;
    piece = static_cast<int64_t>(blockIdx.x) % pieces;
    return true;
  }
  // The range of (head bh, tile i)'s list entries, of this block's piece where it runs one.
  __device__ __forceinline__ void range(int64_t bh, int64_t i, int64_t& begin, int64_t& end) const {
    sparse_schedule::range(bh, i, begin, end);
    int64_t piece;
    if (piece_of(i, piece)) {
      begin = begin + piece * split < end ? begin + piece * split : end;
      end = begin + split < end ? begin + split : end;
    }
  }
  __host__ __device__ __forceinline__ int64_t video_tiles() const { return video; }
  __device__ __forceinline__ int valid(int64_t t) const { return t < 0 ? 0 : table[t].y; }
  struct fast_valid {
    const int2* table;
    __device__ __forceinline__ int valid(int64_t t) const { return t < 0 ? 0 : table[t].y; }
  };
  __device__ __forceinline__ fast_valid valid_counter() const { return {table}; }
  bool narrow_pays() const { return has_narrow_tiles(geo) || step_rows(extra_last) < tile_rows; }
};

template <int W> using step_width = std::integral_constant<int, W>;
// The elements of a score tile of M that hold its first W columns (matrix.hpp).
template <class M, int W> inline constexpr int step_elems = (W * M::score_elems) / tile_rows;
template <bool Narrow, class F> __device__ __forceinline__ void with_step_width(int valid, F&& f) {
  if constexpr (!Narrow) {
    (void)valid;
    f(step_width<tile_rows>{});
  } else if (valid <= 16) { // step_rows, as branches (through step_rows, sm_80 code gained selects a step)
    f(step_width<16>{});
  } else if (valid <= 32) {
    f(step_width<32>{});
  } else {
    f(step_width<tile_rows>{});
  }
}

// Where the rows of one tile of an output go, as an epilogue stores them (row(r, slot): row r, the lane's row
// `slot` of the matrix layout M): tiled_rows, at slot i·64 + r of the tile (padding rows too); raster_out_rows,
// at the token the slot holds (raster_rows; the whole op's output_order), padding rows nowhere (skips()); the
// raster form finds the addresses of the lane's rows before the epilogue's loads. with_out_rows<Raster> runs the
// epilogue on one of them; the run-time form takes the order as a flag and holds both epilogues. The forward and dq
// kernels take Raster as a template parameter instead: both epilogues in one kernel cost them registers the tiled
// kernel had not needed (dq at D = 64: 128 → 143-158, a block an SM fewer; the D = 128 forward 12-36 more bytes of
// spills; and carried through one path, dq at D = 128 162 → 192, its third block an SM). dk/dv's kernels kept their
// registers with both. Only the sparse schedule's tiles are video tiles; the dense schedule's are never raster.
struct tiled_rows {
  uint16_t* base; // the tile's first slot
  int64_t token;
  __device__ __forceinline__ uint16_t* row(int r, int) const { return base + r * token; }
  __device__ __forceinline__ static constexpr bool skips(int, int) { return false; }
};
template <int R> struct raster_out_rows {
  uint16_t* at[R]; // the lane's rows; null for padding rows
  __device__ __forceinline__ uint16_t* row(int, int slot) const { return at[slot]; }
  __device__ __forceinline__ static bool skips(int r, int valid) { return r >= valid; }
};
template <bool Raster, class M, class Sched, class F> __device__ __forceinline__ void
with_out_rows(const operand& t, const Sched& s, int64_t b, int64_t h, int64_t i, int row0, int valid, F&& f) {
  if constexpr (Raster) {
    static_assert(Sched::has_padding_rows && !Sched::joint, "only the sparse schedule's tiles are video tiles");
    const raster_rows map = s.geo.raster_rows_of(i);
    uint16_t* const head = t.data + b * t.batch + h * t.head;
    raster_out_rows<M::rows_per_lane> rows;
#pragma unroll
    for (int slot = 0; slot < M::rows_per_lane; ++slot) {
      const int r = row0 + M::slot_row(slot);
      rows.at[slot] = r < valid ? head + map.token(r) * t.token : nullptr;
    }
    f(rows);
  } else {
    (void)row0, (void)valid;
    if constexpr (Sched::listed_rows) {
      f(tiled_rows{t.at(b, h, s.token0(i)), t.token});
    } else { // the same address; so written, ptxas gave dq from stored dS 16 registers fewer (sm_80, D = 64)
      (void)s;
      f(tiled_rows{t.tile(b, h, i), t.token});
    }
  }
}
template <class M, class Sched, class F>
__device__ __forceinline__ void with_out_rows(const operand& t, bool raster, const Sched& s, int64_t b, int64_t h,
                                              int64_t i, int row0, int valid, F&& f) {
  if constexpr (Sched::has_padding_rows && !Sched::joint) { // the sparse schedule: video tiles
    if (raster) {
      with_out_rows<true, M>(t, s, b, h, i, row0, valid, f);
      return;
    }
  }
  with_out_rows<false, M>(t, s, b, h, i, row0, valid, f);
}

// The forward's raster epilogue (the whole op's output_order): the block's rows of o go
// through shared memory instead of straight to their tokens. Each lane stores its fragments at tiled positions of a
// staging tile (staged_rows, as tiled_rows does in global memory), and after a barrier the block copies the tile's
// valid rows to their raster tokens, 16 bytes a thread at a time (store_staged_rows). The epilogue then needs no
// token addresses beside o's accumulators: with them ptxas serialized every wgmma of the narrow-step kernels (C7511,
// bench/NOTES.md v34), and the copies are whole rows. Rows are D + 8 elements apart, so that the 8 rows one store
// instruction of the matrix layouts writes fall on different banks.
template <int D> struct staged_rows {
  static constexpr int stride = D + 8;
  static constexpr int bytes = tile_rows * stride * 2;
  uint16_t* base; // shared memory, 16-byte aligned
  __device__ __forceinline__ uint16_t* row(int r, int) const { return base + r * stride; }
  __device__ __forceinline__ static bool skips(int r, int valid) { return r >= valid; }
};
// Copies the staged rows below `valid` of tile i to their raster tokens of t (head h of batch b). Every thread of
// the block calls it after the barrier that follows the staging stores.
template <int D> __device__ __forceinline__ void store_staged_rows(const operand& t, const tile_geometry& geo,
                                                                   int64_t b, int64_t h, int64_t i, int valid,
                                                                   const staged_rows<D>& staged, int tid,
                                                                   int nthreads) {
  constexpr int chunks = D / 8; // 16-byte chunks a row
  const raster_rows map = geo.raster_rows_of(i);
  uint16_t* const head = t.data + b * t.batch + h * t.head;
  for (int c = tid; c < valid * chunks; c += nthreads) {
    const int r = c / chunks, part = c % chunks;
    *reinterpret_cast<uint4*>(head + map.token(r) * t.token + part * 8) =
        *reinterpret_cast<const uint4*>(staged.row(r, 0) + part * 8);
  }
}

struct dense_schedule {
  static constexpr bool joint = false;
  static constexpr bool listed_rows = false;
  static constexpr bool has_padding_rows = false; // the last block's missing rows do not exist in memory
  static constexpr bool few_blocks = true;        // ⌈N/64⌉ blocks a head: usually under one wave of the GPU
  int64_t length;                                 // N rows
  int64_t tiles;                                  // ⌈N / 64⌉

  __host__ __device__ __forceinline__ int64_t rows_total() const { return length; }
  __device__ __forceinline__ int64_t token0(int64_t t) const { return t * 64; }
  __device__ __forceinline__ static constexpr bool padding_stored(int64_t) { return false; }
  __device__ __forceinline__ static constexpr bool video_tile(int64_t) { return true; }
  __host__ __device__ __forceinline__ int64_t video_tiles() const { return tiles; }
  __device__ __forceinline__ static void query_block(int64_t& i, int64_t& h, int64_t& b) {
    i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  }
  __host__ __device__ __forceinline__ int64_t query_grid() const { return tiles; }
  __device__ __forceinline__ int valid(int64_t tile) const {
    const int64_t rest = length - tile * 64;
    return rest < 64 ? static_cast<int>(rest) : 64;
  }
  __device__ __forceinline__ dense_schedule valid_counter() const { return *this; } // valid() is cheap here
  __device__ __forceinline__ void range(int64_t, int64_t, int64_t& begin, int64_t& end) const {
    begin = 0;
    end = tiles;
  }
  __device__ __forceinline__ int64_t at(int64_t pos) const { return pos; }
  // Head bh's scores (load_scores).
  __device__ __forceinline__ const float* scores_of(const float* scores, int64_t bh) const {
    return scores + bh * length * length;
  }
};

// The coarse pass over a packed batch (packed_attention.hpp): each sample's N_s means are a sequence of their own,
// ⌈N_s/64⌉ blocks whose query blocks visit the key blocks of their sample only, so that every block's work is that of
// the sample's own call. length: N, the batch's tiles; tiles: the samples' blocks. A head's scores are [N, width]
// (gpu::detail::packed_scores), each row's sample's N_s scores first.
struct packed_dense_schedule : dense_schedule {
  static constexpr bool listed_rows = true;
  const int4* blocks; // {first row, valid rows, the sample's first block, the sample's rows N_s} a block
  int64_t width;
  __device__ __forceinline__ int64_t token0(int64_t t) const { return blocks[t].x; }
  // t = -1 past a walk's end (the forward reads the next step's count unconditionally), as the other schedules.
  __device__ __forceinline__ int valid(int64_t t) const { return t < 0 ? 0 : blocks[t].y; }
  __device__ __forceinline__ packed_dense_schedule valid_counter() const { return *this; }
  __device__ __forceinline__ void range(int64_t, int64_t i, int64_t& begin, int64_t& end) const {
    const int4 e = blocks[i];
    begin = e.z;
    end = e.z + (e.w + 63) / 64;
  }
  __device__ __forceinline__ const float* scores_of(const float* scores, int64_t bh) const {
    return scores + bh * length * width;
  }
};

// The dense pass reads its scores instead of forming Q·Kᵀ: coarse_scores computes them beforehand from the fp32
// tile means, at about 2^-16 of their size, where one product of the 16-bit means errs by 2^-9 of it. Scores of
// tile means are large (a mean of few tokens keeps the tokens' scale), their softmax sharp, and at the scales
// models produce that error moved the coarse branch's gradients by tens of percent (README.md, accuracy).
// Fills the score tile of rows row0.. of block `rows` against block `cols` from `scores`, one head's [length,
// length] fp32 matrix of scaled scores with a row per query. transposed: the tile's rows are keys, its columns
// queries (Sᵀ, as dk and dv take it). Entries past the length read 0 (the kernels mask their columns and drop
// their rows).
template <class M> __device__ __forceinline__ void load_scores(typename M::score_tile& st, const float* scores,
                                                               const dense_schedule& s, int64_t rows, int64_t cols,
                                                               int row0, bool transposed) {
  const int64_t len = s.length;
#pragma unroll
  for (int e = 0; e < M::score_elems; ++e) {
    const int64_t r = rows * 64 + row0 + M::elem_row(e), c = cols * 64 + M::elem_col(e);
    const int64_t row = transposed ? c : r, col = transposed ? r : c;
    st.x[e] = r < len && c < len ? scores[row * len + col] : 0.f;
  }
}
// The same over a packed batch's scores (packed_dense_schedule): blocks `rows` and `cols` are of one sample.
template <class M> __device__ __forceinline__ void load_scores(typename M::score_tile& st, const float* scores,
                                                               const packed_dense_schedule& s, int64_t rows,
                                                               int64_t cols, int row0, bool transposed) {
  const int4 er = s.blocks[rows], ec = s.blocks[cols];
  const int64_t first = er.x - (rows - er.z) * 64; // the sample's first row
#pragma unroll
  for (int e = 0; e < M::score_elems; ++e) {
    const int r = row0 + M::elem_row(e), c = M::elem_col(e);
    const int64_t gr = er.x + r, gc = ec.x + c;
    const int64_t query = transposed ? gc : gr, key = transposed ? gr : gc;
    st.x[e] = r < er.y && c < ec.y ? scores[query * s.width + (key - first)] : 0.f;
  }
}

} // namespace detail
} // namespace gpu
} // namespace vsa
