// This architecture's vector intrinsics, and the macro naming which paths the kernels compile.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECEDGE_OPS_X86 1
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
