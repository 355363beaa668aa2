// The few GPU runtime calls the library uses, under one set of names for both platforms (which runtime: platform.hpp;
// the device intrinsics: arch/warp.hpp). On AMD (hipcc) they are HIP's own. On NVIDIA they map onto CUDA directly,
// because the HIP-for-NVIDIA headers that distributions ship lag behind current CUDA; where a real HIP for NVIDIA is
// installed and selected (__HIP_PLATFORM_NVIDIA__), its headers are used instead.
#pragma once

#include "../types.hpp"
#include "arch/warp.hpp"
#include "platform.hpp"

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
// The architecture (major·10 + minor) a kernel's device pass was compiled for; 0 where not meaningful (AMD).
template <class Kernel> error_t kernel_code_version(Kernel, int* v) {
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
// The architecture (major·10 + minor) a kernel's device pass was compiled for: its PTX version, the
// __CUDA_ARCH__ that pass saw. Not the binary version: a build for sm_80 alone runs on Hopper as its compute_80
// PTX compiled by the driver, binary version 90, but from device code that took every sm_80 branch.
template <class Kernel> error_t kernel_code_version(Kernel k, int* v) {
  cudaFuncAttributes a{};
  const cudaError_t e = cudaFuncGetAttributes(&a, k);
  *v = e == cudaSuccess ? a.ptxVersion : 0;
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
    int version = 0; // PTX of sm_90 or later runs only on such a device
    const status st = runtime_status(kernel_code_version(kernel, &version), what);
    if (!st) return st;
    overlap = version >= 90;
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
// (smem_plan: the device side asks hopper_code, the host the architecture its device pass was compiled for).
template <class Kernel> status runs_as_hopper(Kernel k, bool& hopper) {
  int version = 0;
  const status st = runtime_status(kernel_code_version(k, &version), "querying a kernel's code version");
  hopper = version >= 90;
  return st;
}

} // namespace gpu
} // namespace vsa
