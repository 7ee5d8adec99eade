// The pure logic of the native TensorRT backend, without TensorRT or CUDA headers, so that it is built and
// tested everywhere (mirrors specedge/engines/plan_json.py, profiles.py and runtime/backends/binding.py):
//
// * plan.json, written by `specedge build-engines` beside each `<role>.plan` in `engines/<device-tag>/`:
//   parsing and validation, and the refusals of a plan built for another GPU / SM / TensorRT version, for another
//   graph of the bundle, or missing — each one sentence ending with what to run;
// * optimization-profile selection for a call size T;
// * the graph contract's tensors mapped to the backend's buffers (input_ids, position, logits, the cache arena,
//   the delta arena, argmax), with byte offsets into the arenas (each tensor 256-byte aligned, as TensorRT wants);
// * the 2-D copies that write a delta arena into the cache arena at `position`.
//
// Plan problems (missing, stale, built elsewhere, malformed) are SPECEDGE_ERR_BUNDLE: the bundle lacks a usable
// engine for this device, which `specedge build-engines BUNDLE` fixes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "manifest.h"

namespace specedge {
namespace trt {

constexpr int kPlanSchemaVersion = 1;
constexpr const char* kEnginesDir = "engines";
constexpr const char* kArgmaxOutput = "argmax";  // optional extra output added by build-engines (TopK over logits)
// First TensorRT whose ONNX parser maps TensorScatter to an in-place KV-cache update (scatter-mode bundles).
constexpr int kScatterMinMajor = 10, kScatterMinMinor = 15;

struct Profile {
  std::string name;
  int t_min = 1, t_opt = 1, t_max = 1;
  bool exact() const { return t_min == t_max; }
  bool covers(int t) const { return t_min <= t && t <= t_max; }
};

struct PlanInfo {
  int schema_version = kPlanSchemaVersion;
  std::string role, plan_file, plan_sha256;
  int64_t plan_bytes = 0;
  std::string tensorrt_version, gpu_name, compute_capability, kv_mode, precision;
  int max_seq = 0, batch = 0;
  std::vector<Profile> profiles;
  std::string onnx_path, onnx_sha256;
  std::vector<std::string> extra_outputs;
  std::string created_by, created_at;
};

// ------------------------------------------------------------------ versions, devices

// "10.3.0.30" -> {10, 3, 0, 30}; trailing text ("10.15.1.post1") ends it. Empty when not a version.
std::vector<int> parse_version(const std::string& s);
// First n numbers joined with dots ("10.3.0.30", 2 -> "10.3").
std::string short_version(const std::string& s, int n = 2);
// Plans are tied to major.minor.patch; the build number does not matter.
bool same_trt_version(const std::string& a, const std::string& b);
// getInferLibVersion()'s integer -> "major.minor.patch": (major * 100 + minor) * 100 + patch since TensorRT 10
// (TensorRT < 10 used major * 1000 + minor * 100 + patch).
std::string trt_version_string(int64_t lib_version);
// Compute capability "8.7" (major, minor).
std::string cc_string(int major, int minor);
// "8.7" -> "sm_87".
std::string sm_name(const std::string& cc);
// Folder under engines/: slug of the GPU name + SM, e.g. "nvidia-h200-sm90".
std::string device_tag(const std::string& gpu_name, const std::string& cc);
// "NVIDIA H200 sm_90 with TensorRT 10.15" (three version numbers when two would not tell them apart).
std::string describe_target(const std::string& gpu_name, const std::string& cc, const std::string& trt_version,
                            const std::optional<std::string>& other_trt = std::nullopt);

// ------------------------------------------------------------------ plan.json

// Parse and validate plan.json text; `where` names the file in messages.
PlanInfo parse_plan_info(const std::string& json_text, const std::string& where);
// Read and parse a plan.json file (a missing or unreadable one is refused with what to run).
PlanInfo load_plan_info(const std::string& path);

// "engine built for X; this device is Y — rebuild with `specedge build-engines BUNDLE`"
std::string mismatch_message(const PlanInfo& info, const std::string& gpu_name, const std::string& cc,
                             const std::string& trt_version, const std::string& bundle);
// Refuses a plan built with another TensorRT version (major.minor.patch), for another SM or another GPU model.
void check_compatible(const PlanInfo& info, const std::string& gpu_name, const std::string& cc,
                      const std::string& trt_version, const std::string& bundle);
// The plan must come from this bundle's graph (role, kv mode, max_seq, batch, ONNX path and checksum).
void check_against_manifest(const PlanInfo& info, const Manifest& m, const ModelSpec& spec,
                            const std::string& onnx_path, const std::string& bundle);
// The message for a bundle without a plan for this device: a plan built for another device is named if there is
// one (engines/*/<role>.plan.json), else "build one with `specedge build-engines BUNDLE`".
std::string no_engine_message(const std::string& bundle_root, const std::string& role, const std::string& gpu_name,
                              const std::string& cc, const std::string& trt_version);
// Scatter-mode graphs need TensorRT >= 10.15 (in-place KV update); delta mode runs on any TensorRT 10.
void check_kv_mode_supported(const std::string& kv_mode, const std::string& trt_version);

// ------------------------------------------------------------------ profiles

// Index of the profile a call with T = t runs under: an exact one if any, else the first range covering t.
// Throws (SPECEDGE_ERR_INVALID_ARGUMENT) when none covers t.
int select_profile(const std::vector<Profile>& profiles, int t);

// ------------------------------------------------------------------ buffers and bindings

size_t dtype_bytes(const std::string& dtype);  // float32 4, float16/bfloat16 2, int64 8, int32 4, bool 1

// TensorRT wants every tensor address 256-byte aligned (IExecutionContext::setTensorAddress).
constexpr size_t kTensorAlign = 256;

// 2·L tensors of [B, kv_heads, seq, head_dim] in one allocation, tensor j = kind * L + layer (kind 0 = key,
// 1 = value), each starting on a multiple of `align` bytes. When no padding is needed (tensor_bytes() is a multiple
// of align) the arena is one matrix of 2·L·B·kv_heads rows of seq·head_dim elements.
struct KVLayout {
  int layers = 0, batch = 1, heads = 0, seq = 0, head_dim = 0;
  size_t itemsize = 0;
  size_t align = kTensorAlign;
  static KVLayout for_cache(const ModelSpec& spec, int max_seq, int batch);
  static KVLayout for_delta(const ModelSpec& spec, int t, int batch);
  size_t tensor_bytes() const { return size_t(batch) * size_t(heads) * size_t(seq) * size_t(head_dim) * itemsize; }
  size_t tensor_stride() const { return (tensor_bytes() + align - 1) / align * align; }  // tensor j at j * stride
  size_t total_bytes() const { return 2 * size_t(layers) * tensor_stride(); }
  size_t rows() const { return 2 * size_t(layers) * size_t(batch) * size_t(heads); }
  size_t rows_per_tensor() const { return size_t(batch) * size_t(heads); }
  size_t row_bytes() const { return size_t(seq) * size_t(head_dim) * itemsize; }
  bool dense() const { return tensor_stride() == tensor_bytes(); }
  size_t offset(int kind, int layer) const;  // byte offset of one tensor
};

enum class Buffer { InputIds, Position, TreeMask, Logits, Cache, Delta, Argmax };
const char* buffer_name(Buffer b);

struct TensorBinding {
  std::string name;
  bool input = false;
  Buffer buffer = Buffer::InputIds;
  size_t offset = 0;           // bytes into the buffer (the arenas); 0 otherwise
  std::vector<int64_t> shape;  // resolved for this T
  std::string dtype;
};

// Names of the graph contract (docs/design.md) for one model: inputs and outputs, in order (tree: the graph takes
// tree calls, the `tree_mask` input after `position`).
void expected_names(const ModelSpec& spec, const std::string& kv_mode, std::vector<std::string>* inputs,
                    std::vector<std::string>* outputs, bool tree = false);
// Every tensor of the contract for a call with T = t, mapped to its buffer. Scatter mode binds present_* to the
// very addresses of past_* (in-place update); delta mode binds new_* into the delta arena laid out for this T.
std::vector<TensorBinding> binding_plan(const ModelSpec& spec, const std::string& kv_mode, int max_seq, int t,
                                        int batch, bool argmax, bool tree = false);
// "" when an engine's I/O follows the contract, else the sentence (extra outputs are allowed: argmax, named
// hidden states; missing or extra inputs and missing outputs are not).
std::string check_graph_names(const std::string& role, const std::vector<std::string>& want_in,
                              const std::vector<std::string>& want_out, const std::vector<std::string>& got_in,
                              const std::vector<std::string>& got_out);

// Arguments of one cudaMemcpy2DAsync, offsets relative to the two arenas' base addresses.
struct Copy2D {
  size_t dst_offset = 0, dpitch = 0, src_offset = 0, spitch = 0, width = 0, height = 0;
};
// The 2-D copies that write the delta arena of a call (`delta`, laid out for its T) into the cache arena at
// `position`: one copy of all 2·L·B·kv_heads rows when both arenas are dense, else one per tensor (B·kv_heads rows
// each). Throws when the entries do not fit the cache or the layouts disagree.
std::vector<Copy2D> delta_copies(const KVLayout& cache, const KVLayout& delta, int position);
// The 2-D copies that copy slots [start, end) of every row between two arenas of the same layout (a self-draft
// taking the target's K/V): one copy when the arena is dense, else one per tensor; none when start == end.
std::vector<Copy2D> slot_copies(const KVLayout& cache, int start, int end);
// The 2-D copies, within one arena, that commit a tree's accepted path: for each (source, destination) of
// compaction_moves (offsets from `position`, issued in that order) one slot of every row (binding.py path_copies).
std::vector<Copy2D> path_copies(const KVLayout& cache, int position, const std::vector<std::pair<int, int>>& moves);

}  // namespace trt
}  // namespace specedge
