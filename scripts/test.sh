#!/usr/bin/env bash
# The test suite: exports the default bundle once if it is missing (the real-model tests use
# it), then runs pytest. GPU tests skip with their reason on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
if [ ! -f bundles/smollm2-135m-instruct/manifest.json ]; then
  export-models --quiet
fi
python -m pytest -q -ra "$@"
