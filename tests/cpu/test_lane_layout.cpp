// The lane layouts of both matrix-core backends (include/vsa/gpu/arch/lane_layout.hpp) against CPU models of
// the instructions. The models below are written from the ISA documents' tables, independently of the header:
// the header's fragments are fed to them and the results read back through the header's element mapping, so
// a wrong mapping gives a wrong product. The warp-level nt / nn of the matrix layer are replayed step by step
// with the same address and element functions the kernels call.
#include "support/catch.hpp"

#include <vsa/gpu/arch/lane_layout.hpp>

#include <array>
#include <random>
#include <set>
#include <utility>
#include <vector>

namespace {

namespace nv = vsa::gpu::lane_layout::nvidia;
namespace amd = vsa::gpu::lane_layout::amd;

// Small integers: every product and sum below is exact in double, so results compare with ==.
using matrix = std::vector<std::vector<double>>;

matrix random_matrix(int rows, int cols, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(-4, 4);
  matrix m(rows, std::vector<double>(cols));
  for (auto& row : m)
    for (auto& x : row) x = dist(rng);
  return m;
}

matrix product(const matrix& a, const matrix& b) {
  matrix c(a.size(), std::vector<double>(b[0].size(), 0.0));
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < b[0].size(); ++j)
      for (size_t k = 0; k < b.size(); ++k) c[i][j] += a[i][k] * b[k][j];
  return c;
}

matrix transpose(const matrix& a) {
  matrix t(a[0].size(), std::vector<double>(a.size()));
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < a[0].size(); ++j) t[j][i] = a[i][j];
  return t;
}

// ---- NVIDIA: mma.sync.m16n8k16 and ldmatrix, as the PTX ISA tables state them ----

// A 32-bit register: two 16-bit halves, low first.
using reg2 = std::array<double, 2>;

struct ptx {
  static int group(int lane) { return lane / 4; }
  static int thread_in_group(int lane) { return lane % 4; }
  // Fragment element index i: a0..a7, b0..b3, c0..c3 (register i / 2, half i % 2 for A and B).
  static std::pair<int, int> a_elem(int lane, int i) {
    const int row = (i < 2 || (i >= 4 && i < 6)) ? group(lane) : group(lane) + 8;
    const int col = thread_in_group(lane) * 2 + (i & 1) + (i >= 4 ? 8 : 0);
    return {row, col};
  }
  static std::pair<int, int> b_elem(int lane, int i) {
    return {thread_in_group(lane) * 2 + (i & 1) + (i >= 2 ? 8 : 0), group(lane)};
  }
  static std::pair<int, int> c_elem(int lane, int i) {
    return {i < 2 ? group(lane) : group(lane) + 8, thread_in_group(lane) * 2 + (i & 1)};
  }
  // d[lane][0..3] += A·B with A, B given as the lanes' fragments.
  static void mma(std::array<std::array<double, 4>, 32>& d, const std::array<std::array<reg2, 4>, 32>& a,
                  const std::array<std::array<reg2, 2>, 32>& b) {
    matrix am(16, std::vector<double>(16)), bm(16, std::vector<double>(8));
    for (int l = 0; l < 32; ++l) {
      for (int i = 0; i < 8; ++i) {
        const auto rc = a_elem(l, i);
        am[rc.first][rc.second] = a[l][i / 2][i % 2];
      }
      for (int i = 0; i < 4; ++i) {
        const auto rc = b_elem(l, i);
        bm[rc.first][rc.second] = b[l][i / 2][i % 2];
      }
    }
    const matrix c = product(am, bm);
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i) {
        const auto rc = c_elem(l, i);
        d[l][i] += c[rc.first][rc.second];
      }
  }
  // Element h of the register a lane receives from one 8 × 8 matrix.
  static int ldmatrix_row(int lane, int h, bool trans) { return trans ? 2 * (lane % 4) + h : lane / 4; }
  static int ldmatrix_col(int lane, int h, bool trans) { return trans ? lane / 4 : 2 * (lane % 4) + h; }
  // ldmatrix .x4 from a row-major 2-D tile: lane 8m + r names row r of matrix m as (tile row, first column);
  // register m of lane l gets matrix m's row l / 4, columns 2(l % 4), +1 (.trans: column l / 4, rows 2(l % 4), +1).
  static std::array<std::array<reg2, 4>, 32> ldmatrix_x4(const matrix& tile,
                                                         const std::array<std::pair<int, int>, 32>& addr, bool trans) {
    std::array<std::array<reg2, 4>, 32> out{};
    for (int l = 0; l < 32; ++l)
      for (int m = 0; m < 4; ++m)
        for (int h = 0; h < 2; ++h) {
          const int r = ldmatrix_row(l, h, trans), c = ldmatrix_col(l, h, trans);
          const auto& a = addr[8 * m + r];
          out[l][m][h] = tile[a.first][a.second + c];
        }
    return out;
  }
};

