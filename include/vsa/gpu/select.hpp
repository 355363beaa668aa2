// Stage 4 on the GPU: the top-k key tiles of every row of the coarse scores.
//
// One block per row runs an exact radix select. Scores become 32-bit keys whose unsigned order is the
// ranking (NaN lowest, -0 equal to +0). Up to four passes of an 8-bit digit, most significant first, each
// build a histogram of the keys that still match the digits chosen so far and pick the digit holding the
// k-th largest key; a pass stops early once every key of the chosen digit is taken. What is left is a
// threshold: keys above it are taken, and of the keys equal to it the lowest-indexed ones, as many as are
// still needed. A final block-wide scan over the row in index order gives each taken tile its place, so
// the row comes out ascending without a sort.
//
// Rows of up to 32 tiles per thread stay in registers across the passes; longer rows are re-read from
// global memory (L2) in each pass, so N is bounded only by the int32 index lists, not by shared memory.
#pragma once

#include "../geometry.hpp"
#include "../validate.hpp"
#include "primitives.hpp"

namespace vsa {
namespace gpu {
namespace detail {

inline constexpr int top_k_threads = 128;
inline constexpr int top_k_bins = 256; // one 8-bit digit
inline constexpr int top_k_bins_per_thread = top_k_bins / top_k_threads;

// Unsigned key in ranking order: larger scores give larger keys; -0 and +0 give the same key; NaN gives 0,
// below the key of -inf (0x007fffff), so NaNs rank below every number and tie among themselves.
__device__ __forceinline__ uint32_t score_key(float x) {
  if (x != x) return 0u;
  const uint32_t bits = x == 0.0f ? 0u : __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct top_k_params {
  const float* scores; // [rows, n]
  int64_t rows;
  int n, k;
  int32_t* q2k; // [rows, capacity]
  int32_t* q2k_count;
  int64_t capacity;
  bool vector_loads; // n % 4 == 0 and scores 16-byte aligned
};

template <int Items> __global__ void __launch_bounds__(top_k_threads) top_k_kernel(top_k_params p) {
  constexpr int threads = top_k_threads, chunk = threads * Items;
  using count_scan = block_scan<uint32_t, threads>;
  using rank_scan = block_scan<unsigned long long, threads>;
  __shared__ union {
    typename count_scan::TempStorage counts;
    typename rank_scan::TempStorage ranks;
  } temp;
  __shared__ uint32_t hist[top_k_bins];
  __shared__ uint32_t found_prefix, found_need, found_exact;

  const bool resident = p.n <= chunk;
  uint32_t key[Items];
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const float* src = p.scores + row * p.n;
    // Blocked order: thread t holds positions base + t·Items ... base + t·Items + Items - 1.
    const auto load = [&](int base) {
      const int first = base + static_cast<int>(threadIdx.x) * Items;
      if (Items % 4 == 0 && p.vector_loads && first + Items <= p.n) {
#pragma unroll
        for (int u = 0; u < Items; u += 4) {
          const float4 f = *reinterpret_cast<const float4*>(src + first + u);
          key[u] = score_key(f.x);
          key[u + 1] = score_key(f.y);
          key[u + 2] = score_key(f.z);
          key[u + 3] = score_key(f.w);
        }
      } else {
#pragma unroll
        for (int u = 0; u < Items; ++u) key[u] = first + u < p.n ? score_key(src[first + u]) : 0u;
      }
    };

    if (resident) load(0);
    uint32_t prefix = 0, need = static_cast<uint32_t>(p.k);
    bool exact = false;
    for (int pass = 0; pass < 4 && !exact; ++pass) {
      const int shift = 24 - 8 * pass;
      const uint32_t decided = pass == 0 ? 0u : ~0u << (shift + 8); // digits chosen in earlier passes
      for (int b = threadIdx.x; b < top_k_bins; b += threads) hist[b] = 0u;
      __syncthreads();
      for (int base = 0; base < p.n; base += chunk) {
        if (!resident) load(base);
        const int first = base + static_cast<int>(threadIdx.x) * Items;
#pragma unroll
        for (int u = 0; u < Items; ++u)
          if (first + u < p.n && ((key[u] ^ prefix) & decided) == 0u) atomicAdd(&hist[(key[u] >> shift) & 0xffu], 1u);
      }
      __syncthreads();
      // Digits from the top: scan position q holds digit 255 - q, so `above` counts the larger digits.
      uint32_t count[top_k_bins_per_thread], above[top_k_bins_per_thread], total;
#pragma unroll
      for (int u = 0; u < top_k_bins_per_thread; ++u)
        count[u] = hist[top_k_bins - 1 - (threadIdx.x * top_k_bins_per_thread + u)];
      count_scan(temp.counts).exclusive_sum(count, above, total);
#pragma unroll
      for (int u = 0; u < top_k_bins_per_thread; ++u) {
        if (above[u] < need && above[u] + count[u] >= need) { // exactly one digit qualifies
          const uint32_t digit = top_k_bins - 1 - (threadIdx.x * top_k_bins_per_thread + u);
          found_prefix = prefix | (digit << shift);
          found_need = need - above[u];
          found_exact = need - above[u] == count[u];
        }
      }
      __syncthreads();
      prefix = found_prefix;
      need = found_need;
      exact = found_exact != 0u;
    }

    // Keys >= take_from are taken; of the keys equal to tie_key, the first tie_need in index order.
    const unsigned long long take_from = exact ? prefix : static_cast<unsigned long long>(prefix) + 1ull;
    const uint32_t tie_key = prefix, tie_need = exact ? 0u : need;
    int32_t* out = p.q2k + row * p.capacity;
    unsigned long long carry = 0; // (taken above the threshold << 32) | (ties seen), over earlier chunks
    for (int base = 0; base < p.n; base += chunk) {
      if (!resident) load(base);
      const int first = base + static_cast<int>(threadIdx.x) * Items;
      unsigned long long mine = 0;
#pragma unroll
      for (int u = 0; u < Items; ++u) {
        if (first + u >= p.n) continue;
        if (key[u] >= take_from)
          mine += 1ull << 32;
        else if (key[u] == tie_key)
          mine += 1ull;
      }
      unsigned long long before, total;
      rank_scan(temp.ranks).exclusive_sum(mine, before, total);
      before += carry;
      carry += total;
      uint32_t above = static_cast<uint32_t>(before >> 32), ties = static_cast<uint32_t>(before);
#pragma unroll
      for (int u = 0; u < Items; ++u) {
        if (first + u >= p.n) continue;
        if (key[u] >= take_from) {
          out[above + (ties < tie_need ? ties : tie_need)] = first + u;
          ++above;
        } else if (key[u] == tie_key) {
          if (ties < tie_need) out[above + ties] = first + u;
          ++ties;
        }
      }
      __syncthreads(); // temp is reused by the next chunk or row
    }
    for (int64_t c = p.k + threadIdx.x; c < p.capacity; c += threads) out[c] = -1;
    if (threadIdx.x == 0) p.q2k_count[row] = p.k;
  }
}

// No scratch is used. The size reported is not zero, so that a caller following the query-then-run
// protocol passes a non-null pointer on the second call and the call runs.
inline constexpr std::size_t top_k_workspace_bytes = 256;

} // namespace detail
} // namespace gpu

// For every (b, h, i) row of scores [B, Hq, N, N] (fp32, row-major), the top_k key tiles with the largest
// scores (ties to the lower index, NaN below every number), written ascending to q2k row (b·Hq + h)·N + i;
// q2k_count = top_k and the unused capacity of each row is set to -1. Two-phase workspace protocol: with
// workspace == nullptr only workspace_bytes is set.
inline status select_top_k(const problem& p, int64_t top_k, const float* scores, index_lists idx, void* workspace,
                           std::size_t& workspace_bytes, gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  if (!s) return s;
  const int64_t n = tile_geometry(p.grid).num_tiles();
  if (top_k < 1 || top_k > n)
    return status::error(errc::bad_top_k, "top_k: must be in 1..%lld, got %lld", (long long)n, (long long)top_k);
  if (idx.q2k_capacity < top_k || idx.q2k_capacity > n)
    return status::error(errc::bad_index, "q2k_capacity: must be in top_k..N = %lld..%lld, got %lld", (long long)top_k,
                         (long long)n, (long long)idx.q2k_capacity);
  if (workspace == nullptr) {
    workspace_bytes = gpu::detail::top_k_workspace_bytes;
    return status::ok();
  }
  if (!(s = check_workspace(workspace, workspace_bytes, gpu::detail::top_k_workspace_bytes))) return s;
  if (!(s = check_pointer("scores", scores, 4))) return s;
  if (!(s = check_pointer("q2k", idx.q2k, 4))) return s;
  if (!(s = check_pointer("q2k_count", idx.q2k_count, 4))) return s;

  namespace gd = gpu::detail;
  gd::top_k_params tp{scores,
                      p.batch * p.q_heads * n,
                      static_cast<int>(n),
                      static_cast<int>(top_k),
                      idx.q2k,
                      idx.q2k_count,
                      idx.q2k_capacity,
                      n % 4 == 0 && reinterpret_cast<std::uintptr_t>(scores) % 16 == 0};
  const unsigned blocks = gd::grid_blocks(tp.rows);
  if (n <= gd::top_k_threads * 8)
    gd::top_k_kernel<8><<<blocks, gd::top_k_threads, 0, stream>>>(tp);
  else
    gd::top_k_kernel<32><<<blocks, gd::top_k_threads, 0, stream>>>(tp);
  return gpu::launch_status("select_top_k");
}

} // namespace vsa
