// The few GPU runtime calls and device intrinsics the library uses, under one set of names for both
// platforms. On AMD (hipcc) they are HIP's own. On NVIDIA they map onto CUDA directly, because the
// HIP-for-NVIDIA headers that distributions ship lag behind current CUDA; where a real HIP for NVIDIA is
// installed and selected (__HIP_PLATFORM_NVIDIA__), its headers are used instead.
#pragma once

#include "../types.hpp"
#include "arch/wave_reduce.hpp"

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__) || (defined(__HIPCC__) && !defined(__CUDACC__)) ||  \
    defined(__HIP_PLATFORM_NVIDIA__)
#include <hip/hip_runtime.h>
#define VSA_RUNTIME_HIP 1
#elif defined(__CUDACC__)
#include <cuda_runtime.h>
#define VSA_RUNTIME_CUDA 1
#else
#error "vsa/gpu headers need a GPU compiler: hipcc (AMD) or nvcc (NVIDIA)"
#endif

// Which matrix-core backend the device pass compiles: AMD MFMA (64-wide wavefronts) or NVIDIA mma.
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__) || (defined(__HIPCC__) && !defined(__CUDACC__))
#define VSA_PLATFORM_AMD 1
#else
#define VSA_PLATFORM_NVIDIA 1
#endif

namespace vsa {
namespace gpu {

#if VSA_RUNTIME_HIP
using stream_t = hipStream_t;
using error_t = hipError_t;
inline constexpr error_t success = hipSuccess;
inline error_t last_error() { return hipGetLastError(); }
inline error_t peek_error() { return hipPeekAtLastError(); }
inline const char* error_string(error_t e) { return hipGetErrorString(e); }
inline error_t memset_async(void* p, int v, std::size_t n, stream_t s) { return hipMemsetAsync(p, v, n, s); }
inline error_t current_device(int* d) { return hipGetDevice(d); }
inline error_t multiprocessor_count(int* n, int device) {
  return hipDeviceGetAttribute(n, hipDeviceAttributeMultiprocessorCount, device);
}
template <class Kernel> error_t allow_dynamic_shared(Kernel k, int bytes) {
  return hipFuncSetAttribute(reinterpret_cast<const void*>(k), hipFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
// Compute capability (major·10 + minor) of the machine code a kernel runs as; 0 where not meaningful (AMD).
template <class Kernel> error_t kernel_binary_version(Kernel, int* v) {
  *v = 0;
  return hipSuccess;
}
template <class Kernel> error_t kernel_static_smem(Kernel, int* bytes) {
  *bytes = 0;
  return hipSuccess;
}
#else
using stream_t = cudaStream_t;
using error_t = cudaError_t;
inline constexpr error_t success = cudaSuccess;
inline error_t last_error() { return cudaGetLastError(); }
inline error_t peek_error() { return cudaPeekAtLastError(); }
inline const char* error_string(error_t e) { return cudaGetErrorString(e); }
inline error_t memset_async(void* p, int v, std::size_t n, stream_t s) { return cudaMemsetAsync(p, v, n, s); }
inline error_t current_device(int* d) { return cudaGetDevice(d); }
inline error_t multiprocessor_count(int* n, int device) {
  return cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, device);
}
template <class Kernel> error_t allow_dynamic_shared(Kernel k, int bytes) {
  return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
template <class Kernel> error_t kernel_binary_version(Kernel k, int* v) {
  cudaFuncAttributes a{};
  const cudaError_t e = cudaFuncGetAttributes(&a, k);
  *v = e == cudaSuccess ? a.binaryVersion : 0;
  return e;
}
// Bytes of the kernel's static shared memory, as compiled for the device it runs on.
template <class Kernel> error_t kernel_static_smem(Kernel k, int* bytes) {
  cudaFuncAttributes a{};
  const cudaError_t e = cudaFuncGetAttributes(&a, k);
  *bytes = e == cudaSuccess ? static_cast<int>(a.sharedSizeBytes) : 0;
  return e;
}
#endif

// Turns the runtime's state after a launch into a status: a launch that failed is reported with the
// kernel's name, never ignored.
inline status launch_status(const char* what) {
  const error_t e = last_error();
  if (e != success) return status::error(errc::runtime_error, "%s: launch failed: %s", what, error_string(e));
  return status::ok();
}
inline status runtime_status(error_t e, const char* what) {
  if (e != success) return status::error(errc::runtime_error, "%s: %s", what, error_string(e));
  return status::ok();
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), reporting a failure with `what`. With `overlap`, where the
// kernel's code was compiled for Hopper or later (its PTX, so that grid_dependency_wait is in it), the launch is a
// programmatic dependent one: the kernel may start while the kernel before it in the stream is still running,
// so that its blocks are resident and past their set-up when that kernel ends instead of being launched only
// then. Such a kernel calls grid_dependency_wait in every block before it reads anything an earlier kernel may
// have written and before it writes anything. Elsewhere the launch is in plain stream order.
template <class... Params, class... Args> status launch(const char* what, void (*kernel)(Params...), dim3 grid,
                                                        dim3 block, int smem, stream_t stream, bool overlap,
                                                        Args&&... args) {
#if VSA_RUNTIME_CUDA
  if (overlap) {
    cudaFuncAttributes a{};
    const status st = runtime_status(cudaFuncGetAttributes(&a, kernel), what);
    if (!st) return st;
    overlap = a.ptxVersion >= 90 && a.binaryVersion >= 90;
  }
  cudaLaunchAttribute attribute[1] = {};
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<std::size_t>(smem);
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = overlap ? 1 : 0;
  const error_t e = cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
  const status st = launch_status(what); // also clears the runtime's last error
  if (e != success && st) return status::error(errc::runtime_error, "%s: launch failed: %s", what, error_string(e));
  return st;
#else
  (void)overlap;
  kernel<<<grid, block, smem, stream>>>(static_cast<Args&&>(args)...);
  return launch_status(what);
#endif
}

// Whether a kernel runs as Hopper code (sm_90 and later), which decides its pipeline and so its shared memory
// (smem_plan: the device side asks hopper_code, the host the binary version of the code the kernel runs as).
template <class Kernel> status runs_as_hopper(Kernel k, bool& hopper) {
  int version = 0;
  const status st = runtime_status(kernel_binary_version(k, &version), "querying a kernel's binary version");
  hopper = version >= 90;
  return st;
}

// A kernel parameter that device code may take the address of (the tensor maps of hopper_tma.hpp are read
// by the copy engine from parameter space). Only NVIDIA has the notion; elsewhere parameters are plain.
#if VSA_PLATFORM_NVIDIA
#define VSA_GRID_CONSTANT __grid_constant__
#else
#define VSA_GRID_CONSTANT
#endif

// ---- device-side intrinsics ----------------------------------------------------------------------------

// Stops the kernel with an error the next runtime call reports: for device code that must never run.
__device__ __forceinline__ void device_trap() {
#if VSA_PLATFORM_NVIDIA
  __trap();
#else
  __builtin_trap();
#endif
}

#if VSA_PLATFORM_AMD
inline constexpr int warp_size = 64; // CDNA wavefronts
#else
inline constexpr int warp_size = 32;
#endif

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
