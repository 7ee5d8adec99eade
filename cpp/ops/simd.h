// This architecture's vector intrinsics, and the macro naming which paths the kernels compile.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECEDGE_OPS_X86 1
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#define SPECEDGE_OPS_NEON 1
#endif
