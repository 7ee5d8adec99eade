"""Model drafter: a small (or cheaper) model proposes k tokens, one T=1 call each.

Cache bookkeeping (the subtle part). The draft's cache must hold exactly a prefix of the committed
sequence before it drafts. After a round that proposed d1..dk the draft has processed the pending
token and d1..d(k-1), never dk. Then:

* n < k accepted: the committed sequence is ... d1..dn x; the draft keeps its first n drafts and
  rolls back (position only), then feeds x: one T=1 call;
* all k accepted: the committed sequence is ... d1..dk b (bonus); the draft never saw dk, so it
  catches up by feeding dk and b together: one T=2 call.

Both cases (and a gap left by target-only decoding, and the prompt itself) are the same rule:
compare the draft's cache with the committed sequence, roll back to the common prefix, and feed
what is missing, in prefill chunks. Comparing only the part written since the last proposal keeps
that O(k) per round.

When sampling, each draft token is drawn from q = probs_from_logits(draft logits, params), the
same filtering the target's p goes through, and the q rows are returned for `verify_sampling`;
a greedy proposal carries none (a point mass, see drafters/base.py).
"""

from __future__ import annotations

import numpy as np

from ..backends import Backend, SessionOptions, backend_class, resolve_backend_name
from ..cache import CacheTracker, common_prefix
from ..policy import draft_step_cost
from ..sampling import SamplingParams, probs_from_logits, sample
from ..tree import Tree
from .base import Drafter, Proposal, chain_tree

__all__ = ["ModelDrafter"]


