// A fake CUDA runtime and a fake TensorRT runtime on the CPU, so that cpp/src/trt_backend.cpp builds and runs where
// neither exists (cmake -DSPECEDGE_FAKE_TENSORRT=ON, tests/test_cpp_trt_fake.py). The C++ counterpart of the Python
// fakes in tests/test_tensorrt_fake.py, and one plan format serves both. Never part of a release build.
//
// include/ declares, under the real header names (NvInferRuntime.h, NvInferRuntimeBase.h, NvInferVersion.h,
// NvInfer.h, cuda_runtime_api.h, cuda_runtime.h), exactly the subset of TensorRT 10.3's and CUDA's runtime APIs
// that trt_backend.cpp calls, with their real signatures and enum values (NVIDIA/TensorRT tag v10.3.0, commit
// c5b9de37f7ef9034e2efc621c664145c7c12436e; CUDA 12/13 driver_types.h and cuda_runtime_api.h).
//
// What is simulated:
// * fake_cudart.cpp: one device ("NVIDIA Fake GPU", compute capability 9.0: tests/test_tensorrt_fake.py's).
//   Device memory (cudaMalloc) and pinned host memory (cudaMallocHost) are host allocations, 256-byte aligned,
//   filled with 0xFF bytes when fresh (NaN / -1: a buffer that should have been zeroed shows). Every copy and
//   memset is bounds-checked against one live allocation (cudaErrorInvalidValue otherwise), and its direction
//   against where the pointers live: the host side of a copy must be pinned memory (stricter than CUDA, which
//   also takes pageable memory outside capture). A stream queues its operations and runs them only at
//   cudaStreamSynchronize (or a synchronizing cudaFree), so a host read before the sync sees stale data; an
//   operation that finds its memory gone when it runs is an illegal address: sticky cudaErrorIllegalAddress, as a
//   faulting kernel leaves the context. While a stream captures (cudaStreamBeginCapture), its operations are
//   recorded into a graph instead; cudaStreamSynchronize and cudaMalloc during capture are refused and invalidate
//   it (cudaStreamEndCapture then says so), as in CUDA; cudaGraphLaunch enqueues the recorded operations (copies
//   read their memory when they run; engine steps keep the addresses bound at capture). Allocations, streams and
//   graphs still alive at exit are reported on stderr ("fake cudart: ... never freed").
// * fake_nvinfer.cpp: a "plan" is the FAKE-TRT-PLAN blob of tests/test_tensorrt_fake.py: a JSON object naming
//   the bundle's ONNX graph, its I/O (name, mode, dtype, shape with "T" for the call size; the argmax output the
//   real build adds) and the optimization profiles (T ranges); another blob is refused with TensorRT's
//   serialization error. The engine exposes that I/O and those profiles. An execution context refuses what the
//   real one refuses: an optimization profile out of range, an input shape outside its profile's T range or with
//   other static dimensions, an unknown tensor name, a bound address not aligned to 256 bytes, enqueueV3 with an
//   input shape unset, an address missing or (kUSER_MANAGED) no device memory, and a captured enqueueV3 that is
//   the first after a shape or profile change (TensorRT needs one enqueue outside capture then). Refusals log an
//   error through the ILogger and return false / nullptr. enqueueV3 enqueues one step that checks every bound
//   range lies in device memory, runs the graph with ONNX Runtime's C++ API on the CPU reading the inputs in place,
//   and writes every output (and argmax of the logits) to its bound address.
//
// What is not simulated: TensorRT's numerics, kernels, tactics and builder; device memory isolation (device
// pointers are host addresses, so a host read of device memory goes unnoticed); several devices; concurrency
// between streams; events. The reference is the ort-cpu backend on the same graph.
//
// SPECEDGE_FAKE_GPU_STATS=1 prints "fake cudart: captures=N graph_launches=N engine_steps=N" on stderr at exit;
// SPECEDGE_FAKE_GPU_COUNT=N reports N devices (default 1; 0 = no GPU); SPECEDGE_FAKE_TRT_STEP_US=N makes every engine
// step last N more microseconds, so that a call costs about the same whatever its T, as small calls on a GPU.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <string>

namespace fake_gpu {

constexpr const char* kGpuName = "NVIDIA Fake GPU";
constexpr int kCcMajor = 9, kCcMinor = 0;

enum class Where { None, Device, Host };
// Where [p, p + n) lies: inside one live device or pinned host allocation, else None.
Where where(const void* p, size_t n);

// An operation of a stream: returns false (after report()) when it finds its memory gone, which makes the
// context's error sticky.
using Op = std::function<bool()>;
// Queue `op` on `stream` (or record it when the stream captures). cudaErrorInvalidResourceHandle for an unknown
// stream.
cudaError_t enqueue(cudaStream_t stream, Op op);
// Whether `stream` exists / is capturing.
bool valid_stream(cudaStream_t stream);
bool capturing(cudaStream_t stream);
// A forbidden call during capture: the capture is invalidated (cudaStreamEndCapture fails).
void invalidate_capture(cudaStream_t stream);

// One line "fake cudart: <msg>" (or the fake TensorRT's prefix, given in msg) on stderr.
void report(const std::string& msg);
void count_engine_step();

}  // namespace fake_gpu
