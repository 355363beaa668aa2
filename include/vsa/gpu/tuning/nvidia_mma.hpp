// The tuning table of NVIDIA code before Hopper: the mma.sync backend (sm_80, sm_86, sm_89; an sm_90 build without
// the architecture-specific features takes Hopper's table where a kernel asks hopper_code, this one where it asks
// layer_tn). Hopper's table (hopper.hpp) starts from this one and changes what Hopper measured otherwise.
#pragma once

#include "table.hpp"

namespace vsa {
namespace gpu {
namespace tuning {

constexpr table nvidia_mma_table() {
  table t{};

  // ---- attention ----
  // Forward, both passes: two copy stages where they fit (while tile j is used, tile j+1 streams into the other
  // stage); Q, read into registers first, borrows the second stage's K slot (64 KiB instead of 80 for D = 128).
  // Three blocks an SM, the most the shared memory of two stages allows on sm_80 and sm_90; the second launch
  // bound caps registers at 65536 / (128 threads · 3).
  t.sparse.stages = {2, 2};
  t.sparse.overlap = {false, false};
  // P's row sums from the matrix cores, a B fragment of ones in registers (one m16n8k16 a 16-wide k step), in both
  // loops; and the rows' maxima moved only when one grows by more than 2^8, so that most steps skip o's rescale:
  // together 1.04-1.05x at D = 128 and 1.03-1.04x at D = 64 on the H200 (sm_80 build; bench/NOTES.md, v21).
  t.sparse.ones = {true, true};
  t.sparse.ones_narrow = true;
  t.sparse.lazy_rescale = true;
  t.sparse.copy_engine = false;
  // Two bands a warp at D = 64 (two warps a block; attention_forward.hpp): the products of a step are half those of
  // D = 128 while its softmax is as long, and with one band a warp the loop waits on the exponentials' chain. Two
  // chains a warp measured 1.11x faster on hd64-32k (sm_80 build on an H100: 1.77 -> 1.58 ms, 90% of
  // FlashAttention-2's forward; bench/NOTES.md, v30), at four blocks of two warps an SM (two warps a scheduler, so up
  // to 255 registers a thread, which two bands take: 241-253; at three warps a scheduler ptxas allows 168 and spilled
  // 300 bytes). The joint pass's failure seen once on it (v30) was not reproduced with its code compiled by nvcc
  // rather than by the driver: the suite's joint, packed, attention, accuracy, errors and 64-bit cases pass on it,
  // memcheck clean (v34). D = 128 keeps one band: three blocks of four warps an SM (at D = 64 one band ran best at
  // three too: four, registers capped at 128, measured 2.01-2.02 ms against 1.96-1.97, v21).
  t.sparse.bands = {2, 1};
  t.sparse.min_blocks = {4, 3};
  t.coarse = t.sparse;
  t.coarse.bands = {1, 1};
  t.coarse.min_blocks = {3, 3};
  t.forward_q_own_slot = false;
  // Backward: two stages where they fit, for dq and for dk/dv; no copy engine.
  t.dq_stages = 2;
  t.dkdv_stages = {2, 2};
  t.dkdv_copy_engine = {false, false};
  // dq from the dS that dk/dv stores: five products a pair instead of seven (bench/NOTES.md, v22).
  t.dq_from_stored_ds = {true, true};
  t.joint_dq_from_stored_ds = {true, true};
  // The backward's portable kernels take their MinBlocks template argument (a probe's; 0 by default, no bound) as
  // their second launch bound. With none, ptxas picks their registers itself (Hopper, D = 64: 128 for dq, 165 for
  // dk/dv: four and three blocks an SM); a bound of one block would let it take up to 255 (152 and 203), and caps
  // of five dq or four dk/dv blocks spill and measured 1.5x and 1.8x slower on the H200 (bench/NOTES.md, v19).
  t.min_blocks_bound = true;

  // ---- linear attention ----
  // Copies into shared memory are asynchronous (cp.async): a second stage lets the next tile stream in while the
  // current one is used.
  t.copy_stages = 2;
  t.state_stages = 2;
  // The blocks an SM the state and key-gradient kernels are compiled for; the notes record no measurement of other
  // values.
  t.state_blocks = {3, 2};
  t.key_grad_blocks = {3, 2};
  // apply: two blocks at D = 128 (Hopper's three were measured there only) and copy_stages Q stages: the ring of
  // Q/O tiles is the copy engine's (bench/NOTES-linear.md, "apply: three blocks an SM instead of two").
  t.apply_blocks = {4, 2};
  t.apply_ring = 0;
  // The query gradient: one block at D = 128, where its registers take all of an SM's for 256 threads (255 a
  // thread), two at D = 64 (bench/NOTES-linear.md, "Registers and shared memory").
  t.query_grad_blocks = {2, 1};
  return t;
}

} // namespace tuning
} // namespace gpu
} // namespace vsa
