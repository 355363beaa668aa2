// Device-side test helpers shared by every GPU test: runtime calls checked with REQUIRE, streams and device
// buffers that free themselves, canary bytes on both sides of every buffer, poisoning of outputs before a
// call, and checks afterwards that every element was written and nothing around the buffer was touched.
//
// Allocation happens here, in the tests, never in the library.
#pragma once

#include "catch.hpp"
#include "host.hpp"

#include <vsa/gpu/runtime.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace vsa {
namespace test {

// ---- runtime calls --------------------------------------------------------------------------------------

#if VSA_RUNTIME_HIP
inline gpu::error_t device_malloc(void** p, std::size_t n) { return hipMalloc(p, n); }
inline gpu::error_t device_free(void* p) { return hipFree(p); }
inline gpu::error_t copy_to_device(void* dst, const void* src, std::size_t n) {
  return hipMemcpy(dst, src, n, hipMemcpyHostToDevice);
}
inline gpu::error_t copy_to_host(void* dst, const void* src, std::size_t n) {
  return hipMemcpy(dst, src, n, hipMemcpyDeviceToHost);
}
inline gpu::error_t copy_device_to_device(void* dst, const void* src, std::size_t n) {
  return hipMemcpy(dst, src, n, hipMemcpyDeviceToDevice);
}
inline gpu::error_t gpu_sync() { return hipDeviceSynchronize(); }
inline gpu::error_t stream_create_non_blocking(gpu::stream_t* s) {
  return hipStreamCreateWithFlags(s, hipStreamNonBlocking);
}
inline gpu::error_t stream_destroy(gpu::stream_t s) { return hipStreamDestroy(s); }
inline gpu::error_t stream_sync(gpu::stream_t s) { return hipStreamSynchronize(s); }
#else
inline gpu::error_t device_malloc(void** p, std::size_t n) { return cudaMalloc(p, n); }
inline gpu::error_t device_free(void* p) { return cudaFree(p); }
inline gpu::error_t copy_to_device(void* dst, const void* src, std::size_t n) {
  return cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice);
}
inline gpu::error_t copy_to_host(void* dst, const void* src, std::size_t n) {
  return cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost);
}
inline gpu::error_t copy_device_to_device(void* dst, const void* src, std::size_t n) {
  return cudaMemcpy(dst, src, n, cudaMemcpyDeviceToDevice);
}
inline gpu::error_t gpu_sync() { return cudaDeviceSynchronize(); }
inline gpu::error_t stream_create_non_blocking(gpu::stream_t* s) {
  return cudaStreamCreateWithFlags(s, cudaStreamNonBlocking);
}
inline gpu::error_t stream_destroy(gpu::stream_t s) { return cudaStreamDestroy(s); }
inline gpu::error_t stream_sync(gpu::stream_t s) { return cudaStreamSynchronize(s); }
#endif

