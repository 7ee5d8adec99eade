// Native TensorRT backend; see trt_backend.h. Compiled only with SPECEDGE_WITH_TENSORRT (CMake found NvInfer.h and
// the CUDA runtime). Written against the TensorRT 10 C++ API (NvInferRuntime.h) and the CUDA runtime API.
#include "trt_backend.h"

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "error.h"
#include "sha256.h"
#include "tree.h"
#include "trt_plan.h"

#if NV_TENSORRT_MAJOR < 10
#error "the specedge TensorRT backend needs TensorRT 10 or newer (NvInferRuntime.h of TensorRT 10)"
#endif
#if NV_TENSORRT_MAJOR > 10 || NV_TENSORRT_MINOR >= 1
#define SPECEDGE_TRT_MEMORY_V2 1  // getDeviceMemorySizeV2 / setDeviceMemoryV2 (TensorRT >= 10.1)
#endif

namespace specedge {

namespace fs = std::filesystem;
using nvinfer1::DataType;

namespace {

std::string first_line(const std::string& s) {
  auto p = s.find('\n');
  return p == std::string::npos ? s : s.substr(0, p);
}

std::string mib(size_t bytes) { return std::to_string((bytes + (1u << 20) - 1) >> 20) + " MiB"; }

std::string cuda_error(cudaError_t e) { return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e); }

// Every CUDA call goes through here: a failure is one sentence naming the call and CUDA's error.
void cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so that later calls are not blamed for it
  fail_backend(std::string("CUDA call ") + what + " failed (" + cuda_error(e) + ")");
}

// TensorRT's messages: errors are kept for the exception that follows; warnings go to stderr. SPECEDGE_TRT_LOG =
// none | error | warning (default) | info | verbose chooses what is printed (errors only when set explicitly).
class Logger : public nvinfer1::ILogger {
 public:
  Logger() {
    const char* env = std::getenv("SPECEDGE_TRT_LOG");
    std::string v = env ? env : "";
    explicit_ = !v.empty();
    if (v == "none")
      level_ = -1;
    else if (v == "error")
      level_ = int(Severity::kERROR);
    else if (v == "info")
      level_ = int(Severity::kINFO);
    else if (v == "verbose")
      level_ = int(Severity::kVERBOSE);
    else
      level_ = int(Severity::kWARNING);
  }

  void log(Severity severity, const char* msg) noexcept override {
    try {
      std::string m = msg ? msg : "";
      bool is_error = severity == Severity::kERROR || severity == Severity::kINTERNAL_ERROR;
      if (is_error) {
        std::lock_guard<std::mutex> g(mu_);
        last_error_ = m;
      }
      if (int(severity) <= level_ && (!is_error || explicit_))
        std::fprintf(stderr, "specedge: TensorRT %s: %s\n", name(severity), m.c_str());
    } catch (...) {
      // never let an exception leave a TensorRT callback
    }
  }

  // The last error TensorRT logged (cleared).
  std::string take_error() {
    std::lock_guard<std::mutex> g(mu_);
    std::string e = first_line(last_error_);
    last_error_.clear();
    return e;
  }

 private:
  static const char* name(Severity s) {
    switch (s) {
      case Severity::kINTERNAL_ERROR:
        return "internal error";
      case Severity::kERROR:
        return "error";
      case Severity::kWARNING:
        return "warning";
      case Severity::kINFO:
        return "info";
      default:
        return "verbose";
    }
  }
  std::mutex mu_;
  std::string last_error_;
  int level_ = int(Severity::kWARNING);
  bool explicit_ = false;
};

// ---------------------------------------------------------------- RAII for CUDA resources

struct DeviceMem {
  void* p = nullptr;
  size_t bytes = 0;
  DeviceMem() = default;
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  DeviceMem(DeviceMem&& o) noexcept : p(o.p), bytes(o.bytes) {
    o.p = nullptr;
    o.bytes = 0;
  }
  ~DeviceMem() {
    if (p) cudaFree(p);
  }
  void alloc(size_t n, const std::string& what) {
    void* q = nullptr;
    cudaError_t e = cudaMalloc(&q, std::max<size_t>(n, 1));
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail_backend("cannot allocate " + what + " on the GPU (" + mib(n) + "): " + cuda_error(e));
    }
    if (p) cudaFree(p);
    p = q;
    bytes = n;
  }
  uint8_t* u8() const { return static_cast<uint8_t*>(p); }
};

