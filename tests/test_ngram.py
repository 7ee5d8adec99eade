"""Prompt-lookup drafter: the indexed search must equal a naive scan, whatever the call pattern."""

import time

import numpy as np
import pytest

from specedge.runtime.drafters.ngram import NgramIndex


def naive_propose(history, sizes, k):
    """Reference: scan backwards for the latest earlier occurrence of the suffix n-gram."""
    h = list(history)
    for n in sizes:
        if len(h) <= n:
            continue
        suffix = h[-n:]
        for start in range(len(h) - n - 1, -1, -1):
            if h[start : start + n] == suffix:
                return h[start + n : start + n + k]
    return []


def test_examples():
    drafter = NgramIndex(k=3)
    #          0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert drafter.propose(history) == [8, 9, 1]  # trigram 5 6 7 seen at 0
    # the most recent earlier occurrence wins: "1 2" at 0 and at 3 -> continue after the one at 3
    assert NgramIndex(k=2).propose([1, 2, 3, 1, 2, 4, 0, 1, 2]) == [4, 0]
    # falls back to shorter n-grams: trigram 3 1 2 never seen before, bigram 1 2 was
    assert NgramIndex((3, 2), k=1).propose([1, 2, 9, 3, 1, 2]) == [9]
    # the continuation may run into the suffix itself, and is cut at the end of the history
    assert NgramIndex((2,), k=4).propose([7, 7, 7]) == [7]
    assert NgramIndex((1,), k=4).propose([1, 2, 3, 1]) == [2, 3, 1]


def test_nothing_to_propose():
    drafter = NgramIndex()
    assert drafter.propose([]) == []
    assert drafter.propose([4]) == []
    assert drafter.propose([1, 2, 3, 4, 5]) == []  # no token repeats
    assert drafter.propose([1, 2, 3, 1], k=0) == []


def test_respects_k():
    history = list(range(20)) + [0, 1, 2]
    drafter = NgramIndex(k=4)
    assert drafter.propose(history) == [3, 4, 5, 6]
    assert drafter.propose(history, k=2) == [3, 4]
    assert drafter.propose(history, k=10) == list(range(3, 13))


@pytest.mark.parametrize("sizes", [(3, 2, 1), (1,), (4, 2), (2, 3)])
def test_matches_naive_search_on_random_histories(sizes):
    rng = np.random.default_rng(sum(sizes) * 31 + len(sizes))
    drafter = NgramIndex(sizes, k=5)
    for _ in range(60):
        vocab = int(rng.integers(2, 12))  # small vocabularies give many matches of every size
        history = rng.integers(0, vocab, size=int(rng.integers(0, 300))).tolist()
        k = int(rng.integers(0, 8))
        fresh = NgramIndex(sizes, k=5)
        expected = naive_propose(history, sizes, k)
        assert fresh.propose(history, k) == expected
        # the same drafter reused across unrelated histories (rebuilds its index) agrees too
        assert drafter.propose(np.array(history, dtype=np.int64), k) == expected


def test_incremental_growth_matches_naive_at_every_step():
    rng = np.random.default_rng(7)
    sizes = (3, 2, 1)
    drafter = NgramIndex(sizes, k=4)
    history = rng.integers(0, 6, size=20).tolist()
    for _ in range(300):
        assert drafter.propose(history) == naive_propose(history, sizes, 4)
        # grow by an accepted prefix of the proposal (plus a token), as the generator does
        step = drafter.propose(history)[: int(rng.integers(0, 5))] + [int(rng.integers(0, 6))]
        history = history + step


def test_rollback_and_new_request_rebuild_the_index():
    drafter = NgramIndex((2, 1), k=3)
    long = [1, 2, 3, 4, 1, 2, 9, 9, 1, 2]
    assert drafter.propose(long) == [9, 9, 1]
    short = long[:6]  # a shorter history (rollback): index entries past it must be gone
    assert drafter.propose(short) == naive_propose(short, (2, 1), 3) == [3, 4, 1]
    other = [5, 1, 2, 3, 1, 2]  # same length as an earlier history, different tokens
    assert drafter.propose(other) == naive_propose(other, (2, 1), 3) == [3, 1, 2]
    drafter.reset()
    assert drafter.propose(long) == [9, 9, 1]


def test_long_history_is_fast():
    rng = np.random.default_rng(0)
    history = rng.integers(0, 2000, size=8000).tolist()
    drafter = NgramIndex(k=4)
    drafter.propose(history)  # builds the index once
    start = time.perf_counter()
    for _ in range(200):
        history.append(int(rng.integers(0, 2000)))
        drafter.propose(history)
    per_call = (time.perf_counter() - start) / 200
    assert per_call < 2e-3, f"{per_call * 1e3:.2f} ms per call"  # naive: ~8000 slices per call
    assert drafter.propose(history) == naive_propose(history, (3, 2, 1), 4)


def test_probs_are_one_hot_rows():
    q = NgramIndex.probs([2, 0, 2], 4)
    assert q.dtype == np.float64
    np.testing.assert_array_equal(q, [[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 1, 0]])
    assert NgramIndex.probs([], 4).shape == (0, 4)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 4\)"):
        NgramIndex.probs([4], 4)
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        NgramIndex.probs([0], 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ngram_sizes": ()}, "ngram_sizes must name at least one n-gram size"),
        ({"ngram_sizes": (3, 0)}, "ngram_sizes must be positive integers, got 0"),
        ({"ngram_sizes": (2, 2)}, r"ngram_sizes must not repeat a size, got \(2, 2\)"),
        ({"ngram_sizes": (2.5,)}, "ngram_sizes must be positive integers, got 2.5"),
        ({"k": 0}, "k must be a positive integer, got 0"),
        ({"k": True}, "k must be a positive integer, got True"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramIndex(**kwargs)


def test_propose_rejects_negative_k():
    with pytest.raises(ValueError, match="k must be >= 0, got -1"):
        NgramIndex().propose([1, 2, 1], k=-1)
