#include "support/host.hpp"

#include <vsa/reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

using namespace vsa;
using test::make_problem;

namespace {

// Selection by counting: tile j is selected iff fewer than k tiles rank above it (higher score, or
// equal score and lower index, NaN last), independently of any sort.
std::vector<int32_t> select_by_counting(const float* row, int64_t n, int64_t k) {
  const auto above = [&](int64_t a, int64_t b) {
    const bool na = std::isnan(row[a]), nb = std::isnan(row[b]);
    if (na || nb) return !na && nb ? true : (na && nb ? a < b : false);
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  };
  std::vector<int32_t> out;
  for (int64_t j = 0; j < n; ++j) {
    int64_t rank = 0;
    for (int64_t i = 0; i < n; ++i) rank += above(i, j) ? 1 : 0;
    if (rank < k) out.push_back(static_cast<int32_t>(j));
  }
  return out;
}

struct lists {
  int64_t rows, n, capacity;
  std::vector<int32_t> q2k, count, k2q, offset;
  lists(const problem& p, int64_t cap)
      : rows(p.batch * p.q_heads * tile_geometry(p.grid).num_tiles()), n(tile_geometry(p.grid).num_tiles()),
        capacity(cap), q2k(static_cast<std::size_t>(rows * cap), 0x7f7f7f7f),
        count(static_cast<std::size_t>(rows), 0x7f7f7f7f), k2q(static_cast<std::size_t>(rows * cap), 0x7f7f7f7f),
        offset(static_cast<std::size_t>(p.batch * p.q_heads * (n + 1)), 0x7f7f7f7f) {}
  index_lists view() { return {q2k.data(), count.data(), capacity, k2q.data(), offset.data()}; }
};

// Every (i, j) of the q2k lists is in the k2q lists and nothing else; lists ascending; offsets exact.
void check_consistent(const problem& p, const lists& x) {
  const int64_t n = x.n, heads = p.batch * p.q_heads;
  for (int64_t head = 0; head < heads; ++head) {
    const int32_t* offset = x.offset.data() + head * (n + 1);
    const int32_t* k2q = x.k2q.data() + head * n * x.capacity;
    REQUIRE(offset[0] == 0);
    int64_t total = 0;
    std::vector<std::vector<int32_t>> want(static_cast<std::size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = head * n + i;
      total += x.count[row];
      for (int32_t c = 0; c < x.count[row]; ++c) want[x.q2k[row * x.capacity + c]].push_back(static_cast<int32_t>(i));
    }
    REQUIRE(offset[n] == total);
    for (int64_t j = 0; j < n; ++j) {
      REQUIRE(offset[j + 1] >= offset[j]);
      const std::vector<int32_t> got(k2q + offset[j], k2q + offset[j + 1]);
      REQUIRE(got == want[j]); // built in ascending i, so equality also checks the order
      REQUIRE(std::is_sorted(got.begin(), got.end()));
    }
    for (int64_t e = total; e < n * x.capacity; ++e) REQUIRE(k2q[e] == -1);
  }
}

} // namespace

TEST_CASE("top-k selection matches selection by counting", "[cpu][select]") {
  VSA_TEST_RNG(g, "select random");
  const problem p = make_problem({9, 13, 3}, 2, 3, 1, 4, dtype::bf16); // 12 tiles
  const int64_t n = tile_geometry(p.grid).num_tiles();
  for (int64_t k : {int64_t(1), int64_t(4), n - 1, n}) {
    std::vector<float> scores(static_cast<std::size_t>(2 * 3 * n * n));
    for (float& s : scores) s = static_cast<float>(g.normal());
    // Some exact ties and NaNs among random rows.
    for (std::size_t e = 0; e < scores.size(); e += 7) scores[e] = 0.5f;
    for (std::size_t e = 3; e < scores.size(); e += 29) scores[e] = NAN;
    const int64_t capacity = std::min(n, k + 2);
    lists x(p, capacity);
    REQUIRE(reference::select_top_k(p, k, scores.data(), x.view()).is_ok());
    for (int64_t row = 0; row < x.rows; ++row) {
      REQUIRE(x.count[row] == k);
      const std::vector<int32_t> got(x.q2k.begin() + row * capacity, x.q2k.begin() + row * capacity + k);
      REQUIRE(got == select_by_counting(scores.data() + row * n, n, k));
      for (int64_t c = k; c < capacity; ++c) REQUIRE(x.q2k[row * capacity + c] == -1);
    }
    REQUIRE(reference::build_k2q(p, x.view()).is_ok());
    check_consistent(p, x);
  }
}

TEST_CASE("top-k ties go to the lower index and NaNs rank last", "[cpu][select]") {
  const problem p = make_problem({4, 4, 24}, 1, 1, 1, 4, dtype::f32); // 6 tiles: rows of 6 scores
  const int64_t n = 6;
  const auto pick = [&](std::vector<float> row, int64_t k) {
    std::vector<float> scores;
    for (int64_t i = 0; i < n; ++i) scores.insert(scores.end(), row.begin(), row.end());
    lists x(p, k);
    REQUIRE(reference::select_top_k(p, k, scores.data(), x.view()).is_ok());
    for (int64_t i = 1; i < n; ++i)
      REQUIRE(std::equal(x.q2k.begin(), x.q2k.begin() + k, x.q2k.begin() + i * k)); // all rows alike
    return std::vector<int32_t>(x.q2k.begin(), x.q2k.begin() + k);
  };
  using v = std::vector<int32_t>;
  CHECK(pick({1, 3, 3, 2, 3, 0}, 2) == v{1, 2});
  CHECK(pick({1, 3, 3, 2, 3, 0}, 3) == v{1, 2, 4});
  CHECK(pick({5, 5, 5, 5, 5, 5}, 4) == v{0, 1, 2, 3});
  CHECK(pick({NAN, 1, NAN, 0, -INFINITY, NAN}, 3) == v{1, 3, 4});
  CHECK(pick({NAN, 1, NAN, 0, -INFINITY, NAN}, 4) == v{0, 1, 3, 4});
  CHECK(pick({NAN, NAN, NAN, NAN, NAN, NAN}, 2) == v{0, 1});
  CHECK(pick({-0.0f, 0.0f, -1, INFINITY, -0.0f, 2}, 3) == v{0, 3, 5});
  CHECK(pick({-0.0f, 0.0f, -1, INFINITY, -0.0f, 2}, 5) == v{0, 1, 3, 4, 5});
  CHECK(pick({1e-30f, 2e-30f, -3, -2, -1, 0}, 1) == v{1});
}

