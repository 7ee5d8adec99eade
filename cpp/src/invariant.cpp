#include "invariant.h"

#include <cstdio>
#include <cstring>
#include <vector>

namespace specedge {

bool wants_invariant_steps(const std::string& precision) {
  return precision == "int4" || precision == "int8" || precision == "fp16" || precision == "bf16";
}

// A graph marked batch_invariant, confirmed on this machine: a T = 1 call gives row 0 of a T = 2
// call bit for bit (invariant.py rows_independent_of_t; slots 0 and 1 are overwritten by any
// prefill). The kernels a CPU dispatches to are only known at run time, hence the check.
bool batch_invariant_here(const GraphSpec& g, Backend& target) {
  if (!g.batch_invariant || target.max_seq() < 2) return false;
  const int32_t one = 0, two[2] = {0, 0};
  const size_t v = size_t(target.vocab_size());
  const float* single = target.run(&one, 1, 0);
  const std::vector<float> row(single, single + v);
  const float* pair = target.run(two, 2, 0);
  if (std::memcmp(row.data(), pair, v * sizeof(float)) == 0) return true;
  std::fprintf(stderr,
               "specedge: warning: the target graph is marked batch-invariant, but on this machine a "
               "single-token call's row differs from a verification row: single-token steps run as 2 tokens\n");
  return false;
}

}  // namespace specedge
