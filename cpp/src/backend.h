// The interface every model backend implements (ONNX Runtime CPU in ort_backend.cpp, native TensorRT in
// trt_backend.cpp), and the factory that picks one by name. The generation loop (engine.cpp) only calls run():
// `t` new tokens at cache slot `position` -> logits [t, vocab] for batch row 0. The backend owns the static KV
// cache of its model; rolling back is the caller's business (it just passes an earlier position next time).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "manifest.h"

namespace specedge {

// The target graph's optional output of tapped hidden states a draft head reads (contract.py FEATURES_OUTPUT).
inline constexpr const char* kFeaturesOutput = "hidden_states";

// The call size T host buffers are first sized for: a prefill chunk, or twice the largest verification
// call (k + 1 tokens), so no call of the speculative loop grows them mid-request (contract.py
// reserved_call_size).
inline int reserved_call_size(int prefill_chunk) {
  return prefill_chunk > 2 * (kMaxSpecTokens + 1) ? prefill_chunk : 2 * (kMaxSpecTokens + 1);
}

struct BackendOptions {
  std::string backend = "ort-cpu";  // "ort-cpu" or "tensorrt" ("auto" / "" are resolved by the engine)
  int threads = 0;                  // ONNX Runtime intra-op threads; 0 = its default
  int allow_spinning = -1;          // ONNX Runtime intra-op spinning: -1 auto, 0 off, 1 on
  bool alternating = false;         // another session of the same handle runs in turn (the draft)
  std::string verify = "full";      // TensorRT plan check: "full" (size + sha256), "size" or "none"
  int device_id = 0;                // CUDA device of the TensorRT backend
  bool cuda_graphs = true;          // TensorRT: capture one CUDA graph per exact-shape profile
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Run `t` tokens at `position`; returns logits [t, vocab] (batch row 0), valid until the next run.
  virtual const float* run(const int32_t* ids, int t, int position) = 0;
  int vocab_size() const { return vocab_; }
  int max_seq() const { return max_seq_; }
  const std::string& role() const { return role_; }
  virtual std::string name() const = 0;  // "ort-cpu", "tensorrt"
  // Overwrite cache slots [start, end) with `other`'s (a self-draft taking the target's K/V instead
  // of computing its own). False when it cannot (other backend type or cache geometry).
  virtual bool copy_kv_from(const Backend& /*other*/, int /*start*/, int /*end*/) { return false; }
  // The most tokens one run() accepts (TensorRT: the largest optimization profile).
  virtual int max_call_tokens() const { return 1 << 30; }
  // Tree calls (docs/design.md, "Tree calls"; tree.h): the graph takes a tree_mask input.
  virtual bool takes_trees() const { return false; }
  // The manifest graph this backend runs (an int4 model may have two: choose_int4_graph); null
  // when the backend does not say.
  virtual const GraphSpec* graph() const { return nullptr; }
  // Run a tree's t nodes at `position` with mask uint8 [t, t] (row i: i and its ancestors; checked);
  // logits [t, vocab]. Defaults refuse (tree.cpp), as Python's Backend.run_tree.
  virtual const float* run_tree(const int32_t* ids, int t, int position, const uint8_t* mask);
  // After a tree call at `position`: move the accepted path's K/V (node ids, root first) into
  // slots position..position+len-1 (tree.h compaction_moves).
  virtual void keep_path(int position, const std::vector<int>& path);
  // A target graph with a features output: from now on keep every slot's feature row (batch row 0) in host
  // memory, like the KV cache, for a head drafter (which runs on the CPU whatever device the target uses);
  // false when the graph returns none or the backend cannot. Off by default, so other drafters pay nothing.
  virtual bool keep_features() { return false; }
  virtual const float* features() const { return nullptr; }  // [max_seq, feature_dim]; nullptr unless kept
  virtual int feature_dim() const { return 0; }              // 0 unless keep_features()

 protected:
  Backend(const Manifest& m, const ModelSpec& spec)
      : vocab_(int(spec.vocab_size)), max_seq_(m.max_seq), role_(spec.role) {}
  // Refuses (SPECEDGE_ERR_INVALID_ARGUMENT) a run() of no tokens or one that does not fit max_seq.
  void check_call(int t, int position) const;
  // check_call, and the graph takes trees (SPECEDGE_ERR_BACKEND otherwise) and the mask marks every
  // node itself and only earlier nodes (tree.cpp).
  void check_tree_call(int t, int position, const uint8_t* mask) const;

 private:
  int vocab_, max_seq_;
  std::string role_;
};

// Whether this library was compiled with the native TensorRT backend.
bool tensorrt_compiled();
// The backend names this build accepts ("auto" included).
std::vector<std::string> backend_names();
// Refuses (SPECEDGE_ERR_INVALID_ARGUMENT, one sentence) a name this build does not have; "tensorrt" in a build
// without TensorRT says so and how to rebuild.
void check_backend_name(const std::string& name);
// "auto" / "" -> "ort-cpu"; other names checked and returned as they are.
std::string resolve_backend_name(const std::string& name);
std::unique_ptr<Backend> make_backend(const Manifest& m, const ModelSpec& spec, const BackendOptions& opts);

// The sentence for "tensorrt" in a build without it (also used by the tests). A function, not a global: the tests
// link the core both statically and through libspecedge, and a global would be defined twice.
const char* no_tensorrt_message();

}  // namespace specedge
