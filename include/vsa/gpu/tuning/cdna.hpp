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
  // Forward, both passes: two stages where they fit; Q, read into registers first, borrows the second stage's K
  // slot, so that two stages of D = 128 fit in the 64 KiB LDS of a workgroup. CDNA places blocks by LDS alone:
  // the second launch bound (waves an execution unit to HIP) is 1, no constraint.
  t.sparse.stages = {2, 2};
  t.sparse.overlap = {false, false};
  t.sparse.ones = {false, false}; // the MFMA backend has no nn_sums
  t.sparse.ones_narrow = false;
  // Not taken on AMD until an AMD GPU has measured it.
  t.sparse.lazy_rescale = false;
  t.sparse.copy_engine = false;
  t.sparse.min_blocks = 1;
  t.coarse = t.sparse;
  t.forward_q_own_slot = false;
  // Backward: two stages where they fit in the LDS, for dq and for dk/dv.
  t.dq_stages = 2;
  t.dkdv_stages = {2, 2};
  t.dkdv_copy_engine = {false, false};
  // dq recomputes dS: the MFMA backend has no stored form of a score tile yet (stores_score_frags).
  t.dq_from_stored_ds = {false, false};
  // HIP reads a kernel's second launch bound as waves an execution unit, not blocks: a probe's MinBlocks is dropped.
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
