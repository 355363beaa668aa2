// Host side of the attention kernels: the one place where run-time dtype and head dim become template
// parameters, and where grids and shared-memory sizes are set.
#pragma once

#include "attention_backward.hpp"
#include "attention_dq_stored.hpp"
#include "attention_forward.hpp"
#include "hopper/dkdv.hpp"

#include <type_traits>

namespace vsa {
namespace gpu {
namespace detail {

template <class E, int D> struct kernel_config {
  using element = E;
  static constexpr int head_dim = D;
};

// Calls f(kernel_config<E, D>{}) for the problem's dtype and head dim (validated before: bf16/fp16, 64/128).
template <class F> status dispatch(dtype t, int64_t d, F&& f) {
  if (t == dtype::bf16 && d == 128) return f(kernel_config<bf16_type, 128>{});
  if (t == dtype::bf16 && d == 64) return f(kernel_config<bf16_type, 64>{});
  if (t == dtype::fp16 && d == 128) return f(kernel_config<fp16_type, 128>{});
  if (t == dtype::fp16 && d == 64) return f(kernel_config<fp16_type, 64>{});
  return status::error(errc::bad_argument, "no kernel for %s with head dim %lld", dtype_name(t), (long long)d);
}

// Whether this platform's backend can store dS for dq (stores_score_frags), which sizes the backward's workspace.
inline constexpr bool stores_ds_here = stores_score_frags<warp_mma<bf16_type, 128>>::value;

template <class Kernel> status prepare(Kernel k, int smem_bytes) {
  // Raising the dynamic shared-memory limit is idempotent and cheap; doing it on every launch keeps the
  // library free of global state.
  return runtime_status(allow_dynamic_shared(k, smem_bytes), "setting the kernel's shared-memory size");
}

// kernel_of(std::bool_constant<Narrow>) for the schedule: narrow steps (with_step_width) only for a sparse grid
// that has tiles they pay on; the coarse pass never instantiates them.
template <class Sched, class F> auto narrow_or_not(const Sched& s, F&& kernel_of) {
  if constexpr (!Sched::few_blocks) {
    if (s.narrow_pays()) return kernel_of(std::true_type{});
  }
  return kernel_of(std::false_type{});
}

// kernel_of(std::bool_constant<Raster>) for outputs in raster order (raster_out) where the kernel takes
// the order as a template parameter (the forward and dq: with_out_rows says why); only the sparse schedule
// instantiates the raster kernels (not the joint one: its extra tokens have no raster positions).
template <class Sched, class F> auto raster_or_not(bool raster, F&& kernel_of) {
  if constexpr (!Sched::few_blocks && !Sched::joint) {
    if (raster) return kernel_of(std::true_type{});
  }
  (void)raster;
  return kernel_of(std::false_type{});
}

template <class E, int D, class Sched>
status launch_forward(const forward_params& fp, const Sched& s, int64_t batch, int64_t heads, stream_t stream) {
  const auto kernel = narrow_or_not(s, [&](auto narrow) {
    return raster_or_not<Sched>(fp.raster_out, [](auto raster) {
      return attention_forward_kernel<E, D, Sched, decltype(narrow)::value, decltype(raster)::value>;
    });
  });
  bool hopper = false;
  status st = runs_as_hopper(kernel, hopper);
  if (!st) return st;
  const int smem = smem_plan<D>::forward_bytes(hopper, Sched::few_blocks);
  st = prepare(kernel, smem);
  if (!st) return st;
  const dim3 grid(static_cast<unsigned>(s.query_grid()), static_cast<unsigned>(heads), static_cast<unsigned>(batch));
  forward_params f = fp;
  f.tma = 0;
  if (smem_plan<D>::forward_copy_engine(hopper, Sched::few_blocks)) { // Hopper's sparse pass, not the coarse one
    // K and V through the copy engine where both maps encode (hopper_tma.hpp).
    const int64_t kv_heads = heads / fp.group, tokens = s.rows_total();
    const auto map = [&](tma_map& m, const operand& x, int rows) {
      return encode_tile_map(m, x.data, batch, tokens, kv_heads, D, x.batch, x.token, x.head, rows);
    };
    // The sparse schedule's narrow steps (the one-step loop's, not the overlapped one's: attention_forward_kernel) copy
    // V's rows they read only: maps of their heights too (narrow_maps).
    bool narrow = false;
    if constexpr (!Sched::few_blocks && !Sched::joint)
      narrow = s.narrow_pays() && !smem_plan<D>::forward_overlap(hopper, false);
    if (map(f.k_map, fp.k, tile_rows) && map(f.v_map, fp.v, tile_rows) &&
        (!narrow || (map(f.v_narrow[0], fp.v, 32) && map(f.v_narrow[1], fp.v, 16))))
      f.tma = 1;
  }
  return launch("attention forward", kernel, grid, forward_threads<E, D>(hopper, Sched::few_blocks), smem, stream,
                false, f, s);
}

template <class E, int D, class Sched>
status launch_delta(const delta_params& dp, const Sched& s, int64_t batch, stream_t stream) {
  const dim3 grid(static_cast<unsigned>(s.tiles), static_cast<unsigned>(dp.q_heads), static_cast<unsigned>(batch));
  return launch("attention delta", attention_delta_kernel<E, D, Sched>, grid, 256, 0, stream, false, dp, s);
}

// Fills op.order (and uses op.counts, 2·order_buckets ints a kv head) with the launch order of the dk/dv blocks: the
// extra tiles of every kv head of a run first (op.lead), then each kv head's other tiles longest first.
inline status launch_order(const order_params& op, stream_t stream) {
  const std::size_t heads = static_cast<std::size_t>(op.items / op.tiles);
  status st = runtime_status(memset_async(op.counts, 0, heads * 2 * order_buckets * sizeof(int32_t), stream), "order");
  if (!st) return st;
  const unsigned blocks = static_cast<unsigned>((op.items + 255) / 256);
  st = launch("attention backward (order)", order_count_kernel<>, blocks, 256, 0, stream, false, op);
  if (!st) return st;
  return launch("attention backward (order)", order_place_kernel<>, blocks, 256, 0, stream, false, op);
}

// The sparse backward with dq from stored dS (attention_dq_stored.hpp): the map of q2k entries to k2q positions,
// then over groups of bp.ds_units kv heads (the slots the workspace holds), dk/dv storing each pair's dS and dq
// reading them. Sched: the video's sparse_schedule or the joint pass's.
// split: dk/dv is Hopper's warp-specialized kernel (launch_backward decides).
template <class E, int D, class Sched> status launch_backward_stored(const backward_params& bp, const Sched& q_sched,
                                                                     const Sched& k_sched, int64_t batch, bool hopper,
                                                                     bool split, stream_t stream) {
  using M = warp_mma<E, D>;
  const auto dq = narrow_or_not(q_sched, [&](auto narrow) {
    return raster_or_not<Sched>(bp.raster_out, [](auto raster) {
      return attention_dq_stored_kernel<E, D, decltype(narrow)::value, decltype(raster)::value, Sched>;
    });
  });
  const auto dkdv = attention_dkdv_kernel<E, D, Sched, 0, true>;
  constexpr bool has_split = D == 128; // Hopper's storing dk/dv
  const int dq_smem = dq_stored_plan<D>::bytes, dkdv_smem = smem_plan<D>::dkdv_bytes(hopper);
  status st = prepare(dq, dq_smem);
  if (st && !split) st = prepare(dkdv, dkdv_smem);
  if constexpr (has_split) {
    if (st && split)
      st = prepare(hopper::hopper_dkdv_kernel<E, D, hopper::dkdv_tuning, true, Sched>, hopper::dkdv_plan<D>::bytes);
  }
  if (!st) return st;
  const int64_t tiles = q_sched.tiles;
  ds_map_params mp{q_sched.list, q_sched.count, k_sched.list,     k_sched.offset,
                   bp.ds_map,    tiles,         q_sched.capacity, batch * bp.q_heads * tiles * q_sched.capacity};
  st = launch("attention backward (dS map)", ds_map_kernel<>, static_cast<unsigned>((mp.entries + 255) / 256), 256, 0,
              stream, false, mp);
  const int64_t units = batch * bp.kv_heads;
  for (int64_t u0 = 0; st && u0 < units; u0 += bp.ds_units) {
    const int64_t n = units - u0 < bp.ds_units ? units - u0 : bp.ds_units;
    backward_params b = bp;
    b.item0 = u0 * tiles;
    b.ds_head0 = u0 * bp.group;
    const unsigned blocks = static_cast<unsigned>(n * tiles);
    if constexpr (has_split) {
      if (split) {
        st = launch("attention backward (dk, dv)", hopper::hopper_dkdv_kernel<E, D, hopper::dkdv_tuning, true, Sched>,
                    blocks, hopper::block_threads, hopper::dkdv_plan<D>::bytes, stream, false, b, k_sched);
      }
    }
    if (!split)
      st = launch("attention backward (dk, dv)", dkdv, blocks, 4 * M::threads, dkdv_smem, stream, false, b, k_sched);
    if (st) {
      st =
          launch("attention backward (dq)", dq, dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(n * bp.group)),
                 4 * M::threads, dq_smem, stream, false, b, q_sched);
    }
  }
  return st;
}

// Whether the sparse backward takes dq from stored dS on the current device for this dtype and head dim, on the video's
// schedule or the joint one: the backend can store dS (stores_ds_here) and the table of the code the kernels run as
// takes it, so that the workspace asks for slots only where they are used. False where the device cannot be asked.
template <bool Can = stores_ds_here> bool stores_ds_for(dtype t, int64_t d, bool joint_schedule) {
  bool takes = false;
  if constexpr (Can) {
    (void)dispatch(t, d, [&](auto cfg) {
      using C = decltype(cfg);
      bool hopper = false;
      const status st = runs_as_hopper(attention_dq_stored_kernel<typename C::element, C::head_dim>, hopper);
      takes = st && tuning::of(hopper).stored_ds(C::head_dim, joint_schedule);
      return status::ok();
    });
  }
  (void)t, (void)d, (void)joint_schedule;
  return takes;
}

// Hopper's warp-specialized dk/dv for a schedule (head dim 128 only: named where has_split below holds).
template <class E, int D, class Sched> inline constexpr auto split_dkdv =
    hopper::hopper_dkdv_kernel<E, D, hopper::dkdv_tuning, false, Sched>;

template <class E, int D, class Sched> status launch_backward(const backward_params& bp, const Sched& q_sched,
                                                              const Sched& k_sched, int64_t batch, stream_t stream) {
  using M = warp_mma<E, D>;
  const auto dq = narrow_or_not(q_sched, [&](auto narrow) {
    return raster_or_not<Sched>(bp.raster_out, [](auto raster) {
      return attention_dq_kernel<E, D, Sched, decltype(narrow)::value, 0, decltype(raster)::value>;
    });
  });
  const auto dkdv = attention_dkdv_kernel<E, D, Sched>;
  bool hopper = false;
  status st = runs_as_hopper(dq, hopper);
  if (!st) return st;
  const int smem = smem_plan<D>::backward_bytes(hopper), dkdv_smem = smem_plan<D>::dkdv_bytes(hopper);
  backward_params b = bp;
  b.tma = 0;
  // On Hopper the tiles go through the copy engine where all four maps encode (hopper_tma.hpp). The maps end
  // at the rows that exist in memory: the coarse pass's last block of means is short, and the copy engine
  // fills the rows past the end with zeros instead of reading them. A short block of a packed batch's coarse pass
  // (packed_dense_schedule) is followed by the next sample's rows, which the copy engine reads: the feeds' waits
  // zero every row past the valid count before a product reads it (hopper/feeds.hpp).
  const int64_t tokens = q_sched.rows_total();
  const auto map = [&](tma_map& m, const operand& x, int64_t heads) {
    return encode_tile_map(m, x.data, batch, tokens, heads, D, x.batch, x.token, x.head);
  };
  if (hopper && map(b.k_map, bp.k, bp.kv_heads) && map(b.v_map, bp.v, bp.kv_heads) && map(b.q_map, bp.q, bp.q_heads) &&
      map(b.do_map, bp.d_o, bp.q_heads))
    b.tma = 1;
  // The sparse pass at head dim 128 on Hopper takes the warp-specialized dk/dv (hopper/dkdv.hpp) where the maps
  // encoded and its Hopper body was compiled (sm_90a: the body declares its barriers in static shared memory; a
  // build for sm_90 without the architecture-specific features compiles it empty, and it is not launched). Decided
  // before anything is launched, so that a failed query leaves no kernel of the pass behind.
  constexpr bool has_split = !Sched::few_blocks && D == 128; // the kernel's instantiations
  bool split = false;
  if constexpr (has_split) {
    // Its pair counter is 32-bit: a key tile's pairs are at most group · tiles · capacity (the lists' clamp).
    const bool pairs_fit = bp.group * k_sched.tiles * k_sched.capacity < (int64_t(1) << 31);
    if (hopper && b.tma != 0 && bp.order != nullptr && bp.dk_f32 == nullptr && bp.dv_f32 == nullptr && pairs_fit) {
      int split_static = 0;
      st = runtime_status(kernel_static_smem(split_dkdv<E, D, Sched>, &split_static),
                          "querying a kernel's shared memory");
      if (!st) return st;
      split = split_static > 0;
      if (split) st = prepare(split_dkdv<E, D, Sched>, hopper::dkdv_plan<D>::bytes);
      if (!st) return st;
    }
  }
  // dq from the dS that dk/dv stores, where the workspace holds slots (ds_units), the backend can store them and the
  // table takes it.
  if constexpr (!Sched::few_blocks && stores_score_frags<warp_mma<E, D>>::value) {
    if (bp.ds_units > 0 && bp.order != nullptr && tuning::of(hopper).stored_ds(D, Sched::joint))
      return launch_backward_stored<E, D, Sched>(b, q_sched, k_sched, batch, hopper, split, stream);
  }
  st = prepare(dq, smem);
  if (st && !split) st = prepare(dkdv, dkdv_smem);
  if (!st) return st;
  const dim3 qgrid(static_cast<unsigned>(q_sched.tiles), static_cast<unsigned>(bp.q_heads),
                   static_cast<unsigned>(batch));
  st = launch("attention backward (dq)", dq, qgrid, 4 * M::threads, smem, stream, false, b, q_sched);
  if (!st) return st;
  if constexpr (has_split) {
    if (split) {
      return launch("attention backward (dk, dv)", split_dkdv<E, D, Sched>,
                    static_cast<unsigned>(k_sched.tiles * bp.kv_heads * batch), hopper::block_threads,
                    hopper::dkdv_plan<D>::bytes, stream, false, b, k_sched);
    }
  }
  const dim3 kgrid = bp.order != nullptr ? dim3(static_cast<unsigned>(k_sched.tiles * bp.kv_heads * batch))
                                         : dim3(static_cast<unsigned>(k_sched.tiles),
                                                static_cast<unsigned>(bp.kv_heads), static_cast<unsigned>(batch));
  return launch("attention backward (dk, dv)", dkdv, kgrid, 4 * M::threads, dkdv_smem, stream, false, b, k_sched);
}

} // namespace detail
} // namespace gpu
} // namespace vsa
