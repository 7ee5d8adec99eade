"""One step of decoding, as functions that return what they did.

`speculative_round`: the drafter proposes up to k tokens, the target scores the pending token plus
those drafts in ONE call of k + 1 tokens, the verifier keeps the accepted prefix plus one target
token, and the target's cache rolls back to what was kept (a smaller position: the graph masks
the rest). `target_step`: the target alone picks the next token. Both leave the target's cache
holding every committed token but the last, which the next step feeds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .cache import CacheTracker
from .drafters.base import Drafter, Proposal
from .sampling import SamplingParams, probs_from_logits, sample
from .verify import accept_greedy, verify_sampling

__all__ = ["Round", "TargetView", "speculative_round", "target_step"]

clock = time.perf_counter


@dataclass
class TargetView:
    """The target's cache and how to read its next-token choices.

    vocab: ids that may be generated (the tokenizer's; logits may have padding rows beyond).
    device_argmax: greedy picks may use the backend's argmax (on the device for GPU backends),
    which is only right when no padding row beyond `vocab` could win it."""

    cache: CacheTracker
    vocab: int
    device_argmax: bool

    def argmax(self, ids) -> list[int]:
        if self.device_argmax:
            return [int(t) for t in self.cache.feed_argmax(ids)]
        return self.cache.feed(ids)[:, : self.vocab].argmax(axis=-1).tolist()

    def first_token(self, row: np.ndarray, params: SamplingParams, rng) -> int:
        """The token after a prefill, from its last row of logits."""
        row = row[: self.vocab]
        return int(np.argmax(row)) if params.greedy else sample(probs_from_logits(row, params), rng)


@dataclass
class Round:
    """What one step did: the tokens to commit (at least one), how many drafts the target
    verified (0: a target-only step), the seconds spent drafting and in the target, and the k
    the round asked the drafter for (0 for a target step). A tree round also says how many tokens
    its target call had (`call`, the root included) and its depth (`depth`, the draft steps on its
    longest path); a chain leaves both 0, meaning drafted + 1 and drafted."""

    tokens: list[int]
    drafted: int
    draft_s: float
    verify_s: float
    k: int = 0
    call: int = 0
    depth: int = 0
    chain_accepted: int | None = None  # trees: drafts the tree's first line alone would have kept

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1 if self.drafted else 0

    @property
    def call_size(self) -> int:
        return self.call or self.drafted + 1

    @property
    def draft_depth(self) -> int:
        return self.depth or self.drafted


def target_step(target: TargetView, tokens: list[int], params: SamplingParams, rng) -> Round:
    """Target-only decoding: feed the pending token, pick the next one."""
    t0 = clock()
    if params.greedy:
        new = target.argmax(tokens[-1:])
    else:
        row = target.cache.feed(tokens[-1:])[0, : target.vocab]
        new = [sample(probs_from_logits(row, params), rng)]
    return Round(new, 0, 0.0, clock() - t0)


def speculative_round(
    target: TargetView, drafter: Drafter, tokens: list[int], k: int, params: SamplingParams, rng
) -> Round:
    """Draft up to k tokens after `tokens` (the committed sequence), verify them with one target
    call, keep the accepted prefix plus one target token, roll the target back to what was kept.
    A drafter that finds nothing to propose (an n-gram miss) makes this a plain target step."""
    t0 = clock()
    draft, q = Proposal(*drafter.propose(tokens, k, params, rng))
    t1 = clock()
    if not draft:
        plain = target_step(target, tokens, params, rng)
        return Round(plain.tokens, 0, t1 - t0, plain.verify_s, k)
    cache = target.cache
    position = cache.position  # == len(tokens) - 1: the pending token is not in the cache
    ids = [tokens[-1], *draft]  # row i of the target's output: the token after draft[:i]
    if params.greedy:
        new = accept_greedy(draft, target.argmax(ids))
    else:
        logits = cache.feed(ids)[:, : target.vocab]
        new = verify_sampling(draft, q, probs_from_logits(logits, params), rng)
    cache.rollback(position + len(new))  # the pending token + the accepted drafts
    return Round(new, len(draft), t1 - t0, clock() - t1, k)