// ---- AMD: v_mfma_f32_16x16x16 bf16_1k / f16, as the CDNA ISA states it ----

struct cdna {
  static std::pair<int, int> a_elem(int lane, int i) { return {lane % 16, 4 * (lane / 16) + i}; }
  static std::pair<int, int> b_elem(int lane, int i) { return {4 * (lane / 16) + i, lane % 16}; }
  static std::pair<int, int> c_elem(int lane, int i) { return {4 * (lane / 16) + i, lane % 16}; }
  static void mfma(std::array<std::array<double, 4>, 64>& d, const std::array<std::array<double, 4>, 64>& a,
                   const std::array<std::array<double, 4>, 64>& b) {
    matrix am(16, std::vector<double>(16)), bm(16, std::vector<double>(16));
    for (int l = 0; l < 64; ++l)
      for (int i = 0; i < 4; ++i) {
        const auto ra = a_elem(l, i), rb = b_elem(l, i);
        am[ra.first][ra.second] = a[l][i];
        bm[rb.first][rb.second] = b[l][i];
      }
    const matrix c = product(am, bm);
    for (int l = 0; l < 64; ++l)
      for (int i = 0; i < 4; ++i) {
        const auto rc = c_elem(l, i);
        d[l][i] += c[rc.first][rc.second];
      }
  }
};

template <int D> struct nv_warp {
  static constexpr int score_elems = 32, out_elems = D / 2;
  using score = std::array<std::array<double, score_elems>, 32>;
  using out = std::array<std::array<double, out_elems>, 32>;

  // s += band(rows row0 … row0 + 15 of a) · bᵀ, as warp_mma::nt with A loaded per k step.
  static void nt(score& s, const matrix& a, int row0, const matrix& b) {
    for (int ks = 0; ks < D / 16; ++ks) {
      std::array<std::pair<int, int>, 32> addr{};
      for (int l = 0; l < 32; ++l) addr[l] = {row0 + nv::a_load_row(l), 8 * (2 * ks + nv::a_load_chunk(l))};
      const auto af = ptx::ldmatrix_x4(a, addr, false);
      for (int np = 0; np < 4; ++np) {
        for (int l = 0; l < 32; ++l) addr[l] = {np * 16 + nv::nt_b_load_row(l), 8 * (2 * ks + nv::nt_b_load_chunk(l))};
        const auto r = ptx::ldmatrix_x4(b, addr, false);
        for (int half = 0; half < 2; ++half) { // n8 tile 2 np + half: registers 2 half, 2 half + 1
          std::array<std::array<reg2, 2>, 32> bf{};
          std::array<std::array<double, 4>, 32> acc{};
          for (int l = 0; l < 32; ++l) {
            bf[l] = {r[l][2 * half], r[l][2 * half + 1]};
            for (int i = 0; i < 4; ++i) acc[l][i] = s[l][(2 * np + half) * 4 + i];
          }
          ptx::mma(acc, af, bf);
          for (int l = 0; l < 32; ++l)
            for (int i = 0; i < 4; ++i) s[l][(2 * np + half) * 4 + i] = acc[l][i];
        }
      }
    }
  }
  // o += P · b, P the score tile in registers (reused as A fragments), as warp_mma::nn.
  static void nn(out& o, const score& p, const matrix& b) {
    for (int kk = 0; kk < 4; ++kk) {
      std::array<std::array<reg2, 4>, 32> af{};
      for (int l = 0; l < 32; ++l)
        for (int r = 0; r < 4; ++r) af[l][r] = {p[l][nv::p_elem(kk, r, 0)], p[l][nv::p_elem(kk, r, 1)]};
      for (int dp = 0; dp < D / 16; ++dp) {
        std::array<std::pair<int, int>, 32> addr{};
        for (int l = 0; l < 32; ++l) addr[l] = {kk * 16 + nv::nn_b_load_row(l), 8 * (2 * dp + nv::nn_b_load_chunk(l))};
        const auto r = ptx::ldmatrix_x4(b, addr, true);
        for (int half = 0; half < 2; ++half) {
          std::array<std::array<reg2, 2>, 32> bf{};
          std::array<std::array<double, 4>, 32> acc{};
          for (int l = 0; l < 32; ++l) {
            bf[l] = {r[l][2 * half], r[l][2 * half + 1]};
            for (int i = 0; i < 4; ++i) acc[l][i] = o[l][(2 * dp + half) * 4 + i];
          }
          ptx::mma(acc, af, bf);
          for (int l = 0; l < 32; ++l)
            for (int i = 0; i < 4; ++i) o[l][(2 * dp + half) * 4 + i] = acc[l][i];
        }
      }
    }
  }
};

