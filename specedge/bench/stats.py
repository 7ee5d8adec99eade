"""Statistics for `specedge bench`: robust summaries, acceptance bookkeeping and weight bandwidth.

Pure Python (no numpy) so the arithmetic is easy to check by hand.

Summaries
---------
`summarize(xs)` gives the median and the spread of repeated measurements: the quartiles (linear
interpolation between order statistics, numpy's default "linear" method), their difference (IQR),
min and max. Medians, not means: one run disturbed by another process should not move the figure.

Acceptance bookkeeping
----------------------
Each speculative run reports `drafted` (draft tokens proposed), `accepted` (of those, accepted by
the target), `target_calls` (verification calls, one per round) and a histogram (`hist[n]` = rounds
that accepted exactly n drafts). Pooling runs sums these counts; the pooled rates are then

    acceptance_rate = accepted / drafted
    mean_accepted   = (accepted + target_calls) / target_calls   (tokens emitted per verification:
                                                                   the accepted drafts + the target's own)

(ratios of sums, not means of per-run ratios, so a long run weighs more than a short one).

Weight bandwidth
----------------
Decoding a small model at batch 1 is bound by reading its weights: every forward pass reads all of
them once, whatever the number of tokens T in the call. So the bytes of weights read per generated
token are

    target-only:   W_t
    speculative:   (W_t + k * W_d) / m

with W_t, W_d the bytes of weights of one target / draft forward pass (`ModelSpec.weight_bytes` in
the manifest), k the draft steps per round (each a draft forward pass) and m the mean tokens
emitted per target call (`mean_accepted`, in 1..k+1). An n-gram drafter reads no weights (W_d = 0).
When a run mixes rounds of different k and plain target steps (the runtime's guard shrinks k or
falls back to target-only decoding), the exact count is used instead:

    bytes_per_token = (W_t * target_forward_passes + W_d * draft_forward_passes) / decode_tokens

with target_forward_passes = verification calls + plain steps, draft_forward_passes = drafted
tokens. The achieved ("effective") bandwidth is bytes_per_token * tokens_per_s: the rate at which
weights are streamed from memory. Comparing it with the machine's memory bandwidth says how close
decoding is to the memory-bound limit; speculative decoding raises tokens/s by *lowering*
bytes_per_token, so its achieved bandwidth can stay flat while tokens/s grows. KV-cache reads and
activations are not counted (small next to the weights at these context lengths).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "quantile",
    "median",
    "summarize",
    "pool_acceptance",
    "merge_histograms",
    "decode_target_calls",
    "spec_bytes_per_token",
    "bytes_per_token",
    "bandwidth",
    "throughput",
    "geometric_mean",
]


def _clean(xs: Iterable[float]) -> list[float]:
    out = []
    for x in xs:
        if x is None:
            continue
        x = float(x)
        if math.isnan(x):
            continue
        out.append(x)
    return out


def quantile(xs: Iterable[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) by linear interpolation between order statistics (numpy's
    default): position (n - 1) * q in the sorted values. NaN for no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q must be in [0, 1], got {q}")
    v = sorted(_clean(xs))
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    frac = pos - lo
    return v[lo] + (v[hi] - v[lo]) * frac


def median(xs: Iterable[float]) -> float:
    """Median (mean of the two middle values for an even count); NaN for no values."""
    return quantile(xs, 0.5)


def summarize(xs: Iterable[float]) -> dict:
    """{"median", "q1", "q3", "iqr", "min", "max", "n"} of the values (None / NaN dropped).
    With no values every statistic is None and n is 0 (JSON has no NaN)."""
    v = _clean(xs)
    if not v:
        return {"median": None, "q1": None, "q3": None, "iqr": None, "min": None, "max": None, "n": 0}
    q1, q3 = quantile(v, 0.25), quantile(v, 0.75)
    return {"median": median(v), "q1": q1, "q3": q3, "iqr": q3 - q1, "min": min(v), "max": max(v), "n": len(v)}


def merge_histograms(hists: Iterable[Sequence[int]]) -> list[int]:
    """Element-wise sum of acceptance histograms of different lengths (hist[n] = rounds that
    accepted exactly n drafts)."""
    out: list[int] = []
    for h in hists:
        h = list(h or [])
        if len(h) > len(out):
            out.extend([0] * (len(h) - len(out)))
        for i, c in enumerate(h):
            out[i] += int(c)
    return out


def decode_target_calls(tokens: int, accepted: int, target_calls: int) -> int:
    """Target forward passes spent in the decode phase of one run: the verification calls plus the
    plain (target-only) steps. The first token comes from the prefill; every verification emits
    accepted + 1 tokens and every plain step one, so plain steps = tokens - 1 - accepted - calls
    (never negative: tokens cut by EOS / max tokens / stop strings only make it smaller)."""
    plain = max(int(tokens) - 1 - int(accepted) - int(target_calls), 0)
    return int(target_calls) + plain


def pool_acceptance(runs: Iterable[Mapping]) -> dict:
    """Pool the acceptance counts of several runs (dicts with drafted, accepted, target_calls,
    histogram and tokens). Returns drafted, accepted, target_calls (verification calls),
    target_forward_passes (verifications + plain steps in decode), decode_tokens, histogram,
    acceptance_rate and mean_accepted (None when nothing was drafted)."""
    drafted = accepted = calls = passes = decode_tokens = 0
    hists = []
    for r in runs:
        d, a, c = int(r.get("drafted", 0) or 0), int(r.get("accepted", 0) or 0), int(r.get("target_calls", 0) or 0)
        n = int(r.get("tokens", 0) or 0)
        if a > d:
            raise ValueError(f"a run accepted more drafts ({a}) than it proposed ({d})")
        drafted += d
        accepted += a
        calls += c
        passes += decode_target_calls(n, a, c)
        decode_tokens += max(n - 1, 0)
        hists.append(r.get("histogram") or [])
    return {
        "drafted": drafted,
        "accepted": accepted,
        "target_calls": calls,
        "target_forward_passes": passes,
        "decode_tokens": decode_tokens,
        "histogram": merge_histograms(hists),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted": (accepted + calls) / calls if calls else None,
    }


def spec_bytes_per_token(target_bytes: float, draft_bytes: float, k: int, mean_accepted: float) -> float:
    """Closed form: weight bytes read per generated token by speculative decoding with k draft
    steps per round and `mean_accepted` tokens per target call: (W_t + k * W_d) / m.
    k = 0 (target-only) gives W_t."""
    if k == 0:
        return float(target_bytes)
    if not mean_accepted or mean_accepted <= 0:
        raise ValueError("mean_accepted must be > 0 for a speculative run")
    return (float(target_bytes) + k * float(draft_bytes)) / float(mean_accepted)


def bytes_per_token(
    target_bytes: float, draft_bytes: float, target_passes: int, draft_passes: int, decode_tokens: int
) -> float | None:
    """Exact count: (W_t * target passes + W_d * draft passes) / decode tokens; None without tokens."""
    if decode_tokens <= 0:
        return None
    return (float(target_bytes) * target_passes + float(draft_bytes) * draft_passes) / decode_tokens


def bandwidth(bytes_per_tok: float | None, tokens_per_s: float | None) -> float | None:
    """Achieved weight bandwidth in bytes/s: bytes per token * tokens per second."""
    if bytes_per_tok is None or tokens_per_s is None:
        return None
    return float(bytes_per_tok) * float(tokens_per_s)


def throughput(runs: Iterable[Mapping]) -> float | None:
    """Decode tokens/s of a group of runs taken together: sum of decode tokens / sum of decode
    seconds (each run's first token comes from the prefill and is timed as TTFT)."""
    toks = secs = 0.0
    for r in runs:
        n = int(r.get("tokens", 0) or 0)
        s = float(r.get("decode_s", 0.0) or 0.0)
        if n > 1 and s > 0:
            toks += n - 1
            secs += s
    return toks / secs if secs > 0 else None


def geometric_mean(xs: Iterable[float]) -> float | None:
    v = [x for x in _clean(xs) if x > 0]
    if not v:
        return None
    return math.exp(sum(math.log(x) for x in v) / len(v))
