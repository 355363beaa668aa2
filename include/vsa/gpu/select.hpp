// Stage 4 on the GPU: the top-k key tiles of every row of the coarse scores.
//
// Scores become 32-bit keys whose unsigned order is the ranking (NaN lowest, -0 equal to +0). Both kernels
// find a threshold key: keys above it are taken, and of the keys equal to it the lowest-indexed ones, as many
// as are still needed; a scan over the row in index order then gives each taken tile its place, so the row
// comes out ascending without a sort.
//
// Rows of up to 1024 tiles (every anchor shape) take one warp each, the row in registers (top_k_warp_kernel,
// below). Longer rows take a block each, which runs an exact radix select: up to four passes of an 8-bit
// digit, most significant first, each build a histogram of the keys that still match the digits chosen so
// far and pick the digit holding the k-th largest key; a pass stops early once every key of the chosen digit
// is taken. Rows of up to 32 tiles per thread stay in registers across the passes; longer rows are re-read
// from global memory (L2) in each pass, so N is bounded only by the int32 index lists, not by shared memory.
#pragma once

#include "../geometry.hpp"
#include "../validate.hpp"
#include "primitives.hpp"

#include <cmath>

namespace vsa {
namespace gpu {
namespace detail {

inline constexpr int top_k_threads = 128;
inline constexpr int top_k_bins = 256; // one 8-bit digit
inline constexpr int top_k_bins_per_thread = top_k_bins / top_k_threads;

// Unsigned key in ranking order: larger scores give larger keys; -0 and +0 give the same key; NaN gives 1,
// below the key of -inf (0x007fffff), so NaNs rank below every number and tie among themselves. Key 0 is
// left to the warp kernel's empty slots, below every score.
__device__ __forceinline__ uint32_t score_key(float x) {
  if (x != x) return 1u;
  const uint32_t bits = x == 0.0f ? 0u : __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The number a key stands for (the inverse of score_key; -0 comes back as +0). Keys 0 and 1 (NaN) and keys
// above +inf's give NaN.
__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// What a row takes: its n scores, of which the top k, written as tiles from `first` on.
struct top_k_row {
  int n, k;
  float z; // the warp kernel's first guess: mean + z · standard deviation (top_k_first_guess)
  int first;
};

struct top_k_params {
  const float* scores; // [rows, n]
  int64_t rows;
  int n, k;
  int32_t* q2k; // [rows, capacity]
  int32_t* q2k_count;
  int64_t capacity;
  bool vector_loads; // n % 4 == 0 and scores 16-byte aligned
  float z;           // top_k_row::z
  // A packed batch (packed_attention.hpp): row r is tile r mod `tiles` of the batch, and info[tile] = {the sample's
  // first tile, N_s, k_s, z_s as bits}: the row's first N_s scores are its sample's (of n, the widest sample's), and
  // its top k_s go to the list as tiles of the batch. The kernels take it where Packed.
  const int4* info;
  int64_t tiles;
  template <bool Packed> __device__ __forceinline__ top_k_row row_of(int64_t row) const {
    if constexpr (Packed) {
      const int4 e = info[row % tiles];
      return {e.y, e.z, __int_as_float(e.w), e.x};
    } else {
      return {n, k, z, 0};
    }
  }
};

// Where the k-th largest of n normal scores lies, in standard deviations from their mean: the upper-tail
// quantile of (k - 1/2) / n (Abramowitz and Stegun 26.2.23, error below 5e-4; it only places the warp
// kernel's first candidate, so any value is correct, a close one fast).
inline float top_k_first_guess(int64_t n, int64_t k) {
  const double q = (static_cast<double>(k) - 0.5) / static_cast<double>(n), p = q < 0.5 ? q : 1.0 - q;
  const double t = std::sqrt(-2.0 * std::log(p));
  const double x =
      t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)));
  return static_cast<float>(q < 0.5 ? x : -x);
}

template <int Items, bool Packed = false> __global__ void __launch_bounds__(top_k_threads)
    top_k_kernel(top_k_params p) {
  constexpr int threads = top_k_threads, chunk = threads * Items;
  using count_scan = block_scan<uint32_t, threads>;
  using rank_scan = block_scan<unsigned long long, threads>;
  __shared__ union {
    typename count_scan::TempStorage counts;
    typename rank_scan::TempStorage ranks;
  } temp;
  __shared__ uint32_t hist[top_k_bins];
  __shared__ uint32_t found_prefix, found_need, found_exact;

  uint32_t key[Items];
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const top_k_row spec = p.row_of<Packed>(row);
    const int n = spec.n;
    const bool resident = n <= chunk;
    const float* src = p.scores + row * p.n;
    // Blocked order: thread t holds positions base + t·Items ... base + t·Items + Items - 1.
    const auto load = [&](int base) {
      const int first = base + static_cast<int>(threadIdx.x) * Items;
      if (Items % 4 == 0 && p.vector_loads && first + Items <= n) {
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
        for (int u = 0; u < Items; ++u) key[u] = first + u < n ? score_key(src[first + u]) : 0u;
      }
    };

    if (resident) load(0);
    uint32_t prefix = 0, need = static_cast<uint32_t>(spec.k);
    bool exact = false;
    for (int pass = 0; pass < 4 && !exact; ++pass) {
      const int shift = 24 - 8 * pass;
      const uint32_t decided = pass == 0 ? 0u : ~0u << (shift + 8); // digits chosen in earlier passes
      for (int b = threadIdx.x; b < top_k_bins; b += threads) hist[b] = 0u;
      __syncthreads();
      for (int base = 0; base < n; base += chunk) {
        if (!resident) load(base);
        const int first = base + static_cast<int>(threadIdx.x) * Items;
#pragma unroll
        for (int u = 0; u < Items; ++u)
          if (first + u < n && ((key[u] ^ prefix) & decided) == 0u) atomicAdd(&hist[(key[u] >> shift) & 0xffu], 1u);
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
    for (int base = 0; base < n; base += chunk) {
      if (!resident) load(base);
      const int first = base + static_cast<int>(threadIdx.x) * Items;
      unsigned long long mine = 0;
#pragma unroll
      for (int u = 0; u < Items; ++u) {
        if (first + u >= n) continue;
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
        if (first + u >= n) continue;
        if (key[u] >= take_from) {
          out[above + (ties < tie_need ? ties : tie_need)] = spec.first + first + u;
          ++above;
        } else if (key[u] == tie_key) {
          if (ties < tie_need) out[above + ties] = spec.first + first + u;
          ++ties;
        }
      }
      __syncthreads(); // temp is reused by the next chunk or row
    }
    for (int64_t c = spec.k + threadIdx.x; c < p.capacity; c += threads) out[c] = -1;
    if (threadIdx.x == 0) p.q2k_count[row] = spec.k;
  }
}

// Rows of up to top_k_warp_max_n tiles: one warp a row, the whole row in registers in blocked order (lane l
// holds tiles l·Items ... l·Items + Items - 1), no shared memory and no block barrier, so that as many rows
// are in flight as the SM holds warps. The threshold is the key T with count(key >= T) >= k > count(key > T),
// found on an interval [lo, hi) of keys that always satisfies count(>= lo) >= k > count(>= hi): each step
// counts the keys at or above one candidate (a compare a key and one warp-wide sum) and moves an end to it.
// The first two candidates assume a normal row (mean + z·sd, z from the host); then the candidate is where
// the count would cross k - 1/2 if it fell linearly in the score between the ends (false position, with
// the Illinois rule against one end staying put; in the score, not in the key: keys are bit patterns, far
// from linear across exponents). Simulated on normal rows of 480-768 scores that takes ~4.8 steps, against
// ~15 for a bisection of the key bits (exponential rows ~4.7, uniform ~5). After top_k_interpolation_steps,
// and wherever an end is not a finite number, the key interval is bisected instead, so no input (ties,
// infinities, NaN) takes more than ~48 steps. The search stops early when some candidate has exactly k keys
// at or above it. On the H200 (wan2.1, 624 tiles a row): 21.5 µs against 36-39 for the block kernel
// (bench/NOTES-selection.md).
inline constexpr int top_k_warp_max_n = 1024;
inline constexpr int top_k_interpolation_steps = 16;

template <int Items, bool Packed = false> __global__ void __launch_bounds__(top_k_threads)
    top_k_warp_kernel(top_k_params p) {
  constexpr int warps = top_k_threads / warp_size;
  const int lane = static_cast<int>(threadIdx.x) % warp_size;
  const int first = lane * Items;
  for (int64_t row = int64_t(blockIdx.x) * warps + threadIdx.x / warp_size; row < p.rows;
       row += int64_t(gridDim.x) * warps) {
    const top_k_row spec = p.row_of<Packed>(row);
    const int valid = spec.n - first < 0 ? 0 : (spec.n - first < Items ? spec.n - first : Items);
    const uint32_t k = static_cast<uint32_t>(spec.k);
    const float* src = p.scores + row * p.n + first;
    // Slots past the row's end hold key 0, below every score's key (NaN's is 1), so they are never counted,
    // never at the threshold and never taken: nothing below needs to know which slots are real.
    uint32_t key[Items];
    float sum = 0.f, squares = 0.f; // of the scores, for the first guess
    if (Items % 4 == 0 && p.vector_loads && valid == Items) {
#pragma unroll
      for (int u = 0; u < Items; u += 4) {
        const float4 f = *reinterpret_cast<const float4*>(src + u);
        key[u] = score_key(f.x);
        key[u + 1] = score_key(f.y);
        key[u + 2] = score_key(f.z);
        key[u + 3] = score_key(f.w);
        sum += (f.x + f.y) + (f.z + f.w);
        squares += (f.x * f.x + f.y * f.y) + (f.z * f.z + f.w * f.w);
      }
    } else {
#pragma unroll
      for (int u = 0; u < Items; ++u) {
        const float f = u < valid ? src[u] : 0.f;
        key[u] = u < valid ? score_key(f) : 0u;
        sum += f;
        squares += f * f;
      }
    }
    uint32_t kmin = ~0u, kmax = 0u; // kmin of key - 1: the empty slots' 0 wraps to the top
#pragma unroll
    for (int u = 0; u < Items; ++u) {
      kmin = min(kmin, key[u] - 1u);
      kmax = max(kmax, key[u]);
    }
    const auto at_least = [&](uint32_t t) {
      uint32_t c[4] = {0u, 0u, 0u, 0u}; // four chains of adds instead of one
#pragma unroll
      for (int u = 0; u < Items; ++u) c[u % 4] += key[u] >= t ? 1u : 0u;
      return warp_sum(c[0] + c[1] + c[2] + c[3]);
    };

    // Keys never exceed 0xff800000 (+inf), so kmax + 1 does not wrap.
    uint32_t lo = warp_min(kmin) + 1u, hi = warp_max(kmax) + 1u, c_lo = static_cast<uint32_t>(spec.n), c_hi = 0u;
    // The search is for where count(>= score) - (k - 1/2) changes sign: g_lo > 0 at lo, g_hi < 0 at hi.
    float g_lo = static_cast<float>(c_lo) - static_cast<float>(k) + 0.5f, g_hi = 0.5f - static_cast<float>(k);
    bool exact = c_lo == k;
    // The first two candidates assume normal scores: mean + z·sd, then 0.1 sd further in the direction the
    // first one's count points. Simulated on rows of 480-768 normal scores, this takes the search from ~7.4
    // to ~4.8 steps (exponential scores ~4.7, uniform ~5; without the guess ~9 and ~4.5).
#pragma unroll
    for (int s = 0; s < wave_reduce::warp_steps(warp_size); ++s) { // both sums' butterflies interleaved
      const int m = wave_reduce::warp_mask(warp_size, s);
      sum += shfl_xor(sum, m);
      squares += shfl_xor(squares, m);
    }
    const float mean = sum / static_cast<float>(spec.n);
    const float sd = sqrtf(fmaxf(squares / static_cast<float>(spec.n) - mean * mean, 0.f));
    int last = 0; // which end the previous step moved: 1 lo, 2 hi
    for (int step = 0; !exact && hi - lo > 1u; ++step) {
      const float v_lo = key_value(lo), v_hi = key_value(hi);
      const float v = step == 0   ? mean + sd * spec.z
                      : step == 1 ? mean + sd * (last == 1 ? spec.z + 0.1f : spec.z - 0.1f)
                                  : v_lo + __fdividef(g_lo, g_lo - g_hi) * (v_hi - v_lo);
      uint32_t cand;
      if (step >= top_k_interpolation_steps || (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) {
        cand = lo + (hi - lo) / 2u; // v infinite or NaN (tested on the bits: safe under fast math)
      } else {
        const uint32_t x = score_key(v);
        cand = x <= lo ? lo + 1u : (x >= hi ? hi - 1u : x);
      }
      const uint32_t c = at_least(cand);
      const float g = static_cast<float>(c) - static_cast<float>(k) + 0.5f;
      if (c >= k) {
        if (last == 1 && step >= 2) g_hi *= 0.5f; // the Illinois rule: an end kept twice counts half
        lo = cand, c_lo = c, g_lo = g, last = 1;
      } else {
        if (last == 2 && step >= 2) g_lo *= 0.5f;
        hi = cand, c_hi = c, g_hi = g, last = 2;
      }
      exact = c == k;
    }

    // Exact: the keys >= lo, k of them. Otherwise hi = lo + 1: the c_hi keys above lo, and of the keys equal
    // to lo the first k - c_hi in index order. Each lane marks its keys above and at the threshold in two
    // bit masks, a warp scan of their popcounts gives its place, and it writes the tiles of its taken bits.
    const uint32_t take_from = exact ? lo : hi, tie_need = exact ? 0u : k - c_hi;
    uint32_t above = 0u, ties = 0u;
#pragma unroll
    for (int u = 0; u < Items; ++u) {
      above |= key[u] >= take_from ? 1u << u : 0u;
      ties |= key[u] == lo ? 1u << u : 0u;
    }
    ties &= ~above;
    const uint32_t mine = (static_cast<uint32_t>(__popc(above)) << 16) | static_cast<uint32_t>(__popc(ties));
    // (keys above << 16) | ties, in the lanes before; both at most 1024
    const uint32_t before = warp_inclusive_sum(mine, lane) - mine;
    const uint32_t ties_before = before & 0xffffu;
    // The ties this lane may still take: the first tie_need - ties_before of its tie bits.
    for (uint32_t m = ties, left = tie_need > ties_before ? tie_need - ties_before : 0u; m != 0u; m &= m - 1u)
      if (left-- == 0u) {
        ties &= ~m; // m's lowest bit and all above it: past the quota
        break;
      }
    int32_t* const list = p.q2k + row * p.capacity;
    int32_t* out = list + (before >> 16) + min(ties_before, tie_need);
    for (uint32_t m = above | ties; m != 0u; m &= m - 1u) *out++ = spec.first + first + __ffs(m) - 1;
    for (int64_t c = spec.k + lane; c < p.capacity; c += warp_size) list[c] = -1;
    if (lane == 0) p.q2k_count[row] = spec.k;
  }
}

// A row of top_k_warp_max_n tiles needs Items - 4 < top_k_warp_max_n / warp_size: wider kernels are never
// launched, and are not compiled (on AMD's 64-lane wavefronts, Items above 16).
template <int Items, bool Packed = false>
status launch_top_k_warp(const top_k_params& p, unsigned blocks, stream_t stream) {
  if constexpr ((Items - 4) * warp_size < top_k_warp_max_n)
    return launch("select_top_k", top_k_warp_kernel<Items, Packed>, blocks, top_k_threads, 0, stream, false, p);
  else
    return status::error(errc::unsupported, "select_top_k: no kernel of %d items a lane is compiled", Items);
}

// The warp kernel for rows of up to top_k_warp_max_n scores (p.n: the row stride), else the block kernel.
template <bool Packed> status launch_top_k(const top_k_params& p, stream_t stream) {
  if (p.n <= top_k_warp_max_n) {
    const int64_t warps = top_k_threads / warp_size;
    const unsigned blocks = grid_blocks((p.rows + warps - 1) / warps);
    const int64_t items = (p.n + warp_size - 1) / warp_size; // keys a lane holds
    // Items in steps of 4 (whole 16-byte loads): up to 1024 / 32 on NVIDIA, 1024 / 64 on AMD.
    switch ((items + 3) / 4) {
    case 1:
      return launch_top_k_warp<4, Packed>(p, blocks, stream);
    case 2:
      return launch_top_k_warp<8, Packed>(p, blocks, stream);
    case 3:
      return launch_top_k_warp<12, Packed>(p, blocks, stream);
    case 4:
      return launch_top_k_warp<16, Packed>(p, blocks, stream);
    case 5:
      return launch_top_k_warp<20, Packed>(p, blocks, stream);
    case 6:
      return launch_top_k_warp<24, Packed>(p, blocks, stream);
    case 7:
      return launch_top_k_warp<28, Packed>(p, blocks, stream);
    default:
      return launch_top_k_warp<32, Packed>(p, blocks, stream);
    }
  }
  return launch("select_top_k", top_k_kernel<32, Packed>, grid_blocks(p.rows), top_k_threads, 0, stream, false, p);
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
  if (!(s = check_top_k_disjoint(p, scores, idx, workspace, gpu::detail::top_k_workspace_bytes))) return s;

  namespace gd = gpu::detail;
  gd::top_k_params tp{scores,
                      p.batch * p.q_heads * n,
                      static_cast<int>(n),
                      static_cast<int>(top_k),
                      idx.q2k,
                      idx.q2k_count,
                      idx.q2k_capacity,
                      n % 4 == 0 && reinterpret_cast<std::uintptr_t>(scores) % 16 == 0,
                      gd::top_k_first_guess(n, top_k),
                      nullptr,
                      0};
  return gd::launch_top_k<false>(tp, stream);
}

} // namespace vsa
