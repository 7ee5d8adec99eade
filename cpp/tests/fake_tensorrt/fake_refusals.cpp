// fake_refusals PLAN: checks that the fakes refuse what TensorRT and CUDA refuse (fake_gpu.h), on a FAKE-TRT-PLAN
// whose first input is input_ids [B, T]. One line per check ("ok: ..." or "FAILED: ..."); exit 0 when all pass.
// Run by tests/test_cpp_trt_fake.py: these are the refusals the runtime never reaches when it is right.
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Logger : nvinfer1::ILogger {
  std::string last;
  void log(Severity severity, const char* msg) noexcept override {
    if (severity <= Severity::kERROR) last = msg;
  }
};

int failures = 0;

void check(bool ok, const std::string& what, const Logger& log, const char* want = nullptr) {
  ok = ok && (!want || log.last.find(want) != std::string::npos);
  std::printf("%s: %s%s\n", ok ? "ok" : "FAILED", what.c_str(), ok ? "" : (" (last error: " + log.last + ")").c_str());
  failures += !ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return std::fprintf(stderr, "usage: fake_refusals PLAN\n"), 2;
  std::ifstream in(argv[1], std::ios::binary);
  std::string plan((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Logger log;
  std::unique_ptr<nvinfer1::IRuntime> rt(nvinfer1::createInferRuntime(log));
  std::unique_ptr<nvinfer1::ICudaEngine> eng(rt->deserializeCudaEngine(plan.data(), plan.size()));
  if (!eng) return std::fprintf(stderr, "cannot load %s: %s\n", argv[1], log.last.c_str()), 2;
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const int64_t batch = eng->getProfileShape("input_ids", 0, nvinfer1::OptProfileSelector::kMIN).d[0];
  const int64_t t_max = eng->getProfileShape("input_ids", 0, nvinfer1::OptProfileSelector::kMAX).d[1];
  std::unique_ptr<nvinfer1::IExecutionContext> ctx(
      eng->createExecutionContext(nvinfer1::ExecutionContextAllocationStrategy::kUSER_MANAGED));

  check(!ctx->setOptimizationProfileAsync(eng->getNbOptimizationProfiles(), s), "a profile out of range", log,
        "profileIndex");
  check(!ctx->enqueueV3(s), "enqueueV3 before the input shape is set", log, "allInputDimensionsSpecified");
  nvinfer1::Dims d{};
  d.nbDims = 2;
  d.d[0] = batch;
  d.d[1] = t_max + 1;
  check(!ctx->setInputShape("input_ids", d), "an input shape past the profile's T range", log, "T = ");
  d.d[0] = batch + 1;
  d.d[1] = 1;
  check(!ctx->setInputShape("input_ids", d), "another batch than the engine's", log, "input_ids");
  d.d[0] = batch;
  check(ctx->setInputShape("input_ids", d), "an input shape inside the profile", log);
  check(!ctx->setTensorAddress("no_such_tensor", nullptr), "an unknown tensor name", log, "no_such_tensor");

  std::vector<void*> bufs;
  for (int i = 0; i < eng->getNbIOTensors(); ++i) {
    void* p = nullptr;
    cudaMalloc(&p, 1 << 20);
    bufs.push_back(p);
  }
  const char* first = eng->getIOTensorName(0);
  check(!ctx->setTensorAddress(first, static_cast<char*>(bufs[0]) + 64), "an address not 256-byte aligned", log,
        "256-byte aligned");
  for (int i = 0; i + 1 < eng->getNbIOTensors(); ++i) ctx->setTensorAddress(eng->getIOTensorName(i), bufs[size_t(i)]);
  check(!ctx->enqueueV3(s), "enqueueV3 with an address missing", log, "address of tensor");
  const int last = eng->getNbIOTensors() - 1;
  ctx->setTensorAddress(eng->getIOTensorName(last), bufs[size_t(last)]);
  check(!ctx->enqueueV3(s), "a kUSER_MANAGED context without device memory", log, "device memory");
  void* scratch = nullptr;
  cudaMalloc(&scratch, size_t(eng->getDeviceMemorySizeV2()));
  ctx->setDeviceMemoryV2(scratch, eng->getDeviceMemorySizeV2());

  cudaGraph_t g = nullptr;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  check(!ctx->enqueueV3(s), "a captured enqueueV3 before one outside capture", log, "capturing");
  check(cudaStreamEndCapture(s, &g) == cudaErrorStreamCaptureInvalidated && !g, "that capture is invalidated", log);
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  check(cudaStreamSynchronize(s) == cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize while capturing", log);
  cudaStreamEndCapture(s, &g);
  cudaGetLastError();

  void* host = nullptr;
  cudaMallocHost(&host, 4096);
  check(cudaMemcpyAsync(bufs[0], bufs[1], 64, cudaMemcpyHostToDevice, s) == cudaErrorInvalidValue,
        "a host-to-device copy from device memory", log);
  check(cudaMemcpyAsync(host, bufs[0], 4097, cudaMemcpyDeviceToHost, s) == cudaErrorInvalidValue,
        "a copy past the end of an allocation", log);
  cudaGetLastError();
  for (void* p : bufs) cudaFree(p);
  cudaFree(scratch);
  cudaFreeHost(host);
  cudaStreamDestroy(s);
  return failures ? 1 : 0;
}
