// ai.specedge.MatMulQ80's arithmetic on every path (specedge_ops.cpp describes the op and the sum
// each output is). The AVX-512 VNNI, AVX2, NEON dot-product and portable paths compute the same
// bits, and a row's bits do not depend on how many rows a call has: ops/tests/ops_kernels_test.cpp
// checks both, on x86-64 and (under qemu) aarch64. As in MatMulQ41, each vector lane is one output
// row and a weight block is loaded once for all the rows of a tile.
#include "q80_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "row_chunks.h"
#include "simd.h"

namespace specedge_ops {
namespace {

constexpr int64_t kQK = kQ80K;
constexpr int64_t kRows = kQ80Rows;
constexpr int64_t kBlock = kQ80Block;
constexpr int64_t kGroupsPerTask = 2;
using Job = Q80Job;

const float* Scales(const uint8_t* blk) { return reinterpret_cast<const float*>(blk + 512); }

void TaskPortable(const Job& j, int64_t g0, int64_t g1) {
  const int64_t k = j.nb * kQK;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r = 0; r < j.rows; ++r) {
      float acc[kRows] = {};
      for (int64_t b = 0; b < j.nb; ++b) {
        const uint8_t* blk = j.w + (g * j.nb + b) * kBlock;
        const int8_t* a = j.act->q.data() + r * k + b * kQK;
        float sw[kRows];
        std::memcpy(sw, Scales(blk), sizeof sw);
        for (int64_t row = 0; row < kRows; ++row) {
          int32_t dot = 0;
          for (int i = 0; i < 8; ++i)
            for (int c = 0; c < 4; ++c) dot += (static_cast<int32_t>(blk[64 * i + 4 * row + c]) - 128) * a[4 * i + c];
          acc[row] = std::fma(sw[row] * j.act->scale[r * j.nb + b], static_cast<float>(dot), acc[row]);
        }
      }
      std::memcpy(j.out + r * j.n + g * kRows, acc, sizeof acc);
    }
}

#ifdef SPECEDGE_OPS_X86
#define SPECEDGE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")))

// R activation rows x G groups of 16 outputs: the integer dot seeded with -128 * the block's code
// sum (u - 128 = w), one vpdpbusd per 4 codes; a weight vector is loaded once for R rows.
template <int R, int G>
SPECEDGE_AVX512 void TileAvx512(const Job& j, int64_t g0, int64_t r0) {
  const int64_t k = j.nb * kQK;
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < j.nb; ++b) {
    const int32_t* a4[R];
    __m512i dot[R][G];
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * j.nb + b;
      a4[r] = reinterpret_cast<const int32_t*>(j.act->q.data() + (r0 + r) * k + b * kQK);
      const __m512i init = _mm512_set1_epi32(-128 * j.act->qsum[rb]);
      for (int g = 0; g < G; ++g) dot[r][g] = init;
    }
    for (int g = 0; g < G; ++g)  // as MatMulQ41's tile: a later block's 9 lines ahead of time
      for (int line = 0; line < 9; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(j.w + ((g0 + g) * j.nb + b + 4) * kBlock + 64 * line), _MM_HINT_T0);
    for (int i = 0; i < 8; ++i) {
      __m512i w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_si512(j.w + ((g0 + g) * j.nb + b) * kBlock + 64 * i);
      for (int r = 0; r < R; ++r) {
        const __m512i a = _mm512_set1_epi32(a4[r][i]);
        for (int g = 0; g < G; ++g) dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], w[g], a);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sw = _mm512_loadu_ps(Scales(j.w + ((g0 + g) * j.nb + b) * kBlock));
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_mul_ps(sw, _mm512_set1_ps(j.act->scale[(r0 + r) * j.nb + b]));
        acc[r][g] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(dot[r][g]), acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(j.out + (r0 + r) * j.n + (g0 + g) * kRows, acc[r][g]);
}

// Up to 6 rows x 2 groups: 12 integer and 12 float accumulators, 2 weight vectors.
template <int G>
SPECEDGE_AVX512 void GroupsAvx512(const Job& j, int64_t g0) {
  ForRowTiles<6>(j.rows, [&](auto rows, int64_t r) { TileAvx512<decltype(rows)::value, G>(j, g0, r); });
}

#define SPECEDGE_AVX2 __attribute__((target("avx2,fma")))

