// What every linear-attention kernel shares: the launch-bound and tile-start macros (VSA_LINEAR_BOUNDS,
// VSA_LINEAR_TILES), the platform's copy stages (from its tuning table, tuning.hpp), the fp32 record of a partial
// sum, the band layout of the warps that own rows of a D × D accumulator, the sequence in chunks of 64 tokens and
// its slices, 16-byte pack / unpack, block_max, and the 16 × D row bands of score tiles as they are loaded from
// and stored to shared memory. The kernels and the stored form of the state are described in
// ../linear_attention_kernels.hpp (the module comment).
#pragma once

#include "../../../geometry.hpp"
#include "../../../numeric.hpp"
#include "../../../types.hpp"
#include "../../arch/matrix.hpp"
#include "../../arch/wave_reduce.hpp"
#include "../../tuning.hpp"
#include "../attention_schedule.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// Resident blocks each kernel is compiled for (NVIDIA's second launch bound, the tuning table's *_blocks; it caps
// registers per thread at 64K / (threads · blocks)). HIP's second bound means something else, so AMD gets only the
// first.
#if VSA_PLATFORM_NVIDIA
#define VSA_LINEAR_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#else
#define VSA_LINEAR_BOUNDS(threads, blocks) __launch_bounds__(threads)
#endif

// Stages of an asynchronous copy into shared memory: the platform's, whatever the code runs as (the tuning
// tables say why).
constexpr int copy_stages = tuning::of(false).copy_stages;

// Where a block's shared tiles start: on the wgmma backend on a 1024-byte boundary (descriptor reads, see
// smem_tile.hpp), for which Hopper blocks are given smem_slack more bytes (tile_slack, host and device
// agree through the kernel's code version); elsewhere at the start, with no slack. A macro, so that the
// other backends compile to exactly the code they had (an inline function in between reorders the address
// arithmetic of the copies, seen in the sm_80 PTX).
#if VSA_WGMMA
#define VSA_LINEAR_TILES(raw) aligned_smem(raw)
#else
#define VSA_LINEAR_TILES(raw) reinterpret_cast<uint16_t*>(raw)
#endif
constexpr int tile_slack(bool hopper) { return hopper ? smem_slack : 0; }

// One fp32 record per (slice, head) of the partial sums: a D × D matrix, then two D-vectors.
template <int D> struct record {
  static constexpr int64_t matrix = 0, first = int64_t(D) * D, second = int64_t(D) * D + D;
  static constexpr int64_t floats = int64_t(D) * D + 2 * D;
};

// Warps of the blocks whose warps own rows of a D × D accumulator: enough bands per warp that the
// accumulators take at most 64 fp32 registers a lane (a 16 × D band is D/2 registers on 32-lane warps,
// D/4 on 64-lane wavefronts), and at least four warps.
template <class E, int D> struct band_layout {
  using M = warp_mma<E, D>;
  static constexpr int fit = 64 / M::out_elems > 0 ? 64 / M::out_elems : 1;
  static constexpr int bands = fit < D / 64 ? fit : D / 64; // bands of 16 rows per warp
  static constexpr int warps = D / 16 / bands;
  static constexpr int threads = warps * M::threads;
  static_assert(warps >= 4, "the query gradient kernel gives 16 rows of a 64-row tile to each of four warps");
};

// The tokens of one head in chunks of 64: tiles in tiled order (the last slots of a partial tile are
// padding), consecutive runs of 64 tokens in raster order (the last one may be short).
struct sequence {
  tile_geometry geo{grid3{}};
  int64_t tokens; // S
  int64_t chunks; // ⌈S / 64⌉
  int tiled;
  __device__ __forceinline__ int valid(int64_t c) const {
    if (tiled) return geo.valid(c);
    const int64_t rest = tokens - c * 64;
    return rest < 64 ? static_cast<int>(rest) : 64;
  }
};

// Units [begin, end) of slice `slice` of `slices` over `units`, as even as integers allow.
__device__ __forceinline__ void slice_range(int64_t slice, int64_t slices, int64_t units, int64_t& begin,
                                            int64_t& end) {
  begin = slice * units / slices;
  end = (slice + 1) * units / slices;
}

