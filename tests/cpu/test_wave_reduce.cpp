// The shuffle reductions of the linear-attention kernels whose lanes depend on the warp size
// (include/vsa/gpu/detail/linear/common.hpp and features.hpp), replayed on the host with the lane arithmetic they
// take from include/vsa/gpu/arch/wave_reduce.hpp, for 32-lane warps and 64-lane wavefronts alike:
//   block_max   a butterfly over the whole warp, then one partial per warp through shared memory folded in
//               slot order, or nothing more for a block of a single wavefront (AMD with D = 64);
//   state φ     the softmax feature map's pass over K, where `tpr` consecutive threads share a row and merge
//               their (running maximum, sum of exponentials) pairs over a butterfly inside the row's group.
// Every thread of a block is modelled. shfl_xor exchanges values within each warp as the hardware does, and a
// mask that would reach past the warp fails the test. Results are compared with a plain reduction of the same
// values, on random inputs with ±inf and NaN where the kernels meet them.
#include "support/catch.hpp"

#include <vsa/gpu/arch/wave_reduce.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace {

namespace wr = vsa::gpu::wave_reduce;

constexpr float inf = std::numeric_limits<float>::infinity();
constexpr float qnan = std::numeric_limits<float>::quiet_NaN();
constexpr float log2e = 1.4426950408889634f;

