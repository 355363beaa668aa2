// Where a shared tile keeps each element, and the matrix descriptors through which Hopper's wgmma reads
// those tiles, as plain constexpr arithmetic the host can run too: smem_tile.hpp places every 16-byte chunk
// with these functions (copy_tile and the fragment loads go through it), hopper_wgmma.hpp builds its
// descriptors with them, and tests/cpu/test_wgmma_layout.cpp reads the tiles back through a CPU model of
// the instruction's shared-memory side. Like lane_layout.hpp, this header includes no GPU header.
#pragma once

#include "../../types.hpp"

namespace vsa {
namespace gpu {

inline constexpr int tile_rows = 64;

namespace smem_layout {

// Element offset of 16-byte chunk c (columns 8c … 8c+7) of row `row` from the start of a tile; the chunk
// index is XOR-ed with (row mod 8) so that eight rows read at once spread over all banks (smem_tile.hpp).
//
// NVIDIA: D/64 panels of 64 columns, each 64 rows of 128 bytes (the 128-byte swizzle layout of wgmma).
constexpr int panel_cols = 64;
constexpr int panel = tile_rows * panel_cols; // elements of one panel
constexpr int panel_bytes = panel * 2;
VSA_HOST_DEVICE constexpr int panel_chunk_offset(int row, int c) {
  return (c >> 3) * panel + row * panel_cols + (((c & 7) ^ (row & 7)) << 3);
}
// panel_chunk_offset(r0 + lr, 2s + lc) for r0 a multiple of 8 and lc 0 or 1, the chunks ldmatrix reads (a k step s
// of 16 columns, 8-row blocks of a 16-row band), split into a part of the lane and s mod 4 only (lr, lc come from
// the lane) and a part of r0 and s / 4 only: in a loop over tiles the first is the same every step and the second
// a constant, so each load's address is one add of an immediate instead of the swizzle's shifts, XOR and ORs
// (r0 adds no bits below 8 rows and the XOR acts on s mod 4, so the two parts only add).
VSA_HOST_DEVICE constexpr int panel_lane_part(int lr, int lc, int q) {
  return lr * panel_cols + (((2 * q) ^ lc ^ (lr & 7)) << 3);
}
VSA_HOST_DEVICE constexpr int panel_step_part(int r0, int s) { return (s >> 2) * panel + r0 * panel_cols; }
// AMD: whole rows of d elements.
VSA_HOST_DEVICE constexpr int row_chunk_offset(int d, int row, int c) { return row * d + ((c ^ (row & 7)) << 3); }
// Element (row, col) of that layout, split for the MFMA backend's fragment loads and the tile copy (amd_mfma.hpp,
// copy_tile): the XOR acts within 8 rows and 64 columns, so element (r0 + r, c0 + c) for r0 a multiple of 8 and c0 of
// 64 lies at row_lane_part(d, r, c) + row_step_part(d, r0, c0). With (r, c) of the lane and the k step and (r0, c0)
// of the unrolled counters, the first part is one pointer a tile and the second the load's immediate offset.
VSA_HOST_DEVICE constexpr int row_lane_part(int d, int r, int c) { return row_chunk_offset(d, r, c >> 3) + (c & 7); }
VSA_HOST_DEVICE constexpr int row_step_part(int d, int r0, int c0) { return r0 * d + c0; }
// nn's B operand is read down a column, four rows r … r+3 (r a multiple of 4) a lane: row r + i of column c < 64 lies
// at row_lane_part(d, r, c ^ 8i) + i·d (r + i and r differ only in the bits the XOR sees), so for c = 16q + lc, lc <
// 16, its lane part is that of column 8x ^ lc, x = 2q ^ i: 8 addresses a lane for the 16 pairs of q and i.

// AMD, a tile stored transposed (smem_tile_transposed): the operand that an MFMA product reads along the tile's rows
// (V in P·V, whose k axis is the key) as d rows of the tile's 64 rows, in 8-byte units of four. The MFMA takes four
// consecutive k elements a lane, so a row-major V costs four 2-byte reads and their packing for every 8 bytes; stored
// transposed, they are one 8-byte read. Unit u (tile rows 4u … 4u+3) of transposed row `col` lies at unit u ^ (col mod
// 16): the 16 lanes of an MFMA read that share u read 16 consecutive columns, and the 16 lanes of a copy's write that
// share a column write 16 consecutive units, so each touches 16 different 8-byte units, all 32 banks, once.
constexpr int transposed_unit = 4; // tile rows an 8-byte unit holds
VSA_HOST_DEVICE constexpr int transposed_offset(int col, int unit) {
  return col * tile_rows + ((unit ^ (col & 15)) * transposed_unit);
}
// The XOR acts within 16 columns: for c0 a multiple of 16, column c0 + c lies c0 · 64 past column c (nn_t's lane part
// for c = operand_row < 16 and the load's immediate offset for c0, as with row_lane_part).
VSA_HOST_DEVICE constexpr int transposed_step_part(int c0) { return c0 * tile_rows; }
// The copy into that layout: thread-sized blocks of 4 tile rows × 8 columns (four 16-byte loads, eight 8-byte
// stores), block b at unit b mod 16 and 16-byte chunk b / 16, so that the 16 lanes of a store share the chunk.
VSA_HOST_DEVICE constexpr int transposed_block_unit(int block) { return block & 15; }
VSA_HOST_DEVICE constexpr int transposed_block_chunk(int block) { return block >> 4; }
// The register transpose of one block: in[k][w] holds tile row 4u + k, columns 8c + 2w (low half) and 8c + 2w + 1
// (high half); out[i][h] receives column 8c + i, tile rows 4u + 2h (low half) and 4u + 2h + 1 (high half).
VSA_HOST_DEVICE constexpr uint32_t transposed_word(const uint32_t (&in)[4][4], int i, int h) {
  const uint32_t a = in[2 * h][i >> 1], b = in[2 * h + 1][i >> 1];
  return (i & 1) ? (a >> 16) | (b & 0xffff0000u) : (a & 0xffffu) | (b << 16);
}

} // namespace smem_layout

// wgmma's shared-memory operands (PTX ISA, "Matrix Descriptor" and "Shared Memory Matrix Layout"), over the
// panel layout above with its panels 1024-byte aligned. The 128-byte swizzle acts on address bits (16-byte
// unit bits 4-6 XOR row bits 7-9), so a descriptor may start inside a swizzle atom: a k step within a panel
// is a plain offset of its start address.
namespace wgmma_layout {

// Swizzle mode field, bits 62-63.
constexpr uint64_t swizzle_128b = 1;

// Start address, leading and stride byte offsets, each in 16-byte units in 14 bits, and the swizzle mode;
// the matrix base offset (bits 49-51) stays 0 because panels start on swizzle-pattern boundaries.
VSA_HOST_DEVICE constexpr uint64_t descriptor(uint32_t smem_addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_addr >> 4) & 0x3FFF) | static_cast<uint64_t>((lead_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32 | swizzle_128b << 62;
}

// One k step of a tile as an operand: the element offset of its start from the tile's base and the two
// byte strides of its descriptor.
struct operand_step {
  int offset;
  uint32_t lead_bytes;
  uint32_t stride_bytes;
};

// K-major operand (16 columns of all 64 rows, k along the row): k step ks is 16 columns, 32 bytes further
// into a panel, four steps a panel. The eight-row groups are 1024 bytes apart (stride byte offset); the two
// 8-column halves of a step lie side by side within the 128-byte row, so the leading byte offset is unused
// by the swizzled layout (16 bytes, encoded as 1, the value the ISA assumes).
VSA_HOST_DEVICE constexpr operand_step k_major(int ks) {
  return {(ks >> 2) * smem_layout::panel + (ks & 3) * 16, 16, 1024};
}

// MN-major operand (16 rows, k along the rows, all columns along N): k step kk starts 16 rows = 2048 bytes
// further; the two eight-row groups along k are 1024 bytes apart (stride byte offset) and the 64-column
// blocks along N one panel apart (leading byte offset).
VSA_HOST_DEVICE constexpr operand_step mn_major(int kk) {
  return {kk * 16 * smem_layout::panel_cols, smem_layout::panel_bytes, 1024};
}

// The 64 columns of panel p read transposed, as an MN-major operand of extent 64 (the A of tn: a tile's
// columns become the product's rows, its rows the k axis): k step kk is rows 16kk … 16kk+15 of that panel,
// i.e. the MN-major step moved one panel per p. Extent 64 is one swizzle atom wide, so the leading byte
// offset is never used; it keeps mn_major's value.
VSA_HOST_DEVICE constexpr operand_step mn_major_panel(int p, int kk) {
  const operand_step s = mn_major(kk);
  return {p * smem_layout::panel + s.offset, s.lead_bytes, s.stride_bytes};
}

} // namespace wgmma_layout

} // namespace gpu
} // namespace vsa
