// Host-side test helpers shared by the CPU and GPU tests: a seeded random generator, host tensors of any
// dtype in [B, S, H, D] or [B, H, S, D] layout, aligned scratch buffers and relative errors.
#pragma once

#include "catch.hpp"

#include <vsa/geometry.hpp>
#include <vsa/numeric.hpp>
#include <vsa/types.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace vsa {
namespace test {

// A generator seeded from Catch's --rng-seed and a tag naming the test, so every test draws its own data
// and a failure replays with the same seed. Use VSA_TEST_RNG to also report the seed on failure.
class rng {
public:
  explicit rng(const char* tag) {
    uint64_t h = 1469598103934665603ull; // FNV-1a of the tag
    for (const char* c = tag; *c != '\0'; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
    uint64_t z = h ^ (static_cast<uint64_t>(catch_seed()) * 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull; // splitmix64 finaliser
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    seed_ = z ^ (z >> 31);
    engine_.seed(seed_);
  }
  uint64_t seed() const { return seed_; }
  std::mt19937_64& engine() { return engine_; }
  double normal(double mean = 0.0, double stddev = 1.0) {
    return std::normal_distribution<double>(mean, stddev)(engine_);
  }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(engine_); }
  // Uniform over [lo, hi], both ends included.
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(engine_); }

private:
  uint64_t seed_ = 0;
  std::mt19937_64 engine_;
};

#define VSA_TEST_RNG(name, tag)                                                                                        \
  ::vsa::test::rng name(tag);                                                                                          \
  INFO("rng seed " << name.seed() << " (tag " << tag << ", catch seed " << ::vsa::test::catch_seed() << ")")

enum class layout { bshd, bhsd };

// Owning host storage of a [B, S, H, D] tensor of any dtype, densely packed in `order`. A contiguous
// [B, H, n, D] array (means, coarse outputs) is a host_tensor with tokens = n and layout::bhsd.
struct host_tensor {
  dtype type = dtype::f32;
  int64_t batch = 0, tokens = 0, heads = 0, dim = 0;
  layout order = layout::bshd;
  std::vector<unsigned char> bytes;

  host_tensor() = default;
  host_tensor(dtype t, int64_t b, int64_t s, int64_t h, int64_t d, layout o = layout::bshd)
      : type(t), batch(b), tokens(s), heads(h), dim(d), order(o),
        bytes(static_cast<std::size_t>(b * s * h * d) * dtype_size(t)) {}

  int64_t elements() const { return batch * tokens * heads * dim; }
  int64_t batch_stride() const { return tokens * heads * dim; }
  int64_t token_stride() const { return order == layout::bshd ? heads * dim : dim; }
  int64_t head_stride() const { return order == layout::bshd ? dim : tokens * dim; }
  int64_t index(int64_t b, int64_t s, int64_t h, int64_t d) const {
    return b * batch_stride() + s * token_stride() + h * head_stride() + d;
  }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }

  tensor view() { return {data(), tokens, batch_stride(), token_stride(), head_stride()}; }
  const_tensor view() const { return {data(), tokens, batch_stride(), token_stride(), head_stride()}; }
  const_tensor cview() const { return view(); }

  double get(int64_t b, int64_t s, int64_t h, int64_t d) const { return load(data(), index(b, s, h, d), type); }
  void set(int64_t b, int64_t s, int64_t h, int64_t d, double x) { store(data(), index(b, s, h, d), x, type); }
  // Flat access in storage order (every element exactly once).
  double at(int64_t e) const { return load(data(), e, type); }
  void put(int64_t e, double x) { store(data(), e, x, type); }

  void fill_normal(rng& g, double stddev = 1.0) {
    for (int64_t e = 0; e < elements(); ++e) put(e, g.normal(0.0, stddev));
  }
  void fill_byte(unsigned char value) { std::memset(data(), value, bytes.size()); }
  // The same values in another dtype or layout.
  host_tensor converted(dtype t, layout o) const {
    host_tensor r(t, batch, tokens, heads, dim, o);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t s = 0; s < tokens; ++s)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < dim; ++d) r.set(b, s, h, d, get(b, s, h, d));
    return r;
  }
};

