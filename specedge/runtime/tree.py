"""Token trees: many candidate continuations verified in one target call (docs/design.md, "Tree calls").

A `Tree` is the call's T new tokens in topological order: node 0 is the pending token (the last
committed one, not yet in the cache), every other node a drafted token whose parent comes before
it. The target runs all of them at slots position..position+T-1 with `ancestor_mask()` and
returns one row per node: the next-token distribution after that node's root path.

Verification walks from the root and keeps one root path:

* greedy: descend to the child whose token is the target's argmax at the current node, then emit
  the target's own token where no child matches (the chain's rule, node by node);
* sampling: recursive rejection over the siblings (SpecInfer, Miao et al. 2024): each child x_i
  is tested as a speculative-sampling proposal against the current residual r (r = p at first):
  accept with min(1, r(x_i) / q_i(x_i)), else r <- norm(max(0, r - q_i)); when every child is
  rejected, emit a token from r. q_i is the distribution the drafter drew x_i from *given the
  siblings before it* (the draft's q when drawn with replacement, q without the earlier siblings
  renormalised when drawn without), or None: a point mass at x_i, right for any deterministic
  choice (an n-gram continuation, a top-k pick). Each test then emits exactly r, so the emitted
  token is distributed as p whatever the draft was (`sibling_rule`, proved by enumeration in
  tests/test_tree.py).

After the call the accepted path's K/V are moved to contiguous slots (`compaction_moves`), so
the next call sees an ordinary cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .sampling import sample

__all__ = [
    "Tree",
    "chain_accepted",
    "compaction_moves",
    "first_line_kept",
    "sibling_rule",
    "verify_tree_greedy",
    "verify_tree_sampling",
]


@dataclass
class Tree:
    """tokens[i] with parent parents[i] (< i; -1 for the root, node 0 only). q[i] (optional, one
    per node, q[0] unused): the draft distribution node i's token was drawn from, None = a point
    mass (see the module docstring)."""

    tokens: list[int]
    parents: list[int]
    q: list[np.ndarray | None] | None = None
    _children: list[list[int]] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self):
        self.tokens = [int(t) for t in self.tokens]
        self.parents = [int(p) for p in self.parents]
        if not self.tokens:
            raise ValueError("a tree needs at least its root")
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"a tree needs one parent per token, got {len(self.parents)} for {len(self.tokens)}")
        if self.parents[0] != -1:
            raise ValueError("node 0 is the root: its parent must be -1")
        for i, p in enumerate(self.parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}'s parent {p} must be an earlier node (topological order)")
        if self.q is not None and len(self.q) != len(self.tokens):
            raise ValueError(f"q needs one entry per node, got {len(self.q)} for {len(self.tokens)}")
        self._children = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], 1):
            self._children[p].append(i)

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]]) -> Tree:
        """The prefix tree of several continuations of `root` (shared prefixes merged, first-seen
        order kept, so the first path's nodes come first); no draft distributions."""
        tokens, parents, index = [int(root)], [-1], {}
        for path in paths:
            node = 0
            for t in path:
                key = (node, int(t))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(t))
                    parents.append(node)
                node = index[key]
        return cls(tokens, parents)

    def prefix(self, nodes: int) -> Tree:
        """The first `nodes` nodes (a tree too: parents come first)."""
        n = max(1, int(nodes))
        return Tree(self.tokens[:n], self.parents[:n], None if self.q is None else self.q[:n])

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        return self._children[node]

    def depths(self) -> list[int]:
        d = [0] * len(self.tokens)
        for i, p in enumerate(self.parents[1:], 1):
            d[i] = d[p] + 1
        return d

    def ancestor_mask(self) -> np.ndarray:
        """bool [T, T]: row i marks i and its ancestors (contract.TREE_INPUT for one batch row)."""
        m = np.zeros((len(self.tokens),) * 2, dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                m[i] = m[p]
            m[i, i] = True
        return m

    def check_vocab(self, vocab: int) -> None:
        for t in self.tokens[1:]:
            if not 0 <= t < vocab:
                raise ValueError(f"draft token {t} is outside the vocabulary [0, {vocab})")


def verify_tree_greedy(tree: Tree, target_argmax: Sequence[int]) -> tuple[list[int], list[int]]:
    """(accepted path of node ids from the root, tokens to emit): the longest root path whose every
    token is the target's argmax after its parent, then the target's token there. Siblings hold
    distinct tokens in any tree a drafter makes; with duplicates the first one is followed."""
    best = [int(b) for b in target_argmax]
    if len(best) != len(tree):
        raise ValueError(f"need one argmax per tree node ({len(tree)}), got {len(best)}")
    path, out, node = [0], [], 0
    while True:
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == best[node]), None)
        out.append(best[node])
        if nxt is None:
            return path, out
        path.append(nxt)
        node = nxt


