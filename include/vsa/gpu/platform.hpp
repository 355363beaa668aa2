// What the library is compiled for, in one place: the GPU runtime (HIP or CUDA), the platform the device code is
// for (AMD or NVIDIA), and what the device pass may use (Hopper's features, the warp width). The kernels choose by
// these predicates, mostly through the types built on them (arch/matrix.hpp's attention_mma, the smem plans), not
// by compiler macros of their own.
#pragma once

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

// The device pass is sm_90a's: warpgroup matrix instructions (wgmma), setmaxnreg and the copy engine's tensor copies,
// which only the architecture-specific target has (a build for sm_90 without "a" has none of them).
#if VSA_PLATFORM_NVIDIA && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define VSA_WGMMA 1
#endif

// A kernel parameter that device code may take the address of (the tensor maps of hopper_tma.hpp are read
// by the copy engine from parameter space). Only NVIDIA has the notion; elsewhere parameters are plain.
#if VSA_PLATFORM_NVIDIA
#define VSA_GRID_CONSTANT __grid_constant__
#else
#define VSA_GRID_CONSTANT
#endif

namespace vsa {
namespace gpu {

#if VSA_PLATFORM_AMD
inline constexpr int warp_size = 64; // CDNA wavefronts
#else
inline constexpr int warp_size = 32;
#endif

// Whether the device code being compiled is Hopper's or later (sm_90+): the forward then runs its one-stage
// pipeline. The host learns the same of a kernel from the architecture its device pass was compiled for
// (runs_as_hopper).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
inline constexpr bool hopper_code = true;
#else
inline constexpr bool hopper_code = false;
#endif

// Whether the layer reads the transposed operand of a φᵀ·V product straight out of shared memory (tn, the
// wgmma backend). Otherwise each warp gathers its 16-row band of φᵀ element by element into a score tile.
#if VSA_WGMMA
constexpr bool layer_tn = true;
#else
constexpr bool layer_tn = false;
#endif

} // namespace gpu
} // namespace vsa
