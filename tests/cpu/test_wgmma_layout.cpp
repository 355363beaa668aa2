// The shared-memory side of Hopper's wgmma (include/vsa/gpu/arch/smem_layout.hpp) against a CPU model of
// the instruction. The model below is written from the PTX ISA's description of the matrix descriptor and
// of the canonical shared-memory layouts, independently of the header: the tiles are placed in a simulated
// shared memory with the chunk placement copy_tile uses, every descriptor the kernels build is built with
// the same functions, and the operand the model reads through each descriptor must be the logical tile, so
// that S = A·Bᵀ (nt), O = P·V (nn) and KV = φ(K)ᵀ·V (tn, A read transposed out of a tile's panel)
// computed from those reads are the plain products (and the block of ones through which tn_sums takes column
// sums is read inside its one swizzle atom). The register side
// of wgmma (A from registers, the accumulator) is the mma.sync lane layout, checked in test_lane_layout.cpp.
#include "support/catch.hpp"

#include <vsa/gpu/arch/smem_layout.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace {

namespace sl = vsa::gpu::smem_layout;
namespace wl = vsa::gpu::wgmma_layout;

// ---- wgmma.mma_async operands in shared memory, as the PTX ISA describes them (16-bit elements) ----

enum class major { k, mn };

// The descriptor's fields (PTX ISA, "Matrix Descriptor"): start address, leading and stride dimension byte
// offsets, each stored without its four low bits in 14 bits (0-13, 16-29, 32-45), the matrix base offset
// in bits 49-51 and the swizzle mode in bits 62-63 (0 none, 1 128-byte, 2 64-byte, 3 32-byte).
struct fields {
  uint32_t start, lead, stride;
  int base_offset, swizzle;
};

fields decode(uint64_t desc) {
  const auto field = [&](int lo, int bits) {
    return static_cast<uint32_t>((desc >> lo) & ((uint64_t{1} << bits) - 1));
  };
  return {field(0, 14) << 4, field(16, 14) << 4, field(32, 14) << 4, static_cast<int>(field(49, 3)),
          static_cast<int>(field(62, 2))};
}

// Bytes of one row of a swizzle atom: the span whose 16-byte units are permuted (16 without swizzling).
uint32_t swizzle_span(int mode) { return mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 16; }

// The swizzle permutes the 16-byte units of each span-wide row by XOR-ing the unit index (address bits 4
// and up) with the row's index within the repeating pattern (bits 7 and up), over log2(span / 16) bits: for
// 128 bytes, bits 4-6 with bits 7-9, so the pattern repeats every 1024 bytes.
uint32_t swizzled(uint32_t addr, uint32_t span) { return addr ^ (((addr >> 7) & (span / 16 - 1)) << 4); }

// Byte address from which the instruction reads element (mn, k) of an operand of extent `extent` along M or
// N and 16 along K: A(mn, k) of an M × K A, B(k, mn) of a K × N B. With T = 8 elements in a 16-byte unit
// and a swizzle span of W bytes (the canonical layouts, "Shared Memory Matrix Layout" and "Strides"):
//   K-major: a core matrix is 8 rows (M or N) of 16 bytes along K. Swizzled, 8 rows of W bytes form an atom
//     (row i at W·i), the 16 k of a step lie side by side within the row, atoms along M/N are the stride
//     byte offset apart, and the leading byte offset is not used. Unswizzled, the rows are 16 bytes apart
//     and the two 8-element halves along K are the leading byte offset apart.
//   MN-major: the roles turn: M/N runs along the contiguous bytes. Swizzled, an atom is W/2 elements along
//     M/N by 8 along K (k row j at W·j), blocks of W/2 along M/N are the leading byte offset apart and the
//     groups of 8 along K the stride byte offset apart. Unswizzled, 8 elements along M/N by 8 along K in 128
//     contiguous bytes, groups of 8 along M/N the stride byte offset apart, along K the leading.
// The swizzle acts on the address itself (base offset 0), so a start inside an atom shifts the pattern.
uint32_t element_address(uint64_t desc, major mj, int extent, int mn, int k) {
  REQUIRE((extent == 8 || extent == 64 || extent == 128));
  REQUIRE(mn >= 0);
  REQUIRE(mn < extent);
  REQUIRE(k >= 0);
  REQUIRE(k < 16);
  const fields f = decode(desc);
  REQUIRE(f.base_offset == 0);
  const uint32_t w = swizzle_span(f.swizzle);
  const uint32_t m = static_cast<uint32_t>(mn), kk = static_cast<uint32_t>(k);
  uint32_t offset;
  if (mj == major::k) {
    offset = f.swizzle != 0 ? (m / 8) * f.stride + (m % 8) * w + 2 * kk
                            : (m / 8) * f.stride + (m % 8) * 16 + (kk / 8) * f.lead + 2 * (kk % 8);
  } else {
    offset = f.swizzle != 0 ? (m / (w / 2)) * f.lead + 2 * (m % (w / 2)) + (kk / 8) * f.stride + (kk % 8) * w
                            : (m / 8) * f.stride + 2 * (m % 8) + (kk / 8) * f.lead + (kk % 8) * 16;
  }
  return swizzled(f.start + offset, w);
}

