#include "backend.h"

#include "error.h"
#include "ort_backend.h"
#ifdef SPECEDGE_WITH_TENSORRT
#include "trt_backend.h"
#endif

namespace specedge {

const char* no_tensorrt_message() {
  return "backend 'tensorrt' is not available: this libspecedge was built without TensorRT (NvInfer.h was not "
         "found at build time); rebuild with `cmake -DTENSORRT_ROOT=<TensorRT install>` on a machine with TensorRT "
         "and the CUDA toolkit (on JetPack: sudo apt install libnvinfer-dev)";
}

void Backend::check_call(int t, int position) const {
  if (t < 1) fail_arg("input_ids must hold at least one token");
  if (position < 0 || position + t > max_seq_)
    fail_arg(std::to_string(t) + " tokens at position " + std::to_string(position) + " do not fit max_seq " +
             std::to_string(max_seq_));
}

bool tensorrt_compiled() {
#ifdef SPECEDGE_WITH_TENSORRT
  return true;
#else
  return false;
#endif
}

std::vector<std::string> backend_names() {
  std::vector<std::string> names{"auto", "ort-cpu"};
  if (tensorrt_compiled()) names.push_back("tensorrt");
  return names;
}

void check_backend_name(const std::string& name) {
  if (name.empty() || name == "auto" || name == "ort-cpu") return;
  if (name == "tensorrt") {
    if (!tensorrt_compiled()) fail_arg(no_tensorrt_message());
    return;
  }
  std::string avail;
  for (const auto& n : backend_names()) avail += (avail.empty() ? "" : ", ") + n;
  fail_arg("backend '" + name + "' is not available in this build (available: " + avail + ")");
}

std::string resolve_backend_name(const std::string& name) {
  check_backend_name(name);
  return (name.empty() || name == "auto") ? "ort-cpu" : name;
}

std::unique_ptr<Backend> make_backend(const Manifest& m, const ModelSpec& spec, const BackendOptions& opts) {
  std::string name = resolve_backend_name(opts.backend);
#ifdef SPECEDGE_WITH_TENSORRT
  if (name == "tensorrt") return std::make_unique<TrtBackend>(m, spec, opts);
#endif
  BackendOptions o = opts;
  o.backend = name;
  return std::make_unique<OrtBackend>(m, spec, o);
}

}  // namespace specedge