// TileAvx512's arithmetic with each group of 16 outputs as two halves of 8 lanes. Codes and
// activations are widened to 16 bits (u·a does not fit maddubs' saturating int16 pairs).
template <int R>
SPECEDGE_AVX2 void TileAvx2(const Job& j, int64_t g, int64_t r0) {
  const int64_t k = j.nb * kQK;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < j.nb; ++b) {
    const uint8_t* blk = j.w + (g * j.nb + b) * kBlock;
    for (int half = 0; half < 2; ++half) {
      __m256i sum[R];  // lanes in the order hadd leaves them: outputs 0, 1, 4, 5, 2, 3, 6, 7
      for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i) {
        const __m128i* p = reinterpret_cast<const __m128i*>(blk + 64 * i + 32 * half);
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p)), w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p + 1));
        for (int r = 0; r < R; ++r) {
          const int8_t* a = j.act->q.data() + (r0 + r) * k + b * kQK + 4 * i;
          const __m256i a16 = _mm256_setr_epi16(a[0], a[1], a[2], a[3], a[0], a[1], a[2], a[3], a[0], a[1], a[2], a[3],
                                                a[0], a[1], a[2], a[3]);
          sum[r] = _mm256_add_epi32(sum[r], _mm256_hadd_epi32(_mm256_madd_epi16(w0, a16), _mm256_madd_epi16(w1, a16)));
        }
      }
      const __m256 sw = _mm256_loadu_ps(Scales(blk) + 8 * half);
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (r0 + r) * j.nb + b;
        const __m256i dot =
            _mm256_sub_epi32(_mm256_permute4x64_epi64(sum[r], 0xD8), _mm256_set1_epi32(128 * j.act->qsum[rb]));
        const __m256 s = _mm256_mul_ps(sw, _mm256_set1_ps(j.act->scale[rb]));
        acc[r][half] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dot), acc[r][half]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int half = 0; half < 2; ++half) _mm256_storeu_ps(j.out + (r0 + r) * j.n + g * kRows + 8 * half, acc[r][half]);
}

SPECEDGE_AVX2 void GroupAvx2(const Job& j, int64_t g) {
  ForRowTiles<4>(j.rows, [&](auto rows, int64_t r) { TileAvx2<decltype(rows)::value>(j, g, r); });
}
#endif

#ifdef SPECEDGE_OPS_NEON
// R rows x one group (four lanes of 4 outputs): sdot on the codes' signed form, u ^ 0x80 = u - 128.
template <int R>
SPECEDGE_DOTPROD void TileNeon(const Job& j, int64_t g, int64_t r0) {
  const int64_t k = j.nb * kQK;
  const uint8x16_t flip = vdupq_n_u8(0x80);
  float32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vdupq_n_f32(0.f);
  for (int64_t b = 0; b < j.nb; ++b) {
    const uint8_t* blk = j.w + (g * j.nb + b) * kBlock;
    int32x4_t dot[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) dot[r][c] = vdupq_n_s32(0);
    for (int i = 0; i < 8; ++i) {
      int8x16_t a[R];
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, j.act->q.data() + (r0 + r) * k + b * kQK + 4 * i, 4);
        a[r] = vreinterpretq_s8_s32(vdupq_n_s32(quad));
      }
      for (int c = 0; c < 4; ++c) {  // outputs 4c .. 4c + 3
        const int8x16_t w = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(blk + 64 * i + 16 * c), flip));
        for (int r = 0; r < R; ++r) dot[r][c] = vdotq_s32(dot[r][c], w, a[r]);
      }
    }
    for (int c = 0; c < 4; ++c) {
      const float32x4_t sw = vld1q_f32(Scales(blk) + 4 * c);
      for (int r = 0; r < R; ++r)
        acc[r][c] = vfmaq_f32(acc[r][c], vmulq_n_f32(sw, j.act->scale[(r0 + r) * j.nb + b]), vcvtq_f32_s32(dot[r][c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) vst1q_f32(j.out + (r0 + r) * j.n + g * kRows + 4 * c, acc[r][c]);
}

SPECEDGE_DOTPROD void GroupNeon(const Job& j, int64_t g) {
  ForRowTiles<4>(j.rows, [&](auto rows, int64_t r) { TileNeon<decltype(rows)::value>(j, g, r); });
}
#endif

}  // namespace

std::vector<uint8_t> Q80Pack(const uint8_t* b, const float* scales, int64_t n, int64_t nb) {
  std::vector<uint8_t> out(n / kRows * nb * kBlock);
  for (int64_t g = 0; g < n / kRows; ++g)
    for (int64_t blk = 0; blk < nb; ++blk) {
      uint8_t* dst = out.data() + (g * nb + blk) * kBlock;
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t row = g * kRows + r;
        for (int i = 0; i < 8; ++i) std::memcpy(dst + 64 * i + 4 * r, b + (row * nb + blk) * kQK + 4 * i, 4);
        std::memcpy(dst + 512 + 4 * r, scales + row * nb + blk, 4);
      }
    }
  return out;
}

size_t Q80Tasks(int64_t n) { return static_cast<size_t>((n / kRows + kGroupsPerTask - 1) / kGroupsPerTask); }

void Q80Task(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  const int64_t g0 = static_cast<int64_t>(task) * kGroupsPerTask, g1 = std::min(g0 + kGroupsPerTask, j.n / kRows);
  switch (j.isa) {
#ifdef SPECEDGE_OPS_X86
    case Isa::kAvx512:
      return g1 - g0 == 2 ? GroupsAvx512<2>(j, g0) : GroupsAvx512<1>(j, g0);
    case Isa::kAvx2:
      for (int64_t g = g0; g < g1; ++g) GroupAvx2(j, g);
      return;
#endif
#ifdef SPECEDGE_OPS_NEON
    case Isa::kNeonDot:
      for (int64_t g = g0; g < g1; ++g) GroupNeon(j, g);
      return;
#endif
    default:
      return TaskPortable(j, g0, g1);
  }
}

}  // namespace specedge_ops