// ---- simulated shared memory ----

using tile = std::vector<std::vector<uint16_t>>; // [row][col]
using wide = std::vector<std::vector<uint64_t>>; // products of raw 16-bit values, exact

struct smem {
  std::vector<uint8_t> bytes;
  std::vector<int> writes;
  explicit smem(size_t n) : bytes(n, 0), writes(n, 0) {}
  void store(uint32_t addr, uint16_t v) {
    REQUIRE(addr + 1 < bytes.size());
    bytes[addr] = static_cast<uint8_t>(v & 0xFF);
    bytes[addr + 1] = static_cast<uint8_t>(v >> 8);
    ++writes[addr];
    ++writes[addr + 1];
  }
  uint16_t load(uint32_t addr) const {
    REQUIRE(addr % 2 == 0);
    REQUIRE(addr + 1 < bytes.size());
    return static_cast<uint16_t>(bytes[addr] | bytes[addr + 1] << 8);
  }
};

// What copy_tile does for the 64 × d tile t at byte address base: 16-byte chunk c of row r goes to the
// chunk placement of smem_tile (NVIDIA panels).
void place(smem& s, uint32_t base, const tile& t, int d) {
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < d / 8; ++c)
      for (int e = 0; e < 8; ++e)
        s.store(base + 2 * static_cast<uint32_t>(sl::panel_chunk_offset(r, c) + e), t[r][8 * c + e]);
}

// The descriptor of one k step of the tile at byte address base, as wgmma::descriptor builds it on the device:
// the tile's descriptor plus the step's offset in 16-byte units.
uint64_t descriptor(uint32_t base, wl::operand_step step) {
  return wl::descriptor(base, step.lead_bytes, step.stride_bytes) + static_cast<uint64_t>((2 * step.offset) >> 4);
}

// The operand read through a descriptor: [mn][k].
tile read(const smem& s, uint64_t desc, major mj, int extent) {
  tile x(extent, std::vector<uint16_t>(16));
  for (int mn = 0; mn < extent; ++mn)
    for (int k = 0; k < 16; ++k) x[mn][k] = s.load(element_address(desc, mj, extent, mn, k));
  return x;
}

// Tiles of distinct random 16-bit values, so that reading any element other than the intended one shows.
struct values {
  std::vector<uint16_t> pool;
  size_t next = 0;
  explicit values(std::mt19937& rng) : pool(65536) {
    std::iota(pool.begin(), pool.end(), uint16_t{0});
    std::shuffle(pool.begin(), pool.end(), rng);
  }
  tile make(int rows, int cols) {
    tile t(rows, std::vector<uint16_t>(cols));
    for (auto& row : t)
      for (auto& x : row) x = pool.at(next++);
    return t;
  }
};

wide product_nt(const tile& a, const tile& b) { // a · bᵀ
  wide c(a.size(), std::vector<uint64_t>(b.size(), 0));
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < b.size(); ++j)
      for (size_t k = 0; k < a[0].size(); ++k) c[i][j] += uint64_t{a[i][k]} * b[j][k];
  return c;
}

wide product_nn(const tile& a, const tile& b) { // a · b
  wide c(a.size(), std::vector<uint64_t>(b[0].size(), 0));
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < b[0].size(); ++j)
      for (size_t k = 0; k < b.size(); ++k) c[i][j] += uint64_t{a[i][k]} * b[k][j];
  return c;
}

// Tiles sit at 1024-byte aligned addresses past a first aligned kilobyte, as aligned_smem places them.
constexpr uint32_t first_tile = 1024;
uint32_t tile_bytes(int d) { return 64 * static_cast<uint32_t>(d) * 2; }

