// Shared machinery of the CPU reference: scale and argument checks, the thread pool loop, and copies
// between strided tensors of any dtype and dense double arrays, in which every stage computes.
#pragma once

#include "../geometry.hpp"
#include "../numeric.hpp"
#include "../types.hpp"
#include "../validate.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

namespace vsa {
namespace reference {

// The softmax scale the whole op uses: options.scale, or 1/sqrt(head_dim) when it is 0 (validate.hpp, shared
// with the GPU entry points).
using vsa::detail::resolve_scale;

namespace detail {

using vsa::detail::check_scale;

// Plain arrays the reference reads as T: present and aligned for T.
template <class T> status check_array(const char* name, T* ptr) {
  return check_pointer(name, ptr, alignof(typename std::remove_cv<T>::type));
}
inline status check_array(const char* name, const void* ptr) { return check_pointer(name, ptr, 1); }
inline status check_array(const char* name, void* ptr) { return check_pointer(name, ptr, 1); }

// Runs body(begin, end) over [0, count) in chunks on hardware_concurrency() threads. Chunks are handed
// out dynamically, so uneven rows (partial tiles, ragged lists) still balance. Each body call owns its
// range, so results never depend on the number of threads.
template <class Body> void parallel_for(int64_t count, const Body& body) {
  if (count <= 0) return;
  const unsigned hw = std::thread::hardware_concurrency();
  const int64_t threads = std::min<int64_t>(hw == 0 ? 1 : hw, count);
  if (threads <= 1) {
    body(int64_t(0), count);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, count / (threads * 8));
  std::atomic<int64_t> next{0};
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  auto worker = [&]() {
    try {
      for (;;) {
        if (failed.load()) return;
        const int64_t begin = next.fetch_add(chunk);
        if (begin >= count) return;
        body(begin, std::min(count, begin + chunk));
      }
    } catch (...) {
      if (!failed.exchange(true)) failure = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  try {
    for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  } catch (...) {
    // No more threads to be had: the ones started and this one finish the work.
  }
  worker();
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

// Runs a stage body, turning a failed host allocation (or thread start) into a status.
template <class F> status guarded(const char* what, const F& f) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return status::error(errc::runtime_error, "%s: host memory allocation failed", what);
  } catch (const std::exception& e) {
    return status::error(errc::runtime_error, "%s: %s", what, e.what());
  }
}

// Dense double arrays are [B, H, S, D] (or [B, H, N, D] for per-tile values) in this order.
struct dense_shape {
  int64_t batch, heads, tokens, dim;
  int64_t size() const { return batch * heads * tokens * dim; }
  int64_t row(int64_t b, int64_t h, int64_t s) const { return ((b * heads + h) * tokens + s) * dim; }
};

inline int64_t tensor_offset(const const_tensor& x, int64_t b, int64_t s, int64_t h) {
  return b * x.batch_stride + s * x.token_stride + h * x.head_stride;
}

inline void load_row(const void* base, int64_t offset, int64_t n, dtype t, double* out) {
  switch (t) {
  case dtype::f64:
    std::memcpy(out, static_cast<const double*>(base) + offset, static_cast<std::size_t>(n) * sizeof(double));
    return;
  case dtype::f32: {
    const float* p = static_cast<const float*>(base) + offset;
    for (int64_t d = 0; d < n; ++d) out[d] = p[d];
    return;
  }
  default:
    for (int64_t d = 0; d < n; ++d) out[d] = load(base, offset + d, t);
  }
}

inline void store_row(void* base, int64_t offset, int64_t n, dtype t, const double* in) {
  for (int64_t d = 0; d < n; ++d) store(base, offset + d, in[d], t);
}

// Whole strided tensor -> dense [B, H, S, D] doubles.
inline void gather(const problem& p, int64_t heads, const const_tensor& x, double* out) {
  const dense_shape shape{p.batch, heads, x.tokens, p.head_dim};
  parallel_for(p.batch * heads, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      for (int64_t s = 0; s < x.tokens; ++s)
        load_row(x.data, tensor_offset(x, b, s, h), p.head_dim, p.type, out + shape.row(b, h, s));
    }
  });
}

// Every row of `from` (elements of from_type) into `to`, rounded to p.type; both views of to.tokens tokens.
inline void copy_rows(const problem& p, int64_t heads, const const_tensor& from, dtype from_type, const tensor& to) {
  const const_tensor out = as_const(to);
  parallel_for(p.batch * heads, [&](int64_t begin, int64_t end) {
    std::vector<double> row(static_cast<std::size_t>(p.head_dim));
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      for (int64_t s = 0; s < to.tokens; ++s) {
        load_row(from.data, tensor_offset(from, b, s, h), p.head_dim, from_type, row.data());
        store_row(to.data, tensor_offset(out, b, s, h), p.head_dim, p.type, row.data());
      }
    }
  });
}

// Dense [B, H, S, D] doubles -> strided tensor, rounded to p.type.
inline void scatter(const problem& p, int64_t heads, const double* in, const tensor& x) {
  copy_rows(p, heads, bhsd<const void*>(in, p.batch, x.tokens, heads, p.head_dim), dtype::f64, x);
}

// Tokens first .. first + count of a view of elements of type t (the video part or the extra part of a joint
// tensor). A null view stays null: an absent gate.
template <class Ptr> basic_tensor<Ptr> token_range(const basic_tensor<Ptr>& x, int64_t first, int64_t count, dtype t) {
  using byte = typename std::conditional<std::is_const<typename std::remove_pointer<Ptr>::type>::value,
                                         const unsigned char, unsigned char>::type;
  const int64_t offset = first * x.token_stride * static_cast<int64_t>(dtype_size(t));
  const Ptr data = x.data == nullptr ? x.data : static_cast<Ptr>(static_cast<byte*>(x.data) + offset);
  return {data, count, x.batch_stride, x.token_stride, x.head_stride};
}

// Contiguous typed array of n elements <-> doubles.
inline void load_array(const void* base, int64_t n, dtype t, double* out) {
  parallel_for(n, [&](int64_t begin, int64_t end) { load_row(base, begin, end - begin, t, out + begin); });
}
inline void store_array(void* base, int64_t n, dtype t, const double* in) {
  parallel_for(n, [&](int64_t begin, int64_t end) { store_row(base, begin, end - begin, t, in + begin); });
}

// Four partial sums break the dependency chain of one accumulator (several times faster); the order is
// fixed, so results stay deterministic.
inline double dot(const double* a, const double* b, int64_t n) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t d = 0;
  for (; d + 4 <= n; d += 4) {
    s0 += a[d] * b[d];
    s1 += a[d + 1] * b[d + 1];
    s2 += a[d + 2] * b[d + 2];
    s3 += a[d + 3] * b[d + 3];
  }
  for (; d < n; ++d) s0 += a[d] * b[d];
  return (s0 + s1) + (s2 + s3);
}
inline void axpy(double alpha, const double* x, double* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += alpha * x[d];
}

inline bool is_plus_inf(double x) { return std::isinf(x) && x > 0.0; }

// Validates a tiled tensor of `heads` heads (N·64 slots, and the extra tokens of a joint tensor).
template <class Ptr> status check_tiled(const char* name, const basic_tensor<Ptr>& x, const problem& p, int64_t heads,
                                        const extra_tokens& extra = {}) {
  return check_joint_tensor(name, x, p, heads, tile_geometry(p.grid).tiled_tokens(), extra, target::cpu);
}

} // namespace detail
} // namespace reference
} // namespace vsa
