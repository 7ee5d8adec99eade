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
// The AVX-512 VNNI path and the portable path compute the same bits (tests/test_specedge_ops.py).
//
// Packed layout per group of 16 output rows and block b (320 bytes): 256 code bytes where byte
// 64h + 4r + i holds q[r, 4h + i] in its low nibble and q[r, 4(h + 4) + i] in its high nibble
// (h 0..3, r 0..15, i 0..3), then d[16] and m[16] as fp16. specedge/export/specedge_kernel.py packs it.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_lite_custom_op.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ops_common.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECEDGE_OPS_X86 1
#endif

namespace {

constexpr int64_t kQK = 32;      // values per block
constexpr int64_t kRows = 16;    // output rows per group
constexpr int64_t kBlock = 320;  // packed bytes per group and block
constexpr int64_t kGroupsPerTask = 2;

struct Activations {
  std::vector<int8_t> q;      // [rows, K]
  std::vector<float> scale;   // [rows, K/32]
  std::vector<float> sum;     // [rows, K/32]: fp32 block sums of A
  std::vector<int32_t> qsum;  // [rows, K/32]: block sums of the int8 codes
};

struct Job {
  const uint8_t* w;
  const Activations* act;
  float* out;
  int64_t rows, n, nb;
};

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3FF) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Block sum in the order the AVX-512 path uses: 16 pairs (j, j+16), then halving 8, 4, 2, 1.
float PairwiseSum32(const float* x) {
  float v[16];
  for (int i = 0; i < 16; ++i) v[i] = x[i] + x[i + 16];
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v[i] = v[i] + v[i + w];
  return v[0];
}

void QuantizePortable(const float* a, int64_t rows, int64_t k, Activations& act) {
  const int64_t nb = k / kQK;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = a + r * k + b * kQK;
      float amax = 0.f;
      for (int j = 0; j < kQK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
      const float scale = amax / 127.f, inv = scale != 0.f ? 1.f / scale : 0.f;
      int32_t qs = 0;
      for (int j = 0; j < kQK; ++j) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(x[j] * inv));
        act.q[r * k + b * kQK + j] = static_cast<int8_t>(v);
        qs += v;
      }
      act.scale[r * nb + b] = scale;
      act.sum[r * nb + b] = PairwiseSum32(x);
      act.qsum[r * nb + b] = qs;
    }
}

void TaskPortable(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t g0 = static_cast<int64_t>(task) * kGroupsPerTask;
  const int64_t g1 = std::min(g0 + kGroupsPerTask, j.n / kRows);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r = 0; r < j.rows; ++r) {
      float acc[kRows] = {};
      for (int64_t b = 0; b < j.nb; ++b) {
        const uint8_t* blk = j.w + (g * j.nb + b) * kBlock;
        const int8_t* aq = j.act->q.data() + (r * j.nb + b) * kQK;
        const int64_t rb = r * j.nb + b;
        uint16_t dh[kRows], mh[kRows];
        std::memcpy(dh, blk + 256, sizeof dh);
        std::memcpy(mh, blk + 288, sizeof mh);
        for (int64_t row = 0; row < kRows; ++row) {
          int32_t dot = -8 * j.act->qsum[rb];
          for (int h = 0; h < 4; ++h)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = blk[64 * h + 4 * row + i];
              dot += (byte & 0x0F) * aq[4 * h + i] + (byte >> 4) * aq[4 * (h + 4) + i];
            }
          const float d = HalfToFloat(dh[row]), m = HalfToFloat(mh[row]), s = j.act->sum[rb];
          acc[row] = std::fma(d * j.act->scale[rb], static_cast<float>(dot), acc[row]);
          acc[row] = std::fma(m, s, acc[row]);
          acc[row] = std::fma(d * 8.f, s, acc[row]);
        }
      }
      for (int64_t row = 0; row < kRows; ++row) {
        const int64_t off = r * j.n + g * kRows + row;
        j.out[off] = acc[row];
      }
    }
}

#ifdef SPECEDGE_OPS_X86
#define SPECEDGE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))