template <class E> __device__ __forceinline__ void unpack(const uint4& x, float (&f)[8]) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = E::to_float(static_cast<uint16_t>(w[i] & 0xffffu));
    f[2 * i + 1] = E::to_float(static_cast<uint16_t>(w[i] >> 16));
  }
}
template <class E> __device__ __forceinline__ uint4 pack(const float (&f)[8]) {
  return make_uint4(E::pack(f[0], f[1]), E::pack(f[2], f[3]), E::pack(f[4], f[5]), E::pack(f[6], f[7]));
}

// Maximum over the D threads of a block (D a multiple of the warp size); every thread gets it. `scratch`
// holds D / warp_size floats of shared memory. The lane pattern is wave_reduce's (replayed on the host for
// both warp sizes by tests/cpu/test_wave_reduce.cpp): a whole-warp butterfly, then one partial per warp.
template <int D> __device__ __forceinline__ float block_max(float v, float* scratch) {
  constexpr int warps = wave_reduce::block_warps(D, warp_size);
  static_assert(wave_reduce::block_whole_warps(D, warp_size), "block_max needs whole warps");
#pragma unroll
  for (int s = 0; s < wave_reduce::warp_steps(warp_size); ++s)
    v = fmaxf(v, shfl_xor(v, wave_reduce::warp_mask(warp_size, s)));
  if (warps == 1) return v;
  if (wave_reduce::block_slot_writer(threadIdx.x, warp_size))
    scratch[wave_reduce::block_slot(threadIdx.x, warp_size)] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < warps; ++w) r = fmaxf(r, scratch[w]);
  __syncthreads(); // scratch is reused by the next call
  return r;
}

// ---- score tiles as D-wide row bands --------------------------------------------------------------------
// A 16 × D band of a [64, D] shared tile is held as D / 64 score tiles (columns c·64 ...). Only the layer's
// element map (elem_row, elem_col, elem_slot) and its row reductions are used, so this code runs unchanged
// on every matrix backend. Like the attention kernels' epilogues, it relies on elements e and e + 1 (e even)
// being adjacent columns of one row, and moves them as one 32-bit word.

template <class E, int D, int T>
__device__ __forceinline__ void load_band(typename warp_mma<E, D>::score_tile (&x)[T], smem_tile<D> t, int row0) {
  using M = warp_mma<E, D>;
#pragma unroll
  for (int c = 0; c < T; ++c)
#pragma unroll
    for (int e = 0; e < M::score_elems; e += 2) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(t.at(row0 + M::elem_row(e), c * 64 + M::elem_col(e)));
      x[c].x[e] = E::to_float(static_cast<uint16_t>(w & 0xffffu));
      x[c].x[e + 1] = E::to_float(static_cast<uint16_t>(w >> 16));
    }
}

// Per-column factors (z, m, σ, ...) of the even column `col` and the next, which a lane's elements e, e + 1
// (e even) always pair: one 8-byte load instead of two.
__device__ __forceinline__ float2 column_pair(const float* v, int col) {
  return *reinterpret_cast<const float2*>(v + col);
}

// Writes a 16 × D fp32 band into rows row0 … of a shared tile, rounded to E. Adjacent elements e, e + 1
// of the layer are adjacent columns of one row, so pairs go out as one 32-bit store.
template <class E, int D>
__device__ __forceinline__ void store_band(const typename warp_mma<E, D>::out_tile& o, smem_tile<D> t, int row0) {
  using M = warp_mma<E, D>;
#pragma unroll
  for (int e = 0; e < M::out_elems; e += 2)
    *reinterpret_cast<uint32_t*>(t.at(row0 + M::elem_row(e), M::elem_col(e))) = E::pack(o.x[e], o.x[e + 1]);
}

// Copies the 64 rows of a shared tile to global memory in 16-byte vectors: rows below `valid`, and zeros in
// the rows from `valid` to `rows_out` (the padding slots of a tiled tensor; rows_out = valid in raster
// order, whose short last chunk has no rows beyond the sequence).
template <int D> __device__ __forceinline__ void store_tile(uint16_t* dst, int64_t row_stride, smem_tile<D> t,
                                                            int valid, int rows_out, int tid, int nthreads) {
  constexpr int chunks = smem_tile<D>::chunks;
  for (int i = tid; i < rows_out * chunks; i += nthreads) {
    const int r = i / chunks, c = i % chunks;
    const uint4 v = r < valid ? *reinterpret_cast<const uint4*>(t.chunk(r, c)) : make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(dst + r * row_stride + c * 8) = v;
  }
}

} // namespace linear
} // namespace detail
} // namespace gpu
} // namespace vsa
