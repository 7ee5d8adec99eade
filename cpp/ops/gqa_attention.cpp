// ai.specedge.GroupQueryAttention: com.microsoft GroupQueryAttention's CPU contract as specedge's
// graphs use it (fp32, past and present sharing one buffer, rotate-half rotary inside, optional
// position_ids + attention_bias for tree calls, optional sliding window), with arithmetic per
// query row that does not depend on how many rows the call has.
//
// Why: ONNX Runtime's GroupQueryAttention computes Q·Kᵀ and P·V with MLAS GEMMs whose M = 1 path
// (a single-token step) sums in another order than M >= 2. In an int4 graph at accuracy level 4
// that 1e-7 difference flips int8 activation roundings downstream and changes greedy picks, so
// exact speculation had to run every single-token step as two tokens (runtime/invariant.py).
// With this op (and MatMulQ41 / MatMulNBits at accuracy level 4, whose rows are already
// independent of M) a graph's row i is bit for bit the same at every T, and T = 1 steps are exact.
//
// Per query row t of head h (slot = position + t, position = seqlens_k + 1 - T):
//   keys s in [lo, slot], lo = slot − local_window_size + 1 when the window is on (the last
//   local_window_size keys, as ONNX Runtime's op and specedge's torch reference take them), else 0;
//   score_s = dot(q, k_s) · scale (+ attention_bias[t, s]);  dot over 16 lanes (lane i takes
//   dims i, i + 16, ...; fma chain), lanes then summed pairwise (8, 4, 2, 1);
//   e_s = exp(score_s − max) with one fixed polynomial (0 below −87, so −inf gives 0);
//   out = (Σ_s e_s · v_s, an fma chain in s order per dim) / (Σ_s e_s, in s order).
// The AVX-512, AVX2, NEON and portable paths (gqa_kernel.cpp) compute the same bits, for a row
// alone or with the other heads of its kv head (how rows are handed to threads changes no bits).
#include "gqa_kernel.h"
#include "ops_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace specedge_ops {
namespace {

constexpr int kLanes = kAttnLanes;

struct Task {
  std::vector<AttnRow> rows;  // in groups of `group` rows: the heads of one kv head at one query row
  int64_t group, d;
  float scale;
  Isa isa;
};

void RunRows(void* data, size_t i) {
  const Task& t = *static_cast<const Task*>(data);
  thread_local std::vector<float> e;
  Attend(t.isa, t.rows.data() + i * t.group, t.group, t.d, t.scale, e);
}

struct GqaKernel {
  int64_t heads, kv_heads, window, rotary;
  float scale;

  GqaKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    heads = ki.GetAttribute<int64_t>("num_heads");
    kv_heads = ki.GetAttribute<int64_t>("kv_num_heads");
    window = Attr<int64_t>(ki, "local_window_size", -1);
    rotary = Attr<int64_t>(ki, "do_rotary", 0);
    scale = Attr<float>(ki, "scale", 0.f);
    if (Attr<int64_t>(ki, "rotary_interleaved", 0) != 0)
      ORT_CXX_API_THROW("ai.specedge.GroupQueryAttention: rotary_interleaved must be 0", ORT_INVALID_ARGUMENT);
    if (Attr<float>(ki, "softcap", 0.f) != 0.f)
      ORT_CXX_API_THROW("ai.specedge.GroupQueryAttention: softcap is not supported", ORT_INVALID_ARGUMENT);
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0)
      ORT_CXX_API_THROW("ai.specedge.GroupQueryAttention: num_heads must be a multiple of kv_num_heads",
                        ORT_INVALID_ARGUMENT);
  }

  template <typename T>
  static T Attr(Ort::ConstKernelInfo& ki, const char* name, T fallback) {
    try {
      return ki.GetAttribute<T>(name);
    } catch (const Ort::Exception&) {
      return fallback;
    }
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto input = [&](size_t i) { return i < ctx.GetInputCount() ? ctx.GetInput(i) : Ort::ConstValue{nullptr}; };
    const Ort::ConstValue query = input(0), key = input(1), value = input(2), past_k = input(3), past_v = input(4),
                          seqlens = input(5), cos = input(7), sin = input(8), position_ids = input(9), bias = input(10);
    const std::vector<int64_t> qs = query.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> ps = past_k.GetTensorTypeAndShapeInfo().GetShape();
    if (qs.size() != 3 || ps.size() != 4 || ps[1] != kv_heads)
      ORT_CXX_API_THROW(
          "ai.specedge.GroupQueryAttention: query must be [B, T, hidden] and past_key [B, kv_heads, S, D]",
          ORT_INVALID_ARGUMENT);
    const int64_t b_n = qs[0], t_n = qs[1], slots = ps[2], d = ps[3];
    const bool packed = !key;
    if (d % kLanes != 0)
      ORT_CXX_API_THROW("ai.specedge.GroupQueryAttention: head size must be a multiple of 16", ORT_INVALID_ARGUMENT);
    if (qs[2] != (packed ? (heads + 2 * kv_heads) * d : heads * d))
      ORT_CXX_API_THROW("ai.specedge.GroupQueryAttention: query width does not match the heads", ORT_INVALID_ARGUMENT);
    // a graph is untrusted input: every tensor read below is checked against the shapes it is indexed by
    auto shape = [](const Ort::ConstValue& v) { return v.GetTensorTypeAndShapeInfo().GetShape(); };
    auto refuse = [](const char* what) {
      ORT_CXX_API_THROW(std::string("ai.specedge.GroupQueryAttention: ") + what, ORT_INVALID_ARGUMENT);
    };
    if (ps[0] != b_n || shape(past_v) != ps)
      refuse("past_key and past_value must both be [B, kv_heads, S, D] for the query's B");
    if (!packed) {
      const std::vector<int64_t> want{b_n, t_n, kv_heads * d};
      if (!value || shape(key) != want || shape(value) != want) refuse("key and value must be [B, T, kv_heads * D]");
    }
    if (shape(seqlens) != std::vector<int64_t>{b_n}) refuse("seqlens_k must be [B]");
    if (rotary && cos && sin && (shape(cos).size() != 2 || shape(sin) != shape(cos)))
      refuse("cos_cache and sin_cache must both be [positions, rotary_dim / 2]");
    if (position_ids && shape(position_ids) != std::vector<int64_t>{b_n, t_n}) refuse("position_ids must be [B, T]");
    if (bias && (shape(bias).size() != 4 || shape(bias)[0] != b_n || shape(bias)[1] != 1 || shape(bias)[2] != t_n))
      refuse("attention_bias must be [B, 1, T, total_sequence_length]");
    const int32_t* seq = seqlens.GetTensorData<int32_t>();
    const float* q_in = query.GetTensorData<float>();
    const float* k_in = packed ? q_in + heads * d : key.GetTensorData<float>();
    const float* v_in = packed ? q_in + (heads + kv_heads) * d : value.GetTensorData<float>();
    const int64_t stride = packed ? (heads + 2 * kv_heads) * d : heads * d;  // per token of q_in
    const int64_t kv_stride = packed ? stride : kv_heads * d;

    Ort::UnownedValue out = ctx.GetOutput(0, {b_n, t_n, heads * d});
    Ort::UnownedValue pk = ctx.GetOutput(1, ps), pv = ctx.GetOutput(2, ps);
    float* kc = pk.GetTensorMutableData<float>();
    float* vc = pv.GetTensorMutableData<float>();
    const size_t cache_bytes = static_cast<size_t>(b_n * kv_heads * slots * d) * sizeof(float);
    // The contract binds present to past's memory; a caller that does not gets a copy first.
    if (kc != past_k.GetTensorData<float>()) std::memcpy(kc, past_k.GetTensorData<float>(), cache_bytes);
    if (vc != past_v.GetTensorData<float>()) std::memcpy(vc, past_v.GetTensorData<float>(), cache_bytes);

    int64_t half = 0;
    const float *cos_p = nullptr, *sin_p = nullptr;
    if (rotary) {
      if (!cos || !sin)
        ORT_CXX_API_THROW("ai.specedge.GroupQueryAttention: do_rotary needs cos_cache and sin_cache",
                          ORT_INVALID_ARGUMENT);
      half = cos.GetTensorTypeAndShapeInfo().GetShape()[1];
      if (2 * half > d)
        ORT_CXX_API_THROW("ai.specedge.GroupQueryAttention: rotary wider than a head", ORT_INVALID_ARGUMENT);
      cos_p = cos.GetTensorData<float>();
      sin_p = sin.GetTensorData<float>();
    }
    const int64_t rot_rows = rotary ? cos.GetTensorTypeAndShapeInfo().GetShape()[0] : 0;
    const int64_t* pos_ids = position_ids ? position_ids.GetTensorData<int64_t>() : nullptr;
    const float* bias_p = bias ? bias.GetTensorData<float>() : nullptr;
    const int64_t bias_w = bias ? bias.GetTensorTypeAndShapeInfo().GetShape().back() : 0;

    thread_local std::vector<float> qr;
    qr.resize(static_cast<size_t>(b_n * t_n * heads * d));
    std::vector<float> krow(d);
    // the heads of one kv head together (one pass over its keys) where that leaves enough tasks to
    // share among the threads; a T = 1 step's few groups run row by row instead
    const int64_t group = b_n * t_n * kv_heads >= 8 ? heads / kv_heads : 1;
    Task task{{}, group, d, scale != 0.f ? scale : 1.f / std::sqrt(static_cast<float>(d)), ActiveIsa()};
    task.rows.reserve(static_cast<size_t>(b_n * heads * t_n));
    for (int64_t b = 0; b < b_n; ++b) {
      const int64_t position = static_cast<int64_t>(seq[b]) + 1 - t_n;
      if (position < 0 || position + t_n > slots)
        ORT_CXX_API_THROW("ai.specedge.GroupQueryAttention: seqlens_k puts the new tokens outside the cache",
                          ORT_INVALID_ARGUMENT);
      for (int64_t t = 0; t < t_n; ++t) {
        const int64_t tok = b * t_n + t, slot = position + t;
        const int64_t rpos = pos_ids ? pos_ids[tok] : slot;
        if (rotary && (rpos < 0 || rpos >= rot_rows))
          ORT_CXX_API_THROW("ai.specedge.GroupQueryAttention: position outside the rotary tables",
                            ORT_INVALID_ARGUMENT);
        for (int64_t h = 0; h < heads; ++h) {
          float* q = qr.data() + (tok * heads + h) * d;
          std::memcpy(q, q_in + tok * stride + h * d, d * sizeof(float));
          if (rotary) RotateHalf(q, cos_p + rpos * half, sin_p + rpos * half, half);
        }
        for (int64_t g = 0; g < kv_heads; ++g) {
          std::memcpy(krow.data(), k_in + tok * kv_stride + g * d, d * sizeof(float));
          if (rotary) RotateHalf(krow.data(), cos_p + rpos * half, sin_p + rpos * half, half);
          const int64_t at = ((b * kv_heads + g) * slots + slot) * d;
          std::memcpy(kc + at, krow.data(), d * sizeof(float));
          std::memcpy(vc + at, v_in + tok * kv_stride + g * d, d * sizeof(float));
        }
      }
      float* o = out.GetTensorMutableData<float>();
      for (int64_t t = 0; t < t_n; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t g = h / (heads / kv_heads);
          const int64_t tok = b * t_n + t, slot = position + t;
          const int64_t lo = window > 0 ? std::max<int64_t>(0, slot - window + 1) : 0;
          const float* row_bias = nullptr;
          if (bias_p) {
            if (bias_w < slot + 1)
              ORT_CXX_API_THROW("ai.specedge.GroupQueryAttention: attention_bias narrower than the context",
                                ORT_INVALID_ARGUMENT);
            row_bias = bias_p + tok * bias_w;  // [B, 1, T, total]
          }
          task.rows.push_back(AttnRow{qr.data() + (tok * heads + h) * d, kc + (b * kv_heads + g) * slots * d,
                                      vc + (b * kv_heads + g) * slots * d, row_bias, o + (tok * heads + h) * d, lo,
                                      slot});
        }
    }
    ctx.ParallelFor(RunRows, task.rows.size() / group, 0, &task);
  }
};

struct GqaOp : Ort::CustomOpBase<GqaOp, GqaKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new GqaKernel(api, info); }
  const char* GetName() const { return "GroupQueryAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 11; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 5 || i == 6) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    if (i == 9) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return (i == 1 || i == 2 || i >= 7) ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

void AddGroupQueryAttention(Ort::CustomOpDomain& domain) {
  static GqaOp op;
  domain.Add(&op);
}

}  // namespace specedge_ops
