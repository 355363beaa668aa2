// Hopper's tensor memory accelerator (TMA) for the tile copies: one thread asks the copy engine for a whole
// 64 × 64 box of a [B, S, H, D] tensor, which lands in shared memory already in the 128-byte-swizzle panel
// layout of smem_tile (chunk c of row r at chunk c ^ (r mod 8) of a 1024-byte-aligned atom: the layout
// wgmma reads, smem_layout.hpp), and signals an mbarrier with the bytes it wrote. The copy then costs the
// block one instruction per panel instead of a few per 16-byte chunk per thread (copy_tile), which matters
// because the attention kernels are issue-bound.
//
// Host side: a tensor map (the driver's 128-byte description of the tensor) per operand, encoded per call
// through the driver entry point that the CUDA runtime hands out, so nothing links the driver library.
// Device side: mbarrier wrappers and the 4-d tiled load. Both exist only for NVIDIA code of sm_90 and
// later built by nvcc (VSA_RUNTIME_CUDA); elsewhere tma_available() is false and the kernels copy with
// copy_tile.
#pragma once

#include "smem_tile.hpp"
#include "warp.hpp"

#if VSA_RUNTIME_CUDA
#include <cuda.h>
#endif

namespace vsa {
namespace gpu {

// The driver's tensor map, kept as opaque bytes so that structures holding one compile everywhere. It is a
// kernel parameter and must stay in parameter space: kernels take it through a __grid_constant__ argument.
struct alignas(128) tma_map { // the driver asks 64-byte alignment; CUDA 13's header declares 128
  unsigned char bytes[128];
};

#if VSA_RUNTIME_CUDA
static_assert(sizeof(tma_map) == sizeof(CUtensorMap) && alignof(tma_map) >= alignof(CUtensorMap),
              "tma_map mirrors CUtensorMap");

namespace detail {
using encode_tiled_fn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                     const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                     CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// The driver's encoder, looked up once: its address does not change while the process runs.
inline encode_tiled_fn tma_encoder() {
  static const encode_tiled_fn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &found);
#endif
    return e == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<encode_tiled_fn>(p) : nullptr;
  }();
  return fn;
}
} // namespace detail
#endif

// Encodes the map of a [B, S, H, D] tensor of 16-bit elements (element strides batch, token, head; the head
// dim contiguous) whose boxes are 64 columns × `rows` tokens (64: a whole tile) of one head and batch, stored with the
// 128-byte swizzle. False where the platform has no TMA or the tensor does not meet its rules (16-byte aligned base and
// strides, strides below 2^40 bytes): the caller then copies with copy_tile.
inline bool encode_tile_map(tma_map& map, const void* data, int64_t batch, int64_t tokens, int64_t heads,
                            int64_t head_dim, int64_t batch_stride, int64_t token_stride, int64_t head_stride,
                            int rows = tile_rows) {
#if VSA_RUNTIME_CUDA
  const detail::encode_tiled_fn encode = detail::tma_encoder();
  if (encode == nullptr || reinterpret_cast<std::uintptr_t>(data) % 16 != 0) return false;
  const int64_t strides[3] = {token_stride * 2, head_stride * 2, batch_stride * 2};
  for (int64_t s : strides)
    if (s <= 0 || s % 16 != 0 || s >= (int64_t(1) << 40)) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(tokens),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t byte_strides[3] = {static_cast<cuuint64_t>(strides[0]), static_cast<cuuint64_t>(strides[1]),
                                      static_cast<cuuint64_t>(strides[2])};
  const cuuint32_t box[4] = {smem_layout::panel_cols, static_cast<cuuint32_t>(rows), 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  return encode(reinterpret_cast<CUtensorMap*>(map.bytes), CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(data),
                dims, byte_strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
#else
  (void)map, (void)data, (void)batch, (void)tokens, (void)heads, (void)head_dim, (void)batch_stride, (void)token_stride,
      (void)head_stride, (void)rows;
  return false;
#endif
}

// ---- device side (sm_90a code: VSA_WGMMA) -------------------------------------------------------------------
#if VSA_WGMMA
namespace tma {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// An mbarrier that completes a phase when `count` threads have arrived and the bytes they announced landed.
// The fence makes the initialisation visible to the copy engine; a block barrier must follow before use.
__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// This thread's arrival, announcing `bytes` that copies signalling the barrier will write in this phase.
__device__ __forceinline__ void arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}
// Waits until the barrier's phase with parity `phase` has completed; the bytes of its copies are then visible
// to the waiting thread.
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t phase) {
  uint32_t done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(smem_address(bar)), "r"(phase)
                 : "memory");
  } while (!done);
}
// This thread's plain arrival (no bytes announced): its earlier accesses to shared memory are ordered before
// anything a thread that then sees the phase complete does.
__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}
// The `count` threads (a multiple of 32) that call it with the same id meet (named barrier id: 1 to 15, 0 is
// the block's __syncthreads).
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// The box at (column, token, head, batch) of the tensor `map` describes, into the 1024-byte-aligned panel at
// dst; completion is counted on bar.
__device__ __forceinline__ void load_box(uint16_t* dst, const tma_map* map, uint64_t* bar, int column, int token,
                                         int head, int batch) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
               "%5}], [%6];" ::"r"(smem_address(dst)),
               "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(token), "r"(head), "r"(batch),
               "r"(smem_address(bar))
               : "memory");
}

