"""The backend interface: one model's graph on one device, with its static KV cache.

A backend allocates its buffers once, binds the static KV cache once, and runs the graph for a
given number of new tokens T at a write offset `position`. The generator owns `position`:
rolling back rejected draft tokens is just calling `run` with a smaller position next time, since
the graph masks every slot at or beyond `position + t` (DESIGN.md, graph contract).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ...errors import BackendError
from ...manifest import Manifest, ModelSpec

__all__ = ["Backend", "BackendError"]


class Backend(ABC):
    name: str = ""

    def __init__(self, manifest: Manifest, spec: ModelSpec):
        self.manifest = manifest
        self.spec = spec
        self.max_seq = manifest.max_seq
        self.kv_mode = manifest.kv_mode
        self.vocab_size = spec.vocab_size

    @abstractmethod
    def run(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        """Feed `input_ids` (int64 [T]) written at cache slots position..position+T-1 and return
        fp32 logits [T, V] (a view that stays valid until the next call)."""

    def argmax(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        """Greedy fast path: int64 [T] argmax of each row. GPU backends override it to avoid copying
        the full logits to the host."""
        return np.argmax(self.run(input_ids, position), axis=-1)

    def copy_kv_from(self, other: Backend, start: int, end: int) -> bool:
        """Overwrite this model's cache slots [start, end) with `other`'s (a self-draft taking
        the target's prompt K/V instead of computing its own). False when this backend cannot
        (another backend type, another cache geometry); the caller then feeds the tokens."""
        return False

    def warmup(self, sizes: tuple[int, ...]) -> None:
        """Run once for each T in `sizes` (graph capture, allocator warm-up); cache content at
        slot 0 onwards is garbage afterwards, which is fine since prefill rewrites it."""
        for t in sizes:
            self.run(np.zeros(t, dtype=np.int64), 0)

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"backend": self.name, "precision": self.spec.precision, "kv_mode": self.kv_mode}
