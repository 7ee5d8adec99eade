// ai.specedge.MatMulQ41's arithmetic on every path (specedge_ops.cpp describes the op, its
// packed layout and the sum each output is). The AVX-512 VNNI, AVX2, NEON dot-product and
// portable paths compute the same bits, and a row's bits do not depend on how many rows a call
// has: ops/tests/ops_kernels_test.cpp checks both, on x86-64 and (under qemu) aarch64.
#include "q41_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "row_chunks.h"
#include "simd.h"

namespace specedge_ops {
namespace {

constexpr int64_t kQK = kQ41K;
constexpr int64_t kRows = kQ41Rows;
constexpr int64_t kBlock = kQ41Block;
constexpr int64_t kGroupsPerTask = 2;
constexpr int64_t kAhead = 8;  // blocks
using Activations = Q41Activations;
using Job = Q41Job;

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400) == 0);
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
      act.sum[r * nb + b] = SumLanesAvx512(_mm512_add_ps(x0, x1));  // PairwiseSum32's order
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
    // in a graph the weights come from far memory and the hardware prefetcher alone leaves the
    // loads behind: ask for a later block's 5 lines ahead of time (prefetches do not fault past
    // the end)
    for (int g = 0; g < G; ++g)
      for (int line = 0; line < 5; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(j.w + ((g0 + g) * j.nb + b + kAhead) * kBlock + 64 * line),
                     _MM_HINT_T0);
    for (int h = 0; h < 4; ++h) {
      __m512i wl[G], wh[G];
      for (int g = 0; g < G; ++g) {
        const __m512i v = _mm512_loadu_si512(j.w + ((g0 + g) * j.nb + b) * kBlock + 64 * h);
        wl[g] = _mm512_and_si512(v, lo);
        wh[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
      }
      // one row's two activation broadcasts at a time, used by every group: few live registers
      for (int r = 0; r < R; ++r) {
        const __m512i al = _mm512_broadcastd_epi32(_mm_loadu_si32(a4[r] + h));
        const __m512i ah = _mm512_broadcastd_epi32(_mm_loadu_si32(a4[r] + h + 4));
        for (int g = 0; g < G; ++g) {
          dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], wl[g], al);
          dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], wh[g], ah);
        }
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
        acc[r][g] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(j.act->scale[rb])), _mm512_cvtepi32_ps(dot[r][g]),
                                    acc[r][g]);
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

// Up to 6 rows x 2 groups: 24 accumulators, the unpacked weights and the nibble mask in 32
// registers (the activations come as embedded broadcasts), so a k = 4 verification call (T = 5)
// unpacks each weight block once.
template <int G>
SPECEDGE_AVX512 void GroupsAvx512(const Job& j, int64_t g0) {
  ForRowTiles<6>(j.rows, [&](auto rows, int64_t r) { TileAvx512<decltype(rows)::value, G>(j, g0, r); });
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
      alignas(32) float m8[8];
      _mm256_store_ps(m8, mx);
      float amax = 0.f;
      for (float f : m8) amax = std::fmax(amax, f);
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
      act.sum[r * nb + b] = SumLanesAvx2(_mm256_add_ps(xs[0], xs[2]), _mm256_add_ps(xs[1], xs[3]));  // PairwiseSum32
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
          a = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(j.act->scale[rb])), _mm256_cvtepi32_ps(dot[r][g][half]),
                              a);
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

// 2 rows x 2 groups x 2 halves: the 16 accumulators fill AVX2's 16 registers already.
template <int G>
SPECEDGE_AVX2 void GroupsAvx2(const Job& j, int64_t g0) {
  ForRowTiles<2>(j.rows, [&](auto rows, int64_t r) { TileAvx2<decltype(rows)::value, G>(j, g0, r); });
}

void TaskAvx2(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t g0 = static_cast<int64_t>(task) * kGroupsPerTask;
  if (j.n / kRows - g0 >= 2)
    GroupsAvx2<2>(j, g0);
  else
    GroupsAvx2<1>(j, g0);
}

#endif

#ifdef SPECEDGE_OPS_NEON
// QuantizeAvx512's arithmetic on 4 lanes (the same bits): max |a|, the pairwise block sum,
// codes rounded to nearest even.
void QuantizeNeon(const float* a, int64_t rows, int64_t k, Activations& act) {
  const int64_t nb = k / kQK;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = a + r * k + b * kQK;
      float32x4_t xs[8];
      for (int i = 0; i < 8; ++i) xs[i] = vld1q_f32(x + 4 * i);
      float32x4_t mx = vabsq_f32(xs[0]);
      for (int i = 1; i < 8; ++i) mx = vmaxq_f32(mx, vabsq_f32(xs[i]));
      const float amax = vmaxvq_f32(mx);
      // PairwiseSum32: lanes j + (j + 16), then halving 8, 4, 2, 1
      const float32x4_t t0 = vaddq_f32(vaddq_f32(xs[0], xs[4]), vaddq_f32(xs[2], xs[6]));
      const float32x4_t t1 = vaddq_f32(vaddq_f32(xs[1], xs[5]), vaddq_f32(xs[3], xs[7]));
      const float32x4_t u = vaddq_f32(t0, t1);
      const float32x2_t p = vadd_f32(vget_low_f32(u), vget_high_f32(u));
      const float sum = vget_lane_f32(p, 0) + vget_lane_f32(p, 1);
      const float scale = amax / 127.f, inv = scale != 0.f ? 1.f / scale : 0.f;
      int8_t* q = act.q.data() + r * k + b * kQK;
      int32x4_t qs = vdupq_n_s32(0);
      for (int i = 0; i < 8; i += 2) {
        const int32x4_t q0 = vcvtnq_s32_f32(vmulq_n_f32(xs[i], inv));  // nearest even
        const int32x4_t q1 = vcvtnq_s32_f32(vmulq_n_f32(xs[i + 1], inv));
        qs = vaddq_s32(qs, vaddq_s32(q0, q1));
        const int16x8_t q16 = vcombine_s16(vmovn_s32(q0), vmovn_s32(q1));  // |q| <= 127
        vst1_s8(q + 4 * i, vmovn_s16(q16));
      }
      act.qsum[r * nb + b] = vaddvq_s32(qs);
      act.scale[r * nb + b] = scale;
      act.sum[r * nb + b] = sum;
    }
}

