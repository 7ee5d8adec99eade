// Batch-invariant target steps (mirrors specedge/runtime/invariant.py; docs/design.md
// "Batch-invariant target steps"): whether a target's single-token steps run as two tokens.
#pragma once
#include <string>

#include "backend.h"
#include "manifest.h"

namespace specedge {

// The default of invariant.py's wants_invariant_steps: on for int4/int8/fp16/bf16 targets.
bool wants_invariant_steps(const std::string& precision);
// The target's graph is marked batch_invariant and this machine's kernels confirm it (two calls).
bool batch_invariant_here(const GraphSpec& g, Backend& target);

}  // namespace specedge
