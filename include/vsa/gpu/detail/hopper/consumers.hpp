// Pieces of the warp-specialized Hopper kernels (dkdv.hpp): a block of three warpgroups, two consumers and a
// producer whose first warp feeds a ring of shared-memory stages; a 64 × 64 score tile handed from consumer 0 to
// consumer 1 through shared memory; a consumer's loop that overlaps its two products across steps; and a
// loop-invariant tile as a product's A operand in registers.
#pragma once

#include "../attention_backward.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace hopper {

inline constexpr int consumer_threads = 128, block_threads = 3 * consumer_threads;
// Named barriers (0 is the block's __syncthreads): both consumers, consumer 0 alone, consumer 1 alone.
inline constexpr int consumers_barrier = 1, consumer0_barrier = 2, consumer1_barrier = 3;

// The bytes of score_handoff's two buffers, for the kernels' shared-memory plans on the host.
inline constexpr int score_handoff_bytes = 2 * 64 * 64 * 2;

#if VSA_WGMMA
// A score tile from consumer 0 to consumer 1, in fp16 whatever the element type (the tiles handed are
// probabilities, P ≤ 1: fp16 rounds them to 2^-11 relative, 2^-25 absolute below its normal range). Two buffers,
// by step parity, so that consumer 0 can run a step ahead. Each thread's 32 values go as four 16-byte chunks that
// the same thread of the other warpgroup reads (the lane layouts are the same): chunk c of thread t in buffer pb
// is data[(pb·4 + c)·128 + t].
struct score_handoff {
  uint4* data;
  uint64_t* full;  // [2], 128 arrivals: consumer 0 has written the buffer
  uint64_t* empty; // [2], 128 arrivals: consumer 1 has read it
  __device__ __forceinline__ void init() const {
    for (int x = 0; x < 2; ++x) {
      tma::barrier_init(&full[x], consumer_threads);
      tma::barrier_init(&empty[x], consumer_threads);
    }
  }
  // Consumer 0, step n: waits for consumer 1 to have read step n - 2's tile, then writes the thread's 16 words.
  __device__ __forceinline__ void put(int n, int wtid, const uint32_t (&w)[16]) const {
    const int pb = n & 1;
    tma::wait(&empty[pb], static_cast<uint32_t>(((n >> 1) & 1) ^ 1));
#pragma unroll
    for (int c = 0; c < 4; ++c)
      data[(pb * 4 + c) * consumer_threads + wtid] = make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]);
    tma::arrive(&full[pb]);
  }
  // Consumer 1, step n: waits for step n's tile and reads the thread's 16 words.
  __device__ __forceinline__ void take(int n, int wtid, uint32_t (&w)[16]) const {
    const int pb = n & 1;
    tma::wait(&full[pb], static_cast<uint32_t>((n >> 1) & 1));
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint4 v = data[(pb * 4 + c) * consumer_threads + wtid];
      w[4 * c] = v.x, w[4 * c + 1] = v.y, w[4 * c + 2] = v.z, w[4 * c + 3] = v.w;
    }
    tma::arrive(&empty[pb]);
  }
  // 32 probabilities in fp16, element e in half e mod 2 of word e / 2.
  __device__ __forceinline__ void put(int n, int wtid, const float (&x)[32]) const {
    uint32_t w[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) w[r] = fp16_type::pack(x[2 * r], x[2 * r + 1]);
    put(n, wtid, w);
  }
  // Probability e of the 16 words take gave: unpacked where it is used, so that the tile stays 16 registers.
  __device__ __forceinline__ static float at(const uint32_t (&w)[16], int e) {
    return fp16_type::to_float(static_cast<uint16_t>(e % 2 ? w[e / 2] >> 16 : w[e / 2] & 0xffffu));
  }
};

// The warp's 16 rows (16·warp of the warpgroup) of a tile that stays for the whole loop, as the A operand of a
// product over the head dim from registers. Read through a descriptor instead, each of that product's eight wgmma
// m64n64k16 reads 2 KiB of A besides B's 2 KiB, and shared memory delivers 128 bytes a clock, just what the tensor
// cores take at that shape (bench/NOTES.md, v18: dk/dv 3.66-3.84 ms against 4.12-4.15 with K and V read from
// shared memory).
template <class M, int D> __device__ __forceinline__ typename M::band_frag band_of(smem_tile<D> t, int row0) {
  typename M::row_frag rows;
  M::load_rows(rows, t, row0);
  typename M::band_frag band;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) band.x[ks][r] = rows.x[ks][r];
  return band;
}

// A consumer's loop over the steps of `it` (done(), next()), stage n mod Stages of the ring for step n. Step n's
// first product (first(buf): into x) is issued together with step n-1's second (second(buf): into acc, from a), and
// only the first is waited for before step(n, buf) turns x into the second product's operand, so that the step's
// element-wise work runs under the previous second product; a is then x rounded to the element type. Each thread
// arrives on a stage's empty barrier once its second product over the stage is complete (anything else it read
// there was read before): one arrival a warpgroup would order the other threads' reads only through the products'
// warpgroup-wide issue, which is more than a race detector (and the memory model) can see.
// pack() forms a from x (M::pack, or a form of it that also zeroes rows). issued() runs after each step's first
// product is issued and before the second, which reads a: a is complete and not yet an operand of a product in flight
// (the registers of an unfinished wgmma's A operand may not be read), so issued() may read it, under the first product.
template <class M, int Stages, class It, class First, class Second, class Step, class Pack, class Issued>
__device__ __forceinline__ void overlapped_steps(It& it, uint64_t* full, uint64_t* empty, typename M::score_tile& x,
                                                 typename M::prob_frag& a, typename M::out_tile& acc, First first,
                                                 Second second, Step step, Pack pack, Issued issued) {
  if (it.done()) return;
  tma::wait(&full[0], 0u);
  first(0);
  M::template wait_first<0, 64>(x);
  step(0, 0);
  pack();
  int prev = 0, n = 1;
  for (it.next(); !it.done(); it.next(), ++n) {
    const int buf = n % Stages;
    tma::wait(&full[buf], static_cast<uint32_t>((n / Stages) & 1));
    first(buf);
    issued();
    second(prev);
    M::template wait_first<1, 64>(x);
    step(n, buf);
    M::template wait_groups<0>(acc.x);
    tma::arrive(&empty[prev]);
    M::pin(a);
    pack();
    prev = buf;
  }
  issued();
  second(prev);
  M::template wait_groups<0>(acc.x);
  M::pin(a);
  tma::arrive(&empty[prev]);
}
#endif

} // namespace hopper
} // namespace detail
} // namespace gpu
} // namespace vsa
