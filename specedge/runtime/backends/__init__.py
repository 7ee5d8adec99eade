"""Backends: ONNX Runtime (CPU/CUDA/TensorRT EP), native TensorRT and torch, behind one interface.

`create_backend(name, manifest, spec, ...)` is the registry. Backend modules are imported lazily,
by module and class name, so a build without the GPU modules (or without their packages) still
runs on the CPU; asking for a backend whose module is absent is a `BackendError`, one sentence.

Which tokens a backend's cache holds (prefill, rollback, prefix reuse) is runtime/cache.py.
"""

from __future__ import annotations

import importlib
import importlib.util

from .base import Backend, BackendError, SessionOptions

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendError",
    "SessionOptions",
    "backend_class",
    "create_backend",
    "resolve_backend_name",
]

# name -> (module in this package, class name). `auto` is resolved by `resolve_backend_name`.
BACKENDS: dict[str, tuple[str, str]] = {
    "ort-cpu": ("ort", "OrtBackend"),
    "ort-cuda": ("ort_cuda", "OrtCudaBackend"),
    "ort-trt": ("ort_cuda", "OrtTrtBackend"),
    "tensorrt": ("tensorrt_backend", "TensorRTBackend"),
    "torch": ("torch_backend", "TorchBackend"),
}
NAMES = ("auto", *BACKENDS)


def _cuda_provider_available() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - onnxruntime is a hard dependency
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


def _module_present(module: str) -> bool:
    return importlib.util.find_spec(f"{__name__}.{module}") is not None


def resolve_backend_name(name: str) -> str:
    """`auto` -> `ort-cuda` when onnxruntime-gpu's CUDA provider is usable (and the module is in
    this build), else `ort-cpu`; any other valid name is returned as is."""
    if not isinstance(name, str) or name not in NAMES:
        raise BackendError(f"unknown backend '{name}'; valid backends: {', '.join(NAMES)}")
    if name != "auto":
        return name
    if _cuda_provider_available() and _module_present(BACKENDS["ort-cuda"][0]):
        return "ort-cuda"
    return "ort-cpu"


def backend_class(name: str) -> type[Backend]:
    module, cls = BACKENDS[resolve_backend_name(name)]
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{module}":
            raise BackendError(f"backend '{name}' is not available in this build") from None
        raise
    klass = getattr(mod, cls, None)
    if klass is None:
        raise BackendError(f"backend '{name}' is not available in this build")
    return klass


def create_backend(name: str, manifest, spec, threads: int | None = None, providers=None, **opts) -> Backend:
    """Create backend `name` for `spec` (manifest.target or manifest.draft).

    threads: intra-op threads (ONNX Runtime backends); providers: ONNX Runtime execution providers
    (names or (name, options) pairs). Backends that take neither refuse them with a BackendError
    rather than ignoring them; `opts` go to the backend's constructor as keywords.
    """
    real = resolve_backend_name(name)
    if not spec.is_model:
        raise BackendError(f"the {spec.role} is an n-gram drafter: it has no graph to run on backend '{real}'")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise BackendError(f"threads must be a positive integer, got {threads!r}")
    klass = backend_class(real)
    taken = klass.session_kwargs(SessionOptions(threads=threads, providers=providers))
    for key, value in (("threads", threads), ("providers", providers)):
        if value is not None and key not in taken:
            raise BackendError(f"backend '{real}' does not take {key}")
    return klass(manifest, spec, **{**taken, **opts})