// REQUIREs a runtime call to succeed, naming the call and the runtime's message when it does not.
#define VSA_REQUIRE_RT(call)                                                                                           \
  do {                                                                                                                 \
    const ::vsa::gpu::error_t vsa_rt_result_ = (call);                                                                 \
    INFO(#call << ": " << ::vsa::gpu::error_string(vsa_rt_result_));                                                   \
    REQUIRE(vsa_rt_result_ == ::vsa::gpu::success);                                                                    \
  } while (0)

// ---- poison and canaries --------------------------------------------------------------------------------

// Poison of float outputs: poison_byte (host.hpp) in every byte reads as NaN in bf16, fp16, f32 and f64.
// Index outputs use -1 for unused entries, so they are poisoned with index_poison_byte instead:
// 0x7f7f7f7f is no tile index, count or offset any test produces.
inline constexpr unsigned char index_poison_byte = 0x7f;
inline constexpr int32_t index_poison = 0x7f7f7f7f;

// Bytes kept on each side of every device buffer; a multiple of 256, so the payload keeps the
// allocation's alignment.
inline constexpr std::size_t canary_bytes = 256;
inline unsigned char canary_byte(std::size_t i) { return static_cast<unsigned char>(0xa5u ^ (i * 37u)); }

// ---- device buffers -------------------------------------------------------------------------------------

// A device allocation of `bytes` bytes between two canary zones, freed on destruction. get() is the
// payload, 256-byte aligned.
class device_buffer {
public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) {
    // One canary zone more than needed, so that the payload is 256-byte aligned whatever the allocator
    // returns.
    void* p = nullptr;
    VSA_REQUIRE_RT(device_malloc(&p, bytes + 3 * canary_bytes));
    raw_ = static_cast<unsigned char*>(p);
    base_ = raw_ + (canary_bytes - reinterpret_cast<std::uintptr_t>(raw_) % canary_bytes) % canary_bytes;
    std::vector<unsigned char> guard(canary_bytes);
    for (std::size_t i = 0; i < canary_bytes; ++i) guard[i] = canary_byte(i);
    VSA_REQUIRE_RT(copy_to_device(base_, guard.data(), canary_bytes));
    VSA_REQUIRE_RT(copy_to_device(base_ + canary_bytes + bytes_, guard.data(), canary_bytes));
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& o) noexcept : raw_(o.raw_), base_(o.base_), bytes_(o.bytes_) {
    o.raw_ = o.base_ = nullptr;
    o.bytes_ = 0;
  }
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(raw_, o.raw_);
    std::swap(base_, o.base_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~device_buffer() {
    if (raw_ != nullptr) (void)device_free(raw_);
  }

  void* get() const { return base_ == nullptr ? nullptr : base_ + canary_bytes; }
  template <class T> T* as() const { return static_cast<T*>(get()); }
  std::size_t bytes() const { return bytes_; }

  void fill(unsigned char byte) {
    const std::vector<unsigned char> host(bytes_, byte);
    VSA_REQUIRE_RT(copy_to_device(get(), host.data(), bytes_));
  }
  // For float outputs; index outputs take poison_indices().
  void poison() { fill(poison_byte); }
  void poison_indices() { fill(index_poison_byte); }

  void upload_bytes(const void* host, std::size_t n, std::size_t offset = 0) {
    REQUIRE(offset + n <= bytes_);
    VSA_REQUIRE_RT(copy_to_device(static_cast<unsigned char*>(get()) + offset, host, n));
  }
  std::vector<unsigned char> download_bytes() const {
    std::vector<unsigned char> host(bytes_);
    VSA_REQUIRE_RT(copy_to_host(host.data(), get(), bytes_));
    return host;
  }
  // The whole payload as T, or `count` T from byte `offset` on.
  template <class T> std::vector<T> download() const {
    return download<T>(0, static_cast<int64_t>(bytes_ / sizeof(T)));
  }
  template <class T> std::vector<T> download(std::size_t offset, int64_t count) const {
    REQUIRE(offset + static_cast<std::size_t>(count) * sizeof(T) <= bytes_);
    std::vector<T> host(static_cast<std::size_t>(count));
    VSA_REQUIRE_RT(
        copy_to_host(host.data(), static_cast<const unsigned char*>(get()) + offset, host.size() * sizeof(T)));
    return host;
  }

  // Whether the bytes on both sides of the payload still hold the pattern written at allocation.
  bool canaries_intact() const {
    std::vector<unsigned char> before(canary_bytes), after(canary_bytes);
    VSA_REQUIRE_RT(copy_to_host(before.data(), base_, canary_bytes));
    VSA_REQUIRE_RT(copy_to_host(after.data(), base_ + canary_bytes + bytes_, canary_bytes));
    for (std::size_t i = 0; i < canary_bytes; ++i)
      if (before[i] != canary_byte(i) || after[i] != canary_byte(i)) return false;
    return true;
  }

private:
  unsigned char* raw_ = nullptr;  // what the allocator returned
  unsigned char* base_ = nullptr; // the first canary zone, 256-byte aligned
  std::size_t bytes_ = 0;
};

// A stream created non-blocking (it does not wait for, nor hold up, the null stream), destroyed on
// destruction. destroy() hands back the runtime's answer, for tests that check it.
class device_stream {
public:
  device_stream() { VSA_REQUIRE_RT(stream_create_non_blocking(&stream_)); }
  device_stream(const device_stream&) = delete;
  device_stream& operator=(const device_stream&) = delete;
  ~device_stream() {
    if (stream_ != nullptr) (void)stream_destroy(stream_);
  }

  gpu::stream_t get() const { return stream_; }
  gpu::error_t sync() const { return stream_sync(stream_); }
  gpu::error_t destroy() {
    const gpu::stream_t s = stream_;
    stream_ = nullptr;
    return s == nullptr ? gpu::success : stream_destroy(s);
  }

private:
  gpu::stream_t stream_ = nullptr;
};

template <class T> device_buffer upload(const std::vector<T>& host) {
  device_buffer d(host.size() * sizeof(T));
  if (!host.empty()) d.upload_bytes(host.data(), host.size() * sizeof(T));
  return d;
}

// Number of elements of `values` still holding the index poison.
inline int64_t count_index_poison(const std::vector<int32_t>& values) {
  int64_t n = 0;
  for (const int32_t v : values) n += v == index_poison ? 1 : 0;
  return n;
}

// Number of elements of `size` bytes whose bytes all equal the float poison.
inline int64_t count_poisoned_elements(const std::vector<unsigned char>& bytes, std::size_t size) {
  int64_t n = 0;
  for (std::size_t e = 0; e + size <= bytes.size(); e += size) {
    bool all = true;
    for (std::size_t i = 0; i < size; ++i) all = all && bytes[e + i] == poison_byte;
    n += all ? 1 : 0;
  }
  return n;
}

// ---- device tensors -------------------------------------------------------------------------------------

struct poisoned_t {};
inline constexpr poisoned_t poisoned{};

// The device copy of a host_tensor: same dtype, shape and layout, densely packed, between canaries.
// Built from a host tensor it holds its values; built with `poisoned` it holds the float poison, to be
// overwritten by the call under test.
class device_tensor {
public:
  explicit device_tensor(const host_tensor& h) : shape_(shape_of(h)), buffer_(h.bytes.size()) {
    if (!h.bytes.empty()) buffer_.upload_bytes(h.bytes.data(), h.bytes.size());
  }
  device_tensor(const host_tensor& shape, poisoned_t) : shape_(shape_of(shape)), buffer_(shape.bytes.size()) {
    buffer_.poison();
  }

  tensor view() {
    return {buffer_.get(), shape_.tokens, shape_.batch_stride(), shape_.token_stride(), shape_.head_stride()};
  }
  const_tensor cview() const {
    return {buffer_.get(), shape_.tokens, shape_.batch_stride(), shape_.token_stride(), shape_.head_stride()};
  }
  void* raw() { return buffer_.get(); }
  const void* raw() const { return buffer_.get(); }
  const host_tensor& shape() const { return shape_; }
  device_buffer& buffer() { return buffer_; }

  host_tensor download() const {
    host_tensor h = shape_;
    h.bytes = buffer_.download_bytes();
    return h;
  }
  // Every element's value as a double in storage order (bitwise comparisons between runs).
  std::vector<double> download_raw() const {
    const host_tensor h = download();
    std::vector<double> r(static_cast<std::size_t>(h.elements()));
    for (int64_t e = 0; e < h.elements(); ++e) r[static_cast<std::size_t>(e)] = h.at(e);
    return r;
  }
  // Whether no element still holds the poison it was created with.
  bool all_written() const { return poisoned_elements() == 0; }
  int64_t poisoned_elements() const {
    return count_poisoned_elements(buffer_.download_bytes(), dtype_size(shape_.type));
  }
  bool canaries_intact() const { return buffer_.canaries_intact(); }

private:
  // The shape without the host's values (they are not needed on this side).
  static host_tensor shape_of(const host_tensor& h) {
    host_tensor s;
    s.type = h.type;
    s.batch = h.batch;
    s.tokens = h.tokens;
    s.heads = h.heads;
    s.dim = h.dim;
    s.order = h.order;
    return s;
  }
  host_tensor shape_;
  device_buffer buffer_;
};

} // namespace test
} // namespace vsa
