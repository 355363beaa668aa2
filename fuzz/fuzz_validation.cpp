// libFuzzer target over the host-side argument checks and planning: problem shapes, tensor views with fake
// pointers (never dereferenced: an accepted view is only checked arithmetically), workspace sizes, caller
// q2k lists on small host arrays, resolve_top_k, the tile geometry, and the CPU reference op's size query
// and its checks before it touches memory. Every accepted argument is re-checked here against the
// definition, so a check that lets a bad argument through is a finding, as is any sanitizer report.
#include <vsa/geometry.hpp>
#include <vsa/reference/op.hpp>
#include <vsa/types.hpp>
#include <vsa/validate.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace vsa {
namespace {

// Fails loudly; libFuzzer records the input that got here.
#define FUZZ_ASSERT(cond)                                                                                              \
  do {                                                                                                                 \
    if (!(cond)) {                                                                                                     \
      std::fprintf(stderr, "invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__);                               \
      std::abort();                                                                                                    \
    }                                                                                                                  \
  } while (0)

// Reads the input front to back; past its end every read yields zeros.
class reader {
public:
  reader(const uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  uint8_t byte() { return at_ < size_ ? data_[at_++] : 0; }
  uint64_t bits(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(byte()) << (8 * i);
    return v;
  }
  // A signed size that is usually small and sometimes extreme: the edges where checks go wrong.
  int64_t size(int64_t small_max) {
    const uint8_t mode = byte();
    switch (mode % 8) {
    case 0:
      return static_cast<int64_t>(bits(8));
    case 1:
      return -static_cast<int64_t>(byte());
    case 2: {
      static const int64_t edges[] = {0,
                                      1,
                                      std::numeric_limits<int64_t>::max(),
                                      std::numeric_limits<int64_t>::min(),
                                      int64_t(1) << 31,
                                      (int64_t(1) << 31) - 1,
                                      int64_t(1) << 32,
                                      int64_t(1) << 60,
                                      (int64_t(1) << 30) + 1,
                                      3037000500};
      return edges[byte() % (sizeof(edges) / sizeof(edges[0]))];
    }
    default:
      return static_cast<int64_t>(byte() % (small_max + 1));
    }
  }
  double real() {
    const uint8_t mode = byte();
    if (mode % 4 == 0) {
      double d;
      const uint64_t b = bits(8);
      std::memcpy(&d, &b, sizeof(d));
      return d;
    }
    return static_cast<double>(byte()) / 255.0 * 1.2 - 0.1;
  }
  bool flag() { return (byte() & 1) != 0; }

private:
  const uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

// x·y when it fits in int64.
bool mul_fits(int64_t x, int64_t y, int64_t& r) { return !__builtin_mul_overflow(x, y, &r); }

// A dense [B, S, H, D] or [B, H, S, D] view, when its strides fit in int64 (bshd/bhsd trust their inputs);
// otherwise a view with zero strides, which the checks must reject.
const_tensor dense(const void* data, int64_t tokens, int64_t heads, int64_t dim, bool bshd_order) {
  int64_t plane = 0, row = 0;
  if (tokens < 0 || heads < 0 || dim < 0 || !mul_fits(tokens, heads, plane) || !mul_fits(plane, dim, plane) ||
      !mul_fits(heads, dim, row) || !mul_fits(tokens, dim, row))
    return {data, tokens, 0, 0, 0};
  return bshd_order ? bshd(data, 1, tokens, heads, dim) : bhsd(data, 1, tokens, heads, dim);
}

// A fake pointer: never dereferenced, only compared and tested for alignment.
const void* fake_pointer(reader& in) {
  const uint8_t mode = in.byte();
  const std::uintptr_t base = std::uintptr_t(1) << 40;
  switch (mode % 4) {
  case 0:
    return nullptr;
  case 1:
    return reinterpret_cast<const void*>(base + (in.byte() % 64));
  default:
    return reinterpret_cast<const void*>(base + 256 * std::uintptr_t(in.byte()));
  }
}

problem read_problem(reader& in) {
  problem p;
  p.batch = in.size(3);
  p.q_heads = in.size(8);
  p.kv_heads = in.size(8);
  const uint8_t d = in.byte();
  p.head_dim = d % 4 == 0 ? 64 : d % 4 == 1 ? 128 : in.size(300);
  p.grid = {in.size(13), in.size(13), in.size(13)};
  p.type = static_cast<dtype>(static_cast<int8_t>(in.byte()) % 6);
  return p;
}

// An accepted problem satisfies the definition and keeps every size the library forms inside int64.
void check_problem_invariants(const problem& p) {
  const status cpu = check_problem(p, target::cpu), gpu = check_problem(p, target::gpu);
  FUZZ_ASSERT(cpu.is_ok() || cpu.code() != errc::ok);
  FUZZ_ASSERT(std::strlen(cpu.message()) > 0 && std::strlen(gpu.message()) > 0);
  if (gpu) FUZZ_ASSERT(cpu); // the GPU accepts a subset of what the CPU reference does
  if (!cpu) return;
  FUZZ_ASSERT(p.batch >= 1 && p.q_heads >= 1 && p.kv_heads >= 1 && p.q_heads % p.kv_heads == 0);
  FUZZ_ASSERT(p.head_dim >= 1 && p.head_dim <= 256);
  FUZZ_ASSERT(p.grid.t >= 1 && p.grid.h >= 1 && p.grid.w >= 1);
  if (gpu) {
    FUZZ_ASSERT(p.head_dim == 64 || p.head_dim == 128);
    FUZZ_ASSERT(p.type == dtype::bf16 || p.type == dtype::fp16);
  }
  const tile_geometry geo(p.grid);
  int64_t raster = 0, elems = 0, pairs = 0;
  FUZZ_ASSERT(mul_fits(p.grid.t, p.grid.h, raster) && mul_fits(raster, p.grid.w, raster));
  FUZZ_ASSERT(geo.raster_tokens() == raster);
  FUZZ_ASSERT(geo.num_tiles() >= 1 && geo.num_tiles() <= (int64_t(1) << 30));
  FUZZ_ASSERT(geo.tiled_tokens() >= raster && geo.tiled_tokens() == geo.num_tiles() * tile_tokens);
  FUZZ_ASSERT(mul_fits(geo.tiled_tokens(), p.q_heads, elems) && mul_fits(elems, p.batch, elems) &&
              mul_fits(elems, p.head_dim, elems) && mul_fits(elems, 8, elems));
  FUZZ_ASSERT(mul_fits(geo.num_tiles(), geo.num_tiles(), pairs) && mul_fits(pairs, p.batch, pairs) &&
              mul_fits(pairs, p.q_heads, pairs) && mul_fits(pairs, 4, pairs));
  // The last tile's valid count matches its extents (the 32-bit fast path of valid()).
  const int64_t last = geo.num_tiles() - 1;
  const grid3 e = geo.extent(last);
  FUZZ_ASSERT(geo.valid(last) == e.t * e.h * e.w);
  FUZZ_ASSERT(geo.valid(last) >= 1 && geo.valid(last) <= tile_tokens);
}

// An accepted view addresses every (b, s, h) row without overlap, inside int64, aligned as promised.
template <class Ptr> void check_tensor_invariants(const basic_tensor<Ptr>& x, const problem& p, int64_t heads,
                                                  int64_t expected, target where) {
  const status s = check_tensor("x", x, p, heads, expected, where);
  if (!s) {
    FUZZ_ASSERT(std::strstr(s.message(), "x") != nullptr); // names the argument
    return;
  }
  FUZZ_ASSERT(x.data != nullptr && x.tokens == expected);
  FUZZ_ASSERT(x.batch_stride >= 0 && x.token_stride >= 0 && x.head_stride >= 0);
  if (where == target::gpu) {
    const int64_t vec = 16 / static_cast<int64_t>(dtype_size(p.type));
    FUZZ_ASSERT(reinterpret_cast<std::uintptr_t>(x.data) % 16 == 0);
    FUZZ_ASSERT(x.batch_stride % vec == 0 && x.token_stride % vec == 0 && x.head_stride % vec == 0);
  }
  // The last element's offset fits in int64.
  int64_t end = 0, term = 0;
  if (p.batch > 0 && x.tokens > 0 && heads > 0) {
    FUZZ_ASSERT(mul_fits(p.batch - 1, x.batch_stride, term) && !__builtin_add_overflow(end, term, &end));
    FUZZ_ASSERT(mul_fits(x.tokens - 1, x.token_stride, term) && !__builtin_add_overflow(end, term, &end));
    FUZZ_ASSERT(mul_fits(heads - 1, x.head_stride, term) && !__builtin_add_overflow(end, term, &end));
    FUZZ_ASSERT(!__builtin_add_overflow(end, p.head_dim, &end));
  }
  // No two rows overlap: checked by enumeration when the view is small.
  int64_t rows = 0;
  if (p.batch >= 1 && heads >= 1 && x.tokens >= 0 && mul_fits(p.batch, x.tokens, rows) && mul_fits(rows, heads, rows) &&
      rows <= 4096 && p.batch <= 4096 && x.tokens <= 4096 && heads <= 4096) {
    std::vector<int64_t> starts;
    starts.reserve(static_cast<std::size_t>(rows));
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t t = 0; t < x.tokens; ++t)
        for (int64_t h = 0; h < heads; ++h)
          starts.push_back(b * x.batch_stride + t * x.token_stride + h * x.head_stride);
    std::sort(starts.begin(), starts.end());
    for (std::size_t i = 1; i < starts.size(); ++i) FUZZ_ASSERT(starts[i] - starts[i - 1] >= p.head_dim);
  }
}

void fuzz_tensor(reader& in, const problem& p) {
  const int64_t heads = in.flag() ? p.q_heads : in.size(8);
  basic_tensor<const void*> x;
  x.data = fake_pointer(in);
  const uint8_t mode = in.byte();
  const int64_t expected = in.size(200);
  x.tokens = mode % 4 == 0 ? in.size(200) : expected;
  if (mode % 3 == 0) {
    // A dense layout, so that the accepting paths get exercised too.
    x = dense(x.data, x.tokens, heads, p.head_dim, (mode & 8) != 0);
  } else {
    x.batch_stride = in.size(4096);
    x.token_stride = in.size(1024);
    x.head_stride = in.size(512);
  }
  check_tensor_invariants(x, p, heads, expected, target::cpu);
  check_tensor_invariants(x, p, heads, expected, target::gpu);
}

void fuzz_pointer_and_workspace(reader& in) {
  const void* ptr = fake_pointer(in);
  const std::size_t align = std::size_t(1) << (in.byte() % 9);
  const status s = check_pointer("ptr", ptr, align);
  if (s) FUZZ_ASSERT(ptr != nullptr && reinterpret_cast<std::uintptr_t>(ptr) % align == 0);
  const std::size_t given = static_cast<std::size_t>(in.bits(in.byte() % 9));
  const std::size_t needed = static_cast<std::size_t>(in.bits(in.byte() % 9));
  const void* ws = fake_pointer(in);
  const status w = check_workspace(ws, given, needed);
  if (w && needed > 0) FUZZ_ASSERT(ws != nullptr && reinterpret_cast<std::uintptr_t>(ws) % 256 == 0 && given >= needed);
  if (!w) FUZZ_ASSERT(w.code() == errc::bad_workspace || w.code() == errc::misaligned_pointer);
}

// Caller q2k lists for a small accepted problem, sized exactly as the contract says.
struct host_lists {
  std::vector<int32_t> q2k, count;
  int64_t capacity = 0;
  const_index_lists view() const { return {q2k.data(), count.data(), capacity, nullptr, nullptr}; }
};

bool small_problem(const problem& p, int64_t& rows) {
  if (!check_problem(p, target::cpu)) return false;
  const int64_t n = tile_geometry(p.grid).num_tiles();
  return mul_fits(p.batch * p.q_heads, n, rows) && rows <= 512 && n <= 64;
}

host_lists read_lists(reader& in, const problem& p, int64_t rows) {
  const int64_t n = tile_geometry(p.grid).num_tiles();
  host_lists l;
  const uint8_t mode = in.byte();
  l.capacity = mode % 8 == 0 ? static_cast<int64_t>(in.byte() % 72) - 3 : 1 + in.byte() % n;
  const int64_t stored = l.capacity >= 1 && l.capacity <= n ? rows * l.capacity : 0;
  l.q2k.assign(static_cast<std::size_t>(std::max<int64_t>(stored, 1)), -1);
  l.count.assign(static_cast<std::size_t>(rows), 0);
  const bool well_formed = (mode & 16) != 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (stored == 0) break;
    if (well_formed) {
      // Ascending distinct tiles from a bit pattern of the input.
      int32_t c = 0;
      for (int64_t j = 0; j < n && c < l.capacity; ++j)
        if (in.byte() & 1) l.q2k[static_cast<std::size_t>(r * l.capacity + c++)] = static_cast<int32_t>(j);
      l.count[static_cast<std::size_t>(r)] = c;
    } else {
      l.count[static_cast<std::size_t>(r)] = static_cast<int32_t>(static_cast<int8_t>(in.byte()));
      for (int64_t j = 0; j < l.capacity; ++j)
        l.q2k[static_cast<std::size_t>(r * l.capacity + j)] = static_cast<int32_t>(static_cast<int8_t>(in.byte()));
    }
  }
  return l;
}

void check_lists_invariants(const problem& p, const host_lists& l, int64_t rows) {
  const status s = check_q2k_host(p, l.view());
  if (!s) return;
  const int64_t n = tile_geometry(p.grid).num_tiles();
  FUZZ_ASSERT(l.capacity >= 1 && l.capacity <= n);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t c = l.count[static_cast<std::size_t>(r)];
    FUZZ_ASSERT(c >= 0 && c <= l.capacity);
    for (int32_t j = 0; j < c; ++j) {
      const int32_t t = l.q2k[static_cast<std::size_t>(r * l.capacity + j)];
      FUZZ_ASSERT(t >= 0 && t < n);
      if (j > 0) FUZZ_ASSERT(t > l.q2k[static_cast<std::size_t>(r * l.capacity + j - 1)]);
    }
  }
}

void fuzz_top_k(reader& in, int64_t n) {
  options opt;
  opt.top_k = in.flag() ? 0 : in.size(70);
  opt.sparsity = in.real();
  const int64_t k = resolve_top_k(n, opt);
  FUZZ_ASSERT(k == 0 || (k >= 1 && k <= n));
  if (opt.top_k != 0) {
    FUZZ_ASSERT(k == (opt.top_k >= 1 && opt.top_k <= n ? opt.top_k : 0));
  } else if (!(opt.sparsity >= 0.0 && opt.sparsity < 1.0)) {
    FUZZ_ASSERT(k == 0);
  } else {
    const double want = std::ceil((1.0 - opt.sparsity) * static_cast<double>(n));
    const int64_t expect = std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(want)));
    FUZZ_ASSERT(k == expect);
  }
}

// Raster -> slot -> raster round trip over a whole small grid, and the per-tile valid counts.
void fuzz_geometry(reader& in) {
  const grid3 g{1 + in.byte() % 13, 1 + in.byte() % 13, 1 + in.byte() % 13};
  const tile_geometry geo(g);
  const int64_t n = geo.num_tiles(), raster = geo.raster_tokens();
  std::vector<int> seen(static_cast<std::size_t>(geo.tiled_tokens()), 0);
  for (int64_t r = 0; r < raster; ++r) {
    const int64_t slot = geo.slot_of_raster(r);
    FUZZ_ASSERT(slot >= 0 && slot < geo.tiled_tokens());
    FUZZ_ASSERT(seen[static_cast<std::size_t>(slot)]++ == 0);
    const int64_t tile = slot / tile_tokens;
    const int s = static_cast<int>(slot % tile_tokens);
    FUZZ_ASSERT(s < geo.valid(tile));
    FUZZ_ASSERT(geo.raster_of_slot(tile, s) == r);
  }
  int64_t total = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int valid = geo.valid(t);
    const grid3 e = geo.extent(t);
    FUZZ_ASSERT(valid == e.t * e.h * e.w && valid >= 1 && valid <= tile_tokens);
    total += valid;
    for (int s = 0; s < tile_tokens; ++s) {
      const int64_t r = geo.raster_of_slot(t, s);
      FUZZ_ASSERT((r >= 0) == (s < valid));
      FUZZ_ASSERT(seen[static_cast<std::size_t>(t * tile_tokens + s)] == (s < valid ? 1 : 0));
      if (r >= 0) FUZZ_ASSERT(geo.slot_of_raster(r) == t * tile_tokens + s);
    }
  }
  FUZZ_ASSERT(total == raster);
}