// R activation rows x one group of 16 output rows (four lanes of 4): the integer dot with sdot
// (signed bytes: codes 0..15 fit), the float chain per block as TileAvx512's.
template <int R>
SPECEDGE_DOTPROD inline void TileNeon(const Job& j, int64_t g, int64_t r0) {
  const uint8x16_t lo = vdupq_n_u8(0x0F);
  float32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vdupq_n_f32(0.f);
  for (int64_t b = 0; b < j.nb; ++b) {
    const uint8_t* blk = j.w + (g * j.nb + b) * kBlock;
    const int32_t* a4[R];
    int32x4_t dot[R][4];
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * j.nb + b;
      a4[r] = reinterpret_cast<const int32_t*>(j.act->q.data() + rb * kQK);
      for (int c = 0; c < 4; ++c) dot[r][c] = vdupq_n_s32(-8 * j.act->qsum[rb]);
    }
    for (int h = 0; h < 4; ++h) {
      int8x16_t alo[R], ahi[R];
      for (int r = 0; r < R; ++r) {
        int32_t a_lo, a_hi;
        std::memcpy(&a_lo, a4[r] + h, 4);
        std::memcpy(&a_hi, a4[r] + h + 4, 4);
        alo[r] = vreinterpretq_s8_s32(vdupq_n_s32(a_lo));
        ahi[r] = vreinterpretq_s8_s32(vdupq_n_s32(a_hi));
      }
      for (int c = 0; c < 4; ++c) {  // output rows 4c .. 4c + 3
        const uint8x16_t v = vld1q_u8(blk + 64 * h + 16 * c);
        const int8x16_t wl = vreinterpretq_s8_u8(vandq_u8(v, lo));
        const int8x16_t wh = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        for (int r = 0; r < R; ++r) {
          dot[r][c] = vdotq_s32(dot[r][c], wl, alo[r]);
          dot[r][c] = vdotq_s32(dot[r][c], wh, ahi[r]);
        }
      }
    }
    for (int c = 0; c < 4; ++c) {
      const float32x4_t d =
          vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(blk + 256) + 4 * c)));
      const float32x4_t m =
          vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(blk + 288) + 4 * c)));
      const float32x4_t d8 = vmulq_n_f32(d, 8.f);
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (r0 + r) * j.nb + b;
        const float32x4_t s = vdupq_n_f32(j.act->sum[rb]);
        acc[r][c] = vfmaq_f32(acc[r][c], vmulq_n_f32(d, j.act->scale[rb]), vcvtq_f32_s32(dot[r][c]));
        acc[r][c] = vfmaq_f32(acc[r][c], m, s);
        acc[r][c] = vfmaq_f32(acc[r][c], d8, s);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) vst1q_f32(j.out + (r0 + r) * j.n + g * kRows + 4 * c, acc[r][c]);
}

SPECEDGE_DOTPROD void TaskNeon(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t g0 = static_cast<int64_t>(task) * kGroupsPerTask;
  const int64_t g1 = std::min(g0 + kGroupsPerTask, j.n / kRows);
  for (int64_t g = g0; g < g1; ++g)
    ForRowTiles<4>(j.rows, [&](auto rows, int64_t r) { TileNeon<decltype(rows)::value>(j, g, r); });
}
#endif

}  // namespace

void Q41Quantize(Isa isa, const float* a, int64_t rows, int64_t k, Q41Activations& act) {
  const int64_t nb = k / kQK;
  act.q.resize(rows * k);
  act.scale.resize(rows * nb);
  act.sum.resize(rows * nb);
  act.qsum.resize(rows * nb);
#ifdef SPECEDGE_OPS_X86
  if (isa == Isa::kAvx512) return QuantizeAvx512(a, rows, k, act);
  if (isa == Isa::kAvx2) return QuantizeAvx2(a, rows, k, act);
#endif
#ifdef SPECEDGE_OPS_NEON
  if (isa == Isa::kNeonDot) return QuantizeNeon(a, rows, k, act);
#endif
  QuantizePortable(a, rows, k, act);
}

size_t Q41Tasks(int64_t n) { return static_cast<size_t>((n / kRows + kGroupsPerTask - 1) / kGroupsPerTask); }

void Q41Task(void* job, size_t task) {
  switch (static_cast<const Job*>(job)->isa) {
#ifdef SPECEDGE_OPS_X86
    case Isa::kAvx512:
      return TaskAvx512(job, task);
    case Isa::kAvx2:
      return TaskAvx2(job, task);
#endif
#ifdef SPECEDGE_OPS_NEON
    case Isa::kNeonDot:
      return TaskNeon(job, task);
#endif
    default:
      return TaskPortable(job, task);
  }
}

}  // namespace specedge_ops