struct HostMem {  // pinned, so that async copies are truly async and capturable
  void* p = nullptr;
  size_t bytes = 0;
  HostMem() = default;
  HostMem(const HostMem&) = delete;
  HostMem& operator=(const HostMem&) = delete;
  ~HostMem() {
    if (p) cudaFreeHost(p);
  }
  void alloc(size_t n, const std::string& what) {
    void* q = nullptr;
    cudaError_t e = cudaMallocHost(&q, std::max<size_t>(n, 1));
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail_backend("cannot allocate " + what + " in pinned host memory (" + mib(n) + "): " + cuda_error(e));
    }
    if (p) cudaFreeHost(p);
    p = q;
    bytes = n;
  }
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (s) cudaStreamDestroy(s);
  }
};

struct GraphExec {
  cudaGraphExec_t g = nullptr;
  GraphExec() = default;
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  GraphExec(GraphExec&& o) noexcept : g(o.g) { o.g = nullptr; }
  ~GraphExec() {
    if (g) cudaGraphExecDestroy(g);
  }
};

// ---------------------------------------------------------------- TensorRT types

const char* dtype_name(DataType t) {
  switch (t) {
    case DataType::kFLOAT:
      return "float32";
    case DataType::kHALF:
      return "float16";
    case DataType::kBF16:
      return "bfloat16";
    case DataType::kINT64:
      return "int64";
    case DataType::kINT32:
      return "int32";
    case DataType::kINT8:
      return "int8";
    case DataType::kUINT8:
      return "uint8";
    case DataType::kBOOL:
      return "bool";
    case DataType::kFP8:
      return "fp8";
    case DataType::kINT4:
      return "int4";
    default:
      return "another type";
  }
}

// Bytes per element (an upper bound for packed and unknown types: buffers are sized with it).
size_t dtype_size(DataType t) {
  switch (t) {
    case DataType::kFLOAT:
    case DataType::kINT32:
      return 4;
    case DataType::kHALF:
    case DataType::kBF16:
      return 2;
    case DataType::kINT64:
      return 8;
    case DataType::kINT8:
    case DataType::kUINT8:
    case DataType::kBOOL:
    case DataType::kFP8:
    case DataType::kINT4:
      return 1;
    default:
      return 8;
  }
}

std::string dims_string(const nvinfer1::Dims& d) {
  if (d.nbDims < 0) return "(unknown)";
  std::string s = "[";
  for (int i = 0; i < d.nbDims; ++i) s += (i ? ", " : "") + std::to_string(d.d[i]);
  return s + "]";
}

std::string shape_string(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + (v[i] < 0 ? std::string("T") : std::to_string(v[i]));
  return s + "]";
}

bool env_off(const char* name) {
  const char* v = std::getenv(name);
  return v && (std::string(v) == "0" || std::string(v) == "off" || std::string(v) == "false");
}

}  // namespace

struct TrtBackend::Impl {
  // Declaration order is destruction order reversed: graphs and contexts go first, then the engine, the runtime,
  // the buffers (the contexts' scratch memory among them), the stream, and the logger last.
  Logger logger;
  Stream stream;
  DeviceMem kv, ids, pos, mask, logits, delta, argmax, scratch;
  std::map<std::string, DeviceMem> extras;  // named extra outputs: bound; hidden_states read only after keep_features()
  HostMem ids_host, pos_host, mask_host, logits_host;
  // keep_features(): the features output of each call (batch row 0) comes back to feat_host, and every slot's
  // row lives in feat_store [S, TF], like the cache, for a head drafter on the CPU
  HostMem feat_host;
  std::vector<float> feat_store;
  bool keep_feat = false;
  int TF = 0;
  std::unique_ptr<nvinfer1::IRuntime> runtime;
  std::unique_ptr<nvinfer1::ICudaEngine> engine;
  struct Ctx {
    std::unique_ptr<nvinfer1::IExecutionContext> ctx;
    int bound_t = 0;  // T of the current shape and addresses (0 = none yet)
    GraphExec graph;  // exact-shape profiles, once captured
  };
  std::vector<Ctx> contexts;  // one per optimization profile

  const ModelSpec* spec = nullptr;
  std::string role, kv_mode, bundle;
  bool delta_mode = false, has_argmax = false, graphs_on = true;
  bool tree = false;  // the graph takes tree calls: every call binds tree_mask [B, T, T] (lower-triangular for chains)
  int B = 1, S = 0, V = 0, t_max = 0, device = 0;
  trt::KVLayout cache;
  std::vector<trt::Profile> profiles;
  std::string graph_note;

  size_t argmax_elem = 8;  // bytes of one argmax entry (int64 or int32, as built)

