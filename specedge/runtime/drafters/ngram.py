"""Prompt-lookup (n-gram) drafter: no model, drafts by copying what followed an earlier match.

Given the history (prompt + tokens emitted so far), take its last n tokens, find the most recent
*earlier* place where those n tokens occurred, and propose the tokens that followed there. Sizes
are tried in the configured order (longest first by default): a longer match is a stronger hint.
Works well on inputs that repeat themselves (code edits, summaries quoting the prompt, RAG).

The naive search slices and compares every earlier position on each call; the index below makes
a call cost O(new tokens) Python work plus one C-level list comparison to confirm the history only
grew (about 30 us at 8k tokens when `history` is a list; a numpy array is converted first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..sampling import SamplingParams
from ..tree import Tree
from .base import Drafter, Proposal

__all__ = ["NgramDrafter", "NgramProposer"]

# earlier occurrences of an n-gram remembered for tree proposals: enough for the few branches a
# CPU can afford, bounded so a repetitive history costs no more than a constant per token
MATCHES_KEPT = 8


class NgramDrafter:
    """Prompt-lookup drafter with an incremental index of n-gram -> most recent start position.

    The index follows one growing history. `propose` keeps it when the new history extends the
    indexed one (the next step of a request, or the next turn of a chat) and rebuilds otherwise (a
    new request, a rollback), so results never depend on the call pattern, only on the history.
    `reset()` frees the index explicitly, e.g. when a request ends.
    """

    def __init__(self, ngram_sizes: Sequence[int] = (3, 2, 1), k: int = 4):
        sizes = tuple(ngram_sizes)
        if not sizes:
            raise ValueError("ngram_sizes must name at least one n-gram size")
        for n in sizes:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"ngram_sizes must be positive integers, got {n!r}")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"ngram_sizes must not repeat a size, got {sizes}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        self.ngram_sizes = tuple(int(n) for n in sizes)
        self.k = int(k)
        self.reset()

    def reset(self) -> None:
        """Forget the indexed history (start of a new request)."""
        self._tokens: list[int] = []
        # For each size n: n-gram tuple -> start of its latest occurrence among the n-grams that
        # end at or before self._covered (exclusive end index into self._tokens).
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.ngram_sizes}
        # the same n-grams -> their latest MATCHES_KEPT starts, oldest first (tree proposals)
        self._starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.ngram_sizes}
        self._covered = 0

    def _sync(self, history) -> list[int]:
        """Make self._tokens equal to history, keeping the index if history only grew."""
        if isinstance(history, np.ndarray):
            history = history.tolist()
        elif not isinstance(history, list):
            history = list(history)
        m = len(self._tokens)
        # A C-level list comparison: cheap even for long histories, unlike re-indexing.
        if len(history) < m or history[:m] != self._tokens:
            self.reset()  # not an extension: a different request or a rollback
            m = 0
        self._tokens.extend(int(t) for t in history[m:])
        return self._tokens

    def _extend_index(self, end: int) -> None:
        """Index every n-gram that ends at or before `end` (exclusive)."""
        h = self._tokens
        for stop in range(self._covered + 1, end + 1):
            for n, table in self._index.items():
                if stop >= n:
                    gram = tuple(h[stop - n : stop])
                    table[gram] = stop - n  # later positions overwrite
                    starts = self._starts[n].setdefault(gram, [])
                    starts.append(stop - n)
                    if len(starts) > MATCHES_KEPT:
                        del starts[0]
        self._covered = max(self._covered, end)

    def propose(self, history, k: int | None = None) -> list[int]:
        """Return up to k tokens that followed the latest earlier match of the history's suffix.

        `history` is a list or 1-D array of token ids. May return fewer than k tokens (the match is
        near the end) or none (no size matches).
        """
        k = self.k if k is None else k
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        h = self._sync(history)
        length = len(h)
        if k == 0 or length < 2:
            return []
        # An earlier occurrence must end before the last token, i.e. lie within h[:length - 1];
        # that also guarantees at least one following token.
        self._extend_index(length - 1)
        for n in self.ngram_sizes:
            if length <= n:
                continue
            start = self._index[n].get(tuple(h[length - n :]))
            if start is not None:
                return h[start + n : start + n + k]
        return []

    def propose_paths(self, history, k: int, width: int) -> list[list[int]]:
        """Up to `width` distinct continuations of at most k tokens, from the latest earlier matches
        of the history's suffix, longest n-gram first and most recent first: the first one is
        `propose`'s. Several places that continued the same context differently give a tree
        (`NgramProposer.propose_tree`) several chances where one chain has one."""
        if k < 0 or width < 0:
            raise ValueError(f"k and width must be >= 0, got {k} and {width}")
        h = self._sync(history)
        length = len(h)
        if k == 0 or width == 0 or length < 2:
            return []
        self._extend_index(length - 1)
        paths: list[list[int]] = []
        for n in self.ngram_sizes:
            if length <= n:
                continue
            for start in reversed(self._starts[n].get(tuple(h[length - n :]), ())):
                cont = h[start + n : start + n + k]
                if cont and cont not in paths:
                    paths.append(cont)
                    if len(paths) == width:
                        return paths
        return paths

    @staticmethod
    def probs(tokens: Sequence[int], vocab_size: int) -> np.ndarray:
        """One-hot q rows [len(tokens), vocab_size] (float64): the n-gram proposal's exact
        distribution, written out. `verify_sampling` treats a proposal without rows (probs None)
        as exactly this, without building [k, V] arrays, and that is what `NgramProposer` passes."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids must be in [0, {vocab_size})")
        q = np.zeros((ids.size, vocab_size), dtype=np.float64)
        q[np.arange(ids.size), ids] = 1.0
        return q


class NgramProposer(Drafter):
    """The n-gram drafter in the drafter role: deterministic proposals (no probabilities), only
    ids the target may emit."""

    kind = "ngram"

    def __init__(self, vocab: int, ngram_sizes=(3, 2, 1)):
        super().__init__()
        self.drafter = NgramDrafter(ngram_sizes=ngram_sizes, k=4)
        self.vocab = vocab

    def reset(self) -> None:
        self.drafter.reset()

    def start(self, prompt) -> None:
        self.drafter.reset()

    def propose(self, history, k: int, params: SamplingParams, rng=None) -> Proposal:
        out = []
        for t in self.drafter.propose(history, k):
            if not 0 <= t < self.vocab:  # never propose an id the target may not emit
                break
            out.append(int(t))
        return Proposal(out, None)

    def propose_tree(self, history, k: int, nodes: int, params: SamplingParams, rng=None) -> Tree | None:
        """The prefix tree of several continuations (`NgramDrafter.propose_paths`), cut to `nodes`
        nodes in path order, so the chain `propose` would draft comes first and whole; no
        distributions (point masses, exact for any choice)."""
        if nodes < 2 or k < 1:
            return None
        paths = []
        for path in self.drafter.propose_paths(history, k, max(1, nodes - 1)):
            ok = []
            for t in path:
                if not 0 <= t < self.vocab:
                    break
                ok.append(int(t))
            if ok:
                paths.append(ok)
        if not paths:
            return None
        return Tree.from_paths(int(history[-1]), paths).prefix(nodes)