// nt: S = A·Bᵀ, A (64 rows, the warpgroup's bands) and B (64 rows) both K-major, one m64n64k16 per k step.
template <int D> void nt_product(std::mt19937& rng) {
  values v(rng);
  const tile a = v.make(64, D), b = v.make(64, D);
  const uint32_t at = first_tile, bt = first_tile + tile_bytes(D);
  smem s(bt + tile_bytes(D) + 1024);
  place(s, at, a, D);
  place(s, bt, b, D);
  wide acc(64, std::vector<uint64_t>(64, 0));
  for (int ks = 0; ks < D / 16; ++ks) {
    const tile ar = read(s, descriptor(at, wl::k_major(ks)), major::k, 64);
    const tile br = read(s, descriptor(bt, wl::k_major(ks)), major::k, 64);
    for (int r = 0; r < 64; ++r)
      for (int k = 0; k < 16; ++k) {
        REQUIRE(ar[r][k] == a[r][16 * ks + k]);
        REQUIRE(br[r][k] == b[r][16 * ks + k]);
      }
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < 64; ++n)
        for (int k = 0; k < 16; ++k) acc[m][n] += uint64_t{ar[m][k]} * br[n][k];
  }
  CHECK(acc == product_nt(a, b));
}

// nn: O = P·V, P from registers (64 × 64), V (64 rows along k, D columns along N) MN-major, one m64nDk16
// per k step of 16 rows.
template <int D> void nn_product(std::mt19937& rng) {
  values v(rng);
  const tile p = v.make(64, 64), b = v.make(64, D);
  const uint32_t bt = first_tile;
  smem s(bt + tile_bytes(D) + 1024);
  place(s, bt, b, D);
  wide acc(64, std::vector<uint64_t>(D, 0));
  for (int kk = 0; kk < 4; ++kk) {
    const tile br = read(s, descriptor(bt, wl::mn_major(kk)), major::mn, D);
    for (int n = 0; n < D; ++n)
      for (int k = 0; k < 16; ++k) REQUIRE(br[n][k] == b[16 * kk + k][n]);
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < D; ++n)
        for (int k = 0; k < 16; ++k) acc[m][n] += uint64_t{p[m][16 * kk + k]} * br[n][k];
  }
  CHECK(acc == product_nn(p, b));
}

// tn: KV = Aᵀ·B over the 64 rows of two tiles (the linear-attention state φ(K)ᵀ·V). Warpgroup g reads the
// 64 columns of panel g of A transposed (MN-major A of extent 64: A'(m, k) = A[16kk + k][64g + m]) and all
// of B MN-major as in nn; one m64nDk16 per k step of 16 rows. Its 64 result rows are columns 64g … of A.
template <int D> void tn_product(std::mt19937& rng) {
  values v(rng);
  const tile a = v.make(64, D), b = v.make(64, D);
  const uint32_t at = first_tile, bt = first_tile + tile_bytes(D);
  smem s(bt + tile_bytes(D) + 1024);
  place(s, at, a, D);
  place(s, bt, b, D);
  for (int g = 0; g < D / 64; ++g) {
    wide acc(64, std::vector<uint64_t>(D, 0)), want(64, std::vector<uint64_t>(D, 0));
    for (int kk = 0; kk < 4; ++kk) {
      const tile ar = read(s, descriptor(at, wl::mn_major_panel(g, kk)), major::mn, 64);
      const tile br = read(s, descriptor(bt, wl::mn_major(kk)), major::mn, D);
      for (int m = 0; m < 64; ++m)
        for (int k = 0; k < 16; ++k) REQUIRE(ar[m][k] == a[16 * kk + k][64 * g + m]);
      for (int m = 0; m < 64; ++m)
        for (int n = 0; n < D; ++n)
          for (int k = 0; k < 16; ++k) acc[m][n] += uint64_t{ar[m][k]} * br[n][k];
    }
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < D; ++n)
        for (int t = 0; t < 64; ++t) want[m][n] += uint64_t{a[t][64 * g + m]} * b[t][n];
    CHECK(acc == want);
  }
}

// Whether every k step of every panel of a D-wide tile reads back transposed (tn's A) through descriptors
// built from operand steps altered by `edit` (which gets the panel too).
template <class Edit> bool reads_transposed(int d, Edit edit) {
  std::mt19937 rng(7);
  values v(rng);
  const tile t = v.make(64, d);
  smem s(first_tile + tile_bytes(d) + 1024);
  place(s, first_tile, t, d);
  for (int g = 0; g < d / 64; ++g)
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t desc = descriptor(first_tile, edit(g, wl::mn_major_panel(g, kk)));
      for (int m = 0; m < 64; ++m)
        for (int k = 0; k < 16; ++k) {
          const uint32_t addr = element_address(desc, major::mn, 64, m, k);
          if (addr + 1 >= s.bytes.size() || s.load(addr) != t[16 * kk + k][64 * g + m]) return false;
        }
    }
  return true;
}

