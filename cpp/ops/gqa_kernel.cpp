// ai.specedge.GroupQueryAttention's arithmetic per query row on every path; gqa_attention.cpp
// states the order of every sum. The AVX-512, AVX2, NEON and portable paths compute the same bits
// (ops/tests/ops_kernels_test.cpp, on x86-64 and under qemu on aarch64).
#include "gqa_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "row_chunks.h"
#include "simd.h"

namespace specedge_ops {
namespace {

constexpr int kLanes = kAttnLanes;
constexpr float kExpFloor = -87.0f;  // below: e^x is taken as 0 (also for −inf scores)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = hi + lo
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

float ExpScalar(float x) {
  if (!(x >= kExpFloor)) return 0.f;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kP[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kP[i]);
  p = std::fma(p, r, 1.f);
  p = std::fma(p, r, 1.f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // n in [-126, 0]: a normal 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

float DotScalar(const float* a, const float* b, int64_t d) {
  float lane[kLanes] = {};
  for (int64_t c = 0; c < d; c += kLanes)
    for (int i = 0; i < kLanes; ++i) lane[i] = std::fma(a[c + i], b[c + i], lane[i]);
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) lane[i] = lane[i] + lane[i + w];
  return lane[0];
}

using Row = AttnRow;

void AttendPortable(const Row& r, int64_t d, float scale, std::vector<float>& e) {
  const int64_t n = r.hi - r.lo + 1;
  e.resize(n);
  float mx = -INFINITY;
  for (int64_t s = 0; s < n; ++s) {
    float x = DotScalar(r.q, r.k + (r.lo + s) * d, d) * scale;
    if (r.bias) x = x + r.bias[r.lo + s];
    e[s] = x;
    mx = std::max(mx, x);
  }
  for (int64_t s = 0; s < n; ++s) e[s] = ExpScalar(e[s] - mx);
  float sum = 0.f;
  for (int64_t s = 0; s < n; ++s) sum = sum + e[s];
  for (int64_t c = 0; c < d; ++c) {
    float acc = 0.f;
    for (int64_t s = 0; s < n; ++s) acc = std::fma(e[s], r.v[(r.lo + s) * d + c], acc);
    r.out[c] = acc / sum;
  }
}

#ifdef SPECEDGE_OPS_X86
#define SPECEDGE_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,fma")))

SPECEDGE_AVX512 inline float DotAvx512(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += kLanes) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
  return SumLanesAvx512(acc);  // DotScalar's order
}

SPECEDGE_AVX512 inline __m512 ExpAvx512(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_GE_OQ);
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP[i]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

// Sixteen keys' dot products at once: each key's 16-lane fma chain as DotAvx512's, then the
// lanes of all sixteen summed together by shuffles in DotAvx512's order (i + (i + 8), + 4, + 2,
// + 1), so that the reductions share instructions and run side by side instead of one key's
// dependent chain after another. The shuffles leave register j's sum in lane KeyOfSlot(j), so
// register j takes that key: key i lands in lane i.
// _mm512_shuffle_f32x4 through its masked form, all lanes kept: the plain one starts from an
// undefined register that GCC 12 warns about
template <int Imm>
SPECEDGE_AVX512 inline __m512 Quarters(__m512 a, __m512 b) {
  return _mm512_mask_shuffle_f32x4(a, 0xFFFF, a, b, Imm);
}

constexpr int KeyOfSlot(int j) { return (j % 4) * 4 + j / 4; }

SPECEDGE_AVX512 inline __m512 Dot16Avx512(const float* q, const float* k, int64_t d) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += kLanes) {
    const __m512 qc = _mm512_loadu_ps(q + c);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k + KeyOfSlot(j) * d + c), acc[j]);
  }
  __m512 a8[8], a4[4], a2[2];
  for (int j = 0; j < 8; ++j)  // lanes i + (i + 8): registers 2j and 2j + 1 in one
    a8[j] = _mm512_add_ps(Quarters<_MM_SHUFFLE(1, 0, 1, 0)>(acc[2 * j], acc[2 * j + 1]),
                          Quarters<_MM_SHUFFLE(3, 2, 3, 2)>(acc[2 * j], acc[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // + 4: four keys per register, one per 128-bit lane
    a4[j] = _mm512_add_ps(Quarters<_MM_SHUFFLE(2, 0, 2, 0)>(a8[2 * j], a8[2 * j + 1]),
                          Quarters<_MM_SHUFFLE(3, 1, 3, 1)>(a8[2 * j], a8[2 * j + 1]));
  for (int j = 0; j < 2; ++j)  // + 2, within each 128-bit lane
    a2[j] = _mm512_add_ps(_mm512_shuffle_ps(a4[2 * j], a4[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(a4[2 * j], a4[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(a2[0], a2[1], _MM_SHUFFLE(2, 0, 2, 0)),  // + 1
                       _mm512_shuffle_ps(a2[0], a2[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// e[0..n) = exp(score_s - max) for one row (room for n + 16 floats).
SPECEDGE_AVX512 void ExpScoresAvx512(const Row& r, int64_t d, float scale, float* e) {
  const int64_t n = r.hi - r.lo + 1;
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    __m512 x = _mm512_mul_ps(Dot16Avx512(r.q, r.k + (r.lo + s) * d, d), _mm512_set1_ps(scale));
    if (r.bias) x = _mm512_add_ps(x, _mm512_loadu_ps(r.bias + r.lo + s));
    _mm512_storeu_ps(e + s, x);
    vmax = _mm512_max_ps(vmax, x);
  }
  float mx = _mm512_reduce_max_ps(vmax);  // a maximum: any order gives the same value
  for (; s < n; ++s) {
    float x = DotAvx512(r.q, r.k + (r.lo + s) * d, d) * scale;
    if (r.bias) x = x + r.bias[r.lo + s];
    e[s] = x;
    mx = std::max(mx, x);
  }
  const __m512 vmx = _mm512_set1_ps(mx);
  for (s = 0; s + kLanes <= n; s += kLanes)
    _mm512_storeu_ps(e + s, ExpAvx512(_mm512_sub_ps(_mm512_loadu_ps(e + s), vmx)));
  for (; s < n; ++s) e[s] = ExpScalar(e[s] - mx);
}

// P·V for R rows over the same keys, W registers of dims at a time: R·W fma chains in flight and
// each V load shared by the R rows (each dim's chain, in s order, is the same whatever the
// grouping). The first pass over the keys also adds up each row's Σ e_s, in s order: those
// dependent chains then run beside the fma chains instead of before them.
template <int R, int W>
SPECEDGE_AVX512 inline void PvAvx512(const Row* rows, int64_t d, const float* e, int64_t stride, int64_t c,
                                     float* sum) {
  const int64_t n = rows[0].hi - rows[0].lo + 1;
  __m512 acc[R][W];
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < W; ++w) acc[i][w] = _mm512_setzero_ps();
  const float* v = rows[0].v + rows[0].lo * d + c;
  for (int64_t s = 0; s < n; ++s) {
    __m512 vs[W];
    for (int w = 0; w < W; ++w) vs[w] = _mm512_loadu_ps(v + s * d + kLanes * w);
    for (int i = 0; i < R; ++i) {
      const float es = e[i * stride + s];
      if (c == 0) sum[i] = sum[i] + es;
      for (int w = 0; w < W; ++w) acc[i][w] = _mm512_fmadd_ps(_mm512_set1_ps(es), vs[w], acc[i][w]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < W; ++w)
      _mm512_storeu_ps(rows[i].out + c + kLanes * w, _mm512_div_ps(acc[i][w], _mm512_set1_ps(sum[i])));
}

template <int R>
SPECEDGE_AVX512 void PvRowsAvx512(const Row* rows, int64_t d, const float* e, int64_t stride) {
  float sum[R] = {};
  int64_t c = 0;
  for (; c + 4 * kLanes <= d; c += 4 * kLanes) PvAvx512<R, 4>(rows, d, e, stride, c, sum);
  for (; c < d; c += kLanes) PvAvx512<R, 1>(rows, d, e, stride, c, sum);
}

SPECEDGE_AVX512 void AttendAvx512(const Row* rows, int64_t count, int64_t d, float scale, std::vector<float>& e) {
  const int64_t stride = rows[0].hi - rows[0].lo + 1 + kLanes;
  e.resize(count * stride);
  for (int64_t i = 0; i < count; ++i) ExpScoresAvx512(rows[i], d, scale, e.data() + i * stride);
  // up to 4 rows x 4 registers: 16 accumulators and the 4 V registers
  ForRowTiles<4>(count, [&](auto tile, int64_t r) {
    PvRowsAvx512<decltype(tile)::value>(rows + r, d, e.data() + r * stride, stride);
  });
}
#define SPECEDGE_AVX2 __attribute__((target("avx2,fma")))

// The AVX-512 path's arithmetic on 8 lanes: the 16 dot-product lanes as two registers (lanes
// 0..7 and 8..15), the exp polynomial and the P·V chains 8 dims at a time. Same bits.
SPECEDGE_AVX2 inline float DotAvx2(const float* a, const float* b, int64_t d) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += kLanes) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), hi);
  }
  return SumLanesAvx2(lo, hi);
}

SPECEDGE_AVX2 inline __m256 ExpAvx2(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_GE_OQ);
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Dot16Avx512's scheme on 8 lanes, for keys 2g, 2g + 1, 2g + 4, 2g + 5 (in registers 0, 2, 1, 3):
// DotAvx2's chains, a8 = lo + hi, then + 4 and + 2 for all four at once; 128-bit half h then
// holds register h's two partial sums in lanes 0-1 and register 2 + h's in lanes 2-3.
SPECEDGE_AVX2 inline __m256 Dot4PairsAvx2(const float* q, const float* k, int64_t d, int g) {
  __m256 lo[4], hi[4], a8[4];
  for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += kLanes) {
    const __m256 ql = _mm256_loadu_ps(q + c), qh = _mm256_loadu_ps(q + c + 8);
    for (int j = 0; j < 4; ++j) {
      const float* kj = k + ((j % 2) * 4 + j / 2 + 2 * g) * d + c;
      lo[j] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(kj), lo[j]);
      hi[j] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(kj + 8), hi[j]);
    }
  }
  for (int j = 0; j < 4; ++j) a8[j] = _mm256_add_ps(lo[j], hi[j]);
  const __m256 a4_01 = _mm256_add_ps(_mm256_permute2f128_ps(a8[0], a8[1], 0x20),  // + 4: one key per half
                                     _mm256_permute2f128_ps(a8[0], a8[1], 0x31));
  const __m256 a4_23 =
      _mm256_add_ps(_mm256_permute2f128_ps(a8[2], a8[3], 0x20), _mm256_permute2f128_ps(a8[2], a8[3], 0x31));
  return _mm256_add_ps(_mm256_shuffle_ps(a4_01, a4_23, _MM_SHUFFLE(1, 0, 1, 0)),  // + 2
                       _mm256_shuffle_ps(a4_01, a4_23, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Eight keys' dot products, key i in lane i, each with DotAvx2's bits.
SPECEDGE_AVX2 inline __m256 Dot8Avx2(const float* q, const float* k, int64_t d) {
  const __m256 a = Dot4PairsAvx2(q, k, d, 0), b = Dot4PairsAvx2(q, k, d, 1);
  return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),  // + 1
                       _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

SPECEDGE_AVX2 void ExpScoresAvx2(const Row& r, int64_t d, float scale, float* e) {  // as ExpScoresAvx512
  const int64_t n = r.hi - r.lo + 1;
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t s = 0;
  for (; s + 8 <= n; s += 8) {
    __m256 x = _mm256_mul_ps(Dot8Avx2(r.q, r.k + (r.lo + s) * d, d), _mm256_set1_ps(scale));
    if (r.bias) x = _mm256_add_ps(x, _mm256_loadu_ps(r.bias + r.lo + s));
    _mm256_storeu_ps(e + s, x);
    vmax = _mm256_max_ps(vmax, x);
  }
  alignas(32) float m8[8];
  _mm256_store_ps(m8, vmax);
  float mx = -INFINITY;
  for (float m : m8) mx = std::max(mx, m);  // a maximum: any order gives the same value
  for (; s < n; ++s) {
    float x = DotAvx2(r.q, r.k + (r.lo + s) * d, d) * scale;
    if (r.bias) x = x + r.bias[r.lo + s];
    e[s] = x;
    mx = std::max(mx, x);
  }
  const __m256 vmx = _mm256_set1_ps(mx);
  for (s = 0; s + 8 <= n; s += 8) _mm256_storeu_ps(e + s, ExpAvx2(_mm256_sub_ps(_mm256_loadu_ps(e + s), vmx)));
  for (; s < n; ++s) e[s] = ExpScalar(e[s] - mx);
}

// PvAvx512's P·V on 8 lanes: R rows, W registers of dims at a time, Σ e_s beside the first pass.
template <int R, int W>
SPECEDGE_AVX2 inline void PvAvx2(const Row* rows, int64_t d, const float* e, int64_t stride, int64_t c, float* sum) {
  const int64_t n = rows[0].hi - rows[0].lo + 1;
  __m256 acc[R][W];
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < W; ++w) acc[i][w] = _mm256_setzero_ps();
  const float* v = rows[0].v + rows[0].lo * d + c;
  for (int64_t s = 0; s < n; ++s) {
    __m256 vs[W];
    for (int w = 0; w < W; ++w) vs[w] = _mm256_loadu_ps(v + s * d + 8 * w);
    for (int i = 0; i < R; ++i) {
      const float es = e[i * stride + s];
      if (c == 0) sum[i] = sum[i] + es;
      for (int w = 0; w < W; ++w) acc[i][w] = _mm256_fmadd_ps(_mm256_set1_ps(es), vs[w], acc[i][w]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < W; ++w)
      _mm256_storeu_ps(rows[i].out + c + 8 * w, _mm256_div_ps(acc[i][w], _mm256_set1_ps(sum[i])));
}

template <int R>
SPECEDGE_AVX2 void PvRowsAvx2(const Row* rows, int64_t d, const float* e, int64_t stride) {
  float sum[R] = {};
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) PvAvx2<R, 4>(rows, d, e, stride, c, sum);
  for (; c < d; c += 8) PvAvx2<R, 1>(rows, d, e, stride, c, sum);
}

SPECEDGE_AVX2 void AttendAvx2(const Row* rows, int64_t count, int64_t d, float scale, std::vector<float>& e) {
  const int64_t stride = rows[0].hi - rows[0].lo + 1 + 8;
  e.resize(count * stride);
  for (int64_t i = 0; i < count; ++i) ExpScoresAvx2(rows[i], d, scale, e.data() + i * stride);
  // up to 2 rows x 4 registers: 8 accumulators and the 4 V registers of AVX2's 16
  ForRowTiles<2>(count, [&](auto tile, int64_t r) {
    PvRowsAvx2<decltype(tile)::value>(rows + r, d, e.data() + r * stride, stride);
  });
}
#endif

#ifdef SPECEDGE_OPS_NEON
// The AVX-512 path's arithmetic on 4 lanes: the 16 dot-product lanes as four registers, the exp
// polynomial and the P·V chains 4 dims at a time. Same bits.
inline float DotNeon(const float* a, const float* b, int64_t d) {
  float32x4_t l[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
  for (int64_t c = 0; c < d; c += kLanes)
    for (int i = 0; i < 4; ++i) l[i] = vfmaq_f32(l[i], vld1q_f32(a + c + 4 * i), vld1q_f32(b + c + 4 * i));
  // lanes i + (i + 8), then + 4, + 2, + 1: DotScalar's order
  const float32x4_t u = vaddq_f32(vaddq_f32(l[0], l[2]), vaddq_f32(l[1], l[3]));
  const float32x2_t p = vadd_f32(vget_low_f32(u), vget_high_f32(u));
  return vget_lane_f32(p, 0) + vget_lane_f32(p, 1);
}

inline float32x4_t ExpNeon(float32x4_t x) {
  const uint32x4_t keep = vcgeq_f32(x, vdupq_n_f32(kExpFloor));
  const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, kLog2e));
  float32x4_t r = vfmaq_f32(x, n, vdupq_n_f32(-kLn2Hi));
  r = vfmaq_f32(r, n, vdupq_n_f32(-kLn2Lo));
  float32x4_t p = vdupq_n_f32(kP[0]);
  for (int i = 1; i < 6; ++i) p = vfmaq_f32(vdupq_n_f32(kP[i]), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vreinterpretq_f32_u32(vandq_u32(keep, vreinterpretq_u32_f32(vmulq_f32(p, vreinterpretq_f32_s32(e)))));
}

void AttendNeon(const Row& r, int64_t d, float scale, std::vector<float>& e) {
  const int64_t n = r.hi - r.lo + 1;
  e.resize(n + 4);
  float mx = -INFINITY;
  for (int64_t s = 0; s < n; ++s) {
    float x = DotNeon(r.q, r.k + (r.lo + s) * d, d) * scale;
    if (r.bias) x = x + r.bias[r.lo + s];
    e[s] = x;
    mx = std::max(mx, x);
  }
  const float32x4_t vmx = vdupq_n_f32(mx);
  int64_t s = 0;
  for (; s + 4 <= n; s += 4) vst1q_f32(e.data() + s, ExpNeon(vsubq_f32(vld1q_f32(e.data() + s), vmx)));
  for (; s < n; ++s) e[s] = ExpScalar(e[s] - mx);
  float sum = 0.f;
  for (s = 0; s < n; ++s) sum = sum + e[s];
  const float32x4_t vsum = vdupq_n_f32(sum);
  for (int64_t c = 0; c < d; c += kLanes) {  // P·V as AttendAvx512: four chains at a time (d % 16 == 0)
    float32x4_t acc[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
    const float* v = r.v + r.lo * d + c;
    for (s = 0; s < n; ++s)
      for (int i = 0; i < 4; ++i) acc[i] = vfmaq_n_f32(acc[i], vld1q_f32(v + s * d + 4 * i), e[s]);
    for (int i = 0; i < 4; ++i) vst1q_f32(r.out + c + 4 * i, vdivq_f32(acc[i], vsum));
  }
}
#endif

}  // namespace

void Attend(Isa isa, const AttnRow* rows, int64_t count, int64_t d, float scale, std::vector<float>& e) {
#ifdef SPECEDGE_OPS_X86
  if (isa == Isa::kAvx512) return AttendAvx512(rows, count, d, scale, e);
  if (isa == Isa::kAvx2) return AttendAvx2(rows, count, d, scale, e);
#endif
  for (int64_t i = 0; i < count; ++i) {
#ifdef SPECEDGE_OPS_NEON
    if (isa == Isa::kNeonDot) {
      AttendNeon(rows[i], d, scale, e);
      continue;
    }
#endif
    AttendPortable(rows[i], d, scale, e);
  }
}

void RotateHalf(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

}  // namespace specedge_ops
