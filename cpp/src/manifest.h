// The bundle manifest (schema_version 1 or 2), read and validated like specedge/manifest.py does:
// schema version, types, sanity bounds on every number, paths inside the bundle, file sizes and
// sha256 checksums. Every failure is a specedge::Error(SPECEDGE_ERR_BUNDLE) with one sentence.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace specedge {

// Written by this version's export; 1 is read too (2 added the target's optional features output
// and the optional models.head entry, a trained draft head: drafters/head.h).
constexpr int kSchemaVersion = 2;
constexpr int kMinSchemaVersion = 1;
constexpr int kMaxSpecTokens = 16;

struct TensorSpec {
  std::string name, dtype;
  std::vector<int64_t> shape;  // -1 for the dynamic "T"
};

struct GraphSpec {
  std::string flavour, path;
  std::vector<std::string> backends, external_data;
  // the graph takes tree calls (input tree_mask, docs/design.md "Tree calls"); this runtime runs
  // chains on it, binding the lower-triangular mask
  bool tree = false;
  // custom-op libraries the graph needs loaded into its session; only "specedge_ops"
  // (libspecedge_ops.so beside libspecedge, or $SPECEDGE_OPS_LIB) is known
  std::vector<std::string> custom_ops;
  // every output row is computed the same whatever the call's T (specedge's own kernels): exact
  // speculation needs no padded single-token steps, once the engine has confirmed it on this machine
  bool batch_invariant = false;
};

struct ModelSpec {
  std::string role, kind, family, precision, kv_dtype;
  int num_layers = 0, num_kv_heads = 0, head_dim = 0, hidden_size = 0;
  int64_t vocab_size = 0, weight_bytes = 0;
  // `features`: the target graph also returns hidden states for a draft head (output
  // "hidden_states" [B, T, features_dim] of layers feature_layers); features_dim 0: none.
  std::vector<int> feature_layers;
  int features_dim = 0;
  // kind "head" (extra): the width of its `features` input, its draft->target id map file and the
  // fingerprint of the target it was trained for (manifest.py target_fingerprint).
  int feature_dim = 0;
  std::string draft_vocab_file, target_fingerprint;
  std::vector<GraphSpec> graphs;
  std::vector<TensorSpec> inputs, outputs;
  std::vector<int> ngram_sizes{3, 2, 1};  // kind "ngram": extra.ngram_sizes
  std::string self_draft_of;              // extra.self_draft_of: "target" for a self-draft
  bool is_model() const { return kind == "model"; }
  // The graph serving `backend` (its `backends` list), else the portable flavour.
  const GraphSpec& graph_for(const std::string& backend) const;
};

struct FileEntry {
  std::string sha256;
  int64_t bytes = 0;
};

struct Manifest {
  int schema_version = 0;
  std::string created_by;
  int max_seq = 0, batch = 1;
  std::string kv_mode;
  int spec_tokens = 0, prefill_chunk = 0;
  int64_t tokenizer_vocab_size = 0;
  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> bos_token_id;
  bool add_bos = false;
  std::vector<std::string> tokenizer_files;
  std::optional<std::string> chat_template;
  ModelSpec target, draft;
  bool has_head = false;  // models.head: a draft head (kind "head", in `head`)
  ModelSpec head;
  std::map<std::string, FileEntry> files;
  std::string root;  // bundle folder as given

  // Absolute path of `rel` inside the bundle; refuses anything that leaves it.
  std::string path(const std::string& rel) const;
};

// Parse a manifest from JSON text (no file checks). `root` is only recorded.
Manifest parse_manifest(const std::string& json_text, const std::string& root = "");
// verify: "full" (sizes + sha256), "size" or "none".
Manifest load_manifest(const std::string& bundle_dir, const std::string& verify = "full");
// The path `rel` names inside `root` (resolving links); throws when it would leave the bundle.
std::string resolve_inside(const std::string& root, const std::string& rel);
// One sha256 over the target's graph files' checksums (manifest.py target_fingerprint): what a
// draft head was trained on.
std::string target_fingerprint(const Manifest& m);

}  // namespace specedge