SPECEDGE_AVX512 void QuantizeAvx512(const float* a, int64_t rows, int64_t k, Activations& act) {
  const int64_t nb = k / kQK;
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = a + r * k + b * kQK;
      const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_and_ps(x1, absmask)));
      // the pairwise order of PairwiseSum32, spelled out (reduce intrinsics leave the order open)
      alignas(64) float v[16];
      _mm512_store_ps(v, _mm512_add_ps(x0, x1));
      for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) v[i] = v[i] + v[i + w];
      const float scale = amax / 127.f, inv = scale != 0.f ? 1.f / scale : 0.f;
      const __m512 vinv = _mm512_set1_ps(inv);
      // cvtps_epi32 rounds to nearest even under the default MXCSR, as nearbyint does
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vinv));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vinv));
      int8_t* q = act.q.data() + r * k + b * kQK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
      act.qsum[r * nb + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      act.scale[r * nb + b] = scale;
      act.sum[r * nb + b] = v[0];
    }
}

// R activation rows x G row groups: one integer and one float accumulator per (row, group), so
// the weight bytes are unpacked once for R rows, and each row's arithmetic does not depend on R.
template <int R, int G>
SPECEDGE_AVX512 inline void TileAvx512(const Job& j, int64_t g0, int64_t r0) {
  const __m512i lo = _mm512_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < j.nb; ++b) {
    const int32_t* a4[R];
    __m512i dot[R][G];
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * j.nb + b;
      a4[r] = reinterpret_cast<const int32_t*>(j.act->q.data() + rb * kQK);
      const __m512i init = _mm512_set1_epi32(-8 * j.act->qsum[rb]);
      for (int g = 0; g < G; ++g) dot[r][g] = init;
    }
    for (int h = 0; h < 4; ++h)
      for (int g = 0; g < G; ++g) {
        const __m512i v = _mm512_loadu_si512(j.w + ((g0 + g) * j.nb + b) * kBlock + 64 * h);
        const __m512i wl = _mm512_and_si512(v, lo);
        const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
        for (int r = 0; r < R; ++r) {
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, a4[r] + h, 4);
          std::memcpy(&a_hi, a4[r] + h + 4, 4);
          dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], wl, _mm512_set1_epi32(a_lo));
          dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], wh, _mm512_set1_epi32(a_hi));
        }
      }
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = j.w + ((g0 + g) * j.nb + b) * kBlock;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
      const __m512 d8 = _mm512_mul_ps(d, eight);
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (r0 + r) * j.nb + b;
        const __m512 s = _mm512_set1_ps(j.act->sum[rb]);
        acc[r][g] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(j.act->scale[rb])),
                                    _mm512_cvtepi32_ps(dot[r][g]), acc[r][g]);
        acc[r][g] = _mm512_fmadd_ps(m, s, acc[r][g]);
        acc[r][g] = _mm512_fmadd_ps(d8, s, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t off = (r0 + r) * j.n + (g0 + g) * kRows;
      _mm512_storeu_ps(j.out + off, acc[r][g]);
    }
}

template <int G>
SPECEDGE_AVX512 void GroupsAvx512(const Job& j, int64_t g0) {
  int64_t r = 0;
  for (; r + 2 <= j.rows; r += 2) TileAvx512<2, G>(j, g0, r);
  if (r < j.rows) TileAvx512<1, G>(j, g0, r);
}

void TaskAvx512(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t g0 = static_cast<int64_t>(task) * kGroupsPerTask;
  if (j.n / kRows - g0 >= 2)
    GroupsAvx512<2>(j, g0);
  else
    GroupsAvx512<1>(j, g0);
}
static_assert(kGroupsPerTask == 2, "TaskAvx512 handles two groups per task");

#define SPECEDGE_AVX2 __attribute__((target("avx2,fma,f16c")))