// Whether every k step of a D-wide tile reads back as the logical tile through descriptors altered by `edit`.
template <class Edit> bool reads_tile(int d, major mj, Edit edit) {
  std::mt19937 rng(5);
  values v(rng);
  const tile t = v.make(64, d);
  smem s(first_tile + tile_bytes(d) + 1024);
  place(s, first_tile, t, d);
  const int steps = mj == major::k ? d / 16 : 4;
  const int extent = mj == major::k ? 64 : d;
  for (int i = 0; i < steps; ++i) {
    const uint64_t desc = edit(descriptor(first_tile, mj == major::k ? wl::k_major(i) : wl::mn_major(i)));
    for (int mn = 0; mn < extent; ++mn)
      for (int k = 0; k < 16; ++k) {
        const uint32_t addr = element_address(desc, mj, extent, mn, k);
        if (addr + 1 >= s.bytes.size() || s.load(addr) != (mj == major::k ? t[mn][16 * i + k] : t[16 * i + k][mn]))
          return false;
      }
  }
  return true;
}

uint64_t set_field(uint64_t desc, int lo, int bits, uint64_t value) {
  const uint64_t mask = ((uint64_t{1} << bits) - 1) << lo;
  return (desc & ~mask) | ((value << lo) & mask);
}

} // namespace

TEST_CASE("wgmma descriptors pack their fields where the PTX ISA puts them", "[cpu][wgmma]") {
  const uint32_t addr = 0x2D3A0, lead = 8192, stride = 1024;
  const uint64_t desc = wl::descriptor(addr, lead, stride);
  const fields f = decode(desc);
  CHECK(f.start == addr);
  CHECK(f.lead == lead);
  CHECK(f.stride == stride);
  CHECK(f.base_offset == 0);
  CHECK(f.swizzle == 1);
  // Bits outside the fields stay clear.
  const uint64_t used = 0x3FFFull | 0x3FFFull << 16 | 0x3FFFull << 32 | 7ull << 49 | 3ull << 62;
  CHECK((desc & ~used) == 0);
  // Every shared tile of a block starts below 228 KiB, within the 18 bits the start field holds.
  CHECK(decode(wl::descriptor(227 * 1024, 16, 1024)).start == 227 * 1024);
}

TEST_CASE("a k step's descriptor is its tile's plus the step's offset", "[cpu][wgmma]") {
  // The device adds each step's offset to the packed descriptor of the tile; that equals packing the step's own
  // address for every tile start a block can have (1024-byte aligned, the tile inside 227 KiB) and every step of
  // the three operand forms, because the start field never carries into the next one.
  int checked = 0;
  for (int d : {64, 128}) {
    const uint32_t tile_bytes = 64u * static_cast<uint32_t>(d) * 2u;
    for (uint32_t base = 0; base + tile_bytes <= 227u * 1024u; base += 1024) {
      std::vector<wl::operand_step> steps;
      for (int ks = 0; ks < d / 16; ++ks) steps.push_back(wl::k_major(ks));
      for (int kk = 0; kk < 4; ++kk) steps.push_back(wl::mn_major(kk));
      for (int g = 0; g < d / 64; ++g)
        for (int kk = 0; kk < 4; ++kk) steps.push_back(wl::mn_major_panel(g, kk));
      for (const wl::operand_step& st : steps) {
        const uint64_t packed =
            wl::descriptor(base + 2 * static_cast<uint32_t>(st.offset), st.lead_bytes, st.stride_bytes);
        if (descriptor(base, st) != packed) FAIL("base " << base << ", offset " << st.offset);
        ++checked;
      }
    }
  }
  CHECK(checked > 1000);
}

TEST_CASE("copy_tile's chunk placement fills each tile byte once", "[cpu][wgmma]") {
  for (int d : {64, 128}) {
    std::mt19937 rng(3);
    values v(rng);
    smem s(first_tile + tile_bytes(d) + 1024);
    place(s, first_tile, v.make(64, d), d);
    for (size_t i = 0; i < s.writes.size(); ++i)
      REQUIRE(s.writes[i] == (i >= first_tile && i < first_tile + tile_bytes(d) ? 1 : 0));
  }
}

TEST_CASE("wgmma reads the K-major operands of nt as the logical tiles", "[cpu][wgmma]") {
  std::mt19937 rng(23);
  nt_product<64>(rng);
  nt_product<128>(rng);
}

TEST_CASE("wgmma reads the MN-major operand of nn as the logical tile", "[cpu][wgmma]") {
  std::mt19937 rng(29);
  nn_product<64>(rng);
  nn_product<128>(rng);
}