  // loading, in the order the constructor runs them
  struct Device {
    std::string gpu, cc, trt_version;
  };
  std::string rebuild(bool force = false) const;
  Device open_device();
  std::string read_plan(const Manifest& m, const Device& dev, const std::string& verify, trt::PlanInfo* info,
                        std::string* plan_path);
  void load_engine(std::string data, const std::string& plan_path);
  std::vector<std::string> check_io(std::vector<std::string>* want_out);
  void check_profiles(const trt::PlanInfo& info, const std::string& plan_path);
  void allocate();
  void make_contexts();
  void allocate_extras(const std::vector<std::string>& outs, const std::vector<std::string>& want_out);

  ~Impl() {
    if (stream.s) cudaStreamSynchronize(stream.s);  // nothing may still use the buffers freed next
  }

  [[noreturn]] void fail_trt(const std::string& what) {
    std::string e = logger.take_error();
    fail_backend(what + (e.empty() ? "" : " (TensorRT: " + e + ")"));
  }

  uint8_t* base(trt::Buffer b) {
    switch (b) {
      case trt::Buffer::InputIds:
        return ids.u8();
      case trt::Buffer::Position:
        return pos.u8();
      case trt::Buffer::TreeMask:
        return mask.u8();
      case trt::Buffer::Logits:
        return logits.u8();
      case trt::Buffer::Cache:
        return kv.u8();
      case trt::Buffer::Delta:
        return delta.u8();
      case trt::Buffer::Argmax:
        return argmax.u8();
    }
    return nullptr;
  }

  // Shape of input_ids and the address of every tensor, for a call of T = t (only when T changed).
  void bind(Ctx& c, int t) {
    if (c.bound_t == t) return;
    nvinfer1::Dims d{};
    d.nbDims = 2;
    d.d[0] = B;
    d.d[1] = t;
    if (!c.ctx->setInputShape("input_ids", d))
      fail_trt("TensorRT refused input_ids of shape [" + std::to_string(B) + ", " + std::to_string(t) + "] for the " +
               role);
    for (const auto& b : trt::binding_plan(*spec, kv_mode, S, t, B, has_argmax, tree))
      if (!c.ctx->setTensorAddress(b.name.c_str(), base(b.buffer) + b.offset))
        fail_trt("TensorRT refused the address of '" + b.name + "' of the " + role);
    for (auto& [name, mem] : extras)
      if (!c.ctx->setTensorAddress(name.c_str(), mem.p)) fail_trt("TensorRT refused the address of '" + name + "'");
    c.bound_t = t;
  }

  // Input copies + the engine, on our stream. Returns false (with *why) instead of throwing when `why` is given.
  bool enqueue(Ctx& c, int t, std::string* why = nullptr) {
    cudaError_t e = cudaMemcpyAsync(ids.p, ids_host.p, 8 * size_t(B) * size_t(t), cudaMemcpyHostToDevice, stream.s);
    if (e == cudaSuccess) e = cudaMemcpyAsync(pos.p, pos_host.p, 8 * size_t(B), cudaMemcpyHostToDevice, stream.s);
    if (e == cudaSuccess && tree)
      e = cudaMemcpyAsync(mask.p, mask_host.p, size_t(B) * size_t(t) * size_t(t), cudaMemcpyHostToDevice, stream.s);
    if (e != cudaSuccess) {
      if (!why) cuda_check(e, "cudaMemcpyAsync (inputs to the GPU)");  // throws
      cudaGetLastError();
      *why = "cudaMemcpyAsync: " + cuda_error(e);
      return false;
    }
    if (!c.ctx->enqueueV3(stream.s)) {
      if (!why) fail_trt("TensorRT failed to run the " + role + " engine (T=" + std::to_string(t) + ")");
      std::string te = logger.take_error();
      *why = "enqueueV3 failed" + (te.empty() ? "" : ": " + te);
      return false;
    }
    return true;
  }

