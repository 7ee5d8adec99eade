"""Backends: ONNX Runtime (CPU/CUDA/TensorRT EP), native TensorRT and torch, behind one interface.

`create_backend(name, manifest, spec, ...)` is the registry. Backend modules are imported lazily,
by module and class name, so a build without the GPU modules (or without their packages) still
runs on the CPU; asking for a backend whose module is absent is a `BackendError`, one sentence.

Also here: `run_chunked`, the prefill helper every model owner (generator, model drafter) uses.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import numpy as np

from .base import Backend, BackendError

__all__ = ["BACKENDS", "Backend", "BackendError", "create_backend", "resolve_backend_name", "run_chunked"]

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
    try:
        params = inspect.signature(klass.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover - C extension classes
        params = {}
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, value in (("threads", threads), ("providers", providers)):
        if value is None:
            continue
        if key in params or takes_kwargs:
            opts[key] = value
        else:
            raise BackendError(f"backend '{real}' does not take {key}")
    return klass(manifest, spec, **opts)


def run_chunked(backend: Backend, ids, position: int, chunk: int) -> np.ndarray:
    """Feed `ids` from `position` in calls of at most `chunk` tokens; return the last row's logits
    ([V], a view valid until the backend's next call). The prefill of every model goes through
    here, so equal chunk boundaries give bit-identical caches (prefix reuse relies on it)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError("nothing to feed")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    logits = None
    for start in range(0, ids.size, chunk):
        part = ids[start : start + chunk]
        logits = backend.run(part, position + start)
    return logits[-1]


def common_prefix(a, b, limit: int | None = None) -> int:
    """Length of the longest common prefix of two token sequences (at most `limit`)."""
    n = min(len(a), len(b))
    if limit is not None:
        n = min(n, limit)
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class CacheTracker:
    """Which tokens occupy a backend's cache slots: feeding, rollback and exact prefix reuse.

    `tokens[i]` is the token whose K/V sit in slot i; `position == len(tokens)` is where the next
    call writes. Rolling back is forgetting the tail (the graph masks slots >= position).

    `exact` counts the leading slots written by whole prefill chunks aligned at slot 0. A new
    request may keep those slots when its prompt starts with the same tokens: a fresh run would
    compute them with the very same calls, so reuse is bit-identical to starting from scratch
    (slots written by T=1 or verification calls could round differently and are never reused).
    """

    def __init__(self, backend: Backend, chunk: int):
        if chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
        self.backend = backend
        self.chunk = int(chunk)
        self.tokens: list[int] = []
        self.exact = 0

    @property
    def position(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []
        self.exact = 0

    def rollback(self, position: int) -> None:
        """Keep the first `position` slots (the graph masks the rest; they get overwritten)."""
        if position < len(self.tokens):
            del self.tokens[position:]
        self.exact = min(self.exact, position)

    def reuse(self, prompt, keep_last: bool = True) -> int:
        """Roll back to the longest chunk-aligned exact prefix shared with `prompt` and return its
        length. keep_last leaves at least the prompt's last token to feed (its logits are needed)."""
        limit = min(self.exact, len(prompt) - 1 if keep_last else len(prompt))
        n = common_prefix(self.tokens, prompt, max(limit, 0))
        n = (n // self.chunk) * self.chunk
        self.rollback(n)
        return n

    def feed(self, ids) -> np.ndarray:
        """Run `ids` (one call) at the current position; logits [T, V] (view until the next call)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        logits = self.backend.run(ids, len(self.tokens))
        self.tokens.extend(ids.tolist())
        return logits

    def feed_argmax(self, ids) -> np.ndarray:
        """Like feed, but only each row's argmax (int64 [T]): GPU backends compute it on the
        device and copy T integers instead of [T, V] logits."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        best = self.backend.argmax(ids, len(self.tokens))
        self.tokens.extend(ids.tolist())
        return best

    def feed_chunked(self, ids) -> np.ndarray:
        """Feed `ids` in calls of at most `chunk` tokens; return the last row's logits [V]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        start = len(self.tokens)
        aligned = start == self.exact and start % self.chunk == 0
        row = run_chunked(self.backend, ids, start, self.chunk)
        self.tokens.extend(ids.tolist())
        if aligned:
            self.exact = start + (ids.size // self.chunk) * self.chunk
        return row