class ModelDrafter(Drafter):
    """Drafts with a model backend. `vocab` limits proposals to the shared tokenizer's ids (the
    draft's logits may carry padding rows beyond it)."""

    kind = "model"
    bounds_vocab = True

    @classmethod
    def check_bundle(cls, manifest) -> None:
        if not manifest.draft.is_model:
            raise ValueError("this bundle's draft is an n-gram drafter: it has no draft model (use draft='ngram')")

    @classmethod
    def backend_name(cls, target: str, asked: str | None) -> str:
        return resolve_backend_name(asked or target)

    @classmethod
    def open_backend(cls, name: str, manifest, session: SessionOptions, options, target: str) -> Backend:
        return backend_class(name).open(manifest, manifest.draft, session, options)

    @classmethod
    def from_bundle(cls, manifest, backend: Backend, vocab: int) -> ModelDrafter:
        return cls(backend, manifest.prefill_chunk, vocab=min(vocab, backend.vocab_size))

    @classmethod
    def step_cost(cls, manifest) -> float:
        return draft_step_cost(manifest.draft.weight_bytes, manifest.target.weight_bytes)

    def __init__(self, backend: Backend, prefill_chunk: int, vocab: int | None = None):
        super().__init__()
        self.backend = backend
        self.cache = CacheTracker(backend, prefill_chunk)
        self.vocab = int(vocab or backend.vocab_size)
        if not 1 <= self.vocab <= backend.vocab_size:
            raise ValueError(f"vocab must be in 1..{backend.vocab_size}, got {self.vocab}")
        self._base = 0  # the draft's cache matched the committed sequence up to here at the last proposal
        self._argmax = self.vocab == backend.vocab_size  # no padding rows that could win argmax
        self._chain = backend.has_draft_chain and self._argmax
        self._donor: CacheTracker | None = None

    @property
    def kv_donor(self) -> CacheTracker | None:
        """The target's cache when this draft takes K/V from it (`use_kv_donor`), else None."""
        return self._donor

    def use_kv_donor(self, target: CacheTracker) -> bool:
        """A self-draft of the target (same architecture, same cache geometry): committed tokens
        the target has already run are not fed to the draft, their K/V are copied from the
        target's cache (docs/design.md, exactness: drafts are only proposals). Backends that
        cannot copy (another backend type or geometry) keep feeding, slot by slot."""
        self._donor = target
        return True

    @property
    def position(self) -> int:
        return self.cache.position

    def reset(self) -> None:
        """Forget the cache content (after a warm-up wrote garbage into it)."""
        self.cache.reset()
        self._base = 0

    def start(self, prompt) -> None:
        """A new request: keep the longest exact chunk-aligned prefix shared with `prompt`; the
        rest is fed by the first `propose` (after the target's first token, so it does not delay
        time to first token)."""
        self._base = self.cache.reuse(prompt, keep_last=False)

    def _sync(self, history) -> list[int]:
        """Roll the cache back to its common prefix with `history`; return the tokens to feed."""
        c = self.cache
        n = self._base + common_prefix(c.tokens[self._base :], history[self._base :])
        n = min(n, len(history) - 1)  # always feed the last token: its logits give the first draft
        c.rollback(n)
        d = self._donor
        # only when the target holds slots the draft lacks (the prompt, a catch-up), not every round
        if d is not None and n < min(d.position, len(history) - 1):
            taken = c.take_kv(d, history)
            self.copied += taken
            n += taken
        return history[n:]

    def propose(self, history, k: int, params: SamplingParams, rng=None) -> Proposal:
        """Propose k tokens after `history` (the committed sequence, list of ids): the tokens and,
        when sampling, their q rows [k, vocab] (None when greedy)."""
        if k < 1:
            return Proposal([], None)
        history = history if isinstance(history, list) else list(history)
        if not history:
            raise ValueError("cannot draft after an empty sequence")
        pending = self._sync(history)
        c, V = self.cache, self.vocab
        greedy = params.greedy
        self._base = len(history)
        if greedy and self._chain:
            # GPU fast path: k chained steps in one launch (TensorRT backend).
            if len(pending) > 1:
                c.feed_chunked(pending[:-1])
            out = [int(t) for t in self.backend.draft_greedy(int(pending[-1]), c.position, k)]
            c.adopt([int(pending[-1])] + out[:-1])  # the chain fed each of these itself
            self.calls += k
            return Proposal(out, None)
        row = c.feed_chunked(pending)
        self.calls += -(-len(pending) // c.chunk)
        out: list[int] = []
        if greedy:
            tok = int(np.argmax(row[:V]))
            out.append(tok)
            for _ in range(k - 1):  # the backend's argmax: on the device for GPU backends
                tok = int(c.feed_argmax([tok])[0]) if self._argmax else int(np.argmax(c.feed([tok])[0, :V]))
                out.append(tok)
            self.calls += k - 1
            return Proposal(out, None)
        qs = np.empty((k, V), dtype=np.float64)
        for j in range(k):
            qs[j] = probs_from_logits(row[:V], params)
            tok = sample(qs[j], rng)
            out.append(tok)
            if j < k - 1:
                row = c.feed([tok])[0]
                self.calls += 1
        return Proposal(out, qs)

    def propose_tree(
        self, history, k: int, nodes: int, params: SamplingParams, rng=None, depth: int | None = None
    ) -> Tree | None:
        """A tree of at most `nodes` nodes: the chain of k drafts `propose` would make (greedy, or
        sampled with its q rows) plus the runner-up tokens as ranked leaf siblings
        (base.chain_tree); depth k whatever `depth` allows (a level deeper would be one more draft
        call)."""
        if k < 1 or nodes < 2:
            return None
        history = history if isinstance(history, list) else list(history)
        if not history:
            raise ValueError("cannot draft after an empty sequence")
        pending = self._sync(history)
        c, V = self.cache, self.vocab
        self._base = len(history)
        row = c.feed_chunked(pending)
        self.calls += -(-len(pending) // c.chunk)

        def step(tok: int) -> np.ndarray:
            self.calls += 1
            return c.feed([tok])[0, :V]

        return chain_tree(history[-1], row[:V], step, k, nodes, params=params, rng=rng, vocab=V)
