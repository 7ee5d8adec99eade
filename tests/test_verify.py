"""Greedy and sampling verification, including the analytic exactness test of docs/design.md.

The exactness test works on toy autoregressive "models" over a vocabulary of 4-6 tokens whose
next-token logits are a fixed random function of the whole prefix, so p and q change at every
position and after every choice. It enumerates every draft sequence with its probability under q
and, for each, the verifier's outcomes with probabilities instead of random draws
(`mirror_given_draft`). The resulting distribution of emitted sequences must equal target-only
sampling to 1e-9. The real `verify_sampling` is then checked against the same analytic
distribution by Monte-Carlo, and its individual decisions with a scripted generator.
"""

import itertools
import math
from collections import Counter, defaultdict

import numpy as np
import pytest

from specedge.runtime.drafters.ngram import NgramIndex
from specedge.runtime.sampling import SamplingParams, make_rng, probs_from_logits, sample
from specedge.runtime.verify import AcceptanceStats, verify_greedy, verify_sampling


class ScriptedRng:
    """Stands in for np.random.Generator: returns the given uniforms in order."""

    def __init__(self, *values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


# ---------------------------------------------------------------- toy models


class ToyModel:
    """Next-token probabilities as a fixed random function of the prefix (cached)."""

    def __init__(self, vocab, seed, params, mask_frac=0.0, one_hot=False):
        self.vocab, self.seed, self.params = vocab, seed, params
        self.mask_frac, self.one_hot = mask_frac, one_hot
        self._cache, self._logits = {}, {}

    def logits(self, prefix):
        prefix = tuple(prefix)
        if prefix not in self._logits:
            self._logits[prefix] = self._make_logits(prefix)
        return self._logits[prefix]

    def _make_logits(self, prefix):
        rng = np.random.default_rng([self.seed, len(prefix), *prefix])
        logits = (rng.normal(size=self.vocab) * 2.0).astype(np.float32)
        if self.one_hot:  # a deterministic proposer (n-gram like): any token, even one p rules out
            logits = np.full(self.vocab, -np.inf, np.float32)
            logits[rng.integers(self.vocab)] = 0.0
        elif self.mask_frac:
            mask = rng.random(self.vocab) < self.mask_frac
            mask[rng.integers(self.vocab)] = False  # keep at least one token
            logits[mask] = -np.inf
        return logits

    def __call__(self, prefix):
        prefix = tuple(prefix)
        if prefix not in self._cache:
            self._cache[prefix] = probs_from_logits(self.logits(prefix), self.params)
        return self._cache[prefix]


# ---------------------------------------------------------------- the analytic mirror


def mirror_given_draft(draft, P, Q, buggy=False):
    """Exact distribution {emitted tuple: prob} of verify_sampling's output for a fixed draft.

    Mirrors the rule with probabilities instead of draws: accept x with a = min(1, p(x)/q(x)),
    otherwise emit from norm(max(0, p - q)); q(x) == 0 means "treat q as one-hot at x".
    `buggy=True` resamples from p instead of the residual, to show the test can fail.
    """
    vocab = len(P[0])
    out = defaultdict(float)
    reach = 1.0  # probability that positions 0..i-1 were all accepted
    for i, x in enumerate(draft):
        p, q = P[i], Q[i]
        if q[x] <= 0:
            q = np.eye(vocab)[x]
        accept = min(1.0, p[x] / q[x])
        residual = np.maximum(p - q, 0.0)
        residual = residual / residual.sum() if residual.sum() > 0 and not buggy else p
        for y in range(vocab):
            if residual[y] > 0:
                out[tuple(draft[:i]) + (y,)] += reach * (1.0 - accept) * residual[y]
        reach *= accept
        if reach == 0:
            return out
    for y in range(vocab):
        if P[len(draft)][y] > 0:
            out[tuple(draft) + (y,)] += reach * P[len(draft)][y]
    return out


def emitted_distribution(target, draft_model, k, buggy=False):
    """Sum the mirror over every draft sequence, weighted by its probability under q."""
    total = defaultdict(float)
    for draft in itertools.product(range(target.vocab), repeat=k):
        weight = math.prod(draft_model(draft[:i])[draft[i]] for i in range(k))
        if weight == 0:
            continue
        P = [target(draft[:i]) for i in range(k + 1)]
        Q = [draft_model(draft[:i]) for i in range(k)]
        for seq, prob in mirror_given_draft(draft, P, Q, buggy).items():
            total[seq] += weight * prob
    return dict(total)


def target_joint(target, n):
    """Target-only sampling of n tokens: product of the target's conditionals."""
    return {
        seq: math.prod(target(seq[:i])[seq[i]] for i in range(n))
        for seq in itertools.product(range(target.vocab), repeat=n)
    }


def complete_with_target(dist, target, n):
    """Continue each emitted sequence with target-only sampling up to n tokens.

    This is what generation does next (the following step samples from the target given the
    emitted prefix), so speculative decoding is exact iff the completed joint equals target_joint.
    """
    out = defaultdict(float)
    for seq, prob in dist.items():
        for tail in itertools.product(range(target.vocab), repeat=n - len(seq)):
            full = seq + tail
            out[full] += prob * math.prod(target(full[:i])[full[i]] for i in range(len(seq), n))
    return out


def marginal(dist, j):
    out = defaultdict(float)
    for seq, prob in dist.items():
        out[seq[:j]] += prob
    return out


def max_diff(a, b):
    return max(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b))


