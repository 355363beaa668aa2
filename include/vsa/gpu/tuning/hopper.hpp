// The tuning table of Hopper code: sm_90 and later where a kernel asks hopper_code (the attention kernels), the
// wgmma backend of sm_90a where it asks layer_tn (the linear-attention kernels); and the shared memory of a Hopper
// SM. It starts from the table of the NVIDIA parts before it (nvidia_mma.hpp) and sets what the H200 measured
// otherwise. The warp-specialized dk/dv kernel of the sparse pass at D = 128 has a tuning type of its own, beside
// it: hopper::dkdv_tuning (detail/hopper/dkdv.hpp), which a probe may replace.
#pragma once

#include "nvidia_mma.hpp"

// The build option that set the query gradient's blocks an SM on Hopper (bench/NOTES-linear.md) is the table's
// query_grad_blocks entry.
#ifdef VSA_QUERY_GRAD_HOPPER_BLOCKS
#error "VSA_QUERY_GRAD_HOPPER_BLOCKS is gone: set query_grad_blocks in include/vsa/gpu/tuning/hopper.hpp"
#endif

namespace vsa {
namespace gpu {
namespace tuning {

// What a Hopper (sm_90) block may opt into; only shared memory that the host adds for Hopper code alone (a
// kernel's smem(true)) may go past max_block_smem (arch/smem_tile.hpp).
inline constexpr int hopper_max_block_smem = 227 * 1024;
// Shared memory of a Hopper SM, and what the system keeps of it for each resident block.
inline constexpr int hopper_sm_smem = 228 * 1024, hopper_block_reserve = 1024;

constexpr table hopper_table() {
  table t = nvidia_mma_table();

  // ---- attention ----
  // The wgmma backend reads Q from shared memory in every product, so Q keeps a slot of its own.
  t.forward_q_own_slot = true;
  // The sparse pass (a grid that fills the GPU) at D = 128 takes one stage: Q, K and V in 48 KiB, against 80 KiB
  // and two blocks an SM with two stages and Q's own slot; one stage measured 1.17x faster than two at three blocks
  // an SM (bench/NOTES.md, v4). With the copy engine (hopper_tma.hpp) K and V are each refilled right after the
  // product that reads them, so one stage still overlaps copy and work. At D = 64 its tiles are small (40 KiB for
  // two stages and Q; registers, not shared memory, bound its blocks an SM), and its matrix work per step is no more
  // than its exponentials, so the loop overlaps the products of one step with the softmax of the next, which needs
  // the next K while the current V is still read: two stages (hopper/forward_overlap.hpp; bench/NOTES.md, v10).
  t.sparse.stages = {2, 1};
  t.sparse.overlap = {true, false};
  // In the one-step loop (D = 128) P's row sums come from the matrix cores, from a block of ones after Q: 1 KiB
  // more, four blocks an SM still.
  t.sparse.ones = {false, true};
  // Not in the narrow loop, where ptxas spilled more at 128 registers and measured 0.5-1.5% slower (v15). The
  // coarse pass as before the other parts took them. The lazy rescale is not measured on Hopper: not taken.
  t.sparse.ones_narrow = false;
  t.sparse.lazy_rescale = false;
  t.coarse.ones = {false, false};
  t.coarse.ones_narrow = false;
  t.coarse.lazy_rescale = false;
  t.sparse.copy_engine = true;
  // Four blocks an SM: the one-stage pipeline's 48 KiB (D = 128) or 40 KiB (D = 64) let four sit on an SM's 227
  // KiB, so registers are capped at 128 (ptxas spills 16-92 bytes at D = 128, none at D = 64); measured against
  // three blocks (163 / 136 registers): 1.04-1.05x at D = 128, 1.10x at D = 64 (bench/NOTES.md, v15).
  t.sparse.bands = {1, 1}; // the wgmma backend's warpgroup owns all 64 rows
  t.sparse.min_blocks = {4, 4};
  // The coarse pass keeps the other parts' two stages, copy_tile and three blocks: there each block's chain of
  // steps matters, not occupancy (its grid is under one wave of the GPU), and one stage through the copy engine
  // measured slower (23.4 → 27.9 µs on wan2.1, bench/NOTES.md v8).
  // dq: one stage (64 KiB for D = 128: three blocks an SM instead of two), 1.07x faster (bench/NOTES.md, v4).
  t.dq_stages = 1;
  // The portable dk/dv (the sparse pass at D = 128 runs hopper/dkdv.hpp instead) takes two stages of Q and dO at
  // D = 128: its registers (254 a thread) hold it at two blocks an SM whatever its shared memory, so the second
  // stage costs no block, and the next pair's tiles stream in through the copy engine during the whole of a step:
  // 1.04x (bench/NOTES.md, v15). D = 64 keeps one stage and copy_tile: there the copy engine's path costs
  // registers (165 → 174) and with them the third block an SM, and capped at three blocks it measured slower
  // (bench/NOTES.md, v8); its second stage then goes through cp.async, which measured 1.04x slower (v15).
  t.dkdv_stages = {1, 2};
  t.dkdv_copy_engine = {false, true};
  // dq recomputes dS. From stored dS, its one product a pair on wgmma (bench/NOTES.md, v35; H100): at D = 128 on one
  // grid the sparse backward ran 2-3.4% faster (dk/dv's stores 3.69 -> 4.13 ms, dq 2.35 -> 1.64), for 3.9 GB more
  // workspace at wan2.1 (the slots), which a 2-3% gain does not pay for in a default that every training step
  // allocates; at D = 64 8% slower, on the joint schedule 2.6% (extra tokens) and 3-8.5% (packed batches) slower.
  // With dq's slots through the copy engine (v36, bench/tried/hopper-dq-stored-engine.patch) still 2-6% of the sparse
  // backward, 1.5% of the op's. To be measured on the H200, whose faster HBM moves the slots in 0.91 ms each way
  // against the H100's 1.28.
  t.dq_from_stored_ds = {false, false};
  t.joint_dq_from_stored_ds = {false, false};

  // ---- linear attention ----
  // state_kernel keeps three stages (96 KiB of tiles at D = 128, still two blocks an SM): the next two tiles stream
  // in while one is used, which the copy engine's latency needs at two blocks an SM (bench/NOTES-linear.md, "State
  // sums on the matrix cores, copies through the copy engine, reduce one row a block").
  t.state_stages = 3;
  // apply is bound by latency, not by bytes: at two blocks of four warps an SM a scheduler found an eligible warp
  // in about half of its cycles, and a ring of four Q/O tiles (three Q tiles in flight) was no faster than one Q
  // tile in flight. So at D = 128 it runs three blocks an SM (168 registers, no spill) with the ring of two that
  // three blocks' shared memory leaves room for (bench/NOTES-linear.md, "apply: three blocks an SM
  // instead of two"). D = 64: four blocks, a ring of four.
  t.apply_blocks = {4, 3};
  t.apply_ring = 4;
  // The query gradient at D = 128: two blocks would need registers capped at 128 a thread (256 threads), with the
  // 64 of the dKV accumulator live throughout; shared memory allows two (2 × ~101 KiB of the 228 KiB). Measured on
  // the H200 (wan2.1, bf16, elu+1): two blocks spill 64-112 B a thread inside the tile loop (165 MB of local loads
  // a call) and the backward took 534 µs; one block, no spills, 520 µs (bench/NOTES-linear.md, where the build
  // option VSA_QUERY_GRAD_HOPPER_BLOCKS chose it). So one. Two blocks leave no room for the copy engine's stages,
  // so that build keeps the cp.async loop (query_grad_shape::tma).
  t.query_grad_blocks = {2, 1};
  return t;
}

} // namespace tuning
} // namespace gpu
} // namespace vsa
