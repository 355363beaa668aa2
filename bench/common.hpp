// Shared pieces of the GPU benchmarks: the anchor shapes, device buffers, random inputs and event timing.
// Runtime allocation lives here, not in the library (which never allocates).
#pragma once

#include <vsa/gpu/op.hpp>
#include <vsa/numeric.hpp>
#include <vsa/reference.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace vsa {
namespace bench {

#if VSA_RUNTIME_HIP
inline gpu::error_t device_malloc(void** p, std::size_t n) { return hipMalloc(p, n); }
inline gpu::error_t device_free(void* p) { return hipFree(p); }
inline gpu::error_t copy_to_device(void* d, const void* h, std::size_t n) {
  return hipMemcpy(d, h, n, hipMemcpyHostToDevice);
}
inline gpu::error_t copy_to_host(void* h, const void* d, std::size_t n) {
  return hipMemcpy(h, d, n, hipMemcpyDeviceToHost);
}
inline gpu::error_t copy_device(void* d, const void* s, std::size_t n, gpu::stream_t st) {
  return hipMemcpyAsync(d, s, n, hipMemcpyDeviceToDevice, st);
}
using event_t = hipEvent_t;
inline gpu::error_t event_create(event_t* e) { return hipEventCreate(e); }
inline gpu::error_t event_record(event_t e, gpu::stream_t s) { return hipEventRecord(e, s); }
inline gpu::error_t event_sync(event_t e) { return hipEventSynchronize(e); }
inline gpu::error_t event_elapsed(float* ms, event_t a, event_t b) { return hipEventElapsedTime(ms, a, b); }
inline gpu::error_t device_sync() { return hipDeviceSynchronize(); }
#else
inline gpu::error_t device_malloc(void** p, std::size_t n) { return cudaMalloc(p, n); }
inline gpu::error_t device_free(void* p) { return cudaFree(p); }
inline gpu::error_t copy_to_device(void* d, const void* h, std::size_t n) {
  return cudaMemcpy(d, h, n, cudaMemcpyHostToDevice);
}
inline gpu::error_t copy_to_host(void* h, const void* d, std::size_t n) {
  return cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost);
}
inline gpu::error_t copy_device(void* d, const void* s, std::size_t n, gpu::stream_t st) {
  return cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice, st);
}
using event_t = cudaEvent_t;
inline gpu::error_t event_create(event_t* e) { return cudaEventCreate(e); }
inline gpu::error_t event_record(event_t e, gpu::stream_t s) { return cudaEventRecord(e, s); }
inline gpu::error_t event_sync(event_t e) { return cudaEventSynchronize(e); }
inline gpu::error_t event_elapsed(float* ms, event_t a, event_t b) { return cudaEventElapsedTime(ms, a, b); }
inline gpu::error_t device_sync() { return cudaDeviceSynchronize(); }
#endif

inline void check(gpu::error_t e, const char* what) {
  if (e != gpu::success) {
    std::fprintf(stderr, "%s: %s\n", what, gpu::error_string(e));
    std::exit(2);
  }
}
inline void check(const status& s, const char* what) {
  if (!s) {
    std::fprintf(stderr, "%s: %s\n", what, s.message());
    std::exit(2);
  }
}

