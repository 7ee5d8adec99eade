"""The speculation policy: how many tokens to draft per round, and when not to speculate at all.

Specified once, in docs/design.md ("The speculation policy"), with the constants below; the C++
runtime implements the same rules (cpp/src/policy.{h,cpp}) and both are pinned by the recorded
sequences in tests/data/policy_vectors.json, which tests/test_policy.py and cpp/tests run.

`CostModel` holds step costs (measured at load, refined while generating, shared by requests);
`SpecController` picks k for each round from this request's acceptance and its own recent step
times, which follow the machine's load where the shared, spike-clamped model cannot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..contract import MAX_SPEC_TOKENS

__all__ = ["CostModel", "SpecController", "draft_step_cost", "expected_tokens", "static_cost_model"]

EMA_WEIGHT = 0.2  # weight of a new cost measurement in the moving average
SPIKE_CLAMP = 2.0  # a measurement counts at most this many times the current estimate
PRIOR_ACCEPTED, PRIOR_REJECTED = 2.0, 1.0  # prior of the acceptance estimate: alpha = 2/3
DECAY = 0.9  # per-round decay of the acceptance counts and of the counterfactual window
WINDOW = 48  # rounds kept for the counterfactual E(k)
MIN_ROUNDS = 4  # rounds at a k before the guard judges it
KEEP = 1.0  # keep k while its expected speed-up is at least this
SHRINK_MIN = 1.0  # a smaller k is taken only if it pays at all
BACKOFF_START, BACKOFF_MAX = 16, 256  # target-only tokens after a fallback, doubling
LOCAL_WEIGHT = 0.25  # weight of a new measurement in the request's own step times (unclamped:
# their mean, spikes included, is what the request pays)
PROBE_ROUNDS = 16  # rounds without a 1-token step after which one is taken to time c(1) afresh
TREE_RETRY_START, TREE_RETRY_MAX = 32, 512  # chain rounds, across requests, before trees are tried again, doubling

# Seeded sampling decides with fixed costs, so a seed gives the same output on any machine. Decode
# is memory-bound: a target call costs one step plus VERIFY_TOKEN_COST per extra token, a draft
# step its weight bytes relative to the target's (at least MIN_DRAFT_STEP).
VERIFY_TOKEN_COST = 0.05
MIN_DRAFT_STEP = 0.02
UNSIZED_DRAFT_STEP = 0.3  # a draft model whose weight bytes the manifest does not give
LOOKUP_DRAFT_STEP = 0.01  # a drafter without a model (prompt lookup)
DEFAULT_DRAFT_STEP = 0.1  # a Generator made without a pipeline's figure


@dataclass
class CostModel:
    """Step costs in seconds: target with T tokens, draft per proposed token. Measured at load
    (`Pipeline.calibrate`) and refined by moving averages while generating."""

    target: dict = field(default_factory=dict)  # T -> seconds
    draft: float = 0.0
    alpha: float = EMA_WEIGHT  # moving-average weight of a new measurement
    # A draft that cannot pay even with every token accepted: its fallback goes on across requests
    # as if they were one long request (a new request does not pay a losing round to learn it
    # again): the target-only tokens left of it and the backoff after it. Cleared by a request that
    # finds speculation paying.
    carry_fallback: int = 0
    carry_backoff: int = 0
    # Trees the guard turned off go on off across requests the same way: the chain rounds left
    # before trees are tried again (every round of a request whose trees are off counts), and the
    # span after the next turn-off. Cleared by a request whose trees pay.
    carry_chain: int = 0
    tree_backoff: int = 0

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
        return (1 - self.alpha) * old + self.alpha * min(new, SPIKE_CLAMP * old)

    def observe_target(self, t: int, seconds: float) -> None:
        self.target[t] = self._ema(self.target.get(t), seconds)

    def observe_draft(self, seconds_per_token: float) -> None:
        self.draft = self._ema(self.draft, seconds_per_token)

    def copy(self) -> CostModel:
        return CostModel(
            dict(self.target),
            self.draft,
            self.alpha,
            self.carry_fallback,
            self.carry_backoff,
            self.carry_chain,
            self.tree_backoff,
        )


def static_cost_model(draft_step: float) -> CostModel:
    """The fixed costs of seeded sampling for a drafter whose step costs `draft_step` target steps."""
    return CostModel({1: 1.0, MAX_SPEC_TOKENS + 1: 1.0 + VERIFY_TOKEN_COST * MAX_SPEC_TOKENS}, draft_step)


def draft_step_cost(draft_bytes: int, target_bytes: int) -> float:
    """A draft model's step in target steps, from the weight bytes both read per step."""
    if draft_bytes > 0 and target_bytes > 0:
        return max(draft_bytes / target_bytes, MIN_DRAFT_STEP)
    return UNSIZED_DRAFT_STEP


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per round with k drafts and per-token acceptance alpha (Leviathan et al.)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpecController:
    """Chooses k per round; shrinks k or falls back to target-only when speculation does not pay.

    Feed it every round (`record_round`) and target-only step (`record_plain`); `next_k` is the k
    of the next round (0: a target-only step), `use_tree` whether that round may be a tree. The
    rules (speed-up from this request's own step times, the counterfactual E(k), shrinking,
    fallback and backoff carried across requests through the shared CostModel, adaptive k, trees
    judged against the chain they replace) are docs/design.md "The speculation policy"; the C++
    runtime implements the same, and tests/data/policy_vectors.json pins both.
    """

    def __init__(
        self,
        k: int,
        costs: CostModel,
        *,
        adaptive: bool = False,
        guard: bool = True,
        learn: bool = True,
        k_max: int = MAX_SPEC_TOKENS,
        min_rounds: int = MIN_ROUNDS,
        decay: float = DECAY,
        keep: float = KEEP,
        trees: bool = True,
    ):
        self.k = self.k_start = int(k)
        self.k_max = max(int(k_max), self.k)
        self.costs = costs
        self.adaptive, self.guard, self.learn = adaptive, guard, learn
        # whether the request asked for trees: only its rounds count down a carried tree verdict
        # (a chain request's rounds say nothing about trees; counting them let a tree request that
        # followed chain requests on the same pipeline retry trees, and pay their trial, every time)
        self.trees = trees
        self.min_rounds, self.decay = min_rounds, decay
        self.keep = keep
        self.acc, self.rej = PRIOR_ACCEPTED, PRIOR_REJECTED
        self.recent: deque = deque(maxlen=WINDOW)  # accepted counts of the latest rounds, newest last
        self.k_seen = self.k
        self.rounds_since = 0
        self.fallback_left = 0
        self.backoff = BACKOFF_START
        self.fallbacks = 0
        self.fallback_tokens = 0
        self.shrinks = 0
        self.k_hist: dict[int, int] = {}
        # this request's own step times (T -> seconds, and draft seconds per token): measured
        # under the load the judgement is about, unlike the shared model's older estimates
        self.local: dict[int, float] = {}
        self.local_draft: float | None = None
        self.tree_call: dict[int, int] = {}  # k -> tokens in the last tree call with k draft steps
        self.use_tree = True  # trees (when asked for) still pay at least what the chain would
        self.tree_rounds = 0
        self.tree_gain = self.chain_gain = self.gain_weight = 0.0  # decayed tokens per round, both ways
        self.since_plain = 0  # rounds since this request last timed c(1) (two 1-token steps in a row)
        self.after_plain = False  # the last event was a 1-token step
        self.probes = 0
        self.carried = False  # the fallback in progress is a hopeless draft's, shared with later requests
        if self.guard and self.learn:
            # an earlier request found this draft cannot pay: go on with its fallback
            self.backoff = costs.carry_backoff or BACKOFF_START
            if costs.carry_fallback > 0:
                self.fallbacks += 1
                self.fallback_left = costs.carry_fallback
                self.carried = True
            if costs.carry_chain > 0:
                self.use_tree = False  # an earlier request found trees slower than the chain

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

    def load_scale(self) -> float:
        """How much slower this request's steps run than the shared model says: the sum of its
        own step times over the sum of the model's costs for the same sizes (1 before any)."""
        sizes = sorted(self.local)
        shared = sum(self.costs.target_cost(t) for t in sizes)
        return sum(self.local[t] for t in sizes) / shared if sizes and shared > 0 else 1.0

    def step_cost(self, t: int) -> float:
        """Seconds for a target call of t tokens now: this request's own time for t, else the
        shared model's cost scaled to this request's load."""
        if t in self.local:
            return self.local[t]
        return self.costs.target_cost(t) * self.load_scale()

    def draft_cost(self) -> float:
        if self.local_draft is not None:
            return self.local_draft
        return self.costs.draft * self.load_scale()

    def call_size(self, k: int) -> int:
        """Tokens in the target call of a round with k draft steps: k + 1 for a chain, the last
        tree's size while this request verifies trees of that depth (after trees are turned off,
        its chains are priced as chains)."""
        return self.tree_call.get(k, k + 1) if self.use_tree else k + 1

    def speedup(self, k: int) -> float:
        t1 = self.step_cost(1)
        cost = k * self.draft_cost() + self.step_cost(self.call_size(k))
        return self.expected(k) * t1 / cost if cost > 0 else float("inf")

    def ceiling(self, k: int) -> float:
        """speedup(k) if every draft were accepted."""
        cost = k * self.draft_cost() + self.step_cost(self.call_size(k))
        return (k + 1) * self.step_cost(1) / cost if cost > 0 else float("inf")

    def next_k(self) -> int:
        """k for the next round; 0 = a target-only step (a fallback, or a probe of c(1))."""
        if self.fallback_left > 0 or self._probe_due():
            return 0
        return self.k

    def _probe_due(self) -> bool:
        # only a guard that learns from timings needs c(1) measured under the current load
        return self.guard and self.learn and self.since_plain >= PROBE_ROUNDS

    @staticmethod
    def _local_ema(old: float | None, new: float) -> float:
        return new if old is None else (1 - LOCAL_WEIGHT) * old + LOCAL_WEIGHT * new

    def record_plain(self, n_tokens: int, seconds: float) -> None:
        if self._probe_due() and self.fallback_left <= 0:
            self.probes += 1
        # only a step after a step times what target-only decoding pays: the first 1-token call
        # after a round pays for the shape change (and a draft model's evicted caches)
        if self.learn and self.after_plain:
            self.costs.observe_target(1, seconds)
            self.local[1] = self._local_ema(self.local.get(1), seconds)
            self.since_plain = 0
        self.after_plain = True
        if self.fallback_left > 0:
            self.fallback_left -= n_tokens
            self.fallback_tokens += n_tokens
            if self.carried and self.learn:
                self.costs.carry_fallback = max(self.fallback_left, 0)
            if self.fallback_left <= 0:
                self.carried = False  # try speculating again with the full k, judging afresh
                self.acc, self.rej, self.rounds_since = PRIOR_ACCEPTED, PRIOR_REJECTED, 0
                self.recent.clear()
                self.k = self.k_start
                # round times from before the fallback are stale; c(1) was just measured
                self.local = {1: self.local[1]} if 1 in self.local else {}
                self.local_draft = None

    def tree_vs_chain(self) -> tuple[float, float]:
        """(tree, chain) expected speed-ups over this request's tree rounds: the tokens the trees
        gave and those their first lines alone would have given, priced at the tree's call and at
        the chain's c(k + 1)."""
        if self.gain_weight <= 0:
            return 1.0, 1.0
        k, t1, d = self.k, self.step_cost(1), self.draft_cost()
        tree_cost = k * d + self.step_cost(self.tree_call.get(k, k + 1))
        chain_cost = k * d + self.step_cost(k + 1)
        tree = self.tree_gain / self.gain_weight * t1 / tree_cost if tree_cost > 0 else float("inf")
        chain = self.chain_gain / self.gain_weight * t1 / chain_cost if chain_cost > 0 else float("inf")
        return tree, chain

    def _trees_off(self) -> None:
        """Chains for the rest of the request, and (learning) for the next requests' rounds."""
        self.use_tree = False
        if self.learn:
            self.costs.tree_backoff = min(2 * self.costs.tree_backoff, TREE_RETRY_MAX) or TREE_RETRY_START
            self.costs.carry_chain = self.costs.tree_backoff

    def _judge_tree(self, n_accepted: int, chain_accepted: int) -> None:
        self.tree_rounds += 1
        self.tree_gain = self.tree_gain * self.decay + n_accepted + 1
        self.chain_gain = self.chain_gain * self.decay + chain_accepted + 1
        self.gain_weight = self.gain_weight * self.decay + 1
        if self.guard and self.use_tree and self.tree_rounds >= self.min_rounds:
            tree, chain = self.tree_vs_chain()
            if tree < chain:
                self._trees_off()
            elif self.learn and self.tree_rounds == self.min_rounds:
                self.costs.tree_backoff = 0  # trees pay again: the next turn-off starts afresh

    def record_round(
        self,
        k: int,
        n_accepted: int,
        draft_s: float,
        verify_s: float,
        drafted: int,
        call: int | None = None,
        depth: int | None = None,
        chain_accepted: int | None = None,
    ) -> None:
        """One round: k asked for, n_accepted drafts kept, `drafted` drafts verified in a target
        call of `call` tokens (default drafted + 1) made of `depth` draft steps (default drafted):
        a tree's call and depth differ from its node count. `chain_accepted`: for a tree round,
        the drafts its first line alone would have had accepted."""
        call = drafted + 1 if call is None else int(call)
        depth = drafted if depth is None else int(depth)
        if call > depth + 1:
            self.tree_call[min(depth, k)] = call  # the call that stood in for the chain of k
        self.k_hist[k] = self.k_hist.get(k, 0) + 1
        if self.learn:
            if depth:
                self.costs.observe_draft(draft_s / depth)
                self.local_draft = self._local_ema(self.local_draft, draft_s / depth)
            self.costs.observe_target(call, verify_s)
            self.local[call] = self._local_ema(self.local.get(call), verify_s)
        self.since_plain += 1
        self.after_plain = False
        if self.guard and self.learn and self.trees and not self.use_tree and self.costs.carry_chain > 0:
            self.costs.carry_chain -= 1
        # decayed counts: recent rounds matter more (a request can change character midway)
        self.acc = self.acc * self.decay + n_accepted
        self.rej = self.rej * self.decay + (1 if n_accepted < min(depth, k) else 0)
        if not self.recent:
            self.k_seen = k
        self.k_seen = min(self.k_seen, k)  # counterfactuals hold up to the smallest k in the window
        self.recent.append(n_accepted)
        self.rounds_since += 1
        if chain_accepted is not None:
            self._judge_tree(n_accepted, int(chain_accepted))
        if self.adaptive and depth == k:
            if n_accepted == k and self.k < self.k_max:
                self.k += 1
            elif n_accepted < k / 2 and self.k > 1:
                self.k -= 1
        if not self.guard:
            return
        # a draft too slow to pay even if every token were accepted is dropped without waiting
        # for min_rounds of acceptance evidence (an int4 target's own int4 self-draft)
        hopeless = max(self.ceiling(kk) for kk in range(1, self.k + 1)) < SHRINK_MIN
        if not hopeless:
            if self.rounds_since < self.min_rounds:
                return
            if self.speedup(self.k) >= self.keep:
                self.backoff = BACKOFF_START
                if self.learn:
                    self.costs.carry_fallback = self.costs.carry_backoff = 0
                return
            if self.use_tree and self.tree_call:
                # k does not pay with trees: drop the trees (the extra, dearer part of the call)
                # and judge k afresh as a chain, on MIN_ROUNDS chain rounds of its own: a shrink
                # lasts the request, and a few tree rounds priced at the tree's call can make a
                # good k look worse than k = 1 (benchmarks/history/trees.md)
                self._trees_off()
                self.rounds_since = 0
                return
            best = max(range(1, self.k), key=self.speedup, default=None)
            if best is not None and self.speedup(best) >= SHRINK_MIN:
                self.k = best
                self.shrinks += 1
                return
        self.fallbacks += 1
        self.fallback_left = self.backoff
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)
        self.carried = hopeless
        if self.learn:
            self.costs.carry_fallback = self.fallback_left if hopeless else 0
            if hopeless:
                self.costs.carry_backoff = self.backoff

    def to_dict(self) -> dict:
        return {
            "k": self.k_start,
            "k_final": self.k,
            "k_histogram": {str(k): v for k, v in sorted(self.k_hist.items())},
            "fallbacks": self.fallbacks,
            "fallback_tokens": self.fallback_tokens,
            "k_shrinks": self.shrinks,
            "alpha_estimate": round(self.alpha, 4),
            # tree keys only where trees ran (the C++ runtime's stats do the same)
            **({"tree_rounds": self.tree_rounds, "trees_off": not self.use_tree} if self.tree_rounds else {}),
        }
