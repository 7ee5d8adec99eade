"""Prompt-lookup (n-gram) drafter: no model, drafts by copying what followed an earlier match.

Given the history (prompt + tokens emitted so far), take its last n tokens, find the most recent
*earlier* place where those n tokens occurred, and propose the tokens that followed there. Sizes
are tried in the configured order (longest first by default): a longer match is a stronger hint.
Works well on inputs that repeat themselves (code edits, summaries quoting the prompt, RAG).

The naive search slices and compares every earlier position on each call; the index below makes
a call cost O(new tokens) Python work plus one C-level list comparison to confirm the history only
grew (a numpy `history` is converted to a list first).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from ...contract import NGRAM_SIZES
from ..sampling import SamplingParams
from ..tree import Tree
from .base import Drafter, Proposal

__all__ = ["NgramDrafter", "NgramIndex"]

# earlier occurrences of an n-gram remembered for tree proposals: enough for the few branches a
# CPU can afford, bounded so a repetitive history costs no more than a constant per token
MATCHES_KEPT = 8


class NgramIndex:
    """Prompt-lookup drafter with an incremental index of n-gram -> most recent start position.

    The index follows one growing history. `propose` keeps it when the new history extends the
    indexed one (the next step of a request, or the next turn of a chat) and rebuilds otherwise (a
    new request, a rollback), so results never depend on the call pattern, only on the history.
    `reset()` frees the index explicitly, e.g. when a request ends.
    """

    def __init__(self, ngram_sizes: Sequence[int] = NGRAM_SIZES, k: int = 4):
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

    def _followers(self, tail: list[int], length: int) -> tuple[list[tuple[int, int]], int]:
        """What followed the longest matching suffix of a context: ([(token, count)], matches) over
        the latest MATCHES_KEPT earlier occurrences, most frequent first, then most recent first.
        `tail` is the context's last max(ngram_sizes) tokens (or all of it), `length` its length."""
        for n in self.ngram_sizes:
            if length <= n:
                continue
            starts = self._starts[n].get(tuple(tail[len(tail) - n :]))
            if starts:
                counts: dict[int, int] = {}
                for start in reversed(starts):  # most recent first: dict order breaks count ties
                    tok = self._tokens[start + n]
                    counts[tok] = counts.get(tok, 0) + 1
                return sorted(counts.items(), key=lambda tc: -tc[1]), len(starts)
        return [], 0

    def propose_tree(self, history, k: int, nodes: int, depth: int, vocab: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of a token tree after `history` (node 0 is its last token): first the
        chain `propose` drafts (k tokens), whole, so a tree round can be judged against the chain
        it replaces; then the rest of the `nodes` best first. A node's candidate children are the
        tokens that followed the earlier occurrences of its context's longest matching suffix
        (`_followers`: several places that continued the same context differently), scored by
        the node's score times their share of those occurrences (a chain node's score is computed
        the same way, 0 when its token is not among them); the best candidate anywhere in the tree
        is added next (ties: the one found first) and its own candidates join. Nothing deeper
        than `depth` (>= k: depth costs an n-gram lookup nothing, so a tree may go past the chain
        where the history keeps repeating); no id outside [0, vocab). ([], []) when nothing is
        drafted."""
        if k < 1 or nodes < 2 or depth < 1:
            return [], []
        h = self._sync(history)
        length = len(h)
        if length < 2:
            return [], []
        self._extend_index(length - 1)
        wide = max(self.ngram_sizes)
        base = h[max(0, length - wide) :]
        tokens, parents, paths, scores = [h[-1]], [-1], [[]], [1.0]
        for tok in self.propose(h, min(k, depth, nodes - 1)):
            if not 0 <= tok < vocab:
                break
            options, total = self._followers((base + paths[-1])[-wide:], length + len(paths[-1]))
            share = dict(options).get(tok, 0) / total if total else 0.0
            tokens.append(tok)
            parents.append(len(tokens) - 2)
            paths.append(paths[-1] + [tok])
            scores.append(scores[-1] * share)
        heap: list[tuple[float, int, int, int]] = []
        order = 0
        children: set[tuple[int, int]] = {(parents[i], tokens[i]) for i in range(1, len(tokens))}

        def offer(node: int) -> None:
            nonlocal order
            path = paths[node]
            if len(path) >= depth:
                return
            options, total = self._followers((base + path)[-wide:], length + len(path))
            for tok, count in options:
                if 0 <= tok < vocab and (node, tok) not in children:
                    heapq.heappush(heap, (-(scores[node] * count / total), order, node, tok))
                    order += 1

        for node in range(len(tokens)):
            offer(node)
        while heap and len(tokens) < nodes:
            neg, _, parent, tok = heapq.heappop(heap)
            children.add((parent, tok))
            tokens.append(tok)
            parents.append(parent)
            paths.append(paths[parent] + [tok])
            scores.append(-neg)
            offer(len(tokens) - 1)
        return (tokens, parents) if len(tokens) > 1 else ([], [])

    @staticmethod
    def probs(tokens: Sequence[int], vocab_size: int) -> np.ndarray:
        """One-hot q rows [len(tokens), vocab_size] (float64): the n-gram proposal's exact
        distribution, written out. `verify_sampling` treats a proposal without rows (probs None)
        as exactly this, without building [k, V] arrays, and that is what `NgramDrafter` passes."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids must be in [0, {vocab_size})")
        q = np.zeros((ids.size, vocab_size), dtype=np.float64)
        q[np.arange(ids.size), ids] = 1.0
        return q


class NgramDrafter(Drafter):
    """Prompt lookup in the drafter role (an `NgramIndex` over the history): deterministic
    proposals (no probabilities), only ids the target may emit."""

    kind = "ngram"

    @classmethod
    def from_bundle(cls, manifest, backend, vocab: int) -> NgramDrafter:
        draft = manifest.draft
        return cls(vocab, tuple(draft.extra.get("ngram_sizes", NGRAM_SIZES)) if not draft.is_model else NGRAM_SIZES)

    def __init__(self, vocab: int, ngram_sizes: Sequence[int] = NGRAM_SIZES):
        super().__init__()
        if isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer)) or vocab < 1:
            raise ValueError(f"vocab must be a positive integer, got {vocab!r}")
        self.index = NgramIndex(ngram_sizes=ngram_sizes, k=4)
        self.vocab = vocab

    def reset(self) -> None:
        self.index.reset()

    def start(self, prompt) -> None:
        self.index.reset()

    def propose(self, history, k: int, params: SamplingParams, rng=None) -> Proposal:
        out = []
        for t in self.index.propose(history, k):
            if not 0 <= t < self.vocab:  # never propose an id the target may not emit
                break
            out.append(int(t))
        return Proposal(out, None)

    def propose_tree(
        self, history, k: int, nodes: int, params: SamplingParams, rng=None, depth: int | None = None
    ) -> Tree | None:
        """`NgramIndex.propose_tree`'s tree of at most `nodes` nodes and depth `depth` (default
        k): the chain first, then the likeliest branches by the history's own counts; no
        distributions (point masses, exact for any choice)."""
        tokens, parents = self.index.propose_tree(history, k, nodes, max(k, depth or k), self.vocab)
        return Tree(tokens, parents) if len(tokens) > 1 else None