// QuantizeAvx512's arithmetic on 8 lanes (the same bits).
SPECEDGE_AVX2 void QuantizeAvx2(const float* a, int64_t rows, int64_t k, Activations& act) {
  const int64_t nb = k / kQK;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = a + r * k + b * kQK;
      __m256 xs[4], mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        xs[i] = _mm256_loadu_ps(x + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(xs[i], absmask));
      }
      alignas(32) float v[16], m8[8];
      _mm256_store_ps(m8, mx);
      float amax = 0.f;
      for (float f : m8) amax = std::fmax(amax, f);
      _mm256_store_ps(v, _mm256_add_ps(xs[0], xs[2]));  // pairs (j, j + 16), as PairwiseSum32
      _mm256_store_ps(v + 8, _mm256_add_ps(xs[1], xs[3]));
      for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) v[i] = v[i] + v[i + w];
      const float scale = amax / 127.f, inv = scale != 0.f ? 1.f / scale : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      alignas(32) int32_t q32[kQK];
      __m256i qs = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(xs[i], vinv));  // nearest even
        _mm256_store_si256(reinterpret_cast<__m256i*>(q32 + 8 * i), qi);
        qs = _mm256_add_epi32(qs, qi);
      }
      int8_t* q = act.q.data() + r * k + b * kQK;
      for (int j = 0; j < kQK; ++j) q[j] = static_cast<int8_t>(q32[j]);  // |q| <= 127
      alignas(32) int32_t s8[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(s8), qs);
      int32_t qsum = 0;
      for (int32_t x8 : s8) qsum += x8;
      act.qsum[r * nb + b] = qsum;
      act.scale[r * nb + b] = scale;
      act.sum[r * nb + b] = v[0];
    }
}

// vpdpbusd on AVX2: u8 x s8 products summed in fours per 32-bit lane. maddubs adds two products
// into an int16 with saturation, which cannot happen here: codes are 0..15, so |sum| <= 2*15*128.
SPECEDGE_AVX2 inline __m256i DotBytesAvx2(__m256i acc, __m256i w, __m256i a) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
}

// TileAvx512's arithmetic with each group of 16 rows in two halves of 8 lanes.
template <int R, int G>
SPECEDGE_AVX2 inline void TileAvx2(const Job& j, int64_t g0, int64_t r0) {
  const __m256i lo = _mm256_set1_epi8(0x0F);
  const __m256 eight = _mm256_set1_ps(8.f);
  __m256 acc[R][G][2];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g][0] = acc[r][g][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < j.nb; ++b) {
    const int32_t* a4[R];
    __m256i dot[R][G][2];
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * j.nb + b;
      a4[r] = reinterpret_cast<const int32_t*>(j.act->q.data() + rb * kQK);
      const __m256i init = _mm256_set1_epi32(-8 * j.act->qsum[rb]);
      for (int g = 0; g < G; ++g) dot[r][g][0] = dot[r][g][1] = init;
    }
    for (int h = 0; h < 4; ++h)
      for (int g = 0; g < G; ++g)
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(j.w + ((g0 + g) * j.nb + b) * kBlock + 64 * h + 32 * half));
          const __m256i wl = _mm256_and_si256(v, lo);
          const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
          for (int r = 0; r < R; ++r) {
            int32_t a_lo, a_hi;
            std::memcpy(&a_lo, a4[r] + h, 4);
            std::memcpy(&a_hi, a4[r] + h + 4, 4);
            dot[r][g][half] = DotBytesAvx2(dot[r][g][half], wl, _mm256_set1_epi32(a_lo));
            dot[r][g][half] = DotBytesAvx2(dot[r][g][half], wh, _mm256_set1_epi32(a_hi));
          }
        }
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = j.w + ((g0 + g) * j.nb + b) * kBlock;
      for (int half = 0; half < 2; ++half) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + 16 * half)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 16 * half)));
        const __m256 d8 = _mm256_mul_ps(d, eight);
        for (int r = 0; r < R; ++r) {
          const int64_t rb = (r0 + r) * j.nb + b;
          const __m256 s = _mm256_set1_ps(j.act->sum[rb]);
          __m256& a = acc[r][g][half];
          a = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(j.act->scale[rb])), _mm256_cvtepi32_ps(dot[r][g][half]), a);
          a = _mm256_fmadd_ps(m, s, a);
          a = _mm256_fmadd_ps(d8, s, a);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int half = 0; half < 2; ++half)
        _mm256_storeu_ps(j.out + (r0 + r) * j.n + (g0 + g) * kRows + 8 * half, acc[r][g][half]);
}

