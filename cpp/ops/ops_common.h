// What the kernels of libspecedge_ops share: which instruction set they run on.
#pragma once

// ONNX Runtime's API comes from the loading process (RegisterCustomOps calls Ort::InitApi).
#ifndef ORT_API_MANUAL_INIT
#define ORT_API_MANUAL_INIT
#endif
#include <onnxruntime_cxx_api.h>

namespace specedge_ops {

// The code path the kernels take: the widest this CPU has (AVX-512 with VNNI, else AVX2 with FMA
// and F16C, else portable C++), or a narrower one named by SPECEDGE_OPS_ISA (avx2 | portable).
// Every path computes the same bits (tests/test_specedge_ops.py and test_specedge_attention.py).
enum class Isa { kPortable, kAvx2, kAvx512 };
Isa ActiveIsa();
inline bool UseAvx512() { return ActiveIsa() == Isa::kAvx512; }

// Adds ai.specedge.GroupQueryAttention (gqa_attention.cpp) to the domain.
void AddGroupQueryAttention(Ort::CustomOpDomain& domain);

}  // namespace specedge_ops
