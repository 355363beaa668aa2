// dk and dv of the sparse pass on Hopper (sm_90a, head dim 128), warp-specialized: three warpgroups a block, one
// block a key tile, walking the tile's (query head, query tile) pairs as the portable attention_dkdv_kernel does.
//
//   producer   its first warps (dkdv_tuning::producer_warps, pairs in turn), once both consumers have freed a stage
//              of the ring (empty barrier), ask the copy engine for the next pair's Q and dO, read the pair's row
//              statistics (log-sum-exp, delta) and the query tile's valid count into the stage, and arrive on the
//              stage's full barrier; the warpgroup first gives most of its registers to the consumers (setmaxnreg);
//   consumer 0 owns dV: Sᵀ = K·Qᵀ, P = exp2(Sᵀ·scale·log2 e − lse), hands P to consumer 1 in fp16, dV += Pᵀ·dO;
//   consumer 1 owns dK: dPᵀ = V·dOᵀ, dS = P ∘ (dPᵀ − delta), dK += dSᵀ·Q.
//
// The portable kernel runs all four products and both softmax steps of a pair in one warpgroup, one after the
// other, and holds dK and dV (128 registers a thread) at once, two blocks an SM. Here each consumer holds one
// accumulator and runs two products, the first with the block's own tile (K or V) from registers, each pair's
// first product issued with the previous pair's second (consumers.hpp); the loads that fed each step (list entry,
// statistics, the copy's issue) sit on a warp of their own. On the H200 (wan2.1-1.3b-480p, uniform lists):
// 3.66-3.84 ms against 4.72-4.86 for the portable kernel in the same runs (bench/NOTES.md, v18).
//
// P goes through shared memory in fp16 whatever the element type: P ≤ 1, so fp16 rounds it to 2^-11 relative
// (2^-25 absolute below its normal range), no coarser than the 16-bit rounding dS gets anyway for its product. dV's
// product takes P from consumer 0's registers rounded to the element type, exactly as the portable kernel's:
// dV is bitwise that kernel's, dK within rounding of it. Each output element is summed by one thread in a
// fixed order, so results are bitwise reproducible.
//
// Padding rows of a partial query tile: Q and dO land whole (a box is a whole tile); the consumers mask their
// scores by the query's valid count, and each zeroes the padding rows of the tile its second product reads
// (dO for dV, Q for dK) before that product. The other consumer's first product may read those rows while they
// are being zeroed (consumer 0 zeroes dO's with nothing ordering it against consumer 1's dPᵀ): what it reads
// there lands only in the masked columns, which the masks replace by a select, never a product, so the old
// value, a zero or a NaN all give the same result. Keep the masks selects. A partial key tile is zero-filled by
// copy_tile, and its padding rows of dK and dV are not stored.
#pragma once

#include "consumers.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace hopper {

// The kernel's tuning: the ring of Q/dO stages, the registers a thread setmaxnreg leaves the producer warpgroup
// and gives each consumer (their sum over the block within the 168 a thread that the launch bounds grant 384
// threads), and the producer warps that fill the ring. Stages measured on the H200 (dk/dv alone, wan2.1;
// bench/NOTES.md): before the products overlapped (v17) 3 stages 4.48 ms, 4 stages 4.09-4.11, 5 stages 4.34-4.40;
// with the overlap (v19, two runs) 3 stages 4.02-4.31, 4 stages 3.68-4.03, 5 stages 3.78-3.92. Producer warps (v20,
// one run, two rounds): 1 warp 4.06-4.10 ms, 2 warps 3.92-3.97, 4 warps 3.95-3.99: each pair's list entry, then its
// statistics, are two dependent L2 round trips, which one warp runs one pair after another. A type, so that a probe
// can time others.
struct dkdv_tuning {
  static constexpr int stages = 4, producer_regs = 40, consumer_regs = 232, producer_warps = 2;
};

// What the producer leaves in a stage beside its tiles.
struct dkdv_stage_info {
  float lse2[64], delta[64]; // the 64 rows of the pair's query tile (rows past `valid` are masked by the consumers)
  int valid;
  int pad[3];
};