TEST_CASE("wgmma reads a tile's panel transposed as the A operand of tn", "[cpu][wgmma]") {
  std::mt19937 rng(31);
  tn_product<64>(rng);
  tn_product<128>(rng);
}

TEST_CASE("wgmma reads the block of ones of tn_sums as an 8-column B inside its one swizzle atom", "[cpu][wgmma]") {
  // The column sums of the state kernel read a 64 (k) × 8 B, K-major, through k_major(kk) for the four k
  // steps, from a 1024-byte-aligned block of 1024 bytes of ones (warpgroup_mma::ones_bytes). Every read must
  // stay inside the block; the four steps together read each of its 16-bit words once.
  const uint32_t base = first_tile, bytes = 1024;
  std::vector<int> reads(bytes / 2, 0);
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t desc = descriptor(base, wl::k_major(kk));
    for (int n = 0; n < 8; ++n)
      for (int k = 0; k < 16; ++k) {
        const uint32_t a = element_address(desc, major::k, 8, n, k);
        REQUIRE(a >= base);
        REQUIRE(a + 2 <= base + bytes);
        ++reads[(a - base) / 2];
      }
  }
  CHECK(std::all_of(reads.begin(), reads.end(), [](int n) { return n == 1; }));
}

TEST_CASE("wgmma operand model: a wrong offset of tn's transposed A reads a different operand", "[cpu][wgmma]") {
  using step = wl::operand_step;
  for (int d : {64, 128}) {
    CHECK(reads_transposed(d, [](int, step s) { return s; }));
    // One row (128 bytes) or one 16-byte unit further (the start address has no finer unit), or eight rows
    // (one core-matrix group along k).
    for (int off : {64, 8, 8 * 64})
      CHECK_FALSE(reads_transposed(d, [off](int, step s) {
        return step{s.offset + off, s.lead_bytes, s.stride_bytes};
      }));
    // The k step's 16 rows counted as 16 columns (the K-major step), or the rows as 8 apart.
    CHECK_FALSE(reads_transposed(d, [](int g, step s) {
      return step{g * sl::panel + (s.offset - g * sl::panel) / (16 * sl::panel_cols) * 16, s.lead_bytes,
                  s.stride_bytes};
    }));
    // Eight-row groups along k at the wrong distance.
    CHECK_FALSE(reads_transposed(d, [](int, step s) { return step{s.offset, s.lead_bytes, 512}; }));
    // Extent 64 is one swizzle atom wide: the leading byte offset is never used.
    CHECK(reads_transposed(d, [](int, step s) { return step{s.offset, 16, s.stride_bytes}; }));
  }
  // The panel left out: warpgroup 1 would read warpgroup 0's columns.
  CHECK_FALSE(reads_transposed(128, [](int g, step s) {
    return step{s.offset - g * sl::panel, s.lead_bytes, s.stride_bytes};
  }));
}

TEST_CASE("wgmma operand model: a wrong descriptor field reads a different tile", "[cpu][wgmma]") {
  const auto same = [](uint64_t d) { return d; };
  for (int d : {64, 128}) {
    CHECK(reads_tile(d, major::k, same));
    CHECK(reads_tile(d, major::mn, same));
    for (major mj : {major::k, major::mn}) {
      // Stride byte offset (eight-row groups) halved or doubled.
      CHECK_FALSE(reads_tile(d, mj, [](uint64_t x) { return set_field(x, 32, 14, 512 >> 4); }));
      CHECK_FALSE(reads_tile(d, mj, [](uint64_t x) { return set_field(x, 32, 14, 2048 >> 4); }));
      // Another swizzle mode, or none.
      for (uint64_t mode : {0, 2, 3})
        CHECK_FALSE(reads_tile(d, mj, [mode](uint64_t x) { return set_field(x, 62, 2, mode); }));
      // Start one 16-byte unit off.
      CHECK_FALSE(reads_tile(d, mj, [](uint64_t x) { return x + 1; }));
    }
    // The K-major swizzled layout has no use for the leading byte offset.
    CHECK(reads_tile(d, major::k, [](uint64_t x) { return set_field(x, 16, 14, 4096 >> 4); }));
  }
  // The MN-major leading byte offset steps between the 64-column panels, so only a 128-wide N reads it.
  const auto half_panel = [](uint64_t x) { return set_field(x, 16, 14, (sl::panel_bytes / 2) >> 4); };
  CHECK(reads_tile(64, major::mn, half_panel));
  CHECK_FALSE(reads_tile(128, major::mn, half_panel));
}
