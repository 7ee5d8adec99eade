"""The oldest onnxruntime that runs a bundle, checked before a session is made.

It follows the graphs' ONNX opset (the manifest's graph `opset`, absent = 24), found by running
graphs on each release:

- opset 24 (today's default graphs: TensorScatter for the in-place KV cache, RMSNormalization):
  onnxruntime 1.23 refuses to load them; 1.24.1, the first 1.24 release, runs the tiny bundles and
  the default bundle (see docs/security.md). pyproject.toml's `onnxruntime>=` floor is this
  version (a test keeps the two equal): what pip installs must run every bundle.
- opset 21 (the blocked int4 DequantizeLinear of a --tensorrt bundle's int4 graphs): 1.20.1 runs
  them, 1.17.3 refuses them.
- opset 18 (--tensorrt bundles for TensorRT below 10.15: delta graphs, per-channel int8
  DequantizeLinear): 1.17.3 runs them, so does 1.23.0, the onnxruntime-gpu of NVIDIA's Jetson AI
  Lab index for JetPack 6 (docs/jetson.md).
"""

from __future__ import annotations

import re

ORT_MIN_VERSION = "1.24.1"
# (highest opset, oldest onnxruntime measured to run it), ascending
OPSET_FLOORS = ((20, "1.17.3"), (21, "1.20.1"), (24, ORT_MIN_VERSION))


def _parts(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0].split("dev")[0])[:3])


def required_version(opset: int) -> str:
    """The oldest onnxruntime that runs a graph of ai.onnx `opset`."""
    return next((v for top, v in OPSET_FLOORS if opset <= top), ORT_MIN_VERSION)


def bundle_opset(manifest) -> int:
    """The highest opset among the bundle's model graphs (what its onnxruntime must run)."""
    from ..manifest import GRAPH_OPSET

    opsets = [g.onnx_opset for s in (manifest.target, manifest.draft, manifest.head) if s is not None for g in s.graphs]
    return max(opsets, default=GRAPH_OPSET)


def check_onnxruntime_version(version: str, opset: int = 24) -> None:
    """Refuse an onnxruntime older than the graphs of `opset` need, with one sentence naming both
    versions and what to do."""
    from .backends.base import BackendError

    need = required_version(opset)
    if _parts(version) < _parts(need):
        jetson = (
            "; on a Jetson, whose onnxruntime-gpu comes from NVIDIA's index, export the bundle with "
            "`export-models --tensorrt VERSION` (docs/jetson.md)"
            if need == ORT_MIN_VERSION
            else ""
        )
        raise BackendError(
            f"onnxruntime {version} is too old: this bundle's graphs (ONNX opset {opset}) need onnxruntime >= "
            f"{need}; pip install -U 'onnxruntime>={need}'{jetson}"
        )
