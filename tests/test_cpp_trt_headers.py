"""The C++ TensorRT backend compiles (`-fsyntax-only -Wall -Wextra`, no warning) against the
runtime headers of each TensorRT a Jetson has: 10.3 (JetPack 6) as well as the newer ones.

TensorRT is not installed here and its headers are not committed: set SPECEDGE_TRT_INCLUDES to
`LABEL=DIR` pairs separated by `:` (each DIR holding NvInferRuntime.h, e.g. `include/` of an
NVIDIA/TensorRT OSS release tag: `git archive v10.3.0 include | tar -x`), and SPECEDGE_CUDA_INCLUDE
to a folder with cuda_runtime_api.h (default /usr/local/cuda/include). Skipped without them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("trt_backend.cpp", "trt_plan.cpp", "backend.cpp", "engine.cpp", "drafters/head.cpp")


def _includes() -> list[tuple[str, str]]:
    text = os.environ.get("SPECEDGE_TRT_INCLUDES", "")
    return [tuple(p.split("=", 1)) for p in text.split(":") if "=" in p]


@pytest.mark.parametrize(
    "label,include",
    _includes()
    or [
        pytest.param(
            "", "", marks=pytest.mark.skip(reason="SPECEDGE_TRT_INCLUDES not set (TensorRT headers are not committed)")
        )
    ],
)
@pytest.mark.parametrize("source", SOURCES)
def test_trt_backend_compiles_against_tensorrt_headers(label, include, source):
    cxx = shutil.which("g++") or shutil.which("c++")
    cuda = os.environ.get("SPECEDGE_CUDA_INCLUDE", "/usr/local/cuda/include")
    ort = REPO / "third_party" / "onnxruntime" / "include"
    if not cxx or not (Path(cuda) / "cuda_runtime_api.h").is_file() or not ort.is_dir():
        pytest.skip("needs g++, CUDA runtime headers and third_party/onnxruntime (scripts/cpp_setup.sh)")
    assert (Path(include) / "NvInferRuntime.h").is_file(), f"{include} has no NvInferRuntime.h ({label})"
    res = subprocess.run(
        [
            cxx,
            "-std=c++17",
            "-fsyntax-only",
            "-Wall",
            "-Wextra",
            "-DSPECEDGE_WITH_TENSORRT=1",
            "-I",
            str(REPO / "cpp" / "include"),
            "-I",
            str(REPO / "cpp" / "src"),
            "-isystem",
            str(ort),
            "-isystem",
            include,
            "-isystem",
            cuda,
            str(REPO / "cpp" / "src" / source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0 and "warning" not in res.stderr, f"TensorRT {label}:\n{res.stderr[-4000:]}"
