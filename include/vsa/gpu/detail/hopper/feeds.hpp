// How the attention kernels' steps get the tiles they walk over, beside copy_tile: on Hopper's sparse pass through
// the copy engine (arch/hopper_tma.hpp: thread 0 asks for a tile, an mbarrier per tile and stage counts its bytes,
// every thread waits) where the host encoded the tensors' maps (the params' tma = 1). A kernel declares the feed's
// barriers in its static shared memory, makes one feed, and calls it where a tile is waited for or asked for again;
// what it does around those calls (the block barrier before a refill, the copy_tile path where on() is false) is the
// kernel's. The type is chosen here, once: elsewhere the feed is copy_tile_feed, whose on() is a constant false and
// whose calls do nothing, so that the kernels compile as if the copy engine did not exist.
//
//   kv_feed<D, Bars, Params, Engine>     K and V of the forward's and dq's steps, each tile on a barrier of its
//                                        own (Bars barriers: K, then V, of each stage)
//   qdo_feed<D, Stages, Params, Engine>  Q and dO of the portable dk/dv's steps, both on one barrier a stage
//
// Engine: whether the kernel takes the copy engine at all where it is compiled (a choice of the kernel's template
// parameters, so that a kernel that never does compiles as elsewhere); on() is then whether the host encoded the
// maps.
#pragma once

#include "../../arch/matrix.hpp"

#include <type_traits>

