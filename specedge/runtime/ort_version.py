"""The oldest onnxruntime this specedge runs on, checked before a session is made.

pyproject.toml's `onnxruntime>=` floor is this version (a test keeps the two equal). It was found
by running the runtime on each older release: the exported graphs use ONNX opset 24
(TensorScatter for the in-place KV cache), which onnxruntime 1.23 refuses to load; 1.24.1, the
first 1.24 release, runs the tiny bundles and the default bundle (see docs/security.md).
"""

from __future__ import annotations

import re

ORT_MIN_VERSION = "1.24.1"


def _parts(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0].split("dev")[0])[:3])


def check_onnxruntime_version(version: str) -> None:
    """Refuse an onnxruntime older than ORT_MIN_VERSION with one sentence saying what to do."""
    from .backends.base import BackendError

    if _parts(version) < _parts(ORT_MIN_VERSION):
        raise BackendError(
            f"onnxruntime {version} is too old: specedge's graphs need onnxruntime >= {ORT_MIN_VERSION} "
            f"(ONNX opset 24); pip install -U 'onnxruntime>={ORT_MIN_VERSION}'"
        )
