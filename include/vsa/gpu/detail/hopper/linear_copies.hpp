// How the linear branch's forward kernels (../linear/state.hpp, ../linear/apply.hpp) get their tiles on Hopper, as
// feeds.hpp says for the attention kernels: through the copy engine (arch/hopper_tma.hpp: thread 0 asks for a tile,
// an mbarrier per stage counts its bytes, every thread waits) where the host encoded the tensors' maps (the params'
// tma = 1). A kernel declares the feed's barriers in its static shared memory, makes one feed, and calls it where a
// tile is asked for, waited for or stored; what it does around those calls (the block barriers, the copy_tile path
// where on() is false) is the kernel's. The type is chosen here, once: on the wgmma backend (VSA_WGMMA, where the
// linear kernels' layer_tn holds) the copy engine's; elsewhere copy_tile_feed (feeds.hpp), whose on() is a constant
// false and whose calls do nothing, so that the kernels compile as if the copy engine did not exist.
//
//   kv_pair_feed<D, Stages, Params>  K and V of state_kernel's stages, both on one barrier a stage
//   qo_ring_feed<D, Ring, Params>    Q in and O out of apply_kernel's ring of tiles, one barrier a ring tile
#pragma once

#include "feeds.hpp"

namespace vsa {
namespace gpu {
namespace detail {

#if VSA_WGMMA
namespace hopper {

// K and V of key tile `tile` (tokens tile·64 ..) of kv head `head`, batch `batch`, through the maps p.k_map and
// p.v_map, both counted on the barrier of their stage.
template <int D, int Stages, class Params> struct kv_pair_engine_feed : head_engine_feed<Stages, Params> {
  using base = head_engine_feed<Stages, Params>;
  using base::base;

  // Thread 0: the pair into stage `stage`'s tiles.
  __device__ __forceinline__ void load(smem_tile<D> k, smem_tile<D> v, int64_t tile, int stage) const {
    tma::tile_pair{&this->ready[stage], 0u}.load<D>(k, &this->p.k_map, v, &this->p.v_map, tile * 64, this->head,
                                                    this->batch);
  }
  // Every thread: waits for the phase of parity `phase` of stage `stage`'s barrier.
  __device__ __forceinline__ void wait(int stage, uint32_t phase) const { tma::wait(&this->ready[stage], phase); }
  // Every thread: its share of zeroing the rows of `t` at and past `valid` (a box is a whole tile, padding slots
  // included, and the copy engine does not zero-fill them), with no fence and no barrier (tma::zero_rows).
  __device__ __forceinline__ static void zero_rows(smem_tile<D> t, int valid, int tid, int nthreads) {
    tma::zero_rows<D>(t, valid, tid, nthreads);
  }
};

// Q of query tile `tile` of query head `head`, batch `batch`, through p.q_map into a ring of Ring tiles, and the O
// tile the kernel writes over it out through p.o_map: a ring tile is asked for again once its store has read it.
template <int D, int Ring, class Params> struct qo_ring_engine_feed : head_engine_feed<Ring, Params> {
  static_assert(Ring >= 2, "a ring of two Q/O tiles at least");
  using base = head_engine_feed<Ring, Params>;
  using base::base;

  // Thread 0: Q tile `tile` of a slice whose first tile is `first`, into ring tile at(slot) for slot = (tile −
  // first) mod Ring, counted on that slot's barrier. Its padding rows come as they are in memory.
  template <class At> __device__ __forceinline__ void load(int64_t tile, int64_t first, const At& at) const {
    const int buf = static_cast<int>((tile - first) % Ring);
    tma::tile_one{&this->ready[buf], 0u}.load<D>(at(buf), &this->p.q_map, tile * 64, this->head, this->batch);
  }
  // Every thread: waits for the phase of parity `phase` of ring slot `slot`'s barrier.
  __device__ __forceinline__ void wait(int slot, uint32_t phase) const { tma::wait(&this->ready[slot], phase); }
  // Thread 0: the O tile in `t` out to query tile `tile`, as one bulk group.
  __device__ __forceinline__ void store(smem_tile<D> t, int64_t tile) const {
    tma::store_tile<D>(&this->p.o_map, t, tile * 64, this->head, this->batch);
  }
  // Thread 0: waits until every store issued has read its ring tile (which may then be refilled), or, for
  // wait_stores, is complete (the block's shared memory must outlast the last stores).
  __device__ __forceinline__ static void wait_stores_read() { tma::store_wait_read<0>(); }
  __device__ __forceinline__ static void wait_stores() { tma::store_wait<0>(); }
};

} // namespace hopper

namespace linear {
template <int D, int Stages, class Params> using kv_pair_feed = hopper::kv_pair_engine_feed<D, Stages, Params>;
template <int D, int Ring, class Params> using qo_ring_feed = hopper::qo_ring_engine_feed<D, Ring, Params>;
} // namespace linear
#else
namespace linear {
template <int D, int Stages, class Params> using kv_pair_feed = copy_tile_feed;
template <int D, int Ring, class Params> using qo_ring_feed = copy_tile_feed;
} // namespace linear
#endif

} // namespace detail
} // namespace gpu
} // namespace vsa
