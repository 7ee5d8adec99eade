#include "trt_plan.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "error.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace specedge {
namespace trt {

namespace {
const char* kRebuild = "rebuild with `specedge build-engines`";
constexpr int64_t kMaxPlanBytes = int64_t(1) << 40;  // sizes read from a file are bounded before use
constexpr int kMaxProfiles = 64;
constexpr int kMaxT = 1 << 20;

bool all_lower_hex(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

std::string lower_trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  std::string out = s.substr(a, b - a);
  for (auto& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

[[noreturn]] void malformed(const std::string& where, const std::string& what) {
  fail_bundle(where + " " + what + " — " + kRebuild);
}

const json& field(const json& obj, const std::string& key, json::value_t typ, const std::string& where) {
  if (!obj.contains(key)) malformed(where, "lacks '" + key + "'");
  const json& v = obj.at(key);
  bool ok = typ == json::value_t::number_integer ? v.is_number_integer() : v.type() == typ;
  if (!ok) malformed(where, "has a malformed '" + key + "'");
  return v;
}

std::string str_field(const json& obj, const std::string& key, const std::string& where) {
  return field(obj, key, json::value_t::string, where).get<std::string>();
}

int64_t int_field(const json& obj, const std::string& key, const std::string& where, int64_t lo, int64_t hi) {
  const json& v = field(obj, key, json::value_t::number_integer, where);
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi)) malformed(where, "has an out-of-range '" + key + "'");
  int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) malformed(where, "has an out-of-range '" + key + "'");
  return x;
}

Profile profile_from_json(const json& d, const std::string& where) {
  if (!d.is_object()) malformed(where, "has a malformed profile entry");
  Profile p;
  p.name = d.contains("name") && d["name"].is_string() ? d["name"].get<std::string>() : "";
  for (auto [key, dst] : {std::pair<const char*, int*>{"t_min", &p.t_min}, {"t_opt", &p.t_opt}, {"t_max", &p.t_max}}) {
    if (!d.contains(key) || !d[key].is_number_integer()) malformed(where, "has a malformed profile entry");
    int64_t x = d[key].get<int64_t>();
    if (x < 1 || x > kMaxT) malformed(where, "has a malformed profile entry");
    *dst = int(x);
  }
  if (!(p.t_min <= p.t_opt && p.t_opt <= p.t_max))
    malformed(where, "has a profile '" + p.name + "' that breaks 1 <= min <= opt <= max");
  return p;
}

std::string quoted_list(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size() && i < 3; ++i) out += (i ? ", '" : "'") + v[i] + "'";
  return out;
}

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}
}  // namespace

// ------------------------------------------------------------------ versions, devices

std::vector<int> parse_version(const std::string& s) {
  std::vector<int> parts;
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  std::string t = s.substr(a, b - a);
  size_t i = 0;
  while (true) {
    size_t j = t.find('.', i);
    std::string p = t.substr(i, j == std::string::npos ? std::string::npos : j - i);
    size_t n = 0;
    while (n < p.size() && std::isdigit(static_cast<unsigned char>(p[n]))) ++n;
    if (n == 0 || n > 9) break;
    parts.push_back(std::stoi(p.substr(0, n)));
    if (n != p.size() || j == std::string::npos) break;
    i = j + 1;
  }
  return parts;
}

std::string short_version(const std::string& s, int n) {
  std::vector<int> v = parse_version(s);
  std::string out;
  for (int i = 0; i < n && i < int(v.size()); ++i) out += (i ? "." : "") + std::to_string(v[size_t(i)]);
  return out.empty() ? s : out;
}

bool same_trt_version(const std::string& a, const std::string& b) {
  std::vector<int> x = parse_version(a), y = parse_version(b);
  if (x.empty() || y.empty()) return false;
  x.resize(3, 0);
  y.resize(3, 0);
  return x == y;
}

