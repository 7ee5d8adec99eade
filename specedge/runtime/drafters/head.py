"""Head drafter: a trained draft head (models/eagle_head.py) chains k drafts from the target's features.

Slot j of the head's cache pairs the target's features of committed token j with the embedding of
token j + 1, so after a verification that committed history[:n] (the target has run every token
but the last, history[n - 1]) the head can hold slots 0..n-2. Each proposal:

1. catch up: feed the slots from the first one whose token changed (rejected drafts, a gap left
   by target-only steps, the prompt) to n-2, in prefill chunks, from the target backend's
   feature rows (`Backend.features`); the last fed row's output gives the first draft;
2. chain: each further draft is one T = 1 call at the next slot over the head's own hidden state
   of the step before (zeros for the features input);
3. map every draft id to the target's id (the draft vocabulary's `d2t`).

Chain slots beyond n - 2 are scratch: the next catch-up overwrites them. Drafts are only proposals
(docs/design.md, exactness), so nothing here can change the tokens the target emits.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..backends import Backend, BackendError, SessionOptions, resolve_backend_name
from ..cache import CacheTracker, common_prefix
from ..policy import draft_step_cost
from ..sampling import SamplingParams, probs_from_logits, sample
from ..tree import Tree
from .base import Drafter, Proposal, chain_tree

__all__ = ["HeadDrafter", "read_draft_vocab"]


def read_draft_vocab(manifest) -> np.ndarray:
    """The head's draft->target id map from its file in the bundle (checked: ids, count, unique)."""
    import json

    from ...manifest import BundleError

    head = manifest.head
    rel = head.extra.get("draft_vocab_file")
    try:
        d2t = json.loads(manifest.path(rel).read_text(encoding="utf-8"))["d2t"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise BundleError(f"cannot read the draft head's vocabulary map '{rel}': {e}") from None
    if (
        not isinstance(d2t, list)
        or len(d2t) != head.vocab_size
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < manifest.target.vocab_size for i in d2t)
        or len(set(d2t)) != len(d2t)
    ):
        raise BundleError(f"the draft head's vocabulary map '{rel}' must list {head.vocab_size} distinct target ids")
    return np.asarray(d2t, dtype=np.int64)


