// Stage 5 on the GPU: the key-to-query lists, the transpose of the q2k lists, per (batch, query head).
//
// Query tiles are taken in chunks of 32, so that "which tiles of this chunk selected key tile j" is one
// 32-bit mask. Three kernels, each one pass:
//   mark:   per (head, chunk), the chunk's q2k entries set bits in the masks [chunk][j] (in shared memory,
//           then stored; OR is order-free, so the result is deterministic).
//   count:  per (head, 1024 key tiles), a walk down the chunks gives, for every j, the number of entries of
//           the chunks before (base) and in total; a block scan turns the totals into offsets local to the
//           1024 key tiles, and the block's sum is kept per (head, 1024 key tiles).
//   fill:   per (head, chunk), every q2k entry (i, j) is written at
//               offset(j) + base[chunk][j] + popcount(mask[chunk][j] & bits below i),
//           which orders each list by i without atomics; the same blocks write k2q_offset and the -1 tail.
// Where a head's masks fit in shared memory (N up to ~700 on AMD, ~870 on NVIDIA: every anchor shape), one
// kernel does all three steps there instead (k2q_small_kernel, below).
// The work is proportional to the entries plus (N/32)·N mask words per head: no dense N×N map is scanned.
// Entries outside [0, N) are skipped and counts are clamped to [0, capacity], so malformed lists cannot
// make the kernels write outside their outputs.
#pragma once

#include "../geometry.hpp"
#include "../validate.hpp"
#include "arch/smem_tile.hpp"
#include "primitives.hpp"

namespace vsa {
namespace gpu {
namespace detail {

inline constexpr int k2q_threads = 256;
inline constexpr int k2q_chunk = 32;              // query tiles per mask word
inline constexpr int k2q_mark_columns = 8192;     // key tiles per mark block: 32 KB of masks in shared memory
inline constexpr int k2q_count_columns = 1024;    // key tiles per count block: 4 per thread
inline constexpr int k2q_max_count_blocks = 1024; // per head, scanned by one fill block: N <= 2^20

// Sizes of the scratch arrays, per head: masks and bases [chunks][columns], local offsets [columns], and
// block sums [count blocks]. `columns` is N rounded up to 4, for 16-byte access.
struct k2q_layout {
  int64_t n, chunks, columns, count_blocks, heads;
  std::size_t mask_bytes, base_bytes, local_bytes, block_bytes;
  std::size_t total() const { return mask_bytes + base_bytes + local_bytes + block_bytes; }