// A byte pattern that reads as NaN in every dtype: a float output element still holding it was never
// written. (As int32 it reads -1, which index outputs use for unused entries: poison those differently.)
inline constexpr unsigned char poison_byte = 0xff;

// Host scratch aligned to 256 bytes, as the workspace checks require.
class aligned_buffer {
public:
  aligned_buffer() = default;
  explicit aligned_buffer(std::size_t size) : storage_(new unsigned char[size + 256]), size_(size) {
    const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(storage_.get());
    data_ = storage_.get() + ((256 - at % 256) % 256);
    std::memset(data_, poison_byte, size_);
  }
  void* data() { return data_; }
  std::size_t size() const { return size_; }

private:
  std::unique_ptr<unsigned char[]> storage_;
  unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

// ||a - b|| / ||b|| (Euclidean); +inf when either holds a NaN or the shapes differ; 0 when both are zero.
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double diff = 0.0, ref = 0.0;
  for (std::size_t e = 0; e < a.size(); ++e) {
    if (std::isnan(a[e]) || std::isnan(b[e])) return std::numeric_limits<double>::infinity();
    diff += (a[e] - b[e]) * (a[e] - b[e]);
    ref += b[e] * b[e];
  }
  if (diff == 0.0) return 0.0;
  return ref == 0.0 ? std::numeric_limits<double>::infinity() : std::sqrt(diff / ref);
}

// A log-sum-exp against its reference: within 1e-3 * (1 + |ref|), or the same infinity (a row that attends
// nothing). NaN never passes.
inline bool lse_close(float x, float ref) {
  if (std::isinf(ref)) return x == ref;
  return std::fabs(x - ref) <= 1e-3f * (1.f + std::fabs(ref));
}

// Logical values of a tensor in [b][s][h][d] order, whatever its layout and dtype.
inline std::vector<double> values(const host_tensor& x) {
  std::vector<double> r;
  r.reserve(static_cast<std::size_t>(x.elements()));
  for (int64_t b = 0; b < x.batch; ++b)
    for (int64_t s = 0; s < x.tokens; ++s)
      for (int64_t h = 0; h < x.heads; ++h)
        for (int64_t d = 0; d < x.dim; ++d) r.push_back(x.get(b, s, h, d));
  return r;
}

inline double rel_error(const host_tensor& a, const host_tensor& b) {
  if (a.batch != b.batch || a.tokens != b.tokens || a.heads != b.heads || a.dim != b.dim)
    return std::numeric_limits<double>::infinity();
  return rel_error(values(a), values(b));
}

// Values of a plain array of n elements of type t.
inline std::vector<double> values(const void* data, int64_t n, dtype t) {
  std::vector<double> r(static_cast<std::size_t>(n));
  for (int64_t e = 0; e < n; ++e) r[static_cast<std::size_t>(e)] = load(data, e, t);
  return r;
}

inline problem make_problem(grid3 g, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim, dtype t) {
  problem p;
  p.batch = batch;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.grid = g;
  p.type = t;
  return p;
}

// Σ a ⊙ b over all logical elements (shapes must match).
inline double inner(const host_tensor& a, const host_tensor& b) {
  const std::vector<double> x = values(a), y = values(b);
  double s = 0.0;
  for (std::size_t e = 0; e < x.size() && e < y.size(); ++e) s += x[e] * y[e];
  return s;
}

inline double norm(const host_tensor& a) { return std::sqrt(inner(a, a)); }