template <int D, class T = dkdv_tuning> struct dkdv_plan {
  static constexpr int tile = smem_tile<D>::bytes;
  static constexpr int bytes = (2 + 2 * T::stages) * tile + score_handoff_bytes +
                               T::stages * static_cast<int>(sizeof(dkdv_stage_info)) + smem_slack;
  static_assert(bytes + 1024 <= 227 * 1024, "Hopper grants a block 227 KiB of shared memory (static included)");
  static_assert(T::producer_regs + 2 * T::consumer_regs <= 3 * (65536 / block_threads / 8 * 8),
                "setmaxnreg cannot give the consumers more registers than the block holds");
};

// The (query head, list position) pairs of one key tile, in the portable kernel's order: the lists of every head
// of the kv head's group, in turn.
template <class Sched> struct dkdv_pairs {
  const backward_params& p;
  const Sched& s;
  int64_t b, hk, j;
  int g;
  int64_t pos, end;
  __device__ __forceinline__ void locate() { s.range(b * p.q_heads + hk * p.group + g, j, pos, end); }
  __device__ __forceinline__ void first() {
    g = 0;
    locate();
    while (pos == end && ++g < p.group) locate();
  }
  __device__ __forceinline__ void next() {
    ++pos;
    while (pos == end && ++g < p.group) locate();
  }
  __device__ __forceinline__ bool done() const { return g >= p.group; }
};

// The block's shared tiles: its key tile's K and V, then the ring's stages of Q and dO.
template <int D> struct dkdv_ring {
  uint16_t* base;
  __device__ __forceinline__ smem_tile<D> k() const { return {base}; }
  __device__ __forceinline__ smem_tile<D> v() const { return {base + 64 * D}; }
  __device__ __forceinline__ smem_tile<D> q(int buf) const { return {base + (2 + 2 * buf) * 64 * D}; }
  __device__ __forceinline__ smem_tile<D> d_o(int buf) const { return {base + (3 + 2 * buf) * 64 * D}; }
  // What follows the tiles of `stages` stages.
  __device__ __forceinline__ void* end(int stages) const { return base + (2 + 2 * stages) * 64 * D; }
};

#if VSA_WGMMA
// Producer warp `warp` of Warps: pair n of `it` into stage n mod Stages of the ring, for the n with n mod Warps =
// warp (so that each stage has one warp, and the warps' L2 round trips overlap), once that stage's earlier pair has
// been read (its empty barrier): lane 0 asks the copy engine for Q and dO, every lane reads two rows' statistics
// into the stage's info, lane 0 the valid count, and each lane arrives on the stage's full barrier after its stores.
template <int D, int Stages, int Warps, class Sched>
__device__ __forceinline__ void produce_pairs(dkdv_pairs<Sched>& it, const backward_params& p, const Sched& s,
                                              dkdv_ring<D> ring, uint64_t* full, uint64_t* empty, dkdv_stage_info* info,
                                              int lane, int warp) {
  static_assert(Stages % Warps == 0, "each stage filled by one warp");
  const int64_t rows_total = s.rows_total(), b = it.b, hk = it.hk;
  const auto counter = s.valid_counter();
  for (int n = 0; !it.done(); it.next(), ++n) { // under 2^31 pairs: the launcher's condition
    if (n % Warps != warp) continue;
    const int buf = n % Stages, round = n / Stages;
    if (round > 0) tma::wait(&empty[buf], static_cast<uint32_t>((round - 1) & 1));
    const int64_t h = hk * p.group + it.g, i = s.at(it.pos), first = s.token0(i);
    const int64_t row = (b * p.q_heads + h) * rows_total + first;
    if (lane == 0) tma::tile_pair{&full[buf], 0u}.load<D>(ring.q(buf), &p.q_map, ring.d_o(buf), &p.do_map, first, h, b);
    // Every row of a video tile is a row of lse and delta, padding included; an extra tokens' tile has its valid ones.
    const int qv = counter.valid(i);
    const bool live0 = i >= 0 && (s.padding_stored(i) || lane < qv),
               live1 = i >= 0 && (s.padding_stored(i) || 32 + lane < qv);
    const float l0 = live0 ? p.lse[row + lane] : 0.f, l1 = live1 ? p.lse[row + 32 + lane] : 0.f;
    const float d0 = live0 ? p.delta[row + lane] : 0.f, d1 = live1 ? p.delta[row + 32 + lane] : 0.f;
    info[buf].lse2[lane] = l0 * log2_e;
    info[buf].lse2[32 + lane] = l1 * log2_e;
    info[buf].delta[lane] = d0;
    info[buf].delta[32 + lane] = d1;
    if (lane == 0) info[buf].valid = qv;
    tma::arrive(&full[buf]); // releases this lane's stores
  }
}
#endif

