// Top-k selection and the key-to-query lists on the GPU against the CPU reference, compared exactly:
// random scores, constructed ties, NaN, infinities and signed zeros, k = 1 and k = N, spare list capacity,
// B > 1 and several heads, rows held in registers and rows streamed from memory, and N = 16384 tiles.
// Outputs are poisoned before every call and checked fully written, with their canaries intact.
#include "support/gpu.hpp"
#include "support/host.hpp"

#include <vsa/gpu/index.hpp>
#include <vsa/gpu/primitives.hpp>
#include <vsa/gpu/select.hpp>
#include <vsa/reference/index.hpp>
#include <vsa/reference/select.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace vsa {
namespace test {
namespace {

struct shape {
  grid3 grid;
  int64_t batch, heads;
};

problem to_problem(const shape& s) { return make_problem(s.grid, s.batch, s.heads, s.heads, 128, dtype::bf16); }
int64_t tiles_of(const shape& s) { return tile_geometry(s.grid).num_tiles(); }

std::string describe(const shape& s, int64_t k, int64_t capacity) {
  return std::to_string(s.grid.t) + "x" + std::to_string(s.grid.h) + "x" + std::to_string(s.grid.w) + " (N " +
         std::to_string(tiles_of(s)) + ") B" + std::to_string(s.batch) + " H" + std::to_string(s.heads) + " k " +
         std::to_string(k) + " capacity " + std::to_string(capacity);
}

// Index of the first element where a and b differ, or -1.
int64_t first_mismatch(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  if (a.size() != b.size()) return 0;
  for (std::size_t e = 0; e < a.size(); ++e)
    if (a[e] != b[e]) return static_cast<int64_t>(e);
  return -1;
}

// ---- scores ---------------------------------------------------------------------------------------------

enum class scores_kind { normal, ties, special };

const char* kind_name(scores_kind k) {
  return k == scores_kind::normal ? "normal" : k == scores_kind::ties ? "ties" : "special";
}

// A cheap per-element hash, for score matrices too large to draw through <random> in reasonable time.
inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::vector<float> make_scores(int64_t rows, int64_t n, scores_kind kind, rng& g) {
  std::vector<float> s(static_cast<std::size_t>(rows * n));
  const uint64_t seed = g.engine()();
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // Values chosen to collide: signed zeros, both infinities, NaNs of both signs, a few repeated numbers.
  const float special[] = {nan, -nan, -inf, inf, -0.0f, 0.0f, 1.0f, -1.0f, 2.5f, 1e-30f, -1e-30f, 3.4e38f};
  for (int64_t r = 0; r < rows; ++r) {
    // Some rows are degenerate as a whole: all equal, or all NaN.
    const uint64_t row_hash = mix(seed ^ static_cast<uint64_t>(r) * 0x9e3779b97f4a7c15ull);
    const int row_mode = kind == scores_kind::special ? static_cast<int>(row_hash % 8) : 7;
    for (int64_t j = 0; j < n; ++j) {
      const uint64_t h = mix(row_hash + static_cast<uint64_t>(j));
      float x;
      if (kind == scores_kind::normal) {
        // Sum of uniforms: close enough to normal, with distinct values almost surely.
        const double u = (static_cast<double>(h >> 11) + static_cast<double>(mix(h) >> 11)) * 0x1.0p-53;
        x = static_cast<float>((u - 1.0) * 4.0);
      } else if (kind == scores_kind::ties) {
        x = static_cast<float>(static_cast<int>(h % 64) - 32) / 8.0f; // 64 values: every row full of ties
      } else if (row_mode == 0) {
        x = 0.75f;
      } else if (row_mode == 1) {
        x = nan;
      } else {
        x = special[h % (sizeof(special) / sizeof(special[0]))];
      }
      s[static_cast<std::size_t>(r * n + j)] = x;
    }
  }
  return s;
}

// ---- selection ------------------------------------------------------------------------------------------

struct selection {
  std::vector<int32_t> q2k, count;
};

selection reference_selection(const problem& p, int64_t k, int64_t capacity, const std::vector<float>& scores) {
  const int64_t rows = p.batch * p.q_heads * tile_geometry(p.grid).num_tiles();
  selection r{std::vector<int32_t>(static_cast<std::size_t>(rows * capacity)),
              std::vector<int32_t>(static_cast<std::size_t>(rows))};
  index_lists idx{r.q2k.data(), r.count.data(), capacity, nullptr, nullptr};
  REQUIRE(reference::select_top_k(p, k, scores.data(), idx).is_ok());
  return r;
}

// Runs the GPU selection on scores already on the device and checks it against the reference.
void check_selection(const problem& p, int64_t k, int64_t capacity, const std::vector<float>& scores,
                     const device_buffer& d_scores) {
  const int64_t rows = p.batch * p.q_heads * tile_geometry(p.grid).num_tiles();
  const selection ref = reference_selection(p, k, capacity, scores);
  device_buffer q2k(static_cast<std::size_t>(rows * capacity) * 4), count(static_cast<std::size_t>(rows) * 4);
  q2k.poison_indices();
  count.poison_indices();
  const index_lists idx{q2k.as<int32_t>(), count.as<int32_t>(), capacity, nullptr, nullptr};
  std::size_t bytes = 0;
  REQUIRE(select_top_k(p, k, nullptr, idx, nullptr, bytes, nullptr).is_ok());
  REQUIRE(bytes > 0);
  device_buffer ws(bytes);
  const status st = select_top_k(p, k, d_scores.as<float>(), idx, ws.get(), bytes, nullptr);
  INFO(st.message());
  REQUIRE(st.is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  const std::vector<int32_t> got = q2k.download<int32_t>(), got_count = count.download<int32_t>();
  CHECK(count_index_poison(got) == 0);
  CHECK(count_index_poison(got_count) == 0);
  CHECK(q2k.canaries_intact());
  CHECK(count.canaries_intact());
  CHECK(ws.canaries_intact());
  const int64_t bad = first_mismatch(got, ref.q2k);
  if (bad >= 0) {
    const int64_t row = bad / capacity, n = tile_geometry(p.grid).num_tiles();
    const int32_t want = ref.q2k[static_cast<std::size_t>(bad)];
    INFO("first mismatch in row " << row << " slot " << bad % capacity << ": got " << got[bad] << ", expected " << want
                                  << " (score " << (want >= 0 ? scores[row * n + want] : 0.0f) << ")");
    CHECK(bad < 0);
  }
  CHECK(first_mismatch(got_count, ref.count) < 0);
}

void check_selection(const shape& s, int64_t k, int64_t capacity, scores_kind kind, rng& g) {
  const problem p = to_problem(s);
  const int64_t n = tiles_of(s), rows = s.batch * s.heads * n;
  INFO(describe(s, k, capacity) << ", " << kind_name(kind) << " scores");
  const std::vector<float> scores = make_scores(rows, n, kind, g);
  check_selection(p, k, capacity, scores, upload(scores));
}

TEST_CASE("select_top_k matches the reference", "[gpu][selection]") {
  VSA_TEST_RNG(g, "select");
  const std::vector<shape> shapes = {
      {{1, 1, 1}, 1, 1},    // N = 1
      {{8, 8, 8}, 2, 2},    // N = 8
      {{5, 6, 7}, 1, 3},    // N = 8, partial tiles
      {{9, 10, 11}, 2, 2},  // N = 27
      {{21, 30, 52}, 1, 2}, // N = 624, the wan2.1 anchor's rows
      {{31, 22, 40}, 1, 2}, // N = 480, the wan2.2 anchor's rows
      {{48, 32, 32}, 1, 1}, // N = 768, the fastvideo anchor's rows
      {{32, 32, 64}, 1, 1}, // N = 1024: the longest row a warp holds
      {{48, 48, 32}, 1, 1}, // N = 1152: a block a row, in registers
      {{20, 20, 36}, 2, 1}, // N = 225 (not a multiple of 4: scalar loads)
      {{4, 36, 36}, 1, 1},  // N = 81: the last lane holds one key, the rest of the warp none
  };
  for (const shape& s : shapes) {
    const int64_t n = tiles_of(s);
    const int64_t tenth = std::max<int64_t>(1, (n + 9) / 10);
    for (const scores_kind kind : {scores_kind::normal, scores_kind::ties, scores_kind::special}) {
      check_selection(s, 1, 1, kind, g);
      check_selection(s, n, n, kind, g);
      check_selection(s, tenth, tenth, kind, g);
      const int64_t k = g.integer(1, n);
      check_selection(s, k, g.integer(k, n), kind, g); // spare capacity: the tail must read -1
    }
  }
}

TEST_CASE("select_top_k streams rows longer than its registers hold", "[gpu][selection]") {
  VSA_TEST_RNG(g, "select-stream");
  const shape s{{68, 68, 68}, 1, 1}; // N = 4913 (odd: scalar loads), streamed from memory
  const int64_t n = tiles_of(s);
  check_selection(s, (n + 9) / 10, (n + 9) / 10, scores_kind::ties, g);
  check_selection(s, 1, 3, scores_kind::special, g);
  check_selection(s, n - 1, n, scores_kind::normal, g);
}

TEST_CASE("select_top_k with N = 16384 tiles", "[gpu][selection][large]") {
  VSA_TEST_RNG(g, "select-large");
  const shape s{{128, 64, 128}, 1, 1}; // 32 × 16 × 32 tiles; the score matrix is 1 GiB
  const problem p = to_problem(s);
  const int64_t n = tiles_of(s);
  REQUIRE(n == 16384);
  const std::vector<float> scores = make_scores(n, n, scores_kind::ties, g);
  const device_buffer d_scores = upload(scores);
  for (const int64_t k : {(n + 9) / 10, int64_t(1)}) {
    INFO("k = " << k);
    check_selection(p, k, k, scores, d_scores);
  }
}

TEST_CASE("select_top_k validates before it runs", "[gpu][selection]") {
  const problem p = make_problem({8, 8, 8}, 1, 1, 1, 128, dtype::bf16); // N = 8
  const std::vector<float> scores(64, 1.0f);
  const device_buffer d_scores = upload(scores);
  device_buffer q2k(8 * 8 * 4), count(8 * 4), ws(256);
  q2k.poison_indices();
  count.poison_indices();
  const index_lists idx{q2k.as<int32_t>(), count.as<int32_t>(), 4, nullptr, nullptr};
  std::size_t bytes = 0;
  CHECK(select_top_k(p, 0, d_scores.as<float>(), idx, ws.get(), bytes, nullptr).code() == errc::bad_top_k);
  CHECK(select_top_k(p, 9, d_scores.as<float>(), idx, ws.get(), bytes, nullptr).code() == errc::bad_top_k);
  CHECK(select_top_k(p, 5, d_scores.as<float>(), idx, ws.get(), bytes, nullptr).code() == errc::bad_index);
  // The size query does nothing else; a run with too small a workspace is refused.
  REQUIRE(select_top_k(p, 4, d_scores.as<float>(), idx, nullptr, bytes, nullptr).is_ok());
  REQUIRE(bytes > 0);
  std::size_t small = bytes - 1;
  CHECK(select_top_k(p, 4, d_scores.as<float>(), idx, ws.get(), small, nullptr).code() == errc::bad_workspace);
  CHECK(select_top_k(p, 4, nullptr, idx, ws.get(), bytes, nullptr).code() == errc::null_pointer);
  index_lists no_count = idx;
  no_count.q2k_count = nullptr;
  CHECK(select_top_k(p, 4, d_scores.as<float>(), no_count, ws.get(), bytes, nullptr).code() == errc::null_pointer);
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(count_index_poison(q2k.download<int32_t>()) == 8 * 8);
  CHECK(count_index_poison(count.download<int32_t>()) == 8);
}

// ---- key-to-query lists ---------------------------------------------------------------------------------

struct host_lists {
  int64_t capacity;
  std::vector<int32_t> q2k, count, k2q, offset;
  index_lists view() { return {q2k.data(), count.data(), capacity, k2q.data(), offset.data()}; }
};

// Rows of count(row) distinct ascending tiles; unused slots -1.
template <class Count> host_lists random_lists(const problem& p, int64_t capacity, rng& g, Count count) {
  const int64_t n = tile_geometry(p.grid).num_tiles(), heads = p.batch * p.q_heads, rows = heads * n;
  host_lists l{capacity, std::vector<int32_t>(static_cast<std::size_t>(rows * capacity), -1),
               std::vector<int32_t>(static_cast<std::size_t>(rows)),
               std::vector<int32_t>(static_cast<std::size_t>(rows * capacity)),
               std::vector<int32_t>(static_cast<std::size_t>(heads * (n + 1)))};
  std::vector<int32_t> perm(static_cast<std::size_t>(n));
  std::vector<char> taken(static_cast<std::size_t>(n), 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = count(r);
    if (2 * c <= n) {
      // Few tiles: rejection sampling is cheaper than shuffling all N.
      std::vector<int32_t> pick;
      while (static_cast<int64_t>(pick.size()) < c) {
        const int32_t j = static_cast<int32_t>(g.integer(0, n - 1));
        if (!taken[j]) pick.push_back(j);
        taken[j] = 1;
      }
      for (const int32_t j : pick) taken[j] = 0;
      std::sort(pick.begin(), pick.end());
      std::copy(pick.begin(), pick.end(), l.q2k.begin() + r * capacity);
    } else {
      std::iota(perm.begin(), perm.end(), 0);
      for (int64_t t = 0; t < c; ++t) std::swap(perm[t], perm[t + g.integer(0, n - 1 - t)]);
      std::sort(perm.begin(), perm.begin() + c);
      std::copy(perm.begin(), perm.begin() + c, l.q2k.begin() + r * capacity);
    }
    l.count[static_cast<std::size_t>(r)] = static_cast<int32_t>(c);
  }
  return l;
}

struct device_lists {
  device_buffer q2k, count, k2q, offset;
  int64_t capacity;
  explicit device_lists(const host_lists& h)
      : q2k(upload(h.q2k)), count(upload(h.count)), k2q(h.k2q.size() * 4), offset(h.offset.size() * 4),
        capacity(h.capacity) {
    k2q.poison_indices();
    offset.poison_indices();
  }
  index_lists view() const {
    return {q2k.as<int32_t>(), count.as<int32_t>(), capacity, k2q.as<int32_t>(), offset.as<int32_t>()};
  }
};

// Builds the k2q lists on the GPU (twice, from poisoned outputs) and compares them with `expect`, the
// reference's output (whose unused tail is -1, as the GPU's must be).
void check_k2q(const problem& p, device_lists& d, const host_lists& expect) {
  for (int run = 0; run < 2; ++run) {
    INFO("run " << run);
    d.k2q.poison_indices();
    d.offset.poison_indices();
    std::size_t bytes = 0;
    REQUIRE(build_k2q(p, d.view(), nullptr, bytes, nullptr).is_ok());
    device_buffer ws(bytes);
    ws.poison();
    const status st = build_k2q(p, d.view(), ws.get(), bytes, nullptr);
    INFO(st.message());
    REQUIRE(st.is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    const std::vector<int32_t> k2q = d.k2q.download<int32_t>(), offset = d.offset.download<int32_t>();
    CHECK(count_index_poison(k2q) == 0);
    CHECK(count_index_poison(offset) == 0);
    CHECK(d.k2q.canaries_intact());
    CHECK(d.offset.canaries_intact());
    CHECK(ws.canaries_intact());
    const int64_t bad_offset = first_mismatch(offset, expect.offset);
    INFO("first k2q_offset mismatch at " << bad_offset);
    CHECK(bad_offset < 0);
    const int64_t bad = first_mismatch(k2q, expect.k2q);
    INFO("first k2q mismatch at " << bad);
    CHECK(bad < 0);
  }
}

void check_k2q(const shape& s, int64_t capacity, rng& g, bool ragged) {
  const problem p = to_problem(s);
  INFO(describe(s, capacity, capacity) << (ragged ? " ragged" : ""));
  host_lists lists = random_lists(p, capacity, g, [&](int64_t) { return ragged ? g.integer(0, capacity) : capacity; });
  host_lists expect = lists;
  REQUIRE(reference::build_k2q(p, expect.view()).is_ok());
  device_lists d(lists);
  check_k2q(p, d, expect);
}

TEST_CASE("build_k2q matches the reference", "[gpu][index]") {
  VSA_TEST_RNG(g, "k2q");
  const std::vector<shape> shapes = {
      {{1, 1, 1}, 1, 1},    // N = 1
      {{8, 8, 8}, 2, 3},    // N = 8: one chunk of query tiles, partly used
      {{9, 10, 11}, 2, 2},  // N = 27
      {{21, 30, 52}, 1, 3}, // N = 624: 20 chunks
      {{48, 48, 32}, 1, 2}, // N = 1152: two count blocks
  };
  for (const shape& s : shapes) {
    const int64_t n = tiles_of(s);
    check_k2q(s, 1, g, false);
    check_k2q(s, n, g, false);
    check_k2q(s, std::max<int64_t>(1, (n + 9) / 10), g, false);
    check_k2q(s, g.integer(1, n), g, true);
    check_k2q(s, n, g, true);
  }
}

TEST_CASE("build_k2q with N = 16384 tiles", "[gpu][index][large]") {
  VSA_TEST_RNG(g, "k2q-large");
  const shape s{{128, 64, 128}, 1, 1}; // two mark blocks per chunk, 16 count blocks
  check_k2q(s, 6, g, true);
  check_k2q(s, 40, g, false);
}

TEST_CASE("build_k2q stays inside its outputs on malformed lists", "[gpu][index]") {
  // Out-of-range tiles and counts, repeats and unsorted rows: the reference refuses such lists; the GPU
  // cannot check them without a host round trip, so it skips bad tiles, clamps counts, and must still write
  // exactly its outputs.
  VSA_TEST_RNG(g, "k2q-malformed");
  const problem p = make_problem({9, 10, 11}, 2, 2, 2, 128, dtype::bf16);
  const int64_t n = tile_geometry(p.grid).num_tiles(), cap = 5, rows = p.batch * p.q_heads * n;
  host_lists lists{cap, std::vector<int32_t>(static_cast<std::size_t>(rows * cap)),
                   std::vector<int32_t>(static_cast<std::size_t>(rows)),
                   std::vector<int32_t>(static_cast<std::size_t>(rows * cap)),
                   std::vector<int32_t>(static_cast<std::size_t>(p.batch * p.q_heads * (n + 1)))};
  for (auto& j : lists.q2k) j = static_cast<int32_t>(g.integer(-3, n + 3));
  for (auto& c : lists.count) c = static_cast<int32_t>(g.integer(-2, cap + 2));
  device_lists d(lists);
  std::size_t bytes = 0;
  REQUIRE(build_k2q(p, d.view(), nullptr, bytes, nullptr).is_ok());
  device_buffer ws(bytes);
  REQUIRE(build_k2q(p, d.view(), ws.get(), bytes, nullptr).is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(d.k2q.canaries_intact());
  CHECK(d.offset.canaries_intact());
  CHECK(ws.canaries_intact());
  const std::vector<int32_t> offset = d.offset.download<int32_t>(), k2q = d.k2q.download<int32_t>();
  CHECK(count_index_poison(offset) == 0);
  CHECK(count_index_poison(k2q) == 0);
  // What the GPU promises: each list ascending, distinct, within [0, N).
  for (int64_t h = 0; h < p.batch * p.q_heads; ++h)
    for (int64_t j = 0; j < n; ++j) {
      const int32_t* o = offset.data() + h * (n + 1);
      for (int32_t e = o[j]; e < o[j + 1]; ++e) {
        const int32_t i = k2q[h * n * cap + e];
        CHECK((i >= 0 && i < n));
        if (e > o[j]) CHECK(i > k2q[h * n * cap + e - 1]);
      }
    }
}

TEST_CASE("build_k2q validates before it runs", "[gpu][index]") {
  const problem p = make_problem({8, 8, 8}, 1, 1, 1, 128, dtype::bf16); // N = 8
  host_lists lists = {4, std::vector<int32_t>(32, 0), std::vector<int32_t>(8, 0), std::vector<int32_t>(32),
                      std::vector<int32_t>(9)};
  device_lists d(lists);
  std::size_t bytes = 0;
  index_lists idx = d.view();
  idx.q2k_capacity = 9;
  CHECK(build_k2q(p, idx, nullptr, bytes, nullptr).code() == errc::bad_index);
  idx.q2k_capacity = 0;
  CHECK(build_k2q(p, idx, nullptr, bytes, nullptr).code() == errc::bad_index);
  REQUIRE(build_k2q(p, d.view(), nullptr, bytes, nullptr).is_ok());
  device_buffer ws(bytes);
  std::size_t small = bytes - 1;
  CHECK(build_k2q(p, d.view(), ws.get(), small, nullptr).code() == errc::bad_workspace);
  CHECK(build_k2q(p, d.view(), static_cast<char*>(ws.get()) + 4, bytes, nullptr).code() == errc::misaligned_pointer);
  idx = d.view();
  idx.k2q = nullptr;
  CHECK(build_k2q(p, idx, ws.get(), bytes, nullptr).code() == errc::null_pointer);
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(count_index_poison(d.k2q.download<int32_t>()) == 32);
  CHECK(count_index_poison(d.offset.download<int32_t>()) == 9);
}

TEST_CASE("selection then k2q, all on the device", "[gpu][selection][index]") {
  VSA_TEST_RNG(g, "select-k2q");
  const shape s{{21, 30, 52}, 2, 3};
  const problem p = to_problem(s);
  const int64_t n = tiles_of(s), rows = s.batch * s.heads * n, k = (n + 9) / 10;
  const std::vector<float> scores = make_scores(rows, n, scores_kind::ties, g);
  host_lists expect{k, std::vector<int32_t>(static_cast<std::size_t>(rows * k)),
                    std::vector<int32_t>(static_cast<std::size_t>(rows)),
                    std::vector<int32_t>(static_cast<std::size_t>(rows * k)),
                    std::vector<int32_t>(static_cast<std::size_t>(s.batch * s.heads * (n + 1)))};
  REQUIRE(reference::select_top_k(p, k, scores.data(), expect.view()).is_ok());
  REQUIRE(reference::build_k2q(p, expect.view()).is_ok());

  const device_buffer d_scores = upload(scores);
  device_buffer q2k(expect.q2k.size() * 4), count(expect.count.size() * 4), k2q(expect.k2q.size() * 4),
      offset(expect.offset.size() * 4);
  for (device_buffer* b : {&q2k, &count, &k2q, &offset}) b->poison_indices();
  const index_lists idx{q2k.as<int32_t>(), count.as<int32_t>(), k, k2q.as<int32_t>(), offset.as<int32_t>()};
  std::size_t select_bytes = 0, index_bytes = 0;
  REQUIRE(select_top_k(p, k, nullptr, idx, nullptr, select_bytes, nullptr).is_ok());
  REQUIRE(build_k2q(p, idx, nullptr, index_bytes, nullptr).is_ok());
  device_buffer select_ws(select_bytes), index_ws(index_bytes);
  REQUIRE(select_top_k(p, k, d_scores.as<float>(), idx, select_ws.get(), select_bytes, nullptr).is_ok());
  REQUIRE(build_k2q(p, idx, index_ws.get(), index_bytes, nullptr).is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(first_mismatch(q2k.download<int32_t>(), expect.q2k) < 0);
  CHECK(first_mismatch(count.download<int32_t>(), expect.count) < 0);
  CHECK(first_mismatch(offset.download<int32_t>(), expect.offset) < 0);
  CHECK(first_mismatch(k2q.download<int32_t>(), expect.k2q) < 0);
  for (device_buffer* b : {&q2k, &count, &k2q, &offset}) CHECK(b->canaries_intact());
}

// ---- block primitives -----------------------------------------------------------------------------------

constexpr int prim_threads = 128, prim_items = 4;

// Per block: exclusive and inclusive sums of one value per thread, the blocked 4-item exclusive sum and its
// total, the sum and the maximum, and a key-value radix sort both ways.
__global__ void primitives_kernel(const uint32_t* in, uint32_t* out) {
  using scan = gpu::block_scan<uint32_t, prim_threads>;
  using reduce = gpu::block_reduce<uint32_t, prim_threads>;
  using sort = gpu::block_radix_sort<uint32_t, int32_t, prim_threads, prim_items>;
  __shared__ union {
    typename scan::TempStorage scanning;
    typename reduce::TempStorage reducing;
    typename sort::TempStorage sorting;
  } temp;
  const int t = threadIdx.x;
  const uint32_t* x = in + blockIdx.x * prim_threads * prim_items;
  uint32_t* o = out + blockIdx.x * prim_threads * prim_items * 8;
  const int span = prim_threads * prim_items;
  uint32_t a, b, total, items[prim_items], sums[prim_items];
  scan(temp.scanning).exclusive_sum(x[t], a);
  __syncthreads();
  scan(temp.scanning).inclusive_sum(x[t], b);
  __syncthreads();
  o[t] = a;
  o[span + t] = b;
  for (int u = 0; u < prim_items; ++u) items[u] = x[t * prim_items + u];
  scan(temp.scanning).exclusive_sum(items, sums, total);
  __syncthreads();
  for (int u = 0; u < prim_items; ++u) o[2 * span + t * prim_items + u] = sums[u];
  o[3 * span + t] = total;
  const uint32_t sum = reduce(temp.reducing).sum(x[t]);
  __syncthreads();
  const uint32_t top = reduce(temp.reducing).reduce(x[t], [](uint32_t p, uint32_t q) { return p > q ? p : q; });
  __syncthreads();
  if (t == 0) {
    o[4 * span] = sum;
    o[4 * span + 1] = top;
  }
  int32_t index[prim_items];
  for (int u = 0; u < prim_items; ++u) {
    items[u] = x[t * prim_items + u] & 0xffu; // 8-bit keys: many ties, so stability shows
    index[u] = t * prim_items + u;
  }
  sort(temp.sorting).sort(items, index, 0, 8);
  __syncthreads();
  for (int u = 0; u < prim_items; ++u) {
    o[5 * span + t * prim_items + u] = items[u];
    o[6 * span + t * prim_items + u] = static_cast<uint32_t>(index[u]);
  }
  sort(temp.sorting).sort_descending(items, index, 0, 8);
  __syncthreads();
  for (int u = 0; u < prim_items; ++u) o[7 * span + t * prim_items + u] = static_cast<uint32_t>(index[u]);
}

TEST_CASE("the block primitives agree with sequential code", "[gpu][primitives]") {
  VSA_TEST_RNG(g, "primitives");
  const int blocks = 3, span = prim_threads * prim_items;
  std::vector<uint32_t> in(static_cast<std::size_t>(blocks * span));
  for (auto& v : in) v = static_cast<uint32_t>(g.integer(0, 1 << 20));
  const device_buffer d_in = upload(in);
  device_buffer d_out(static_cast<std::size_t>(blocks) * span * 8 * 4);
  d_out.poison_indices();
  primitives_kernel<<<blocks, prim_threads>>>(d_in.as<uint32_t>(), d_out.as<uint32_t>());
  VSA_REQUIRE_RT(gpu::last_error());
  VSA_REQUIRE_RT(gpu_sync());
  const std::vector<uint32_t> out = d_out.download<uint32_t>();
  for (int b = 0; b < blocks; ++b) {
    INFO("block " << b);
    const uint32_t* x = in.data() + b * span;
    const uint32_t* o = out.data() + static_cast<std::size_t>(b) * span * 8;
    uint32_t run = 0, bad = 0;
    for (int t = 0; t < prim_threads; ++t) {
      bad += o[t] != run;
      run += x[t];
      bad += o[span + t] != run;
    }
    CHECK(bad == 0);
    run = 0;
    bad = 0;
    for (int e = 0; e < span; ++e) {
      bad += o[2 * span + e] != run;
      run += x[e];
    }
    CHECK(bad == 0);
    bad = 0;
    for (int t = 0; t < prim_threads; ++t) bad += o[3 * span + t] != run;
    CHECK(bad == 0);
    uint32_t sum = 0, top = 0;
    for (int t = 0; t < prim_threads; ++t) {
      sum += x[t];
      top = std::max(top, x[t]);
    }
    CHECK(o[4 * span] == sum);
    CHECK(o[4 * span + 1] == top);
    std::vector<int32_t> order(static_cast<std::size_t>(span));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t p, int32_t q) { return (x[p] & 0xffu) < (x[q] & 0xffu); });
    bad = 0;
    for (int e = 0; e < span; ++e) {
      bad += o[5 * span + e] != (x[order[e]] & 0xffu);
      bad += o[6 * span + e] != static_cast<uint32_t>(order[e]);
    }
    CHECK(bad == 0);
    // Descending and stable, from the ascending order: equal keys keep that order.
    std::stable_sort(order.begin(), order.end(), [&](int32_t p, int32_t q) { return (x[p] & 0xffu) > (x[q] & 0xffu); });
    bad = 0;
    for (int e = 0; e < span; ++e) bad += o[7 * span + e] != static_cast<uint32_t>(order[e]);
    CHECK(bad == 0);
  }
}

} // namespace
} // namespace test
} // namespace vsa
