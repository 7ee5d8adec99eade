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

// How a session gets its intra-op threads. The first ONNX Runtime backend in the process creates
// ORT's (process-wide) environment with one global thread pool of its `threads`, spinning unless
// spinning was turned off; every later session asking for the same (threads, spinning) runs on
// that pool. A draft and a target on one pool take turns on the same hot threads, where two
// per-session pools would make each spin against the other (docs/design.md, Threads), so spinning
// stays on and a round costs no thread wake-ups. A session asking for something else gets its own
// pool, with spinning off when another session alternates with it (auto).
struct PoolKey {
  int threads = 0;
  bool spinning = true;
  bool operator==(const PoolKey& o) const { return threads == o.threads && spinning == o.spinning; }
};
struct SessionThreading {
  bool shared_pool = false;
  bool spinning = true;  // of the session's own pool (shared: the pool's)
};
// The pool the first backend creates for these options.
PoolKey pool_key_for(const BackendOptions& opts);
// `global` is the process's pool (the key of the first backend).
SessionThreading choose_threading(const BackendOptions& opts, const PoolKey& global);

// Which graph ort-cpu runs for `spec`: as Python's runtime/int4_kernel.choose. An int4 model with
// a specedge graph (custom_ops) and a MatMulNBits one takes the specedge graph where
// libspecedge_ops.so is found and has a fast path on this CPU, else the other with one note on
// stderr; $SPECEDGE_INT4_KERNEL=specedge|matmulnbits overrides. *why says why.
const GraphSpec& choose_int4_graph(const ModelSpec& spec, const std::string& backend, std::string* why);

class OrtBackend : public Backend {
 public:
  OrtBackend(const Manifest& m, const ModelSpec& spec, const BackendOptions& opts);
  ~OrtBackend() override;
  OrtBackend(const OrtBackend&) = delete;
  OrtBackend& operator=(const OrtBackend&) = delete;

  // Run `t` tokens at `position`; returns logits [t, vocab] (batch row 0), valid until the next run.
  const float* run(const int32_t* ids, int t, int position) override;
  std::string name() const override { return "ort-cpu"; }
  const SessionThreading& threading() const;
  bool copy_kv_from(const Backend& other, int start, int end) override;
  bool takes_trees() const override;
  const GraphSpec* graph() const override;
  const float* run_tree(const int32_t* ids, int t, int position, const uint8_t* mask) override;
  void keep_path(int position, const std::vector<int>& path) override;

  // A draft head's graph (kind "head", contract.head_graph_io): run `t` tokens over target
  // `features` [t, feature_dim] and/or the head's own `hidden` [t, hidden_size] of the step before
  // (nullptr: zeros); returns logits [t, draft vocab] and sets *hidden_out to [t, hidden_size],
  // both valid until the next run. A plain run() feeds whatever the buffers hold (timing only).
  const float* run_head(const int32_t* ids, int t, int position, const float* features, const float* hidden,
                        const float** hidden_out);
  // Backend::keep_features; until then the output is left to ONNX Runtime, as any extra output.
  bool keep_features() override;
  const float* features() const override;
  int feature_dim() const override;
  int hidden_size() const;  // a draft head's hidden_out width (0 for other graphs)

 private:
  const float* call(const int32_t* ids, int t, int position, const uint8_t* tree_mask);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace specedge