// Launched with block_threads threads and dkdv_plan<D, T>::bytes of shared memory, a block per entry of p.order from
// p.item0; only where the kernel runs as sm_90a code and the tiles' maps encode (backward_params::tma;
// attention_launch.hpp). The launcher tells the compiled body from the empty one of other builds by the barriers'
// static shared memory. StoreDs: consumer 1 also stores each pair's dS for dq (attention_dq_stored.hpp). Sched: the
// sparse schedule, or the joint one (its extra tokens' tiles: joint_attention.hpp; a packed batch's tiles).
template <class E, int D, class T = dkdv_tuning, bool StoreDs = false, class Sched = sparse_schedule>
__global__ void __launch_bounds__(block_threads, 1)
    hopper_dkdv_kernel(const VSA_GRID_CONSTANT backward_params p, const VSA_GRID_CONSTANT Sched s) {
  static_assert(D == 128, "the split pays at head dim 128; D = 64 keeps the portable kernel (bench/NOTES.md, v19)");
#if VSA_WGMMA
  using M = attention_mma<E, D>;
  constexpr int stages = T::stages;
  extern __shared__ uint4 smem_raw[];
  uint16_t* sm = aligned_smem(smem_raw);
  const dkdv_ring<D> ring{sm};
  const smem_tile<D> sk = ring.k(), sv = ring.v();
  const auto sq = [&](int buf) { return ring.q(buf); };
  const auto sdo = [&](int buf) { return ring.d_o(buf); };
  static_assert(M::score_elems == 32, "P's hand-over: 32 values a consumer thread");
  __shared__ __align__(8) uint64_t full[stages], empty[stages], p_full[2], p_empty[2];
  const score_handoff hand{static_cast<uint4*>(ring.end(stages)), p_full, p_empty};
  dkdv_stage_info* info = reinterpret_cast<dkdv_stage_info*>(reinterpret_cast<char*>(hand.data) + score_handoff_bytes);

  const int64_t item = p.order[p.item0 + blockIdx.x];
  const int64_t j = item % s.tiles, hk = (item / s.tiles) % p.kv_heads, b = item / s.tiles / p.kv_heads;
  // The warpgroup index through a shuffle, so that ptxas knows it is the same across each warp: branches on it are
  // then not divergent, and the wgmma chains inside them stay pipelined (otherwise C7518: every wgmma serialized).
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), wtid = tid % 128, row0 = (wtid / 32) * 16;
  const int kv = s.valid(j);
  const int64_t rows_total = s.rows_total();
  if (tid == 0) {
    for (int x = 0; x < stages; ++x) {
      tma::barrier_init(&full[x], 1 + 32); // the copy's announcement, then each producer lane after its stores
      tma::barrier_init(&empty[x], 256);   // each consumer thread after its reads of the stage
    }
    hand.init();
  }
  __syncthreads();

  dkdv_pairs<Sched> it{p, s, b, hk, j, 0, 0, 0};
  it.first();
  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(T::producer_regs) : "memory");
    if (wtid < 32 * T::producer_warps)
      produce_pairs<D, stages, T::producer_warps>(it, p, s, ring, full, empty, info, wtid % 32, wtid / 32);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(T::consumer_regs) : "memory");

  // K and V of the block's key tile (padding rows zero-filled), by both consumers.
  copy_tile(sk, p.k.at(b, hk, s.token0(j)), p.k.token, kv, tid, 256);
  copy_tile(sv, p.v.at(b, hk, s.token0(j)), p.v.token, kv, tid, 256);
  copy_commit();
  copy_wait<0>();
  tma::named_sync(consumers_barrier, 256);

  typename M::out_tile acc; // dV in consumer 0, dK in consumer 1
