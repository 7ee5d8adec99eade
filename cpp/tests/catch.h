// Catch2 v2 (Debian 12) or v3 (Debian 13, JetPack images with newer distributions).
#pragma once
#ifdef SPECEDGE_CATCH3
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
using Catch::Approx;
#else
#include <catch2/catch.hpp>
#endif
