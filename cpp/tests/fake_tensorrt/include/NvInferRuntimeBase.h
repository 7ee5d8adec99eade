// Fake TensorRT (cpp/tests/fake_tensorrt, see fake_gpu.h): the subset of NVIDIA/TensorRT v10.3.0's
// include/NvInferRuntimeBase.h (tag v10.3.0, commit c5b9de37f7ef9034e2efc621c664145c7c12436e) that
// cpp/src/trt_backend.cpp uses, with the same names, signatures and enum values. Never used in a release build.
#ifndef NV_INFER_RUNTIME_BASE_H
#define NV_INFER_RUNTIME_BASE_H

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "NvInferVersion.h"

#define TENSORRTAPI __attribute__((visibility("default")))
#define NV_TENSORRT_VERSION_INT(major, minor, patch) ((major) * 10000L + (minor) * 100L + (patch) * 1L)
#define NV_TENSORRT_VERSION NV_TENSORRT_VERSION_INT(NV_TENSORRT_MAJOR, NV_TENSORRT_MINOR, NV_TENSORRT_PATCH)

namespace nvinfer1 {

using char_t = char;
using AsciiChar = char_t;

enum class DataType : int32_t {
  kFLOAT = 0,
  kHALF = 1,
  kINT8 = 2,
  kINT32 = 3,
  kBOOL = 4,
  kUINT8 = 5,
  kFP8 = 6,
  kBF16 = 7,
  kINT64 = 8,
  kINT4 = 9,
};

class Dims64 {
 public:
  static constexpr int32_t MAX_DIMS{8};
  int32_t nbDims;
  int64_t d[MAX_DIMS];
};
using Dims = Dims64;

class ILogger {
 public:
  enum class Severity : int32_t {
    kINTERNAL_ERROR = 0,
    kERROR = 1,
    kWARNING = 2,
    kINFO = 3,
    kVERBOSE = 4,
  };
  virtual void log(Severity severity, AsciiChar const* msg) noexcept = 0;
  ILogger() = default;
  virtual ~ILogger() = default;

 protected:
  ILogger(ILogger const&) = default;
  ILogger(ILogger&&) = default;
  ILogger& operator=(ILogger const&) & = default;
  ILogger& operator=(ILogger&&) & = default;
};

enum class TensorIOMode : int32_t {
  kNONE = 0,
  kINPUT = 1,
  kOUTPUT = 2,
};

}  // namespace nvinfer1

extern "C" TENSORRTAPI int32_t getInferLibVersion() noexcept;

#endif  // NV_INFER_RUNTIME_BASE_H
