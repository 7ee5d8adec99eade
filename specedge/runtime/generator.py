"""The generation loop: prefill, propose -> verify -> commit -> roll back, stop, stream, stats.

The heart is `Generator.speculative_step`: the draft proposes k tokens, the target scores the
pending token plus those k in ONE call of k + 1 tokens, the verifier keeps the accepted prefix plus
one target token, and the target's cache rolls back to what was kept (a smaller position: the graph
masks the rest). Everything else is bookkeeping around it:

* `SpecController` picks k for each round and keeps speculation from making things slower: it
  estimates the per-token acceptance of this request and, from measured step costs, the expected
  speed-up of a round; when k no longer pays it shrinks k, and when even k = 1 does not pay it
  decodes target-only for a while (doubling the stretch each time), then tries again.
* `IncrementalDecoder` turns accepted token ids into text that is safe to show: it decodes a small
  window of tokens and emits only a stable prefix that does not end in U+FFFD, so a multi-byte
  character split over tokens is emitted once complete.
* Stop strings are searched in the decoded text; streamed text holds back any suffix that could
  still grow into a stop string, and the final text is cut before the stop string.

Invariant of the loop: `tokens` is the committed sequence (prompt + generated); the target's cache
holds all of it but the last token, which is fed at the start of the next step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .backends import Backend, CacheTracker
from .drafters.ngram import NgramDrafter
from .sampling import SamplingParams, make_rng, probs_from_logits, sample
from .verify import AcceptanceStats, verify_sampling

__all__ = [
    "Generator",
    "GenerationConfig",
    "Result",
    "IncrementalDecoder",
    "NgramProposer",
    "SpecController",
    "CostModel",
    "FINISH_REASONS",
]

FINISH_REASONS = ("eos", "stop", "length", "context")
MAX_SPEC_TOKENS = 16
clock = time.perf_counter


# ----------------------------------------------------------------------------- config / result


@dataclass
class GenerationConfig:
    """Everything one request can set. `spec_tokens=None` takes the bundle's k."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] | None = None
    spec_tokens: int | None = None
    speculative: bool = True
    adaptive_k: bool = False
    guard: bool = True

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    def validate(self) -> GenerationConfig:
        """Raise ValueError (one sentence) on a bad setting."""
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {m!r}")
        self.sampling.validate()
        k = self.spec_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_SPEC_TOKENS):
            raise ValueError(f"spec_tokens (k) must be an integer in 1..{MAX_SPEC_TOKENS}, got {k!r}")
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            for s in self.stop:
                if not isinstance(s, str) or not s:
                    raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        return self


@dataclass
class Result:
    """A finished generation. `token_ids` are the generated ids (no prompt, no EOS; cut after the
    token that completed a stop string); `text` is their decoded text, cut before the stop string.
    `finish_reason` is one of "eos", "stop", "length", "context"."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- text


class IncrementalDecoder:
    """Decode a growing list of token ids into text pieces that concatenate to the full text.

    Keeps two offsets into the ids: `prefix` (start of the decode window) and `read` (end of what
    has been emitted). Each push decodes ids[prefix:] and ids[prefix:read]; the difference is new
    text, emitted only when it does not end with U+FFFD (an incomplete UTF-8 sequence: its last
    bytes are still to come). Decoding a window rather than single tokens keeps the tokenizer's
    context-dependent rules (leading spaces, byte fallback) right.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token_ids) -> str:
        self.ids.extend(int(t) for t in token_ids)
        window = self.ids[self.prefix :]
        head = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(window)
        if len(text) > len(head) and not text.endswith("\ufffd"):
            piece = text[len(head) :]
            self.prefix = self.read
            self.read = len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is left (an incomplete character decodes to U+FFFD, as a full decode would)."""
        head = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(head) :] if len(text) > len(head) else ""


def _stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


# ----------------------------------------------------------------------------- drafters


class NgramProposer:
    """Adapter giving the n-gram drafter the model drafter's interface (one-hot q rows)."""

    kind = "ngram"

    def __init__(self, vocab: int, ngram_sizes=(3, 2, 1)):
        self.drafter = NgramDrafter(ngram_sizes=ngram_sizes, k=4)
        self.vocab = vocab
        self.calls = 0

    def reset(self) -> None:
        self.drafter.reset()

    def start(self, prompt) -> None:
        self.drafter.reset()

    def propose(self, history, k: int, params: SamplingParams, rng=None):
        out = []
        for t in self.drafter.propose(history, k):
            if not 0 <= t < self.vocab:  # never propose an id the target may not emit
                break
            out.append(int(t))
        q = None if params.greedy or not out else NgramDrafter.probs(out, self.vocab)
        return out, q