# ---------------------------------------------------------------- exactness cases


T = SamplingParams
CASES = {
    "plain-V4": dict(vocab=4, params=T(temperature=1.0)),
    "temp-topk-V5": dict(vocab=5, params=T(temperature=0.7, top_k=3)),
    "temp-topp-V5": dict(vocab=5, params=T(temperature=1.3, top_p=0.8)),
    "topk-topp-V6": dict(vocab=6, params=T(temperature=1.0, top_k=4, top_p=0.9)),
    # q = 0 where p > 0 and p = 0 where q > 0, from -inf logits on both sides
    "zeros-both-sides-V5": dict(vocab=5, params=T(temperature=1.0), t_mask=0.4, d_mask=0.4),
    # n-gram style one-hot q, often on tokens the target (top-k 2) gives zero probability
    "one-hot-q-V5": dict(vocab=5, params=T(temperature=0.9, top_k=2), one_hot=True),
    # draft with different settings than the target: exactness holds for any q
    "draft-other-params-V5": dict(vocab=5, params=T(temperature=1.0, top_p=0.7), draft_params=T(temperature=2.0)),
    "target-top-p-tiny-V4": dict(vocab=4, params=T(temperature=1.0, top_p=1e-6), draft_params=T(temperature=1.0)),
    "greedy-V4": dict(vocab=4, params=T(temperature=0.0)),
}


def build(case, seed=0):
    target = ToyModel(case["vocab"], 1000 + seed, case["params"], mask_frac=case.get("t_mask", 0.0))
    draft = ToyModel(
        case["vocab"],
        2000 + seed,
        case.get("draft_params", case["params"]),
        mask_frac=case.get("d_mask", 0.0),
        one_hot=case.get("one_hot", False),
    )
    return target, draft


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_emitted_distribution_equals_target_analytically(name, k):
    target, draft = build(CASES[name])
    dist = emitted_distribution(target, draft, k)
    assert abs(sum(dist.values()) - 1.0) < 1e-9
    assert all(1 <= len(seq) <= k + 1 for seq in dist)

    # first emitted token ~ p_0 (after temperature / top-k / top-p)
    first = marginal(dist, 1)
    p0 = {(y,): target(())[y] for y in range(target.vocab)}
    assert max_diff(first, p0) < 1e-9

    # the first j tokens of the continued sequence ~ product of target conditionals, all j
    completed = complete_with_target(dist, target, k + 1)
    for j in range(1, k + 2):
        assert max_diff(marginal(completed, j), target_joint(target, j)) < 1e-9, f"j={j}"


def test_identical_draft_is_always_accepted():
    case = dict(vocab=4, params=T(temperature=1.0))
    target, _ = build(case)
    dist = emitted_distribution(target, target, 3)
    assert all(len(seq) == 4 for seq, prob in dist.items() if prob > 0)
    assert max_diff(dist, target_joint(target, 4)) < 1e-9


def test_analytic_check_catches_a_wrong_residual():
    target, draft = build(CASES["plain-V4"])
    first = marginal(emitted_distribution(target, draft, 2, buggy=True), 1)
    assert max_diff(first, {(y,): target(())[y] for y in range(4)}) > 1e-3


def test_zero_q_proposals_are_exact_for_every_fixed_draft():
    """A drafted token its own q gives 0 (e.g. filtered after sampling) must not bias the output.

    With the one-hot rule each position is exact conditionally on the drafted token, so the
    emitted distribution equals the target's for *every* fixed draft, not only on average.
    """
    vocab, k = 4, 3
    target = ToyModel(vocab, 7, T(temperature=1.0, top_k=3))
    for draft in itertools.product(range(vocab), repeat=k):
        Q = []
        for i, x in enumerate(draft):
            q = np.random.default_rng([11, i, *draft[: i + 1]]).random(vocab)
            q[x] = 0.0
            Q.append(q / q.sum())
        P = [target(draft[:i]) for i in range(k + 1)]
        dist = mirror_given_draft(draft, P, Q)
        completed = complete_with_target(dist, target, k + 1)
        assert max_diff(completed, target_joint(target, k + 1)) < 1e-9, draft


