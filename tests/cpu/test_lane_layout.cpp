// The lane layouts of both matrix-core backends (include/vsa/gpu/arch/lane_layout.hpp) against CPU models of
// the instructions. The models below are written from the ISA documents' tables, independently of the header:
// the header's fragments are fed to them and the results read back through the header's element mapping, so
// a wrong mapping gives a wrong product. The warp-level nt / nn of the matrix layer are replayed step by step
// with the same address and element functions the kernels call, and so is the online softmax of the attention
// forward: every lane of a warp (32 lanes) or wavefront (64, transposed), its row reductions over the
// header's xor masks, against softmax · V in double.
#include "support/catch.hpp"

#include <vsa/gpu/arch/lane_layout.hpp>
#include <vsa/gpu/arch/smem_layout.hpp>
#include <vsa/numeric.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
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

// A backend as the kernels see it through warp_mma: the header's element map and row reductions, plus
// warp_mma's lanes and row slots per lane.
struct nv_layout {
  static constexpr int lanes = nv::lanes, rows_per_lane = 2;
  template <int D> using warp = nv_warp<D>;
  static int elem_slot(int e) { return nv::elem_slot(e); }
  static int slot_row(int l, int s) { return nv::slot_row(l, s); }
  static int elem_row(int l, int e) { return nv::elem_row(l, e); }
  static int elem_col(int l, int e) { return nv::elem_col(l, e); }
  static int row_xor_mask(int step) { return nv::row_xor_mask(step); }
  static bool row_leader(int l) { return nv::row_leader(l); }
};
struct amd_layout {
  static constexpr int lanes = amd::lanes, rows_per_lane = 1;
  template <int D> using warp = amd_warp<D>;
  static int elem_slot(int e) { return amd::elem_slot(e); }
  static int slot_row(int l, int s) { return amd::slot_row(l, s); }
  static int elem_row(int l, int e) { return amd::elem_row(l, e); }
  static int elem_col(int l, int e) { return amd::elem_col(l, e); }
  static int row_xor_mask(int step) { return amd::row_xor_mask(step); }
  static bool row_leader(int l) { return amd::row_leader(l); }
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

// ---- the online softmax of attention_forward_kernel, every lane of one warp ----
//
// Per lane and row slot the kernel keeps the running maximum m (scaled scores, base 2) and a partial row sum
// l; row_max combines the lanes of a row each key tile, row_sum only once at the end (the lanes of a row
// agree on m, so their partial sums share one scale). The replay runs these steps for all lanes at once, in
// fp32 with exp2 as the kernel does, shfl_xor exchanging values across the whole warp, and nt / nn as the
// layer models above. P is not rounded to the element type before nn: what is checked here is which lane
// combines with which and when, not precision.

template <class L> using lane_values = std::array<float, L::lanes>;

// shfl_xor over the whole warp: every lane receives what lane ^ mask held before the exchange.
template <class L> lane_values<L> shfl_xor(const lane_values<L>& v, int mask) {
  lane_values<L> r{};
  for (int l = 0; l < L::lanes; ++l) {
    REQUIRE((l ^ mask) < L::lanes);
    r[l] = v[l ^ mask];
  }
  return r;
}
// warp_mma::row_max and row_sum: xor row_xor_mask(0), then row_xor_mask(1).
template <class L> lane_values<L> row_max(lane_values<L> v) {
  for (int step = 0; step < 2; ++step) {
    const lane_values<L> o = shfl_xor<L>(v, L::row_xor_mask(step));
    for (int l = 0; l < L::lanes; ++l) v[l] = std::fmax(v[l], o[l]);
  }
  return v;
}
template <class L> lane_values<L> row_sum(lane_values<L> v) {
  for (int step = 0; step < 2; ++step) {
    const lane_values<L> o = shfl_xor<L>(v, L::row_xor_mask(step));
    for (int l = 0; l < L::lanes; ++l) v[l] = v[l] + o[l];
  }
  return v;
}

// One warp's band (rows row0 … row0 + 15 of a 64-row query tile) against a list of key tiles. Rows at or
// past q_valid and key rows at or past kv[t] are zero, as copy_tile leaves them. The kernels mask by key
// column (c < kv[t]) only; here rows are also taken out of whole tiles, so that one band holds rows whose
// keys are all masked so far (m = -inf: the base = 0 guard, then alpha = 0), rows with a hole in the
// middle (alpha = 1 on an all-masked tile) and rows that attend nothing (l = 0: o = 0, lse = +inf).
struct band_problem {
  int d = 0, row0 = 0, q_valid = 64;
  float scale = 0.f;
  matrix q;
  std::vector<matrix> k, v;
  std::vector<int> kv;
  static bool dead(int row) { return row % 7 == 3; }
  static bool attends(int row, int t) { return !dead(row) && t >= row % 3 && !(t == 2 && row % 5 == 0); }
};

band_problem random_band(int d, int row0, int q_valid, std::vector<int> kv, std::mt19937& rng) {
  band_problem b;
  b.d = d;
  b.row0 = row0;
  b.q_valid = q_valid;
  b.scale = 1.f / (8.f * std::sqrt(float(d))); // scores of the small-integer inputs spread over a few units
  b.kv = std::move(kv);
  b.q = random_matrix(64, d, rng);
  for (int r = q_valid; r < 64; ++r) std::fill(b.q[r].begin(), b.q[r].end(), 0.0);
  for (int valid : b.kv) {
    b.k.push_back(random_matrix(64, d, rng));
    b.v.push_back(random_matrix(64, d, rng));
    for (int r = valid; r < 64; ++r) {
      std::fill(b.k.back()[r].begin(), b.k.back()[r].end(), 0.0);
      std::fill(b.v.back()[r].begin(), b.v.back()[r].end(), 0.0);
    }
  }
  return b;
}

// The band's output, natural-log lse and, per key tile, the probabilities P.
struct band_result {
  matrix o;
  std::vector<double> lse;
  std::vector<matrix> p;
};

// softmax(scale · q kᵀ) · v over every attended key, in double; rows past q_valid or without a key: o = 0,
// lse = +inf, P = 0.
band_result reference_band(const band_problem& b) {
  const size_t tiles = b.k.size();
  band_result r{matrix(16, std::vector<double>(b.d, 0.0)),
                std::vector<double>(16, std::numeric_limits<double>::infinity()),
                std::vector<matrix>(tiles, matrix(16, std::vector<double>(64, 0.0)))};
  for (int i = 0; i < 16; ++i) {
    const int row = b.row0 + i;
    if (row >= b.q_valid) continue;
    matrix s(tiles, std::vector<double>(64, 0.0));
    double mx = -std::numeric_limits<double>::infinity();
    for (size_t t = 0; t < tiles; ++t)
      for (int c = 0; c < b.kv[t]; ++c) {
        if (!band_problem::attends(row, int(t))) continue;
        double x = 0.0;
        for (int j = 0; j < b.d; ++j) x += b.q[row][j] * b.k[t][c][j];
        s[t][c] = x * double(b.scale);
        mx = std::max(mx, s[t][c]);
      }
    if (mx == -std::numeric_limits<double>::infinity()) continue;
    double z = 0.0;
    for (size_t t = 0; t < tiles; ++t)
      for (int c = 0; c < b.kv[t]; ++c)
        if (band_problem::attends(row, int(t))) z += std::exp(s[t][c] - mx);
    for (size_t t = 0; t < tiles; ++t)
      for (int c = 0; c < b.kv[t]; ++c) {
        if (!band_problem::attends(row, int(t))) continue;
        const double pr = std::exp(s[t][c] - mx) / z;
        r.p[t][i][c] = pr;
        for (int j = 0; j < b.d; ++j) r.o[i][j] += pr * b.v[t][c][j];
      }
    r.lse[i] = mx + std::log(z);
  }
  return r;
}

// attention_forward_kernel's loop and epilogue for one warp, then the dq kernel's recomputation of P from
// the lse of each lane's rows.
template <class L, int D> band_result replay_band(const band_problem& b) {
  using W = typename L::template warp<D>;
  constexpr int R = L::rows_per_lane;
  constexpr float inf = std::numeric_limits<float>::infinity(), log2e = 1.4426950408889634f;
  using slots = std::array<std::array<float, R>, L::lanes>;
  const float scale_log2 = b.scale * log2e;
  const size_t tiles = b.k.size();
  for (int e = 0; e < W::score_elems; ++e) REQUIRE(L::elem_slot(e) < R);

  slots m{}, l{};
  for (auto& x : m) x.fill(-inf);
  typename W::out o{};
  for (size_t t = 0; t < tiles; ++t) {
    typename W::score s{};
    W::nt(s, b.q, b.row0, b.k[t]);
    std::array<std::array<float, W::score_elems>, L::lanes> x{};
    slots mx{}, base{}, alpha{}, sum{};
    for (auto& y : mx) y.fill(-inf);
    for (int ln = 0; ln < L::lanes; ++ln)
      for (int e = 0; e < W::score_elems; ++e) {
        const int row = b.row0 + L::elem_row(ln, e), col = L::elem_col(ln, e);
        const bool keep = col < b.kv[t] && band_problem::attends(row, int(t));
        x[ln][e] = keep ? float(s[ln][e]) * scale_log2 : -inf;
        float& mr = mx[ln][L::elem_slot(e)];
        mr = std::fmax(mr, x[ln][e]);
      }
    for (int r = 0; r < R; ++r) {
      lane_values<L> v{};
      for (int ln = 0; ln < L::lanes; ++ln) v[ln] = mx[ln][r];
      v = row_max<L>(v);
      for (int ln = 0; ln < L::lanes; ++ln) {
        const float mnew = std::fmax(m[ln][r], v[ln]);
        base[ln][r] = mnew == -inf ? 0.f : mnew;
        alpha[ln][r] = std::exp2(m[ln][r] - base[ln][r]);
        m[ln][r] = mnew;
      }
    }
    typename W::score pr{};
    for (int ln = 0; ln < L::lanes; ++ln)
      for (int e = 0; e < W::score_elems; ++e) {
        const float y = std::exp2(x[ln][e] - base[ln][L::elem_slot(e)]);
        sum[ln][L::elem_slot(e)] += y;
        pr[ln][e] = y;
      }
    for (int ln = 0; ln < L::lanes; ++ln) {
      for (int r = 0; r < R; ++r) l[ln][r] = l[ln][r] * alpha[ln][r] + sum[ln][r];
      for (int e = 0; e < W::out_elems; ++e) o[ln][e] *= alpha[ln][L::elem_slot(e)];
    }
    W::nn(o, pr, b.v[t]);
  }

  // Epilogue: one reduction of the partial sums; every lane of a row must hold the same m and total, and
  // exactly one of them (the row leader) writes the row's lse.
  band_result res{matrix(), std::vector<double>(16, std::nan("")), {}};
  std::vector<int> writes(16, 0);
  std::vector<float> row_m(16, std::nanf("")), row_total(16, std::nanf(""));
  slots inv{};
  for (int r = 0; r < R; ++r) {
    lane_values<L> v{};
    for (int ln = 0; ln < L::lanes; ++ln) v[ln] = l[ln][r];
    const lane_values<L> total = row_sum<L>(v);
    for (int ln = 0; ln < L::lanes; ++ln) {
      const int i = L::slot_row(ln, r), row = b.row0 + i;
      REQUIRE(i >= 0);
      REQUIRE(i < 16);
      if (std::isnan(row_total[i])) {
        row_m[i] = m[ln][r];
        row_total[i] = total[ln];
      }
      CHECK(std::memcmp(&row_m[i], &m[ln][r], sizeof(float)) == 0);
      CHECK(std::memcmp(&row_total[i], &total[ln], sizeof(float)) == 0);
      const bool live = row < b.q_valid && total[ln] > 0.f;
      inv[ln][r] = live ? 1.f / total[ln] : 0.f;
      if (L::row_leader(ln)) {
        res.lse[i] = live ? (m[ln][r] + std::log2(total[ln])) * vsa::ln_2 : inf;
        ++writes[i];
      }
    }
  }
  for (int n : writes) CHECK(n == 1);
  for (int ln = 0; ln < L::lanes; ++ln)
    for (int e = 0; e < W::out_elems; ++e) o[ln][e] *= inv[ln][L::elem_slot(e)];
  res.o = gather<L>(o, D);

  // The backward kernels mask by key column only and read the lse of each lane's row slots: rows without
  // a key and padding rows must get P = 0 from lse = +inf alone.
  slots lse2{};
  for (int ln = 0; ln < L::lanes; ++ln)
    for (int r = 0; r < R; ++r) {
      const int i = L::slot_row(ln, r);
      lse2[ln][r] = b.row0 + i < b.q_valid ? float(res.lse[i]) * log2e : inf;
    }
  for (size_t t = 0; t < tiles; ++t) {
    typename W::score s{}, pr{};
    W::nt(s, b.q, b.row0, b.k[t]);
    for (int ln = 0; ln < L::lanes; ++ln)
      for (int e = 0; e < W::score_elems; ++e) {
        const int row = b.row0 + L::elem_row(ln, e), col = L::elem_col(ln, e);
        const bool keep =
            col < b.kv[t] && (band_problem::attends(row, int(t)) || band_problem::dead(row) || row >= b.q_valid);
        pr[ln][e] = keep ? std::exp2(float(s[ln][e]) * scale_log2 - lse2[ln][L::elem_slot(e)]) : 0.f;
      }
    res.p.push_back(gather<L>(pr, 64));
  }
  return res;
}

// Outputs within fp32 rounding of the reference; rows without a key exactly 0 and +inf.
void check_band(const band_result& got, const band_result& want) {
  for (int i = 0; i < 16; ++i) {
    INFO("band row " << i);
    if (std::isinf(want.lse[i])) {
      CHECK(got.lse[i] == want.lse[i]);
      for (double x : got.o[i]) CHECK(x == 0.0);
    } else {
      CHECK(std::fabs(got.lse[i] - want.lse[i]) <= 1e-5 * (1.0 + std::fabs(want.lse[i])));
      for (size_t j = 0; j < got.o[i].size(); ++j) CHECK(std::fabs(got.o[i][j] - want.o[i][j]) <= 1e-4);
    }
    for (size_t t = 0; t < want.p.size(); ++t)
      for (int c = 0; c < 64; ++c) {
        if (want.p[t][i][c] == 0.0)
          CHECK(got.p[t][i][c] == 0.0);
        else
          CHECK(std::fabs(got.p[t][i][c] - want.p[t][i][c]) <= 1e-5);
      }
  }
}

// Every band of a query tile, full and partial, against key tiles with partial valid counts, and with no
// key tile at all.
template <class L, int D> void online_softmax(std::mt19937& rng) {
  const std::vector<std::vector<int>> lists = {{64, 37, 64, 9}, {5, 64}, {}};
  for (const auto& kv : lists)
    for (int q_valid : {64, 50, 1})
      for (int row0 = 0; row0 < 64; row0 += 16) {
        INFO("D " << D << ", " << kv.size() << " key tiles, q_valid " << q_valid << ", row0 " << row0);
        const band_problem b = random_band(D, row0, q_valid, kv, rng);
        check_band(replay_band<L, D>(b), reference_band(b));
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

// The mma.sync backend gives ldmatrix the chunk's place as the lane's part plus a constant (warp_mma::frag_address):
// for every load the layer makes (A rows, nt's B, nn's B) the two must add up to the tile's own placement.
TEST_CASE("nvidia lane layout: the split ldmatrix address is the tile's chunk placement", "[cpu]") {
  namespace sl = vsa::gpu::smem_layout;
  struct load {
    int (*row)(int);
    int (*chunk)(int);
  };
  const load loads[] = {{nv::a_load_row, nv::a_load_chunk},
                        {nv::nt_b_load_row, nv::nt_b_load_chunk},
                        {nv::nn_b_load_row, nv::nn_b_load_chunk}};
  int checked = 0;
  for (const load& ld : loads)
    for (int d : {64, 128, 256})
      for (int r0 = 0; r0 + 16 <= vsa::gpu::tile_rows; r0 += 8)
        for (int s = 0; s < d / 16; ++s)
          for (int l = 0; l < 32; ++l) {
            const int lr = ld.row(l), lc = ld.chunk(l);
            const int split = sl::panel_lane_part(lr, lc, s & 3) + sl::panel_step_part(r0, s);
            if (split != sl::panel_chunk_offset(r0 + lr, 2 * s + lc)) {
              CAPTURE(d, r0, s, l);
              CHECK(split == sl::panel_chunk_offset(r0 + lr, 2 * s + lc));
            }
            ++checked;
          }
  CHECK(checked == 3 * (4 + 8 + 16) * 7 * 32);
}

TEST_CASE("nvidia lane layout: row reductions over xor 1, 2", "[cpu]") {
  CHECK(nv::row_xor_mask(0) == 1);
  CHECK(nv::row_xor_mask(1) == 2);
  check_row_groups<nv_layout, 32, 32, 2>(
      nv::row_xor_mask(0), nv::row_xor_mask(1), [](int l) { return nv::row_leader(l); },
      [](int e) { return nv::elem_slot(e); }, [](int l, int s) { return nv::slot_row(l, s); });
}

// dk/dv stores dS for dq (warp_mma::pack_rows, store_transposed): warp kk holds dSᵀ of keys 16kk … in the accumulator
// layout, rounds it once to the A fragments of dK's product (p_elem), zeroing the keys at or past the tile's valid
// count by the fragment's rows (a_row), transposes register ds_frag_reg(r) of k step `band` with movmatrix.trans for
// register r and stores the registers at ds_chunk; dq's warp w must read there its A fragment of dS, rows 16w …
// (queries), k step kk (keys), with zeros at the padding keys.
TEST_CASE("nvidia lane layout: dS stored through movmatrix.trans is dq's A operand", "[cpu]") {
  std::mt19937 rng(13);
  const matrix ds = random_matrix(64, 64, rng); // rows queries, columns keys
  // movmatrix.m8n8.trans.b16 (PTX ISA): lane l gives row l / 4, columns 2(l mod 4), +1 of an 8 × 8 matrix and
  // receives the same places of its transpose.
  const auto movmatrix = [](const std::array<reg2, 32>& in) {
    double m[8][8];
    for (int l = 0; l < 32; ++l)
      for (int h = 0; h < 2; ++h) m[l / 4][2 * (l % 4) + h] = in[l][h];
    std::array<reg2, 32> out{};
    for (int l = 0; l < 32; ++l)
      for (int h = 0; h < 2; ++h) out[l][h] = m[2 * (l % 4) + h][l / 4];
    return out;
  };
  for (int l = 0; l < 32; ++l)
    for (int h = 0; h < 2; ++h) {
      CHECK(nv::movmatrix_src_row(l, h) == 2 * (l % 4) + h);
      CHECK(nv::movmatrix_src_col(l) == l / 4);
    }
  // The zeroing goes by the A register's rows: both halves of register r are elements of row a_row(l, r).
  for (int l = 0; l < 32; ++l)
    for (int kk = 0; kk < 4; ++kk)
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h) CHECK(nv::elem_row(l, nv::p_elem(kk, r, h)) == nv::a_row(l, r));
  for (int valid : {64, 49, 33, 16, 7, 1}) {
    std::vector<std::array<reg2, 4>> slot(64 * 64 / 8, std::array<reg2, 4>{});
    std::vector<int> writes(slot.size(), 0);
    for (int kk = 0; kk < 4; ++kk) { // dk/dv's warps: the A fragments of dK's product, padding keys zeroed
      std::array<std::array<std::array<reg2, 4>, 4>, 32> frag{};
      for (int l = 0; l < 32; ++l)
        for (int band = 0; band < 4; ++band)
          for (int r = 0; r < 4; ++r)
            for (int h = 0; h < 2; ++h) {
              const int e = nv::p_elem(band, r, h);
              const int key = 16 * kk + nv::elem_row(l, e), query = nv::elem_col(l, e);
              frag[l][band][r][h] = 16 * kk + nv::a_row(l, r) < valid ? ds[query][key] : 0.0; // dSᵀ's accumulator
            }
      for (int band = 0; band < 4; ++band)
        for (int r = 0; r < 4; ++r) {
          std::array<reg2, 32> packed{};
          for (int l = 0; l < 32; ++l) packed[l] = frag[l][band][nv::ds_frag_reg(r)];
          const std::array<reg2, 32> t = movmatrix(packed);
          for (int l = 0; l < 32; ++l) {
            slot[nv::ds_chunk(band, kk, l)][r] = t[l];
            if (r == 0) ++writes[nv::ds_chunk(band, kk, l)];
          }
        }
    }
    CHECK(std::all_of(writes.begin(), writes.end(), [](int w) { return w == 1; })); // every chunk once
    int wrong = 0;
    for (int band = 0; band < 4; ++band) // dq's warps
      for (int kk = 0; kk < 4; ++kk)
        for (int l = 0; l < 32; ++l)
          for (int r = 0; r < 4; ++r)
            for (int h = 0; h < 2; ++h) {
              const int query = 16 * band + nv::a_row(l, r), key = 16 * kk + nv::a_col(l, r, h);
              if (slot[nv::ds_chunk(band, kk, l)][r][h] != (key < valid ? ds[query][key] : 0.0)) ++wrong;
            }
    CHECK(wrong == 0);
  }
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

TEST_CASE("nvidia lane layout: online softmax of every lane against softmax · V in double", "[cpu]") {
  std::mt19937 rng(19);
  online_softmax<nv_layout, 64>(rng);
  online_softmax<nv_layout, 128>(rng);
}

TEST_CASE("amd lane layout: online softmax of every lane, computed transposed, against softmax · V in double",
          "[cpu]") {
  std::mt19937 rng(23);
  online_softmax<amd_layout, 64>(rng);
  online_softmax<amd_layout, 128>(rng);
}

// The coarse pass stores the scores two at a time (attention_forward.hpp): accumulator elements e and e + 1,
// e even, must be neighbours in one row in every layout (the Hopper accumulator uses the NVIDIA one).
TEST_CASE("accumulator elements pair up as row neighbours", "[cpu]") {
  for (int l = 0; l < nv::lanes; ++l)
    for (int e = 0; e < 32; e += 2) {
      CHECK(nv::elem_row(l, e + 1) == nv::elem_row(l, e));
      CHECK(nv::elem_col(l, e + 1) == nv::elem_col(l, e) + 1);
    }
  for (int l = 0; l < amd::lanes; ++l)
    for (int e = 0; e < 16; e += 2) {
      CHECK(amd::elem_row(l, e + 1) == amd::elem_row(l, e));
      CHECK(amd::elem_col(l, e + 1) == amd::elem_col(l, e) + 1);
    }
}

// V stored transposed for the MFMA backend's nn_t (smem_layout::transposed_*): every thread's block of the copy,
// transposed in registers and stored as eight 8-byte units, then read back as nn_t's A operands, gives each lane
// B's rows operand_k … +3 at column operand_row; the tile is written exactly once, and the 16 lanes of a store or a
// read that share a unit index touch 16 different 8-byte units (all 32 banks).
template <int D> void amd_transposed_tile(std::mt19937& rng) {
  namespace sl = vsa::gpu::smem_layout;
  std::uniform_int_distribution<uint32_t> bits(0, 0xffff);
  std::vector<std::vector<uint16_t>> v(64, std::vector<uint16_t>(D));
  for (auto& row : v)
    for (auto& x : row) x = static_cast<uint16_t>(bits(rng));
  std::vector<uint16_t> lds(64 * D, 0);
  std::vector<int> written(64 * D, 0);
  constexpr int chunks = D / 8;
  for (int blk = 0; blk < 16 * chunks; ++blk) {
    const int u = sl::transposed_block_unit(blk), c = sl::transposed_block_chunk(blk);
    uint32_t in[4][4];
    for (int k = 0; k < 4; ++k)
      for (int w = 0; w < 4; ++w)
        in[k][w] = uint32_t(v[4 * u + k][8 * c + 2 * w]) | (uint32_t(v[4 * u + k][8 * c + 2 * w + 1]) << 16);
    for (int i = 0; i < 8; ++i) {
      const int off = sl::transposed_offset(8 * c + i, u);
      REQUIRE(off % 4 == 0);
      for (int h = 0; h < 2; ++h) {
        const uint32_t word = sl::transposed_word(in, i, h);
        lds[off + 2 * h] = static_cast<uint16_t>(word & 0xffff),
                      lds[off + 2 * h + 1] = static_cast<uint16_t>(word >> 16);
        ++written[off + 2 * h], ++written[off + 2 * h + 1];
      }
    }
  }
  for (int n : written) REQUIRE(n == 1);
  for (int kk = 0; kk < 4; ++kk)
    for (int dt = 0; dt < D / 16; ++dt)
      for (int l = 0; l < amd::lanes; ++l) {
        const int r = kk * 16 + amd::operand_k(l), col = dt * 16 + amd::operand_row(l);
        const int off = sl::transposed_offset(col, r / sl::transposed_unit);
        for (int i = 0; i < 4; ++i) CHECK(lds[off + i] == v[r + i][col]);
      }
  // Banks: a read's 16 lanes l mod 16 share the unit; a store's 16 consecutive blocks share the chunk.
  for (int u = 0; u < 16; ++u)
    for (int col0 = 0; col0 < D; col0 += 16) {
      std::set<int> units;
      for (int j = 0; j < 16; ++j) units.insert((sl::transposed_offset(col0 + j, u) / 4) % 16);
      CHECK(units.size() == 16);
    }
  for (int blk0 = 0; blk0 < 16 * chunks; blk0 += 16)
    for (int i = 0; i < 8; ++i) {
      std::set<int> units;
      for (int b = blk0; b < blk0 + 16; ++b)
        units.insert((sl::transposed_offset(8 * sl::transposed_block_chunk(b) + i, sl::transposed_block_unit(b)) / 4) %
                     16);
      CHECK(units.size() == 16);
    }
}

TEST_CASE("amd lane layout: V stored transposed is read as nn's A operands, conflict-free", "[cpu]") {
  std::mt19937 rng(29);
  amd_transposed_tile<64>(rng);
  amd_transposed_tile<128>(rng);
}

// The MFMA backend and AMD's tile copy address a tile as a pointer of the lane's plus a constant that becomes the
// instruction's immediate offset (amd_mfma.hpp: load_operand, nn, nn_t; matrix.hpp: copy_tile): for every load they
// make the two must add up to the tile's own placement of the element (smem_layout::row_chunk_offset,
// transposed_offset), and the constant must fit the 16-bit byte offset of ds_read and ds_write.
template <int D> int amd_split_addresses() {
  namespace sl = vsa::gpu::smem_layout;
  const auto placed = [](int row, int col) { return sl::row_chunk_offset(D, row, col >> 3) + (col & 7); };
  const auto immediate = [](int step) { return step >= 0 && 2 * step < (1 << 16); };
  int checked = 0;
  for (int l = 0; l < amd::lanes; ++l) {
    const int lr = amd::operand_row(l), lk = amd::operand_k(l);
    // nt's operands (load_operand): rows r0 + operand_row, r0 a band (row0) or a 16-row block of b, k step ks.
    for (int r0 = 0; r0 < vsa::gpu::tile_rows; r0 += 16)
      for (int ks = 0; ks < D / 16; ++ks) {
        const int step = sl::row_step_part(D, r0, 0);
        for (int i = 0; i < 4; ++i) // the 8-byte read's four elements, in order
          CHECK(sl::row_lane_part(D, lr, 16 * ks + lk) + step + i == placed(r0 + lr, 16 * ks + lk + i));
        CHECK(immediate(step));
        ++checked;
      }
    // nn's B operand (row-major: dq's K, dk/dv's Q and dO): rows 16kk + operand_k + i of column 16dt + operand_row,
    // at the lane's pointer for x = 2(dt mod 4) ^ i.
    for (int kk = 0; kk < 4; ++kk)
      for (int dt = 0; dt < D / 16; ++dt)
        for (int i = 0; i < 4; ++i) {
          const int x = (2 * (dt & 3)) ^ i;
          const int step = sl::row_step_part(D, 16 * kk, 64 * (dt >> 2)) + i * D;
          CHECK(sl::row_lane_part(D, lk, (8 * x) ^ lr) + step == placed(16 * kk + lk + i, 16 * dt + lr));
          CHECK(immediate(step));
          ++checked;
        }
    // nn_t's B operand (V stored transposed): unit (16kk + operand_k) / 4 of column 16dt + operand_row.
    for (int kk = 0; kk < 4; ++kk)
      for (int dt = 0; dt < D / 16; ++dt) {
        const int u = (16 * kk + lk) / sl::transposed_unit, step = sl::transposed_step_part(16 * dt);
        CHECK(sl::transposed_offset(lr, u) + step == sl::transposed_offset(16 * dt + lr, u));
        CHECK(immediate(step));
        ++checked;
      }
  }
  // copy_tile's whole tiles: thread tid keeps chunk column tid mod chunks and steps by `rows` rows; every chunk of the
  // tile is written once.
  constexpr int chunks = D / 8;
  for (int nthreads : {128, 256, 512}) {
    const int rows = nthreads / chunks;
    if (nthreads % chunks != 0 || rows % 8 != 0 || vsa::gpu::tile_rows % rows != 0) continue;
    std::vector<int> written(vsa::gpu::tile_rows * chunks, 0);
    for (int tid = 0; tid < nthreads; ++tid) {
      const int c = tid % chunks, r0 = tid / chunks;
      for (int k = 0; k < vsa::gpu::tile_rows / rows; ++k) {
        const int step = sl::row_step_part(D, k * rows, 0);
        const int at = sl::row_chunk_offset(D, r0, c) + step;
        CHECK(at == sl::row_chunk_offset(D, r0 + k * rows, c));
        CHECK(immediate(step));
        ++written[at / 8];
        ++checked;
      }
    }
    CHECK(std::all_of(written.begin(), written.end(), [](int w) { return w == 1; }));
  }
  return checked;
}

TEST_CASE("amd lane layout: the split fragment and copy addresses are the tile's placement", "[cpu]") {
  // Per lane: nt 4 · D/16, nn 4 · D/16 · 4, nn_t 4 · D/16; copy_tile: 64 · D/8 chunks for each thread count (at
  // D = 64 and 128 all three step by whole groups of 8 rows).
  CHECK(amd_split_addresses<64>() == 64 * (16 + 64 + 16) + 3 * 512);
  CHECK(amd_split_addresses<128>() == 64 * (32 + 128 + 32) + 3 * 1024);
}