TEST_CASE("k2q lists agree with ragged caller-supplied q2k lists", "[cpu][select][index]") {
  VSA_TEST_RNG(g, "k2q ragged");
  const problem p = make_problem({5, 6, 7}, 2, 2, 1, 4, dtype::bf16); // 8 tiles
  const int64_t n = tile_geometry(p.grid).num_tiles();
  for (int64_t capacity : {int64_t(1), int64_t(3), n}) {
    lists x(p, capacity);
    for (int64_t row = 0; row < x.rows; ++row) {
      std::vector<int32_t> all(static_cast<std::size_t>(n));
      for (int64_t j = 0; j < n; ++j) all[j] = static_cast<int32_t>(j);
      std::shuffle(all.begin(), all.end(), g.engine());
      const int64_t c = row % 5 == 0 ? 0 : g.integer(0, capacity); // some empty rows
      std::sort(all.begin(), all.begin() + c);
      for (int64_t e = 0; e < capacity; ++e) x.q2k[row * capacity + e] = e < c ? all[e] : 12345; // junk past count
      x.count[row] = static_cast<int32_t>(c);
    }
    REQUIRE(reference::build_k2q(p, x.view()).is_ok());
    check_consistent(p, x);
  }
}

TEST_CASE("selection and k2q reject bad arguments and bad lists", "[cpu][select][index][errors]") {
  VSA_TEST_RNG(g, "select errors");
  const problem p = make_problem({5, 6, 7}, 1, 2, 1, 4, dtype::bf16); // 8 tiles
  const int64_t n = 8;
  std::vector<float> scores(static_cast<std::size_t>(2 * n * n));
  for (float& s : scores) s = static_cast<float>(g.normal());
  {
    lists x(p, 3);
    const std::vector<int32_t> before = x.q2k, before_count = x.count;
    status s = reference::select_top_k(p, 0, scores.data(), x.view());
    CHECK(s.code() == errc::bad_top_k);
    CHECK(test::mentions(s, "top_k"));
    CHECK(reference::select_top_k(p, n + 1, scores.data(), x.view()).code() == errc::bad_top_k);
    s = reference::select_top_k(p, 4, scores.data(), x.view()); // capacity 3 < k
    CHECK(s.code() == errc::bad_index);
    CHECK(test::mentions(s, "q2k_capacity"));
    s = reference::select_top_k(p, 2, nullptr, x.view());
    CHECK(s.code() == errc::null_pointer);
    CHECK(test::mentions(s, "scores"));
    index_lists no_count = x.view();
    no_count.q2k_count = nullptr;
    s = reference::select_top_k(p, 2, scores.data(), no_count);
    CHECK(s.code() == errc::null_pointer);
    CHECK(test::mentions(s, "q2k_count"));
    CHECK(x.q2k == before);
    CHECK(x.count == before_count);
  }
  // Valid lists, then one defect at a time.
  lists good(p, 3);
  REQUIRE(reference::select_top_k(p, 3, scores.data(), good.view()).is_ok());
  const auto expect_rejected = [&](lists x, const char* what) {
    INFO(what);
    const std::vector<int32_t> k2q = x.k2q, offset = x.offset;
    const status s = reference::build_k2q(p, x.view());
    CHECK(s.code() == errc::bad_index);
    CHECK(test::mentions(s, "q2k"));
    CHECK(x.k2q == k2q);
    CHECK(x.offset == offset);
  };
  lists bad = good;
  bad.q2k[5 * 3 + 1] = static_cast<int32_t>(n); // out of range
  expect_rejected(bad, "tile index N");
  bad = good;
  bad.q2k[4 * 3 + 2] = -1;
  expect_rejected(bad, "negative tile index");
  bad = good;
  bad.q2k[7 * 3 + 1] = bad.q2k[7 * 3 + 0]; // repeated
  expect_rejected(bad, "repeated tile");
  bad = good;
  std::swap(bad.q2k[2 * 3 + 0], bad.q2k[2 * 3 + 2]); // descending
  expect_rejected(bad, "not ascending");
  bad = good;
  bad.count[3] = 4; // more than the capacity
  expect_rejected(bad, "count above capacity");
  bad = good;
  bad.count[9] = -1;
  expect_rejected(bad, "negative count");
  bad = good;
  bad.capacity = n + 1;
  expect_rejected(bad, "capacity above N");
  bad = good;
  bad.capacity = 0;
  expect_rejected(bad, "capacity 0");

  lists x = good;
  index_lists no_k2q = x.view();
  no_k2q.k2q = nullptr;
  const status s = reference::build_k2q(p, no_k2q);
  CHECK(s.code() == errc::null_pointer);
  CHECK(test::mentions(s, "k2q"));
}
