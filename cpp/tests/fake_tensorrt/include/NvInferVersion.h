// Fake TensorRT (cpp/tests/fake_tensorrt, see fake_gpu.h): the version macros of NVIDIA/TensorRT v10.3.0's
// include/NvInferVersion.h (tag v10.3.0, commit c5b9de37f7ef9034e2efc621c664145c7c12436e): the fake is TensorRT 10.3,
// JetPack 6's, the oldest TensorRT the runtime supports.
#ifndef NV_INFER_VERSION_H
#define NV_INFER_VERSION_H

#define NV_TENSORRT_MAJOR 10
#define NV_TENSORRT_MINOR 3
#define NV_TENSORRT_PATCH 0
#define NV_TENSORRT_BUILD 26

#endif  // NV_INFER_VERSION_H
