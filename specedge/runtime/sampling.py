"""Turning logits into the probability rows that drafting and verification use.

The same `probs_from_logits` is applied to the draft's and the target's logits, so speculative
sampling compares two distributions that went through identical temperature / top-k / top-p
filtering; the verifier then reproduces the filtered target distribution exactly.

Everything is computed in float64: the exactness tests compare distributions to 1e-9, and a
float32 softmax over a 150k vocabulary would already be off by more than that.

Randomness contract: every random decision draws exactly one `rng.random()` (a float64 uniform in
[0, 1)). Nothing else touches the generator, so a seed reproduces a run bit for bit, and tests can
drive the code with a scripted generator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..contract import SEED_MAX

__all__ = ["SamplingParams", "probs_from_logits", "make_rng", "sample"]


@dataclass
class SamplingParams:
    """Decoding settings shared by the draft and the target.

    `temperature == 0` means greedy decoding (top_k / top_p are then irrelevant). `top_k == 0` and
    `top_p == 1.0` disable those filters. `seed=None` draws a fresh seed from the OS.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, names: Mapping[str, str] | None = None) -> SamplingParams:
        """Raise ValueError (one sentence) on a bad setting; return self so calls can chain.
        `names` shows a field under the caller's name for it (a CLI flag, a JSON field)."""
        n = (names or {}).get
        for name in ("temperature", "top_k", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"{n(name, name)} must be a number, got {value!r}")
            if math.isnan(value):
                raise ValueError(f"{n(name, name)} must not be NaN")
        if self.temperature < 0:
            raise ValueError(f"{n('temperature', 'temperature')} must be >= 0, got {self.temperature}")
        if math.isinf(self.temperature):
            raise ValueError(f"{n('temperature', 'temperature')} must be finite, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"{n('top_p', 'top_p')} must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"{n('top_k', 'top_k')} must be >= 0 (0 disables it), got {self.top_k}")
        if self.top_k != int(self.top_k):
            raise ValueError(f"{n('top_k', 'top_k')} must be an integer, got {self.top_k}")
        check_seed(self.seed, n("seed", "seed"))
        return self


def check_seed(seed, name: str = "seed") -> None:
    """Refuse a seed outside 0..SEED_MAX (None: a fresh seed from the OS) with one sentence."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"{name} must be an integer from 0 to {SEED_MAX} (2^64-1), got {seed!r}")


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Return float64 probabilities with the shape of `logits` ([V] or [N, V]); rows sum to 1.

    Order: temperature, then top-k, then top-p on the renormalised top-k distribution (the order
    Hugging Face uses, so users get the distribution they expect). Ties are broken towards the
    lower token id everywhere (top-k boundary, top-p boundary, greedy argmax), matching np.argmax,
    so the result never depends on sort-implementation details.

    Greedy params give a one-hot row at np.argmax(logits).
    """
    params.validate()
    x = np.asarray(logits)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"logits must have shape [V] or [N, V] with V > 0, got {x.shape}")
    rows = x.reshape(-1, x.shape[-1])
    if np.isnan(rows).any() or np.isposinf(rows).any():
        raise ValueError("logits must not contain NaN or +inf")
    if np.isneginf(rows).all(axis=-1).any():
        raise ValueError("every logit of a row is -inf, so no token can be chosen")
    n, vocab = rows.shape

    if params.greedy:
        out = np.zeros((n, vocab), dtype=np.float64)
        out[np.arange(n), rows.argmax(axis=-1)] = 1.0
        return out.reshape(x.shape)

    # Shift before dividing: with a tiny temperature, logits / T could overflow to +inf.
    z = rows.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    z /= params.temperature

    # max(z) == 0, so exp cannot overflow and every row keeps an entry equal to 1.
    top_k = int(params.top_k)
    if 0 < top_k < vocab:
        keep = _top_k_mask(z, top_k)
        probs = np.zeros_like(z)
        probs[keep] = np.exp(z[keep])  # exp dominates on a 150k vocabulary: only the survivors
    else:
        probs = np.exp(z, out=z)
    probs /= probs.sum(axis=-1, keepdims=True)

    if params.top_p < 1.0:
        for row in probs:
            keep = _nucleus(row, params.top_p)
            kept = row[keep]
            row[:] = 0.0
            row[keep] = kept / kept.sum()

    return probs.reshape(x.shape)


def _top_k_mask(z: np.ndarray, k: int) -> np.ndarray:
    """Mask of the k largest entries per row, ties at the boundary going to the lower ids.

    np.partition is O(V) where a full sort of a 150k vocabulary costs milliseconds per row.
    """
    kth = np.partition(z, z.shape[1] - k, axis=-1)[:, z.shape[1] - k, None]  # k-th largest value
    keep = z > kth
    for row, mask, value in zip(z, keep, kth[:, 0]):
        need = k - int(mask.sum())
        mask[np.flatnonzero(row == value)[:need]] = True
    return keep


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Ids of the smallest set of most probable tokens whose mass reaches top_p.

    Same answer as sorting the whole row (descending, lower id first on ties) and cutting the
    cumulative sum, but only the m most probable candidates are sorted; m grows until the cut
    falls strictly above the smallest candidate, which proves no token outside them could belong.
    """
    m = min(p.size, 256)
    while True:
        cand = np.arange(p.size) if m == p.size else np.sort(np.argpartition(-p, m - 1)[:m])
        order = cand[np.argsort(-p[cand], kind="stable")]  # cand is id-sorted: ties -> lower id
        n_keep = min(int((np.cumsum(p[order]) < top_p).sum()) + 1, m)
        if m == p.size or p[order[n_keep - 1]] > p[order[-1]]:
            return order[:n_keep]
        m = min(8 * m, p.size)


def make_rng(seed: int | None) -> np.random.Generator:
    """A PCG64 generator; `None` seeds from the OS (non-reproducible on purpose)."""
    check_seed(seed)
    return np.random.default_rng(seed)


def sample(probs_row: np.ndarray, rng) -> int:
    """Draw one token id from a 1-D probability row by inverse CDF on one float64 uniform.

    The row need not sum exactly to 1 (the uniform is scaled by the total), and a token with zero
    probability is never returned, even when rounding puts the scaled uniform on the last CDF value.
    """
    p = np.asarray(probs_row, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"probs_row must be a non-empty 1-D array, got shape {p.shape}")
    cdf = np.cumsum(p)
    total = cdf[-1]
    if not np.isfinite(total) or total <= 0 or (p < 0).any():
        raise ValueError("probs_row must be finite, non-negative and have a positive sum")
    # side="right" returns the first index whose cdf exceeds u; a zero-probability token has the
    # same cdf as its predecessor, so it can never be that first index.
    idx = int(np.searchsorted(cdf, rng.random() * total, side="right"))
    if idx >= p.size:  # u * total rounded up to total: take the last token that has mass
        idx = int(np.flatnonzero(p)[-1])
    return idx