template <int D> struct amd_warp {
  static constexpr int score_elems = 16, out_elems = D / 4;
  using score = std::array<std::array<double, score_elems>, 64>;
  using out = std::array<std::array<double, out_elems>, 64>;
  using frag = std::array<std::array<double, 4>, 64>;

  // Four consecutive elements of one row (the 8-byte LDS read of warp_mma::load4).
  static std::array<double, 4> load4(const matrix& t, int row, int col) {
    return {t[row][col], t[row][col + 1], t[row][col + 2], t[row][col + 3]};
  }
  // sᵀ += b · bandᵀ: b's rows are the MFMA A operand, the band's rows its B operand (warp_mma::nt).
  static void nt(score& s, const matrix& a, int row0, const matrix& b) {
    for (int ks = 0; ks < D / 16; ++ks) {
      frag band{};
      for (int l = 0; l < 64; ++l) band[l] = load4(a, row0 + amd::operand_row(l), ks * 16 + amd::operand_k(l));
      for (int t = 0; t < 4; ++t) {
        frag rows{}, acc{};
        for (int l = 0; l < 64; ++l) {
          rows[l] = load4(b, t * 16 + amd::operand_row(l), ks * 16 + amd::operand_k(l));
          for (int i = 0; i < 4; ++i) acc[l][i] = s[l][t * 4 + i];
        }
        cdna::mfma(acc, rows, band);
        for (int l = 0; l < 64; ++l)
          for (int i = 0; i < 4; ++i) s[l][t * 4 + i] = acc[l][i];
      }
    }
  }
  // oᵀ += bᵀ · Pᵀ: Pᵀ is the score tile as it lies in registers (warp_mma::nn).
  static void nn(out& o, const score& p, const matrix& b) {
    for (int kk = 0; kk < 4; ++kk) {
      frag pf{};
      for (int l = 0; l < 64; ++l)
        for (int i = 0; i < 4; ++i) pf[l][i] = p[l][amd::p_elem(kk, i)];
      for (int dt = 0; dt < D / 16; ++dt) {
        frag bt{}, acc{};
        for (int l = 0; l < 64; ++l) {
          const int r = kk * 16 + amd::operand_k(l), c = dt * 16 + amd::operand_row(l);
          for (int i = 0; i < 4; ++i) bt[l][i] = b[r + i][c];
          for (int i = 0; i < 4; ++i) acc[l][i] = o[l][dt * 4 + i];
        }
        cdna::mfma(acc, bt, pf);
        for (int l = 0; l < 64; ++l)
          for (int i = 0; i < 4; ++i) o[l][dt * 4 + i] = acc[l][i];
      }
    }
  }
};

// Gathers a warp's tile (16 rows) from its lanes through elem_row / elem_col; every element exactly once.
template <class Layout, size_t Lanes, size_t Elems>
matrix gather(const std::array<std::array<double, Elems>, Lanes>& x, int cols) {
  matrix m(16, std::vector<double>(cols, 0.0));
  std::vector<std::vector<int>> seen(16, std::vector<int>(cols, 0));
  for (int l = 0; l < int(Lanes); ++l)
    for (int e = 0; e < int(Elems); ++e) {
      const int r = Layout::elem_row(l, e), c = Layout::elem_col(l, e);
      REQUIRE(r >= 0);
      REQUIRE(r < 16);
      REQUIRE(c >= 0);
      REQUIRE(c < cols);
      m[r][c] = x[l][e];
      ++seen[r][c];
    }
  for (const auto& row : seen)
    for (int n : row) REQUIRE(n == 1);
  return m;
}

