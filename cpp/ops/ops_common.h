// What the kernels of libspecedge_ops share: which instruction set they run on.
#pragma once

// ONNX Runtime's API comes from the loading process (RegisterCustomOps calls Ort::InitApi).
#ifndef ORT_API_MANUAL_INIT
#define ORT_API_MANUAL_INIT
#endif
#include <onnxruntime_cxx_api.h>

namespace specedge_ops {

// True when the AVX-512 (VNNI) paths run; SPECEDGE_OPS_ISA=portable forces the portable ones,
// which compute the same bits (tests/test_specedge_ops.py compares them).
bool UseAvx512();

// Adds ai.specedge.GroupQueryAttention (gqa_attention.cpp) to the domain.
void AddGroupQueryAttention(Ort::CustomOpDomain& domain);

}  // namespace specedge_ops