std::string trt_version_string(int64_t v) {
  int64_t major, minor, patch;
  if (v >= 100000) {  // TensorRT >= 10: (major * 100 + minor) * 100 + patch
    major = v / 10000;
    minor = (v / 100) % 100;
    patch = v % 100;
  } else {  // TensorRT <= 9: major * 1000 + minor * 100 + patch
    major = v / 1000;
    minor = (v / 100) % 10;
    patch = v % 100;
  }
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

std::string cc_string(int major, int minor) { return std::to_string(major) + "." + std::to_string(minor); }

std::string sm_name(const std::string& cc) {
  std::vector<int> v = parse_version(cc);
  v.resize(2, 0);
  return "sm_" + std::to_string(v[0]) + std::to_string(v[1]);
}

std::string device_tag(const std::string& gpu_name, const std::string& cc) {
  std::string slug;
  bool dash = false;
  for (char ch : gpu_name) {
    unsigned char c = static_cast<unsigned char>(std::tolower(static_cast<unsigned char>(ch)));
    bool keep = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
    if (keep) {
      if (dash && !slug.empty()) slug += '-';
      slug += char(c);
      dash = false;
    } else {
      dash = true;
    }
  }
  if (slug.empty()) slug = "gpu";
  std::string sm = sm_name(cc);
  sm.erase(std::remove(sm.begin(), sm.end(), '_'), sm.end());
  return slug + "-" + sm;
}

std::string describe_target(const std::string& gpu_name, const std::string& cc, const std::string& trt_version,
                            const std::optional<std::string>& other_trt) {
  std::string v = short_version(trt_version);
  if (other_trt && short_version(*other_trt) == v && !same_trt_version(trt_version, *other_trt))
    v = short_version(trt_version, 3);
  return gpu_name + " " + sm_name(cc) + " with TensorRT " + v;
}

// ------------------------------------------------------------------ plan.json

PlanInfo parse_plan_info(const std::string& text, const std::string& where) {
  json obj;
  try {
    obj = json::parse(text);
  } catch (const json::parse_error& e) {
    fail_bundle("cannot read " + where + " (not valid JSON at byte " + std::to_string(e.byte) + ") — " + kRebuild);
  }
  if (!obj.is_object()) malformed(where, "is not a JSON object");
  const json ver = obj.contains("schema_version") ? obj["schema_version"] : json();
  if (!ver.is_number_integer() || ver.get<int64_t>() != kPlanSchemaVersion)
    fail_bundle(where + " has schema version " + (ver.is_null() ? std::string("None") : ver.dump()) +
                ", this specedge reads " + std::to_string(kPlanSchemaVersion) + " — " + kRebuild);
  PlanInfo p;
  p.plan_file = str_field(obj, "plan_file", where);
  if (p.plan_file.empty() || p.plan_file == "." || p.plan_file == ".." || p.plan_file.find('/') != std::string::npos ||
      p.plan_file.find('\\') != std::string::npos || p.plan_file.find('\0') != std::string::npos)
    fail_bundle(where + " names a plan file outside its folder: '" + p.plan_file + "'");
  const json& profiles = field(obj, "profiles", json::value_t::array, where);
  if (profiles.empty()) malformed(where, "lists no optimization profile");
  if (profiles.size() > size_t(kMaxProfiles)) malformed(where, "lists too many optimization profiles");
  for (const json& d : profiles) p.profiles.push_back(profile_from_json(d, where));
  p.compute_capability = str_field(obj, "compute_capability", where);
  if (parse_version(p.compute_capability).empty()) malformed(where, "has a malformed 'compute_capability'");
  p.tensorrt_version = str_field(obj, "tensorrt_version", where);
  if (parse_version(p.tensorrt_version).empty()) malformed(where, "has a malformed 'tensorrt_version'");
  p.plan_sha256 = str_field(obj, "plan_sha256", where);
  if (!all_lower_hex(p.plan_sha256)) malformed(where, "has a malformed plan_sha256");
  p.role = str_field(obj, "role", where);
  p.plan_bytes = int_field(obj, "plan_bytes", where, 1, kMaxPlanBytes);
  p.gpu_name = str_field(obj, "gpu_name", where);
  p.kv_mode = str_field(obj, "kv_mode", where);
  p.max_seq = int(int_field(obj, "max_seq", where, 1, kMaxT));
  p.batch = int(int_field(obj, "batch", where, 1, 1 << 16));
  p.precision = str_field(obj, "precision", where);
  p.onnx_path = str_field(obj, "onnx_path", where);
  p.onnx_sha256 = str_field(obj, "onnx_sha256", where);
  if (obj.contains("extra_outputs") && !obj["extra_outputs"].is_null()) {
    if (!obj["extra_outputs"].is_array()) malformed(where, "has a malformed 'extra_outputs'");
    for (const json& x : obj["extra_outputs"])
      p.extra_outputs.push_back(x.is_string() ? x.get<std::string>() : x.dump());
  }
  if (obj.contains("created_by") && obj["created_by"].is_string()) p.created_by = obj["created_by"];
  if (obj.contains("created_at") && obj["created_at"].is_string()) p.created_at = obj["created_at"];
  return p;
}

PlanInfo load_plan_info(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail_bundle(path + " is missing — build engines with `specedge build-engines`");
  auto size = fs::file_size(path, ec);
  if (ec) fail_bundle("cannot read " + path + " (" + ec.message() + ") — " + kRebuild);
  if (size > (1u << 20)) fail_bundle("cannot read " + path + " (larger than 1 MiB: not a plan.json) — " + kRebuild);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_bundle("cannot read " + path + " — " + kRebuild);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_plan_info(ss.str(), path);
}

std::string mismatch_message(const PlanInfo& info, const std::string& gpu_name, const std::string& cc,
                             const std::string& trt_version, const std::string& bundle) {
  std::string built = describe_target(info.gpu_name, info.compute_capability, info.tensorrt_version, trt_version);
  std::string here = describe_target(gpu_name, cc, trt_version, info.tensorrt_version);
  return "engine built for " + built + "; this device is " + here + " — rebuild with `specedge build-engines " +
         bundle + "`";
}

void check_compatible(const PlanInfo& info, const std::string& gpu_name, const std::string& cc,
                      const std::string& trt_version, const std::string& bundle) {
  std::vector<int> a = parse_version(cc), b = parse_version(info.compute_capability);
  a.resize(2, 0);
  b.resize(2, 0);
  bool same_sm = a == b;
  bool same_gpu = lower_trim(info.gpu_name) == lower_trim(gpu_name);
  if (!(same_trt_version(info.tensorrt_version, trt_version) && same_sm && same_gpu))
    fail_bundle(mismatch_message(info, gpu_name, cc, trt_version, bundle));
}

void check_against_manifest(const PlanInfo& info, const Manifest& m, const ModelSpec& spec,
                            const std::string& onnx_path, const std::string& bundle) {
  std::string rebuild = "rebuild with `specedge build-engines " + bundle + "`";
  if (info.role != spec.role)
    fail_bundle("the " + spec.role + " engine's plan.json describes the " + info.role + " model — " + rebuild);
  if (info.kv_mode != m.kv_mode || info.max_seq != m.max_seq || info.batch != m.batch)
    fail_bundle("the " + spec.role + " engine was built for kv mode " + info.kv_mode + ", max_seq " +
                std::to_string(info.max_seq) + ", batch " + std::to_string(info.batch) + "; the bundle has " +
                m.kv_mode + ", " + std::to_string(m.max_seq) + ", " + std::to_string(m.batch) + " — " + rebuild);
  auto it = m.files.find(onnx_path);
  std::string want = it == m.files.end() ? "" : it->second.sha256;
  if (info.onnx_path != onnx_path || (!want.empty() && want != info.onnx_sha256))
    fail_bundle("the " + spec.role + " engine was built from another " + onnx_path + " than the bundle's — " + rebuild);
}

std::string no_engine_message(const std::string& bundle_root, const std::string& role, const std::string& gpu_name,
                              const std::string& cc, const std::string& trt_version) {
  fs::path root = fs::path(bundle_root) / kEnginesDir;
  std::error_code ec;
  if (fs::is_directory(root, ec)) {
    std::vector<fs::path> dirs;
    for (const auto& e : fs::directory_iterator(root, ec))
      if (e.is_directory(ec)) dirs.push_back(e.path());
    std::sort(dirs.begin(), dirs.end());
    for (const auto& d : dirs) {
      fs::path p = d / (role + ".plan.json");
      if (!fs::is_regular_file(p, ec)) continue;
      try {
        PlanInfo other = load_plan_info(p.string());
        return mismatch_message(other, gpu_name, cc, trt_version, bundle_root);
      } catch (const Error&) {
        continue;  // unreadable ones are skipped, as in Python
      }
    }
  }
  return "the bundle has no TensorRT engine for this device (" + describe_target(gpu_name, cc, trt_version) +
         ") — build one with `specedge build-engines " + bundle_root + "`";
}

void check_kv_mode_supported(const std::string& kv_mode, const std::string& trt_version) {
  std::vector<int> v = parse_version(trt_version);
  v.resize(2, 0);
  if (v[0] < 10) fail_backend("specedge needs TensorRT 10 or newer; this machine has TensorRT " + trt_version);
  if (kv_mode == "scatter" && (v[0] < kScatterMinMajor || (v[0] == kScatterMinMajor && v[1] < kScatterMinMinor)))
    fail_bundle(
        "this bundle updates the KV cache in place (kv mode 'scatter', ONNX TensorScatter), which TensorRT "
        "supports from " +
        std::to_string(kScatterMinMajor) + "." + std::to_string(kScatterMinMinor) + "; this machine has TensorRT " +
        short_version(trt_version) +
        " — export a delta-mode bundle with `export-models --kv-update delta` (for JetPack 6 / TensorRT "
        "10.3) or install TensorRT >= 10.15");
}

// ------------------------------------------------------------------ profiles

int select_profile(const std::vector<Profile>& profiles, int t) {
  for (size_t i = 0; i < profiles.size(); ++i)
    if (profiles[i].exact() && profiles[i].t_min == t) return int(i);
  for (size_t i = 0; i < profiles.size(); ++i)
    if (profiles[i].covers(t)) return int(i);
  int top = 0;
  for (const auto& p : profiles) top = std::max(top, p.t_max);
  fail_arg("no optimization profile covers T = " + std::to_string(t) +
           " (the engine was built for T <= " + std::to_string(top) + ")");
}

// ------------------------------------------------------------------ buffers and bindings

size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "float32" || dtype == "int32") return 4;
  if (dtype == "float16" || dtype == "bfloat16") return 2;
  if (dtype == "int64") return 8;
  if (dtype == "bool") return 1;
  fail_bundle("unsupported tensor dtype '" + dtype + "'");
}

