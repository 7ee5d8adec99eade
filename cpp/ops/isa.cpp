#include "isa.h"

#include <cstdlib>
#include <string>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

namespace specedge_ops {

bool CpuHas(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return true;
#if defined(__x86_64__) || defined(_M_X64)
    case Isa::kAvx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vnni");
    case Isa::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
#if defined(__aarch64__) && defined(__linux__)
    case Isa::kNeonDot:
      return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__aarch64__) && defined(__APPLE__)
    case Isa::kNeonDot:
      return true;  // every Apple silicon core has the dot-product instructions
#endif
    default:
      return false;
  }
}

Isa ActiveIsa() {
  static const Isa isa = [] {
    Isa best = Isa::kPortable;
    for (Isa i : {Isa::kAvx512, Isa::kAvx2, Isa::kNeonDot})
      if (CpuHas(i)) {
        best = i;
        break;
      }
    const char* want = std::getenv("SPECEDGE_OPS_ISA");
    if (want && std::string(want) == "portable") return Isa::kPortable;
    if (want && std::string(want) == "avx2" && best == Isa::kAvx512) return Isa::kAvx2;
    return best;
  }();
  return isa;
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512vnni";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kNeonDot:
      return "neondot";
    default:
      return "portable";
  }
}

}  // namespace specedge_ops
