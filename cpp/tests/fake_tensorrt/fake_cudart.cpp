// The fake CUDA runtime on the CPU: see fake_gpu.h for what it simulates and what not.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fake_gpu.h"

struct CUstream_st {
  std::deque<fake_gpu::Op> queue;
  bool capturing = false, invalidated = false;
  std::vector<fake_gpu::Op> captured;
};
struct CUgraph_st {
  std::vector<fake_gpu::Op> ops;
};
struct CUgraphExec_st {
  std::vector<fake_gpu::Op> ops;
};

namespace fake_gpu {
namespace {

struct Alloc {
  size_t bytes;
  Where kind;
  void* raw;  // what free() takes
};

struct State {
  std::recursive_mutex mu;
  std::map<uintptr_t, Alloc> allocs;  // by address
  std::set<cudaStream_t> streams;
  std::set<cudaGraph_t> graphs;
  std::set<cudaGraphExec_t> execs;
  CUstream_st null_stream;  // stream 0
  cudaError_t last = cudaSuccess, sticky = cudaSuccess;
  int device = 0;
  long captures = 0, launches = 0, steps = 0;

  ~State() {  // at exit: what the program never gave back
    size_t bytes = 0;
    for (const auto& [p, a] : allocs) bytes += a.bytes;
    if (!allocs.empty())
      report(std::to_string(allocs.size()) + " allocations (" + std::to_string(bytes) + " bytes) never freed");
    if (!streams.empty()) report(std::to_string(streams.size()) + " streams never destroyed");
    if (!graphs.empty() || !execs.empty())
      report(std::to_string(graphs.size() + execs.size()) + " graphs never destroyed");
    const char* env = std::getenv("SPECEDGE_FAKE_GPU_STATS");
    if (env && *env && std::string(env) != "0")
      report("captures=" + std::to_string(captures) + " graph_launches=" + std::to_string(launches) +
             " engine_steps=" + std::to_string(steps));
    for (auto& [p, a] : allocs) std::free(a.raw);
  }
};

State& st() {
  static State s;
  return s;
}

int device_count() {
  const char* env = std::getenv("SPECEDGE_FAKE_GPU_COUNT");
  return env && *env ? std::atoi(env) : 1;
}

// Every API call returns through here: the sticky error wins, a failure is remembered for cudaGetLastError.
cudaError_t ret(cudaError_t e) {
  State& s = st();
  if (s.sticky != cudaSuccess) e = s.sticky;
  if (e != cudaSuccess) s.last = e;
  return e;
}

CUstream_st* stream_of(cudaStream_t h) {
  State& s = st();
  if (!h) return &s.null_stream;
  return s.streams.count(h) ? h : nullptr;
}

cudaError_t allocate(void** out, size_t n, Where kind) {
  State& s = st();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  if (!out) return ret(cudaErrorInvalidValue);
  for (cudaStream_t h : s.streams)
    if (h->capturing) {  // cudaMalloc is not stream-ordered: forbidden while a stream captures
      h->invalidated = true;
      return ret(cudaErrorStreamCaptureUnsupported);
    }
  size_t padded = (std::max<size_t>(n, 1) + 255) / 256 * 256;
  void* raw = std::aligned_alloc(256, padded);
  if (!raw) return ret(cudaErrorMemoryAllocation);
  std::memset(raw, 0xFF, padded);
  s.allocs[reinterpret_cast<uintptr_t>(raw)] = Alloc{n, kind, raw};
  *out = raw;
  return ret(cudaSuccess);
}

cudaError_t release(void* p, Where kind) {
  State& s = st();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  if (!p) return ret(cudaSuccess);
  auto it = s.allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.allocs.end() || it->second.kind != kind) {
    report(std::string(kind == Where::Device ? "cudaFree" : "cudaFreeHost") + " of a pointer it did not allocate");
    return ret(kind == Where::Device ? cudaErrorInvalidDevicePointer : cudaErrorInvalidValue);
  }
  if (kind == Where::Device) {  // cudaFree synchronizes the device first
    for (cudaStream_t h : s.streams) cudaStreamSynchronize(h);
    cudaStreamSynchronize(nullptr);
  }
  std::free(it->second.raw);
  s.allocs.erase(it);
  return ret(cudaSuccess);
}

// The range a 2-D copy touches: (height - 1) rows of pitch and one of width.
size_t span(size_t pitch, size_t width, size_t height) { return height ? pitch * (height - 1) + width : 0; }

const char* where_name(Where w) { return w == Where::Device ? "device" : w == Where::Host ? "pinned host" : "no"; }

// Direction and bounds of a copy: the ranges must lie in allocations of the kinds `kind` names.
cudaError_t check_copy(void* dst, size_t n_dst, const void* src, size_t n_src, cudaMemcpyKind kind) {
  if (n_dst == 0 && n_src == 0) return cudaSuccess;
  Where want_dst, want_src;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      want_dst = Where::Device, want_src = Where::Host;
      break;
    case cudaMemcpyDeviceToHost:
      want_dst = Where::Host, want_src = Where::Device;
      break;
    case cudaMemcpyDeviceToDevice:
      want_dst = Where::Device, want_src = Where::Device;
      break;
    default:
      report("copy kind " + std::to_string(int(kind)) + " is not one the runtime should use");
      return cudaErrorInvalidMemcpyDirection;
  }
  Where d = where(dst, n_dst), s = where(src, n_src);
  if (d != want_dst || s != want_src) {
    report("copy of kind " + std::to_string(int(kind)) + " from " + where_name(s) + " memory (" +
           std::to_string(n_src) + " bytes) to " + where_name(d) + " memory (" + std::to_string(n_dst) +
           " bytes): outside its allocations or the wrong direction");
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // namespace

Where where(const void* p, size_t n) {
  State& s = st();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  auto a = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocs.upper_bound(a);
  if (it == s.allocs.begin()) return Where::None;
  --it;
  if (a + n > it->first + it->second.bytes || a + n < a) return Where::None;
  return it->second.kind;
}

cudaError_t enqueue(cudaStream_t h, Op op) {
  State& s = st();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  CUstream_st* x = stream_of(h);
  if (!x) return cudaErrorInvalidResourceHandle;
  if (x->capturing)
    x->captured.push_back(std::move(op));
  else
    x->queue.push_back(std::move(op));
  return cudaSuccess;
}

bool valid_stream(cudaStream_t h) { return stream_of(h) != nullptr; }

bool capturing(cudaStream_t h) {
  CUstream_st* x = stream_of(h);
  return x && x->capturing;
}

void invalidate_capture(cudaStream_t h) {
  CUstream_st* x = stream_of(h);
  if (x && x->capturing) x->invalidated = true;
}

void report(const std::string& msg) {
  bool own = msg.rfind("fake ", 0) == 0;
  std::fprintf(stderr, "%s%s\n", own ? "" : "fake cudart: ", msg.c_str());
}

void count_engine_step() { ++st().steps; }

}  // namespace fake_gpu

using fake_gpu::ret;
using fake_gpu::st;
using fake_gpu::Where;

extern "C" {

cudaError_t cudaMalloc(void** devPtr, size_t size) { return fake_gpu::allocate(devPtr, size, Where::Device); }
cudaError_t cudaMallocHost(void** ptr, size_t size) { return fake_gpu::allocate(ptr, size, Where::Host); }
cudaError_t cudaFree(void* devPtr) { return fake_gpu::release(devPtr, Where::Device); }
cudaError_t cudaFreeHost(void* ptr) { return fake_gpu::release(ptr, Where::Host); }

cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  if (count && fake_gpu::where(devPtr, count) != Where::Device) {
    fake_gpu::report("cudaMemsetAsync of " + std::to_string(count) + " bytes outside device memory");
    return ret(cudaErrorInvalidValue);
  }
  return ret(fake_gpu::enqueue(stream, [=] {
    if (count && fake_gpu::where(devPtr, count) != Where::Device) {
      fake_gpu::report("a queued cudaMemsetAsync found its memory freed");
      return false;
    }
    std::memset(devPtr, value, count);
    return true;
  }));
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream) {
  cudaError_t e = fake_gpu::check_copy(dst, count, src, count, kind);
  if (e != cudaSuccess) return ret(e);
  return ret(fake_gpu::enqueue(stream, [=] {
    if (fake_gpu::check_copy(dst, count, src, count, kind) != cudaSuccess) return false;
    std::memmove(dst, src, count);
    return true;
  }));
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t stream) {
  if (width > dpitch || width > spitch) return ret(cudaErrorInvalidPitchValue);
  const size_t nd = fake_gpu::span(dpitch, width, height), ns = fake_gpu::span(spitch, width, height);
  cudaError_t e = fake_gpu::check_copy(dst, nd, src, ns, kind);
  if (e != cudaSuccess) return ret(e);
  return ret(fake_gpu::enqueue(stream, [=] {
    if (fake_gpu::check_copy(dst, nd, src, ns, kind) != cudaSuccess) return false;
    for (size_t r = 0; r < height; ++r)
      std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
    return true;
  }));
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return ret(cudaErrorInvalidValue);
  *count = fake_gpu::device_count();
  return ret(*count > 0 ? cudaSuccess : cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= fake_gpu::device_count()) return ret(cudaErrorInvalidDevice);
  st().device = device;
  return ret(cudaSuccess);
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  if (!prop) return ret(cudaErrorInvalidValue);
  if (device < 0 || device >= fake_gpu::device_count()) return ret(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "%s", fake_gpu::kGpuName);
  prop->totalGlobalMem = size_t(8) << 30;
  prop->major = fake_gpu::kCcMajor;
  prop->minor = fake_gpu::kCcMinor;
  return ret(cudaSuccess);
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidPitchValue:
      return "cudaErrorInvalidPitchValue";
    case cudaErrorInvalidDevicePointer:
      return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection:
      return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState:
      return "cudaErrorIllegalState";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureUnmatched:
      return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureImplicit:
      return "cudaErrorStreamCaptureImplicit";
    case cudaErrorStreamCaptureWrongThread:
      return "cudaErrorStreamCaptureWrongThread";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    default:
      return cudaGetErrorName(error);
  }
}

