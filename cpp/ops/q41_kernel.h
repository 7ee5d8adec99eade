// The arithmetic of ai.specedge.MatMulQ41 (specedge_ops.cpp holds the ONNX Runtime op around it),
// without ONNX Runtime, so that its standalone test builds for any architecture.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "isa.h"

namespace specedge_ops {

constexpr int64_t kQ41K = 32;       // values per block
constexpr int64_t kQ41Rows = 16;    // output rows per group
constexpr int64_t kQ41Block = 320;  // packed bytes per group and block

struct Q41Activations {
  std::vector<int8_t> q;      // [rows, K]
  std::vector<float> scale;   // [rows, K/32]
  std::vector<float> sum;     // [rows, K/32]: fp32 block sums of A
  std::vector<int32_t> qsum;  // [rows, K/32]: block sums of the int8 codes
};

struct Q41Job {
  const uint8_t* w;  // [N/16, K/32, 320]
  const Q41Activations* act;
  float* out;  // [rows, N]
  int64_t rows, n, nb;
  Isa isa;
};

// A [rows, K] quantized per block of 32 into `act` (resized here).
void Q41Quantize(Isa isa, const float* a, int64_t rows, int64_t k, Q41Activations& act);
// The tasks a job splits into (each writes its own output columns, for every row) and one task:
// the signature of OrtKernelContext's ParallelFor.
size_t Q41Tasks(int64_t n);
void Q41Task(void* job, size_t task);

}  // namespace specedge_ops
