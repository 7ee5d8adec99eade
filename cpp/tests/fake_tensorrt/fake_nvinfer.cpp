// The fake TensorRT runtime: engines from FAKE-TRT-PLAN blobs whose steps run the ONNX graph with ONNX Runtime on
// the CPU. See fake_gpu.h for what it simulates and what not.
#include <NvInferRuntime.h>
#include <onnxruntime_cxx_api.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "fake_gpu.h"

namespace nvinfer1 {
namespace {

constexpr char kPlanMagic[] = "FAKE-TRT-PLAN\n";  // tests/test_tensorrt_fake.py PLAN_MAGIC
constexpr int64_t kScratchBytes = 64 << 10;       // the engine's "activation memory"
constexpr uintptr_t kAlign = 256;

struct Tensor {
  std::string name;
  bool input = false;
  DataType dtype = DataType::kFLOAT;
  std::string dtype_name;
  std::vector<int64_t> shape;  // -1 where the plan says "T"
};

bool dtype_of(const std::string& s, DataType* t, ONNXTensorElementDataType* o, size_t* bytes) {
  static const std::map<std::string, std::tuple<DataType, ONNXTensorElementDataType, size_t>> k{
      {"float32", {DataType::kFLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, 4}},
      {"float16", {DataType::kHALF, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, 2}},
      {"bfloat16", {DataType::kBF16, ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16, 2}},
      {"int64", {DataType::kINT64, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, 8}},
      {"int32", {DataType::kINT32, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, 4}},
      {"bool", {DataType::kBOOL, ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, 1}},
  };
  auto it = k.find(s);
  if (it == k.end()) return false;
  if (t) *t = std::get<0>(it->second);
  if (o) *o = std::get<1>(it->second);
  if (bytes) *bytes = std::get<2>(it->second);
  return true;
}

Dims invalid_dims() {
  Dims d{};
  d.nbDims = -1;
  return d;
}

Dims to_dims(const std::vector<int64_t>& v) {
  Dims d{};
  d.nbDims = int32_t(v.size());
  for (size_t i = 0; i < v.size(); ++i) d.d[i] = v[i];
  return d;
}

Ort::Env& ort_env() {
  static Ort::Env env(ORT_LOGGING_LEVEL_ERROR, "fake-tensorrt");
  return env;
}

}  // namespace

namespace apiv {

class VRuntime {
 public:
  ILogger* logger = nullptr;
  void error(const std::string& msg) const { logger->log(ILogger::Severity::kERROR, msg.c_str()); }
};

class VCudaEngine {
 public:
  ILogger* logger = nullptr;
  std::vector<Tensor> io;
  std::vector<std::pair<int64_t, int64_t>> profiles;  // T ranges
  int64_t batch = 1;
  std::unique_ptr<Ort::Session> session;
  std::vector<std::string> graph_inputs, graph_outputs;

  void error(const std::string& msg) const { logger->log(ILogger::Severity::kERROR, msg.c_str()); }
  const Tensor* find(const char* name) const {
    if (!name) return nullptr;
    for (const auto& t : io)
      if (t.name == name) return &t;
    return nullptr;
  }
};

class VExecutionContext {
 public:
  const VCudaEngine* engine = nullptr;
  ExecutionContextAllocationStrategy strategy = ExecutionContextAllocationStrategy::kSTATIC;
  int profile = 0;
  int64_t t = -1;     // the call size set with setInputShape; -1: unset
  bool warm = false;  // an enqueue ran outside capture since the shape or profile last changed
  std::map<std::string, void*> addresses;
  void* memory = nullptr;
  int64_t memory_bytes = 0;