// The reference op: its size query, and a call whose workspace is one byte short (fake pointers
// everywhere): whatever else is wrong, it must return an error before touching memory.
void fuzz_reference_op(reader& in, const problem& p, const host_lists* lists) {
  options opt;
  opt.top_k = in.flag() ? 0 : in.size(70);
  opt.sparsity = in.real();
  opt.scale = in.flag() ? 0.0f : static_cast<float>(in.real());
  if (lists != nullptr && in.flag()) opt.q2k = lists->view();
  const bool caller_lists = opt.q2k.q2k != nullptr;

  const auto view = [&]() {
    const void* data = fake_pointer(in);
    const int64_t tokens = check_problem(p, target::cpu) ? tile_geometry(p.grid).tiled_tokens() : in.size(100);
    const int64_t heads = in.flag() ? p.q_heads : p.kv_heads;
    return dense(data, tokens, heads, p.head_dim, in.flag());
  };
  const auto mutable_view = [&]() {
    const const_tensor c = view();
    return tensor{const_cast<void*>(c.data), c.tokens, c.batch_stride, c.token_stride, c.head_stride};
  };
  forward_io fio{view(), view(), view(), in.flag() ? view() : const_tensor{}, mutable_view()};
  backward_io bio{view(),         view(),         view(),         in.flag() ? view() : const_tensor{},  view(), view(),
                  mutable_view(), mutable_view(), mutable_view(), in.flag() ? mutable_view() : tensor{}};

  const std::size_t untouched = 0xdeadbeef;
  std::size_t forward_bytes = untouched, backward_bytes = untouched;
  const status f = reference::forward(p, opt, fio, nullptr, forward_bytes);
  const status b = reference::backward(p, opt, bio, nullptr, backward_bytes);
  FUZZ_ASSERT(f.is_ok() == b.is_ok()); // both sizes depend on the same plan
  if (f) {
    FUZZ_ASSERT(check_problem(p, target::cpu));
    const int64_t n = tile_geometry(p.grid).num_tiles();
    if (!caller_lists) FUZZ_ASSERT(resolve_top_k(n, opt) >= 1);
    // The forward saves o_s, so its workspace holds at least B·Hq·N·64·D elements.
    const std::size_t o_s =
        static_cast<std::size_t>(p.batch * p.q_heads * n * tile_tokens * p.head_dim) * dtype_size(p.type);
    FUZZ_ASSERT(forward_bytes != untouched && forward_bytes >= o_s && forward_bytes % 256 == 0);
    FUZZ_ASSERT(backward_bytes != untouched && backward_bytes >= o_s && backward_bytes % 256 == 0);
  } else {
    FUZZ_ASSERT(std::strlen(f.message()) > 0);
    return;
  }
  // A short workspace: every check may pass but the last, which must then fail.
  void* ws = reinterpret_cast<void*>(std::uintptr_t(1) << 41);
  std::size_t short_forward = forward_bytes - 1, short_backward = backward_bytes - 1;
  FUZZ_ASSERT(!reference::forward(p, opt, fio, ws, short_forward));
  FUZZ_ASSERT(!reference::backward(p, opt, bio, ws, short_backward));
}

} // namespace
} // namespace vsa

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  using namespace vsa;
  reader in(data, size);
  const problem p = read_problem(in);
  check_problem_invariants(p);
  fuzz_tensor(in, p);
  fuzz_pointer_and_workspace(in);
  int64_t rows = 0;
  host_lists lists;
  const bool small = small_problem(p, rows);
  if (small) {
    lists = read_lists(in, p, rows);
    check_lists_invariants(p, lists, rows);
  }
  // N >= 1 always (check_problem); resolve_top_k is only defined there.
  fuzz_top_k(in, check_problem(p, target::cpu) ? tile_geometry(p.grid).num_tiles() : 1 + (in.size(100) & 0xffffff));
  fuzz_geometry(in);
  fuzz_reference_op(in, p, small ? &lists : nullptr);
  return 0;
}
