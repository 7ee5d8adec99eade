#include "manifest.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "error.h"
#include "sha256.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace specedge {
namespace {

constexpr int64_t kMaxLayers = 512, kMaxHeads = 1024, kMaxHeadDim = 1024, kMaxVocab = 4000000,
                  kMaxMaxSeq = int64_t(1) << 20;
constexpr uintmax_t kMaxManifestBytes = uintmax_t(64) << 20;  // real manifests are a few KB (as in Python)

const char* type_name(json::value_t t) {
  switch (t) {
    case json::value_t::string:
      return "str";
    case json::value_t::object:
      return "dict";
    case json::value_t::array:
      return "list";
    case json::value_t::boolean:
      return "bool";
    default:
      return "int";
  }
}

const json& req(const json& d, const std::string& key, json::value_t typ, const std::string& where) {
  if (!d.is_object() || !d.contains(key)) fail_bundle("the manifest lacks '" + key + "' in " + where);
  const json& v = d.at(key);
  bool ok;
  if (typ == json::value_t::number_integer)
    ok = v.is_number_integer();  // booleans are not numbers in nlohmann::json
  else
    ok = v.type() == typ;
  if (!ok) {
    if (typ == json::value_t::number_integer)
      fail_bundle("the manifest's '" + key + "' in " + where + " must be an integer");
    fail_bundle("the manifest's '" + key + "' in " + where + " must be of type " + type_name(typ));
  }
  return v;
}

int64_t req_int(const json& d, const std::string& key, const std::string& where) {
  const json& v = req(d, key, json::value_t::number_integer, where);
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    fail_bundle("the manifest's '" + key + "' in " + where + " is out of range");
  return v.get<int64_t>();
}

std::string req_str(const json& d, const std::string& key, const std::string& where) {
  return req(d, key, json::value_t::string, where).get<std::string>();
}

int64_t bounded(int64_t v, int64_t lo, int64_t hi, const std::string& what) {
  if (v < lo || v > hi)
    fail_bundle("the manifest's " + what + " is " + std::to_string(v) + ", outside " + std::to_string(lo) + ".." +
                std::to_string(hi));
  return v;
}

int64_t opt_int(const json& d, const std::string& key) {
  if (d.contains(key) && d.at(key).is_number_integer()) return d.at(key).get<int64_t>();
  return 0;
}

TensorSpec tensor(const json& d, const std::string& where) {
  TensorSpec t;
  t.name = req_str(d, "name", where);
  t.dtype = req_str(d, "dtype", where);
  for (const json& s : req(d, "shape", json::value_t::array, where)) {
    if (s.is_string() && s.get<std::string>() == "T") {
      t.shape.push_back(-1);
    } else if (s.is_number_integer() && s.get<int64_t>() > 0 && s.get<int64_t>() <= kMaxMaxSeq * 4) {
      t.shape.push_back(s.get<int64_t>());
    } else {
      fail_bundle("the manifest gives tensor '" + t.name + "' an invalid dimension " + s.dump());
    }
  }
  return t;
}

const char* kPrecisions[] = {"fp32", "fp16", "bf16", "int8", "int4"};
const char* kKvDtypes[] = {"float32", "float16", "bfloat16", "int64", "int32"};

template <size_t N>
bool one_of(const std::string& s, const char* (&arr)[N]) {
  for (const char* a : arr)
    if (s == a) return true;
  return false;
}

// The optional `features` object of a model entry: tapped layers and the output width (manifest.py _features).
void features(const json& d, const std::string& where, ModelSpec& m) {
  if (!d.contains("features") || d.at("features").is_null()) return;
  const json& f = d.at("features");
  if (!f.is_object()) fail_bundle("the manifest's 'features' in " + where + " must be an object");
  const json& layers = req(f, "layers", json::value_t::array, where + ".features");
  bool ok = !layers.empty();
  for (const json& i : layers)
    ok = ok && i.is_number_integer() && i.get<int64_t>() >= 0 && i.get<int64_t>() < m.num_layers;
  if (!ok) fail_bundle("the manifest's features.layers in " + where + " must list layers of the model");
  for (const json& i : layers) m.feature_layers.push_back(int(i.get<int64_t>()));
  m.features_dim = int(bounded(req_int(f, "dim", where + ".features"), 1,
                               kMaxHeads * kMaxHeadDim * int64_t(layers.size()), where + " features.dim"));
}

// A draft head's `extra`: the width of its features input, its vocabulary map file and the
// fingerprint of the target it was trained for (checked in load_manifest, like manifest.py).
void head_extra(const json& d, ModelSpec& m) {
  const json extra = d.contains("extra") && d.at("extra").is_object() ? d.at("extra") : json::object();
  if (!extra.contains("feature_dim") || !extra["feature_dim"].is_number_integer() ||
      extra["feature_dim"].get<int64_t>() < 1 ||
      extra["feature_dim"].get<int64_t>() > kMaxHeads * kMaxHeadDim * kMaxLayers)
    fail_bundle("the manifest's draft head has no valid extra.feature_dim");
  m.feature_dim = int(extra["feature_dim"].get<int64_t>());
  if (m.hidden_size < 1) fail_bundle("the manifest's draft head has no hidden_size");
  if (extra.contains("draft_vocab_file") && extra["draft_vocab_file"].is_string())
    m.draft_vocab_file = extra["draft_vocab_file"].get<std::string>();
  if (extra.contains("target_fingerprint") && extra["target_fingerprint"].is_string())
    m.target_fingerprint = extra["target_fingerprint"].get<std::string>();
}

ModelSpec model(const json& d, const std::string& role) {
  std::string where = "models." + role;
  ModelSpec m;
  m.role = role;
  m.kind = req_str(d, "kind", where);
  if (m.kind == "ngram") {
    if (role != "draft") fail_bundle("the manifest's " + role + " model cannot be of kind 'ngram'");
    if (d.contains("extra") && d["extra"].is_object() && d["extra"].contains("ngram_sizes")) {
      const json& ns = d["extra"]["ngram_sizes"];
      std::vector<int> sizes;
      if (!ns.is_array() || ns.empty()) fail_bundle("the manifest's draft extra.ngram_sizes must be a list of sizes");
      for (const json& n : ns) {
        if (!n.is_number_integer() || n.get<int64_t>() < 1 || n.get<int64_t>() > 64)
          fail_bundle("the manifest's draft extra.ngram_sizes must be a list of sizes in 1..64");
        sizes.push_back(int(n.get<int64_t>()));
      }
      m.ngram_sizes = sizes;
    }
    return m;
  }
  // free-form like the rest of `extra` (the Python loader only compares it with "target")
  if (d.contains("extra") && d["extra"].is_object() && d["extra"].contains("self_draft_of") &&
      d["extra"]["self_draft_of"].is_string())
    m.self_draft_of = d["extra"]["self_draft_of"].get<std::string>();
  if (m.kind != (role == "head" ? "head" : "model"))
    fail_bundle("the manifest's " + role + " model has unknown kind '" + m.kind + "'");
  m.precision = req_str(d, "precision", where);
  if (!one_of(m.precision, kPrecisions))
    fail_bundle("the manifest's " + role + " precision '" + m.precision +
                "' is not one of fp32, fp16, bf16, int8, int4");
  m.family = req_str(d, "family", where);
  m.kv_dtype = req_str(d, "kv_dtype", where);
  m.num_layers = int(bounded(req_int(d, "num_layers", where), 1, kMaxLayers, role + " num_layers"));
  m.num_kv_heads = int(bounded(req_int(d, "num_kv_heads", where), 1, kMaxHeads, role + " num_kv_heads"));
  m.head_dim = int(bounded(req_int(d, "head_dim", where), 1, kMaxHeadDim, role + " head_dim"));
  m.vocab_size = bounded(req_int(d, "vocab_size", where), 2, kMaxVocab, role + " vocab_size");
  m.weight_bytes = opt_int(d, "weight_bytes");
  m.hidden_size = int(std::clamp<int64_t>(opt_int(d, "hidden_size"), 0, kMaxHeads * kMaxHeadDim));
  for (const json& t : req(d, "inputs", json::value_t::array, where)) m.inputs.push_back(tensor(t, where + ".inputs"));
  for (const json& t : req(d, "outputs", json::value_t::array, where))
    m.outputs.push_back(tensor(t, where + ".outputs"));
  if (!one_of(m.kv_dtype, kKvDtypes))
    fail_bundle("the manifest's " + role + " kv_dtype '" + m.kv_dtype + "' is not supported");
  features(d, where, m);
  if (role == "head") head_extra(d, m);
  const json& graphs = req(d, "graphs", json::value_t::array, where);
  if (graphs.empty()) fail_bundle("the manifest's " + role + " model lists no graph");
  for (const json& g : graphs) {
    GraphSpec gs;
    gs.flavour = req_str(g, "flavour", where + ".graphs");
    gs.path = req_str(g, "path", where + ".graphs");
    for (const json& b : req(g, "backends", json::value_t::array, where + ".graphs"))
      gs.backends.push_back(b.is_string() ? b.get<std::string>() : b.dump());
    if (g.contains("external_data")) {
      if (!g["external_data"].is_array())
        fail_bundle("the manifest's external_data in " + where + ".graphs must be a list");
      for (const json& x : g["external_data"]) {
        if (!x.is_string()) fail_bundle("the manifest names an empty or non-text file path: " + x.dump());
        gs.external_data.push_back(x.get<std::string>());
      }
    }
    for (auto [name, flag] :
         {std::pair<const char*, bool*>{"tree", &gs.tree}, {"batch_invariant", &gs.batch_invariant}}) {
      if (!g.contains(name)) continue;
      if (!g[name].is_boolean())
        fail_bundle(std::string("the manifest's '") + name + "' in " + where + ".graphs must be true or false, got " +
                    g[name].dump());
      *flag = g[name].get<bool>();
    }
    if (g.contains("custom_ops")) {
      const json& ops = g["custom_ops"];
      if (!ops.is_array())
        fail_bundle("the manifest's 'custom_ops' in " + where + ".graphs must be a list of library names, got " +
                    ops.dump());
      for (const json& x : ops) {
        if (!x.is_string())
          fail_bundle("the manifest's 'custom_ops' in " + where + ".graphs must be a list of library names, got " +
                      ops.dump());
        if (x.get<std::string>() != "specedge_ops")
          fail_bundle(
              "the manifest's 'custom_ops' in " + where + ".graphs names '" + x.get<std::string>() +
              "', which this specedge does not provide (it has 'specedge_ops'): the bundle needs a newer specedge");
        gs.custom_ops.push_back(x.get<std::string>());
      }
    }
    m.graphs.push_back(gs);
  }
  return m;
}

}  // namespace

