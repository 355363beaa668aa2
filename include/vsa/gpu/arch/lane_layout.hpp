// Which lane holds which element, for both matrix-core backends, as plain constexpr arithmetic that the host
// can run too: nvidia_mma.hpp and amd_mfma.hpp take their index arithmetic from here, and
// tests/cpu/test_lane_layout.cpp checks it against a CPU model of each instruction.
//
// Element indices follow the kernels: a 16 × 64 score tile or 16 × D output tile of a warp is an array of
// fp32 elements e per lane; elem_row / elem_col place element e of lane `lane` in the tile.
#pragma once

#include "../../types.hpp"

namespace vsa {
namespace gpu {
namespace lane_layout {

// NVIDIA mma.sync m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), 32 lanes. With g = lane / 4
// and t = lane mod 4, register r of A (two 16-bit halves h) holds A(g + 8(r mod 2), 2t + h + 8⌊r/2⌋),
// register r of B holds B(2t + h + 8r, g), accumulator element i holds C(g + 8⌊i/2⌋, 2t + i mod 2).
namespace nvidia {

constexpr int lanes = 32;

VSA_HOST_DEVICE constexpr int a_row(int lane, int reg) { return (lane >> 2) + 8 * (reg & 1); }
VSA_HOST_DEVICE constexpr int a_col(int lane, int reg, int half) { return 2 * (lane & 3) + half + 8 * (reg >> 1); }
VSA_HOST_DEVICE constexpr int b_row(int lane, int reg, int half) { return 2 * (lane & 3) + half + 8 * reg; }
VSA_HOST_DEVICE constexpr int b_col(int lane) { return lane >> 2; }
VSA_HOST_DEVICE constexpr int c_row(int lane, int i) { return (lane >> 2) + 8 * (i >> 1); }
VSA_HOST_DEVICE constexpr int c_col(int lane, int i) { return 2 * (lane & 3) + (i & 1); }

// ldmatrix .x4: lanes 8m … 8m+7 give the addresses of rows 0 … 7 of matrix m, and register m of every lane
// receives matrix m: row lane / 4, columns 2(lane mod 4) + h; with .trans, row 2(lane mod 4) + h, column
// lane / 4.
VSA_HOST_DEVICE constexpr int ldmatrix_matrix(int lane) { return lane >> 3; }
VSA_HOST_DEVICE constexpr int ldmatrix_row(int lane) { return lane & 7; }
VSA_HOST_DEVICE constexpr int ldmatrix_frag_row(int lane, int half, bool trans) {
  return trans ? 2 * (lane & 3) + half : lane >> 2;
}
VSA_HOST_DEVICE constexpr int ldmatrix_frag_col(int lane, int half, bool trans) {
  return trans ? lane >> 2 : 2 * (lane & 3) + half;
}

// Addresses the layer gives ldmatrix: the row within a 16-row block and the 8-element chunk within a 16-wide
// k step. A operand (rows × k, row-major): matrix m covers rows 8(m mod 2) …, k 8⌊m/2⌋ …, so register m is
// A's register m. B operand of nt (tile rows = n, k along the row): matrix m covers n 8⌊m/2⌋ …, k 8(m mod 2)
// …, so registers 0, 1 are the B of the first n8 tile and 2, 3 that of the second. B operand of nn (tile
// rows = k, columns = n), loaded with .trans: matrix m covers k 8(m mod 2) …, n 8⌊m/2⌋ … (same addresses
// as the A operand).
VSA_HOST_DEVICE constexpr int a_load_row(int lane) { return ldmatrix_row(lane) + 8 * (ldmatrix_matrix(lane) & 1); }
VSA_HOST_DEVICE constexpr int a_load_chunk(int lane) { return ldmatrix_matrix(lane) >> 1; }
VSA_HOST_DEVICE constexpr int nt_b_load_row(int lane) { return ldmatrix_row(lane) + 8 * (ldmatrix_matrix(lane) >> 1); }
VSA_HOST_DEVICE constexpr int nt_b_load_chunk(int lane) { return ldmatrix_matrix(lane) & 1; }
VSA_HOST_DEVICE constexpr int nn_b_load_row(int lane) { return a_load_row(lane); }
VSA_HOST_DEVICE constexpr int nn_b_load_chunk(int lane) { return a_load_chunk(lane); }

// Score and output tiles: element e is accumulator element e mod 4 of n8 tile ⌊e/4⌋; each lane has two rows
// (slots 0 and 1).
VSA_HOST_DEVICE constexpr int elem_slot(int e) { return (e >> 1) & 1; }
VSA_HOST_DEVICE constexpr int slot_row(int lane, int slot) { return (lane >> 2) + 8 * slot; }
VSA_HOST_DEVICE constexpr int elem_row(int lane, int e) { return slot_row(lane, elem_slot(e)); }
VSA_HOST_DEVICE constexpr int elem_col(int lane, int e) { return (e >> 2) * 8 + 2 * (lane & 3) + (e & 1); }

// P as the A operand of the 16-wide k step kk: register r, half h is score element p_elem(kk, r, h)
// (two adjacent n8 accumulators make one A fragment).
VSA_HOST_DEVICE constexpr int p_elem(int kk, int reg, int half) {
  return (2 * kk + (reg >> 1)) * 4 + 2 * (reg & 1) + half;
}

// movmatrix.m8n8.trans: lane l gives and receives the two elements of row l / 4 at columns 2(l mod 4) + h of
// an 8 × 8 matrix; what it receives is that place of the transpose, element (2(l mod 4) + h, l / 4) of what
// the lanes gave.
VSA_HOST_DEVICE constexpr int movmatrix_src_row(int lane, int half) { return 2 * (lane & 3) + half; }
VSA_HOST_DEVICE constexpr int movmatrix_src_col(int lane) { return lane >> 2; }

// A pair's dS as dk/dv stores it for dq (detail/attention_dq_stored.hpp): a 64 × 64 tile (rows queries, columns
// keys) as the A fragments of dq's product, in 16-byte chunks of the four registers of one lane. Chunk
// ds_chunk(band, kk, lane) holds lane `lane`'s A fragment of the band's 16 query rows at the 16-wide key step
// kk, so that a dq warp reads its band as four chunks a lane, contiguous across the warp's lanes.
VSA_HOST_DEVICE constexpr int ds_chunk(int band, int kk, int lane) { return (band * 4 + kk) * lanes + lane; }
// dk/dv's warp kk holds dSᵀ of keys 16kk … 16kk + 15 (its score tile's rows) against the 64 queries, rounded to E
// once as the A fragments of dK's product (p_elem: k step `band` is query band `band`). Register r of dq's A
// fragment of query band `band` is, before the transpose, register ds_frag_reg(r) of k step `band` of those
// fragments (query octet 2·band + r mod 2, key half ⌊r/2⌋: the A register that holds rows 8⌊r/2⌋ … and columns
// 8(r mod 2) …), one movmatrix.trans a register, so the store moves the registers the product reads.
VSA_HOST_DEVICE constexpr int ds_frag_reg(int reg) { return 2 * (reg & 1) + (reg >> 1); }

// The lanes that share a row differ in the two low bits: reduce over xor row_xor_mask(0), row_xor_mask(1).
VSA_HOST_DEVICE constexpr int row_xor_mask(int step) { return 1 << step; }
VSA_HOST_DEVICE constexpr bool row_leader(int lane) { return (lane & 3) == 0; }

} // namespace nvidia

// AMD v_mfma_f32_16x16x16 bf16_1k / f16 (CDNA2 and CDNA3 ISA), 64 lanes: lane l holds A(l mod 16, 4⌊l/16⌋ + i),
// B(4⌊l/16⌋ + i, l mod 16) and C(4⌊l/16⌋ + i, l mod 16), i = 0 … 3 (register ⌊i/2⌋, half i mod 2 for A, B).
namespace amd {

constexpr int lanes = 64;

VSA_HOST_DEVICE constexpr int a_row(int lane) { return lane & 15; }
VSA_HOST_DEVICE constexpr int a_col(int lane, int i) { return 4 * (lane >> 4) + i; }
VSA_HOST_DEVICE constexpr int b_row(int lane, int i) { return 4 * (lane >> 4) + i; }
VSA_HOST_DEVICE constexpr int b_col(int lane) { return lane & 15; }
VSA_HOST_DEVICE constexpr int c_row(int lane, int i) { return 4 * (lane >> 4) + i; }
VSA_HOST_DEVICE constexpr int c_col(int lane) { return lane & 15; }

// The layer computes every tile transposed: nt reads four consecutive k elements of one row (operand_row,
// operand_k) for both operands; nn reads B's rows operand_k … +3 at column operand_row.
VSA_HOST_DEVICE constexpr int operand_row(int lane) { return lane & 15; }
VSA_HOST_DEVICE constexpr int operand_k(int lane) { return 4 * (lane >> 4); }

// Score and output tiles: element e is accumulator element e mod 4 of the 16-wide tile ⌊e/4⌋ of the
// transposed product, so the band's row is the accumulator's column and the tile column its row.
VSA_HOST_DEVICE constexpr int elem_slot(int) { return 0; }
VSA_HOST_DEVICE constexpr int slot_row(int lane, int) { return lane & 15; }
VSA_HOST_DEVICE constexpr int elem_row(int lane, int) { return lane & 15; }
VSA_HOST_DEVICE constexpr int elem_col(int lane, int e) { return (e >> 2) * 16 + 4 * (lane >> 4) + (e & 3); }

// Pᵀ as the B operand of the 16-wide k step kk: element i is score element 4 kk + i.
VSA_HOST_DEVICE constexpr int p_elem(int kk, int i) { return 4 * kk + i; }

// The lanes that share a row differ in bits 4 and 5: reduce over xor row_xor_mask(0), row_xor_mask(1).
VSA_HOST_DEVICE constexpr int row_xor_mask(int step) { return 16 << step; }
VSA_HOST_DEVICE constexpr bool row_leader(int lane) { return lane < 16; }

} // namespace amd

} // namespace lane_layout
} // namespace gpu
} // namespace vsa