// The box at (column, token, head, batch) of the tensor `map` describes, from the 1024-byte-aligned panel at
// src (the layout load_box writes), as one bulk store of this thread's current bulk group. Rows of the box
// past the tensor's end are not written.
__device__ __forceinline__ void store_box(const tma_map* map, const uint16_t* src, int column, int token, int head,
                                          int batch) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_address(src)), "r"(column), "r"(token), "r"(head), "r"(batch)
               : "memory");
}
// Closes this thread's current bulk group of stores.
__device__ __forceinline__ void store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's bulk groups still read their shared memory (which may then be
// written again), or, for store_wait, are still incomplete at all.
template <int N> __device__ __forceinline__ void store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
// Thread 0 of the block: the D/64 panels of shared tile t to token `token` of head `head`, batch `batch`, as
// one bulk group. The tile's rows were written with ordinary stores: every writing thread fences them
// (fence.proxy.async) before the block barrier that precedes this call.
template <int D> __device__ __forceinline__ void store_tile(const tma_map* map, smem_tile<D> t, int64_t token,
                                                            int64_t head, int64_t batch) {
#pragma unroll
  for (int c = 0; c < D / smem_layout::panel_cols; ++c)
    store_box(map, t.base + c * smem_layout::panel, c * smem_layout::panel_cols, static_cast<int>(token),
              static_cast<int>(head), static_cast<int>(batch));
  store_commit();
}

// Initialises `count` barriers of one arrival each when `on` (thread 0), then the block meets once, so that
// no thread waits on a barrier before it exists. Every thread of the block calls it.
__device__ __forceinline__ void init_barriers(uint64_t* bars, int count, bool on, int tid) {
  if (!on) return;
  if (tid == 0)
    for (int i = 0; i < count; ++i) barrier_init(&bars[i], 1);
  __syncthreads();
}

// Thread 0 of the block: the D/64 panels of the tile at token `token` of head `head`, batch `batch`, counted on
// bar. load_tile announces the tile's bytes with its one arrival; load_rows takes a map whose boxes are `rows` tokens
// high (encode_tile_map's rows) and announces those: the tile's first rows only.
template <int D> __device__ __forceinline__ void load_rows(smem_tile<D> t, const tma_map* map, int rows, uint64_t* bar,
                                                           int64_t token, int64_t head, int64_t batch) {
  arrive_expect(bar, static_cast<uint32_t>(rows * D * 2));
#pragma unroll
  for (int c = 0; c < D / smem_layout::panel_cols; ++c)
    load_box(t.base + c * smem_layout::panel, map, bar, c * smem_layout::panel_cols, static_cast<int>(token),
             static_cast<int>(head), static_cast<int>(batch));
}
template <int D> __device__ __forceinline__ void load_tile(smem_tile<D> t, const tma_map* map, uint64_t* bar,
                                                           int64_t token, int64_t head, int64_t batch) {
  load_rows<D>(t, map, tile_rows, bar, token, head, batch);
}
// Every thread, once a tile has landed: this thread's share of zeroing the tile's rows at and past `valid`, as
// copy_tile's zero-fill leaves them (a box is a whole tile, padding slots included, and a padding slot may hold
// anything: a NaN times a zero probability is NaN). No fence and no barrier: the caller orders the zeros.
// Rows at and past `rows` are left as they are, for a product that reads only the first `rows` of the tile.
template <int D>
__device__ __forceinline__ void zero_rows(smem_tile<D> t, int valid, int tid, int nthreads, int rows = tile_rows) {
  constexpr int chunks = smem_tile<D>::chunks;
  for (int x = tid; x < (rows - valid) * chunks; x += nthreads)
    *reinterpret_cast<uint4*>(t.chunk(valid + x / chunks, x % chunks)) = make_uint4(0u, 0u, 0u, 0u);
}
// zero_rows, then the threads that share the tile meet (`meet`: the block's barrier, or a named one of the
// nthreads threads) so that every thread's zeros are in place before any warp's product reads them. `valid` is
// the same for every thread: the barrier is reached by all or none.
template <int D, class Meet>
__device__ __forceinline__ void clear_rows_then(smem_tile<D> t, int valid, int tid, int nthreads, int rows, Meet meet) {
  if (valid >= rows) return;
  zero_rows<D>(t, valid, tid, nthreads, rows);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  meet();
}
template <int D>
__device__ __forceinline__ void clear_rows(smem_tile<D> t, int valid, int tid, int nthreads, int rows = tile_rows) {
  clear_rows_then<D>(t, valid, tid, nthreads, rows, [] { __syncthreads(); });
}

