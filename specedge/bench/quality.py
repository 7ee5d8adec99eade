"""What a quantized target trades against its fp32 reference: greedy agreement on the prompt suite
and perplexity on held-out text, measured through the runtime (scripts/bench_quality.py runs it).

Agreement: each bundle decodes every prompt greedily with the target alone; a prompt agrees when
its whole output equals the reference's, and the tokens before the first divergence are counted.
Teacher-forced top-1 agreement feeds the reference's own continuation to the bundle (multi-token
calls, every row's logits) and counts the positions whose argmax is the reference's token: one
early divergence no longer hides how the rest of the answer would have gone.

Perplexity: the held-out text's tokens cut into windows of equal length from slot 0, each window
fed in calls of the bundle's prefill chunk; every token but a window's first is scored by the
log-softmax of the row before it. Every bundle scores the very same windows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..runtime.cache import common_prefix

__all__ = [
    "call_size",
    "greedy_agreement",
    "held_out_perplexity",
    "perplexity",
    "score_rows",
    "score_sequence",
    "teacher_forced",
    "windows",
]


def score_rows(logits: np.ndarray, targets: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """For logits [N, V] and the N tokens that follow each row: (negative log-likelihood of each
    target, float64 [N]; each row's argmax, int64 [N]). Summed in float64 so long texts lose nothing."""
    x = np.asarray(logits, dtype=np.float64)
    t = np.asarray(targets, dtype=np.int64).reshape(-1)
    if x.ndim != 2 or x.shape[0] != t.shape[0]:
        raise ValueError(f"logits of shape {x.shape} do not match {t.shape[0]} targets")
    top = x.max(axis=1)
    lse = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
    return lse - x[np.arange(t.shape[0]), t], x.argmax(axis=1)


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp(mean negative log-likelihood) of `tokens` scored tokens."""
    if tokens < 1:
        raise ValueError("no tokens were scored")
    return math.exp(nll_sum / tokens)


def windows(ids: Sequence[int], size: int, limit: int | None = None) -> list[list[int]]:
    """`ids` cut into consecutive windows of exactly `size` tokens (a shorter tail is dropped so
    that every window scores alike), at most `limit` of them."""
    if size < 2:
        raise ValueError(f"a window needs at least 2 tokens, got {size}")
    n = len(ids) // size
    if limit is not None:
        n = min(n, limit)
    return [list(ids[i * size : (i + 1) * size]) for i in range(n)]


def call_size(pipe) -> int:
    """The most tokens one scoring call feeds: the bundle's prefill chunk, within what the target
    backend takes in one call."""
    return max(1, min(int(pipe.manifest.prefill_chunk), int(pipe.target.max_call_tokens)))


def score_sequence(pipe, ids: Sequence[int], first: int) -> tuple[np.ndarray, np.ndarray]:
    """Feed `ids` from cache slot 0 through the pipeline's target (its cache tracker: the padded
    single-token steps of a quantized target included) in calls of `call_size`, and score tokens
    ids[first:] by the rows before them: (nll float64, argmax int64), one entry per scored token."""
    if not 1 <= first < len(ids):
        raise ValueError(f"cannot score from token {first} of {len(ids)}")
    if len(ids) > pipe.max_seq:
        raise ValueError(f"{len(ids)} tokens do not fit the bundle's context of {pipe.max_seq}")
    ids = np.asarray(ids, dtype=np.int64)
    pipe.generator.reset()  # these calls overwrite the cache: no later request may reuse its record
    target, chunk, vocab = pipe.generator.target, call_size(pipe), pipe.vocab
    nll, top = [], []
    for start in range(0, len(ids) - 1, chunk):  # the last token predicts nothing here
        part = ids[start : min(start + chunk, len(ids) - 1)]
        rows = target.run(part, start)
        # row j predicts ids[start + j + 1]; keep the rows whose next token is scored
        lo = max(first - 1 - start, 0)
        if lo >= len(part):
            continue
        a, b = score_rows(rows[lo : len(part), :vocab], ids[start + lo + 1 : start + len(part) + 1])
        nll.append(a)
        top.append(b)
    return np.concatenate(nll), np.concatenate(top)


def greedy_agreement(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> dict:
    """Prompt by prompt, outputs against the reference's: how many are equal as a whole, and the
    mean number of tokens before the first divergence (an equal output counts its full length)."""
    if len(reference) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs for {len(reference)} reference outputs")
    if not reference:
        raise ValueError("no outputs to compare")
    same = sum(list(a) == list(b) for a, b in zip(reference, outputs))
    prefix = [common_prefix(a, b) for a, b in zip(reference, outputs)]
    return {
        "same_output": same,
        "prompts": len(reference),
        "mean_tokens_before_divergence": round(sum(prefix) / len(prefix), 2),
        "tokens_before_divergence": prefix,
    }


def teacher_forced(pipe, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> dict:
    """Top-1 agreement with the reference's continuations: each prompt followed by its reference
    continuation is fed once, and every continuation token is compared with the bundle's argmax at
    that position (given the reference's tokens before it)."""
    agree = positions = 0
    for p, c in zip(prompts, continuations, strict=True):
        if not c:
            continue
        _, top = score_sequence(pipe, [*p, *c], len(p))
        agree += int((top == np.asarray(c, dtype=np.int64)).sum())
        positions += len(c)
    return {"positions": positions, "top1_agree": agree, "rate": round(agree / positions, 4) if positions else None}


def held_out_perplexity(pipe, wins: Sequence[Sequence[int]]) -> dict:
    """Perplexity over `windows` (each scored from its second token) and how many tokens that is."""
    nll_sum, scored = 0.0, 0
    for w in wins:
        nll, _ = score_sequence(pipe, w, 1)
        nll_sum += float(nll.sum())
        scored += int(nll.shape[0])
    return {
        "tokens": scored,
        "nll_mean": round(nll_sum / scored, 5),
        "perplexity": round(perplexity(nll_sum, scored), 4),
    }
