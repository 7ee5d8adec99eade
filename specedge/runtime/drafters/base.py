"""The drafter role: what the generator asks of anything that proposes tokens.

A drafter sees the committed sequence and proposes up to k tokens for the target to verify in one
call. A `Proposal` carries the tokens and, only when they were *sampled*, the rows q [k, V] they
were sampled from. A deterministic proposal (a greedy draft, a prompt lookup) carries no
distribution: the verifier treats each token as a point mass, which is exact for any way the
token was chosen (docs/design.md, exactness rules). A new drafter is one new file: subclass
`Drafter`, implement `propose` and `from_bundle`, and name it in drafters/__init__.py's DRAFTERS.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..backends import Backend, BackendError, SessionOptions
from ..cache import CacheTracker
from ..policy import LOOKUP_DRAFT_STEP
from ..sampling import SamplingParams, probs_from_logits, sample
from ..tree import Tree

__all__ = ["Drafter", "Proposal", "chain_tree", "top_ids"]


class Proposal(NamedTuple):
    """Drafted tokens, and q rows [len(tokens), V] when they were sampled (None: deterministic).

    A tuple, so a drafter may also return a plain (tokens, probs) pair."""

    tokens: list[int]
    probs: np.ndarray | None = None


class Drafter(ABC):
    kind: str = ""  # its name in load(draft=...), the stats and describe()
    # the draft model's logits index the target's ids, so its vocabulary bounds the pipeline's
    bounds_vocab: bool = False
    # what load's progress display calls the session of its model
    session_label: str = "draft session"

    # -- assembly (load): what it needs of the bundle, where its model runs, how it is built --

    @classmethod
    def check_bundle(cls, manifest) -> None:
        """Refuse (ValueError, one sentence) a bundle that lacks what this drafter needs."""

    @classmethod
    def backend_name(cls, target: str, asked: str | None) -> str | None:
        """The backend its model runs on, from the target's and the draft_backend asked for
        (both resolved names or None); None for a drafter without a model."""
        return None

    @classmethod
    def open_backend(cls, name: str, manifest, session: SessionOptions, options, target: str) -> Backend:
        """Its model's backend `name` (load's session options, and backend_options as `options`)."""
        raise BackendError(f"the {cls.kind} drafter runs no model")

    @classmethod
    def from_bundle(cls, manifest, backend: Backend | None, vocab: int) -> Drafter:
        """The drafter for `manifest` on `backend` (None without a model), proposing ids < vocab;
        every drafter in DRAFTERS makes one (drafters made by hand, in tests, need not)."""
        raise NotImplementedError(f"the {cls.kind or cls.__name__} drafter is not made from a bundle")

    @classmethod
    def step_cost(cls, manifest) -> float:
        """A draft step in target steps, for seeded sampling's fixed costs (policy.py)."""
        return LOOKUP_DRAFT_STEP

    # -- the drafter role ---------------------------------------------------------------------

    def __init__(self):
        self.calls = 0  # backend calls made while proposing (stats); 0 for a drafter without a model
        self.copied = 0  # cache slots taken from the target's K/V instead of computed (stats)

    def reset(self) -> None:
        """Forget every cached state (after a warm-up wrote into the caches, or between tests)."""

    def start(self, prompt) -> None:
        """A new request begins with `prompt`; called after the target's first token."""

    def use_kv_donor(self, target: CacheTracker) -> bool:
        """Let this drafter take committed tokens' K/V from the target's cache instead of computing
        them (a self-draft of the same geometry). False: this drafter cannot, and ignores it."""
        return False

    def follow_target(self, target: CacheTracker) -> None:
        """Given the target's cache once the loop exists: a drafter that drafts from the target's
        own state (a draft head reads its features, drafters/head.py) keeps it; others ignore it."""

    def propose_tree(
        self, history: list[int], k: int, nodes: int, params: SamplingParams, rng=None, depth: int | None = None
    ):
        """A `runtime.tree.Tree` of at most `nodes` nodes (the root is history's last token) and
        depth at most k, for tree verification; None when this drafter makes no trees (the round
        then verifies `propose`'s chain). `depth` (>= k, default k): how deep a drafter whose
        levels cost nothing (the n-gram lookup) may go; a model drafter stays at k, since each
        level is one of its calls."""
        return None

    @abstractmethod
    def propose(self, history: list[int], k: int, params: SamplingParams, rng=None) -> Proposal:
        """Up to k tokens after `history` (the committed sequence); fewer, or none, is allowed."""


