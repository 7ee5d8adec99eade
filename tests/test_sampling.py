"""Sampling parameters, logits -> probabilities filtering, and the inverse-CDF sampler."""

import numpy as np
import pytest

from specedge.runtime.sampling import SamplingParams, make_rng, probs_from_logits, sample


class ScriptedRng:
    """Stands in for np.random.Generator: returns the given uniforms in order."""

    def __init__(self, *values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, r"temperature must be >= 0, got -1\.0"),
        ({"temperature": float("nan")}, r"temperature must not be NaN"),
        ({"temperature": float("inf")}, r"temperature must be finite"),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
        ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\], got 1\.5"),
        ({"temperature": 1.0, "top_p": float("nan")}, r"top_p must not be NaN"),
        ({"temperature": 1.0, "top_k": -1}, r"top_k must be >= 0 \(0 disables it\), got -1"),
        ({"temperature": 1.0, "top_k": 2.5}, r"top_k must be an integer, got 2\.5"),
        ({"temperature": 1.0, "top_k": float("nan")}, r"top_k must not be NaN"),
        ({"temperature": "hot"}, r"temperature must be a number"),
        ({"seed": -3}, r"seed must be an integer from 0 to 18446744073709551615 \(2\^64-1\), got -3"),
        (
            {"seed": 2**64},
            r"seed must be an integer from 0 to 18446744073709551615 \(2\^64-1\), got 18446744073709551616",
        ),
        ({"seed": "7"}, r"seed must be an integer from 0 to 18446744073709551615 \(2\^64-1\), got '7'"),
    ],
)
def test_validate_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs).validate()


def test_the_largest_seed_is_accepted_and_reproducible():
    from specedge.contract import SEED_MAX
    from specedge.runtime.sampling import make_rng

    SamplingParams(temperature=1.0, seed=SEED_MAX).validate()
    assert SEED_MAX == 2**64 - 1
    assert make_rng(SEED_MAX).random() == make_rng(SEED_MAX).random()


def test_defaults_are_greedy_and_valid():
    params = SamplingParams().validate()
    assert params.greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_probs_from_logits_validates_params_and_logits():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        probs_from_logits(np.zeros(3, np.float32), SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="NaN"):
        probs_from_logits(np.array([0.0, np.nan], np.float32), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="every logit of a row is -inf"):
        probs_from_logits(np.full((2, 3), -np.inf, np.float32), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match=r"shape \[V\] or \[N, V\]"):
        probs_from_logits(np.zeros((1, 2, 3), np.float32), SamplingParams(temperature=1.0))


# ---------------------------------------------------------------- probs_from_logits


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_plain_softmax_with_temperature_and_batch_rows():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 7)).astype(np.float32)
    probs = probs_from_logits(logits, SamplingParams(temperature=0.7))
    assert probs.dtype == np.float64 and probs.shape == (3, 7)
    for row, out in zip(logits, probs):
        np.testing.assert_allclose(out, _softmax(row.astype(np.float64) / 0.7), rtol=1e-12)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=0, atol=1e-12)
    # a 1-D row gives the same as that row of the batch
    np.testing.assert_array_equal(probs_from_logits(logits[1], SamplingParams(temperature=0.7)), probs[1])


def test_greedy_is_one_hot_argmax_first_index_on_ties():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
    probs = probs_from_logits(logits, SamplingParams())
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_top_k_1_equals_greedy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 9)).astype(np.float32)
    logits[0, [2, 6]] = 4.0  # a tie for the maximum: lower id wins in both
    greedy = probs_from_logits(logits, SamplingParams())
    np.testing.assert_array_equal(probs_from_logits(logits, SamplingParams(temperature=1.3, top_k=1)), greedy)


def test_top_k_keeps_k_largest_and_breaks_boundary_ties_by_id():
    logits = np.array([0.0, 2.0, 1.0, 1.0, 1.0, -1.0], np.float32)
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3))
    kept = np.flatnonzero(probs)
    np.testing.assert_array_equal(kept, [1, 2, 3])  # id 4 ties with 2 and 3 but comes later
    np.testing.assert_allclose(probs[kept], _softmax(np.array([2.0, 1.0, 1.0])), rtol=1e-12)


def test_top_k_larger_than_vocab_is_a_no_op():
    logits = np.array([0.3, -1.0, 2.0], np.float32)
    full = probs_from_logits(logits, SamplingParams(temperature=1.0))
    np.testing.assert_array_equal(probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=50)), full)
    np.testing.assert_array_equal(probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3)), full)


def test_top_p_keeps_smallest_set_reaching_mass():
    base = np.array([0.5, 0.2, 0.25, 0.05])
    logits = np.log(base).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.7)
    probs = probs_from_logits(logits, params)
    # sorted: 0.5, 0.25 (0.75 >= 0.7) -> keep ids 0 and 2
    np.testing.assert_array_equal(np.flatnonzero(probs), [0, 2])
    np.testing.assert_allclose(probs[[0, 2]], [0.5 / 0.75, 0.25 / 0.75], rtol=1e-6)
    # exactly reaching the threshold stops there (>= top_p)
    probs = probs_from_logits(np.log(np.array([0.5, 0.5])), SamplingParams(temperature=1.0, top_p=0.5))
    np.testing.assert_array_equal(probs, [1.0, 0.0])


