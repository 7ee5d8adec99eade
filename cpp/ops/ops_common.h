// What the ONNX Runtime ops of libspecedge_ops share: its API and the instruction set they run on.
#pragma once

// ONNX Runtime's API comes from the loading process (RegisterCustomOps calls Ort::InitApi).
#ifndef ORT_API_MANUAL_INIT
#define ORT_API_MANUAL_INIT
#endif
#include <onnxruntime_cxx_api.h>

#include "isa.h"

namespace specedge_ops {

// Adds ai.specedge.GroupQueryAttention (gqa_attention.cpp) to the domain.
void AddGroupQueryAttention(Ort::CustomOpDomain& domain);

}  // namespace specedge_ops