def top_ids(p: np.ndarray, n: int) -> np.ndarray:
    """Ids of the n largest entries of the 1-D row p (all of them when n >= its size), ties at the
    cut going to the lower ids, in increasing id order: a deterministic set (np.argpartition's
    choice among equal values at the cut is not specified), the one the C++ runtime picks too
    (cpp/src/tree.cpp, top_ids). O(V) like argpartition; no full sort."""
    p = np.asarray(p)
    n = int(n)
    if n >= p.size:
        return np.arange(p.size)
    if n <= 0:
        return np.arange(0)
    kth = np.partition(p, p.size - n)[p.size - n]  # the n-th largest value
    above = np.flatnonzero(p > kth)
    at = np.flatnonzero(p == kth)[: n - above.size]
    return np.sort(np.concatenate([above, at]))


def chain_tree(
    root: int,
    first_row: np.ndarray,
    step: Callable[[int], np.ndarray],
    k: int,
    nodes: int,
    ids: np.ndarray | None = None,
    params: SamplingParams | None = None,
    rng=None,
    vocab: int | None = None,
) -> Tree:
    """The draft's chain of k tokens (k - 1 calls of `step`, what a chain costs, no more) plus, as
    leaf siblings, the draft's runner-up tokens ranked by the probability of their whole path (the
    chain's probabilities up to there times theirs: EAGLE-2's confidence ranking), so branches go
    where the draft is unsure; at most `nodes` nodes. `first_row`: the draft's logits for the token
    after `root`; `step(token)` feeds a chain token and returns the next row; `ids` maps a row index
    to a target id (a head's draft vocabulary; None: the same).

    Greedy (`params` None or greedy): the chain is the draft's argmax line and every node a point
    mass. Sampling: the chain is *sampled* from q = probs_from_logits(row, params), one
    `rng.random()` per token as `propose` draws it, and its nodes carry their q rows (over the
    target's `vocab` ids), so the first child is accepted with min(1, p/q) exactly as in a chain
    round; the siblings, q's likeliest other tokens, are point masses tested on the residual.
    A greedy line under sampling would be accepted only with p(x), far less when the draft is
    good (benchmarks/history/trees.md).
    Exact either way (runtime/tree.py: a sibling may be any function of the draft's earlier choices)."""
    sampled = params is not None and not params.greedy
    if sampled and (rng is None or vocab is None):
        raise ValueError("a sampled chain tree needs the request's rng and the target's vocab")
    extra = max(0, nodes - 1 - k)
    row, chain, qs = first_row, [], []
    alts: list[tuple[float, int, int]] = []  # (path probability, parent node, token)
    reach = 1.0
    for j in range(k):
        z = np.asarray(row, dtype=np.float64)
        if sampled:
            p = probs_from_logits(z, params)
            pick = sample(p, rng)
            q = np.zeros(vocab, dtype=np.float64)
            q[slice(None) if ids is None else ids] = p
            qs.append(q)
        else:
            pick = int(np.argmax(z))
            if extra:
                p = np.exp(z - z[pick])
                p /= p.sum()
        if extra:
            top = top_ids(p, extra + 1)
            alts.extend(
                (reach * float(p[t]), j, int(t) if ids is None else int(ids[t])) for t in top if t != pick and p[t] > 0
            )
            reach *= float(p[pick])
        tok = pick if ids is None else int(ids[pick])
        chain.append(tok)
        if j < k - 1:
            row = step(tok)
    tokens, parents = [int(root), *chain], list(range(-1, k))
    for _, parent, t in sorted(alts, key=lambda a: (-a[0], a[1], a[2]))[:extra]:
        tokens.append(t)
        parents.append(parent)  # chain node `parent` is the depth-`parent` prefix
    q_rows = [None, *qs, *[None] * (len(tokens) - 1 - k)] if sampled else None
    return Tree(tokens, parents, q_rows).prefix(nodes)
