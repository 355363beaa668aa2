// dq of the sparse pass from the dS that dk/dv stored: five products a pair instead of seven. The dk/dv kernel
// forms every pair's dS (as dSᵀ, keys against queries) on its way to dK; with p.ds set it also stores it,
// transposed into the A fragments of dq's product (warp_mma::store_transposed), in the pair's slot, the pair's
// position in the k2q lists. dq then needs one product a pair, dq += dS · K, instead of recomputing S and dP
// from Q, K, V and dO (three). Each query tile still sums its pairs in its q2k list's order, one thread an
// element, so the result stays bitwise reproducible; it differs from the recomputing kernel's only by the
// rounding of S and dP formed as K·Qᵀ and V·dOᵀ (bench/NOTES.md v22).
//
// Two kernels: ds_map_kernel finds, for each q2k entry (query tile i of head bh selecting key tile j), the
// position of i in j's ascending k2q list, so that dq finds its pairs' slots; attention_dq_stored_kernel walks a
// query tile's list, streaming each pair's 8 KB slot and K tile through a ring of shared-memory stages.
//
// The slots take 8 KB a pair (3.9 GB on wan2.1-1.3b-480p), so the pass runs over groups of kv heads sized to
// the workspace (backward_params::ds_units; attention_launch.hpp), dk/dv and then dq of each group. The joint pass
// (joint_attention.hpp) takes the same kernels on its lists of T = N + X entries a row, its slots by pair
// (joint_schedule::ds_slot).
#pragma once

#include "attention_backward.hpp"