// Central differences of a scalar function loss() of a tensor's values: along the direction u (same
// shape), and along one element (storage index). x is restored afterwards.
template <class Loss>
double directional_difference(host_tensor& x, const host_tensor& u, double step, const Loss& loss) {
  const host_tensor saved = x;
  const auto shifted = [&](double sign) {
    for (int64_t b = 0; b < x.batch; ++b)
      for (int64_t s = 0; s < x.tokens; ++s)
        for (int64_t h = 0; h < x.heads; ++h)
          for (int64_t d = 0; d < x.dim; ++d)
            x.set(b, s, h, d, saved.get(b, s, h, d) + sign * step * u.get(b, s, h, d));
    const double value = loss();
    x = saved;
    return value;
  };
  const double up = shifted(1.0), down = shifted(-1.0);
  return (up - down) / (2.0 * step);
}
template <class Loss> double element_difference(host_tensor& x, int64_t e, double step, const Loss& loss) {
  const double x0 = x.at(e);
  x.put(e, x0 + step);
  const double up = loss();
  x.put(e, x0 - step);
  const double down = loss();
  x.put(e, x0);
  return (up - down) / (2.0 * step);
}

// Whether a status message names `word` (every error names the argument it rejects).
inline bool mentions(const status& s, const char* word) {
  return std::string(s.message()).find(word) != std::string::npos;
}

// Tiled slot of every raster token, built from the definition (tiles in t, h, w order; inside a tile
// its valid tokens row-major over the partial cube), independently of tile_geometry.
inline std::vector<int64_t> tiled_slots(grid3 g) {
  std::vector<int64_t> slot(static_cast<std::size_t>(g.t * g.h * g.w), -1);
  int64_t tile = 0;
  for (int64_t t0 = 0; t0 < g.t; t0 += 4)
    for (int64_t h0 = 0; h0 < g.h; h0 += 4)
      for (int64_t w0 = 0; w0 < g.w; w0 += 4, ++tile) {
        int64_t next = tile * 64;
        for (int64_t t = t0; t < std::min(t0 + 4, g.t); ++t)
          for (int64_t h = h0; h < std::min(h0 + 4, g.h); ++h)
            for (int64_t w = w0; w < std::min(w0 + 4, g.w); ++w)
              slot[static_cast<std::size_t>((t * g.h + h) * g.w + w)] = next++;
      }
  return slot;
}

// Caller-supplied q2k lists of the sparse pass, owned: rows of `capacity` entries and their counts.
struct q2k_lists {
  int64_t capacity;
  std::vector<int32_t> q2k, count;
  const_index_lists view() const { return {q2k.data(), count.data(), capacity, nullptr, nullptr}; }
};

// Random ascending lists of 0..capacity tiles; every 7th row empty.
inline q2k_lists random_lists(const problem& p, int64_t capacity, rng& g) {
  const int64_t n = tile_geometry(p.grid).num_tiles(), rows = p.batch * p.q_heads * n;
  q2k_lists x{capacity, std::vector<int32_t>(static_cast<std::size_t>(rows * capacity), -1),
              std::vector<int32_t>(static_cast<std::size_t>(rows))};
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> all(static_cast<std::size_t>(n));
    for (int64_t j = 0; j < n; ++j) all[j] = static_cast<int32_t>(j);
    std::shuffle(all.begin(), all.end(), g.engine());
    const int64_t c = r % 7 == 3 ? 0 : g.integer(1, capacity);
    std::sort(all.begin(), all.begin() + c);
    std::copy(all.begin(), all.begin() + c, x.q2k.begin() + r * capacity);
    x.count[r] = static_cast<int32_t>(c);
  }
  return x;
}

// Fills the valid slots of a tiled tensor with normal values and its padding slots with zeros.
inline void fill_tiled_normal(host_tensor& x, grid3 g, rng& r, double stddev = 1.0) {
  const tile_geometry geo(g);
  for (int64_t b = 0; b < x.batch; ++b)
    for (int64_t s = 0; s < x.tokens; ++s)
      for (int64_t h = 0; h < x.heads; ++h)
        for (int64_t d = 0; d < x.dim; ++d)
          x.set(b, s, h, d, (s % tile_tokens) < geo.valid(s / tile_tokens) ? r.normal(0.0, stddev) : 0.0);
}

} // namespace test
} // namespace vsa
