// libspecedge_ops: specedge's own ONNX Runtime CPU kernels, loaded as a custom-op library
// (SessionOptions::RegisterCustomOpsLibrary) by the Python and the C++ runtime.
//
// ai.specedge.MatMulQ41(A [..., K] float, W uint8 [N/16, K/32, 320]) -> Y [..., N]
//
// A times a GGUF Q4_1 weight, w[n, 32b + j] = d[n, b]·q[n, 32b + j] + m[n, b] (q in 0..15; d, m fp16). ONNX Runtime's
// MatMulNBits cannot hold m (a uint8 zero point cannot, a float one runs a 12x slower path), so the exported graph
// otherwise adds a block-sum correction of four nodes per weight; this kernel reads d, m and the codes together (0.625
// bytes per weight, the GGUF's own size) and needs no correction (docs/design.md "The specedge int4 kernel").
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
#include "q80_kernel.h"

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

// ai.specedge.MatMulQ80(A [..., K] float, B uint8 [N, K/32, 32], scales float [N * K/32]) -> Y [..., N]
//
// com.microsoft.MatMulNBits with bits 8, block 32 and no zero point (128), so w = (B − 128)·scale
// (GGUF Q8_0: the int4 graphs' lm_head, the tied embedding), taking the same inputs, so that a
// graph swaps the op and keeps its weights file. Its rows do not depend on how many rows a call
// has, and a weight block is read once for all of them (MatMulNBits' rows are also independent
// of T, but each costs almost a full read of the weights). B and scales must be initializers:
// they are repacked once, when the session creates the kernel (q80_kernel.h), into lanes of
// output rows as MatMulQ41's. A is quantized as for MatMulQ41 (int8 codes aq, scale sa per block
// of 32, its code sum qs), and
//   y[n] = fma chain over b of  (scale[n, b]·sa_b)·(Σ_j B[n, b, j]·aq_j − 128·qs_b).
struct Q80Kernel {
  std::vector<uint8_t> packed;
  int64_t n = 0, nb = 0;

  Q80Kernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    int b_const = 0, s_const = 0;
    const Ort::ConstValue b = ki.GetTensorConstantInput(1, &b_const);
    const Ort::ConstValue s = ki.GetTensorConstantInput(2, &s_const);
    if (!b_const || !s_const) ORT_CXX_API_THROW("MatMulQ80: B and scales must be initializers", ORT_INVALID_ARGUMENT);
    const std::vector<int64_t> bs = b.GetTensorTypeAndShapeInfo().GetShape();
    if (bs.size() != 3 || bs[2] != kQ80K || bs[0] % kQ80Rows != 0 ||
        static_cast<int64_t>(s.GetTensorTypeAndShapeInfo().GetElementCount()) != bs[0] * bs[1])
      ORT_CXX_API_THROW("MatMulQ80: B must be [N, K/32, 32] with N a multiple of 16, and scales [N * K/32]",
                        ORT_INVALID_ARGUMENT);
    n = bs[0];
    nb = bs[1];
    packed = Q80Pack(b.GetTensorData<uint8_t>(), s.GetTensorData<float>(), n, nb);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue a = ctx.GetInput(0);
    std::vector<int64_t> shape = a.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != nb * kQ80K)
      ORT_CXX_API_THROW("MatMulQ80: A must be [..., K] with K = 32 * B's second dimension", ORT_INVALID_ARGUMENT);
    const int64_t k = shape.back();
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    shape.back() = n;
    float* out = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    if (rows == 0) return;
    thread_local Q41Activations act;
    const Isa isa = ActiveIsa();
    Q41Quantize(isa, a.GetTensorData<float>(), rows, k, act);
    Q80Job job{packed.data(), &act, out, rows, n, nb, isa};
    ctx.ParallelFor(Q80Task, Q80Tasks(n), 4, &job);
  }
};

struct Q80Op : Ort::CustomOpBase<Q80Op, Q80Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Q80Kernel(api, info); }
  const char* GetName() const { return "MatMulQ80"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

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
  static Q80Op q80;
  static Ort::CustomOpDomain domain{nullptr};
  try {
    if (!domain) {
      domain = Ort::CustomOpDomain{"ai.specedge"};
      domain.Add(op.get());
      domain.Add(&q80);
      specedge_ops::AddGroupQueryAttention(domain);
    }
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
}
