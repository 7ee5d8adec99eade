// This architecture's vector intrinsics, and the macro naming which paths the kernels compile.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECEDGE_OPS_X86 1

// The sum of 16 lanes in the kernels' fixed order: lanes i + (i + 8), then + 4, + 2, + 1 (the
// reduce intrinsics leave the order open). AVX2 holds the 16 lanes as two registers, 0..7 and 8..15.
__attribute__((target("avx"))) inline float SumLanes8(__m256 a8) {  // the + 4, + 2, + 1 steps
  const __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
  const __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
  return _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1)));
}

__attribute__((target("avx512f,avx512dq"))) inline float SumLanesAvx512(__m512 v) {
  return SumLanes8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

__attribute__((target("avx2"))) inline float SumLanesAvx2(__m256 lo, __m256 hi) {
  return SumLanes8(_mm256_add_ps(lo, hi));
}
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#define SPECEDGE_OPS_NEON 1
// NEON with the dot-product extension, compiled for it whatever the build's -march, and taken
// only where the CPU reports it (isa.cpp)
#if defined(__clang__)
#define SPECEDGE_DOTPROD __attribute__((target("dotprod")))
#else
#define SPECEDGE_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
#endif
