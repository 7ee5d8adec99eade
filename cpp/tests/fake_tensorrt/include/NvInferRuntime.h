// Fake TensorRT (cpp/tests/fake_tensorrt, see fake_gpu.h): the subset of NVIDIA/TensorRT v10.3.0's
// include/NvInferRuntime.h (tag v10.3.0, commit c5b9de37f7ef9034e2efc621c664145c7c12436e) that
// cpp/src/trt_backend.cpp uses: the same classes, method signatures (noexcept, const, default arguments) and enum
// values. The real methods forward to an implementation object; these are defined in fake_nvinfer.cpp. Never used
// in a release build.
#ifndef NV_INFER_RUNTIME_H
#define NV_INFER_RUNTIME_H

#include "NvInferRuntimeBase.h"

namespace nvinfer1 {

class IExecutionContext;
class ICudaEngine;

namespace apiv {
class VRuntime;
class VCudaEngine;
class VExecutionContext;
}  // namespace apiv

class INoCopy {
 protected:
  INoCopy() = default;
  virtual ~INoCopy() = default;
  INoCopy(INoCopy const& other) = delete;
  INoCopy& operator=(INoCopy const& other) = delete;
  INoCopy(INoCopy&& other) = delete;
  INoCopy& operator=(INoCopy&& other) = delete;
};

enum class OptProfileSelector : int32_t {
  kMIN = 0,
  kOPT = 1,
  kMAX = 2,
};

enum class ExecutionContextAllocationStrategy : int32_t {
  kSTATIC = 0,
  kON_PROFILE_CHANGE = 1,
  kUSER_MANAGED = 2,
};

class IRuntime : public INoCopy {
 public:
  virtual ~IRuntime() noexcept;
  ICudaEngine* deserializeCudaEngine(void const* blob, std::size_t size) noexcept;

 protected:
  apiv::VRuntime* mImpl;
};

class ICudaEngine : public INoCopy {
 public:
  virtual ~ICudaEngine() noexcept;
  Dims getTensorShape(char const* tensorName) const noexcept;
  DataType getTensorDataType(char const* tensorName) const noexcept;
  IExecutionContext* createExecutionContext(
      ExecutionContextAllocationStrategy strategy = ExecutionContextAllocationStrategy::kSTATIC) noexcept;
  TensorIOMode getTensorIOMode(char const* tensorName) const noexcept;
  [[deprecated]] size_t getDeviceMemorySize() const noexcept;  // TRT_DEPRECATED in 10.3
  int64_t getDeviceMemorySizeV2() const noexcept;
  int32_t getNbOptimizationProfiles() const noexcept;
  Dims getProfileShape(char const* tensorName, int32_t profileIndex, OptProfileSelector select) const noexcept;
  int32_t getNbIOTensors() const noexcept;
  char const* getIOTensorName(int32_t index) const noexcept;

 protected:
  apiv::VCudaEngine* mImpl;
};

class IExecutionContext : public INoCopy {
 public:
  virtual ~IExecutionContext() noexcept;
  void setDeviceMemory(void* memory) noexcept;  // deprecated (documented) in 10.1, not marked
  void setDeviceMemoryV2(void* memory, int64_t size) noexcept;
  bool setInputShape(char const* tensorName, Dims const& dims) noexcept;
  Dims getTensorShape(char const* tensorName) const noexcept;
  bool setOptimizationProfileAsync(int32_t profileIndex, cudaStream_t stream) noexcept;
  bool setTensorAddress(char const* tensorName, void* data) noexcept;
  bool enqueueV3(cudaStream_t stream) noexcept;

 protected:
  apiv::VExecutionContext* mImpl;
};

}  // namespace nvinfer1

extern "C" TENSORRTAPI void* createInferRuntime_INTERNAL(void* logger, int32_t version) noexcept;

namespace nvinfer1 {
namespace {
inline IRuntime* createInferRuntime(ILogger& logger) noexcept {
  return static_cast<IRuntime*>(createInferRuntime_INTERNAL(&logger, NV_TENSORRT_VERSION));
}
}  // namespace
}  // namespace nvinfer1

#endif  // NV_INFER_RUNTIME_H
