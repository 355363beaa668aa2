// Device-side intrinsics under one set of names for both platforms: a trap, the warp's shuffles, barrier and
// reductions, the dependent-launch controls and the special-function unit's exp2.
#pragma once

#include "../platform.hpp"
#include "wave_reduce.hpp"

namespace vsa {
namespace gpu {

// Stops the kernel with an error the next runtime call reports: for device code that must never run.
__device__ __forceinline__ void device_trap() {
#if VSA_PLATFORM_NVIDIA
  __trap();
#else
  __builtin_trap();
#endif
}

template <class T> __device__ __forceinline__ T shfl_xor(T v, int mask) {
#if VSA_PLATFORM_AMD
  return __shfl_xor(v, mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}
template <class T> __device__ __forceinline__ T shfl(T v, int lane) {
#if VSA_PLATFORM_AMD
  return __shfl(v, lane);
#else
  return __shfl_sync(0xffffffffu, v, lane);
#endif
}
template <class T> __device__ __forceinline__ T shfl_up(T v, int delta) {
#if VSA_PLATFORM_AMD
  return __shfl_up(v, delta);
#else
  return __shfl_up_sync(0xffffffffu, v, delta);
#endif
}

// The warp's lanes meet (__syncwarp): their shared-memory accesses before it are ordered before those after it.
// A wavefront's lanes run in lockstep on AMD, where only the compiler is held to the order. A name of both
// platforms, so that code only Hopper runs (if constexpr) still compiles everywhere.
__device__ __forceinline__ void warp_sync() {
#if VSA_PLATFORM_AMD
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

// Whether any lane of the warp has `pred`, in every lane.
__device__ __forceinline__ bool warp_any(bool pred) {
#if VSA_PLATFORM_AMD
  return __any(pred);
#else
  return __any_sync(0xffffffffu, pred);
#endif
}

// f folded over the whole warp, in every lane: a butterfly of shuffles in wave_reduce's order.
template <class T, class F> __device__ __forceinline__ T warp_fold(T v, F f) {
#pragma unroll
  for (int s = 0; s < wave_reduce::warp_steps(warp_size); ++s)
    v = f(v, shfl_xor(v, wave_reduce::warp_mask(warp_size, s)));
  return v;
}

// Sum, minimum and maximum of an unsigned value over the whole warp, in every lane. On NVIDIA sm_80 and later
// each is one instruction (redux.sync); elsewhere the butterfly.
#if VSA_PLATFORM_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ uint32_t warp_sum(uint32_t v) { return __reduce_add_sync(0xffffffffu, v); }
__device__ __forceinline__ uint32_t warp_min(uint32_t v) { return __reduce_min_sync(0xffffffffu, v); }
__device__ __forceinline__ uint32_t warp_max(uint32_t v) { return __reduce_max_sync(0xffffffffu, v); }
#else
__device__ __forceinline__ uint32_t warp_sum(uint32_t v) {
  return warp_fold(v, [](uint32_t a, uint32_t b) { return a + b; });
}
__device__ __forceinline__ uint32_t warp_min(uint32_t v) {
  return warp_fold(v, [](uint32_t a, uint32_t b) { return min(a, b); });
}
__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  return warp_fold(v, [](uint32_t a, uint32_t b) { return max(a, b); });
}
#endif

// Inclusive prefix sum over the lanes of the warp, in lane order (`lane` is the caller's lane index).
__device__ __forceinline__ uint32_t warp_inclusive_sum(uint32_t v, int lane) {
#pragma unroll
  for (int d = 1; d < warp_size; d *= 2) {
    const uint32_t u = shfl_up(v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// The device side of launch's overlap (programmatic dependent launch, Hopper). grid_dependency_wait returns once
// the kernel before this one in the stream has finished and its writes are visible (at once where the kernel was
// launched in stream order, and on every other target). grid_dependents_launch lets the next kernel, if launched
// with overlap, start its blocks from now on; it waits for this kernel all the same.
__device__ __forceinline__ void grid_dependency_wait() {
#if VSA_PLATFORM_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if VSA_PLATFORM_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// 2^x on the special-function unit; exp2(-inf) = 0, which the masking relies on.
__device__ __forceinline__ float fast_exp2(float x) {
#if VSA_PLATFORM_AMD
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

} // namespace gpu
} // namespace vsa
