// The shape of a tuning table: the numbers by which the kernels of one architecture family use its machine (copy
// stages, blocks a multiprocessor, which variant of a loop), each measured or reasoned in the family's own file
// (hopper.hpp, nvidia_mma.hpp, cdna.hpp). tuning.hpp picks the table of the code a kernel runs as. What the
// numbers decide is in the plans that read them: smem_plan (arch/smem_tile.hpp) for the attention kernels, the
// *_shape structs and launch bounds of the linear-attention kernels (detail/linear/). Plain values, so that host
// code (shared-memory sizes) and device code (the kernels' constants and launch bounds) read the same table.
#pragma once

namespace vsa {
namespace gpu {
namespace tuning {

// A value for each head dim the kernels are built for, D = 64 and D = 128: value(D).
template <class T> struct per_dim {
  T d64, d128;
  constexpr T operator()(int d) const { return d <= 64 ? d64 : d128; }
};

// The attention forward of one pass: the sparse pass (a grid of many blocks) or the coarse one (smem_plan's
// few_blocks: a grid under one wave of the GPU).
struct forward_pass {
  per_dim<int> stages;   // (K, V) copy stages: 2 where two fit in shared memory, otherwise 1
  per_dim<bool> overlap; // the products of a step overlap the softmax of the next (hopper/forward_overlap.hpp)
  per_dim<bool> ones; // P's row sums on the matrix cores, P times ones (row_sums_by_product), in the loop of one width
  bool ones_narrow;   // ... and in the narrow loop (with_step_width) too
  // The rows' maxima move only when a row's grows past the one in use by more than lazy_margin (a factor of 2^8
  // in P), so that most steps skip the rescale of o (attention_forward.hpp).
  bool lazy_rescale;
  bool copy_engine; // K and V through the copy engine (hopper/feeds.hpp), where the loop allows it
  // 16-row bands of the block's 64 query rows a warp, 1 or 2 (2 only on the mma.sync backend): 4 / bands warps a
  // block, each running the chains of its bands side by side (attention_forward.hpp).
  per_dim<int> bands;
  per_dim<int> min_blocks; // the kernel's second launch bound (forward_min_blocks)
};

struct table {
  // ---- attention (smem_plan, attention_forward.hpp, attention_backward.hpp) ----
  forward_pass sparse, coarse;
  // The forward's Q keeps a slot of its own instead of borrowing one (smem_plan::forward_q_shares): the second
  // stage's K slot with two stages, V's slot with one.
  bool forward_q_own_slot;
  // The dq kernel's (K, V) stages (smem_plan::backward_stages) and the portable dk/dv's (Q, dO) stages: 2 where
  // they fit, otherwise 1.
  int dq_stages;
  per_dim<int> dkdv_stages;
  // The portable dk/dv's Q and dO through the copy engine (hopper/feeds.hpp).
  per_dim<bool> dkdv_copy_engine;
  // The sparse pass's dq from the dS that dk/dv stores (detail/attention_dq_stored.hpp), where the workspace holds
  // the slots and the backend can store them (stores_score_frags); otherwise dq recomputes S and dP. The one-grid
  // video pass, and the joint schedule's (extra tokens, packed batches): their slots and walks differ.
  per_dim<bool> dq_from_stored_ds, joint_dq_from_stored_ds;
  constexpr bool stored_ds(int d, bool joint_schedule) const {
    return joint_schedule ? joint_dq_from_stored_ds(d) : dq_from_stored_ds(d);
  }
  // The backward kernels' MinBlocks (a probe's) becomes their second launch bound (backward_min_blocks).
  bool min_blocks_bound;
  // Where it does not: the dq and the portable dk/dv kernels' second launch bounds, blocks a multiprocessor (0: no
  // bound). dk/dv's row statistics go to shared memory only where they leave room for dkdv_blocks blocks.
  per_dim<int> dq_blocks, dkdv_blocks;
  // ---- linear attention (detail/linear/) ----
  // Stages of an asynchronous copy into shared memory (the same in both tables of a platform), and
  // state_kernel's (K, V) stages where they fit (otherwise copy_stages).
  int copy_stages;
  int state_stages;
  // The blocks an SM each kernel is compiled for (its second launch bound, VSA_LINEAR_BOUNDS).
  per_dim<int> state_blocks, apply_blocks, query_grad_blocks, key_grad_blocks;
  // The largest ring of Q/O tiles apply_kernel may take (apply_shape::ring); 0: no ring, copy_stages Q stages.
  int apply_ring;

  constexpr forward_pass forward(bool few_blocks) const { return few_blocks ? coarse : sparse; }
};

} // namespace tuning
} // namespace gpu
} // namespace vsa