// Equal values, or both NaN. fmax of +0 and -0 may return either zero; == takes them as equal.
bool same(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

// shfl_xor(v, mask) executed by every thread of a block at once: the thread at lane l of its warp receives
// what lane l ^ mask of the same warp held before the exchange.
std::vector<float> shfl_xor(const std::vector<float>& v, int mask, int lanes) {
  std::vector<float> r(v.size());
  for (size_t t = 0; t < v.size(); ++t) {
    const int lane = static_cast<int>(t % lanes), src = lane ^ mask;
    if (mask <= 0 || src >= lanes) FAIL("shfl_xor mask " << mask << " leaves a warp of " << lanes << " lanes");
    r[t] = v[t - lane + src];
  }
  return r;
}

// fmaxf over values in the order given; NaN is dropped unless every value is NaN.
float plain_max(const float* x, int n) {
  float r = x[0];
  for (int i = 1; i < n; ++i) r = std::fmax(r, x[i]);
  return r;
}

// ---- block_max ---------------------------------------------------------------------------------------------

// block_max<D> for one block of D = v.size() threads: what each thread returns. Checks on the way that every
// lane holds its warp's maximum after the butterfly and that each shared slot is written exactly once.
std::vector<float> replay_block_max(const std::vector<float>& in, int lanes) {
  const int threads = static_cast<int>(in.size());
  REQUIRE(wr::block_whole_warps(threads, lanes));
  std::vector<float> v = in;
  for (int s = 0; s < wr::warp_steps(lanes); ++s) {
    const std::vector<float> o = shfl_xor(v, wr::warp_mask(lanes, s), lanes);
    for (int t = 0; t < threads; ++t) v[t] = std::fmax(v[t], o[t]);
  }
  for (int t = 0; t < threads; ++t)
    if (!same(v[t], plain_max(&in[t - t % lanes], lanes))) FAIL("thread " << t << " lacks its warp's maximum");

  const int warps = wr::block_warps(threads, lanes);
  if (warps == 1) return v;
  std::vector<float> scratch(warps, qnan);
  std::vector<int> writes(warps, 0);
  for (unsigned t = 0; t < unsigned(threads); ++t)
    if (wr::block_slot_writer(t, lanes)) {
      const unsigned slot = wr::block_slot(t, lanes);
      REQUIRE(slot < unsigned(warps));
      scratch[slot] = v[t];
      ++writes[slot];
    }
  for (int n : writes) CHECK(n == 1);
  // After the barrier every thread folds the slots in slot order.
  std::vector<float> r(threads);
  for (int t = 0; t < threads; ++t) r[t] = plain_max(scratch.data(), warps);
  return r;
}

void check_block_max(const std::vector<float>& v, int lanes) {
  const float want = plain_max(v.data(), static_cast<int>(v.size()));
  const std::vector<float> got = replay_block_max(v, lanes);
  for (size_t t = 0; t < got.size(); ++t)
    if (!same(got[t], want)) FAIL("thread " << t << ": " << got[t] << ", the block's maximum is " << want);
}

// The kernels launch block_max with D = 64 and 128 threads (one thread per column of the state); 256 adds a
// block of four wavefronts. The kernels pass |x|, but the reduction is checked for any sign.
void block_max_cases(int lanes, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 4.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  for (int threads : {64, 128, 256}) {
    INFO(lanes << " lanes, " << threads << " threads");
    const auto fill = [&](std::vector<float>& v) {
      for (float& x : v) x = normal(rng);
    };
    std::vector<float> v(threads);
    // Plain values; then NaN and -inf sprinkled, and their absolute values as the kernels pass them.
    for (int trial = 0; trial < 50; ++trial) {
      fill(v);
      check_block_max(v, lanes);
      for (float& x : v) {
        const float u = unit(rng);
        x = u < 0.1f ? qnan : u < 0.2f ? -inf : x;
      }
      check_block_max(v, lanes);
      for (float& x : v) x = std::fabs(x);
      check_block_max(v, lanes);
    }
    // The maximum (a finite value, then +inf) at every thread in turn: each lane's value must reach all.
    for (int t = 0; t < threads; ++t) {
      fill(v);
      v[t] = 100.f;
      check_block_max(v, lanes);
      v[t] = inf;
      check_block_max(v, lanes);
    }
    // One whole warp of NaN: the others decide. Every value NaN: NaN. Every value -inf: -inf.
    for (int w = 0; w < threads / lanes; ++w) {
      fill(v);
      for (int l = 0; l < lanes; ++l) v[w * lanes + l] = qnan;
      check_block_max(v, lanes);
    }
    v.assign(threads, qnan);
    check_block_max(v, lanes);
    v.assign(threads, -inf);
    check_block_max(v, lanes);
  }
}

// ---- groups of consecutive threads ---------------------------------------------------------------------

// Every power-of-two group width up to the warp: after the butterfly each thread holds the sum of its group
// (small integers, exact in float), whatever the position of a value in the group.
void group_sums(int lanes, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(0, 1000);
  for (int width = 1; width <= lanes; width *= 2) {
    INFO(lanes << " lanes, groups of " << width);
    REQUIRE(wr::group_fits(width, lanes));
    const int threads = 4 * lanes;
    std::vector<float> v(threads), want(threads / width, 0.f);
    for (int t = 0; t < threads; ++t) {
      v[t] = static_cast<float>(dist(rng));
      const int item = wr::group_item(t, width);
      REQUIRE(item == t / width); // consecutive threads
      want[item] += v[t];
    }
    for (int s = 0; s < wr::group_steps(width); ++s) {
      const std::vector<float> o = shfl_xor(v, wr::group_mask(s), lanes);
      for (int t = 0; t < threads; ++t) v[t] += o[t];
    }
    for (int t = 0; t < threads; ++t)
      if (v[t] != want[t / width]) FAIL("thread " << t << ": " << v[t] << ", its group's sum is " << want[t / width]);
  }
  CHECK_FALSE(wr::group_fits(3, lanes));
  CHECK_FALSE(wr::group_fits(2 * lanes, lanes));
}

// ---- the state kernel's softmax partials -------------------------------------------------------------------
//
// 64 rows of D values, tpr threads a row (the kernel's tpr is threads / 64: 2 for D = 64 and 4 for D = 128 on
// 32-lane warps, 4 for both on 64-lane wavefronts; every power of two that leaves a thread at least one
// chunk is run). Part p of a row reads its chunks of 8 values in the kernel's order, p + tpr·((j + row) mod
// cpt), keeping the running maximum of x·log2(e) and the sum of 2^(x·log2(e) − max); the row's partials are
// then merged over the group butterfly. Every thread of a row must end with the same pair: the row's maximum,
// and its sum within fp32 rounding of the sum in double.

struct softmax_partials {
  std::vector<float> mx, sum; // per thread
};

int share_chunk(int row, int part, int j, int tpr, int cpt) { return part + tpr * ((j + row) % cpt); }

softmax_partials replay_softmax_partials(const std::vector<std::vector<float>>& rows, int d, int tpr, int lanes) {
  const int cpt = d / 8 / tpr, threads = 64 * tpr;
  REQUIRE(cpt >= 1);
  REQUIRE(wr::group_fits(tpr, lanes));
  REQUIRE(wr::block_whole_warps(threads, lanes));
  softmax_partials p{std::vector<float>(threads), std::vector<float>(threads)};
  for (int t = 0; t < threads; ++t) {
    const int row = wr::group_item(t, tpr), part = wr::group_part(t, tpr);
    REQUIRE(row < 64);
    float mx = -inf, sum = 0.f;
    for (int j = 0; j < cpt; ++j) {
      const float* x = &rows[row][8 * share_chunk(row, part, j, tpr, cpt)];
      float mc = x[0];
      for (int i = 1; i < 8; ++i) mc = std::fmax(mc, x[i]);
      mc = std::fmax(mx, mc * log2e);
      sum *= std::exp2(mx - mc);
      for (int i = 0; i < 8; ++i) sum += std::exp2(std::fma(x[i], log2e, -mc));
      mx = mc;
    }
    p.mx[t] = mx;
    p.sum[t] = sum;
  }
  for (int s = 0; s < wr::group_steps(tpr); ++s) {
    const int o = wr::group_mask(s);
    const std::vector<float> mo = shfl_xor(p.mx, o, lanes), so = shfl_xor(p.sum, o, lanes);
    for (int t = 0; t < threads; ++t) {
      const float mn = std::fmax(p.mx[t], mo[t]);
      p.sum[t] = p.sum[t] * std::exp2(p.mx[t] - mn) + so[t] * std::exp2(mo[t] - mn);
      p.mx[t] = mn;
    }
  }
  return p;
}

void check_softmax_partials(const std::vector<std::vector<float>>& rows, int d, int tpr, int lanes) {
  const softmax_partials p = replay_softmax_partials(rows, d, tpr, lanes);
  for (int t = 0; t < 64 * tpr; ++t) {
    const int row = t / tpr;
    INFO("thread " << t << ", row " << row);
    const float mx = plain_max(rows[row].data(), d) * log2e;
    double sum = 0.0;
    for (float x : rows[row]) sum += std::exp2(double(x) * double(log2e) - double(mx));
    CHECK(same(p.mx[t], mx));
    if (std::isnan(sum))
      CHECK(std::isnan(p.sum[t]));
    else
      CHECK(std::fabs(p.sum[t] - sum) <= 1e-5 * sum);
    CHECK(same(p.mx[t], p.mx[row * tpr]));
    CHECK(same(p.sum[t], p.sum[row * tpr]));
  }
}

// Random rows; then -inf (a key feature that takes no weight) and NaN sprinkled. A NaN makes its own row's sum
// NaN, and no other row's. A thread whose values are all -inf would get a NaN sum (2^(−inf − (−inf)) in its
// first chunk), so every thread keeps at least one finite value here.
void softmax_partial_cases(int lanes, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 3.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  for (int d : {64, 128})
    for (int tpr = 1; tpr <= d / 8 && tpr <= lanes; tpr *= 2) {
      INFO(lanes << " lanes, D " << d << ", " << tpr << " threads a row");
      const int cpt = d / 8 / tpr;
      std::vector<std::vector<float>> rows(64, std::vector<float>(d));
      for (int trial = 0; trial < 8; ++trial) {
        for (auto& r : rows)
          for (float& x : r) x = normal(rng);
        check_softmax_partials(rows, d, tpr, lanes);
        // The row maximum at a different place in each row, far above the rest.
        for (int row = 0; row < 64; ++row) rows[row][(row * 37 + trial * 11) % d] = 40.f;
        check_softmax_partials(rows, d, tpr, lanes);
        for (auto& r : rows)
          for (float& x : r) {
            const float u = unit(rng);
            x = u < 0.2f ? -inf : u < 0.21f ? qnan : x;
          }
        for (int row = 0; row < 64; ++row)
          for (int part = 0; part < tpr; ++part) {
            bool finite = false;
            for (int j = 0; j < cpt; ++j)
              for (int i = 0; i < 8; ++i)
                finite |= std::isfinite(rows[row][8 * share_chunk(row, part, j, tpr, cpt) + i]);
            if (!finite) rows[row][8 * share_chunk(row, part, 0, tpr, cpt)] = normal(rng);
          }
        check_softmax_partials(rows, d, tpr, lanes);
      }
    }
}

} // namespace

TEST_CASE("wave reduce: block_max over 32-lane warps against a plain maximum", "[cpu]") {
  std::mt19937 rng(31);
  block_max_cases(32, rng);
}

TEST_CASE("wave reduce: block_max over 64-lane wavefronts against a plain maximum", "[cpu]") {
  std::mt19937 rng(37);
  block_max_cases(64, rng);
}

TEST_CASE("wave reduce: group butterflies of every width sum their group, 32 and 64 lanes", "[cpu]") {
  std::mt19937 rng(41);
  group_sums(32, rng);
  group_sums(64, rng);
}

TEST_CASE("wave reduce: state kernel softmax partials merged over a row's threads, 32-lane warps", "[cpu]") {
  std::mt19937 rng(43);
  softmax_partial_cases(32, rng);
}

TEST_CASE("wave reduce: state kernel softmax partials merged over a row's threads, 64-lane wavefronts", "[cpu]") {
  std::mt19937 rng(47);
  softmax_partial_cases(64, rng);
}
