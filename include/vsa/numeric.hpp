// Scalar conversions between float and the 16-bit storage types (bf16, fp16) on raw bits, and element
// access to a buffer of any dtype. Conversions round to nearest even and keep NaN and infinity, so
// that the host side agrees bit for bit with the hardware conversions the kernels use.
#pragma once

#include "types.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace vsa {

// log2(e): the kernels' softmax runs in base 2, with the scale folded into the exponent as scale · log2(e).
inline constexpr float log2_e = 1.4426950408889634f;
// ln(2): the kernels' base-2 log-sum-exp back to the natural log the API returns.
inline constexpr float ln_2 = 0.6931471805599453f;

namespace detail {
// HIP's device code has no memcpy; its compiler (clang) has the bit cast built in.
VSA_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__HIP_DEVICE_COMPILE__)
  return __builtin_bit_cast(uint32_t, f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
VSA_HOST_DEVICE inline float bits_float(uint32_t u) {
#if defined(__HIP_DEVICE_COMPILE__)
  return __builtin_bit_cast(float, u);
#else
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
#endif
}
} // namespace detail

VSA_HOST_DEVICE inline float bf16_to_float(uint16_t h) { return detail::bits_float(static_cast<uint32_t>(h) << 16); }

VSA_HOST_DEVICE inline uint16_t float_to_bf16(float f) {
  const uint32_t u = detail::float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u); // quiet NaN, sign kept
  // Adding 0x7fff plus the lowest kept bit rounds to nearest even; a carry into the exponent is the
  // correct result, up to infinity.
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

VSA_HOST_DEVICE inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return detail::bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Zero or subnormal: mantissa · 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return detail::bits_float(sign | detail::float_bits(magnitude));
  }
  return detail::bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

VSA_HOST_DEVICE inline uint16_t float_to_fp16(float f) {
  const uint32_t u = detail::float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); // quiet NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u); // >= 65520 (or inf) rounds to inf
  if (a < 0x38800000u) {
    // Below 2^-14 the result is subnormal: round (|f| · 2^24) to an integer, half to even.
    const uint32_t e = a >> 23;
    if (e < 102u) return static_cast<uint16_t>(sign); // below 2^-25: rounds to zero
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e; // 14..24
    uint32_t r = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = (a - 0x38000000u) >> 13; // rebias the exponent from 127 to 15
  const uint32_t rest = a & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

// What rounding to 16 bits lost, kept in one signed byte: the op's forward stores o = o_s + g ⊙ o_c rounded,
// and its backward needs Σ dO ⊙ o_s far more precisely than the rounded o gives it back (the accuracy note in
// README.md). The byte holds x − round(x) in steps of 2^-8 of round(x)'s last place, so x comes back to
// within 2^-9 of a last place: 256 times closer than the 16-bit value alone, at half its size.
//
// The step is a power of two taken from round(x)'s exponent, so both the encoding's scaling and the decoding
// are exact. Below the smallest normal exponent (fp16: 2^-14, where its subnormals keep one last place) the
// exponent is held there; bf16 holds it at 2^-100, below which no output's error matters, so that the step
// stays a normal float. |x − round(x)| is at most half a last place, 128 steps, clamped to 127: within half a
// step of a tie x comes back to within a whole step. A NaN or infinite x gives a code that decodes to round(x)
// unchanged in kind.
namespace detail {
// The residual step of `rounded` in type t (inverse: its reciprocal), 2^(e − mantissa bits − 8).
VSA_HOST_DEVICE inline float residual_scale(float rounded, dtype t, bool inverse) {
  const int mantissa = t == dtype::fp16 ? 10 : 7, lowest = t == dtype::fp16 ? -14 : -100;
  const int e = static_cast<int>((float_bits(rounded) >> 23) & 0xffu) - 127; // -127 for zero and subnormals
  const int step = (e < lowest ? lowest : e) - mantissa - 8;
  return bits_float(static_cast<uint32_t>((inverse ? -step : step) + 127) << 23);
}
} // namespace detail

// t: bf16 or fp16, the type `rounded` was rounded to.
VSA_HOST_DEVICE inline int8_t residual_encode(float exact, float rounded, dtype t) {
  const float steps = (exact - rounded) * detail::residual_scale(rounded, t, true);
  // fmaxf takes the number when the other operand is NaN, so NaN lands on a bound and rintf sees a number.
  const float code = fminf(fmaxf(steps, -127.0f), 127.0f);
  return static_cast<int8_t>(rintf(code));
}
VSA_HOST_DEVICE inline float residual_decode(int8_t code, float rounded, dtype t) {
  return rounded + static_cast<float>(code) * detail::residual_scale(rounded, t, false);
}

// Element `index` of a buffer of type t, widened to double.
inline double load(const void* base, int64_t index, dtype t) {
  const unsigned char* p = static_cast<const unsigned char*>(base) + index * static_cast<int64_t>(dtype_size(t));
  switch (t) {
  case dtype::bf16:
  case dtype::fp16: {
    uint16_t h;
    std::memcpy(&h, p, sizeof(h));
    return t == dtype::bf16 ? bf16_to_float(h) : fp16_to_float(h);
  }
  case dtype::f32: {
    float f;
    std::memcpy(&f, p, sizeof(f));
    return f;
  }
  case dtype::f64: {
    double d;
    std::memcpy(&d, p, sizeof(d));
    return d;
  }
  }
  return 0.0;
}

// Stores `value` rounded to type t (bf16 and fp16 round through float, as the kernels do).
inline void store(void* base, int64_t index, double value, dtype t) {
  unsigned char* p = static_cast<unsigned char*>(base) + index * static_cast<int64_t>(dtype_size(t));
  switch (t) {
  case dtype::bf16:
  case dtype::fp16: {
    const float f = static_cast<float>(value);
    const uint16_t h = t == dtype::bf16 ? float_to_bf16(f) : float_to_fp16(f);
    std::memcpy(p, &h, sizeof(h));
    return;
  }
  case dtype::f32: {
    const float f = static_cast<float>(value);
    std::memcpy(p, &f, sizeof(f));
    return;
  }
  case dtype::f64:
    std::memcpy(p, &value, sizeof(value));
    return;
  }
}

// `value` as it reads back after store(): the rounding a tensor of type t applies.
inline double round_to(double value, dtype t) {
  unsigned char buffer[8];
  store(buffer, 0, value, t);
  return load(buffer, 0, t);
}

} // namespace vsa