cudaError_t cudaGetLastError(void) {
  fake_gpu::State& s = st();
  cudaError_t e = s.sticky != cudaSuccess ? s.sticky : s.last;
  s.last = cudaSuccess;
  return e;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
  if (!pStream || (flags & ~unsigned(cudaStreamNonBlocking))) return ret(cudaErrorInvalidValue);
  std::lock_guard<std::recursive_mutex> g(st().mu);
  *pStream = new CUstream_st;
  st().streams.insert(*pStream);
  return ret(cudaSuccess);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> g(st().mu);
  if (!stream || !st().streams.count(stream)) return ret(cudaErrorInvalidResourceHandle);
  if (!stream->queue.empty()) {  // CUDA finishes the work first; the runtime should have synchronized
    fake_gpu::report("stream destroyed with " + std::to_string(stream->queue.size()) + " operations pending");
    cudaStreamSynchronize(stream);
  }
  st().streams.erase(stream);
  delete stream;
  return ret(cudaSuccess);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  fake_gpu::State& s = st();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  CUstream_st* x = fake_gpu::stream_of(stream);
  if (!x) return ret(cudaErrorInvalidResourceHandle);
  if (x->capturing) {
    x->invalidated = true;
    return ret(cudaErrorStreamCaptureUnsupported);
  }
  while (!x->queue.empty()) {
    fake_gpu::Op op = std::move(x->queue.front());
    x->queue.pop_front();
    if (s.sticky == cudaSuccess && !op()) s.sticky = cudaErrorIllegalAddress;
  }
  return ret(cudaSuccess);
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  std::lock_guard<std::recursive_mutex> g(st().mu);
  if (!stream) return ret(cudaErrorStreamCaptureUnsupported);  // the legacy stream cannot capture
  CUstream_st* x = fake_gpu::stream_of(stream);
  if (!x) return ret(cudaErrorInvalidResourceHandle);
  if (x->capturing) return ret(cudaErrorIllegalState);
  if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed)
    return ret(cudaErrorInvalidValue);
  x->capturing = true;
  x->invalidated = false;
  x->captured.clear();
  return ret(cudaSuccess);
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
  std::lock_guard<std::recursive_mutex> g(st().mu);
  CUstream_st* x = fake_gpu::stream_of(stream);
  if (!x || !pGraph) return ret(cudaErrorInvalidValue);
  if (!x->capturing) return ret(cudaErrorIllegalState);
  x->capturing = false;
  *pGraph = nullptr;
  std::vector<fake_gpu::Op> ops = std::move(x->captured);
  x->captured.clear();
  if (x->invalidated) return ret(cudaErrorStreamCaptureInvalidated);
  *pGraph = new CUgraph_st{std::move(ops)};
  st().graphs.insert(*pGraph);
  ++st().captures;
  return ret(cudaSuccess);
}

cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* pGraphExec, cudaGraph_t graph, unsigned long long flags) {
  std::lock_guard<std::recursive_mutex> g(st().mu);
  if (!pGraphExec || !graph || !st().graphs.count(graph)) return ret(cudaErrorInvalidValue);
  *pGraphExec = new CUgraphExec_st{graph->ops};
  st().execs.insert(*pGraphExec);
  return ret(cudaSuccess);
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> g(st().mu);
  if (!graphExec || !st().execs.count(graphExec)) return ret(cudaErrorInvalidResourceHandle);
  if (!fake_gpu::valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
  ++st().launches;
  for (const auto& op : graphExec->ops) fake_gpu::enqueue(stream, op);
  return ret(cudaSuccess);
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  std::lock_guard<std::recursive_mutex> g(st().mu);
  if (!graph || !st().graphs.erase(graph)) return ret(cudaErrorInvalidValue);
  delete graph;
  return ret(cudaSuccess);
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
  std::lock_guard<std::recursive_mutex> g(st().mu);
  if (!graphExec || !st().execs.erase(graphExec)) return ret(cudaErrorInvalidValue);
  delete graphExec;
  return ret(cudaSuccess);
}

}  // extern "C"
