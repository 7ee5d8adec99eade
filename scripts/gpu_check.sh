#!/usr/bin/env bash
# GPU check for specedge: every GPU path reachable on the machine, in a fixed order with the most
# valuable figures first, each step under its own time budget (total under 8 minutes), its JSON
# written as it goes (a call stopped by its limit still returns what it measured):
#
#   exports          export-models of the default model, fp16 and fp32 with an int4 self-draft, in
#                    the background (the steps below wait for them); the device's copy bandwidth
#   pytest_gpu       pytest -m gpu (pass/skip/fail counts; the draft head beside a torch and an
#                    ort-cuda target among them), while the exports run
#   ort_cuda_fp16    ort-cuda on the fp16 bundle: greedy speculative = target-only (n-gram; and the
#                    self-draft through load()), with and without ONNX Runtime's CUDA graphs; tok/s
#   torch_module     the torch backend on the same model (fp16), the same loop: the figures to set
#                    ort-cuda's against; where a step's time goes
#   ort_io_binding   no host copies of the cache per step (ONNX Runtime profile + bound addresses)
#   ort_cuda_fp32    ort-cuda on the fp32 bundle, as for fp16
#   torch_trees      the torch backend's tree calls: tree output = target-only, tree vs chain tok/s
#                    at the tree sizes the cost model picks on this GPU
#   torch_module_more  the torch backend at the other --dtypes (bf16); --compile adds torch.compile
#
# Prints a short table last; writes ${OUT:-gpu_out}/gpu_check.json (and gpu_check.log,
# pytest_gpu.log / .xml, export_*.log). scripts/gpu_check.py --help lists the options (--steps, --budget, --dtypes ...).
# On an offline host, scripts/offline_gpu_pack.py carries onnxruntime-gpu, gguf and the default
# model there and runs this script (docs/gpu.md).
#
#   scripts/gpu_check.sh [gpu_check.py options]
#
# Installs nothing by default. Environment:
#   PYTHON            interpreter (default: python3)
#   SPECEDGE_WHEELS   a folder of wheels to install offline first (--no-index --no-deps)
# Exit code: 0 when every step passed or had nothing to check (no GPU: nothing at all), 1 otherwise.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-gpu_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  reason="no CUDA GPU"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    reason="an NVIDIA GPU is present but $PY's torch cannot use it (CPU-only build, or torch missing)"
  fi
  echo "gpu_check: skipped: $reason"
  printf '{"skipped": "%s"}\n' "$reason" >"$OUT_DIR/gpu_check.json"
  exit 0
fi

if [[ -n "${SPECEDGE_WHEELS:-}" ]]; then
  site="${SPECEDGE_SITE:-/tmp/specedge-site}"
  echo "gpu_check: installing wheels from $SPECEDGE_WHEELS into $site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$SPECEDGE_WHEELS"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# onnxruntime-gpu's CUDA provider loads the CUDA 13 libraries (cuBLAS, cuDNN, cuFFT, cuRAND) by
# name: those of the pip packages torch runs on, wherever they are installed.
nv_libs=$("$PY" -c 'import glob, os, nvidia
print(":".join(sorted({os.path.dirname(f) for p in nvidia.__path__ for f in glob.glob(os.path.join(p, "**", "lib*.so*"), recursive=True)})))' 2>/dev/null || true)
if [[ -n "$nv_libs" ]]; then export LD_LIBRARY_PATH="$nv_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PY" - <<'EOF' || true
try:
    import onnxruntime as ort
    p = ort.get_available_providers()
    print("onnxruntime", ort.__version__, "providers:", ", ".join(p))
    if "CUDAExecutionProvider" not in p:
        print("note: onnxruntime-gpu is not installed: the ort-cuda / ort-trt backends are not checked")
except ImportError:
    print("note: onnxruntime is not installed")
try:
    import tensorrt
    print("tensorrt", tensorrt.__version__)
except ImportError:
    print("note: tensorrt is not installed: the tensorrt backend is not checked")
EOF

# Every step and its budget: gpu_check.py --budget (450 s) plus start-up, under the 8 minutes.
# The log is kept beside the JSON: a device call's reply holds only the end of the output.
set +e
timeout 470 "$PY" scripts/gpu_check.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