KVLayout KVLayout::for_cache(const ModelSpec& spec, int max_seq, int batch) {
  return KVLayout{spec.num_layers, batch, spec.num_kv_heads, max_seq, spec.head_dim, dtype_bytes(spec.kv_dtype),
                  kTensorAlign};
}

KVLayout KVLayout::for_delta(const ModelSpec& spec, int t, int batch) {
  return KVLayout{spec.num_layers, batch, spec.num_kv_heads, t, spec.head_dim, dtype_bytes(spec.kv_dtype),
                  kTensorAlign};
}

size_t KVLayout::offset(int kind, int layer) const {
  if ((kind != 0 && kind != 1) || layer < 0 || layer >= layers)
    fail_arg("no KV tensor kind=" + std::to_string(kind) + " layer=" + std::to_string(layer) + " in a " +
             std::to_string(layers) + "-layer layout");
  return (size_t(kind) * size_t(layers) + size_t(layer)) * tensor_stride();
}

const char* buffer_name(Buffer b) {
  switch (b) {
    case Buffer::InputIds:
      return "input_ids";
    case Buffer::Position:
      return "position";
    case Buffer::TreeMask:
      return "tree_mask";
    case Buffer::Logits:
      return "logits";
    case Buffer::Cache:
      return "cache";
    case Buffer::Delta:
      return "delta";
    case Buffer::Argmax:
      return "argmax";
  }
  return "?";
}

