// Fake TensorRT (cpp/tests/fake_tensorrt, see fake_gpu.h): NvInfer.h includes the runtime API (the builder API of the
// real header is not faked: the runtime never builds engines).
#ifndef NV_INFER_H
#define NV_INFER_H
#include "NvInferRuntime.h"
#endif  // NV_INFER_H
