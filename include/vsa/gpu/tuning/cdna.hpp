// The tuning table of AMD code: the MFMA backend of CDNA (gfx90a, gfx940/942). No AMD GPU has run these kernels
// yet (bench/NOTES-amd.md): the entries follow from the compiler's output and LDS (bench/amd-resources.md), not
// from timings.
#pragma once

#include "table.hpp"

namespace vsa {
namespace gpu {
namespace tuning {

constexpr table cdna_table() {
  table t{};

  // ---- attention ----
  // The attention kernels' blocks are four wave64s, one a SIMD, so blocks a CU are waves a SIMD; a second one needs
  // at most 32 KiB of LDS a block and 256 VGPR + AGPR a lane. The copy into LDS is a plain load and store through
  // registers: a second stage overlaps it with the wave's own products only as far as the compiler moves them
  // between the loads and the stores, a second block's wave overlaps it from outside. The issue model
  // (bench/amd-resources.md) bounds the matrix pipe's use higher at two waves than at one (bench/NOTES-amd.md, "Two
  // waves a SIMD"); no AMD GPU has measured either.
  // Forward, sparse pass: two stages at D = 64 (32 KiB, Q in the second stage's K slot); one at D = 128, Q through
  // V's slot before the first V (K + V = 32 KiB instead of 64). The second launch bound, waves an execution unit to
  // HIP, asks for the two blocks the LDS then allows: it caps the registers at 256, which the narrow variants at
  // D = 128 need (244-280 without it).
  t.sparse.stages = {2, 1};
  t.sparse.overlap = {false, false};
  t.sparse.ones = {false, false}; // the MFMA backend has no nn_sums
  t.sparse.ones_narrow = false;
  // Not taken on AMD until an AMD GPU has measured it.
  t.sparse.lazy_rescale = false;
  t.sparse.copy_engine = false;
  t.sparse.bands = {1, 1};
  t.sparse.min_blocks = {2, 2};
  // The coarse pass (a grid under one wave of the GPU: each block's chain of steps matters, not occupancy) keeps
  // two stages at both head dims and no register cap.
  t.coarse = t.sparse;
  t.coarse.stages = {2, 2};
  t.coarse.min_blocks = {1, 1};
  t.forward_q_own_slot = false;
  // Backward, dq: one stage of K and V (at D = 128 all that fits): with Q and dO, 32 KiB a block at D = 64 instead
  // of 49, two blocks a CU, and the bound asks for two (172-192 registers, no spill). At D = 128, 64 KiB and 284-317
  // registers: one block, no bound.
  t.dq_stages = 1;
  t.dq_blocks = {2, 0};
  // dk/dv: at D = 64 one stage of Q and dO, the row statistics read from global memory, 32 KiB a block, and the bound
  // of two blocks (196 registers without it, under the 256 of two waves). The same plan had spilled VGPRs inside the
  // loop (bf16 11, fp16 7-8) while the kernel took 292-300 registers, before the operand addresses were taken once a
  // step (bench/NOTES-amd.md). At D = 128 two stages where they fit, the statistics in LDS: one block.
  t.dkdv_stages = {1, 2};
  t.dkdv_blocks = {2, 0};
  t.dkdv_copy_engine = {false, false};
  // dq recomputes dS: the MFMA backend has no stored form of a score tile yet (stores_score_frags).
  t.dq_from_stored_ds = {false, false};
  t.joint_dq_from_stored_ds = {false, false};
  // HIP reads a kernel's second launch bound as waves an execution unit, not blocks: a probe's MinBlocks is dropped,
  // dq takes dq_blocks (backward_min_blocks).
  t.min_blocks_bound = false;

  // ---- linear attention ----
  // The copy into shared memory is a plain load and store, which a second stage cannot hide: one stage.
  t.copy_stages = 1;
  t.state_stages = 1;
  // The linear kernels take no second launch bound on AMD (VSA_LINEAR_BOUNDS): 0.
  t.state_blocks = {0, 0};
  t.key_grad_blocks = {0, 0};
  t.apply_blocks = {0, 0};
  t.apply_ring = 0; // the ring is the copy engine's, and would not fit the 64 KiB at D = 128 either
  t.query_grad_blocks = {0, 0};
  return t;
}

} // namespace tuning
} // namespace gpu
} // namespace vsa