  // After a plain enqueue of this (exact) shape, capture the same work as a CUDA graph to replay from now on. A
  // failure turns graphs off for this backend, with the reason on stderr; the step itself has already run.
  void capture(Ctx& c, int t) {
    cuda_check(cudaStreamSynchronize(stream.s), "cudaStreamSynchronize");
    std::string why;
    cudaError_t e = cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
      why = "cudaStreamBeginCapture: " + cuda_error(e);
    } else {
      bool ok = enqueue(c, t, &why);
      cudaGraph_t graph = nullptr;
      e = cudaStreamEndCapture(stream.s, &graph);
      if (ok && e != cudaSuccess) why = "cudaStreamEndCapture: " + cuda_error(e);
      if (why.empty() && graph) {
        cudaGraphExec_t exec = nullptr;
        e = cudaGraphInstantiateWithFlags(&exec, graph, 0);
        if (e != cudaSuccess)
          why = "cudaGraphInstantiate: " + cuda_error(e);
        else
          c.graph.g = exec;
      } else if (why.empty()) {
        why = "the capture recorded no graph";
      }
      if (graph) cudaGraphDestroy(graph);
    }
    if (!why.empty()) {
      cudaGetLastError();
      graphs_on = false;
      graph_note = "CUDA graph capture failed for the " + role + " at T=" + std::to_string(t) + " (" + why +
                   "); running without CUDA graphs";
      std::fprintf(stderr, "specedge: %s\n", graph_note.c_str());
    }
  }
};

// ---- loading, step by step (the constructor below runs them in order)

// --force: the plan exists but is unusable, so a plain build-engines would keep it.
std::string TrtBackend::Impl::rebuild(bool force) const {
  return "rebuild with `specedge build-engines " + bundle + (force ? " --force`" : "`");
}

// This TensorRT and this GPU: the names the plan's folder and plan.json are checked against.
TrtBackend::Impl::Device TrtBackend::Impl::open_device() {
  Device dev;
  dev.trt_version = trt::trt_version_string(getInferLibVersion());
  trt::check_kv_mode_supported(kv_mode, dev.trt_version);
  int n_dev = 0;
  cudaError_t e = cudaGetDeviceCount(&n_dev);
  if (e != cudaSuccess || n_dev == 0) {
    cudaGetLastError();
    fail_backend("backend 'tensorrt' needs a CUDA GPU: " +
                 (e != cudaSuccess ? cuda_error(e) : std::string("no CUDA device found")));
  }
  if (device < 0 || device >= n_dev)
    fail_arg("CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(n_dev) + " found)");
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  dev.gpu.assign(prop.name, strnlen(prop.name, sizeof(prop.name)));
  while (!dev.gpu.empty() && (dev.gpu.back() == ' ' || dev.gpu.back() == '\t')) dev.gpu.pop_back();
  dev.cc = trt::cc_string(prop.major, prop.minor);
  return dev;
}

// plan.json, then the plan's bytes: both checked before TensorRT parses a byte of it.
std::string TrtBackend::Impl::read_plan(const Manifest& m, const Device& dev, const std::string& verify,
                                        trt::PlanInfo* info, std::string* plan_path) {
  const std::string folder = std::string(trt::kEnginesDir) + "/" + trt::device_tag(dev.gpu, dev.cc);
  std::error_code ec;
  if (!fs::is_regular_file(fs::path(m.root) / folder / (role + ".plan.json"), ec))
    fail_bundle(trt::no_engine_message(m.root, role, dev.gpu, dev.cc, dev.trt_version));
  *info = trt::load_plan_info(resolve_inside(m.root, folder + "/" + role + ".plan.json"));
  trt::check_compatible(*info, dev.gpu, dev.cc, dev.trt_version, bundle);
  trt::check_against_manifest(*info, m, *spec, spec->graph_for("tensorrt").path, bundle);
  const std::string path = resolve_inside(m.root, folder + "/" + info->plan_file);
  *plan_path = path;
  auto size = fs::file_size(path, ec);
  if (ec) fail_bundle("cannot read " + path + " (" + ec.message() + ") — " + rebuild());
  if (int64_t(size) != info->plan_bytes)
    fail_bundle(path + " has " + std::to_string(size) + " bytes, its plan.json says " +
                std::to_string(info->plan_bytes) + " — " + rebuild(true));
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_bundle("cannot read " + path + " — " + rebuild());
  std::string data(size_t(size), '\0');
  if (!in.read(&data[0], std::streamsize(size))) fail_bundle("cannot read " + path + " — " + rebuild());
  if (verify == "full" && sha256_hex(data) != info->plan_sha256)
    fail_bundle(path + " does not match its plan.json checksum — " + rebuild(true));
  return data;
}

void TrtBackend::Impl::load_engine(std::string data, const std::string& plan_path) {
  runtime.reset(nvinfer1::createInferRuntime(logger));
  if (!runtime) fail_trt("TensorRT could not create a runtime");
  engine.reset(runtime->deserializeCudaEngine(data.data(), data.size()));
  if (!engine) {
    std::string te = logger.take_error();
    fail_bundle("TensorRT could not load " + plan_path + (te.empty() ? "" : " (" + te + ")") + " — " + rebuild(true));
  }
}