struct nv_layout {
  static int elem_row(int l, int e) { return nv::elem_row(l, e); }
  static int elem_col(int l, int e) { return nv::elem_col(l, e); }
};
struct amd_layout {
  static int elem_row(int l, int e) { return amd::elem_row(l, e); }
  static int elem_col(int l, int e) { return amd::elem_col(l, e); }
};

matrix rows_of(const matrix& a, int row0, int n) { return matrix(a.begin() + row0, a.begin() + row0 + n); }

template <int D> void nvidia_layer(std::mt19937& rng) {
  using W = nv_warp<D>;
  const matrix q = random_matrix(64, D, rng), k = random_matrix(64, D, rng), v = random_matrix(64, D, rng);
  for (int row0 = 0; row0 < 64; row0 += 16) {
    typename W::score s{};
    W::nt(s, q, row0, k);
    const matrix expected_s = product(rows_of(q, row0, 16), transpose(k));
    CHECK(gather<nv_layout>(s, 64) == expected_s);

    typename W::out o{};
    W::nn(o, s, v);
    CHECK(gather<nv_layout>(o, D) == product(expected_s, v));
  }
}

template <int D> void amd_layer(std::mt19937& rng) {
  using W = amd_warp<D>;
  const matrix q = random_matrix(64, D, rng), k = random_matrix(64, D, rng), v = random_matrix(64, D, rng);
  for (int row0 = 0; row0 < 64; row0 += 16) {
    typename W::score s{};
    W::nt(s, q, row0, k);
    const matrix expected_s = product(rows_of(q, row0, 16), transpose(k));
    CHECK(gather<amd_layout>(s, 64) == expected_s);

    typename W::out o{};
    W::nn(o, s, v);
    CHECK(gather<amd_layout>(o, D) == product(expected_s, v));
  }
}

// The lanes a row reduction combines (xor with both masks) hold, between them, each column of one row once;
// exactly one of them is the row leader.
template <class Layout, int Lanes, int Elems, int Slots>
void check_row_groups(int mask0, int mask1, bool (*leader)(int), int (*slot_of)(int), int (*slot_row)(int, int)) {
  for (int l = 0; l < Lanes; ++l)
    for (int slot = 0; slot < Slots; ++slot) {
      const int row = slot_row(l, slot);
      std::set<int> cols;
      int leaders = 0, members = 0;
      for (int x : {0, mask0, mask1, mask0 ^ mask1}) {
        const int m = l ^ x;
        leaders += leader(m) ? 1 : 0;
        for (int e = 0; e < Elems; ++e) {
          if (slot_of(e) != slot) continue;
          REQUIRE(Layout::elem_row(m, e) == row);
          cols.insert(Layout::elem_col(m, e));
          ++members;
        }
      }
      CHECK(leaders == 1);
      CHECK(members == 64);
      CHECK(cols.size() == 64);
    }
}

} // namespace

TEST_CASE("nvidia lane layout: fragment functions are the PTX m16n8k16 tables", "[cpu]") {
  for (int l = 0; l < nv::lanes; ++l) {
    for (int i = 0; i < 8; ++i) {
      const auto rc = ptx::a_elem(l, i);
      CHECK(nv::a_row(l, i / 2) == rc.first);
      CHECK(nv::a_col(l, i / 2, i % 2) == rc.second);
    }
    for (int i = 0; i < 4; ++i) {
      const auto b = ptx::b_elem(l, i), c = ptx::c_elem(l, i);
      CHECK(nv::b_row(l, i / 2, i % 2) == b.first);
      CHECK(nv::b_col(l) == b.second);
      CHECK(nv::c_row(l, i) == c.first);
      CHECK(nv::c_col(l, i) == c.second);
    }
    for (int h = 0; h < 2; ++h)
      for (bool trans : {false, true}) {
        CHECK(nv::ldmatrix_frag_row(l, h, trans) == ptx::ldmatrix_row(l, h, trans));
        CHECK(nv::ldmatrix_frag_col(l, h, trans) == ptx::ldmatrix_col(l, h, trans));
      }
  }
}

