"""Verification of drafted tokens against one batched target call.

Row i of the target's output is its next-token distribution after the prefix plus
`draft_tokens[:i]`, so k drafted tokens need k + 1 rows: the last one gives the bonus token when
everything is accepted. Both verifiers return the tokens to emit, always `n_accepted + 1` of them,
so every target call makes progress even when the draft is useless.

Greedy: emit the draft while it equals the target argmax, then the target's own token.

Sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"): for
each position accept x ~ q with probability min(1, p(x) / q(x)); on the first rejection emit a
token from norm(max(0, p - q)) and stop; after k acceptances emit a bonus token from p_k. Each
emitted token is then distributed exactly as the target's p, whatever the draft is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specedge.runtime.sampling import sample

__all__ = ["accept_greedy", "verify_greedy", "verify_sampling", "AcceptanceStats"]


def _check_tokens(draft_tokens: Sequence[int], rows: int, vocab: int, what: str) -> list[int]:
    tokens = [int(t) for t in draft_tokens]
    if rows != len(tokens) + 1:
        raise ValueError(f"{what} needs len(draft_tokens) + 1 = {len(tokens) + 1} rows, got {rows}")
    for t in tokens:
        if not 0 <= t < vocab:
            raise ValueError(f"draft token {t} is outside the vocabulary [0, {vocab})")
    return tokens


def verify_greedy(draft_tokens: Sequence[int], target_logits: np.ndarray) -> list[int]:
    """Return the accepted draft prefix plus one target token (correction or bonus).

    `target_logits` is [k + 1, V]; argmax ties go to the lower id (np.argmax), the same rule the
    target-only greedy loop uses, so speculative and plain greedy output agree token for token.
    """
    logits = np.asarray(target_logits)
    if logits.ndim != 2:
        raise ValueError(f"target_logits must be [k + 1, V], got shape {logits.shape}")
    tokens = _check_tokens(draft_tokens, logits.shape[0], logits.shape[1], "target_logits")
    return accept_greedy(tokens, logits.argmax(axis=-1).tolist())


def accept_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """`verify_greedy` from the target's argmax rows alone (k + 1 ids): what a backend that takes
    the argmax on the device returns, so the logits never reach the host."""
    best = [int(b) for b in target_argmax]
    if len(best) != len(draft_tokens) + 1:
        raise ValueError(f"need len(draft_tokens) + 1 = {len(draft_tokens) + 1} argmax rows, got {len(best)}")
    out = []
    for x, b in zip(draft_tokens, best):
        if x != b:
            break
        out.append(int(x))
    out.append(best[len(out)])
    return out


def verify_sampling(
    draft_tokens: Sequence[int], draft_probs: np.ndarray | None, target_probs: np.ndarray, rng
) -> list[int]:
    """Exact speculative sampling: the emitted tokens are distributed as target-only sampling.

    `draft_probs` [k, V] are the q rows the draft tokens were sampled from and `target_probs`
    [k + 1, V] the p rows, both from `probs_from_logits` with the same params. Uses one
    `rng.random()` per acceptance test and one per emitted sample (see sampling.py).

    `draft_probs` None is a deterministic proposal (an n-gram lookup, a greedy draft): each token
    is a point mass, q = one-hot at x, so accept with probability p(x), otherwise sample p without
    x. A drafted token with q(x) == 0 gets the same rule. That is exact for *any* way the token
    was chosen, so a draft that filtered its distribution after sampling, or an n-gram drafter,
    can never bias the output.
    """
    p_all = np.asarray(target_probs, dtype=np.float64)
    if p_all.ndim != 2:
        raise ValueError(f"target_probs must be [k + 1, V], got shape {p_all.shape}")
    tokens = _check_tokens(draft_tokens, p_all.shape[0], p_all.shape[1], "target_probs")
    q_all = None
    if draft_probs is not None:
        q_all = np.asarray(draft_probs, dtype=np.float64)
        if q_all.shape != (len(tokens), p_all.shape[1]):
            raise ValueError(f"draft_probs must be [k, V] = {(len(tokens), p_all.shape[1])}, got {q_all.shape}")

    out = []
    for i, x in enumerate(tokens):
        p = p_all[i]
        q = None if q_all is None else q_all[i]
        qx = 0.0 if q is None else q[x]
        if qx <= 0:  # a point mass at x, see the docstring
            # u < p(x) / 1; on rejection max(p - onehot(x), 0) is p with x removed
            if rng.random() < p[x]:
                out.append(x)
                continue
            residual = p.copy()
            residual[x] = 0.0
        else:
            # u < p/q without dividing; with p(x) >= q(x) this always holds because u < 1.
            if rng.random() * qx < p[x]:
                out.append(x)
                continue
            residual = np.maximum(p - q, 0.0)
        # Mathematically a rejection implies p(y) > q(y) somewhere; only rounding (p ~= q) can
        # leave no mass, and then p itself is the right fallback.
        out.append(sample(residual if residual.sum() > 0 else p, rng))
        return out
    out.append(sample(p_all[len(tokens)], rng))
    return out


@dataclass
class AcceptanceStats:
    """Running acceptance counts over target calls (one `record` per verification)."""

    calls: int = 0
    drafted: int = 0
    accepted: int = 0
    _hist: list[int] = field(default_factory=list, repr=False)

    def record(self, n_drafted: int, n_accepted: int) -> None:
        if not 0 <= n_accepted <= n_drafted:
            raise ValueError(f"need 0 <= n_accepted <= n_drafted, got {n_accepted} of {n_drafted}")
        self.calls += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        if len(self._hist) <= n_drafted:  # histogram spans 0..largest k seen
            self._hist.extend([0] * (n_drafted + 1 - len(self._hist)))
        self._hist[n_accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0.0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean tokens emitted per target call (accepted + the target's own token)."""
        return (self.accepted + self.calls) / self.calls if self.calls else 0.0

    @property
    def histogram(self) -> list[int]:
        """histogram[n] = number of calls that accepted exactly n draft tokens."""
        return list(self._hist)

    def to_dict(self) -> dict:
        return {
            "calls": self.calls,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted": self.mean_accepted,
            "histogram": self.histogram,
        }