const GraphSpec& ModelSpec::graph_for(const std::string& backend) const {
  for (const auto& g : graphs)
    for (const auto& b : g.backends)
      if (b == backend) return g;
  for (const auto& g : graphs)
    if (g.flavour == "portable") return g;
  fail_bundle("the " + role + " model has no graph for backend '" + backend + "'");
}

std::string resolve_inside(const std::string& root, const std::string& rel) {
  if (rel.empty()) fail_bundle("the manifest names an empty or non-text file path: ''");
  fs::path p(rel);
  bool bad = p.is_absolute() || rel[0] == '/' || rel[0] == '\\' || rel.find('\0') != std::string::npos;
  if (!bad) {
    bool first = true;
    for (const auto& part : p) {
      std::string s = part.string();
      if (s == "..") bad = true;
      if (first && s.find(':') != std::string::npos) bad = true;
      first = false;
    }
  }
  if (bad) fail_bundle("the manifest names a file outside the bundle: '" + rel + "'");
  std::error_code ec;
  fs::path root_r = fs::weakly_canonical(fs::path(root), ec);
  if (ec) fail_bundle("cannot resolve the bundle folder '" + root + "'");
  fs::path full = fs::weakly_canonical(fs::path(root) / p, ec);
  if (ec) fail_bundle("cannot resolve '" + rel + "' inside the bundle");
  // full must be root_r or below it
  auto r = root_r.begin(), f = full.begin();
  for (; r != root_r.end(); ++r, ++f) {
    if (r->empty() && std::next(r) == root_r.end()) break;  // trailing separator
    if (f == full.end() || *r != *f)
      fail_bundle("the manifest names a file outside the bundle: '" + rel + "' (through a link)");
  }
  return full.string();
}