namespace vsa {
namespace gpu {
namespace detail {

// Where the copy engine is not compiled: every tile comes through copy_tile, and every call does nothing.
struct copy_tile_feed {
  struct barriers {};
  static constexpr bool copy_engine = false;
  template <class... A> __device__ __forceinline__ explicit copy_tile_feed(barriers&, const A&...) {}
  __device__ __forceinline__ static constexpr bool on() { return false; }
  template <class... A> __device__ __forceinline__ void load(const A&...) const {}
  template <class... A> __device__ __forceinline__ void load_k(const A&...) const {}
  template <class... A> __device__ __forceinline__ void load_v(const A&...) const {}
  template <int Rows, class... A> __device__ __forceinline__ void load_v_rows(const A&...) const {}
  template <class... A> __device__ __forceinline__ void wait(const A&...) const {}
  __device__ __forceinline__ copy_tile_feed k_stage0() const { return *this; }
  __device__ __forceinline__ copy_tile_feed v_stage0() const { return *this; }
  // The calls of the linear kernels' feeds (linear_copies.hpp) beside load and wait: the type is the same on every
  // instantiation, so even a call the kernel makes only on Hopper (if constexpr) must name a member here.
  template <class... A> __device__ __forceinline__ void zero_rows(const A&...) const {}
  template <class... A> __device__ __forceinline__ void store(const A&...) const {}
  __device__ __forceinline__ static void wait_stores_read() {}
  __device__ __forceinline__ static void wait_stores() {}
};

// The map of V a feed takes for a tile's first Rows rows (16, 32 or 64): params that hold maps of the narrow steps'
// heights (v_narrow: boxes of 32 and 16 rows) give the one of that height and copy rows<Rows> rows; others whole tiles.
template <class Params, class = void> struct narrow_maps {
  template <int Rows> static constexpr int rows = tile_rows;
  template <int Rows> __device__ __forceinline__ static const tma_map* v(const Params& p) { return &p.v_map; }
};
template <class Params> struct narrow_maps<Params, std::void_t<decltype(&Params::v_narrow)>> {
  template <int Rows> static constexpr int rows = Rows;
  template <int Rows> __device__ __forceinline__ static const tma_map* v(const Params& p) {
    return Rows == tile_rows ? &p.v_map : &p.v_narrow[Rows == 32 ? 0 : 1];
  }
};

#if VSA_WGMMA
namespace hopper {

// What a feed of one head's tiles holds: its Bars barriers (the kernel's), the params whose maps the copy engine
// reads (by reference: it reads them from parameter space), the head and batch of the block's tiles, and whether
// the host encoded the maps. kv_engine_feed below and the linear kernels' feeds (linear_copies.hpp) build on it.
template <int Bars, class Params> struct head_engine_feed {
  using barriers = uint64_t[Bars];
  static constexpr bool copy_engine = true;
  uint64_t* ready;
  const Params& p;
  int64_t head, batch;
  bool engine;

  // Every thread of the block; `on` as for tma::init_barriers.
  __device__ __forceinline__ head_engine_feed(barriers& bars, bool on, int tid, const Params& params, int64_t h,
                                              int64_t b)
      : ready(bars), p(params), head(h), batch(b), engine(on) {
    tma::init_barriers(bars, Bars, on, tid);
  }
  __device__ __forceinline__ bool on() const { return engine; }
};

// K and V of the key tile whose first token is row `first` (a schedule's token0: 64·tile for the video alone), of kv
// head `head`, batch `batch`, through the maps p.k_map and p.v_map. A loop of one stage waits through k_stage0() and
// v_stage0(); the overlapped forward (forward_overlap.hpp) has two stages and keeps the barriers' phases itself.
template <int D, int Bars, class Params> struct kv_engine_feed : head_engine_feed<Bars, Params> {
  using base = head_engine_feed<Bars, Params>;
  using base::base;

  // Thread 0: the tile into `t`, counted on the barrier of its kind in stage `stage`.
  __device__ __forceinline__ void load_k(smem_tile<D> t, int64_t first, int stage = 0) const {
    tma::load_tile<D>(t, &this->p.k_map, &this->ready[2 * stage], first, this->head, this->batch);
  }
  __device__ __forceinline__ void load_v(smem_tile<D> t, int64_t first, int stage = 0) const {
    load_v_rows<tile_rows>(t, first, stage);
  }
  __device__ __forceinline__ void load(smem_tile<D> kt, smem_tile<D> vt, int64_t first, int stage = 0) const {
    load_k(kt, first, stage);
    load_v(vt, first, stage);
  }
  // V of the tile's first Rows rows only (a narrow step's 16 or 32: step_rows) where the params hold maps of boxes that
  // high (narrow_maps), else all of it. The height is a constant: a map chosen at run time cost the D = 128 forward the
  // registers its wgmma pipeline needs (bench/NOTES.md, v38).
  template <int Rows> __device__ __forceinline__ void load_v_rows(smem_tile<D> t, int64_t first, int stage = 0) const {
    tma::load_rows<D>(t, narrow_maps<Params>::template v<Rows>(this->p), narrow_maps<Params>::template rows<Rows>,
                      &this->ready[2 * stage + 1], first, this->head, this->batch);
  }

  // Every thread, in a loop of one stage, where on(): waits for K or V of stage 0 through these (tma::tile_one::wait,
  // which zeroes a tile's padding rows where given its valid count), each keeping its barrier's phase from the first
  // on. Made where the loop begins.
  __device__ __forceinline__ tma::tile_one k_stage0() const { return {&this->ready[0], 0u}; }
  __device__ __forceinline__ tma::tile_one v_stage0() const { return {&this->ready[1], 0u}; }
  // Every thread, in the overlapped loop (which runs only where on()): waits for the phase of parity `phase` of K's
  // or V's barrier in stage `stage`. A tile whose padding rows a product would read as data then has them zeroed,
  // those at and past `valid` (tma::clear_rows: a box is a whole tile, padding slots included).
  __device__ __forceinline__ void wait_k(int stage, uint32_t phase) const { tma::wait(&this->ready[2 * stage], phase); }
  __device__ __forceinline__ void wait_v(int stage, uint32_t phase) const {
    tma::wait(&this->ready[2 * stage + 1], phase);
  }
  __device__ __forceinline__ static void clear_rows(smem_tile<D> t, int valid, int tid, int nthreads) {
    tma::clear_rows<D>(t, valid, tid, nthreads);
  }
};

// Q and dO of the query tile whose first token is row `first`, of query head `head`, batch `batch`, through p.q_map
// and p.do_map, both on the barrier of their stage.
template <int D, int Stages, class Params> struct qdo_engine_feed {
  using barriers = uint64_t[Stages];
  static constexpr bool copy_engine = true;
  uint64_t* ready;
  const Params& p;
  bool engine;

  // Every thread of the block; `on` as for tma::init_barriers.
  __device__ __forceinline__ qdo_engine_feed(barriers& bars, bool on, int tid, const Params& params)
      : ready(bars), p(params), engine(on) {
    tma::init_barriers(bars, Stages, on, tid);
  }
  __device__ __forceinline__ bool on() const { return engine; }

  // Thread 0: the pair into stage `stage`.
  __device__ __forceinline__ void load(int stage, smem_tile<D> q, smem_tile<D> d_o, int64_t first, int64_t head,
                                       int64_t batch) const {
    tma::tile_pair{&ready[stage], 0u}.load<D>(q, &p.q_map, d_o, &p.do_map, first, head, batch);
  }
  // Every thread: waits for the pair in stage `stage`, whose barrier has been waited on `uses` times before, then
  // zeroes both tiles' rows at and past `valid` (tma::tile_pair::wait). A block barrier must follow.
  __device__ __forceinline__ void wait(int stage, int64_t uses, smem_tile<D> q, smem_tile<D> d_o, int valid, int tid,
                                       int nthreads) const {
    tma::tile_pair{&ready[stage], static_cast<uint32_t>(uses & 1)}.wait<D>(q, d_o, valid, tid, nthreads);
  }
};

} // namespace hopper

template <int D, int Bars, class Params, bool Engine> using kv_feed =
    std::conditional_t<Engine, hopper::kv_engine_feed<D, Bars, Params>, copy_tile_feed>;
template <int D, int Stages, class Params, bool Engine> using qdo_feed =
    std::conditional_t<Engine, hopper::qdo_engine_feed<D, Stages, Params>, copy_tile_feed>;
#else
template <int D, int Bars, class Params, bool Engine> using kv_feed = copy_tile_feed;
template <int D, int Stages, class Params, bool Engine> using qdo_feed = copy_tile_feed;
#endif

} // namespace detail
} // namespace gpu
} // namespace vsa
