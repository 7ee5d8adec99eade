// The arithmetic of ai.specedge.GroupQueryAttention per query row (gqa_attention.cpp holds the
// ONNX Runtime op around it and describes the order of every sum), without ONNX Runtime, so that
// its standalone test builds for any architecture.
#pragma once

#include <cstdint>
#include <vector>

#include "isa.h"

namespace specedge_ops {

constexpr int kAttnLanes = 16;  // the head size must be a multiple of it

struct AttnRow {   // one (batch, head, query row) to attend
  const float* q;  // [D], rotated
  const float* k;  // cache of its kv head [S, D]
  const float* v;
  const float* bias;  // [total] or nullptr
  float* out;         // [D]
  int64_t lo, hi;     // keys lo..hi inclusive
};

// out = softmax(q·kᵀ · scale + bias) · v over keys lo..hi for `count` rows that share k, v, bias,
// lo and hi (the heads of one kv head at one query position), so that a path may read each key
// once for all of them; each row's bits are those it has alone. `e` is scratch.
void Attend(Isa isa, const AttnRow* rows, int64_t count, int64_t d, float scale, std::vector<float>& e);
// x rotated in place, rotate-half layout over the first 2 * half dims.
void RotateHalf(float* x, const float* cos, const float* sin, int64_t half);

}  // namespace specedge_ops