// The engine's I/O against the graph contract: names, then types and static dimensions of every contract
// tensor (a dimension that changes with T must be dynamic, -1, or equal to it). Returns the engine's outputs.
std::vector<std::string> TrtBackend::Impl::check_io(std::vector<std::string>* want_out) {
  nvinfer1::ICudaEngine& eng = *engine;
  std::vector<std::string> ins, outs, want_in;
  for (int i = 0; i < eng.getNbIOTensors(); ++i) {
    const char* name = eng.getIOTensorName(i);
    if (!name) continue;
    nvinfer1::TensorIOMode mode = eng.getTensorIOMode(name);
    if (mode == nvinfer1::TensorIOMode::kINPUT)
      ins.emplace_back(name);
    else if (mode == nvinfer1::TensorIOMode::kOUTPUT)
      outs.emplace_back(name);
  }
  trt::expected_names(*spec, kv_mode, &want_in, want_out, tree);
  std::string problem = trt::check_graph_names(role, want_in, *want_out, ins, outs);
  if (!problem.empty()) fail_bundle(problem);
  has_argmax = std::find(outs.begin(), outs.end(), trt::kArgmaxOutput) != outs.end();
  if (has_argmax) {
    DataType t = eng.getTensorDataType(trt::kArgmaxOutput);
    if (t != DataType::kINT64 && t != DataType::kINT32)
      fail_bundle("the " + role + " engine's argmax output is " + dtype_name(t) + ", not an integer — " + rebuild());
    argmax_elem = dtype_size(t);
  }
  auto p1 = trt::binding_plan(*spec, kv_mode, S, 1, B, false, tree);
  auto p2 = trt::binding_plan(*spec, kv_mode, S, 2, B, false, tree);
  for (size_t i = 0; i < p1.size(); ++i) {
    const auto& b = p1[i];
    DataType got = eng.getTensorDataType(b.name.c_str());
    if (std::string(dtype_name(got)) != b.dtype)
      fail_bundle("the " + role + " engine's '" + b.name + "' is " + dtype_name(got) + ", the bundle says " + b.dtype +
                  " — " + rebuild());
    nvinfer1::Dims d = eng.getTensorShape(b.name.c_str());
    std::vector<int64_t> want = b.shape;
    for (size_t k = 0; k < want.size(); ++k)
      if (p2[i].shape[k] != want[k]) want[k] = -1;  // the T dimension
    bool ok = d.nbDims == int(want.size());
    for (int k = 0; ok && k < d.nbDims; ++k)
      ok = want[size_t(k)] < 0 ? (d.d[k] == -1 || d.d[k] >= 1) : d.d[k] == want[size_t(k)];
    if (!ok)
      fail_bundle("the " + role + " engine's '" + b.name + "' has shape " + dims_string(d) + ", the bundle says " +
                  shape_string(want) + " — " + rebuild());
  }
  return outs;
}

// Optimization profiles: plan.json's, as built.
void TrtBackend::Impl::check_profiles(const trt::PlanInfo& info, const std::string& plan_path) {
  nvinfer1::ICudaEngine& eng = *engine;
  profiles = info.profiles;
  if (eng.getNbOptimizationProfiles() != int(profiles.size()))
    fail_bundle(plan_path + " has " + std::to_string(eng.getNbOptimizationProfiles()) +
                " optimization profiles, its "
                "plan.json " +
                std::to_string(profiles.size()) + " — " + rebuild());
  for (size_t i = 0; i < profiles.size(); ++i) {
    const auto& p = profiles[i];
    nvinfer1::Dims lo = eng.getProfileShape("input_ids", int32_t(i), nvinfer1::OptProfileSelector::kMIN);
    nvinfer1::Dims hi = eng.getProfileShape("input_ids", int32_t(i), nvinfer1::OptProfileSelector::kMAX);
    if (lo.nbDims != 2 || hi.nbDims != 2 || lo.d[1] != p.t_min || hi.d[1] != p.t_max)
      fail_bundle("optimization profile " + std::to_string(i) + " of " + plan_path + " is " + dims_string(lo) + ".." +
                  dims_string(hi) + ", its plan.json says T = " + std::to_string(p.t_min) + ".." +
                  std::to_string(p.t_max) + " — " + rebuild());
    t_max = std::max(t_max, p.t_max);
  }
}

