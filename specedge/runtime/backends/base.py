"""The backend interface: one model's graph on one device, with its static KV cache.

A backend allocates its buffers once, binds the static KV cache once, and runs the graph for a
given number of new tokens T at a write offset `position`. The generator owns `position`:
rolling back rejected draft tokens is just calling `run` with a smaller position next time, since
the graph masks every slot at or beyond `position + t` (docs/design.md, graph contract).

What every backend does alike lives here once: the refusal of an n-gram "model", the check of a
call's T and position, the k-step greedy draft loop, switching CUDA graphs off when a capture
fails, and the optional-package import with a one-sentence error.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...errors import BackendError, import_optional
from ...manifest import Manifest, ModelSpec

__all__ = ["Backend", "BackendError", "SessionOptions", "import_optional"]


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionOptions:
    """What `load` settles for every backend of a pipeline. Each backend class says which of
    these its constructor takes (`Backend.session_kwargs`); the others do not apply to it (a GPU
    backend has no CPU thread pool)."""

    threads: int | None = None
    providers: object = None  # ONNX Runtime execution providers: names or (name, options) pairs
    allow_spinning: bool | None = None
    alternating: bool = False  # two sessions take turns on the CPU (a target and its draft)
    shared_pool: bool = False
    int4_kernel: str = "auto"


class Backend(ABC):
    name: str = ""
    # draft_greedy runs its k steps in one launch (a captured chain): the model drafter then hands
    # the whole greedy proposal to it instead of stepping itself
    has_draft_chain: bool = False
    # CUDA graphs in use; a failed capture turns them off (`graphs_off`), with the reason in graph_note
    cuda_graphs: bool = False
    graph_note: str = ""
    # [B, max_seq, F] fp32 in host memory: the target features (contract.FEATURES_OUTPUT) of the
    # token in each cache slot, kept like the cache, for a draft head (which runs on the CPU
    # whatever device the target uses); None where the graph has none
    features: np.ndarray | None = None
    # the graph takes tree calls (the manifest's graph `tree`, contract.TREE_INPUT): `run_tree`
    # and `keep_path` work; chain calls bind the lower-triangular mask themselves
    takes_trees: bool = False
    # the most tokens one call takes (TensorRT: its largest optimization profile); trees stay within it
    max_call_tokens: int = 1 << 30

    @classmethod
    def session_kwargs(cls, session: SessionOptions) -> dict:
        """The constructor keywords this backend takes from `session` (none by default)."""
        return {}

    @classmethod
    def open(
        cls, manifest: Manifest, spec: ModelSpec, session: SessionOptions, options: Mapping | None = None
    ) -> Backend:
        """This backend for `spec`, with the session options it takes (providers it does not take
        are refused, other options ignored) and its own `options` (load's backend_options:
        keywords of its constructor, which may not repeat a session one)."""
        kwargs = cls.session_kwargs(session)
        if session.providers is not None and "providers" not in kwargs:  # threads: GPU backends have no pool
            raise BackendError(f"backend '{cls.name}' does not take providers")
        clash = sorted(set(kwargs) & set(options or {}))
        if clash:
            raise BackendError(
                f"backend_options may not set {', '.join(clash)}: load() sets it for backend '{cls.name}'"
            )
        return cls(manifest, spec, **kwargs, **(options or {}))

    def __init__(self, manifest: Manifest, spec: ModelSpec):
        if isinstance(spec, ModelSpec) and spec.kind == "ngram":  # test doubles pass other spec objects
            raise BackendError(f"the {spec.role} is an n-gram drafter: it has no graph to run on backend '{self.name}'")
        self.manifest = manifest
        self.spec = spec
        self.max_seq = manifest.max_seq
        self.kv_mode = manifest.kv_mode
        self.vocab_size = spec.vocab_size

    @abstractmethod
    def run(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        """Feed `input_ids` (int64 [T]) written at cache slots position..position+T-1 and return
        fp32 logits [T, V] (a view that stays valid until the next call)."""

    def feature_dim(self) -> int:
        """F, the width of the graph's features output (manifest `features.dim`); 0 without one."""
        f = getattr(self.spec, "features", None)
        return int(f.get("dim", 0)) if f else 0

    def allocate_features(self) -> None:
        """The host `features` array, once, when the graph has a features output."""
        F = self.feature_dim()
        if F and self.features is None:
            self.features = np.zeros((self.manifest.batch, self.max_seq, F), dtype=np.float32)

    def store_features(self, position: int, rows) -> None:
        """Record a call's features rows [B, t, F] at slots position..position+t-1 (every
        backend calls this after each run; a GPU backend passes the rows it copied to the host)."""
        if self.features is not None:
            rows = np.asarray(rows).reshape(self.features.shape[0], -1, self.features.shape[2])
            self.features[:, position : position + rows.shape[1]] = rows

    def keep_path_features(self, position: int, moves) -> None:
        """The host side of `keep_path`: move the features rows with the K/V entries (`moves`:
        runtime/tree.py compaction_moves, (source, destination) node offsets from `position`)."""
        if self.features is not None and moves:
            src = [position + s for s, _ in moves]
            dst = [position + d for _, d in moves]
            self.features[:, dst] = self.features[:, src]  # fancy indexing reads every source first

    def check_call(self, input_ids, position: int) -> np.ndarray:
        """`input_ids` as int64 [T] after checking that T >= 1 tokens fit at `position`."""
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        t = int(ids.shape[0])
        if t < 1:
            raise ValueError("input_ids must hold at least one token")
        if position < 0 or position + t > self.max_seq:
            raise ValueError(f"{t} tokens at position {position} do not fit max_seq {self.max_seq}")
        return ids

    def check_chain(self, position: int, k: int) -> None:
        if position < 0 or position + k > self.max_seq:
            raise ValueError(f"{k} draft steps at position {position} do not fit max_seq {self.max_seq}")

    def draft_greedy(self, token: int, position: int, k: int) -> np.ndarray:
        """Feed `token` at `position`, then each step's argmax at the next slot, k times; return the
        k greedy tokens (int64). Backends with `has_draft_chain` run the steps in one launch."""
        if k < 1:
            return np.zeros(0, dtype=np.int64)
        self.check_chain(position, k)
        out, tok = [], int(token)
        for j in range(k):
            tok = int(self.argmax(np.array([tok], dtype=np.int64), position + j)[0])
            out.append(tok)
        return np.array(out, dtype=np.int64)

    def graphs_off(self, what: str, error: BaseException) -> None:
        """A CUDA graph capture or replay failed: run without graphs from now on, and say why."""
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        self.cuda_graphs = False
        self.graph_note = f"{what} failed ({first}); running without graphs"
        log.warning("%s: %s", self.name, self.graph_note)

    def argmax(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        """Greedy fast path: int64 [T] argmax of each row. GPU backends override it to avoid copying
        the full logits to the host."""
        return np.argmax(self.run(input_ids, position), axis=-1)

    def copy_kv_from(self, other: Backend, start: int, end: int) -> bool:
        """Overwrite this model's cache slots [start, end) with `other`'s (a self-draft taking
        the target's prompt K/V instead of computing its own). False when this backend cannot
        (another backend type, another cache geometry); the caller then feeds the tokens."""
        return False

    def check_tree_call(self, input_ids, position: int, mask) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [T], mask bool [T, T]) of a tree call, checked: the graph takes trees, the
        mask is T x T with its diagonal set and nothing above it (parents come first)."""
        if not self.takes_trees:
            raise BackendError(f"the {self.spec.role} graph takes no tree calls (export the bundle with --tree)")
        ids = self.check_call(input_ids, position)
        m = np.asarray(mask, dtype=bool)
        t = ids.shape[0]
        if m.shape != (t, t):
            raise ValueError(f"a tree call of {t} tokens needs a [{t}, {t}] mask, got shape {m.shape}")
        if not m.diagonal().all() or np.triu(m, 1).any():
            raise ValueError("a tree mask must mark every token itself and only earlier tokens (topological order)")
        return ids, m

    def run_tree(self, input_ids: np.ndarray, position: int, mask: np.ndarray) -> np.ndarray:
        """A tree call: like `run`, with `mask` [T, T] (row t: token t and its ancestors); logits
        [T, V]. Only backends whose graph takes trees implement it."""
        self.check_tree_call(input_ids, position, mask)
        raise BackendError(f"backend '{self.name}' does not run tree calls yet")

    def keep_path(self, position: int, path) -> None:
        """After a tree call at `position`: move the K/V (and features) of the accepted path's
        nodes (node ids, root first) into slots position..position+len(path)-1
        (runtime/tree.py `compaction_moves`)."""
        raise BackendError(f"backend '{self.name}' does not run tree calls yet")

    def warmup(self, sizes: tuple[int, ...]) -> None:
        """Run once for each T in `sizes` (graph capture, allocator warm-up); cache content at
        slot 0 onwards is garbage afterwards, which is fine since prefill rewrites it."""
        for t in sizes:
            self.run(np.zeros(t, dtype=np.int64), 0)

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"backend": self.name, "precision": self.spec.precision, "kv_mode": self.kv_mode}