// A device allocation that frees itself.
class buffer {
public:
  buffer() = default;
  explicit buffer(std::size_t bytes) : bytes_(bytes) { check(device_malloc(&ptr_, bytes ? bytes : 1), "alloc"); }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  buffer(buffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  buffer& operator=(buffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~buffer() {
    if (ptr_) (void)device_free(ptr_);
  }
  template <class T = void> T* get() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// A T made from args once per key and kept for the process. Google Benchmark calls a benchmark function again
// for each repetition and for each trial of its iteration count; inputs built there (allocations, host draws,
// uploads, synchronisations) would cost the run more than its timing.
template <class T, class... Args> T& kept(const std::string& key, const Args&... args) {
  static std::map<std::string, std::unique_ptr<T>> made;
  auto& slot = made[key];
  if (!slot) slot = std::make_unique<T>(args...);
  return *slot;
}

// Element i of random_elements' draw: Box–Muller over two uniforms hashed (splitmix64) from the seed and i / 2, the
// cosine for even i and the sine for odd, rounded to E as the library rounds.
__device__ inline uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
template <class E> __global__ void random_normal_kernel(uint16_t* x, int64_t n, uint64_t seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint64_t h = splitmix64(splitmix64(seed) ^ static_cast<uint64_t>(i / 2));
  const float u1 = static_cast<float>((h >> 40) + 1) * (1.0f / 16777217.0f); // (0, 1)
  const float u2 = static_cast<float>((h >> 16) & 0xffffffu) * (1.0f / 16777216.0f);
  const float r = sqrtf(-2.f * logf(u1)), a = 6.2831853f * u2;
  x[i] = static_cast<uint16_t>(E::pack(i % 2 ? r * sinf(a) : r * cosf(a), 0.f) & 0xffffu);
}

// A device buffer of n 16-bit elements of normal random values (never zeros: zeros run faster than data), drawn
// on the device: the anchor shapes need ~10^8 values, which the host took seconds to draw.
inline buffer random_elements(int64_t n, dtype t, uint64_t seed) {
  buffer b(static_cast<std::size_t>(n) * 2);
  const unsigned blocks = static_cast<unsigned>((n + 255) / 256);
  if (t == dtype::bf16)
    random_normal_kernel<gpu::bf16_type><<<blocks, 256>>>(b.get<uint16_t>(), n, seed);
  else
    random_normal_kernel<gpu::fp16_type><<<blocks, 256>>>(b.get<uint16_t>(), n, seed);
  check(gpu::last_error(), "random draw");
  check(device_sync(), "random draw");
  return b;
}

// One anchor shape of the peers' table.
struct shape {
  const char* name;
  int64_t batch, heads, head_dim;
  grid3 grid;
};
inline const std::vector<shape>& anchors() {
  static const std::vector<shape> s = {
      {"wan2.1-1.3b-480p", 1, 12, 128, {21, 30, 52}},
      {"fastvideo-bench-49k", 1, 12, 128, {48, 32, 32}},
      {"wan2.2-5b-720p", 1, 24, 128, {31, 22, 40}},
      {"hd64-32k", 1, 16, 64, {32, 32, 32}},
  };
  return s;
}
inline problem anchor_problem(const shape& s) {
  problem p;
  p.batch = s.batch;
  p.q_heads = p.kv_heads = s.heads;
  p.head_dim = s.head_dim;
  p.grid = s.grid;
  p.type = dtype::bf16;
  return p;
}

// Keeps the GPU busy for about `cycles` clock cycles (one thread), so that what is launched after it queues up.
__global__ void hold_stream_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
// ~100 us at a 2 GHz clock: longer than the host takes to launch any measured call (the whole op's
// backward is the longest, ~15 launches).
inline constexpr long long hold_cycles = 200000;
inline constexpr double hold_cycles_per_us = 2000.0;

// Calls of f timed together in one pass: as many as make at most batch_ms of GPU work (a power of two, at most
// max_batch), one for a call of half a millisecond or more. Each pass costs a hold and a sync besides what it times
// (~0.1 ms), which for stages of 17-90 us was most of a benchmark's wall time: bench_selection did not finish in two
// minutes with one call a pass.
inline constexpr double batch_ms = 1.0;
inline constexpr int max_batch = 64;
// VSA_BENCH_ONE_CALL=1 in the environment times one call a pass whatever its length: to tell whether back-to-back
// calls of a stage run slower or faster than one call alone.
inline bool one_call_a_pass() {
  static const bool one = [] {
    const char* v = std::getenv("VSA_BENCH_ONE_CALL");
    return v != nullptr && v[0] == '1';
  }();
  return one;
}

// Times f on the stream with events after a few warm-up calls; Google Benchmark reports the statistics (run with
// --benchmark_repetitions and the median). Each pass's launches queue behind hold_stream_kernel, so the start
// event fires when the GPU already has the work: the time is the GPU's, as in a stream that is never idle, and does
// not include the host's latency to launch the first kernel (a few microseconds, which the short stages would
// otherwise carry). A short stage runs a batch of back-to-back calls a pass (batch_ms), behind a hold long enough
// for the host to launch all of them twice over; the time reported is per call.
template <class F> void time_on_stream(benchmark::State& state, gpu::stream_t stream, F&& f) {
  event_t start, stop;
  check(event_create(&start), "event");
  check(event_create(&stop), "event");
  // One call to warm up (code, caches, the clock); the pilot pass below is three more before anything is timed. Google
  // Benchmark runs this whole function for each repetition, so that a 30 ms call's warm-up was most of its run.
  f();
  check(device_sync(), "warm-up");
  // One pass: `calls` calls behind a hold of `hold` cycles; the GPU's milliseconds, and the host's microseconds to
  // launch them.
  const auto pass = [&](int calls, long long hold, double& host_us) {
    hold_stream_kernel<<<1, 1, 0, stream>>>(hold);
    check(gpu::last_error(), "hold");
    const auto launched = std::chrono::steady_clock::now();
    check(event_record(start, stream), "record");
    for (int c = 0; c < calls; ++c) f();
    check(event_record(stop, stream), "record");
    host_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - launched).count();
    check(event_sync(stop), "sync");
    float ms = 0.f;
    check(event_elapsed(&ms, start, stop), "elapsed");
    return ms;
  };
  // A pass of three calls sizes the batch and its hold. The batch is a power of two, so that a stage whose time sits
  // near a boundary rarely changes batch between repetitions.
  constexpr int pilot = 3;
  double host_us = 0.0;
  const float pilot_ms = pass(pilot, hold_cycles, host_us);
  int batch = 1;
  while (!one_call_a_pass() && 2 * batch <= max_batch && 2 * batch * (pilot_ms / pilot) <= batch_ms) batch *= 2;
  const long long hold =
      std::max(hold_cycles, static_cast<long long>(2.0 * host_us / pilot * batch * hold_cycles_per_us));
  // Each pass runs `batch` calls, or what is left of the iterations Google Benchmark asked for, so that every
  // repetition runs exactly that many (its statistics require it). The time set is the pass's: Google Benchmark
  // divides by the iterations, `calls` a pass.
  for (;;) {
    const benchmark::IterationCount left = state.max_iterations - state.iterations();
    const int calls =
        static_cast<int>(std::max<benchmark::IterationCount>(1, std::min<benchmark::IterationCount>(batch, left)));
    if (!state.KeepRunningBatch(calls)) break;
    state.SetIterationTime(pass(calls, hold, host_us) * 1e-3);
  }
  state.counters["batch"] = batch;
}

// The card's device-to-device copy of 2 GiB (read + written), the bandwidth the memory-bound stages are set against:
// every benchmark binary times it in its own run.
struct copy_inputs {
  std::size_t bytes = std::size_t(2) << 30;
  buffer a = random_elements(static_cast<int64_t>(bytes / 2), dtype::bf16, 9), b{bytes};
};
inline void copy_bandwidth(benchmark::State& state) {
  const copy_inputs& c = kept<copy_inputs>("copy");
  time_on_stream(state, nullptr, [&] { check(copy_device(c.b.get(), c.a.get(), c.bytes, nullptr), "copy"); });
  state.counters["GB/s"] = benchmark::Counter(2.0 * c.bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Times f on the host: each iteration the mean of `calls` back-to-back calls, queued behind a hold so that none
// waits for the GPU: what a call costs its caller's thread (argument checks, planning, launches), which a
// binding in another language adds its own cost to.
template <class F> void time_on_host(benchmark::State& state, gpu::stream_t stream, F&& f, int calls = 10) {
  for (int i = 0; i < 3; ++i) f();
  check(device_sync(), "warm-up");
  for (auto _ : state) {
    hold_stream_kernel<<<1, 1, 0, stream>>>(hold_cycles * calls);
    check(gpu::last_error(), "hold");
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f();
    const auto stop = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(stop - start).count() / calls);
    check(device_sync(), "sync");
  }
}

} // namespace bench
} // namespace vsa