# ----------------------------------------------------------------------------- speculation policy


@dataclass
class CostModel:
    """Step costs in seconds: target with T tokens, draft per proposed token. Measured at load
    (`Pipeline.calibrate`) and refined by moving averages while generating."""

    target: dict = field(default_factory=dict)  # T -> seconds
    draft: float = 0.0
    alpha: float = 0.2  # moving-average weight of a new measurement

    def target_cost(self, t: int) -> float:
        """Seconds for a target call of t tokens; linear between the sizes measured."""
        c = self.target
        if t in c:
            return c[t]
        if not c:
            return float(t)  # nothing measured: pretend compute-bound (conservative for speculation)
        sizes = sorted(c)
        if t < sizes[0]:
            return c[sizes[0]]
        if t > sizes[-1]:
            if len(sizes) == 1:
                return c[sizes[0]] * t / sizes[0]  # one point: assume cost grows with T
            a, b = sizes[-2], sizes[-1]
            slope = max((c[b] - c[a]) / (b - a), 0.0)
            return c[b] + slope * (t - b)
        hi = next(s for s in sizes if s > t)
        lo = max(s for s in sizes if s < t)
        w = (t - lo) / (hi - lo)
        return c[lo] * (1 - w) + c[hi] * w

    def _ema(self, old: float | None, new: float) -> float:
        if not old:
            return new
        # a spike (another process took the CPU) moves the estimate by at most alpha * old
        return (1 - self.alpha) * old + self.alpha * min(new, 2.0 * old)

    def observe_target(self, t: int, seconds: float) -> None:
        self.target[t] = self._ema(self.target.get(t), seconds)

    def observe_draft(self, seconds_per_token: float) -> None:
        self.draft = self._ema(self.draft, seconds_per_token)

    def copy(self) -> CostModel:
        return CostModel(dict(self.target), self.draft, self.alpha)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per round with k drafts and per-token acceptance alpha (Leviathan et al.)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpecController:
    """Chooses k per round; shrinks k or falls back to target-only when speculation does not pay.

    A round with k drafts is worth E(k) target steps and costs k draft steps + one target call of
    k + 1 tokens; its speed-up is the ratio of the two. E(k') for k' up to the k in use comes from
    this request's recent rounds (decayed): a round that accepted n drafts would have accepted
    min(n, k') with k' drafts, since the first k' drafts are the same. Beyond that, E uses the
    geometric model with the per-token acceptance rate. After `min_rounds` rounds, when the current k's
    speed-up falls below `keep` (0.95: measured step times are noisy), the best smaller k is taken
    if it pays (>= 1), else decoding goes target-only for `backoff` tokens (16, doubling up to
    256 on each consecutive fallback), after which speculation is tried again.

    adaptive_k (off by default) also moves k by the last round: +1 when all k were accepted,
    -1 when the rejection came in the first half.
    """

    def __init__(self, k: int, costs: CostModel, *, adaptive: bool = False, guard: bool = True,
                 learn: bool = True, k_max: int = MAX_SPEC_TOKENS, min_rounds: int = 4, decay: float = 0.9,
                 keep: float = 0.95):
        self.k = self.k_start = int(k)
        self.k_max = max(int(k_max), self.k)
        self.costs = costs
        self.adaptive, self.guard, self.learn = adaptive, guard, learn
        self.min_rounds, self.decay = min_rounds, decay
        self.keep = keep  # hysteresis: timing noise alone should not stop a draft that roughly breaks even
        self.acc, self.rej = 2.0, 1.0  # prior: alpha = 2/3
        self.recent: deque = deque(maxlen=48)  # accepted counts of the latest rounds, newest last
        self.k_seen = self.k
        self.rounds_since = 0
        self.fallback_left = 0
        self.backoff = 16
        self.fallbacks = 0
        self.fallback_tokens = 0
        self.shrinks = 0
        self.k_hist: dict[int, int] = {}

    @property
    def alpha(self) -> float:
        return self.acc / (self.acc + self.rej)

    def expected(self, k: int) -> float:
        """Expected tokens per round with k drafts."""
        if self.recent and k <= self.k_seen:
            w = wsum = 0.0
            weight = 1.0
            for n in reversed(self.recent):
                w += weight * min(n, k)
                wsum += weight
                weight *= self.decay
            return 1.0 + w / wsum
        return expected_tokens(self.alpha, k)

    def speedup(self, k: int) -> float:
        c = self.costs
        t1 = c.target_cost(1)
        cost = k * c.draft + c.target_cost(k + 1)
        return self.expected(k) * t1 / cost if cost > 0 else float("inf")

    def next_k(self) -> int:
        """k for the next round; 0 = a target-only step."""
        if self.fallback_left > 0:
            return 0
        return self.k

    def record_plain(self, n_tokens: int, seconds: float) -> None:
        if self.learn:
            self.costs.observe_target(1, seconds)
        if self.fallback_left > 0:
            self.fallback_left -= n_tokens
            self.fallback_tokens += n_tokens
            if self.fallback_left <= 0:  # try speculating again with the full k, judging afresh
                self.acc, self.rej, self.rounds_since = 2.0, 1.0, 0
                self.recent.clear()
                self.k = self.k_start

    def record_round(self, k: int, n_accepted: int, draft_s: float, verify_s: float, drafted: int) -> None:
        self.k_hist[k] = self.k_hist.get(k, 0) + 1
        if self.learn:
            if drafted:
                self.costs.observe_draft(draft_s / drafted)
            self.costs.observe_target(drafted + 1, verify_s)
        # decayed counts: recent rounds matter more (a request can change character midway)
        self.acc = self.acc * self.decay + n_accepted
        self.rej = self.rej * self.decay + (1 if n_accepted < drafted else 0)
        if not self.recent:
            self.k_seen = k
        self.k_seen = min(self.k_seen, k)  # counterfactuals hold up to the smallest k in the window
        self.recent.append(n_accepted)
        self.rounds_since += 1
        if self.adaptive and drafted == k:
            if n_accepted == k and self.k < self.k_max:
                self.k += 1
            elif n_accepted < k / 2 and self.k > 1:
                self.k -= 1
        if not self.guard or self.rounds_since < self.min_rounds:
            return
        if self.speedup(self.k) >= self.keep:
            self.backoff = 16
            return
        best = max(range(1, self.k), key=self.speedup, default=None)
        if best is not None and self.speedup(best) >= 1.0:
            self.k = best
            self.shrinks += 1
            return
        self.fallbacks += 1
        self.fallback_left = self.backoff
        self.backoff = min(self.backoff * 2, 256)

    def to_dict(self) -> dict:
        return {
            "k": self.k_start,
            "k_final": self.k,
            "k_histogram": {str(k): v for k, v in sorted(self.k_hist.items())},
            "fallbacks": self.fallbacks,
            "fallback_tokens": self.fallback_tokens,
            "k_shrinks": self.shrinks,
            "alpha_estimate": round(self.alpha, 4),
        }