# ---------------------------------------------------------------- the implementation vs the mirror


def chi_square_ok(counts, expected, n):
    """Chi-square with cells of expected count < 5 pooled; generous bound (seeded, so stable)."""
    assert set(counts) <= {s for s, e in expected.items() if e > 0}, "emitted an impossible sequence"
    stat, df, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for seq, e in expected.items():
        if e * n < 5:
            pool_obs, pool_exp = pool_obs + counts.get(seq, 0), pool_exp + e * n
            continue
        stat += (counts.get(seq, 0) - e * n) ** 2 / (e * n)
        df += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / max(pool_exp, 5.0)
        df += 1
    return stat < df + 6 * math.sqrt(2 * max(df, 1)) + 10, (stat, df)


@pytest.mark.parametrize("name", ["temp-topk-V5", "zeros-both-sides-V5", "one-hot-q-V5"])
def test_verify_sampling_matches_analytic_distribution(name):
    k, n = 2, 12000
    target, draft_model = build(CASES[name], seed=3)
    expected = emitted_distribution(target, draft_model, k)
    rows = {}  # draft -> (Q, P): as the generator does, q rows kept from drafting, p rows batched

    def q_and_p(draft):
        if draft not in rows:
            logits = np.stack([target.logits(draft[:i]) for i in range(k + 1)])
            Q = np.stack([draft_model(draft[:i]) for i in range(k)])
            rows[draft] = Q, probs_from_logits(logits, target.params)
        return rows[draft]

    rng = make_rng(123)
    counts = Counter()
    for _ in range(n):
        draft = ()
        for _ in range(k):
            draft += (sample(draft_model(draft), rng),)
        counts[tuple(verify_sampling(draft, *q_and_p(draft), rng))] += 1
    ok, detail = chi_square_ok(counts, expected, n)
    assert ok, detail


def test_verify_sampling_matches_mirror_for_a_zero_q_draft():
    vocab, n = 4, 12000
    target = ToyModel(vocab, 5, T(temperature=1.0))
    draft = (2, 1)
    Q = np.array([[0.5, 0.5, 0.0, 0.0], [0.2, 0.0, 0.3, 0.5]])  # q(2) = 0, q(1) = 0
    P = np.stack([target(draft[:i]) for i in range(3)])
    expected = mirror_given_draft(draft, P, Q)
    rng = make_rng(9)
    counts = Counter(tuple(verify_sampling(draft, Q, P, rng)) for _ in range(n))
    ok, detail = chi_square_ok(counts, expected, n)
    assert ok, detail


# ---------------------------------------------------------------- verify_sampling decisions


def test_accept_boundary_and_residual():
    p = np.array([[0.3, 0.7, 0.0], [0.1, 0.1, 0.8]])
    q = np.array([[0.6, 0.4, 0.0]])
    # ratio p/q = 0.5 at token 0: u just below accepts, then the bonus is sampled from p[1]
    assert verify_sampling([0], q, p, ScriptedRng(0.4999, 0.95)) == [0, 2]
    # u = 0.5 rejects; residual max(p - q, 0) = [0, 0.3, 0] -> token 1 for any u
    assert verify_sampling([0], q, p, ScriptedRng(0.5, 0.0)) == [1]
    assert verify_sampling([0], q, p, ScriptedRng(0.5, 0.999)) == [1]
    # p(x) >= q(x): accepted whatever the uniform
    assert verify_sampling([1], q, p, ScriptedRng(np.nextafter(1.0, 0.0), 0.0)) == [1, 0]


def test_zero_q_token_uses_one_hot_rule():
    p = np.array([[0.2, 0.5, 0.3], [1.0, 0.0, 0.0]])
    q = np.array([[1.0, 0.0, 0.0]])  # drafted token 1 has q = 0
    assert verify_sampling([1], q, p, ScriptedRng(0.49, 0.5)) == [1, 0]  # accept iff u < p(1)
    # rejected: sample p without token 1 = [0.4, 0, 0.6]
    assert verify_sampling([1], q, p, ScriptedRng(0.5, 0.39)) == [0]
    assert verify_sampling([1], q, p, ScriptedRng(0.5, 0.41)) == [2]


