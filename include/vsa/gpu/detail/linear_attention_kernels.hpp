// Kernels of the linear-attention branch. Per (batch, kv head) the sequence reduces to a D × D state
// KV = Σ_j φ(k_j) v_jᵀ and a D-vector z = Σ_j φ(k_j); every query then reads o_i = φ(q_i)ᵀKV / (φ(q_i)·z + eps).
//
// Forward, three launches:
//   state         one block per (slice of the sequence, batch, kv head): partial KV, z and Σ v over its
//                 slice, into fp32 workspace records. One warp per 16 rows (d1) of KV: the warp reads the
//                 transposed φ(K) band out of shared memory into a score tile and multiplies it by the V tile
//                 (on Hopper each warpgroup reads its 64 rows of φ(K)ᵀ through a transposed wgmma operand).
//   state_reduce  adds the records of every slice in slice order (so the result never depends on timing) and
//                 stores the state in the form the matrix cores read (below).
//   apply         one block per (slice, batch, q head), one warp per 16 query rows: φ(Q) in registers, one
//                 16 × D × D product per 64 tokens, the state staying in shared memory for the whole slice.
// Backward, four more (after state and state_reduce): query_grad (dq, and per-slice partial dKV, dz from the
// transposed φ(Q) band times dO), grad_reduce (over slices and over the q heads of each group, in a fixed
// order), key_grad (dk, dv). No atomics anywhere: every sum has one owner and one order.
//
// Matrix layer: attention_mma (arch/matrix.hpp), i.e. the wgmma backend in device code for sm_90a and
// warp_mma elsewhere; both give warp w rows 16w … of a 64-row tile in the same element map, so the band
// code (linear/common.hpp) serves both. Launch shapes are taken from warp_mma on the host and the device alike.
//
// Stored form of the state, chosen so that no 16-bit operand can overflow or lose its range, whatever the
// sequence length or the magnitude of v (fp16 included):
//   m = mean of v over the valid tokens; KV̄ = KV − z mᵀ = Σ_j φ(k_j)(v_j − m)ᵀ;
//   σ[d1] = max_d2 |KV̄[d1, d2]|; KVn = KV̄ / σ (rows in [−1, 1]), rounded to the element type.
//   o_i = (φ(q_i)·KV̄ + (φ(q_i)·z) m) / den_i, and φ(q_i)·KV̄ = β_i Σ_d1 P̂[i, d1] KVn[d1, :] with
//   P[i, d1] = φ(q_i)[d1] σ[d1] / den_i and P̂ = P / β_i, β_i = max_d1 P[i, d1] (so P̂ is in [0, 1]).
// Centering on m also keeps the backward accurate when v has a large common mean: the gradient terms
// Σ_j φ(k_j)[d1] dO·(v_j − o_i) are formed from the centered state, never as a difference of two large sums.
//
// One kernel a file under linear/, included here in the order they build on each other:
//   common.hpp             macros, constants, records, band layout, sequence, pack / unpack, block_max, row bands
//   features.hpp           the feature map φ and its derivative
//   state.hpp              state_kernel
//   state_reduce.hpp       state_reduce_kernel
//   apply.hpp              apply_kernel
//   query_grad_common.hpp  what both bodies of the query gradient share
//   query_grad.hpp         query_grad_kernel
//   grad_reduce.hpp        grad_reduce_kernel
//   key_grad_common.hpp    what both loops of the key gradient share
//   key_grad.hpp           key_grad_kernel
// Their Hopper-only code (the copy engine, wgmma's asynchronous products) sits with the attention kernels' under
// hopper/, each file included by the kernel that uses it; the kernels choose it by type or by if constexpr on
// layer_tn, never by a preprocessor branch of their own:
//   hopper/linear_copies.hpp      the copy-engine feeds of state_kernel and apply_kernel (copy_tile_feed elsewhere)
//   hopper/linear_query_grad.hpp  query_grad_tma, query_grad_kernel's loop through the copy engine
//   hopper/linear_key_grad.hpp    key_grad_tma, key_grad_kernel's loop through the copy engine
#pragma once

#include "linear/common.hpp"
#include "linear/features.hpp"
#include "linear/state.hpp"
#include "linear/state_reduce.hpp"
#include "linear/apply.hpp"
#include "linear/query_grad_common.hpp"
#include "linear/query_grad.hpp"
#include "linear/grad_reduce.hpp"
#include "linear/key_grad_common.hpp"
#include "linear/key_grad.hpp"
