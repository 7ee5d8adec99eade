// One model on an ONNX Runtime session with static, IO-bound buffers (mirrors
// specedge/runtime/backends/ort.py): a zeroed KV arena [2L, B, kv_heads, S, head_dim] allocated
// once; input_ids / position / logits buffers; one Ort::IoBinding per distinct T, kept. Scatter
// mode binds present_* to the very address of past_* (ONNX Runtime updates the cache in place);
// delta mode binds new_* to a delta arena and copies the new entries to slot `position`.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "manifest.h"

namespace specedge {

class OrtBackend : public Backend {
 public:
  OrtBackend(const Manifest& m, const ModelSpec& spec, const BackendOptions& opts);
  ~OrtBackend() override;
  OrtBackend(const OrtBackend&) = delete;
  OrtBackend& operator=(const OrtBackend&) = delete;

  // Run `t` tokens at `position`; returns logits [t, vocab] (batch row 0), valid until the next run.
  const float* run(const int32_t* ids, int t, int position) override;
  std::string name() const override { return "ort-cpu"; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace specedge