// Every buffer, allocated once, for the largest T of any profile.
void TrtBackend::Impl::allocate() {
  cache = trt::KVLayout::for_cache(*spec, S, B);
  double kv_bytes =
      2.0 * spec->num_layers * B * spec->num_kv_heads * double(S) * spec->head_dim * double(cache.itemsize);
  if (kv_bytes > double(int64_t(1) << 40)) fail_bundle("the " + role + " KV cache would need more than 1 TiB");
  cuda_check(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  kv.alloc(cache.total_bytes(), "the " + role + " KV cache");
  // Zeroed: stale slots are masked, but 0 x NaN from uninitialised memory would still poison the attention sum.
  cuda_check(cudaMemsetAsync(kv.p, 0, kv.bytes, stream.s), "cudaMemsetAsync");
  const size_t BT = size_t(B) * size_t(t_max);
  ids.alloc(8 * BT, "input_ids");
  pos.alloc(8 * size_t(B), "position");
  logits.alloc(4 * BT * size_t(V), "the " + role + " logits");
  if (delta_mode) delta.alloc(trt::KVLayout::for_delta(*spec, t_max, B).total_bytes(), "the delta arena");
  if (has_argmax) argmax.alloc(argmax_elem * BT, "argmax");
  ids_host.alloc(8 * BT, "input_ids");
  pos_host.alloc(8 * size_t(B), "position");
  if (tree) {
    mask.alloc(size_t(B) * size_t(t_max) * size_t(t_max), "tree_mask");
    mask_host.alloc(size_t(B) * size_t(t_max) * size_t(t_max), "tree_mask");
  }
  logits_host.alloc(4 * size_t(t_max) * size_t(V), "logits");
}

// One context per profile, sharing one scratch allocation (they run one after another on one stream).
void TrtBackend::Impl::make_contexts() {
  nvinfer1::ICudaEngine& eng = *engine;
#ifdef SPECEDGE_TRT_MEMORY_V2
  int64_t size = eng.getDeviceMemorySizeV2();
#else
  int64_t size = int64_t(eng.getDeviceMemorySize());
#endif
  if (size < 0) fail_trt("TensorRT reported no device memory size for the " + role + " engine");
  if (size > 0) scratch.alloc(size_t(size), "TensorRT's activation memory");
  for (size_t i = 0; i < profiles.size(); ++i) {
    Ctx c;
    c.ctx.reset(eng.createExecutionContext(nvinfer1::ExecutionContextAllocationStrategy::kUSER_MANAGED));
    if (!c.ctx) fail_trt("TensorRT could not create an execution context for the " + role);
#ifdef SPECEDGE_TRT_MEMORY_V2
    c.ctx->setDeviceMemoryV2(scratch.p, size);
#else
    c.ctx->setDeviceMemory(scratch.p);
#endif
    if (!c.ctx->setOptimizationProfileAsync(int32_t(i), stream.s))
      fail_trt("TensorRT refused optimization profile " + std::to_string(i) + " of the " + role);
    contexts.push_back(std::move(c));
  }
  cuda_check(cudaStreamSynchronize(stream.s), "cudaStreamSynchronize");
}

// Extra outputs other than argmax (hidden states for feature-level drafts, added by name) must be bound too:
// sized for the largest T of every profile.
void TrtBackend::Impl::allocate_extras(const std::vector<std::string>& outs, const std::vector<std::string>& want_out) {
  for (const auto& name : outs) {
    if (name == trt::kArgmaxOutput || std::find(want_out.begin(), want_out.end(), name) != want_out.end()) continue;
    size_t need = 0;
    for (size_t i = 0; i < profiles.size(); ++i) {
      nvinfer1::Dims d{};
      d.nbDims = 2;
      d.d[0] = B;
      d.d[1] = profiles[i].t_max;
      if (!contexts[i].ctx->setInputShape("input_ids", d)) fail_trt("TensorRT refused an input_ids shape");
      nvinfer1::Dims o = contexts[i].ctx->getTensorShape(name.c_str());
      size_t n = dtype_size(engine->getTensorDataType(name.c_str()));
      for (int k = 0; k < o.nbDims; ++k) {
        if (o.d[k] < 0)
          fail_bundle("the " + role + " engine's extra output '" + name + "' has a data-dependent shape " +
                      dims_string(o) + ", which this runtime cannot bind");
        n *= size_t(o.d[k]);
      }
      need = std::max(need, n);
    }
    extras[name].alloc(need, "the output '" + name + "'");
  }
}

TrtBackend::TrtBackend(const Manifest& m, const ModelSpec& spec, const BackendOptions& opts)
    : Backend(m, spec), impl_(new Impl) {
  if (!spec.is_model()) fail_bundle("the " + spec.role + " is an n-gram drafter: it has no graph to run on TensorRT");
  if (opts.verify != "full" && opts.verify != "size" && opts.verify != "none")
    fail_arg("verify must be 'full', 'size' or 'none', got '" + opts.verify + "'");
  Impl& s = *impl_;
  s.spec = &spec;
  s.role = spec.role;
  s.kv_mode = m.kv_mode;
  s.delta_mode = m.kv_mode == "delta";
  s.bundle = m.root;
  s.B = m.batch;
  s.S = m.max_seq;
  s.V = int(spec.vocab_size);
  s.device = opts.device_id;
  s.tree = spec.graph_for("tensorrt").tree;
  s.graphs_on = opts.cuda_graphs && !env_off("SPECEDGE_CUDA_GRAPHS");
  if (!s.graphs_on) s.graph_note = "CUDA graphs are off (SPECEDGE_CUDA_GRAPHS=0 or the option)";

  const Impl::Device dev = s.open_device();
  trt::PlanInfo info;
  std::string plan_path;
  s.load_engine(s.read_plan(m, dev, opts.verify, &info, &plan_path), plan_path);
  std::vector<std::string> want_out;
  const std::vector<std::string> outs = s.check_io(&want_out);
  s.check_profiles(info, plan_path);
  s.allocate();
  s.make_contexts();
  s.allocate_extras(outs, want_out);
}

TrtBackend::~TrtBackend() = default;

const std::string& TrtBackend::graph_note() const { return impl_->graph_note; }

int TrtBackend::max_call_tokens() const { return impl_->t_max; }

const float* TrtBackend::run(const int32_t* ids, int t, int position) {
  check_call(t, position);
  return call(ids, t, position, nullptr);
}

bool TrtBackend::takes_trees() const { return impl_->tree; }

const float* TrtBackend::run_tree(const int32_t* ids, int t, int position, const uint8_t* mask) {
  check_tree_call(t, position, mask);
  return call(ids, t, position, mask);
}

void TrtBackend::keep_path(int position, const std::vector<int>& path) {
  Impl& s = *impl_;
  auto moves = compaction_moves(path);
  if (moves.empty()) return;
  // one slot of every row per move, in the moves' order on our stream (no move overwrites a later move's source)
  cuda_check(cudaSetDevice(s.device), "cudaSetDevice");
  for (const trt::Copy2D& cp : trt::path_copies(s.cache, position, moves))
    cuda_check(cudaMemcpy2DAsync(s.kv.u8() + cp.dst_offset, cp.dpitch, s.kv.u8() + cp.src_offset, cp.spitch, cp.width,
                                 cp.height, cudaMemcpyDeviceToDevice, s.stream.s),
               "cudaMemcpy2DAsync (the accepted path's K/V)");
  cuda_check(cudaStreamSynchronize(s.stream.s), "cudaStreamSynchronize");
  if (s.keep_feat)  // the kept feature rows follow the K/V, as in OrtBackend::keep_path
    for (const auto& [src, dst] : moves)
      std::memcpy(s.feat_store.data() + size_t(position + dst) * size_t(s.TF),
                  s.feat_store.data() + size_t(position + src) * size_t(s.TF), size_t(s.TF) * sizeof(float));
}

// One call of t tokens at `position`; `mask` [t, t] for a tree call, null for a chain (a graph that takes trees then
// gets the lower-triangular mask).
const float* TrtBackend::call(const int32_t* ids, int t, int position, const uint8_t* mask) {
  Impl& s = *impl_;
  const int pi = trt::select_profile(s.profiles, t);
  auto* ih = static_cast<int64_t*>(s.ids_host.p);
  auto* ph = static_cast<int64_t*>(s.pos_host.p);
  auto* mh = static_cast<uint8_t*>(s.mask_host.p);
  const size_t tt = size_t(t) * size_t(t);
  for (int b = 0; b < s.B; ++b) {
    for (int i = 0; i < t; ++i) ih[size_t(b) * size_t(t) + size_t(i)] = ids[i];
    ph[b] = position;
    if (s.tree)
      for (int i = 0; i < t; ++i)
        for (int j = 0; j < t; ++j)
          mh[size_t(b) * tt + size_t(i) * size_t(t) + size_t(j)] =
              mask ? mask[size_t(i) * size_t(t) + size_t(j)] != 0 : j <= i;
  }
  cuda_check(cudaSetDevice(s.device), "cudaSetDevice");
  Impl::Ctx& c = s.contexts[size_t(pi)];
  const bool exact = s.profiles[size_t(pi)].exact();
  if (s.graphs_on && exact && c.graph.g) {
    cuda_check(cudaGraphLaunch(c.graph.g, s.stream.s), "cudaGraphLaunch");
  } else {
    s.bind(c, t);
    s.enqueue(c, t);
    if (s.graphs_on && exact) s.capture(c, t);  // this plain enqueue was the warm-up
  }
  if (s.delta_mode) {
    for (const trt::Copy2D& cp : trt::delta_copies(s.cache, trt::KVLayout::for_delta(*s.spec, t, s.B), position))
      cuda_check(cudaMemcpy2DAsync(s.kv.u8() + cp.dst_offset, cp.dpitch, s.delta.u8() + cp.src_offset, cp.spitch,
                                   cp.width, cp.height, cudaMemcpyDeviceToDevice, s.stream.s),
                 "cudaMemcpy2DAsync (new KV entries into the cache)");
  }
  cuda_check(
      cudaMemcpyAsync(s.logits_host.p, s.logits.p, 4 * size_t(t) * size_t(s.V), cudaMemcpyDeviceToHost, s.stream.s),
      "cudaMemcpyAsync (logits to the host)");
  if (s.keep_feat)  // [B, t, TF] fp32: batch row 0 is the first t rows
    cuda_check(cudaMemcpyAsync(s.feat_host.p, s.extras[kFeaturesOutput].p, 4 * size_t(t) * size_t(s.TF),
                               cudaMemcpyDeviceToHost, s.stream.s),
               "cudaMemcpyAsync (features to the host)");
  cudaError_t e = cudaStreamSynchronize(s.stream.s);
  if (e != cudaSuccess) {
    std::string te = s.logger.take_error();
    cudaGetLastError();
    fail_backend("the " + s.role + " engine failed on the GPU (T=" + std::to_string(t) + ", position " +
                 std::to_string(position) + "): " + cuda_error(e) + (te.empty() ? "" : " (TensorRT: " + te + ")"));
  }
  if (s.keep_feat)
    std::memcpy(s.feat_store.data() + size_t(position) * size_t(s.TF), s.feat_host.p, 4 * size_t(t) * size_t(s.TF));
  return static_cast<const float*>(s.logits_host.p);
}

bool TrtBackend::keep_features() {
  Impl& s = *impl_;
  if (s.keep_feat) return true;
  auto it = s.extras.find(kFeaturesOutput);
  if (s.spec->features_dim < 1 || it == s.extras.end()) return false;
  // the engine's output buffer holds [B, t_max, TF] of the largest profile (sized with the other extras)
  if (it->second.bytes < 4 * size_t(s.B) * size_t(s.t_max) * size_t(s.spec->features_dim))
    fail_bundle("the " + s.role + " engine's features output is narrower than the manifest's features.dim " +
                std::to_string(s.spec->features_dim));
  s.TF = s.spec->features_dim;
  s.feat_host.alloc(4 * size_t(s.t_max) * size_t(s.TF), "the features of one call");
  s.feat_store.assign(size_t(s.S) * size_t(s.TF), 0.f);
  s.keep_feat = true;
  return true;
}

const float* TrtBackend::features() const { return impl_->keep_feat ? impl_->feat_store.data() : nullptr; }

int TrtBackend::feature_dim() const { return impl_->keep_feat ? impl_->TF : 0; }

bool TrtBackend::copy_kv_from(const Backend& other, int start, int end) {
  const auto* o = dynamic_cast<const TrtBackend*>(&other);
  if (!o) return false;
  Impl& s = *impl_;
  const Impl& src = *o->impl_;
  const trt::KVLayout &a = s.cache, &b = src.cache;
  if (src.device != s.device || a.layers != b.layers || a.batch != b.batch || a.heads != b.heads || a.seq != b.seq ||
      a.head_dim != b.head_dim || a.itemsize != b.itemsize)
    return false;
  // the other backend's run() synchronized its stream before returning: its cache is complete
  cuda_check(cudaSetDevice(s.device), "cudaSetDevice");
  for (const trt::Copy2D& cp : trt::slot_copies(s.cache, start, end))
    cuda_check(cudaMemcpy2DAsync(s.kv.u8() + cp.dst_offset, cp.dpitch, src.kv.u8() + cp.src_offset, cp.spitch, cp.width,
                                 cp.height, cudaMemcpyDeviceToDevice, s.stream.s),
               "cudaMemcpy2DAsync (the target's K/V into the draft's cache)");
  return true;
}

}  // namespace specedge
