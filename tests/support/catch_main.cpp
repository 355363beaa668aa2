// main() of the test executables for Catch2 v2; with Catch2 v3 the build links Catch2::Catch2WithMain instead.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