std::string Manifest::path(const std::string& rel) const { return resolve_inside(root, rel); }

Manifest parse_manifest(const std::string& text, const std::string& root) {
  json obj;
  try {
    obj = json::parse(text);
  } catch (const json::parse_error& e) {
    fail_bundle("the manifest is not valid JSON (at byte " + std::to_string(e.byte) + ")");
  }
  if (!obj.is_object()) fail_bundle("the manifest is not a JSON object");
  Manifest m;
  m.root = root;
  const json ver = obj.contains("schema_version") ? obj["schema_version"] : json();
  if (!ver.is_number_integer() || ver.get<int64_t>() < kMinSchemaVersion || ver.get<int64_t>() > kSchemaVersion)
    fail_bundle("the bundle's manifest has schema version " + (ver.is_null() ? std::string("None") : ver.dump()) +
                "; this specedge reads versions " + std::to_string(kMinSchemaVersion) + ", " +
                std::to_string(kSchemaVersion) + " (re-export the bundle with this version)");
  m.schema_version = int(ver.get<int64_t>());
  if (obj.contains("created_by") && obj["created_by"].is_string()) m.created_by = obj["created_by"];
  m.max_seq = int(bounded(req_int(obj, "max_seq", "the manifest"), 16, kMaxMaxSeq, "max_seq"));
  m.batch = int(bounded(req_int(obj, "batch", "the manifest"), 1, 64, "batch"));
  m.kv_mode = req_str(obj, "kv_mode", "the manifest");
  if (m.kv_mode != "scatter" && m.kv_mode != "delta")
    fail_bundle("the manifest's kv_mode '" + m.kv_mode + "' is not one of scatter, delta");
  const json& spec = req(obj, "spec", json::value_t::object, "the manifest");
  m.spec_tokens = int(bounded(req_int(spec, "k", "spec"), 1, kMaxSpecTokens, "spec.k"));
  m.prefill_chunk = int(bounded(req_int(spec, "prefill_chunk", "spec"), 1, m.max_seq, "spec.prefill_chunk"));
  const json& tok = req(obj, "tokenizer", json::value_t::object, "the manifest");
  const json& eos = req(tok, "eos_token_ids", json::value_t::array, "tokenizer");
  if (eos.empty()) fail_bundle("the manifest's tokenizer.eos_token_ids must be a non-empty list of token ids");
  for (const json& e : eos) {
    if (!e.is_number_integer() || e.get<int64_t>() < 0)
      fail_bundle("the manifest's tokenizer.eos_token_ids must be a non-empty list of token ids");
    m.eos_token_ids.push_back(e.get<int64_t>());
  }
  if (tok.contains("bos_token_id") && !tok["bos_token_id"].is_null()) {
    const json& b = tok["bos_token_id"];
    if (!b.is_number_integer() || b.get<int64_t>() < 0)
      fail_bundle("the manifest's tokenizer.bos_token_id must be a token id or null");
    m.bos_token_id = b.get<int64_t>();
  }
  const json& models = req(obj, "models", json::value_t::object, "the manifest");
  m.target = model(req(models, "target", json::value_t::object, "models"), "target");
  m.draft = model(req(models, "draft", json::value_t::object, "models"), "draft");
  m.has_head = models.contains("head");
  if (m.has_head) m.head = model(req(models, "head", json::value_t::object, "models"), "head");
  if (m.schema_version < 2 && (m.has_head || m.target.features_dim))
    fail_bundle("the manifest has schema version 1 but uses version 2 fields (features, a draft head)");
  if (m.has_head && !m.target.features_dim)
    fail_bundle("the manifest has a draft head but its target graph returns no features");
  const json& files = req(obj, "files", json::value_t::object, "the manifest");
  for (auto it = files.begin(); it != files.end(); ++it) {
    const json& info = it.value();
    if (!info.is_object() || !info.contains("sha256") || !info["sha256"].is_string() || !info.contains("bytes") ||
        !info["bytes"].is_number_integer())
      fail_bundle("the manifest's checksum entry for '" + it.key() + "' is malformed");
    m.files[it.key()] = FileEntry{info["sha256"].get<std::string>(), info["bytes"].get<int64_t>()};
  }
  m.tokenizer_vocab_size = bounded(req_int(tok, "vocab_size", "tokenizer"), 2, kMaxVocab, "tokenizer.vocab_size");
  if (tok.contains("add_bos")) {
    const json& a = tok["add_bos"];
    m.add_bos = a.is_boolean()
                    ? a.get<bool>()
                    : (a.is_number() ? a.get<double>() != 0 : (a.is_string() && !a.get<std::string>().empty()));
  }
  for (const json& f : req(tok, "files", json::value_t::array, "tokenizer")) {
    if (!f.is_string()) fail_bundle("the manifest names an empty or non-text file path: " + f.dump());
    m.tokenizer_files.push_back(f.get<std::string>());
  }
  if (tok.contains("chat_template") && !tok["chat_template"].is_null()) {
    if (!tok["chat_template"].is_string())
      fail_bundle("the manifest's tokenizer.chat_template must be a file path or null");
    std::string ct = tok["chat_template"];
    if (!ct.empty()) m.chat_template = ct;
  }
  return m;
}