class HeadDrafter(Drafter):
    kind = "head"
    session_label = "draft head session"

    @classmethod
    def check_bundle(cls, manifest) -> None:
        if manifest.head is None:
            raise ValueError("this bundle has no draft head: train one with `specedge train-draft BUNDLE`")

    @classmethod
    def backend_name(cls, target: str, asked: str | None) -> str:
        # the head is a few MB: it runs on the CPU next to any target, which hands it its features
        name = resolve_backend_name(asked) if asked else "ort-cpu"
        if name != "ort-cpu":
            raise BackendError(
                f"a draft head runs on the ort-cpu backend (draft_backend {name!r}); its target may use any backend"
            )
        return name

    @classmethod
    def open_backend(cls, name: str, manifest, session: SessionOptions, options, target: str) -> Backend:
        from ..backends.ort_head import OrtHeadBackend

        if target != "ort-cpu":  # providers and backend_options are the GPU target's
            session, options = replace(session, providers=None), None
        return OrtHeadBackend.open(manifest, manifest.head, session, options)

    @classmethod
    def from_bundle(cls, manifest, backend: Backend, vocab: int) -> HeadDrafter:
        return cls(backend, read_draft_vocab(manifest), vocab, manifest.prefill_chunk)

    @classmethod
    def step_cost(cls, manifest) -> float:
        return draft_step_cost(manifest.head.weight_bytes, manifest.target.weight_bytes)

    def __init__(self, head, d2t: np.ndarray, vocab: int, prefill_chunk: int):
        super().__init__()
        self.head = head  # an OrtHeadBackend (step(ids, position, features, hidden))
        self.target: CacheTracker | None = None  # set by follow_target
        self.d2t = np.asarray(d2t, dtype=np.int64)
        if self.d2t.ndim != 1 or self.d2t.size != head.vocab_size:
            raise ValueError(f"the draft vocabulary map has {self.d2t.size} ids, the head's logits {head.vocab_size}")
        if self.d2t.size and (self.d2t.min() < 0 or self.d2t.max() >= vocab):
            raise ValueError("the draft vocabulary map names ids outside the target's vocabulary")
        self.vocab = int(vocab)
        self.chunk = int(prefill_chunk)
        self.fed: list[int] = []  # fed[j]: the token (history[j + 1]) whose embedding head slot j holds

    def _features(self) -> np.ndarray:
        backend = self.target.backend
        feats = getattr(backend, "features", None)
        if feats is None:
            raise ValueError(
                f"the target backend '{backend.name}' does not return target features: "
                "head drafting needs a bundle exported with features"
            )
        return feats[0]

    def follow_target(self, target: CacheTracker) -> None:
        self.target = target

    def reset(self) -> None:
        self.fed = []

    def start(self, prompt) -> None:
        self.fed = []

    def _catch_up(self, history: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Feed head slots up to n - 2; return the last slot's draft logits [Vd] and hidden [H]."""
        n = len(history)
        last = n - 2
        tcache = self.target
        if tcache is None:
            raise ValueError("the head drafter was not given the target's cache (Drafter.follow_target)")
        if tcache.position < n - 1 or common_prefix(tcache.tokens, history, n - 1) < n - 1:
            raise ValueError("the target's cache does not hold the committed sequence the head drafts after")
        start = common_prefix(self.fed, history[1:], last)  # always re-feed slot n - 2: its output is needed
        feats = self._features()
        logits = hidden = None
        for s in range(start, last + 1, self.chunk):
            e = min(s + self.chunk, last + 1)
            logits, hidden = self.head.step(history[s + 1 : e + 1], s, features=feats[s:e])
            self.calls += 1
        self.fed = list(history[1:n])
        return logits[-1], hidden[-1:].copy()

    def propose(self, history, k: int, params: SamplingParams, rng=None) -> Proposal:
        if k < 1:
            return Proposal([], None)
        history = history if isinstance(history, list) else list(history)
        n = len(history)
        if n < 2:
            return Proposal([], None)  # no target features yet: nothing to draft from
        k = min(k, self.head.max_seq - (n - 1))
        if k < 1:
            return Proposal([], None)
        row, hidden = self._catch_up(history)
        out: list[int] = []
        qs = None if params.greedy else np.zeros((k, self.vocab), dtype=np.float64)
        for j in range(k):
            if params.greedy:
                tok = int(self.d2t[int(np.argmax(row))])
            else:
                q = probs_from_logits(row, params)
                qs[j, self.d2t] = q
                tok = int(self.d2t[sample(q, rng)])
            out.append(tok)
            if j < k - 1:
                lg, hd = self.head.step([tok], n - 1 + j, hidden=hidden)
                row, hidden = lg[-1], hd[-1:].copy()
                self.calls += 1
        return Proposal(out, qs)

    def propose_tree(
        self, history, k: int, nodes: int, params: SamplingParams, rng=None, depth: int | None = None
    ) -> Tree | None:
        """A tree of at most `nodes` nodes: the head's chain of k drafts (greedy, or sampled with
        its q rows as `propose` draws it) plus its runner-up tokens (mapped through the draft
        vocabulary) as ranked leaf siblings (base.chain_tree); depth k whatever `depth` allows (a
        level deeper would be one more head call)."""
        if k < 1 or nodes < 2:
            return None
        history = history if isinstance(history, list) else list(history)
        n = len(history)
        k = min(k, self.head.max_seq - (n - 1))
        if n < 2 or k < 1:
            return None  # no target features yet, or no head slots left: the round drafts a chain
        row, hidden = self._catch_up(history)
        state = {"hidden": hidden, "slot": n - 1}

        def step(tok: int) -> np.ndarray:
            lg, hd = self.head.step([tok], state["slot"], hidden=state["hidden"])
            state["hidden"], state["slot"] = hd[-1:].copy(), state["slot"] + 1
            self.calls += 1
            return lg[-1]

        return chain_tree(history[-1], row, step, k, nodes, ids=self.d2t, params=params, rng=rng, vocab=self.vocab)