// The pipelines' use of the above: two tiles (K and V, or Q and dO) of one (token block, head, batch), asked
// for by thread 0 and counted on one barrier, then waited for by every thread.
struct tile_pair {
  uint64_t* bar;
  uint32_t phase; // parity of the barrier's next phase

  // Thread 0 of the block: the D/64 panels of both tiles at token `token` of head `head`, batch `batch`.
  template <int D> __device__ __forceinline__ void load(smem_tile<D> a, const tma_map* a_map, smem_tile<D> b,
                                                        const tma_map* b_map, int64_t token, int64_t head,
                                                        int64_t batch) {
    arrive_expect(bar, 2 * smem_tile<D>::bytes);
#pragma unroll
    for (int c = 0; c < D / smem_layout::panel_cols; ++c) {
      const int col = c * smem_layout::panel_cols;
      load_box(a.base + c * smem_layout::panel, a_map, bar, col, static_cast<int>(token), static_cast<int>(head),
               static_cast<int>(batch));
      load_box(b.base + c * smem_layout::panel, b_map, bar, col, static_cast<int>(token), static_cast<int>(head),
               static_cast<int>(batch));
    }
  }
  // Every thread: waits for the pair, then zeroes the rows at and past `valid` of both tiles. A box is a
  // whole tile, padding slots included, and a padding slot may hold anything (a NaN times a zero probability
  // is NaN), so the rows are cleared as copy_tile's zero-fill leaves them. A block barrier must follow.
  template <int D>
  __device__ __forceinline__ void wait(smem_tile<D> a, smem_tile<D> b, int valid, int tid, int nthreads) {
    tma::wait(bar, phase);
    phase ^= 1u;
    constexpr int chunks = smem_tile<D>::chunks;
    for (int x = tid; x < (tile_rows - valid) * chunks; x += nthreads) {
      const int r = valid + x / chunks, c = x % chunks;
      *reinterpret_cast<uint4*>(a.chunk(r, c)) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(b.chunk(r, c)) = make_uint4(0u, 0u, 0u, 0u);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); // the zeros are read by wgmma
  }
};

// One tile on a barrier of its own. The forward and dq wait for their two tiles separately and ask for the
// next copy of each as soon as the step's last product reading it is done, so that one tile is in flight
// while the other is being used (the block has one stage: a second would cost a block an SM).
struct tile_one {
  uint64_t* bar;
  uint32_t phase; // parity of the barrier's next phase

  // Thread 0 of the block: the D/64 panels of the tile at token `token` of head `head`, batch `batch`.
  template <int D>
  __device__ __forceinline__ void load(smem_tile<D> t, const tma_map* map, int64_t token, int64_t head, int64_t batch) {
    load_tile<D>(t, map, bar, token, head, batch);
  }
  // Every thread: waits for the tile. For a tile whose padding rows a product would read as data, pass
  // its valid row count: rows at and past it are zeroed (as tile_pair::wait), and the block meets at a
  // barrier so that every thread's zeros are in place before any warp's product reads them. Products that
  // read only the first `rows` rows (a narrow step: attention_schedule.hpp) need only those cleared.
  __device__ __forceinline__ void wait() {
    tma::wait(bar, phase);
    phase ^= 1u;
  }
  template <int D>
  __device__ __forceinline__ void wait(smem_tile<D> t, int valid, int tid, int nthreads, int rows = tile_rows) {
    wait();
    clear_rows<D>(t, valid, tid, nthreads, rows);
  }
};

// K and V of the forward's and dq's steps, each on one of the two barriers `bars` (a __shared__ array of the
// kernel). Every thread of the block constructs it; `on` as for init_barriers.
struct kv_copies {
  tile_one k, v;
  __device__ __forceinline__ kv_copies(uint64_t (&bars)[2], bool on, int tid) : k{&bars[0], 0u}, v{&bars[1], 0u} {
    init_barriers(bars, 2, on, tid);
  }
  // Thread 0: both tiles of key block `token`.
  template <int D> __device__ __forceinline__ void load(smem_tile<D> kt, const tma_map* k_map, smem_tile<D> vt,
                                                        const tma_map* v_map, int64_t token, int64_t head,
                                                        int64_t batch) {
    k.load<D>(kt, k_map, token, head, batch);
    v.load<D>(vt, v_map, token, head, batch);
  }
};

} // namespace tma
#endif

} // namespace gpu
} // namespace vsa
