// Block-wide scan, reduction and radix sort under one interface: rocPRIM on AMD, CUB on NVIDIA. Kernels use
// these instead of their own shared-memory trees, so that every platform gets its vendor's tuned version.
//
// Each class is constructed per call site from its TempStorage, which the kernel places in shared memory
// (alone or in a union with other storage). As with CUB and rocPRIM, a __syncthreads() is needed before
// the same storage is used again.
#pragma once

#include "arch/element.hpp"
#include "runtime.hpp"

#if VSA_PLATFORM_AMD
// Debian's rocPRIM 5.3 headers do not compile one by one; the umbrella header does.
#include <rocprim/rocprim.hpp>
#else
#include <cub/cub.cuh>
#endif

namespace vsa {
namespace gpu {

// Sums across the threads of a block, in thread order.
template <class T, int BlockThreads> class block_scan {
#if VSA_PLATFORM_AMD
  using impl = rocprim::block_scan<T, BlockThreads>;

public:
  using TempStorage = typename impl::storage_type;
  __device__ explicit block_scan(TempStorage& storage) : storage_(storage) {}
  __device__ void exclusive_sum(T input, T& output) { impl().exclusive_scan(input, output, T(0), storage_); }
  __device__ void exclusive_sum(T input, T& output, T& total) {
    impl().exclusive_scan(input, output, T(0), total, storage_);
  }
  __device__ void inclusive_sum(T input, T& output) { impl().inclusive_scan(input, output, storage_); }
  // Items are in blocked order: thread t holds positions t·Items ... t·Items + Items - 1.
  template <int Items> __device__ void exclusive_sum(T (&input)[Items], T (&output)[Items], T& total) {
    impl().exclusive_scan(input, output, T(0), total, storage_);
  }
#else
  using impl = cub::BlockScan<T, BlockThreads>;

public:
  using TempStorage = typename impl::TempStorage;
  __device__ explicit block_scan(TempStorage& storage) : storage_(storage) {}
  __device__ void exclusive_sum(T input, T& output) { impl(storage_).ExclusiveSum(input, output); }
  __device__ void exclusive_sum(T input, T& output, T& total) { impl(storage_).ExclusiveSum(input, output, total); }
  __device__ void inclusive_sum(T input, T& output) { impl(storage_).InclusiveSum(input, output); }
  template <int Items> __device__ void exclusive_sum(T (&input)[Items], T (&output)[Items], T& total) {
    impl(storage_).ExclusiveSum(input, output, total);
  }
#endif

private:
  TempStorage& storage_;
};

// Reduction across the threads of a block; the result is valid in thread 0 only.
template <class T, int BlockThreads> class block_reduce {
#if VSA_PLATFORM_AMD
  using impl = rocprim::block_reduce<T, BlockThreads>;

public:
  using TempStorage = typename impl::storage_type;
  __device__ explicit block_reduce(TempStorage& storage) : storage_(storage) {}
  __device__ T sum(T input) {
    T out;
    impl().reduce(input, out, storage_);
    return out;
  }
  template <class Op> __device__ T reduce(T input, Op op) {
    T out;
    impl().reduce(input, out, storage_, op);
    return out;
  }
#else
  using impl = cub::BlockReduce<T, BlockThreads>;

public:
  using TempStorage = typename impl::TempStorage;
  __device__ explicit block_reduce(TempStorage& storage) : storage_(storage) {}
  __device__ T sum(T input) { return impl(storage_).Sum(input); }
  template <class Op> __device__ T reduce(T input, Op op) { return impl(storage_).Reduce(input, op); }
#endif

private:
  TempStorage& storage_;
};

// Radix sort of key-value pairs held in blocked order (Items per thread); stable, on bits
// [begin_bit, end_bit) of the key.
template <class Key, class Value, int BlockThreads, int Items> class block_radix_sort {
#if VSA_PLATFORM_AMD
  using impl = rocprim::block_radix_sort<Key, BlockThreads, Items, Value>;

public:
  using TempStorage = typename impl::storage_type;
  __device__ explicit block_radix_sort(TempStorage& storage) : storage_(storage) {}
  __device__ void sort(Key (&keys)[Items], Value (&values)[Items], int begin_bit = 0, int end_bit = 8 * sizeof(Key)) {
    impl().sort(keys, values, storage_, static_cast<unsigned>(begin_bit), static_cast<unsigned>(end_bit));
  }
  __device__ void sort_descending(Key (&keys)[Items], Value (&values)[Items], int begin_bit = 0,
                                  int end_bit = 8 * sizeof(Key)) {
    impl().sort_desc(keys, values, storage_, static_cast<unsigned>(begin_bit), static_cast<unsigned>(end_bit));
  }
#else
  using impl = cub::BlockRadixSort<Key, BlockThreads, Items, Value>;

public:
  using TempStorage = typename impl::TempStorage;
  __device__ explicit block_radix_sort(TempStorage& storage) : storage_(storage) {}
  __device__ void sort(Key (&keys)[Items], Value (&values)[Items], int begin_bit = 0, int end_bit = 8 * sizeof(Key)) {
    impl(storage_).Sort(keys, values, begin_bit, end_bit);
  }
  __device__ void sort_descending(Key (&keys)[Items], Value (&values)[Items], int begin_bit = 0,
                                  int end_bit = 8 * sizeof(Key)) {
    impl(storage_).SortDescending(keys, values, begin_bit, end_bit);
  }
#endif

private:
  TempStorage& storage_;
};

namespace detail {

// Blocks for a grid-stride loop over `items` work items: enough to fill the device many times over, never
// more than a 1-D grid takes.
inline unsigned grid_blocks(int64_t items, int64_t cap = int64_t(1) << 20) {
  return static_cast<unsigned>(items < 1 ? 1 : (items < cap ? items : cap));
}

// A [B, S, H, D] tensor of 16-bit elements seen as rows of 16-byte vectors (V = uint4 or const uint4);
// strides in vectors. The validation has checked that the strides are whole vectors.
template <class V> struct vector_view {
  V* data;
  int64_t batch_stride, token_stride, head_stride;
  __device__ V* row(int64_t b, int64_t s, int64_t h) const {
    return data + b * batch_stride + s * token_stride + h * head_stride;
  }
};

template <class V, class Ptr> vector_view<V> make_vector_view(const basic_tensor<Ptr>& x) {
  return {static_cast<V*>(x.data), x.batch_stride / 8, x.token_stride / 8, x.head_stride / 8};
}

// Eight 16-bit elements of one vector <-> fp32.
template <class E> __device__ __forceinline__ void unpack8(const uint4& x, float (&f)[8]) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = E::to_float(static_cast<uint16_t>(w[i] & 0xffffu));
    f[2 * i + 1] = E::to_float(static_cast<uint16_t>(w[i] >> 16));
  }
}
template <class E> __device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(E::pack(f[0], f[1]), E::pack(f[2], f[3]), E::pack(f[4], f[5]), E::pack(f[6], f[7]));
}

// Calls f(bf16_type{}) or f(fp16_type{}) for the problem's dtype (validated before).
template <class F> status dispatch_element(dtype t, F&& f) {
  if (t == dtype::bf16) return f(bf16_type{});
  if (t == dtype::fp16) return f(fp16_type{});
  return status::error(errc::bad_dtype, "no kernel for %s", dtype_name(t));
}

} // namespace detail

} // namespace gpu
} // namespace vsa
