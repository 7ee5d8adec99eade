// libspecedge_ops: specedge's own ONNX Runtime CPU kernels, loaded as a custom-op library
// (SessionOptions::RegisterCustomOpsLibrary) by the Python and the C++ runtime.
//
// ai.specedge.MatMulQ41(A [..., K] float, W uint8 [N/16, K/32, 320]) -> Y [..., N]
//
// A times a GGUF Q4_1 weight, w[n, 32b + j] = d[n, b]·q[n, 32b + j] + m[n, b] (q in 0..15; d, m fp16). ONNX Runtime's MatMulNBits cannot hold m (a uint8
// zero point cannot, a float one runs a 12x slower path), so the exported graph otherwise adds a
// block-sum correction of four nodes per weight; this kernel reads d, m and the codes together
// (0.625 bytes per weight, the GGUF's own size) and needs no correction (docs/design.md "The specedge int4 kernel").
//
// Arithmetic, the same for every row whatever the number of rows (batch invariance, which exact
// speculation needs): A is quantized per block of 32 to int8 like MatMulNBits' accuracy level 4
// (scale = max|a| / 127, codes rounded to nearest even), and
//   y[n] = sum_b  fma chain:  (d·sa)·(sum_j q·aq − 8·sum_j aq)  +  m·s  +  (8d)·s
// with s the fp32 block sum of A (a fixed pairwise order) and sa the block's scale. Codes are
// centred on 8 as in the MatMulNBits graph so the int8 rounding error weighs the same.
// The AVX-512 VNNI, AVX2, NEON dot-product and portable paths (q41_kernel.cpp) compute the same bits
// (ops/tests/ops_kernels_test.cpp, tests/test_specedge_ops.py).
//
// Packed layout per group of 16 output rows and block b (320 bytes): 256 code bytes where byte
// 64h + 4r + i holds q[r, 4h + i] in its low nibble and q[r, 4(h + 4) + i] in its high nibble
// (h 0..3, r 0..15, i 0..3), then d[16] and m[16] as fp16. specedge/export/specedge_kernel.py packs it.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_lite_custom_op.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "ops_common.h"
#include "q41_kernel.h"

namespace {

using namespace specedge_ops;

void MatMulQ41(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& a, const Ort::Custom::Tensor<uint8_t>& w,
               Ort::Custom::Tensor<float>& y) {
  std::vector<int64_t> shape = a.Shape();
  const std::vector<int64_t> ws = w.Shape();
  if (shape.empty() || ws.size() != 3 || ws[2] != kQ41Block || ws[1] * kQ41K != shape.back())
    ORT_CXX_API_THROW("MatMulQ41: A must be [..., K] and W [N/16, K/32, 320]", ORT_INVALID_ARGUMENT);
  const int64_t k = shape.back(), nb = ws[1], n = ws[0] * kQ41Rows;
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  shape.back() = n;
  float* out = y.Allocate(shape);
  if (rows == 0) return;
  thread_local Q41Activations act;  // the kernel runs on one session thread at a time per call
  const Isa isa = ActiveIsa();
  Q41Quantize(isa, a.Data(), rows, k, act);
  Q41Job job{w.Data(), &act, out, rows, n, nb, isa};
  // a few contiguous batches: one ParallelFor task per row group costs more than it computes
  Ort::KernelContext(ctx).ParallelFor(Q41Task, Q41Tasks(n), 4, &job);
}

}  // namespace

extern "C" {

// Which path the kernels take on this machine: "avx512vnni", "avx2", "neondot" or "portable".
__attribute__((visibility("default"))) const char* specedge_ops_isa() {
  return specedge_ops::IsaName(specedge_ops::ActiveIsa());
}

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // cannot even report: an ONNX Runtime older than these headers
  Ort::InitApi(api);
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> op{
      Ort::Custom::CreateLiteCustomOp("MatMulQ41", "CPUExecutionProvider", MatMulQ41)};
  static Ort::CustomOpDomain domain{nullptr};
  try {
    if (!domain) {
      domain = Ort::CustomOpDomain{"ai.specedge"};
      domain.Add(op.get());
      specedge_ops::AddGroupQueryAttention(domain);
    }
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
}