def chain_accepted(tree: Tree, target_argmax: Sequence[int], limit: int | None = None) -> int:
    """How many drafts the tree's first line (each node's first child: the chain a drafter puts
    first) would have had accepted on its own, greedily: what a chain round of `limit` drafts
    (default: the whole line) would have kept."""
    best = [int(b) for b in target_argmax]
    n, node = 0, 0
    while tree.children(node) and (limit is None or n < limit):
        first = tree.children(node)[0]
        if tree.tokens[first] != best[node]:
            break
        n, node = n + 1, first
    return n


def first_line_kept(tree: Tree, path: Sequence[int], limit: int | None = None) -> int:
    """How many nodes of the tree's first line (each node's first child) a sampled verification
    kept before leaving it, at most `limit`: what a chain round of those drafts would have kept on
    the same draws. The first child is tested first, against p itself, with the chain's own rule,
    so its acceptance is the chain's; a sibling taken after it was rejected is where the chain
    would have stopped."""
    n = 0
    for parent, node in zip(path, path[1:]):
        kids = tree.children(parent)
        if (limit is not None and n >= limit) or not kids or kids[0] != node:
            break
        n += 1
    return n


def sibling_rule(
    p: np.ndarray, tokens: Sequence[int], qs: Sequence[np.ndarray | None]
) -> tuple[list[float], np.ndarray]:
    """The recursive rejection over one node's children: (a, r) where a[i] is the probability of
    accepting child i given that every child before it was rejected, and r the distribution to
    emit from when all are rejected (normalised; p itself where rounding leaves no mass)."""
    r = np.asarray(p, dtype=np.float64)
    accept = []
    for x, q in zip(tokens, qs):
        if q is None or q[x] <= 0:
            # a point mass at x (also for q(x) == 0, like the chain): accept with r(x); the
            # residual max(0, r - onehot(x)) is r without x
            a = float(r[x])
            nxt = r.copy()
            nxt[x] = 0.0
        else:
            q = np.asarray(q, dtype=np.float64)
            a = min(1.0, float(r[x]) / float(q[x]))
            nxt = np.maximum(r - q, 0.0)
        accept.append(a)
        if a >= 1.0:
            return accept, r  # never rejected: the residual is never used
        total = nxt.sum()
        # a rejection implies mass left somewhere; only rounding (r ~= q) leaves none
        r = nxt / total if total > 0 else r
    return accept, r


def verify_tree_sampling(tree: Tree, target_probs: np.ndarray, rng) -> tuple[list[int], list[int]]:
    """(accepted path of node ids, tokens to emit), exact: the emitted tokens are distributed as
    target-only sampling. `target_probs` [T, V] are the target's p rows of the tree's nodes (from
    `probs_from_logits`). One `rng.random()` per child tested and one per emitted sample."""
    p_all = np.asarray(target_probs, dtype=np.float64)
    if p_all.ndim != 2 or p_all.shape[0] != len(tree):
        raise ValueError(f"target_probs must be [{len(tree)}, V] (one row per tree node), got shape {p_all.shape}")
    tree.check_vocab(p_all.shape[1])
    path, out, node = [0], [], 0
    while True:
        kids = tree.children(node)
        qs = [None if tree.q is None else tree.q[c] for c in kids]
        accept, residual = sibling_rule(p_all[node], [tree.tokens[c] for c in kids], qs)
        chosen = None
        for c, a in zip(kids, accept):
            if rng.random() < a:
                chosen = c
                break
        if chosen is None:
            out.append(sample(residual, rng))
            return path, out
        out.append(tree.tokens[chosen])
        path.append(chosen)
        node = chosen


def compaction_moves(path: Sequence[int]) -> list[tuple[int, int]]:
    """(source, destination) offsets from the call's position that put the accepted path's nodes
    (node ids, root first, increasing as topological order makes them) in slots 0..len-1: only
    the nodes not already in place, in increasing order. Done in that order, one slot at a time,
    no move overwrites a later move's source (every later source is past every destination so
    far), so a backend may copy slot by slot in place."""
    moves = []
    for dst, src in enumerate(path):
        src = int(src)
        if dst and src <= int(path[dst - 1]):
            raise ValueError(f"an accepted path's node ids must increase, got {list(path)}")
        if src != dst:
            moves.append((src, dst))
    return moves