#pragma unroll
  for (int e = 0; e < M::out_elems; ++e) acc.x[e] = 0.f;

  // Each consumer overlaps its two products across pairs (overlapped_steps): pair n's first product (Sᵀ or dPᵀ)
  // goes with pair n-1's second (dV or dK), and the softmax step of pair n runs under the latter. x holds pair n's
  // scores, then P or dS; a holds pair n-1's P or dS rounded to E, the second product's A operand.
  typename M::score_tile x;
  typename M::prob_frag a;
  const auto live = [&](int e, int qv) { return M::elem_col(e) < qv; };
  // Consumer 0, pair n in stage buf, x = Sᵀ: P, handed to consumer 1; dO's padding rows zeroed for dV's product.
  const auto make_p = [&](int n, int buf) {
    const int qv = info[buf].valid;
    const float* lse2 = info[buf].lse2;
#pragma unroll
    for (int e = 0; e < M::score_elems; ++e)
      x.x[e] = live(e, qv) ? fast_exp2(x.x[e] * p.scale_log2 - lse2[M::elem_col(e)]) : 0.f;
    hand.put(n, wtid, x.x);
    tma::clear_rows_then<D>(sdo(buf), qv, wtid, 128, tile_rows, [] { tma::named_sync(consumer0_barrier, 128); });
  };
  // Consumer 1, pair n in stage buf, x = dPᵀ: dSᵀ from consumer 0's P; Q's padding rows zeroed for dK's product.
  // StoreDs: dSᵀ is rounded once, into dK's operand a with its padding keys zeroed (pack_rows: they reach only dK's
  // padding rows, which are not stored), and a is stored for dq under the next step's first product, before dK's
  // product that reads it is issued (overlapped_steps' issued), the slot of its pair kept in ds_slot meanwhile.
  int64_t ds_slot = 0;
  const auto make_ds = [&](int n, int buf) {
    const int qv = info[buf].valid;
    const float* delta = info[buf].delta;
    uint32_t pw[M::score_elems / 2];
    hand.take(n, wtid, pw);
#pragma unroll
    for (int e = 0; e < M::score_elems; ++e)
      x.x[e] = live(e, qv) ? score_handoff::at(pw, e) * (x.x[e] - delta[M::elem_col(e)]) : 0.f;
    if constexpr (StoreDs) ds_slot = s.ds_slot(it.pos, b * p.q_heads + hk * p.group + it.g, p.ds_head0); // pair n
    tma::clear_rows_then<D>(sq(buf), qv, wtid, 128, tile_rows, [] { tma::named_sync(consumer1_barrier, 128); });
  };
  // The block's own tile, K for consumer 0 and V for consumer 1, is the first product's A operand (band_of).
  typename M::band_frag band = band_of<M, D>(wg == 0 ? sk : sv, row0);
  if (wg == 0)
    overlapped_steps<M, stages>(
        it, full, empty, x, a, acc, [&](int buf) { M::nt_async(x, band, sq(buf)); },
        [&](int buf) { M::nn_async(acc, a, sdo(buf)); }, make_p, [&] { M::pack(a, x); }, [] {});
  else
    overlapped_steps<M, stages>(
        it, full, empty, x, a, acc, [&](int buf) { M::nt_async(x, band, sdo(buf)); },
        [&](int buf) { M::nn_async(acc, a, sq(buf)); }, make_ds,
        [&] {
          if constexpr (StoreDs)
            M::pack_rows(a, x, row0, kv);
          else
            M::pack(a, x);
        },
        [&] {
          if constexpr (StoreDs) M::store_transposed(p.ds + ds_slot * (tile_rows * tile_rows), a, row0);
        });

  const int64_t bhk = b * p.kv_heads + hk, fold_row = bhk * s.video_tiles() + j;
  const bool video = s.video_tile(j); // the extra tokens' tiles have no folds
  if (wg == 0)
    with_out_rows<M>(p.dv, p.raster_out, s, b, hk, j, row0, kv, [&](const auto& rows) {
      store_band<E, D, M, Sched>(acc, 1.f, row0, kv, rows, nullptr, video ? p.fold_v : nullptr, fold_row,
                                 s.padding_stored(j));
    });
  else
    with_out_rows<M>(p.dk, p.raster_out, s, b, hk, j, row0, kv, [&](const auto& rows) {
      store_band<E, D, M, Sched>(acc, p.scale, row0, kv, rows, nullptr, video ? p.fold_k : nullptr, fold_row,
                                 s.padding_stored(j));
    });
#else
  (void)p, (void)s;
  device_trap(); // never launched: its launcher keys on the Hopper body's static shared memory
#endif
}

} // namespace hopper
} // namespace detail
} // namespace gpu
} // namespace vsa
