// Fake CUDA runtime (cpp/tests/fake_tensorrt, see fake_gpu.h): cuda_runtime.h includes the runtime API.
#ifndef SPECEDGE_FAKE_CUDA_RUNTIME_H
#define SPECEDGE_FAKE_CUDA_RUNTIME_H
#include "cuda_runtime_api.h"
#endif  // SPECEDGE_FAKE_CUDA_RUNTIME_H