  // Returns false when the sizes overflow.
  bool init(int64_t tiles, int64_t head_count) {
    n = tiles;
    heads = head_count;
    chunks = (n + k2q_chunk - 1) / k2q_chunk;
    columns = (n + 3) / 4 * 4;
    count_blocks = (columns + k2q_count_columns - 1) / k2q_count_columns;
    const int64_t words = vsa::detail::checked_mul(vsa::detail::checked_mul(heads, chunks), columns);
    const int64_t local = vsa::detail::checked_mul(heads, columns);
    const int64_t blocks = vsa::detail::checked_mul(heads, count_blocks);
    if (words < 0 || local < 0 || blocks < 0 || words > (int64_t(1) << 58)) return false;
    mask_bytes = vsa::detail::align_up(static_cast<std::size_t>(words) * 4);
    base_bytes = mask_bytes;
    local_bytes = vsa::detail::align_up(static_cast<std::size_t>(local) * 4);
    block_bytes = vsa::detail::align_up(static_cast<std::size_t>(blocks) * 4);
    return true;
  }
};

struct k2q_params {
  const int32_t* q2k;
  const int32_t* q2k_count;
  int32_t* k2q;
  int32_t* k2q_offset;
  uint32_t* mask;     // [heads][chunks][columns]
  int32_t* base;      // [heads][chunks][columns]
  int32_t* local;     // [heads][columns]
  int32_t* block_sum; // [heads][count_blocks]
  int64_t heads, n, capacity, chunks, columns, count_blocks;
};

// The chunk's rows: their first tile and their counts clamped to [0, capacity] (0 past the last tile).
__device__ __forceinline__ void load_chunk_counts(const k2q_params& p, int64_t head, int64_t chunk, int32_t* counts) {
  if (threadIdx.x < k2q_chunk) {
    const int64_t i = chunk * k2q_chunk + threadIdx.x;
    int32_t c = i < p.n ? p.q2k_count[head * p.n + i] : 0;
    c = c < 0 ? 0 : c;
    counts[threadIdx.x] = c > p.capacity ? static_cast<int32_t>(p.capacity) : c;
  }
}

// A template only so that the header can be included by several translation units (one definition).
template <int Threads = k2q_threads> __global__ void __launch_bounds__(Threads) k2q_mark_kernel(k2q_params p) {
  __shared__ __align__(16) uint32_t bits[k2q_mark_columns];
  __shared__ int32_t counts[k2q_chunk];
  const int64_t ranges = (p.columns + k2q_mark_columns - 1) / k2q_mark_columns;
  const int64_t items = p.heads * p.chunks * ranges;
  const unsigned cap = static_cast<unsigned>(p.capacity);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t range = item % ranges, chunk = (item / ranges) % p.chunks, head = item / ranges / p.chunks;
    const int64_t lo = range * k2q_mark_columns;
    const int width = static_cast<int>(p.columns - lo < k2q_mark_columns ? p.columns - lo : k2q_mark_columns);
    for (int j = threadIdx.x; j < width; j += k2q_threads) bits[j] = 0u;
    load_chunk_counts(p, head, chunk, counts);
    __syncthreads();

    const int64_t first_row = head * p.n + chunk * k2q_chunk;
    const int32_t* entries = p.q2k + first_row * p.capacity;
    const unsigned rows =
        static_cast<unsigned>(p.n - chunk * k2q_chunk < k2q_chunk ? p.n - chunk * k2q_chunk : k2q_chunk);
    for (unsigned e = threadIdx.x; e < rows * cap; e += k2q_threads) {
      const unsigned r = e / cap, t = e - r * cap;
      if (static_cast<int32_t>(t) >= counts[r]) continue;
      const int64_t j = entries[e];
      if (j >= lo && j < lo + width && j < p.n) atomicOr(&bits[j - lo], 1u << r);
    }
    __syncthreads();
    uint4* out = reinterpret_cast<uint4*>(p.mask + (head * p.chunks + chunk) * p.columns + lo);
    for (int j = threadIdx.x; j < width / 4; j += k2q_threads) out[j] = reinterpret_cast<const uint4*>(bits)[j];
    __syncthreads(); // bits and counts are rewritten by the next item
  }
}

// A template only so that the header can be included by several translation units (one definition).
template <int Threads = k2q_threads> __global__ void __launch_bounds__(Threads) k2q_count_kernel(k2q_params p) {
  using scan = block_scan<int32_t, k2q_threads>;
  __shared__ typename scan::TempStorage temp;
  const int64_t items = p.heads * p.count_blocks;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t block = item % p.count_blocks, head = item / p.count_blocks;
    const int64_t j0 = block * k2q_count_columns + 4 * threadIdx.x;
    const bool mine = j0 < p.columns;
    int32_t total[4] = {0, 0, 0, 0};
    if (mine) {
      const uint4* mask = reinterpret_cast<const uint4*>(p.mask + head * p.chunks * p.columns + j0);
      int4* base = reinterpret_cast<int4*>(p.base + head * p.chunks * p.columns + j0);
      const int64_t step = p.columns / 4;
      // Four chunks' masks are loaded before their bases are stored, to keep loads in flight.
      for (int64_t c = 0; c < p.chunks; c += 4) {
        uint4 m[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) m[u] = c + u < p.chunks ? mask[(c + u) * step] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (c + u >= p.chunks) break;
          base[(c + u) * step] = make_int4(total[0], total[1], total[2], total[3]);
          total[0] += __popc(m[u].x);
          total[1] += __popc(m[u].y);
          total[2] += __popc(m[u].z);
          total[3] += __popc(m[u].w);
        }
      }
    }
    int32_t offset[4], sum;
    scan(temp).exclusive_sum(total, offset, sum);
    if (mine)
      *reinterpret_cast<int4*>(p.local + head * p.columns + j0) = make_int4(offset[0], offset[1], offset[2], offset[3]);
    if (threadIdx.x == 0) p.block_sum[head * p.count_blocks + block] = sum;
    __syncthreads(); // temp is reused by the next item
  }
}

