"""Cache state: which tokens occupy a backend's static KV slots, and the moves on it.

The generator's target and the model drafter each own one `CacheTracker`; it is the only thing
that writes their token record. Feeding appends, rolling back forgets the tail (the graph masks
every slot at or beyond `position`), `reuse` keeps an exact prefix for the next request, and
`adopt` records slots something else wrote (K/V copied from another cache, a chained draft call).
A target tracker may also pad its single-token steps (`invariant_steps`, runtime/invariant.py).
"""

from __future__ import annotations

import numpy as np

from .backends import Backend
from .invariant import PAD_TOKEN

__all__ = ["CacheTracker", "common_prefix", "run_chunked"]


def run_chunked(backend: Backend | CacheTracker, ids, position: int, chunk: int) -> np.ndarray:
    """Feed `ids` from `position` in calls of at most `chunk` tokens (`backend.run`: a backend,
    or a tracker calling its backend); return the last row's logits ([V], a view valid until the
    backend's next call). The prefill of every model goes through here, so equal chunk boundaries
    give bit-identical caches (prefix reuse relies on it)."""
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

    `invariant_steps` runs every single-token call as two tokens, the second a padding token the
    graph masks and the next call overwrites, so a step rounds like a verification row
    (runtime/invariant.py). The last slot has no room for it: there both modes call T = 1.
    """

    def __init__(self, backend: Backend, chunk: int, invariant_steps: bool = False):
        if chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
        self.backend = backend
        self.chunk = int(chunk)
        self.invariant_steps = bool(invariant_steps)
        self._tokens: list[int] = []
        self.exact = 0

    def _padded(self, ids, position: int) -> tuple[np.ndarray, bool]:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.invariant_steps and ids.shape[0] == 1 and position + 2 <= self.backend.max_seq:
            return np.array([ids[0], PAD_TOKEN], dtype=np.int64), True
        return ids, False

    def run(self, ids, position: int) -> np.ndarray:
        """The backend's `run` as this cache calls it (single-token steps padded when
        `invariant_steps`); records nothing. Logits [T, V], a view until the next call."""
        ids, padded = self._padded(ids, position)
        out = self.backend.run(ids, position)
        return out[:1] if padded else out

    def argmax(self, ids, position: int) -> np.ndarray:
        """`run`'s rows' argmax (int64 [T]) through the backend's `argmax`; records nothing."""
        ids, padded = self._padded(ids, position)
        out = self.backend.argmax(ids, position)
        return out[:1] if padded else out

    @property
    def tokens(self) -> list[int]:
        """The token in each slot (read it; change it only through the methods below)."""
        return self._tokens

    @property
    def position(self) -> int:
        return len(self._tokens)

    def reset(self) -> None:
        self._tokens = []
        self.exact = 0

    def rollback(self, position: int) -> None:
        """Keep the first `position` slots (the graph masks the rest; they get overwritten)."""
        if position < len(self._tokens):
            del self._tokens[position:]
        self.exact = min(self.exact, position)

    def adopt(self, ids) -> None:
        """Record that the next slots hold `ids`, written without `feed` (copied from another
        cache, or by a backend call that feeds its own output back). Never counted as exact:
        prefix reuse keeps only slots written by aligned prefill chunks."""
        self._tokens.extend(int(t) for t in ids)

    def take_kv(self, donor: CacheTracker, history) -> int:
        """Copy from `donor` the slots from this cache's position on that both hold for
        `history` (the donor's tokens agree with it there), when the backend can copy from the
        donor's; returns the number of slots taken (0 when there is nothing to take or the
        backend cannot, and then the caller feeds them)."""
        n = self.position
        m = min(common_prefix(donor.tokens, history), len(history) - 1)
        if m > n and self.backend.copy_kv_from(donor.backend, n, m):
            self.adopt(history[n:m])
            return m - n
        return 0

    def reuse(self, prompt, keep_last: bool = True) -> int:
        """Roll back to the longest chunk-aligned exact prefix shared with `prompt` and return its
        length. keep_last leaves at least the prompt's last token to feed (its logits are needed)."""
        n = self.reusable(prompt, keep_last)
        self.rollback(n)
        return n

    def reusable(self, prompt, keep_last: bool = True) -> int:
        """How many leading tokens of `prompt` `reuse` would keep (changes nothing: a server
        picks the replica whose cache serves a continued conversation best)."""
        limit = min(self.exact, len(prompt) - 1 if keep_last else len(prompt))
        n = common_prefix(self._tokens, prompt, max(limit, 0))
        return (n // self.chunk) * self.chunk

    def feed(self, ids) -> np.ndarray:
        """Run `ids` (one call) at the current position; logits [T, V] (view until the next call)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        logits = self.run(ids, len(self._tokens))
        self._tokens.extend(ids.tolist())
        return logits

    def feed_argmax(self, ids) -> np.ndarray:
        """Like feed, but only each row's argmax (int64 [T]): GPU backends compute it on the
        device and copy T integers instead of [T, V] logits."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        best = self.argmax(ids, len(self._tokens))
        self._tokens.extend(ids.tolist())
        return best

    def feed_chunked(self, ids) -> np.ndarray:
        """Feed `ids` in calls of at most `chunk` tokens; return the last row's logits [V]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        start = len(self._tokens)
        aligned = start == self.exact and start % self.chunk == 0
        row = run_chunked(self, ids, start, self.chunk)
        self._tokens.extend(ids.tolist())
        if aligned:
            self.exact = start + (ids.size // self.chunk) * self.chunk
        return row

    def feed_tree(self, tokens, mask) -> np.ndarray:
        """Run a tree's nodes (runtime/tree.py `Tree`: tokens in topological order, ancestor mask
        [T, T]) in one call at the current position; logits [T, V]. The record holds the nodes
        in call order until `keep_path` says which of them stay."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        logits = self.backend.run_tree(ids, len(self._tokens), mask)
        self._tokens.extend(ids.tolist())
        return logits

    def keep_path(self, position: int, path) -> None:
        """After `feed_tree` at `position`: keep the accepted path's nodes (node ids, root first)
        in slots position.. (the backend moves their K/V), forget the rest of the tree."""
        if not 0 <= position <= len(self._tokens):
            raise ValueError(f"position {position} is outside the {len(self._tokens)} recorded slots")
        nodes = self._tokens[position:]
        if any(not 0 <= int(i) < len(nodes) for i in path):
            raise ValueError(f"path {list(path)} names nodes outside the {len(nodes)} fed at position {position}")
        kept = [nodes[int(i)] for i in path]
        self.backend.keep_path(position, path)
        del self._tokens[position:]
        self._tokens.extend(kept)
        self.exact = min(self.exact, position)
