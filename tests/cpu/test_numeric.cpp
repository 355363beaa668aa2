#include "support/host.hpp"

#include <vsa/numeric.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

using namespace vsa;

namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Nearest representable value from a sorted table of the non-negative finite values, ties to the even
// (lower bit clear) encoding; the overflow threshold is the midpoint past the largest value.
uint16_t nearest_in_table(float x, const std::vector<std::pair<double, uint16_t>>& table, double overflow_at,
                          uint16_t inf_bits, uint16_t sign_bit) {
  const double a = std::fabs(static_cast<double>(x));
  const uint16_t sign = std::signbit(x) ? sign_bit : 0;
  if (a >= overflow_at) return static_cast<uint16_t>(sign | inf_bits);
  auto hi = std::lower_bound(table.begin(), table.end(), std::make_pair(a, uint16_t(0)));
  if (hi == table.begin()) return static_cast<uint16_t>(sign | hi->second);
  auto lo = hi - 1;
  if (hi == table.end()) return static_cast<uint16_t>(sign | lo->second);
  const double dl = a - lo->first, dh = hi->first - a;
  if (dl < dh) return static_cast<uint16_t>(sign | lo->second);
  if (dh < dl) return static_cast<uint16_t>(sign | hi->second);
  return static_cast<uint16_t>(sign | ((lo->second & 1) == 0 ? lo->second : hi->second));
}

std::vector<std::pair<double, uint16_t>> table(float (*decode)(uint16_t), uint16_t first_non_finite) {
  std::vector<std::pair<double, uint16_t>> t;
  for (uint32_t h = 0; h < first_non_finite; ++h) t.emplace_back(decode(static_cast<uint16_t>(h)), h);
  return t;
}

// Random floats spread over every exponent (including subnormals, infinities and NaNs).
float random_float(test::rng& g) { return from_bits(static_cast<uint32_t>(g.integer(0, 0xffffffffll))); }

} // namespace

TEST_CASE("fp16 and bf16 conversions of known values", "[cpu][numeric]") {
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(float_to_bf16(-2.0f) == 0xc000);
  CHECK(float_to_bf16(1.0f + 1.0f / 256) == 0x3f80);         // tie -> even (down)
  CHECK(float_to_bf16(1.0f + 3.0f / 256) == 0x3f82);         // tie -> even (up)
  CHECK(float_to_bf16(1.0f + 1.0f / 256 + 1e-6f) == 0x3f81); // above the tie
  CHECK(float_to_bf16(3.4028235e38f) == 0x7f80);             // rounds past the largest bf16
  CHECK(float_to_bf16(INFINITY) == 0x7f80);
  CHECK(float_to_bf16(-INFINITY) == 0xff80);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  CHECK(std::isnan(bf16_to_float(float_to_bf16(from_bits(0x7f800001u))))); // NaN with a low payload stays NaN
  CHECK(bf16_to_float(0x3f80) == 1.0f);
  CHECK(std::signbit(bf16_to_float(float_to_bf16(-0.0f))));

  CHECK(float_to_fp16(1.0f) == 0x3c00);
  CHECK(float_to_fp16(-2.5f) == 0xc100);
  CHECK(float_to_fp16(65504.0f) == 0x7bff);
  CHECK(float_to_fp16(65519.99f) == 0x7bff);
  CHECK(float_to_fp16(65520.0f) == 0x7c00); // tie with the next (absent) value -> inf
  CHECK(float_to_fp16(1e10f) == 0x7c00);
  CHECK(float_to_fp16(-INFINITY) == 0xfc00);
  CHECK(float_to_fp16(std::ldexp(1.0f, -14)) == 0x0400);                         // smallest normal
  CHECK(float_to_fp16(std::ldexp(1.0f, -24)) == 0x0001);                         // smallest subnormal
  CHECK(float_to_fp16(std::ldexp(1.0f, -25)) == 0x0000);                         // tie -> even zero
  CHECK(float_to_fp16(std::ldexp(1.5f, -25)) == 0x0001);                         // above the tie
  CHECK(float_to_fp16(std::ldexp(3.0f, -25)) == 0x0002);                         // 1.5 ulp tie -> even 2
  CHECK(float_to_fp16(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)) == 0x0400); // rounds up into the normals
  CHECK(float_to_fp16(-std::ldexp(1.0f, -30)) == 0x8000);
  CHECK(std::isnan(fp16_to_float(float_to_fp16(NAN))));
  CHECK(std::isnan(fp16_to_float(float_to_fp16(from_bits(0x7f800001u)))));
  CHECK(fp16_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(fp16_to_float(0x7bff) == 65504.0f);
  CHECK(std::isinf(fp16_to_float(0x7c00)));
}

TEST_CASE("16-bit conversions round-trip every encoding and round to nearest even", "[cpu][numeric]") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    const float fh = fp16_to_float(b), fb = bf16_to_float(b);
    if (std::isnan(fh))
      REQUIRE(std::isnan(fp16_to_float(float_to_fp16(fh))));
    else
      REQUIRE(float_to_fp16(fh) == b);
    if (std::isnan(fb))
      REQUIRE(std::isnan(bf16_to_float(float_to_bf16(fb))));
    else
      REQUIRE(float_to_bf16(fb) == b);
  }

  // Against the nearest value of a table of every finite encoding.
  const auto fp16_table = table(fp16_to_float, 0x7c00);
  const auto bf16_table = table(bf16_to_float, 0x7f80);
  const double fp16_overflow = 65520.0;
  const double bf16_overflow = (static_cast<double>(bf16_to_float(0x7f7f)) + std::ldexp(1.0, 128)) / 2;
  VSA_TEST_RNG(g, "numeric nearest");
  for (int trial = 0; trial < 200000; ++trial) {
    float x = random_float(g);
    if (trial % 2 == 0) x = static_cast<float>(g.normal(0.0, std::ldexp(1.0, static_cast<int>(g.integer(-30, 20)))));
    if (std::isnan(x)) continue;
    INFO("x = " << x << " bits " << std::hex << to_bits(x));
    REQUIRE(float_to_fp16(x) == nearest_in_table(x, fp16_table, fp16_overflow, 0x7c00, 0x8000));
    REQUIRE(float_to_bf16(x) == nearest_in_table(x, bf16_table, bf16_overflow, 0x7f80, 0x8000));
  }