def test_top_p_tiny_keeps_one_token_and_ties_go_to_lower_id():
    logits = np.array([1.0, 3.0, 3.0, 2.0], np.float32)
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    np.testing.assert_array_equal(probs, [0, 1, 0, 0])


def test_top_p_one_is_a_no_op_and_top_p_applies_after_top_k():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=8).astype(np.float32)
    np.testing.assert_array_equal(
        probs_from_logits(logits, SamplingParams(temperature=0.9, top_p=1.0)),
        probs_from_logits(logits, SamplingParams(temperature=0.9)),
    )
    # top-k=4 then top-p on the renormalised 4: must equal filtering that 4-token softmax by hand
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.6)
    probs = probs_from_logits(logits, params)
    top4 = np.argsort(-logits, kind="stable")[:4]
    p4 = _softmax(logits[top4].astype(np.float64) / 0.9)
    n_keep = int(np.searchsorted(np.cumsum(p4), 0.6) + 1)
    expected = np.zeros(8)
    expected[top4[:n_keep]] = p4[:n_keep] / p4[:n_keep].sum()
    np.testing.assert_allclose(probs, expected, rtol=1e-12, atol=0)


def test_neg_inf_logits_get_zero_probability_and_tiny_temperature_does_not_overflow():
    logits = np.array([-np.inf, 1e30, 0.0, -np.inf], np.float32)
    probs = probs_from_logits(logits, SamplingParams(temperature=1e-6))
    np.testing.assert_array_equal(probs, [0, 1, 0, 0])
    probs = probs_from_logits(np.array([-np.inf, 0.0, 0.0]), SamplingParams(temperature=1.0))
    np.testing.assert_array_equal(probs, [0, 0.5, 0.5])


# ---------------------------------------------------------------- sample / make_rng


def test_same_seed_same_samples():
    probs = probs_from_logits(np.random.default_rng(3).normal(size=50), SamplingParams(temperature=1.0))
    rng_a, rng_b = make_rng(7), make_rng(7)
    a = [sample(probs, rng_a) for _ in range(100)]
    assert [sample(probs, rng_b) for _ in range(100)] == a
    rng = make_rng(8)
    assert [sample(probs, rng) for _ in range(100)] != a
    with pytest.raises(ValueError, match=r"seed must be an integer from 0 to 18446744073709551615 \(2\^64-1\), got -1"):
        make_rng(-1)


def test_sample_inverse_cdf_and_never_zero_probability():
    p = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    assert sample(p, ScriptedRng(0.0)) == 1
    assert sample(p, ScriptedRng(0.2499)) == 1
    assert sample(p, ScriptedRng(0.25)) == 3
    assert sample(p, ScriptedRng(np.nextafter(1.0, 0.0))) == 3
    # a uniform scaled up to exactly the total (rounding) must not fall onto the trailing zero
    assert sample(p, ScriptedRng(1.0)) == 3
    # unnormalised rows are scaled, not rejected
    assert sample(np.array([0.0, 2.0, 6.0]), ScriptedRng(0.3)) == 2


def test_sample_frequencies_match_probs():
    p = np.array([0.1, 0.0, 0.6, 0.3])
    rng = make_rng(0)
    counts = np.bincount([sample(p, rng) for _ in range(20000)], minlength=4)
    assert counts[1] == 0
    np.testing.assert_allclose(counts / 20000, p, atol=0.015)


def test_sample_rejects_bad_rows():
    for bad in ([], [0.0, 0.0], [0.5, -0.1, 0.6], [np.nan, 1.0], [[0.5, 0.5]]):
        with pytest.raises(ValueError):
            sample(np.array(bad, dtype=np.float64), make_rng(0))


def _reference_probs(row, params):
    """Straightforward full-sort implementation of temperature -> top-k -> top-p."""
    z = row.astype(np.float64)
    z = (z - z.max()) / params.temperature
    order = np.argsort(-z, kind="stable")
    if 0 < params.top_k < z.size:
        z[order[params.top_k :]] = -np.inf
    p = np.exp(z) / np.exp(z).sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        n_keep = min(int(np.searchsorted(np.cumsum(p[order]), params.top_p)) + 1, p.size)
        p[order[n_keep:]] = 0.0
        p /= p.sum()
    return p


@pytest.mark.parametrize("top_k, top_p", [(0, 0.5), (0, 0.95), (0, 0.999), (7, 1.0), (300, 0.9), (40, 0.3)])
def test_partial_sorts_equal_full_sort_reference(top_k, top_p):
    rng = np.random.default_rng(top_k + int(top_p * 1000))
    # coarse logits give many exact ties, including at the top-k and top-p boundaries;
    # a flat-ish row makes the nucleus larger than the first candidate batch
    logits = np.round(rng.normal(size=(4, 3000)) * 2) / 2
    logits[3] = np.round(rng.normal(size=3000) * 0.05, 2)
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    probs = probs_from_logits(logits.astype(np.float32), params)
    for row, out in zip(logits.astype(np.float32), probs):
        expected = _reference_probs(row, params)
        np.testing.assert_array_equal(out > 0, expected > 0)
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=0)
