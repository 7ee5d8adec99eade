// Which instruction set specedge's kernels run on. No ONNX Runtime here: the kernel cores
// (q41_kernel, gqa_kernel) and their standalone test (ops/tests/ops_kernels_test.cpp) use it too.
#pragma once

namespace specedge_ops {

// The code path the kernels take: the widest this CPU has (x86-64: AVX-512 with VNNI, else AVX2
// with FMA and F16C; aarch64: NEON with the dot-product extension), else portable C++; or a
// narrower one named by SPECEDGE_OPS_ISA (avx2 | portable). Every path computes the same bits
// (ops/tests/ops_kernels_test.cpp, tests/test_specedge_ops.py, tests/test_ops_aarch64.py).
enum class Isa { kPortable, kAvx2, kAvx512, kNeonDot };
Isa ActiveIsa();
// Whether this CPU can run `isa` (kPortable always can).
bool CpuHas(Isa isa);
// "avx512vnni", "avx2", "neondot" or "portable": what specedge_ops_isa() reports.
const char* IsaName(Isa isa);

}  // namespace specedge_ops
