"""specedge: speculative decoding for edge and datacenter NVIDIA GPUs and CPUs."""

import os as _os

__version__ = "0.1.0"

# ONNX Runtime's Linux build creates a telemetry database (~/.cache/Microsoft/DeveloperTools/
# .onnxruntime/onnxruntime.db and a deviceid file) when it loads, unless ORT_DISABLE_TELEMETRY=1:
# specedge leaves the user's home alone (docs/security.md); ORT_DISABLE_TELEMETRY=0 lets it write.
_os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
