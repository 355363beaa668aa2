// The one Catch2 include of the tests: Catch2 v3 (split headers, main from Catch2::Catch2WithMain) or
// Catch2 v2 (single header, main from catch_main.cpp). The build may force one with VSA_CATCH_MAJOR=2|3.
#pragma once

#if !defined(VSA_CATCH_MAJOR)
#if __has_include(<catch2/catch_test_macros.hpp>)
#define VSA_CATCH_MAJOR 3
#else
#define VSA_CATCH_MAJOR 2
#endif
#endif

#if VSA_CATCH_MAJOR >= 3
#include <catch2/catch_approx.hpp>
#include <catch2/catch_get_random_seed.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_all.hpp>
// v2 declares Approx at global scope; v3 only in namespace Catch.
using Catch::Approx;
#else
#include <catch2/catch.hpp>
#endif

namespace vsa {
namespace test {

// The seed Catch runs with (--rng-seed), so that a failing test can be replayed.
inline unsigned catch_seed() {
#if VSA_CATCH_MAJOR >= 3
  return Catch::getSeed();
#else
  return Catch::rngSeed();
#endif
}

} // namespace test
} // namespace vsa
