#!/usr/bin/env bash
# The whole test suite, as CI runs it (after scripts/setup.sh):
#  1. export the default bundle if bundles/smollm2-135m-instruct has none (the real-model tests
#     use it), checking that `export-models --quiet` writes nothing on stderr;
#  2. scripts/cpp_setup.sh: as root, installs g++, cmake, nlohmann-json, Catch2 and libssl-dev with
#     apt and unpacks ONNX Runtime's headers into third_party/ (docs/cpp.md);
#  3. build the C++ runtime (release, and the unit tests with AddressSanitizer) and run ctest;
#  4. pytest, slow real-model tests included, one worker per core (pytest-xdist; whole files per
#     worker, so a module's fixtures are made once; the tiny bundles are shared across workers,
#     tests/conftest.py). GPU tests skip with their reason without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
if [ ! -f bundles/smollm2-135m-instruct/manifest.json ]; then
  echo "== exporting the default bundle"
  # --quiet means nothing on stderr (no third-party progress bars either): checked here, on the real model.
  err=$(export-models --quiet 2>&1 >/dev/null) || { echo "$err"; exit 1; }
  if [ -n "$err" ]; then echo "export-models --quiet wrote to stderr:"; echo "$err"; exit 1; fi
fi
echo "== building the C++ runtime"
bash scripts/cpp_setup.sh
cmake -S cpp -B cpp/build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build cpp/build -j2 >/dev/null
cmake -S cpp -B cpp/build-asan -DSPECEDGE_ASAN=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build cpp/build-asan -j2 --target specedge_tests >/dev/null
ctest --test-dir cpp/build --output-on-failure
echo "== pytest"
python -m pytest -q -ra -n auto --dist loadfile -m "slow or not slow" "$@"