# ----------------------------------------------------------------------------- the loop


class Generator:
    """Runs requests on a target backend and an optional drafter (ModelDrafter or NgramProposer).

    vocab: ids that may be generated (the tokenizer's; logits may have padding rows beyond).
    costs: the pipeline's CostModel (shared across requests; updated while generating).
    """

    def __init__(self, target: Backend, drafter, *, vocab: int, eos_ids: Sequence[int], prefill_chunk: int,
                 max_seq: int, spec_tokens: int, decode: Callable[[list[int]], str], costs: CostModel | None = None,
                 static_costs: CostModel | None = None):
        self.target = CacheTracker(target, prefill_chunk)
        self.drafter = drafter
        self.vocab = int(vocab)
        # greedy decoding may use the backend's argmax (on the device for GPU backends) when no
        # padding rows beyond the usable vocabulary could win it
        self.device_argmax = self.vocab == target.vocab_size
        self.eos = set(int(e) for e in eos_ids)
        self.max_seq = int(max_seq)
        self.spec_tokens = int(spec_tokens)
        self.decode = decode
        self.costs = costs or CostModel()
        # Costs a seeded sampling run decides with: fixed, so the same seed gives the same output
        # whatever the machine's timing noise (measured costs would make the guard's choices vary).
        self.static_costs = static_costs or CostModel({1: 1.0, 17: 1.8}, 0.1)

    def reset(self) -> None:
        """Forget every cache's content (after a warm-up or calibration wrote into them)."""
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()

    # -- the two kinds of step ------------------------------------------------------------

    def _target_argmax(self, ids) -> list[int]:
        if self.device_argmax:
            return [int(t) for t in self.target.feed_argmax(ids)]
        return self.target.feed(ids)[:, : self.vocab].argmax(axis=-1).tolist()

    def target_step(self, tokens: list[int], params: SamplingParams, rng) -> list[int]:
        """Target-only decoding: feed the pending token, pick the next one."""
        if params.greedy:
            return self._target_argmax(tokens[-1:])
        row = self.target.feed(tokens[-1:])[0, : self.vocab]
        return [sample(probs_from_logits(row, params), rng)]

    def speculative_step(self, tokens: list[int], k: int, params: SamplingParams, rng, timing: list) -> tuple[list[int], int]:
        """Draft k tokens, verify them with one target call of k + 1 tokens, keep the accepted
        prefix plus one target token, roll the target back to what was kept.
        Returns (new tokens, number of drafts proposed)."""
        t0 = clock()
        draft, q = self.drafter.propose(tokens, k, params, rng)
        t1 = clock()
        if not draft:  # the n-gram drafter found no match: a plain step
            new = self.target_step(tokens, params, rng)
            timing[:] = [t1 - t0, clock() - t1]
            return new, 0
        position = self.target.position  # == len(tokens) - 1: the pending token is not in the cache
        ids = [tokens[-1], *draft]  # row i of the target's output: the token after draft[:i]
        if params.greedy:  # = verify_greedy on the logits, from the argmax rows alone
            best = self._target_argmax(ids)
            n = next((i for i, (d, b) in enumerate(zip(draft, best)) if d != b), len(draft))
            new = draft[:n] + [best[n]]
        else:
            logits = self.target.feed(ids)[:, : self.vocab]
            new = verify_sampling(draft, q, probs_from_logits(logits, params), rng)
        self.target.rollback(position + len(new))  # the pending token + the accepted drafts
        timing[:] = [t1 - t0, clock() - t1]
        return new, len(draft)

    # -- a request -------------------------------------------------------------------------

    def run(self, prompt: Sequence[int], cfg: GenerationConfig) -> Iterator[str]:
        """Generate for `prompt` (token ids): yields text pieces; the generator's return value
        (StopIteration.value) is the Result."""
        cfg.validate()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_seq:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens but the bundle's context holds {self.max_seq} "
                "(prompt + at least one new token must fit)"
            )
        params = cfg.sampling
        rng = make_rng(params.seed)
        speculative = bool(cfg.speculative and self.drafter is not None)
        k = int(cfg.spec_tokens or self.spec_tokens)
        deterministic = not params.greedy and params.seed is not None
        costs = self.static_costs.copy() if deterministic else self.costs
        ctl = SpecController(k, costs, adaptive=cfg.adaptive_k, guard=cfg.guard, learn=not deterministic)
        acc = AcceptanceStats()
        stops = list(cfg.stop or [])
        dec = IncrementalDecoder(self.decode)

        t_start = clock()
        reused = self.target.reuse(prompt)
        row = self.target.feed_chunked(prompt[reused:])[: self.vocab]
        if params.greedy:
            first = int(np.argmax(row))
        else:
            first = sample(probs_from_logits(row, params), rng)
        t_first = clock()
        if speculative:
            self.drafter.start(prompt)
            calls0 = self.drafter.calls
            copied0 = getattr(self.drafter, "copied", 0)
        tokens = prompt + [first]
        out: list[int] = []
        text = ""  # decoded text of `out`
        shown = 0  # characters of `text` already yielded
        t_draft = t_verify = paused = 0.0
        finish = None
        new = [first]
        timing = [0.0, 0.0]
        while True:
            # commit `new`: EOS, stop strings, length
            for tok in new:
                if tok in self.eos:
                    finish = "eos"
                    break
                out.append(tok)
                before = len(text)
                text += dec.push([tok])
                if stops and len(text) > before:
                    cut = _find_stop(text, stops, before)
                    if cut is not None:
                        text, finish = text[:cut], "stop"
                        break
                if len(out) >= cfg.max_new_tokens:
                    finish = "length"
                    break
            if finish is None and self.target.position >= self.max_seq:
                finish = "context"
            if finish is not None:
                break
            hold = _stop_holdback(text, stops) if stops else 0
            if len(text) - hold > shown:
                y0 = clock()
                yield text[shown : len(text) - hold]
                paused += clock() - y0  # the consumer's time is not ours
                shown = len(text) - hold

            # next step: k limited by what is left to generate and by the context
            room = self.max_seq - self.target.position  # free slots, >= 1 here
            kk = min(ctl.next_k() if speculative else 0, cfg.max_new_tokens - len(out) - 1, room - 1)
            if kk >= 1:
                new, drafted = self.speculative_step(tokens, kk, params, rng, timing)
                t_draft += timing[0]
                t_verify += timing[1]
                if drafted:
                    acc.record(drafted, len(new) - 1)
                    ctl.record_round(kk, len(new) - 1, timing[0], timing[1], drafted)
                else:
                    ctl.record_plain(1, timing[1])
            else:
                t0 = clock()
                new = self.target_step(tokens, params, rng)
                dt = clock() - t0
                t_verify += dt
                if speculative:
                    ctl.record_plain(1, dt)
            tokens.extend(new)

        if finish != "stop":
            text += dec.flush()
            if stops:
                cut = _find_stop(text, stops, 0)
                if cut is not None:
                    text, finish = text[:cut], "stop"
        # The target cache must hold only committed tokens for the next request's prefix reuse.
        self.target.rollback(min(self.target.position, len(tokens) - 1))
        t_end = clock() - paused
        if len(text) > shown:
            yield text[shown:]
        n = len(out)
        decode_s = t_end - t_first
        stats = {
            "tokens": n,
            "prompt_tokens": len(prompt),
            "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            "e2e_tokens_per_s": n / (t_end - t_start) if t_end > t_start else 0.0,
            "ttft_s": t_first - t_start,
            "prefill_s": t_first - t_start,
            "decode_s": decode_s,
            "total_s": t_end - t_start,
            "time_draft_s": t_draft,
            "time_verify_s": t_verify,
            "time_other_s": max(decode_s - t_draft - t_verify, 0.0),
            "speculative": speculative,
            "drafter": self.drafter.kind if speculative else None,
            "acceptance_rate": acc.acceptance_rate,
            "mean_accepted": acc.mean_accepted,
            "accepted_histogram": acc.histogram,
            "target_calls": acc.calls,
            "drafted": acc.drafted,
            "accepted": acc.accepted,
            "prefix_reused_tokens": reused,
        }
        if speculative:
            stats.update(ctl.to_dict())
            stats["draft_calls"] = self.drafter.calls - calls0
            # draft cache slots taken from the target's K/V instead of fed (self-draft hand-over)
            stats["draft_kv_copied"] = getattr(self.drafter, "copied", 0) - copied0
        else:
            stats.update({"k": 0, "k_final": 0, "fallbacks": 0})
        return Result(text=text, token_ids=out, finish_reason=finish, stats=stats)


def _find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index of the earliest stop string in text (searching from `start`), or None."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s)))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