// A template only so that the header can be included by several translation units (one definition).
template <int Threads = k2q_threads> __global__ void __launch_bounds__(Threads) k2q_fill_kernel(k2q_params p) {
  constexpr int per_thread = k2q_max_count_blocks / k2q_threads;
  using scan = block_scan<int32_t, k2q_threads>;
  __shared__ typename scan::TempStorage temp;
  __shared__ int32_t block_offset[k2q_max_count_blocks];
  __shared__ int32_t counts[k2q_chunk];
  __shared__ int32_t head_total;
  const int64_t items = p.heads * p.chunks;
  const unsigned cap = static_cast<unsigned>(p.capacity);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t chunk = item % p.chunks, head = item / p.chunks;
    // Offsets of the count blocks of this head: every fill block scans the (at most 1024) block sums
    // itself rather than waiting for another launch.
    int32_t sums[per_thread], offsets[per_thread], total;
#pragma unroll
    for (int u = 0; u < per_thread; ++u) {
      const int64_t b = threadIdx.x * per_thread + u;
      sums[u] = b < p.count_blocks ? p.block_sum[head * p.count_blocks + b] : 0;
    }
    scan(temp).exclusive_sum(sums, offsets, total);
#pragma unroll
    for (int u = 0; u < per_thread; ++u) block_offset[threadIdx.x * per_thread + u] = offsets[u];
    if (threadIdx.x == 0) head_total = total;
    load_chunk_counts(p, head, chunk, counts);
    __syncthreads();

    const int64_t first_tile = chunk * k2q_chunk;
    const int32_t* entries = p.q2k + (head * p.n + first_tile) * p.capacity;
    const uint32_t* mask = p.mask + (head * p.chunks + chunk) * p.columns;
    const int32_t* base = p.base + (head * p.chunks + chunk) * p.columns;
    const int32_t* local = p.local + head * p.columns;
    int32_t* lists = p.k2q + head * p.n * p.capacity;
    const unsigned rows = static_cast<unsigned>(p.n - first_tile < k2q_chunk ? p.n - first_tile : k2q_chunk);
    for (unsigned e = threadIdx.x; e < rows * cap; e += k2q_threads) {
      const unsigned r = e / cap, t = e - r * cap;
      if (static_cast<int32_t>(t) >= counts[r]) continue;
      const int64_t j = entries[e];
      if (j < 0 || j >= p.n) continue;
      const int32_t pos = block_offset[j / k2q_count_columns] + local[j] + base[j] + __popc(mask[j] & ((1u << r) - 1u));
      lists[pos] = static_cast<int32_t>(first_tile + r);
    }

    // k2q_offset entries [first_tile, first_tile + 32), the last chunk also entry N; then the -1 tail of
    // this chunk's share of the head's N·capacity list slots.
    int32_t* offset = p.k2q_offset + head * (p.n + 1);
    const int64_t offset_end = chunk == p.chunks - 1 ? p.n + 1 : first_tile + k2q_chunk;
    for (int64_t j = first_tile + threadIdx.x; j < offset_end; j += k2q_threads)
      offset[j] = j < p.n ? block_offset[j / k2q_count_columns] + local[j] : head_total;
    const int64_t slot_begin = first_tile * p.capacity;
    const int64_t slot_end = (chunk == p.chunks - 1 ? p.n : first_tile + k2q_chunk) * p.capacity;
    const int64_t tail_begin = head_total > slot_begin ? head_total : slot_begin;
    for (int64_t s = tail_begin + threadIdx.x; s < slot_end; s += k2q_threads) lists[s] = -1;
    __syncthreads(); // shared arrays are rewritten by the next item
  }
}

// Heads of up to k2q_small_max_n tiles, whose masks fit in shared memory: one kernel instead of the three,
// no scratch and no round trip through global memory between them. Each block builds its head's masks
// itself (one pass over the head's q2k lists, about 150 KB from L2 on wan2.1), takes the column totals and
// their scan, and then writes the lists of k2q_small_columns key tiles: a warp a key tile, a lane a chunk
// of 32 query tiles, whose set bits it writes in order after the earlier chunks' (a warp scan of the
// popcounts). Blocks of one head repeat the marking and split only the writing: the marking is short, and
// more blocks fill more SMs. On the H200 (wan2.1): 20.9 µs against 25.9 for the three kernels
// (bench/NOTES-selection.md).
inline constexpr int k2q_small_threads = 1024;
inline constexpr int k2q_small_columns = 128;
inline constexpr int k2q_small_rows = 16;        // rows a warp loads before it marks them: 512 a pass for the block
inline constexpr int64_t k2q_small_max_n = 1024; // at most 32 chunks: one lane each
inline std::size_t k2q_small_smem(int64_t n) {
  return static_cast<std::size_t>((n + k2q_chunk - 1) / k2q_chunk * n + 2 * n) * 4; // masks, counts, offsets
}
inline bool k2q_small_fits(int64_t n) {
  return n <= k2q_small_max_n && k2q_small_smem(n) + 1024 <= static_cast<std::size_t>(max_block_smem);
}