void expected_names(const ModelSpec& spec, const std::string& kv_mode, std::vector<std::string>* inputs,
                    std::vector<std::string>* outputs, bool tree) {
  inputs->assign({"input_ids", "position"});
  if (tree) inputs->push_back("tree_mask");
  outputs->assign({"logits"});
  for (int i = 0; i < spec.num_layers; ++i) {
    inputs->push_back("past_key." + std::to_string(i));
    inputs->push_back("past_value." + std::to_string(i));
  }
  const char* prefix = kv_mode == "scatter" ? "present_" : "new_";
  for (int i = 0; i < spec.num_layers; ++i) {
    outputs->push_back(std::string(prefix) + "key." + std::to_string(i));
    outputs->push_back(std::string(prefix) + "value." + std::to_string(i));
  }
}

std::vector<TensorBinding> binding_plan(const ModelSpec& spec, const std::string& kv_mode, int max_seq, int t,
                                        int batch, bool argmax, bool tree) {
  if (kv_mode != "scatter" && kv_mode != "delta") fail_bundle("unknown kv mode '" + kv_mode + "'");
  if (t < 1) fail_arg("T must be >= 1, got " + std::to_string(t));
  KVLayout cache = KVLayout::for_cache(spec, max_seq, batch), delta = KVLayout::for_delta(spec, t, batch);
  const int64_t B = batch, H = spec.num_kv_heads, S = max_seq, D = spec.head_dim, T = t;
  std::vector<TensorBinding> out;
  out.push_back({"input_ids", true, Buffer::InputIds, 0, {B, T}, "int64"});
  out.push_back({"position", true, Buffer::Position, 0, {B}, "int64"});
  if (tree) out.push_back({"tree_mask", true, Buffer::TreeMask, 0, {B, T, T}, "bool"});
  for (int i = 0; i < spec.num_layers; ++i)
    for (int kind = 0; kind < 2; ++kind)
      out.push_back({std::string(kind ? "past_value." : "past_key.") + std::to_string(i),
                     true,
                     Buffer::Cache,
                     cache.offset(kind, i),
                     {B, H, S, D},
                     spec.kv_dtype});
  out.push_back({"logits", false, Buffer::Logits, 0, {B, T, spec.vocab_size}, "float32"});
  for (int i = 0; i < spec.num_layers; ++i)
    for (int kind = 0; kind < 2; ++kind) {
      std::string kname = std::string(kind ? "value." : "key.") + std::to_string(i);
      if (kv_mode == "scatter")
        out.push_back({"present_" + kname, false, Buffer::Cache, cache.offset(kind, i), {B, H, S, D}, spec.kv_dtype});
      else
        out.push_back({"new_" + kname, false, Buffer::Delta, delta.offset(kind, i), {B, H, T, D}, spec.kv_dtype});
    }
  if (argmax) out.push_back({kArgmaxOutput, false, Buffer::Argmax, 0, {B, T, 1}, "int64"});
  return out;
}

