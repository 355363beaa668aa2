// 16-bit element types as the device sees them: raw bits in memory, fp32 in arithmetic. The tag types pick
// the matrix instruction variant and the rounding of fp32 results back to storage.
#pragma once

#include "warp.hpp"

#if VSA_PLATFORM_NVIDIA
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace vsa {
namespace gpu {

struct bf16_type {
  static constexpr bool is_bf16 = true;
  static constexpr dtype type = dtype::bf16;
  __device__ __forceinline__ static float to_float(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }
  __device__ __forceinline__ static uint16_t from_float(float f) {
#if VSA_PLATFORM_NVIDIA
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
    // Round to nearest even; NaN stays NaN (quiet bit forced).
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
#endif
  }
  // Two fp32 values packed into one register, lo in the low half.
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
#if VSA_PLATFORM_NVIDIA
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return uint32_t(from_float(lo)) | (uint32_t(from_float(hi)) << 16);
#endif
  }
};

struct fp16_type {
  static constexpr bool is_bf16 = false;
  static constexpr dtype type = dtype::fp16;
#if VSA_PLATFORM_NVIDIA
  __device__ __forceinline__ static float to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
  __device__ __forceinline__ static uint16_t from_float(float f) { return __half_as_ushort(__float2half_rn(f)); }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
#else
  __device__ __forceinline__ static float to_float(uint16_t b) { return float(__builtin_bit_cast(_Float16, b)); }
  __device__ __forceinline__ static uint16_t from_float(float f) {
    return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    return uint32_t(from_float(lo)) | (uint32_t(from_float(hi)) << 16);
  }
#endif
};

// x0 and x1 as E::pack rounds them, back in fp32 (the same packing instruction, so the same rounding).
template <class E> __device__ __forceinline__ void rounded_pair(float x0, float x1, float& lo, float& hi) {
  const uint32_t w = E::pack(x0, x1);
  lo = E::to_float(static_cast<uint16_t>(w & 0xffffu));
  hi = E::to_float(static_cast<uint16_t>(w >> 16));
}

} // namespace gpu
} // namespace vsa