// A template only so that the header can be included by several translation units (one definition).
template <int Threads = k2q_small_threads> __global__ void __launch_bounds__(Threads) k2q_small_kernel(k2q_params p) {
  using scan = block_scan<int32_t, Threads>;
  constexpr int warps = Threads / warp_size;
  __shared__ typename scan::TempStorage temp;
  __shared__ int32_t head_total;
  extern __shared__ uint4 smem_raw[];
  const int n = static_cast<int>(p.n), chunks = static_cast<int>(p.chunks), cap = static_cast<int>(p.capacity);
  uint32_t* bits = reinterpret_cast<uint32_t*>(smem_raw); // [chunks][n]
  int32_t* counts = reinterpret_cast<int32_t*>(bits + chunks * n);
  int32_t* offsets = counts + n;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % warp_size, warp = tid / warp_size;
  const int ranges = (n + k2q_small_columns - 1) / k2q_small_columns;
  for (int64_t item = blockIdx.x; item < p.heads * ranges; item += gridDim.x) {
    const int64_t head = item / ranges;
    const int range = static_cast<int>(item % ranges);

    for (int w = tid; w < chunks * n; w += Threads) bits[w] = 0u;
    for (int i = tid; i < n; i += Threads) {
      const int32_t c = p.q2k_count[head * n + i];
      counts[i] = c < 0 ? 0 : (c > cap ? cap : c);
    }
    __syncthreads();

    // Marks: a warp takes k2q_small_rows rows at a time (one chunk: the row group never straddles two), a
    // lane a slot of each; all loads before any OR, and no branch around them (a slot past its row's count
    // loads entry 0 and drops it), so that they are in flight together. Offsets fit 32 bits: N·capacity
    // < 2^31 is checked on the host.
    const int32_t* entries = p.q2k + head * n * cap;
    static_assert(k2q_chunk % k2q_small_rows == 0, "a row group stays inside one chunk");
    for (int i0 = warp * k2q_small_rows; i0 < n; i0 += warps * k2q_small_rows) {
      uint32_t* mask = bits + (i0 / k2q_chunk) * n;
      for (int t = lane; t < cap; t += warp_size) {
        int32_t j[k2q_small_rows];
#pragma unroll
        for (int u = 0; u < k2q_small_rows; ++u) {
          const int i = i0 + u;
          const bool ok = i < n && t < counts[i < n ? i : n - 1];
          const int32_t e = entries[ok ? i * cap + t : 0];
          j[u] = ok ? e : -1;
        }
#pragma unroll
        for (int u = 0; u < k2q_small_rows; ++u)
          if (j[u] >= 0 && j[u] < n) atomicOr(&mask[j[u]], 1u << ((i0 + u) % k2q_chunk));
      }
    }
    __syncthreads();

    // List lengths of every key tile (n <= Threads: one a thread) and their exclusive scan.
    int32_t total = 0;
    if (tid < n)
      for (int c = 0; c < chunks; ++c) total += __popc(bits[c * n + tid]);
    int32_t before, sum;
    scan(temp).exclusive_sum(total, before, sum);
    if (tid < n) offsets[tid] = before;
    if (tid == 0) head_total = sum;
    __syncthreads();

    int32_t* lists = p.k2q + head * n * cap;
    int32_t* offset = p.k2q_offset + head * (n + 1);
    const int lo = range * k2q_small_columns, hi = lo + k2q_small_columns < n ? lo + k2q_small_columns : n;
    for (int j = lo + warp; j < hi; j += warps) {
      uint32_t m = lane < chunks ? bits[lane * n + j] : 0u;
      const uint32_t mine = __popc(m);
      const uint32_t through = warp_inclusive_sum(mine, lane); // entries of the chunks up to this lane's
      int32_t* out = lists + offsets[j] + (through - mine);
      for (; m != 0u; m &= m - 1u) *out++ = lane * k2q_chunk + __ffs(m) - 1;
      if (lane == 0) offset[j] = offsets[j];
    }
    if (range == ranges - 1) {
      if (tid == 0) offset[n] = head_total;
      for (int64_t s = head_total + tid; s < static_cast<int64_t>(n) * cap; s += Threads) lists[s] = -1;
    }
    __syncthreads(); // shared arrays are rewritten by the next item
  }
}

