#include "ort_backend.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <onnxruntime_cxx_api.h>

#include "error.h"
#include "tree.h"

namespace specedge {

namespace {
// ONNX Runtime allows one environment per process; the first backend's options size its pool.
Ort::Env& env(const BackendOptions& opts, PoolKey* global) {
  static std::mutex mu;
  static Ort::Env* e = nullptr;  // process lifetime, like ORT's own environment
  static PoolKey key;
  std::lock_guard<std::mutex> lock(mu);
  if (!e) {
    key = pool_key_for(opts);
    Ort::ThreadingOptions to;
    to.SetGlobalIntraOpNumThreads(key.threads);
    to.SetGlobalInterOpNumThreads(1);
    to.SetGlobalSpinControl(key.spinning ? 1 : 0);
    // ONNX Runtime's Linux build writes a telemetry database under ~/.cache/Microsoft/DeveloperTools
    // when its environment is created, unless ORT_DISABLE_TELEMETRY=1 (docs/security.md); a value
    // the caller set (0 allows it) is kept.
    setenv("ORT_DISABLE_TELEMETRY", "1", 0);
    e = new Ort::Env(to, ORT_LOGGING_LEVEL_FATAL, "specedge");
  }
  *global = key;
  return *e;
}

ONNXTensorElementDataType element_type(const std::string& dtype, size_t* bytes) {
  if (dtype == "float32") {
    *bytes = 4;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  if (dtype == "float16") {
    *bytes = 2;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  }
  if (dtype == "bfloat16") {
    *bytes = 2;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
  }
  fail_bundle("unsupported KV dtype '" + dtype + "'");
}

// Zero-filled bytes from calloc: large blocks come straight from mmap, so pages the model never
// writes (the KV rows past the current context) are never touched and cost no resident memory,
// as with numpy's np.zeros in the Python runtime. std::vector would memset all of them.
class ZeroedBytes {
 public:
  void reset(size_t n) {
    p_.reset(nullptr);
    if (n == 0) return;
    p_.reset(static_cast<uint8_t*>(std::calloc(n, 1)));
    if (!p_) throw std::bad_alloc();
  }
  uint8_t* data() const { return p_.get(); }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> p_;
};

std::string first_line(const std::string& s) {
  auto p = s.find('\n');
  return p == std::string::npos ? s : s.substr(0, p);
}
}  // namespace

PoolKey pool_key_for(const BackendOptions& opts) { return {opts.threads, opts.allow_spinning != 0}; }

SessionThreading choose_threading(const BackendOptions& opts, const PoolKey& global) {
  if (pool_key_for(opts) == global) return {true, global.spinning};
  bool spin = opts.allow_spinning < 0 ? !opts.alternating : opts.allow_spinning != 0;
  return {false, spin};
}

struct OrtBackend::Impl {
  const GraphSpec* graph = nullptr;  // the manifest graph this session runs (choose_int4_graph)
  const ModelSpec* spec = nullptr;
  std::unique_ptr<Ort::Session> session;
  Ort::MemoryInfo mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
  bool delta = false;
  bool tree = false;  // the graph takes tree calls: chains bind the lower-triangular tree_mask
  int B = 1, L = 0, H = 0, S = 0, D = 0, V = 0, t_max = 0;
  size_t elem = 4;
  ONNXTensorElementDataType kv_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  ZeroedBytes kv;         // [2L, B, H, S, D]
  ZeroedBytes delta_buf;  // [2L, B, H, t_max, D]
  std::vector<int64_t> ids, pos;
  std::vector<float> logits;
  std::vector<std::string> extra_outputs;
  // draft head graphs: features / hidden inputs [B, t, F] / [B, t, HH], hidden_out [B, t, HH]
  bool head = false;
  int F = 0, HH = 0;
  std::vector<float> in_feat, in_hidden, out_hidden;
  // target features kept for a head drafter: the output [B, t, TF] and every slot's row (batch 0)
  bool keep_feat = false;
  int TF = 0;
  std::vector<float> feat_out, feat_store;
  struct Binding {
    std::unique_ptr<Ort::IoBinding> io;
    std::vector<Ort::Value> values;  // kept alive with the binding
    std::vector<uint8_t> mask;       // tree graphs: [B, t, t] lower triangle (a chain call)
  };
  std::map<int, Binding> bindings;
  Ort::RunOptions run_opts;
  SessionThreading threading;