namespace vsa {
namespace gpu {
namespace detail {

struct ds_map_params {
  const int32_t* q2k;        // [B·Hq·N, capacity]
  const int32_t* q2k_count;  // [B·Hq·N]
  const int32_t* k2q;        // [B·Hq, N·capacity]
  const int32_t* k2q_offset; // [B·Hq, N + 1]
  int32_t* map;              // [B·Hq·N, capacity]: the k2q position within the head, or −1
  int64_t tiles, capacity, entries;
};

// One thread a q2k entry: a binary search of the query tile in its key tile's k2q list, over the clamped range
// the dk/dv kernel walks (sparse_schedule::range), so that a position found is one that dk/dv wrote. An entry
// past the row's count, a key tile out of range or a query tile missing from the list (corrupt lists) gets −1,
// and dq skips it: such lists cost results, never memory safety.
template <int Threads = 256> __global__ void __launch_bounds__(Threads) ds_map_kernel(ds_map_params p) {
  const int64_t pos = static_cast<int64_t>(blockIdx.x) * Threads + threadIdx.x;
  if (pos >= p.entries) return;
  const int64_t row = pos / p.capacity, t = pos % p.capacity, bh = row / p.tiles, i = row % p.tiles;
  const int64_t span = p.tiles * p.capacity;
  const auto clamp = [](int64_t x, int64_t hi) { return x < 0 ? int64_t(0) : (x > hi ? hi : x); };
  int32_t found = -1;
  const int64_t j = t < clamp(p.q2k_count[row], p.capacity) ? p.q2k[pos] : -1;
  if (j >= 0 && j < p.tiles) {
    const int32_t* o = p.k2q_offset + bh * (p.tiles + 1) + j;
    int64_t lo = clamp(o[0], span);
    const int64_t end = clamp(o[1], span);
    int64_t hi = end;
    const int32_t* list = p.k2q + bh * span;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (list[mid] < i)
        lo = mid + 1;
      else
        hi = mid;
    }
    if (lo < end && list[lo] == i) found = static_cast<int32_t>(lo);
  }
  p.map[pos] = found;
}

// The stages of the ring: K (64 × D) and the pair's stored dS (64 × 64), both in flight while an earlier stage is
// used.
template <int D> struct dq_stored_plan {
  static constexpr int stages = 2;
  static constexpr int k_bytes = smem_tile<D>::bytes, ds_bytes = tile_rows * tile_rows * 2;
  static constexpr int stage_bytes = k_bytes + ds_bytes;
  static constexpr int bytes = stages * stage_bytes + smem_slack;
  static_assert(bytes <= max_block_smem, "the stages do not fit");
};

// A block per (query tile, query head of the group of heads ds_head0 …); warp w computes dq of the tile's rows
// 16w … 16w + 15. Each lane copies only the four 16-byte chunks of the slot that it reads (its A fragments), so
// the slot needs no barrier of its own; K is shared by the warps. Narrow and RasterOut as for attention_dq_kernel.
// Sched: the video's sparse_schedule or the joint pass's (its tiles' rows through token0, its extra query tiles' long
// walks first: query_block).
template <class E, int D, bool Narrow = false, bool RasterOut = false, class Sched = sparse_schedule>
__global__ void __launch_bounds__((4 * warp_mma<E, D>::threads))
    attention_dq_stored_kernel(const VSA_GRID_CONSTANT backward_params p, Sched s) {
  using M = warp_mma<E, D>;
  using plan = dq_stored_plan<D>;
  constexpr int nthreads = 4 * M::threads, stages = plan::stages, slot_elems = tile_rows * tile_rows;
  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = aligned_smem(smem_raw);
  const auto sk = [&](int buf) { return smem_tile<D>{sm + buf * (plan::stage_bytes / 2)}; };
  const auto sds = [&](int buf) { return sm + buf * (plan::stage_bytes / 2) + plan::k_bytes / 2; };

  // The grid is (tiles, query heads of the group of heads): query_block's head is the head's place in the group.
  int64_t i, unit, zero;
  s.query_block(i, unit, zero);
  const int64_t bh = p.ds_head0 + unit;
  const int64_t b = bh / p.q_heads, h = bh % p.q_heads, hk = h / p.group;
  const int tid = threadIdx.x, row0 = (tid / M::threads) * 16;
  const int q_valid = s.valid(i);
  const uint16_t* const slots = p.ds + unit * s.ds_stride() * slot_elems;

  int64_t begin, end;
  s.range(bh, i, begin, end);
  const auto count = s.valid_counter(); // as in attention_dkdv_kernel
  const auto load = [&](int64_t pos, int buf) {
    const int64_t j = s.at(pos);
    const int kv = count.valid(j);
    // (tile(): at D = 64 ptxas gave the video's kernel 16 registers fewer than with at(token0), a block an SM more)
    if constexpr (Sched::joint) {
      copy_tile(sk(buf), p.k.at(b, hk, s.token0(j)), p.k.token, kv, tid, nthreads);
    } else {
      copy_tile(sk(buf), p.k.tile(b, hk, j), p.k.token, kv, tid, nthreads);
    }
    const int32_t slot = p.ds_map[pos];
    const uint16_t* src = slots + (slot < 0 ? 0 : static_cast<int64_t>(slot)) * slot_elems;
#pragma unroll
    for (int kk = 0; kk < tile_rows / 16; ++kk) {
      const int c = M::frag_chunk(row0, kk);
      // A missing pair reads zeros; so do the key steps past the step's width, which the product skips.
      copy_chunk(sds(buf) + 8 * c, src + 8 * c, src, slot >= 0 && j >= 0 && kk * 16 < step_rows(kv));
    }
  };
  for (int k = 0; k < stages - 1; ++k) {
    if (begin + k < end) load(begin + k, k);
    copy_commit();
  }

  typename M::out_tile dq;
#pragma unroll
  for (int e = 0; e < M::out_elems; ++e) dq.x[e] = 0.f;

  for (int64_t pos = begin; pos < end; ++pos) {
    const int step = static_cast<int>((pos - begin) % stages);
    const int64_t ahead = pos + stages - 1;
    if (ahead < end) load(ahead, static_cast<int>((ahead - begin) % stages));
    copy_commit();
    copy_wait<stages - 1>(); // this step's group has landed; the later ones may still be in flight
    __syncthreads();         // and every thread's part of K with it
    typename M::score_frag a;
#pragma unroll
    for (int kk = 0; kk < tile_rows / 16; ++kk) {
      const uint4 c = *reinterpret_cast<const uint4*>(sds(step) + 8 * M::frag_chunk(row0, kk));
      a.x[kk][0] = c.x, a.x[kk][1] = c.y, a.x[kk][2] = c.z, a.x[kk][3] = c.w;
    }
    with_step_width<Narrow>(count.valid(s.at(pos)),
                            [&](auto width) { M::template nn_frags<decltype(width)::value>(dq, a, sk(step)); });
    __syncthreads(); // every warp has read K before a later step's copy refills this stage
  }

  float* f32 = p.dq_f32 != nullptr ? p.dq_f32 + (bh * s.rows_total() + s.token0(i)) * D : nullptr;
  with_out_rows<RasterOut, M>(p.dq, s, b, h, i, row0, q_valid, [&](const auto& rows) {
    if constexpr (Sched::joint) {
      store_band<E, D, M, Sched>(dq, p.scale, row0, q_valid, rows, f32, s.video_tile(i) ? p.fold_q : nullptr,
                                 bh * s.video_tiles() + i, s.padding_stored(i));
    } else {
      store_band<E, D, M, Sched>(dq, p.scale, row0, q_valid, rows, f32, p.fold_q, bh * s.tiles + i);
    }
  });
}

} // namespace detail
} // namespace gpu
} // namespace vsa