// The launches of build_k2q (below) over `n` tiles and `heads` heads of q2k lists, once checked; workspace of
// k2q_layout(n, heads).total() bytes. The joint pass (joint_attention.hpp) calls it on lists over the video's tiles
// and the extra tokens' blocks.
inline status launch_k2q(int64_t n, const k2q_layout& layout, const index_lists& idx, void* workspace,
                         stream_t stream) {
  unsigned char* w = static_cast<unsigned char*>(workspace);
  k2q_params kp{idx.q2k,
                idx.q2k_count,
                idx.k2q,
                idx.k2q_offset,
                reinterpret_cast<uint32_t*>(w),
                reinterpret_cast<int32_t*>(w + layout.mask_bytes),
                reinterpret_cast<int32_t*>(w + layout.mask_bytes + layout.base_bytes),
                reinterpret_cast<int32_t*>(w + layout.mask_bytes + layout.base_bytes + layout.local_bytes),
                layout.heads,
                n,
                idx.q2k_capacity,
                layout.chunks,
                layout.columns,
                layout.count_blocks};
  status s;
  if (k2q_small_fits(n)) {
    const int smem = static_cast<int>(k2q_small_smem(n));
    if (!(s = runtime_status(allow_dynamic_shared(k2q_small_kernel<>, smem), "setting build_k2q's shared-memory size")))
      return s;
    const int64_t ranges = (n + k2q_small_columns - 1) / k2q_small_columns;
    return launch("build_k2q", k2q_small_kernel<>, grid_blocks(layout.heads * ranges), k2q_small_threads, smem, stream,
                  false, kp);
  }
  const int64_t ranges = (layout.columns + k2q_mark_columns - 1) / k2q_mark_columns;
  if (!(s = launch("build_k2q (mark)", k2q_mark_kernel<>, grid_blocks(layout.heads * layout.chunks * ranges),
                   k2q_threads, 0, stream, false, kp)))
    return s;
  if (!(s = launch("build_k2q (count)", k2q_count_kernel<>, grid_blocks(layout.heads * layout.count_blocks),
                   k2q_threads, 0, stream, false, kp)))
    return s;
  return launch("build_k2q (fill)", k2q_fill_kernel<>, grid_blocks(layout.heads * layout.chunks), k2q_threads, 0,
                stream, false, kp);
}

} // namespace detail
} // namespace gpu

// k2q and k2q_offset of idx from its q2k lists (rows may be ragged: counts 0..q2k_capacity): for every key
// tile j of head (b, h), the query tiles whose q2k row holds j, ascending; k2q_offset the exclusive prefix
// sum of the list lengths (entry N the total); the unused tail of each head's N·q2k_capacity slots is set
// to -1. Deterministic. Two-phase workspace protocol: with workspace == nullptr only workspace_bytes is set.
inline status build_k2q(const problem& p, index_lists idx, void* workspace, std::size_t& workspace_bytes,
                        gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (!s) return s;
  const int64_t n = tile_geometry(p.grid).num_tiles();
  if (!(s = check_q2k_capacity(p, idx.q2k_capacity))) return s;
  if (n * idx.q2k_capacity > int64_t(INT32_MAX))
    return status::error(errc::bad_index, "q2k_capacity: N·capacity = %lld overflows the int32 offsets",
                         (long long)(n * idx.q2k_capacity));
  if (n > int64_t(gpu::detail::k2q_max_count_blocks) * gpu::detail::k2q_count_columns)
    return status::error(errc::unsupported, "build_k2q: at most %lld tiles, got %lld",
                         (long long)gpu::detail::k2q_max_count_blocks * gpu::detail::k2q_count_columns, (long long)n);
  gpu::detail::k2q_layout layout;
  if (!layout.init(n, p.batch * p.q_heads))
    return status::error(errc::bad_grid, "build_k2q: the scratch size for %lld tiles overflows", (long long)n);
  if (workspace == nullptr) {
    workspace_bytes = layout.total();
    return status::ok();
  }
  if (!(s = check_workspace(workspace, workspace_bytes, layout.total()))) return s;
  if (!(s = check_pointer("q2k", idx.q2k, 4))) return s;
  if (!(s = check_pointer("q2k_count", idx.q2k_count, 4))) return s;
  if (!(s = check_pointer("k2q", idx.k2q, 4))) return s;
  if (!(s = check_pointer("k2q_offset", idx.k2q_offset, 4))) return s;
  if (!(s = check_k2q_disjoint(p, idx, workspace, layout.total()))) return s;
  return gpu::detail::launch_k2q(n, layout, idx, workspace, stream);
}

} // namespace vsa