#if defined(__FLT16_MAX__)
  // The compiler's own conversion, where it has one.
  for (int trial = 0; trial < 200000; ++trial) {
    const float x = random_float(g);
    if (std::isnan(x)) continue;
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t bits;
    std::memcpy(&bits, &h, sizeof(bits));
    REQUIRE(float_to_fp16(x) == bits);
  }
#endif
}

TEST_CASE("load and store every dtype", "[cpu][numeric]") {
  VSA_TEST_RNG(g, "numeric load store");
  for (dtype t : {dtype::bf16, dtype::fp16, dtype::f32, dtype::f64}) {
    std::vector<unsigned char> buffer(8 * dtype_size(t));
    for (int e = 0; e < 8; ++e) {
      const double x = g.normal(0.0, 10.0);
      store(buffer.data(), e, x, t);
      const double y = load(buffer.data(), e, t);
      CHECK(y == round_to(x, t));
      const double tolerance = t == dtype::bf16   ? 1.0 / 256
                               : t == dtype::fp16 ? 1.0 / 2048
                               : t == dtype::f32  ? 1e-7
                                                  : 0.0;
      CHECK(std::fabs(y - x) <= tolerance * std::fabs(x));
    }
    // Neighbours are untouched: element e occupies exactly dtype_size bytes.
    std::vector<unsigned char> before = buffer;
    store(buffer.data(), 3, 1.0, t);
    for (std::size_t byte = 0; byte < buffer.size(); ++byte)
      if (byte < 3 * dtype_size(t) || byte >= 4 * dtype_size(t)) CHECK(buffer[byte] == before[byte]);
    CHECK(load(buffer.data(), 3, t) == 1.0);
  }
  // bf16 and fp16 round through float: a double just above a float tie still rounds as the float does.
  CHECK(round_to(1.0 + 1.0 / 256 + 1e-12, dtype::bf16) == 1.0);
  CHECK(round_to(1e300, dtype::f32) == INFINITY);
  CHECK(round_to(1e300, dtype::f64) == 1e300);
}

TEST_CASE("the rounding residual brings a value back to within 2^-9 of its last place", "[cpu][numeric]") {
  VSA_TEST_RNG(g, "numeric residual");
  for (dtype t : {dtype::bf16, dtype::fp16}) {
    INFO(dtype_name(t));
    const int m = t == dtype::fp16 ? 10 : 7, lowest = t == dtype::fp16 ? -14 : -100;
    int64_t checked = 0;
    for (int trial = 0; trial < 400000; ++trial) {
      // Magnitudes across the type's whole range, its subnormals included, both signs.
      const double magnitude = std::ldexp(1.0, static_cast<int>(g.integer(t == dtype::fp16 ? -26 : -99, 15)));
      const float x = static_cast<float>(g.uniform(-2.0, 2.0) * magnitude);
      const float r = static_cast<float>(round_to(x, t));
      if (std::isinf(r)) continue;
      const float back = residual_decode(residual_encode(x, r, t), r, t);
      // r's last place: 2^(e - m) for r's exponent e, held where residual_scale holds it.
      int e = lowest + 1;
      if (r != 0.f) std::frexp(r, &e);
      const double ulp = std::ldexp(1.0, std::max(e - 1, lowest) - m);
      // Half a step (2^-8 of a last place), or a whole one where |x - r| is within half a step of the tie
      // and the code is clamped to 127.
      const double step = ulp / 256.0, lost = std::fabs(double(x) - double(r));
      REQUIRE(std::fabs(double(back) - double(x)) <= (lost > 127.5 * step ? step : step / 2));
      // Not merely the rounded value: the residual carries what rounding lost whenever it lost a step's worth.
      if (lost > step) REQUIRE(back != r);
      ++checked;
    }
    CHECK(checked > 300000);
    // A tie (exactly half a last place) clamps to 127 steps, half a step further off than the rest.
    const float tie = 1.0f + std::ldexp(1.0f, -m - 1), tie_r = static_cast<float>(round_to(tie, t));
    CHECK(residual_encode(tie, tie_r, t) == 127);
    CHECK(std::fabs(residual_decode(127, tie_r, t) - tie) <= std::ldexp(1.0f, -m - 8));
    // Exact values, NaN and infinity: nothing added that changes them in kind.
    CHECK(residual_encode(1.5f, 1.5f, t) == 0);
    CHECK(residual_encode(0.f, 0.f, t) == 0);
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    CHECK(std::isnan(residual_decode(residual_encode(nan, nan, t), nan, t)));
    CHECK(residual_decode(residual_encode(inf, inf, t), inf, t) == inf);
    CHECK(residual_decode(residual_encode(-inf, -inf, t), -inf, t) == -inf);
    CHECK(residual_decode(residual_encode(7e4f, inf, t), inf, t) == inf);
  }
}
