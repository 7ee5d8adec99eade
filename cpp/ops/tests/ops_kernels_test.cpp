// Standalone test of libspecedge_ops' kernel cores (q41_kernel, q80_kernel, gqa_kernel), without
// ONNX Runtime, so that it builds for x86-64 and aarch64 alike. On every path this CPU has it checks that
//   - MatMulQ41 and MatMulQ80 row i of a T-row call has the bits of row i computed alone,
//     T = 1..17 (batch invariance: exact speculation needs it), and
//   - every path gives the portable path's bits (MatMulQ41, MatMulQ80 and attention),
// then prints a hash of the outputs: the same inputs (made here from integers, so identical on
// every machine) must give the same hash on every architecture (tests/test_ops_aarch64.py runs
// the aarch64 build under qemu and compares). Exit 1 with one line per mismatch.
//
//   ops_kernels_test            the checks and the hashes
//   ops_kernels_test --bench    also time MatMulQ41 and MatMulQ80 at T = 1..5 and attention per path
//                              (one thread, CPU time)
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "../gqa_kernel.h"
#include "../q41_kernel.h"
#include "../q80_kernel.h"

using namespace specedge_ops;

namespace {

struct Rng {
  uint64_t s;
  uint64_t Next() {  // splitmix64
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // a float in [-2, 2) on a 2^-22 grid: exact on every machine
  float Float() { return static_cast<float>(static_cast<int32_t>(Next() >> 40) - (1 << 23)) / 4194304.f; }
  // an fp16 with the given sign and a biased exponent in [lo, hi]
  uint16_t Half(bool negative, int lo, int hi) {
    const uint64_t x = Next();
    const int exp = lo + static_cast<int>(x % static_cast<uint64_t>(hi - lo + 1));
    return static_cast<uint16_t>((negative ? 0x8000 : 0) | exp << 10 | ((x >> 20) & 0x3FF));
  }
};

struct Hash {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  void Add(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
};

int failures = 0;
void Fail(const std::string& what) {
  std::printf("MISMATCH %s\n", what.c_str());
  ++failures;
}

bool SameBits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

std::vector<Isa> Paths() {
  std::vector<Isa> out;
  for (Isa i : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kNeonDot})
    if (CpuHas(i)) out.push_back(i);
  return out;
}

// Weights [n/16, k/32, 320] in the packed layout: random code bytes, fp16 d > 0 and m < 0; block 0
// of group 0 all zero (d = m = 0).
std::vector<uint8_t> RandomWeights(Rng& rng, int64_t n, int64_t k) {
  const int64_t groups = n / kQ41Rows, nb = k / kQ41K;
  std::vector<uint8_t> w(groups * nb * kQ41Block);
  for (int64_t gb = 0; gb < groups * nb; ++gb) {
    uint8_t* blk = w.data() + gb * kQ41Block;
    for (int i = 0; i < 256; ++i) blk[i] = static_cast<uint8_t>(rng.Next() >> 56);
    for (int r = 0; r < 16; ++r) {
      const uint16_t d = gb == 0 ? 0 : rng.Half(false, 6, 9), m = gb == 0 ? 0 : rng.Half(true, 5, 12);
      std::memcpy(blk + 256 + 2 * r, &d, 2);
      std::memcpy(blk + 288 + 2 * r, &m, 2);
    }
  }
  return w;
}

// A [rows, k]: blocks of mixed magnitude, and one all-zero block (scale 0).
std::vector<float> RandomActivations(Rng& rng, int64_t rows, int64_t k) {
  std::vector<float> a(rows * k);
  for (int64_t i = 0; i < rows * k; ++i) a[i] = rng.Float() * static_cast<float>(1 << (i / kQ41K % 5));
  for (int64_t j = 0; j < kQ41K && rows > 2; ++j) a[2 * k + j] = 0.f;
  return a;
}

std::vector<float> MatMul(Isa isa, const std::vector<uint8_t>& w, const float* a, int64_t rows, int64_t n, int64_t k) {
  Q41Activations act;
  Q41Quantize(isa, a, rows, k, act);
  std::vector<float> y(rows * n, std::nanf(""));
  Q41Job job{w.data(), &act, y.data(), rows, n, k / kQ41K, isa};
  const size_t tasks = Q41Tasks(n);
  for (size_t t = tasks; t-- > 0;) Q41Task(&job, t);  // any order: tasks write disjoint columns
  return y;
}

uint64_t CheckQ41(const std::vector<Isa>& paths) {
  constexpr int64_t kN = 80, kK = 576, kMaxT = 17;  // 5 groups: a task with one group too
  Rng rng{37};
  const std::vector<uint8_t> w = RandomWeights(rng, kN, kK);
  const std::vector<float> a = RandomActivations(rng, kMaxT, kK);
  std::vector<std::vector<float>> portable_single(kMaxT);
  Hash hash;
  for (Isa isa : paths) {
    const std::string name = IsaName(isa);
    std::vector<std::vector<float>> single(kMaxT);
    for (int64_t i = 0; i < kMaxT; ++i) {
      single[i] = MatMul(isa, w, a.data() + i * kK, 1, kN, kK);
      if (isa == Isa::kPortable) {
        portable_single[i] = single[i];
        hash.Add(single[i].data(), kN * sizeof(float));
      } else if (!SameBits(single[i].data(), portable_single[i].data(), kN)) {
        Fail("q41 " + name + " row " + std::to_string(i) + " differs from portable");
      }
    }
    for (int64_t t = 1; t <= kMaxT; ++t) {
      const std::vector<float> y = MatMul(isa, w, a.data(), t, kN, kK);
      for (int64_t i = 0; i < t; ++i)
        if (!SameBits(y.data() + i * kN, single[i].data(), kN))
          Fail("q41 " + name + " T=" + std::to_string(t) + " row " + std::to_string(i) + " differs from T=1");
    }
  }
  return hash.h;
}

std::vector<float> MatMulQ80(Isa isa, const std::vector<uint8_t>& packed, const float* a, int64_t rows, int64_t n,
                             int64_t k) {
  Q41Activations act;
  Q41Quantize(isa, a, rows, k, act);
  std::vector<float> y(rows * n, std::nanf(""));
  Q80Job job{packed.data(), &act, y.data(), rows, n, k / kQ80K, isa};
  for (size_t t = Q80Tasks(n); t-- > 0;) Q80Task(&job, t);
  return y;
}

// MatMulNBits' 8-bit weights (codes 0..255, 0 included: -128; scales of both signs), packed.
std::vector<uint8_t> RandomQ80(Rng& rng, int64_t n, int64_t k) {
  std::vector<uint8_t> w(n * k);
  std::vector<float> ws(n * k / kQ80K);
  for (uint8_t& x : w) x = static_cast<uint8_t>(rng.Next() >> 56);
  for (float& x : ws) x = rng.Float() / 64.f;
  return Q80Pack(w.data(), ws.data(), n, k / kQ80K);
}

uint64_t CheckQ80(const std::vector<Isa>& paths) {
  Hash hash;
  // N = 80: 5 groups, a task with one group too
  for (int64_t k : {576, 96}) {
    constexpr int64_t kN = 80, kMaxT = 17;
    Rng rng{static_cast<uint64_t>(80 + k)};
    const std::vector<uint8_t> w = RandomQ80(rng, kN, k);
    const std::vector<float> a = RandomActivations(rng, kMaxT, k);
    std::vector<std::vector<float>> portable_single(kMaxT);
    for (Isa isa : paths) {
      const std::string name = std::string("q80 ") + IsaName(isa) + " K=" + std::to_string(k);
      std::vector<std::vector<float>> single(kMaxT);
      for (int64_t i = 0; i < kMaxT; ++i) {
        single[i] = MatMulQ80(isa, w, a.data() + i * k, 1, kN, k);
        if (isa == Isa::kPortable) {
          portable_single[i] = single[i];
          hash.Add(single[i].data(), kN * sizeof(float));
        } else if (!SameBits(single[i].data(), portable_single[i].data(), kN)) {
          Fail(name + " row " + std::to_string(i) + " differs from portable");
        }
      }
      for (int64_t t = 1; t <= kMaxT; ++t) {
        const std::vector<float> y = MatMulQ80(isa, w, a.data(), t, kN, k);
        for (int64_t i = 0; i < t; ++i)
          if (!SameBits(y.data() + i * kN, single[i].data(), kN))
            Fail(name + " T=" + std::to_string(t) + " row " + std::to_string(i) + " differs from T=1");
      }
    }
  }
  return hash.h;
}

uint64_t CheckAttention(const std::vector<Isa>& paths) {
  constexpr int64_t kD = 64, kS = 40;
  Rng rng{1337};
  std::vector<float> kc(kS * kD), vc(kS * kD), bias(kS), q(kD), cs(kD / 2), sn(kD / 2);
  for (float& x : kc) x = rng.Float();
  for (float& x : vc) x = rng.Float();
  for (float& x : q) x = rng.Float();
  for (int64_t s = 0; s < kS; ++s) bias[s] = s % 7 == 3 ? -INFINITY : rng.Float();
  for (float& x : cs) x = rng.Float() / 2;
  for (float& x : sn) x = rng.Float() / 2;
  RotateHalf(q.data(), cs.data(), sn.data(), kD / 2);  // scalar everywhere: its bits are hashed too
  Hash hash;
  hash.Add(q.data(), kD * sizeof(float));
  std::vector<float> e;
  std::vector<std::vector<float>> portable;
  int idx = 0;
  for (int64_t hi = 0; hi < kS; ++hi)
    for (int variant = 0; variant < 3; ++variant, ++idx) {  // all keys; a window of 9; with the bias
      const int64_t lo = variant == 1 ? std::max<int64_t>(0, hi - 8) : 0;
      for (Isa isa : paths) {
        std::vector<float> out(kD);
        const float scale = 0.125f * static_cast<float>(1 + variant);  // large scores: exp's floor is hit
        const AttnRow row{q.data(), kc.data(), vc.data(), variant == 2 ? bias.data() : nullptr, out.data(), lo, hi};
        Attend(isa, &row, 1, kD, scale, e);
        if (isa == Isa::kPortable) {
          portable.push_back(out);
          hash.Add(out.data(), kD * sizeof(float));
        } else if (!SameBits(out.data(), portable[idx].data(), kD)) {
          Fail(std::string("attention ") + IsaName(isa) + " keys " + std::to_string(lo) + ".." + std::to_string(hi) +
               " variant " + std::to_string(variant) + " differs from portable");
        }
      }
    }
  return hash.h;
}

// Attention over a group of rows sharing keys (count 1..17: the heads of one kv head at a query
// row, which a path may take together) gives each row the bits it has alone, for head sizes with
// and without a remainder past four registers, with and without the bias.
void CheckAttentionRows(const std::vector<Isa>& paths) {
  constexpr int64_t kS = 40, kMaxRows = 17;
  Rng rng{4242};
  for (int64_t d : {16, 64, 80})
    for (int64_t hi : {4, 16, 39})
      for (int with_bias = 0; with_bias < 2; ++with_bias) {
        std::vector<float> kc(kS * d), vc(kS * d), bias(kS), q(kMaxRows * d);
        for (float& x : kc) x = rng.Float();
        for (float& x : vc) x = rng.Float();
        for (float& x : q) x = rng.Float();
        for (int64_t s = 0; s < kS; ++s) bias[s] = s % 5 == 1 ? -INFINITY : rng.Float();
        for (Isa isa : paths) {
          std::vector<float> e, single(kMaxRows * d), grouped(kMaxRows * d);
          auto row = [&](int64_t i, std::vector<float>& out) {
            return AttnRow{q.data() + i * d,   kc.data(), vc.data(), with_bias ? bias.data() : nullptr,
                           out.data() + i * d, hi / 3,    hi};
          };
          for (int64_t i = 0; i < kMaxRows; ++i) {
            const AttnRow one = row(i, single);
            Attend(isa, &one, 1, d, 0.25f, e);
          }
          for (int64_t count = 1; count <= kMaxRows; ++count) {
            std::vector<AttnRow> rows;
            for (int64_t i = 0; i < count; ++i) rows.push_back(row(i, grouped));
            Attend(isa, rows.data(), count, d, 0.25f, e);
            for (int64_t i = 0; i < count; ++i)
              if (!SameBits(grouped.data() + i * d, single.data() + i * d, d))
                Fail(std::string("attention ") + IsaName(isa) + " D=" + std::to_string(d) + " keys ..." +
                     std::to_string(hi) + (with_bias ? " bias" : "") + ": row " + std::to_string(i) + " of " +
                     std::to_string(count) + " differs from the row alone");
          }
        }
      }
}

double CpuMs() {  // this thread's CPU time: a busy machine's other processes do not count
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return 1e3 * static_cast<double>(ts.tv_sec) + 1e-6 * static_cast<double>(ts.tv_nsec);
}

void Bench(const std::vector<Isa>& paths) {
  // one decoder layer's Q41 weights of the default model (q|k|v, o, gate|up, down), K = 576 or 1536
  struct Shape {
    int64_t n, k;
  };
  const Shape shapes[] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  Rng rng{5};
  std::vector<std::vector<uint8_t>> ws;
  for (int layer = 0; layer < 8; ++layer)  // 8 layers, ~17 MB: past the caches
    for (const Shape& s : shapes) ws.push_back(RandomWeights(rng, s.n, s.k));
  const std::vector<float> a = RandomActivations(rng, 5, 1536);
  for (Isa isa : paths) {
    double ms[5];
    int i = 0;
    for (int64_t t : {1, 2, 3, 4, 5}) {
      std::vector<double> reps;
      for (int rep = 0; rep < 15; ++rep) {
        const double t0 = CpuMs();
        for (size_t m = 0; m < ws.size(); ++m) {
          const Shape& s = shapes[m % 4];
          MatMul(isa, ws[m], a.data(), t, s.n, s.k);
        }
        reps.push_back(CpuMs() - t0);
      }
      ms[i++] = *std::min_element(reps.begin(), reps.end());  // the least disturbed by other processes
    }
    std::printf("bench %-10s T1 %.3f T2 %.3f T3 %.3f T4 %.3f T5 %.3f ms  T5/T1 %.2f\n", IsaName(isa), ms[0], ms[1],
                ms[2], ms[3], ms[4], ms[4] / ms[0]);
  }
  // the default model's lm_head (its tied Q8_0 embedding, 49152 x 576)
  {
    constexpr int64_t kN = 49152, kK = 576;
    const std::vector<uint8_t> w = RandomQ80(rng, kN, kK);
    const std::vector<float> a8 = RandomActivations(rng, 5, kK);
    for (Isa isa : paths) {
      if (isa == Isa::kPortable) continue;  // minutes, and says nothing about the vector paths
      double ms[5];
      for (int64_t t = 1; t <= 5; ++t) {
        double best = 1e30;
        for (int rep = 0; rep < 9; ++rep) {
          const double t0 = CpuMs();
          MatMulQ80(isa, w, a8.data(), t, kN, kK);
          best = std::min(best, CpuMs() - t0);
        }
        ms[t - 1] = best;
      }
      std::printf("bench %-10s q80 lm_head T1 %.3f T2 %.3f T3 %.3f T4 %.3f T5 %.3f ms  T5/T1 %.2f\n", IsaName(isa),
                  ms[0], ms[1], ms[2], ms[3], ms[4], ms[4] / ms[0]);
    }
  }
  // attention: the default model's 9 heads of 64 over 105 keys, 30 layers (one T = 1 step's rows)
  constexpr int64_t kD = 64, kKeys = 105;
  std::vector<float> kv(2 * kKeys * kD), q(kD), out(kD), e;
  for (float& x : kv) x = rng.Float();
  for (float& x : q) x = rng.Float();
  for (Isa isa : paths) {
    double best = 1e30;
    for (int rep = 0; rep < 15; ++rep) {
      const double t0 = CpuMs();
      for (int group = 0; group < 3 * 30; ++group) {  // the 3 heads of each of the 3 kv heads together, as the op
        const AttnRow one{q.data(), kv.data(), kv.data() + kKeys * kD, nullptr, out.data(), 0, kKeys - 1};
        const AttnRow rows[3] = {one, one, one};
        Attend(isa, rows, 3, kD, 0.125f, e);
      }
      best = std::min(best, CpuMs() - t0);
    }
    std::printf("bench %-10s attention, 270 rows in groups of 3: %.3f ms\n", IsaName(isa), best);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<Isa> paths = Paths();
  std::printf("paths");
  for (Isa isa : paths) std::printf(" %s", IsaName(isa));
  std::printf("\n");
  std::printf("q41 %016" PRIx64 "\n", CheckQ41(paths));
  std::printf("q80 %016" PRIx64 "\n", CheckQ80(paths));
  std::printf("attention %016" PRIx64 "\n", CheckAttention(paths));
  CheckAttentionRows(paths);
  if (argc > 1 && std::string(argv[1]) == "--bench") Bench(paths);
  if (failures) std::printf("%d mismatches\n", failures);
  return failures ? 1 : 0;
}
