// The forward's loop for Hopper's sparse pass at head dim 64 (smem_plan::forward_overlap): the products of a step
// overlap the softmax of the next. attention_forward_kernel runs it where its K and V come through the copy engine
// (feeds.hpp); it needs the split products of the wgmma backend (nt_into, nn_async, wait_groups), so it is
// instantiated for that backend only.
#pragma once

#include "../../arch/smem_tile.hpp"
#include "../attention_schedule.hpp"

namespace vsa {
namespace gpu {
namespace detail {
namespace hopper {

// The steps begin .. end of the kernel's list; j and j_next their first two tiles and kv the first's valid rows,
// moved along as the kernel's one-step loop moves them; sk(stage) and sv(stage) the two stages' tiles, whose first
// copies the kernel has asked for; softmax and rescale the kernel's (attention_forward_kernel), o its output. st, the
// steps' S_n, is the caller's, and j, j_next and kv are references: where these are declared among the kernel's
// variables decides how the compiler orders and numbers their registers, and so placed the code is that of the loop
// when it was written in the kernel.
//
// Step n issues S_n = Q·K_nᵀ, then O += P_{n-1}·V_{n-1}, as two wgmma groups, and waits for the first only: the
// softmax of S_n runs while the tensor cores do P_{n-1}·V_{n-1}; then it waits for the second and rescales O by step
// n's alpha (O was in step n-1's frame, P_n is in step n's). K_n and V_{n-1} sit in opposite stages (stage = step
// parity), each on its own barrier, whose phase parity is (step / 2) mod 2 for the step that uses it. One block
// barrier a step: after it every warp is done with K_n and V_{n-1}, and thread 0 refills their stages with K_{n+2}
// and V_{n+1}, each a step or more ahead of use.
template <class M, int D, class Feed, class Sched, class Count, class StageK, class StageV, class Softmax,
          class Rescale>
__device__ __forceinline__ void forward_overlapped(Feed& feed, const Sched& s, const Count& count, int64_t begin,
                                                   int64_t end, int64_t& j, int64_t& j_next, int& kv, smem_tile<D> sq,
                                                   const StageK& sk, const StageV& sv, typename M::out_tile& o, int tid,
                                                   int nthreads, Softmax& softmax, Rescale& rescale,
                                                   typename M::score_tile& st) {
  constexpr int R = M::rows_per_lane;
  const int64_t steps = end - begin;
  typename M::prob_frag pf; // P_{n-1}: the A operand of the P·V group in flight
  float alpha[R];
  int64_t j2 = steps > 2 ? s.at(begin + 2) : -1;
  {
    typename M::score_tile st;
    feed.wait_k(0, 0u);
    M::nt_into(st, sq, sk(0));
    M::template wait_groups<0>(st.x);
    softmax(step_width<tile_rows>{}, st, kv, alpha); // o is still zero: no rescale
    M::pack(pf, st);
    __syncthreads(); // every warp's Q·K_0ᵀ has read stage 0's K
    if (tid == 0 && steps > 2) feed.load_k(sk(0), s.token0(j2), 0);
  }
  int kv_prev = kv;
  j = j_next; // j, j_next: the tiles of this step and the next
  j_next = j2;
  kv = count.valid(j);
  for (int64_t step = 1; step < steps; ++step) {
    const int64_t pos = begin + step;
    const int buf = static_cast<int>(step & 1), prev = buf ^ 1;
    const uint32_t phase = static_cast<uint32_t>(step >> 1) & 1u;
    const uint32_t prev_phase = static_cast<uint32_t>((step - 1) >> 1) & 1u;
    j2 = pos + 2 < end ? s.at(pos + 2) : -1;

    feed.wait_v(prev, prev_phase);
    feed.clear_rows(sv(prev), kv_prev, tid, nthreads); // V's padding rows: zero probability times NaN
    feed.wait_k(buf, phase);
    M::nt_into(st, sq, sk(buf));
    M::nn_async(o, pf, sv(prev));
    M::template wait_groups<1>(st.x);
    softmax(step_width<tile_rows>{}, st, kv, alpha);
    M::template wait_groups<0>(o.x);
    // P_n is rounded into P_{n-1}'s registers only now that the P·V group has read them: ptxas keeps the groups in
    // flight only if no other instruction writes a register a wgmma reads while its group runs.
    M::pin(pf);
    M::pack(pf, st);
    rescale(alpha);

    __syncthreads(); // every warp's products have read K_n and V_{n-1}
    if (tid == 0) {
      if (pos + 2 < end) feed.load_k(sk(buf), s.token0(j2), buf);
      if (pos + 1 < end) feed.load_v(sv(prev), s.token0(j_next), prev);
    }
    kv_prev = kv;
    j = j_next;
    j_next = j2;
    kv = count.valid(j);
  }
  // The last step's P·V.
  const int64_t last = steps - 1;
  feed.wait_v(static_cast<int>(last & 1), static_cast<uint32_t>(last >> 1) & 1u);
  feed.clear_rows(sv(static_cast<int>(last & 1)), kv_prev, tid, nthreads);
  M::nn_async(o, pf, sv(static_cast<int>(last & 1)));
  M::template wait_groups<0>(o.x);
  M::pin(pf);
}

} // namespace hopper
} // namespace detail
} // namespace gpu
} // namespace vsa