TEST_CASE("nvidia lane layout: one mma.sync on fragments built by the header", "[cpu]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 8; ++trial) {
    const matrix a = random_matrix(16, 16, rng), b = random_matrix(16, 8, rng);
    std::array<std::array<reg2, 4>, 32> af{};
    std::array<std::array<reg2, 2>, 32> bf{};
    for (int l = 0; l < 32; ++l) {
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h) af[l][r][h] = a[nv::a_row(l, r)][nv::a_col(l, r, h)];
      for (int r = 0; r < 2; ++r)
        for (int h = 0; h < 2; ++h) bf[l][r][h] = b[nv::b_row(l, r, h)][nv::b_col(l)];
    }
    std::array<std::array<double, 4>, 32> d{};
    ptx::mma(d, af, bf);
    matrix got(16, std::vector<double>(8, 0.0));
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i) got[nv::c_row(l, i)][nv::c_col(l, i)] = d[l][i];
    CHECK(got == product(a, b));
  }
}

TEST_CASE("nvidia lane layout: warp-level nt and nn with P reused from the accumulators", "[cpu]") {
  std::mt19937 rng(11);
  nvidia_layer<64>(rng);
  nvidia_layer<128>(rng);
}

TEST_CASE("nvidia lane layout: row reductions over xor 1, 2", "[cpu]") {
  CHECK(nv::row_xor_mask(0) == 1);
  CHECK(nv::row_xor_mask(1) == 2);
  check_row_groups<nv_layout, 32, 32, 2>(
      nv::row_xor_mask(0), nv::row_xor_mask(1), [](int l) { return nv::row_leader(l); },
      [](int e) { return nv::elem_slot(e); }, [](int l, int s) { return nv::slot_row(l, s); });
}

TEST_CASE("amd lane layout: fragment functions are the CDNA 16x16x16 tables", "[cpu]") {
  for (int l = 0; l < amd::lanes; ++l)
    for (int i = 0; i < 4; ++i) {
      const auto a = cdna::a_elem(l, i), b = cdna::b_elem(l, i), c = cdna::c_elem(l, i);
      CHECK(amd::a_row(l) == a.first);
      CHECK(amd::a_col(l, i) == a.second);
      CHECK(amd::b_row(l, i) == b.first);
      CHECK(amd::b_col(l) == b.second);
      CHECK(amd::c_row(l, i) == c.first);
      CHECK(amd::c_col(l) == c.second);
    }
}

TEST_CASE("amd lane layout: one v_mfma_f32_16x16x16 on fragments built by the header", "[cpu]") {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 8; ++trial) {
    const matrix a = random_matrix(16, 16, rng), b = random_matrix(16, 16, rng);
    std::array<std::array<double, 4>, 64> af{}, bf{}, d{};
    for (int l = 0; l < 64; ++l)
      for (int i = 0; i < 4; ++i) {
        af[l][i] = a[amd::a_row(l)][amd::a_col(l, i)];
        bf[l][i] = b[amd::b_row(l, i)][amd::b_col(l)];
      }
    cdna::mfma(d, af, bf);
    matrix got(16, std::vector<double>(16, 0.0));
    for (int l = 0; l < 64; ++l)
      for (int i = 0; i < 4; ++i) got[amd::c_row(l, i)][amd::c_col(l)] = d[l][i];
    CHECK(got == product(a, b));
    // The accumulator lies like the B operand: the layer feeds it to the next product unchanged.
    for (int l = 0; l < 64; ++l)
      for (int i = 0; i < 4; ++i) {
        CHECK(amd::c_row(l, i) == amd::b_row(l, i));
        CHECK(amd::c_col(l) == amd::b_col(l));
      }
  }
}

TEST_CASE("amd lane layout: warp-level nt and nn computed transposed, Pᵀ from the accumulators", "[cpu]") {
  std::mt19937 rng(17);
  amd_layer<64>(rng);
  amd_layer<128>(rng);
}

TEST_CASE("amd lane layout: row reductions over xor 16, 32", "[cpu]") {
  CHECK(amd::row_xor_mask(0) == 16);
  CHECK(amd::row_xor_mask(1) == 32);
  check_row_groups<amd_layout, 64, 16, 1>(
      amd::row_xor_mask(0), amd::row_xor_mask(1), [](int l) { return amd::row_leader(l); },
      [](int e) { return amd::elem_slot(e); }, [](int l, int s) { return amd::slot_row(l, s); });
}