Manifest load_manifest(const std::string& bundle, const std::string& verify) {
  if (verify != "full" && verify != "size" && verify != "none")
    fail_arg("verify must be full, size or none, got '" + verify + "'");
  std::error_code ec;
  if (!fs::exists(bundle, ec)) fail_bundle("bundle '" + bundle + "' does not exist");
  if (!fs::is_directory(bundle, ec)) fail_bundle("bundle '" + bundle + "' is not a folder");
  fs::path mpath = fs::path(bundle) / "manifest.json";
  if (!fs::is_regular_file(mpath, ec)) fail_bundle("'" + bundle + "' is not a bundle: it has no manifest.json");
  resolve_inside(bundle, "manifest.json");  // a manifest.json that links out of the bundle
  if (fs::file_size(mpath, ec) > kMaxManifestBytes)
    fail_bundle(mpath.string() + " is larger than " + std::to_string(kMaxManifestBytes >> 20) +
                " MiB: not a bundle manifest");
  std::ifstream in(mpath, std::ios::binary);
  if (!in) fail_bundle("cannot read " + mpath.string());
  std::stringstream ss;
  ss << in.rdbuf();
  Manifest m;
  try {
    m = parse_manifest(ss.str(), bundle);
  } catch (const Error& e) {
    std::string msg = e.what();
    if (msg.rfind("the manifest is not valid JSON", 0) == 0)
      fail_bundle(mpath.string() + " is not valid JSON" +
                  msg.substr(std::string("the manifest is not valid JSON").size()));
    throw;
  }
  std::vector<std::string> referenced = m.tokenizer_files;
  if (m.chat_template) referenced.push_back(*m.chat_template);
  for (const ModelSpec* spec : {&m.target, &m.draft, &m.head})
    for (const auto& g : spec->graphs) {
      referenced.push_back(g.path);
      referenced.insert(referenced.end(), g.external_data.begin(), g.external_data.end());
    }
  if (m.has_head) {
    if (m.head.draft_vocab_file.empty()) fail_bundle("the manifest's draft head names no draft_vocab_file");
    referenced.push_back(m.head.draft_vocab_file);
  }
  for (const auto& kv : m.files) resolve_inside(bundle, kv.first);
  for (const auto& rel : referenced) resolve_inside(bundle, rel);
  for (const auto& rel : referenced)
    if (!m.files.count(rel)) fail_bundle("the manifest references '" + rel + "' but lists no checksum for it");
  // Whatever `verify` says: opening a named pipe or a device could block forever (manifest.py's check_regular).
  for (const auto& kv : m.files) {
    fs::file_status st = fs::status(resolve_inside(bundle, kv.first), ec);
    if (ec || st.type() == fs::file_type::not_found || st.type() == fs::file_type::regular) continue;
    const char* kind = st.type() == fs::file_type::directory   ? "a folder"
                       : st.type() == fs::file_type::fifo      ? "a named pipe"
                       : st.type() == fs::file_type::socket    ? "a socket"
                       : st.type() == fs::file_type::character ? "a character device"
                       : st.type() == fs::file_type::block     ? "a block device"
                                                               : "not a file";
    fail_bundle("the bundle's file '" + kv.first + "' is " + kind + ", not a regular file: refused before opening it");
  }
  if (verify != "none") {
    for (const auto& kv : m.files) {
      std::string p = resolve_inside(bundle, kv.first);
      if (!fs::is_regular_file(p, ec)) fail_bundle("the bundle is incomplete: '" + kv.first + "' is missing");
      int64_t size = int64_t(fs::file_size(p, ec));
      if (size != kv.second.bytes)
        fail_bundle("checksum mismatch: '" + kv.first + "' has " + std::to_string(size) + " bytes, the manifest says " +
                    std::to_string(kv.second.bytes));
      if (verify == "full" && sha256_file(p) != kv.second.sha256)
        fail_bundle("checksum mismatch: '" + kv.first + "' does not match its sha256 in the manifest");
    }
  }
  // ids below min(tokenizer, target) are the only ones generated (manifest.py says why a longer tokenizer is fine)
  const int64_t usable = std::min<int64_t>(m.tokenizer_vocab_size, m.target.vocab_size);
  if (m.draft.is_model() && m.draft.vocab_size < usable)
    fail_bundle("the draft's vocabulary (" + std::to_string(m.draft.vocab_size) + " ids) does not cover the " +
                std::to_string(usable) + " ids the target and the tokenizer share");
  // a draft head trained for another target (its fingerprint differs) is refused (check_head_matches)
  if (m.has_head && m.head.target_fingerprint != target_fingerprint(m))
    fail_bundle(
        "the bundle's draft head was trained for another target (its target checksum differs): train it "
        "again with `specedge train-draft`");
  return m;
}

std::string target_fingerprint(const Manifest& m) {
  std::string lines;
  for (const auto& g : m.target.graphs) {
    std::vector<std::string> rels{g.path};
    rels.insert(rels.end(), g.external_data.begin(), g.external_data.end());
    for (const auto& rel : rels) {
      auto it = m.files.find(rel);
      if (it == m.files.end()) fail_bundle("the manifest lists no checksum for the target's '" + rel + "'");
      lines += rel + ":" + it->second.sha256 + "\n";
    }
  }
  return sha256_hex(lines);
}

}  // namespace specedge
