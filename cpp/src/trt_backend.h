// Native TensorRT backend (compiled only when CMake finds NvInfer.h and the CUDA runtime: SPECEDGE_WITH_TENSORRT).
// Mirrors specedge/runtime/backends/tensorrt_backend.py:
//
// * engines/<device-tag>/<role>.plan + <role>.plan.json from `specedge build-engines` are checked first (trt_plan.h):
//   a plan built for another GPU, SM or TensorRT version (getInferLibVersion()), for another graph of the bundle, or
//   missing, is refused with one sentence saying what to run. The plan's size and sha256 are checked before
//   TensorRT sees it (verify "full"; "size" skips the hash).
// * One IExecutionContext per optimization profile (T = 1, k + 1, prefill chunk; plan.json lists them), created
//   with kUSER_MANAGED memory and all sharing one scratch allocation (they never run concurrently: one stream).
//   A context is never switched between profiles, so each keeps its shapes, addresses and CUDA graph.
// * Device buffers allocated once with cudaMalloc (RAII): input_ids [B, T_max] and position [B] (int64), logits
//   [B, T_max, V] (float32), the zeroed KV arena [2L, B, H, S, D], a delta arena [2L, B, H, T_max, D] in delta
//   mode, the engine's extra outputs (argmax). Every I/O tensor is bound with setTensorAddress; in scatter mode
//   present_* share the address of past_* (TensorRT updates the cache in place); in delta mode
//   cudaMemcpy2DAsync writes every layer's new entries at `position` (one copy, or one per K/V tensor when
//   tensors are padded to TensorRT's 256-byte address alignment).
// * Inputs go from pinned host memory (cudaMallocHost) on a stream of our own (cudaStreamNonBlocking); logits of
//   batch row 0 come back to pinned memory; one cudaStreamSynchronize per step.
// * For each exact-shape profile a CUDA graph (input copies + enqueueV3) is captured after a plain warm-up enqueue
//   and replayed; a capture that fails turns graphs off with the reason on stderr (SPECEDGE_CUDA_GRAPHS=0 or
//   BackendOptions::cuda_graphs = false turns them off from the start).
// Every CUDA / TensorRT call is checked; failures are specedge::Error(SPECEDGE_ERR_BACKEND) with TensorRT's last
// error message when it logged one.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "manifest.h"

namespace specedge {

class TrtBackend : public Backend {
 public:
  TrtBackend(const Manifest& m, const ModelSpec& spec, const BackendOptions& opts);
  ~TrtBackend() override;
  TrtBackend(const TrtBackend&) = delete;
  TrtBackend& operator=(const TrtBackend&) = delete;

  const float* run(const int32_t* ids, int t, int position) override;
  // A graph exported with --tree: tree calls bind the caller's mask; chains bind the lower-triangular one.
  bool takes_trees() const override;
  const float* run_tree(const int32_t* ids, int t, int position, const uint8_t* mask) override;
  void keep_path(int position, const std::vector<int>& path) override;
  std::string name() const override { return "tensorrt"; }
  int max_call_tokens() const override;
  bool copy_kv_from(const Backend& other, int start, int end) override;
  // Backend::keep_features: each run() then copies the call's feature rows to the host too.
  bool keep_features() override;
  const float* features() const override;
  int feature_dim() const override;
  // Why CUDA graphs are off, when they are ("" otherwise).
  const std::string& graph_note() const;

 private:
  const float* call(const int32_t* ids, int t, int position, const uint8_t* mask);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace specedge