std::string check_graph_names(const std::string& role, const std::vector<std::string>& want_in,
                              const std::vector<std::string>& want_out, const std::vector<std::string>& got_in,
                              const std::vector<std::string>& got_out) {
  std::vector<std::string> missing_in, extra_in, missing_out;
  for (const auto& n : want_in)
    if (!contains(got_in, n)) missing_in.push_back(n);
  for (const auto& n : got_in)
    if (!contains(want_in, n)) extra_in.push_back(n);
  for (const auto& n : want_out)
    if (!contains(got_out, n)) missing_out.push_back(n);
  std::string problems;
  auto add = [&](const std::string& p) { problems += (problems.empty() ? "" : "; ") + p; };
  if (!missing_in.empty()) add("missing input(s) " + quoted_list(missing_in));
  if (!extra_in.empty()) add("unexpected input(s) " + quoted_list(extra_in));
  if (!missing_out.empty()) add("missing output(s) " + quoted_list(missing_out));
  if (problems.empty()) return "";
  return "the " + role + " graph does not follow the bundle's I/O contract (" + problems +
         "); re-export the bundle with this version of specedge";
}

namespace {
// `base` (offsets within one tensor, for every row) as issued: a single copy of every row when neither arena is
// padded (each is one matrix), else one per K/V tensor.
std::vector<Copy2D> expand_copies(const KVLayout& dst, const KVLayout& src, Copy2D base) {
  if (dst.dense() && src.dense()) {
    base.height = dst.rows();
    return {base};
  }
  std::vector<Copy2D> out;
  base.height = dst.rows_per_tensor();
  for (int kind = 0; kind < 2; ++kind)
    for (int layer = 0; layer < dst.layers; ++layer) {
      Copy2D one = base;
      one.dst_offset += dst.offset(kind, layer);
      one.src_offset += src.offset(kind, layer);
      out.push_back(one);
    }
  return out;
}
}  // namespace