  size_t layer_bytes() const { return size_t(B) * H * S * D * elem; }
  uint8_t* kv_ptr(int j) { return kv.data() + size_t(j) * layer_bytes(); }

  void allocate(int t) {
    t_max = t;
    ids.assign(size_t(B) * t_max, 0);
    pos.assign(size_t(B), 0);
    logits.assign(size_t(B) * t_max * V, 0.f);
    if (delta) delta_buf.reset(size_t(2) * L * B * H * t_max * D * elem);
    if (head) {
      in_feat.assign(size_t(B) * t_max * F, 0.f);
      in_hidden.assign(size_t(B) * t_max * HH, 0.f);
      out_hidden.assign(size_t(B) * t_max * HH, 0.f);
    }
    if (keep_feat) feat_out.assign(size_t(B) * t_max * TF, 0.f);
    bindings.clear();
  }

  // a chain call's mask: the lower triangle in every batch row
  void lower_triangle(Binding& b, int t) {
    b.mask.assign(size_t(B) * t * t, 0);
    for (int r = 0; r < B * t; ++r)
      for (int c = 0; c <= r % t; ++c) b.mask[size_t(r) * t + c] = 1;
  }

  Binding& binding(int t) {
    auto it = bindings.find(t);
    if (it != bindings.end()) return it->second;
    Binding b;
    b.io = std::make_unique<Ort::IoBinding>(*session);
    auto bind_in = [&](const std::string& name, void* p, size_t bytes, std::vector<int64_t> shape,
                       ONNXTensorElementDataType ty) {
      b.values.push_back(Ort::Value::CreateTensor(mem, p, bytes, shape.data(), shape.size(), ty));
      b.io->BindInput(name.c_str(), b.values.back());
    };
    auto bind_out = [&](const std::string& name, void* p, size_t bytes, std::vector<int64_t> shape,
                        ONNXTensorElementDataType ty) {
      b.values.push_back(Ort::Value::CreateTensor(mem, p, bytes, shape.data(), shape.size(), ty));
      b.io->BindOutput(name.c_str(), b.values.back());
    };
    bind_in("input_ids", ids.data(), size_t(B) * t * 8, {B, t}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    bind_in("position", pos.data(), size_t(B) * 8, {B}, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    if (tree) {
      lower_triangle(b, t);
      bind_in("tree_mask", b.mask.data(), b.mask.size(), {B, t, t}, ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL);
    }
    bind_out("logits", logits.data(), size_t(B) * t * V * 4, {B, t, V}, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    if (head) {
      bind_in("features", in_feat.data(), size_t(B) * t * F * 4, {B, t, F}, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
      bind_in("hidden", in_hidden.data(), size_t(B) * t * HH * 4, {B, t, HH}, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
      bind_out("hidden_out", out_hidden.data(), size_t(B) * t * HH * 4, {B, t, HH},
               ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    }
    if (keep_feat)
      bind_out(kFeaturesOutput, feat_out.data(), size_t(B) * t * TF * 4, {B, t, TF},
               ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    size_t delta_elems = size_t(B) * H * t * D;
    for (int kind = 0; kind < 2; ++kind) {
      const char* kname = kind ? "value" : "key";
      for (int i = 0; i < L; ++i) {
        int j = kind * L + i;
        std::string idx = std::to_string(i);
        bind_in(std::string("past_") + kname + "." + idx, kv_ptr(j), layer_bytes(), {B, H, S, D}, kv_type);
        if (!delta)
          bind_out(std::string("present_") + kname + "." + idx, kv_ptr(j), layer_bytes(), {B, H, S, D}, kv_type);
        else
          bind_out(std::string("new_") + kname + "." + idx, delta_buf.data() + size_t(j) * delta_elems * elem,
                   delta_elems * elem, {B, H, t, D}, kv_type);
      }
    }
    for (const auto& name : extra_outputs) b.io->BindOutput(name.c_str(), mem);
    return bindings.emplace(t, std::move(b)).first->second;
  }
};

namespace {
// libspecedge_ops.so: $SPECEDGE_OPS_LIB, else beside the library this code is linked into (the
// build folder, or PREFIX/lib after cmake --install). Python looks in the same places.
// The kernels' slow portable path (a CPU without AVX2) is worth one warning per process, as in
// Python's custom_ops.register: its steps are several times slower.
void warn_if_portable(const std::string& path) {
  static std::once_flag once;
  std::call_once(once, [&] {
    const char* forced = std::getenv("SPECEDGE_OPS_ISA");
    if (forced && std::string(forced) == "portable") return;
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;  // ONNX Runtime's own load reports what is wrong
    using IsaFn = const char* (*)();
    auto fn = reinterpret_cast<IsaFn>(dlsym(lib, "specedge_ops_isa"));
    if (fn && std::string(fn()) == "portable")
      std::fprintf(stderr,
                   "specedge: warning: specedge's CPU kernels run their portable path on this CPU (it has no "
                   "AVX2): a step takes about 10x as long as with AVX2 or AVX-512; re-export the bundle without "
                   "--int4-kernel specedge for ONNX Runtime's kernels\n");
    dlclose(lib);
  });
}

std::vector<std::string> ops_library_candidates() {
  std::vector<std::string> tried;
  if (const char* env = std::getenv("SPECEDGE_OPS_LIB"); env && *env) {
    tried.push_back(env);
  } else {
    Dl_info info{};
    if (dladdr(reinterpret_cast<const void*>(&ops_library_candidates), &info) && info.dli_fname) {
      std::string self = info.dli_fname;
      const size_t slash = self.rfind('/');
      tried.push_back((slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/libspecedge_ops.so");
    }
  }
  return tried;
}

bool readable(const std::string& p) {
  FILE* f = std::fopen(p.c_str(), "rb");
  if (f) std::fclose(f);
  return f != nullptr;
}

// "" when libspecedge_ops.so is found and has a fast path here, else why not
std::string kernels_unavailable() {
  for (const auto& p : ops_library_candidates()) {
    if (!readable(p)) continue;
    void* lib = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) return "libspecedge_ops.so does not load (" + p + ")";
    using IsaFn = const char* (*)();
    auto fn = reinterpret_cast<IsaFn>(dlsym(lib, "specedge_ops_isa"));
    const std::string isa = fn ? fn() : "";
    dlclose(lib);
    if (isa == "portable") return "specedge's kernels have no fast path on this CPU (no AVX2)";
    return "";
  }
  return "libspecedge_ops.so is not installed";
}

std::string find_ops_library(const std::string& role, const std::string& graph) {
  const std::vector<std::string> tried = ops_library_candidates();
  for (const auto& p : tried)
    if (FILE* f = std::fopen(p.c_str(), "rb")) {
      std::fclose(f);
      warn_if_portable(p);
      return p;
    }
  fail_backend("the " + role + " graph '" + graph +
               "' uses specedge's CPU kernels, but libspecedge_ops.so was not found" +
               (tried.empty() ? std::string() : " (looked at " + tried[0] + ")") +
               ": build it with the C++ runtime (cmake --build), set SPECEDGE_OPS_LIB to its path, or re-export the "
               "bundle without --int4-kernel specedge");
}
}  // namespace

const GraphSpec& choose_int4_graph(const ModelSpec& spec, const std::string& backend, std::string* why) {
  const GraphSpec* fast = nullptr;
  const GraphSpec* plain = nullptr;
  for (const auto& g : spec.graphs)
    if (std::find(g.backends.begin(), g.backends.end(), backend) != g.backends.end()) {
      const GraphSpec*& slot = g.custom_ops.empty() ? plain : fast;
      if (!slot) slot = &g;
    }
  const char* env = std::getenv("SPECEDGE_INT4_KERNEL");
  const std::string want = env && *env ? env : "auto";
  if (want != "auto" && want != "specedge" && want != "matmulnbits")
    fail_arg("SPECEDGE_INT4_KERNEL must be auto, specedge or matmulnbits, got '" + want + "'");
  if (!fast || !plain) {
    const GraphSpec& only = spec.graph_for(backend);
    const std::string kind = only.custom_ops.empty() ? "matmulnbits" : "specedge";
    if (spec.precision == "int4" && want != "auto" && want != kind)
      fail_backend("--int4-kernel " + want + ": the " + spec.role + " model has only a " + kind +
                   " graph (exported with --int4-kernel " + kind + "); re-export it without --int4-kernel");
    if (why) *why = spec.precision == "int4" ? "the bundle's only graph" : "";
    return only;
  }
  if (want == "matmulnbits") {
    if (why) *why = "asked for with SPECEDGE_INT4_KERNEL=matmulnbits";
    return *plain;
  }
  const std::string no = kernels_unavailable();
  if (want == "specedge") {
    if (!no.empty()) fail_backend("--int4-kernel specedge: " + no);
    if (why) *why = "asked for with SPECEDGE_INT4_KERNEL=specedge";
    return *fast;
  }
  if (no.empty()) {
    if (why) *why = "specedge's kernels have a fast path on this CPU";
    return *fast;
  }
  static std::once_flag once;
  std::call_once(once, [&] {
    std::fprintf(stderr,
                 "specedge: note: int4 graphs run on ONNX Runtime's MatMulNBits: %s (exact either way; "
                 "specedge's kernels are faster where they run)\n",
                 no.c_str());
  });
  if (why) *why = no;
  return *plain;
}

OrtBackend::OrtBackend(const Manifest& m, const ModelSpec& spec, const BackendOptions& opts)
    : Backend(m, spec), impl_(new Impl) {
  if (spec.kind == "ngram") fail_bundle("the " + spec.role + " is an n-gram drafter: it has no graph to run");
  if (opts.backend != "ort-cpu") fail_arg("OrtBackend runs backend 'ort-cpu', not '" + opts.backend + "'");
  Impl& s = *impl_;
  s.spec = &spec;
  s.delta = m.kv_mode == "delta";
  s.B = m.batch;
  s.L = spec.num_layers;
  s.H = spec.num_kv_heads;
  s.S = m.max_seq;
  s.D = spec.head_dim;
  s.V = int(spec.vocab_size);
  s.kv_type = element_type(spec.kv_dtype, &s.elem);
  s.head = spec.kind == "head";
  s.F = spec.feature_dim;
  s.HH = spec.hidden_size;
  const GraphSpec& g = choose_int4_graph(spec, opts.backend, nullptr);
  s.graph = &g;
  s.tree = g.tree;
  std::string path = m.path(g.path);
  const std::string ops_library = g.custom_ops.empty() ? std::string() : find_ops_library(spec.role, g.path);
  auto make_session = [&](Ort::Env& e, const SessionThreading& t) {
    Ort::SessionOptions so;
    if (!ops_library.empty()) so.RegisterCustomOpsLibrary(ops_library.c_str());
    so.SetGraphOptimizationLevel(GraphOptimizationLevel::ORT_ENABLE_ALL);
    so.SetExecutionMode(ExecutionMode::ORT_SEQUENTIAL);
    so.SetLogSeverityLevel(4);  // fatal only: failures come back as one Error line, not ORT's log lines too
    if (t.shared_pool) {
      so.DisablePerSessionThreads();
    } else {
      so.SetInterOpNumThreads(1);
      if (opts.threads > 0) so.SetIntraOpNumThreads(opts.threads);
      if (!t.spinning) {
        so.AddConfigEntry("session.intra_op.allow_spinning", "0");
        so.AddConfigEntry("session.inter_op.allow_spinning", "0");
      }
    }
    s.session = std::make_unique<Ort::Session>(e, path.c_str(), so);
  };
  try {
    PoolKey global;
    Ort::Env& e = env(opts, &global);
    s.threading = choose_threading(opts, global);
    try {
      make_session(e, s.threading);
    } catch (const Ort::Exception&) {
      if (!s.threading.shared_pool) throw;
      // The host application made ORT's environment before us, without global pools (ORT keeps
      // one environment per process and ignores our threading options then): a pool of its own.
      s.threading = choose_threading(opts, PoolKey{-1, false});
      make_session(e, s.threading);
    }
  } catch (const Ort::Exception& e) {
    fail_backend("ONNX Runtime cannot load the " + spec.role + " graph '" + g.path + "': " + first_line(e.what()));
  }
  // Check the graph's names against the contract (docs/design.md).
  std::vector<std::string> got_in, got_out;
  Ort::AllocatorWithDefaultOptions alloc;
  for (size_t i = 0; i < s.session->GetInputCount(); ++i)
    got_in.push_back(s.session->GetInputNameAllocated(i, alloc).get());
  for (size_t i = 0; i < s.session->GetOutputCount(); ++i)
    got_out.push_back(s.session->GetOutputNameAllocated(i, alloc).get());
  std::vector<std::string> want_in{"input_ids", "position"}, want_out{"logits"};
  if (s.tree) want_in.push_back("tree_mask");
  if (s.head) {
    want_in.push_back("features");
    want_in.push_back("hidden");
    want_out.push_back("hidden_out");
  }
  for (int i = 0; i < s.L; ++i) {
    want_in.push_back("past_key." + std::to_string(i));
    want_in.push_back("past_value." + std::to_string(i));
    want_out.push_back((s.delta ? "new_key." : "present_key.") + std::to_string(i));
    want_out.push_back((s.delta ? "new_value." : "present_value.") + std::to_string(i));
  }
  auto has = [](const std::vector<std::string>& v, const std::string& n) {
    for (const auto& x : v)
      if (x == n) return true;
    return false;
  };
  for (const auto& n : want_in)
    if (!has(got_in, n)) fail_bundle("the " + spec.role + " graph lacks input '" + n + "' that the manifest promises");
  for (const auto& n : got_in)
    if (!has(want_in, n)) fail_bundle("the " + spec.role + " graph has an unexpected input '" + n + "'");
  for (const auto& n : want_out)
    if (!has(got_out, n))
      fail_bundle("the " + spec.role + " graph lacks output '" + n + "' that the manifest promises");
  for (const auto& n : got_out)
    if (!has(want_out, n)) s.extra_outputs.push_back(n);
  // sizes come from a checked manifest, but guard the multiplication anyway
  double kv_bytes = 2.0 * s.L * s.B * s.H * double(s.S) * s.D * double(s.elem);
  if (kv_bytes > double(1ull << 40)) fail_bundle("the " + spec.role + " KV cache would need more than 1 TiB");
  try {
    s.kv.reset(size_t(kv_bytes));
  } catch (const std::bad_alloc&) {
    fail_backend("cannot allocate the " + spec.role + " KV cache (" + std::to_string(size_t(kv_bytes) >> 20) + " MiB)");
  }
  s.allocate(reserved_call_size(m.prefill_chunk));
}

OrtBackend::~OrtBackend() = default;

const SessionThreading& OrtBackend::threading() const { return impl_->threading; }

bool OrtBackend::copy_kv_from(const Backend& other, int start, int end) {
  const auto* o = dynamic_cast<const OrtBackend*>(&other);
  if (!o) return false;
  const Impl& src = *o->impl_;
  Impl& s = *impl_;
  if (src.B != s.B || src.L != s.L || src.H != s.H || src.S != s.S || src.D != s.D || src.kv_type != s.kv_type)
    return false;
  if (start < 0 || end > s.S || start >= end) return start == end;
  // [2L, B, H, S, D]: the slots of one (layer, batch, head) row are contiguous
  size_t slot = size_t(s.D) * s.elem, rows = size_t(2) * s.L * s.B * s.H;
  for (size_t r = 0; r < rows; ++r) {
    size_t off = (r * size_t(s.S) + size_t(start)) * slot;
    std::memcpy(s.kv.data() + off, src.kv.data() + off, size_t(end - start) * slot);
  }
  return true;
}

const float* OrtBackend::run(const int32_t* ids, int t, int position) {
  check_call(t, position);
  return call(ids, t, position, nullptr);
}

const float* OrtBackend::call(const int32_t* ids, int t, int position, const uint8_t* tree_mask) {
  Impl& s = *impl_;
  if (t > s.t_max) s.allocate(t);
  for (int b = 0; b < s.B; ++b)
    for (int i = 0; i < t; ++i) s.ids[size_t(b) * t + i] = ids[i];
  for (int b = 0; b < s.B; ++b) s.pos[size_t(b)] = position;
  Impl::Binding& bd = s.binding(t);
  // a tree call writes its mask into the binding's buffer (every batch row); the next chain call
  // of this T finds the lower triangle restored (tree_call)
  struct Restore {
    Impl& s;
    Impl::Binding& bd;
    int t;
    bool on;
    ~Restore() {
      if (on) s.lower_triangle(bd, t);
    }
  } restore{s, bd, t, tree_mask != nullptr};
  if (tree_mask)
    for (int b = 0; b < s.B; ++b) std::memcpy(bd.mask.data() + size_t(b) * t * t, tree_mask, size_t(t) * t);
  try {
    s.session->Run(s.run_opts, *bd.io);
  } catch (const Ort::Exception& e) {
    fail_backend("ONNX Runtime failed to run the " + role() + " graph (T=" + std::to_string(t) + ", position " +
                 std::to_string(position) + "): " + first_line(e.what()));
  }
  if (s.delta) {
    size_t row = size_t(t) * s.D * s.elem, slot = size_t(s.D) * s.elem;
    size_t delta_elems = size_t(s.B) * s.H * t * s.D;
    for (int j = 0; j < 2 * s.L; ++j) {
      const uint8_t* src = s.delta_buf.data() + size_t(j) * delta_elems * s.elem;
      uint8_t* dst = s.kv_ptr(j);
      for (int bh = 0; bh < s.B * s.H; ++bh)
        std::memcpy(dst + (size_t(bh) * s.S + size_t(position)) * slot, src + size_t(bh) * row, row);
    }
  }
  if (s.keep_feat)  // row = cache slot, batch row 0 (the rows a head drafter reads)
    std::memcpy(s.feat_store.data() + size_t(position) * s.TF, s.feat_out.data(), size_t(t) * s.TF * sizeof(float));
  return s.logits.data();
}

bool OrtBackend::takes_trees() const { return impl_->tree; }
const GraphSpec* OrtBackend::graph() const { return impl_->graph; }

const float* OrtBackend::run_tree(const int32_t* ids, int t, int position, const uint8_t* mask) {
  check_tree_call(t, position, mask);
  return call(ids, t, position, mask);
}

void OrtBackend::keep_path(int position, const std::vector<int>& path) {
  Impl& s = *impl_;
  auto moves = compaction_moves(path);
  if (moves.empty()) return;
  int last = 0;
  for (const auto& m : moves) last = std::max(last, m.first);
  if (position < 0 || position + last >= s.S)
    fail_arg("tree nodes " + std::to_string(last) + " past position " + std::to_string(position) +
             " are outside max_seq " + std::to_string(s.S));
  // [2L, B, H, S, D]: one slot of every (layer, K/V, batch, head) row per move, in the moves' order
  // (no move overwrites a later move's source); delta mode's run() already put the tree's K/V there
  size_t slot = size_t(s.D) * s.elem, rows = size_t(2) * s.L * s.B * s.H;
  for (size_t r = 0; r < rows; ++r) {
    uint8_t* row = s.kv.data() + r * size_t(s.S) * slot;
    for (const auto& [src, dst] : moves)
      std::memcpy(row + size_t(position + dst) * slot, row + size_t(position + src) * slot, slot);
  }
  // the target's feature rows kept for a head drafter are in tree order after a tree call, like the
  // K/V: the accepted path's rows go to its slots too (ort.py keep_path), so the head's next
  // catch-up reads committed token j's features at row j
  if (s.keep_feat) {
    float* rows = s.feat_store.data();
    for (const auto& [src, dst] : moves)
      std::memcpy(rows + size_t(position + dst) * s.TF, rows + size_t(position + src) * s.TF,
                  size_t(s.TF) * sizeof(float));
  }
}

}  // namespace specedge

namespace specedge {

const float* OrtBackend::run_head(const int32_t* ids, int t, int position, const float* features, const float* hidden,
                                  const float** hidden_out) {
  Impl& s = *impl_;
  if (!s.head) fail_arg("the " + role() + " graph is not a draft head's");
  check_call(t, position);
  if (t > s.t_max) s.allocate(t);
  for (int b = 0; b < s.B; ++b) {
    float* f = s.in_feat.data() + size_t(b) * t * s.F;
    float* h = s.in_hidden.data() + size_t(b) * t * s.HH;
    if (features)
      std::memcpy(f, features, size_t(t) * s.F * sizeof(float));
    else
      std::fill(f, f + size_t(t) * s.F, 0.f);
    if (hidden)
      std::memcpy(h, hidden, size_t(t) * s.HH * sizeof(float));
    else
      std::fill(h, h + size_t(t) * s.HH, 0.f);
  }
  const float* logits = run(ids, t, position);
  if (hidden_out) *hidden_out = s.out_hidden.data();
  return logits;
}

bool OrtBackend::keep_features() {
  Impl& s = *impl_;
  if (s.keep_feat) return true;
  auto it = std::find(s.extra_outputs.begin(), s.extra_outputs.end(), kFeaturesOutput);
  if (s.spec->features_dim < 1 || it == s.extra_outputs.end()) return false;
  s.extra_outputs.erase(it);
  s.keep_feat = true;
  s.TF = s.spec->features_dim;
  s.feat_store.assign(size_t(s.S) * s.TF, 0.f);
  s.allocate(s.t_max);  // sizes the output buffer and drops the bindings made without it
  return true;
}

const float* OrtBackend::features() const { return impl_->keep_feat ? impl_->feat_store.data() : nullptr; }

int OrtBackend::feature_dim() const { return impl_->keep_feat ? impl_->TF : 0; }

int OrtBackend::hidden_size() const { return impl_->head ? impl_->HH : 0; }

}  // namespace specedge