template <int G>
SPECEDGE_AVX2 void GroupsAvx2(const Job& j, int64_t g0) {
  int64_t r = 0;
  for (; r + 2 <= j.rows; r += 2) TileAvx2<2, G>(j, g0, r);
  if (r < j.rows) TileAvx2<1, G>(j, g0, r);
}

void TaskAvx2(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t g0 = static_cast<int64_t>(task) * kGroupsPerTask;
  if (j.n / kRows - g0 >= 2)
    GroupsAvx2<2>(j, g0);
  else
    GroupsAvx2<1>(j, g0);
}

bool HaveAvx512Vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}

bool HaveAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

using specedge_ops::ActiveIsa;
using specedge_ops::Isa;

void MatMulQ41(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& a, const Ort::Custom::Tensor<uint8_t>& w,
               Ort::Custom::Tensor<float>& y) {
  std::vector<int64_t> shape = a.Shape();
  const std::vector<int64_t> ws = w.Shape();
  if (shape.empty() || ws.size() != 3 || ws[2] != kBlock || ws[1] * kQK != shape.back())
    ORT_CXX_API_THROW("MatMulQ41: A must be [..., K] and W [N/16, K/32, 320]", ORT_INVALID_ARGUMENT);
  const int64_t k = shape.back(), nb = ws[1], n = ws[0] * kRows;
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  shape.back() = n;
  float* out = y.Allocate(shape);
  if (rows == 0) return;
  thread_local Activations act;  // the kernel runs on one session thread at a time per call
  act.q.resize(rows * k);
  act.scale.resize(rows * nb);
  act.sum.resize(rows * nb);
  act.qsum.resize(rows * nb);
  const Isa isa = ActiveIsa();
  void (*fn)(void*, size_t) = TaskPortable;
#ifdef SPECEDGE_OPS_X86
  if (isa == Isa::kAvx512) {
    QuantizeAvx512(a.Data(), rows, k, act);
    fn = TaskAvx512;
  } else if (isa == Isa::kAvx2) {
    QuantizeAvx2(a.Data(), rows, k, act);
    fn = TaskAvx2;
  } else
#endif
    QuantizePortable(a.Data(), rows, k, act);
  Job job{w.Data(), &act, out, rows, n, nb};
  const size_t tasks = static_cast<size_t>((n / kRows + kGroupsPerTask - 1) / kGroupsPerTask);
  // a few contiguous batches: one ParallelFor task per row group costs more than it computes
  Ort::KernelContext(ctx).ParallelFor(fn, tasks, 4, &job);
}

}  // namespace

specedge_ops::Isa specedge_ops::ActiveIsa() {
  static const Isa isa = [] {
    Isa best = Isa::kPortable;
#ifdef SPECEDGE_OPS_X86
    if (HaveAvx512Vnni())
      best = Isa::kAvx512;
    else if (HaveAvx2())
      best = Isa::kAvx2;
#endif
    const char* want = std::getenv("SPECEDGE_OPS_ISA");
    if (want && std::string(want) == "portable") return Isa::kPortable;
    if (want && std::string(want) == "avx2" && best == Isa::kAvx512) return Isa::kAvx2;
    return best;
  }();
  return isa;
}

extern "C" {

// Which path the kernels take on this machine: "avx512vnni", "avx2" or "portable".
__attribute__((visibility("default"))) const char* specedge_ops_isa() {
  switch (specedge_ops::ActiveIsa()) {
    case specedge_ops::Isa::kAvx512: return "avx512vnni";
    case specedge_ops::Isa::kAvx2: return "avx2";
    default: return "portable";
  }
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