def test_one_hot_q_never_emits_a_token_the_target_rules_out():
    p = np.array([[0.0, 0.4, 0.6], [1 / 3, 1 / 3, 1 / 3]])
    q = NgramIndex.probs([0], 3)
    rng = make_rng(0)
    outs = [verify_sampling([0], q, p, rng) for _ in range(2000)]
    assert all(len(o) == 1 and o[0] in (1, 2) for o in outs)


def test_all_zero_residual_falls_back_to_p():
    # p slightly under q everywhere it matters (rounding): a rejection leaves no residual mass
    p = np.array([[0.3, 0.4], [0.5, 0.5]])
    q = np.array([[0.6, 0.4]])
    assert verify_sampling([0], q, p, ScriptedRng(0.9, 0.9)) == [1]


def test_k0_emits_one_target_sample_and_same_seed_same_output():
    p = np.array([[0.25, 0.25, 0.5]])
    assert verify_sampling([], np.zeros((0, 3)), p, ScriptedRng(0.6)) == [2]
    target, draft_model = build(CASES["temp-topp-V5"])

    def run(seed):
        rng, outs = make_rng(seed), []
        for _ in range(200):
            draft = []
            for _ in range(3):
                draft.append(sample(draft_model(draft), rng))
            Q = np.stack([draft_model(draft[:i]) for i in range(3)])
            P = np.stack([target(draft[:i]) for i in range(4)])
            outs.append(verify_sampling(draft, Q, P, rng))
        return outs

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_verify_sampling_validates_shapes():
    p = np.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="needs len\\(draft_tokens\\) \\+ 1 = 3 rows, got 2"):
        verify_sampling([1, 2], np.full((2, 4), 0.25), p[:2], make_rng(0))
    with pytest.raises(ValueError, match="draft_probs must be \\[k, V\\]"):
        verify_sampling([1, 2], np.full((1, 4), 0.25), p, make_rng(0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_sampling([1, 4], np.full((2, 4), 0.25), p, make_rng(0))


# ---------------------------------------------------------------- verify_greedy


def logits_with_argmax(ids, vocab=6):
    out = np.random.default_rng(len(ids)).normal(size=(len(ids), vocab)).astype(np.float32)
    out[np.arange(len(ids)), ids] = 10.0
    return out


def test_greedy_all_accepted_gets_bonus():
    assert verify_greedy([3, 1, 4], logits_with_argmax([3, 1, 4, 5])) == [3, 1, 4, 5]


def test_greedy_none_accepted_gets_correction():
    assert verify_greedy([2, 1, 4], logits_with_argmax([3, 1, 4, 5])) == [3]


def test_greedy_partial():
    assert verify_greedy([3, 1, 0], logits_with_argmax([3, 1, 4, 5])) == [3, 1, 4]


def test_greedy_k1_and_k0():
    assert verify_greedy([2], logits_with_argmax([2, 0])) == [2, 0]
    assert verify_greedy([5], logits_with_argmax([2, 0])) == [2]
    assert verify_greedy([], logits_with_argmax([4])) == [4]


def test_greedy_ties_use_first_index():
    logits = np.array([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]], np.float32)
    assert verify_greedy([1], logits) == [0]  # argmax of row 0 is 0, not the tied 1
    assert verify_greedy([0], logits) == [0, 1]


def test_greedy_validates():
    with pytest.raises(ValueError, match="needs len\\(draft_tokens\\) \\+ 1 = 3 rows, got 2"):
        verify_greedy([1, 2], np.zeros((2, 4)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_greedy([7], np.zeros((2, 4)))
    with pytest.raises(ValueError, match="must be \\[k \\+ 1, V\\]"):
        verify_greedy([1], np.zeros(4))


# ---------------------------------------------------------------- AcceptanceStats


def test_acceptance_stats():
    stats = AcceptanceStats()
    assert stats.acceptance_rate == 0.0 and stats.mean_accepted == 0.0 and stats.histogram == []
    for drafted, accepted in [(4, 4), (4, 0), (4, 2), (2, 2), (0, 0)]:
        stats.record(drafted, accepted)
    assert stats.acceptance_rate == 8 / 14
    assert stats.mean_accepted == (8 + 5) / 5
    assert stats.histogram == [2, 0, 2, 0, 1]
    assert stats.to_dict() == {
        "calls": 5,
        "drafted": 14,
        "accepted": 8,
        "acceptance_rate": 8 / 14,
        "mean_accepted": 13 / 5,
        "histogram": [2, 0, 2, 0, 1],
    }
    with pytest.raises(ValueError, match="need 0 <= n_accepted <= n_drafted, got 5 of 4"):
        stats.record(4, 5)