  void error(const std::string& msg) const { engine->error(msg); }
  std::vector<int64_t> shape(const Tensor& x) const {
    std::vector<int64_t> s = x.shape;
    for (auto& d : s)
      if (d < 0) d = t;
    return s;
  }
};

}  // namespace apiv

namespace {

class FakeRuntime : public IRuntime {
 public:
  explicit FakeRuntime(ILogger* logger) {
    mImpl = new apiv::VRuntime;
    mImpl->logger = logger;
  }
};

class FakeEngine : public ICudaEngine {
 public:
  explicit FakeEngine(apiv::VCudaEngine* impl) { mImpl = impl; }
};

class FakeContext : public IExecutionContext {
 public:
  explicit FakeContext(apiv::VExecutionContext* impl) { mImpl = impl; }
};

size_t element_count(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= size_t(d);
  return n;
}

// The plan's engine, or nullptr after logging why (TensorRT's serialization error for another blob).
apiv::VCudaEngine* load_plan(const apiv::VRuntime& rt, const char* blob, size_t size) {
  const size_t magic = sizeof(kPlanMagic) - 1;
  if (!blob || size < magic || std::memcmp(blob, kPlanMagic, magic) != 0) {
    rt.error(
        "1: [stdArchiveReader.cpp::StdArchiveReader::32] Error Code 1: Serialization (Serialization assertion "
        "magicTagRead == kMAGIC_TAG failed.Magic tag does not match)");
    return nullptr;
  }
  auto eng = std::make_unique<apiv::VCudaEngine>();
  eng->logger = rt.logger;
  try {
    auto plan = nlohmann::json::parse(blob + magic, blob + size);
    eng->batch = plan.at("batch").get<int64_t>();
    for (const auto& p : plan.at("profiles"))
      eng->profiles.emplace_back(p.at(0).get<int64_t>(), p.at(1).get<int64_t>());
    for (const auto& e : plan.at("io")) {
      Tensor x;
      x.name = e.at(0).get<std::string>();
      x.input = e.at(1).get<std::string>() == "input";
      x.dtype_name = e.at(2).get<std::string>();
      if (!dtype_of(x.dtype_name, &x.dtype, nullptr, nullptr)) {
        rt.error("fake TensorRT: the plan's tensor '" + x.name + "' has the unsupported type " + x.dtype_name);
        return nullptr;
      }
      for (const auto& d : e.at(3)) x.shape.push_back(d.is_string() ? -1 : d.get<int64_t>());
      eng->io.push_back(std::move(x));
    }
    Ort::SessionOptions so;
    so.SetIntraOpNumThreads(1);
    so.SetLogSeverityLevel(3);
    const std::string onnx = plan.at("onnx").get<std::string>();
    eng->session = std::make_unique<Ort::Session>(ort_env(), onnx.c_str(), so);
  } catch (const std::exception& ex) {
    rt.error(std::string("fake TensorRT: cannot read the plan: ") + ex.what());
    return nullptr;
  }
  Ort::AllocatorWithDefaultOptions alloc;
  std::vector<std::string> names;
  for (size_t i = 0; i < eng->session->GetInputCount(); ++i)
    eng->graph_inputs.push_back(eng->session->GetInputNameAllocated(i, alloc).get());
  for (size_t i = 0; i < eng->session->GetOutputCount(); ++i)
    eng->graph_outputs.push_back(eng->session->GetOutputNameAllocated(i, alloc).get());
  std::vector<std::string> graph = eng->graph_inputs, plan_io;
  graph.insert(graph.end(), eng->graph_outputs.begin(), eng->graph_outputs.end());
  for (const auto& x : eng->io)
    if (x.name != "argmax") plan_io.push_back(x.name);
  std::sort(graph.begin(), graph.end());
  std::sort(plan_io.begin(), plan_io.end());
  if (graph != plan_io) {
    rt.error("fake TensorRT: the plan's I/O is not its ONNX graph's");
    return nullptr;
  }
  return eng.release();
}

// One step of the engine with the addresses bound now: every range checked, the graph run, the outputs written.
bool run_step(const apiv::VCudaEngine& eng, const std::map<std::string, void*>& bound, int64_t t, void* memory,
              int64_t memory_bytes) {
  fake_gpu::count_engine_step();
  // a GPU's call cost, flat in T for small calls: SPECEDGE_FAKE_TRT_STEP_US microseconds per step
  static const long step_us = [] {
    const char* env = std::getenv("SPECEDGE_FAKE_TRT_STEP_US");
    return env && *env ? std::atol(env) : 0L;
  }();
  if (step_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(step_us));
  if (memory_bytes > 0) {
    if (fake_gpu::where(memory, size_t(memory_bytes)) != fake_gpu::Where::Device) {
      fake_gpu::report("fake TensorRT: the context's device memory is not device memory any more");
      return false;
    }
    std::memset(memory, 0xA5, size_t(memory_bytes));  // scratch is clobbered by every step
  }
  auto shape_of = [&](const Tensor& x) {
    std::vector<int64_t> s = x.shape;
    for (auto& d : s)
      if (d < 0) d = t;
    return s;
  };
  std::map<std::string, std::pair<void*, size_t>> range;
  for (const Tensor& x : eng.io) {
    size_t item = 0;
    dtype_of(x.dtype_name, nullptr, nullptr, &item);
    size_t n = element_count(shape_of(x)) * item;
    void* p = bound.at(x.name);
    if (fake_gpu::where(p, n) != fake_gpu::Where::Device) {
      fake_gpu::report("fake TensorRT: tensor '" + x.name + "' (" + std::to_string(n) +
                       " bytes) is not inside one device allocation: illegal address");
      return false;
    }
    range[x.name] = {p, n};
  }
  Ort::MemoryInfo mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
  std::vector<Ort::Value> feeds;
  std::vector<const char*> in_names, out_names;
  for (const auto& name : eng.graph_inputs) {
    const Tensor& x = *eng.find(name.c_str());
    ONNXTensorElementDataType ty{};
    dtype_of(x.dtype_name, nullptr, &ty, nullptr);
    std::vector<int64_t> s = shape_of(x);
    feeds.push_back(Ort::Value::CreateTensor(mem, range[name].first, range[name].second, s.data(), s.size(), ty));
    in_names.push_back(name.c_str());
  }
  for (const auto& name : eng.graph_outputs) out_names.push_back(name.c_str());
  std::vector<Ort::Value> outs;
  try {
    outs = eng.session->Run(Ort::RunOptions{nullptr}, in_names.data(), feeds.data(), feeds.size(), out_names.data(),
                            out_names.size());
  } catch (const std::exception& ex) {
    fake_gpu::report(std::string("fake TensorRT: ONNX Runtime failed: ") + ex.what());
    return false;
  }
  const float* logits = nullptr;
  for (size_t i = 0; i < outs.size(); ++i) {
    const std::string& name = eng.graph_outputs[i];
    auto info = outs[i].GetTensorTypeAndShapeInfo();
    if (info.GetShape() != shape_of(*eng.find(name.c_str()))) {
      fake_gpu::report("fake TensorRT: output '" + name + "' has another shape than the plan says");
      return false;
    }
    std::memcpy(range[name].first, outs[i].GetTensorRawData(), range[name].second);
    if (name == "logits") logits = outs[i].GetTensorData<float>();
  }
  if (const Tensor* am = eng.find("argmax")) {  // TopK(1) over the logits' last axis, as build-engines adds it
    const Tensor& lg = *eng.find("logits");
    std::vector<int64_t> s = shape_of(lg);
    const size_t V = size_t(s.back()), rows = element_count(s) / V;
    for (size_t r = 0; r < rows; ++r) {
      const float* row = logits + r * V;
      int64_t best = std::max_element(row, row + V) - row;
      if (am->dtype == DataType::kINT32)
        static_cast<int32_t*>(range["argmax"].first)[r] = int32_t(best);
      else
        static_cast<int64_t*>(range["argmax"].first)[r] = best;
    }
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------- IRuntime

IRuntime::~IRuntime() noexcept { delete mImpl; }

ICudaEngine* IRuntime::deserializeCudaEngine(void const* blob, std::size_t size) noexcept {
  apiv::VCudaEngine* impl = load_plan(*mImpl, static_cast<const char*>(blob), size);
  return impl ? new FakeEngine(impl) : nullptr;
}

// ---------------------------------------------------------------- ICudaEngine

ICudaEngine::~ICudaEngine() noexcept { delete mImpl; }

Dims ICudaEngine::getTensorShape(char const* tensorName) const noexcept {
  const Tensor* x = mImpl->find(tensorName);
  return x ? to_dims(x->shape) : invalid_dims();
}

DataType ICudaEngine::getTensorDataType(char const* tensorName) const noexcept {
  const Tensor* x = mImpl->find(tensorName);
  return x ? x->dtype : DataType::kFLOAT;
}

IExecutionContext* ICudaEngine::createExecutionContext(ExecutionContextAllocationStrategy strategy) noexcept {
  auto* c = new apiv::VExecutionContext;
  c->engine = mImpl;
  c->strategy = strategy;
  return new FakeContext(c);
}

TensorIOMode ICudaEngine::getTensorIOMode(char const* tensorName) const noexcept {
  const Tensor* x = mImpl->find(tensorName);
  return !x ? TensorIOMode::kNONE : x->input ? TensorIOMode::kINPUT : TensorIOMode::kOUTPUT;
}

size_t ICudaEngine::getDeviceMemorySize() const noexcept { return size_t(kScratchBytes); }

int64_t ICudaEngine::getDeviceMemorySizeV2() const noexcept { return kScratchBytes; }

int32_t ICudaEngine::getNbOptimizationProfiles() const noexcept { return int32_t(mImpl->profiles.size()); }

Dims ICudaEngine::getProfileShape(char const* tensorName, int32_t profileIndex,
                                  OptProfileSelector select) const noexcept {
  const Tensor* x = mImpl->find(tensorName);
  if (!x || !x->input || profileIndex < 0 || size_t(profileIndex) >= mImpl->profiles.size()) return invalid_dims();
  const auto& [lo, hi] = mImpl->profiles[size_t(profileIndex)];
  std::vector<int64_t> s = x->shape;
  for (auto& d : s)
    if (d < 0) d = select == OptProfileSelector::kMIN ? lo : hi;
  return to_dims(s);
}

int32_t ICudaEngine::getNbIOTensors() const noexcept { return int32_t(mImpl->io.size()); }

char const* ICudaEngine::getIOTensorName(int32_t index) const noexcept {
  if (index < 0 || size_t(index) >= mImpl->io.size()) return nullptr;
  return mImpl->io[size_t(index)].name.c_str();
}

// ---------------------------------------------------------------- IExecutionContext

IExecutionContext::~IExecutionContext() noexcept { delete mImpl; }

void IExecutionContext::setDeviceMemory(void* memory) noexcept {
  mImpl->memory = memory;
  mImpl->memory_bytes = kScratchBytes;
}

void IExecutionContext::setDeviceMemoryV2(void* memory, int64_t size) noexcept {
  if (size < kScratchBytes) {
    mImpl->error(
        "3: [executionContext.cpp::setDeviceMemoryV2] Error Code 3: API Usage Error (Parameter check "
        "failed, condition: size >= getDeviceMemorySizeV2())");
    return;
  }
  mImpl->memory = memory;
  mImpl->memory_bytes = size;
}

bool IExecutionContext::setInputShape(char const* tensorName, Dims const& dims) noexcept {
  const Tensor* x = mImpl->engine->find(tensorName);
  if (!x || !x->input) {
    mImpl->error(std::string("3: [executionContext.cpp::setInputShape] Error Code 3: API Usage Error (") +
                 (tensorName ? tensorName : "(null)") + " is not an input tensor)");
    return false;
  }
  const auto& [lo, hi] = mImpl->engine->profiles[size_t(mImpl->profile)];
  bool ok = dims.nbDims == int32_t(x->shape.size());
  int64_t t = -1;
  for (int i = 0; ok && i < dims.nbDims; ++i) {
    if (x->shape[size_t(i)] >= 0) {
      ok = dims.d[i] == x->shape[size_t(i)];
    } else {  // the call size T: inside the profile's range, the same wherever it appears
      ok = (t < 0 || dims.d[i] == t) && lo <= dims.d[i] && dims.d[i] <= hi;
      t = dims.d[i];
    }
  }
  if (!ok) {
    mImpl->error(
        "3: [executionContext.cpp::setInputShape] Error Code 3: API Usage Error (Parameter check failed, "
        "condition: the dimensions of '" +
        x->name +
        "' agree with the engine and lie in optimization "
        "profile " +
        std::to_string(mImpl->profile) + " (T = " + std::to_string(lo) + ".." + std::to_string(hi) + "))");
    return false;
  }
  if (t != mImpl->t) mImpl->warm = false;
  mImpl->t = t;
  return true;
}

Dims IExecutionContext::getTensorShape(char const* tensorName) const noexcept {
  const Tensor* x = mImpl->engine->find(tensorName);
  if (!x) return invalid_dims();
  std::vector<int64_t> s = mImpl->shape(*x);
  return to_dims(s);  // -1 stays while the input shape is unset
}

bool IExecutionContext::setOptimizationProfileAsync(int32_t profileIndex, cudaStream_t stream) noexcept {
  if (profileIndex < 0 || size_t(profileIndex) >= mImpl->engine->profiles.size()) {
    mImpl->error(
        "3: [executionContext.cpp::setOptimizationProfileAsync] Error Code 3: API Usage Error (Parameter "
        "check failed, condition: profileIndex >= 0 && profileIndex < mEngine.getNbOptimizationProfiles())");
    return false;
  }
  if (!fake_gpu::valid_stream(stream)) {
    mImpl->error("fake TensorRT: setOptimizationProfileAsync on a stream that does not exist");
    return false;
  }
  if (profileIndex != mImpl->profile) {  // the shapes of another profile no longer hold
    mImpl->profile = profileIndex;
    mImpl->t = -1;
    mImpl->warm = false;
  }
  return true;
}

bool IExecutionContext::setTensorAddress(char const* tensorName, void* data) noexcept {
  const Tensor* x = mImpl->engine->find(tensorName);
  if (!x) {
    mImpl->error(std::string("3: [executionContext.cpp::setTensorAddress] Error Code 3: API Usage Error (Parameter "
                             "check failed, condition: '") +
                 (tensorName ? tensorName : "(null)") + "' is an input or output tensor of the engine)");
    return false;
  }
  if (reinterpret_cast<uintptr_t>(data) % kAlign) {
    mImpl->error(
        "3: [executionContext.cpp::setTensorAddress] Error Code 3: API Usage Error (Parameter check "
        "failed, condition: (reinterpret_cast<uintptr_t>(data) % 256) == 0: the address of '" +
        x->name + "' is not 256-byte aligned)");
    return false;
  }
  if (data)
    mImpl->addresses[x->name] = data;
  else
    mImpl->addresses.erase(x->name);
  return true;
}

bool IExecutionContext::enqueueV3(cudaStream_t stream) noexcept {
  apiv::VExecutionContext& c = *mImpl;
  const apiv::VCudaEngine& eng = *c.engine;
  if (c.t < 0) {
    c.error(
        "3: [executionContext.cpp::enqueueV3] Error Code 3: API Usage Error (Parameter check failed, condition: "
        "allInputDimensionsSpecified(routine): input_ids's shape is not set)");
    return false;
  }
  for (const Tensor& x : eng.io)
    if (!c.addresses.count(x.name)) {
      c.error(
          "3: [executionContext.cpp::enqueueV3] Error Code 3: API Usage Error (Parameter check failed, "
          "condition: the address of tensor '" +
          x.name + "' is set)");
      return false;
    }
  if (c.strategy == ExecutionContextAllocationStrategy::kUSER_MANAGED && !c.memory) {
    c.error(
        "3: [executionContext.cpp::enqueueV3] Error Code 3: API Usage Error (Parameter check failed, "
        "condition: device memory is set (kUSER_MANAGED context without setDeviceMemory))");
    return false;
  }
  if (!fake_gpu::valid_stream(stream)) {
    c.error("fake TensorRT: enqueueV3 on a stream that does not exist");
    return false;
  }
  if (fake_gpu::capturing(stream)) {
    if (!c.warm) {
      c.error(
          "1: [executionContext.cpp::enqueueV3] Error Code 1: Cuda Runtime (operation not permitted when stream "
          "is capturing: the first enqueueV3 after a shape or profile change must run outside capture)");
      fake_gpu::invalidate_capture(stream);
      return false;
    }
  } else {
    c.warm = true;
  }
  const apiv::VCudaEngine* e = &eng;
  std::map<std::string, void*> bound = c.addresses;  // a captured enqueue keeps the addresses bound now
  int64_t t = c.t, bytes = c.memory ? c.memory_bytes : 0;
  void* memory = c.memory;
  return fake_gpu::enqueue(stream, [e, bound, t, memory, bytes] { return run_step(*e, bound, t, memory, bytes); }) ==
         cudaSuccess;
}

}  // namespace nvinfer1

extern "C" {

int32_t getInferLibVersion() noexcept { return int32_t(NV_TENSORRT_VERSION); }

void* createInferRuntime_INTERNAL(void* logger, int32_t version) noexcept {
  auto* l = static_cast<nvinfer1::ILogger*>(logger);
  if (version != NV_TENSORRT_VERSION) {
    l->log(nvinfer1::ILogger::Severity::kERROR, "fake TensorRT: the caller was built against another TensorRT");
    return nullptr;
  }
  return new nvinfer1::FakeRuntime(l);
}

}  // extern "C"