std::vector<Copy2D> slot_copies(const KVLayout& cache, int start, int end) {
  if (start < 0 || end < start || end > cache.seq)
    fail_arg("slots [" + std::to_string(start) + ", " + std::to_string(end) + ") are not inside a cache of " +
             std::to_string(cache.seq) + " slots");
  if (start == end) return {};
  const size_t slot = size_t(cache.head_dim) * cache.itemsize;
  Copy2D c;
  c.width = size_t(end - start) * slot;
  c.dst_offset = c.src_offset = size_t(start) * slot;
  c.dpitch = c.spitch = cache.row_bytes();
  return expand_copies(cache, cache, c);
}

std::vector<Copy2D> path_copies(const KVLayout& cache, int position, const std::vector<std::pair<int, int>>& moves) {
  const size_t slot = size_t(cache.head_dim) * cache.itemsize;
  std::vector<Copy2D> out;
  for (const auto& [src, dst] : moves) {
    if (position < 0 || src < 0 || dst < 0 || position + std::max(src, dst) >= cache.seq)
      fail_arg("tree nodes " + std::to_string(std::max(src, dst)) + " past position " + std::to_string(position) +
               " are outside max_seq " + std::to_string(cache.seq));
    Copy2D c;
    c.width = slot;
    c.dst_offset = size_t(position + dst) * slot;
    c.src_offset = size_t(position + src) * slot;
    c.dpitch = c.spitch = cache.row_bytes();
    for (const Copy2D& one : expand_copies(cache, cache, c)) out.push_back(one);
  }
  return out;
}

std::vector<Copy2D> delta_copies(const KVLayout& cache, const KVLayout& delta, int position) {
  const int t = delta.seq;
  if (t < 1) fail_arg("T must be >= 1, got " + std::to_string(t));
  if (delta.layers != cache.layers || delta.batch != cache.batch || delta.heads != cache.heads ||
      delta.head_dim != cache.head_dim || delta.itemsize != cache.itemsize)
    fail_arg("the delta arena's layout does not match the cache's");
  if (position < 0 || position + t > cache.seq)
    fail_arg("writing " + std::to_string(t) + " entries at position " + std::to_string(position) +
             " overflows the cache of " + std::to_string(cache.seq) + " slots");
  Copy2D c;
  c.width = delta.row_bytes();  // T·head_dim elements
  c.dst_offset = size_t(position) * size_t(cache.head_dim) * cache.itemsize;
  c.dpitch = cache.row_bytes();
  c.src_offset = 0;
  c.spitch = c.width;
  return expand_copies(cache, delta, c);
}

}  // namespace trt
}  // namespace specedge
