// The arithmetic of ai.specedge.MatMulQ80 (specedge_ops.cpp holds the ONNX Runtime op around it),
// without ONNX Runtime, so that its standalone test builds for any architecture.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "q41_kernel.h"

namespace specedge_ops {

constexpr int64_t kQ80K = 32;       // values per block
constexpr int64_t kQ80Rows = 16;    // output rows per group
constexpr int64_t kQ80Block = 576;  // packed bytes per group and block: 512 codes, 16 fp32 scales

// MatMulNBits' 8-bit weights (B [N, K/32, 32] codes u, w = (u - 128)·scale; scales [N, K/32]),
// packed once per session as [N/16, K/32, 576]: byte 64i + 4r + c holds u[16g + r, 32b + 4i + c]
// (i 0..7, r 0..15, c 0..3), then the 16 rows' scales. N must be a multiple of 16.
std::vector<uint8_t> Q80Pack(const uint8_t* b, const float* scales, int64_t n, int64_t nb);

struct Q80Job {
  const uint8_t* w;  // packed, [N/16, K/32, 576]
  const Q41Activations* act;
  float* out;  // [rows, N]
  int64_t rows, n, nb;
  Isa isa;
};

// A quantized as for MatMulQ41 (Q41Quantize), then these tasks (each writes its own output
// columns, for every row): OrtKernelContext's ParallelFor signature.
size_t Q80Tasks(int64_t n);
void Q80Task(void* job, size_t task);

}  // namespace specedge_ops
