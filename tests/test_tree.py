"""Tree structure, greedy tree verification and the exactness of tree sampling (runtime/tree.py).

The exactness test mirrors tests/test_verify.py's for chains: toy autoregressive models over a
small vocabulary whose next-token distribution is a fixed random function of the whole prefix.
Every tree a drafting process can make is enumerated with its probability (children drawn with
replacement from q, without replacement, or chosen deterministically as point masses), and for
each the verifier's outcomes are summed with the probabilities `sibling_rule` (the rule
`verify_tree_sampling` draws from) gives; each emitted sequence is then completed by target-only
sampling. The joint must equal target-only sampling to 1e-9. A statistical test then runs the
real `verify_tree_sampling` with a seeded generator against the same analytic distribution.
"""

import itertools
import math
from collections import Counter, defaultdict

import numpy as np
import pytest

from specedge.runtime.sampling import SamplingParams, make_rng, probs_from_logits
from specedge.runtime.tree import Tree, compaction_moves, sibling_rule, verify_tree_greedy, verify_tree_sampling

VOCAB = 4


class Toy:
    """Next-token probabilities as a fixed random function of the prefix."""

    def __init__(self, seed, params=None, mask_frac=0.0):
        params = SamplingParams(temperature=1.0) if params is None else params
        self.seed, self.params, self.mask_frac, self._cache = seed, params, mask_frac, {}

    def __call__(self, prefix):
        prefix = tuple(prefix)
        if prefix not in self._cache:
            rng = np.random.default_rng([self.seed, len(prefix), *prefix])
            logits = (rng.normal(size=VOCAB) * 2.0).astype(np.float32)
            if self.mask_frac:
                mask = rng.random(VOCAB) < self.mask_frac
                mask[rng.integers(VOCAB)] = False
                logits[mask] = -np.inf
            self._cache[prefix] = probs_from_logits(logits, self.params)
        return self._cache[prefix]


# ------------------------------------------------------------- trees a drafter can make


def sibling_draws(q, b, mode):
    """Every way of choosing b children from the draft distribution q: [(tokens, qs, weight)]."""
    if mode == "point":  # deterministic: the b most likely tokens, no distributions
        top = [int(i) for i in np.argsort(-q, kind="stable")[:b] if q[i] > 0]
        return [(top, [None] * len(top), 1.0)]
    out = []
    for toks in itertools.product(range(VOCAB), repeat=b):
        qs, w, left = [], 1.0, np.asarray(q, np.float64).copy()
        for x in toks:
            dist = left / left.sum() if mode == "without" else np.asarray(q, np.float64)
            w *= dist[x]
            qs.append(dist)
            if mode == "without":
                left[x] = 0.0
            if w == 0 or (mode == "without" and left.sum() == 0 and len(qs) < b):
                break
        if w > 0 and len(qs) == b:
            out.append((list(toks), qs, w))
    return out


def all_trees(draft, shape, mode, root=0):
    """Enumerate (Tree, probability) for a tree whose depth-d nodes each get shape[d] children."""
    results = []

    def grow(tokens, parents, qs, prefixes, frontier, depth, weight):
        if depth == len(shape) or not frontier:
            results.append((Tree(list(tokens), list(parents), list(qs)), weight))
            return
        options = [sibling_draws(draft(prefixes[n]), shape[depth], mode) for n in frontier]
        for combo in itertools.product(*options):
            t, p, q, pre, nxt, w = list(tokens), list(parents), list(qs), list(prefixes), [], weight
            for node, (toks, dists, cw) in zip(frontier, combo):
                w *= cw
                for x, d in zip(toks, dists):
                    nxt.append(len(t))
                    t.append(x)
                    p.append(node)
                    q.append(d)
                    pre.append(prefixes[node] + (x,))
            grow(t, p, q, pre, nxt, depth + 1, w)

    grow([root], [-1], [None], [()], [0], 0, 1.0)
    return results


def tree_outcomes(tree, target, buggy=False):
    """{emitted tuple: probability} of one tree's verification, from `sibling_rule`'s numbers."""
    out = defaultdict(float)
    prefixes = [()]
    for i in range(1, len(tree)):
        prefixes.append(prefixes[tree.parents[i]] + (tree.tokens[i],))

    def walk(node, reach):
        kids = tree.children(node)
        p = target(prefixes[node])
        accept, residual = sibling_rule(p, [tree.tokens[c] for c in kids], [tree.q[c] for c in kids])
        if buggy:
            residual = p
        for c, a in zip(kids, accept):
            if a > 0:
                walk(c, reach * a)
            reach *= 1.0 - a
        if reach > 0:
            for y in range(VOCAB):
                if residual[y] > 0:
                    out[prefixes[node] + (y,)] += reach * residual[y]

    walk(0, 1.0)
    return out


def completed(dist, target, n):
    out = defaultdict(float)
    for seq, prob in dist.items():
        for tail in itertools.product(range(VOCAB), repeat=n - len(seq)):
            full = seq + tail
            out[full[:n]] += prob * math.prod(target(full[:i])[full[i]] for i in range(len(seq), n))
    return out


def target_joint(target, n):
    return {s: math.prod(target(s[:i])[s[i]] for i in range(n)) for s in itertools.product(range(VOCAB), repeat=n)}


def emitted(target, draft, shape, mode, buggy=False):
    total = defaultdict(float)
    for tree, w in all_trees(draft, shape, mode):
        for seq, p in tree_outcomes(tree, target, buggy).items():
            total[seq] += w * p
    return total


SHAPES = [[3], [2, 1], [1, 2], [2, 2], [1, 1, 1]]


@pytest.mark.parametrize("mode", ["point", "with", "without"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tree_sampling_is_exact(shape, mode):
    target, draft = Toy(1), Toy(2)
    dist = emitted(target, draft, shape, mode)
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-12)
    n = len(shape) + 1
    want, got = target_joint(target, n), completed(dist, target, n)
    assert max(abs(got[s] - want[s]) for s in want) < 1e-9


@pytest.mark.parametrize("mode", ["point", "with", "without"])
def test_tree_sampling_is_exact_with_masked_supports(mode):
    # top-k/top-p leave zeros in p and q: drafted tokens the target rules out, q(x) = 0 edges
    params = SamplingParams(temperature=0.8, top_k=3)
    target, draft = Toy(3, params, mask_frac=0.4), Toy(4, params, mask_frac=0.4)
    dist = emitted(target, draft, [2, 2], mode)
    want, got = target_joint(target, 3), completed(dist, target, 3)
    assert max(abs(got[s] - want[s]) for s in want) < 1e-9


def test_the_enumeration_catches_a_wrong_residual():
    target, draft = Toy(1), Toy(2)
    got = completed(emitted(target, draft, [2, 1], "with", buggy=True), target, 3)
    want = target_joint(target, 3)
    assert max(abs(got[s] - want[s]) for s in want) > 1e-3


def test_tree_sampling_statistically_matches_the_analytic_distribution():
    """The real verifier, drawing: emitted sequences over many trials vs `emitted`'s distribution."""
    target, draft = Toy(5), Toy(6)
    trees = all_trees(draft, [2, 1], "without")
    weights = np.array([w for _, w in trees])
    rng = make_rng(7)
    counts, n = Counter(), 40000
    picks = rng.choice(len(trees), size=n, p=weights / weights.sum())
    for i in picks:
        tree = trees[i][0]
        prefixes = [()]
        for j in range(1, len(tree)):
            prefixes.append(prefixes[tree.parents[j]] + (tree.tokens[j],))
        probs = np.stack([target(pre) for pre in prefixes])
        path, out = verify_tree_sampling(tree, probs, rng)
        assert tuple(tree.tokens[j] for j in path[1:]) == tuple(out[:-1])
        counts[tuple(out)] += 1
    want = emitted(target, draft, [2, 1], "without")
    tv = 0.5 * sum(abs(counts[s] / n - want.get(s, 0.0)) for s in set(counts) | set(want))
    assert tv < 0.03
    # first emitted token alone: target-only sampling's first distribution
    first = Counter()
    for s, c in counts.items():
        first[s[0]] += c
    p0 = target(())
    assert max(abs(first[y] / n - p0[y]) for y in range(VOCAB)) < 0.015


# ------------------------------------------------------------- greedy, structure, compaction


def test_greedy_takes_the_longest_matching_root_path_then_the_target_token():
    # root -> a(5) -> c(9); root -> b(7) -> d(2) -> e(3)
    tree = Tree([1, 5, 7, 9, 2, 3], [-1, 0, 0, 1, 2, 4])
    # target argmax per node: after root 7, after b 2, after d 8 (e=3 rejected)
    path, out = verify_tree_greedy(tree, [7, 0, 2, 0, 8, 0])
    assert path == [0, 2, 4] and out == [7, 2, 8]
    # nothing matches at the root: only the target's token
    assert verify_tree_greedy(tree, [4, 0, 0, 0, 0, 0]) == ([0], [4])
    # a full path accepted: the bonus token after the leaf
    assert verify_tree_greedy(tree, [7, 0, 2, 0, 3, 6]) == ([0, 2, 4, 5], [7, 2, 3, 6])


def test_greedy_equals_the_chain_verifier_on_a_chain():
    from specedge.runtime.verify import accept_greedy

    rng = np.random.default_rng(0)
    for _ in range(50):
        draft = rng.integers(0, 3, size=4).tolist()
        best = rng.integers(0, 3, size=5).tolist()
        tree = Tree([9, *draft], [-1, 0, 1, 2, 3])
        assert verify_tree_greedy(tree, best)[1] == accept_greedy(draft, best)


def test_mask_depths_and_prefix_tree():
    tree = Tree.from_paths(1, [[5, 9], [5, 4], [7]])
    assert tree.tokens == [1, 5, 9, 4, 7] and tree.parents == [-1, 0, 1, 1, 0]
    assert tree.depths() == [0, 1, 2, 2, 1]
    m = tree.ancestor_mask()
    assert m.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [True, True, False, True, False],
        [True, False, False, False, True],
    ]
    chain = Tree([1, 2, 3], [-1, 0, 1])
    assert np.array_equal(chain.ancestor_mask(), np.tril(np.ones((3, 3), bool)))


@pytest.mark.parametrize(
    "tokens,parents,msg",
    [
        ([], [], "at least its root"),
        ([1, 2], [-1], "one parent per token"),
        ([1, 2], [0, 0], "parent must be -1"),
        ([1, 2, 3], [-1, 2, 0], "earlier node"),
    ],
)
def test_bad_trees_are_refused(tokens, parents, msg):
    with pytest.raises(ValueError, match=msg):
        Tree(tokens, parents)


def test_bad_verifier_inputs_are_refused():
    tree = Tree([1, 2], [-1, 0])
    with pytest.raises(ValueError, match="one argmax per tree node"):
        verify_tree_greedy(tree, [1])
    with pytest.raises(ValueError, match="one row per tree node"):
        verify_tree_sampling(tree, np.ones((3, 4)) / 4, make_rng(0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_tree_sampling(Tree([1, 9], [-1, 0]), np.ones((2, 4)) / 4, make_rng(0))
    with pytest.raises(ValueError, match="one entry per node"):
        Tree([1, 2], [-1, 0], q=[None])


def test_compaction_moves():
    assert compaction_moves([0, 1, 2]) == []
    assert compaction_moves([0, 2, 4, 5]) == [(2, 1), (4, 2), (5, 3)]
    with pytest.raises(ValueError, match="must increase"):
        compaction_moves([0, 3, 2])
    # done in order, slot by slot, in place: every moved slot ends up holding its node
    slots = list(range(10))
    for src, dst in compaction_moves([0, 3, 4, 8]):
        slots[dst] = slots[src]
    assert slots[:4] == [0, 3, 4, 8]


def test_tree_nodes_grow_with_cheap_calls_only():
    from specedge.runtime.policy import CostModel
    from specedge.runtime.tree_size import MAX_TREE_NODES, tree_nodes

    cpu = CostModel({1: 1.0, 5: 4.0, 17: 14.0})  # compute-bound: every token costs
    gpu = CostModel({1: 1.0, 5: 1.02, 33: 1.1})  # bandwidth-bound: extra tokens nearly free
    assert tree_nodes(cpu, 4) == 6  # c(6) = 4.83 <= 1.25 * 4; c(7) = 5.67 is not
    assert tree_nodes(gpu, 4) == MAX_TREE_NODES
    assert tree_nodes(CostModel(), 4) == 6  # nothing measured: cost ~ T
    assert tree_nodes(cpu, 4, slack=0.0) == 5
    # flat costs measured only up to T = 5: the tree grows two nodes past that, then as measured
    flat = CostModel({1: 1.0, 5: 1.0})
    assert tree_nodes(flat, 4) == 7
    flat.observe_target(7, 1.0)
    assert tree_nodes(flat, 4) == 9
    with pytest.raises(ValueError, match="k must be >= 1"):
        tree_nodes(cpu, 0)


def test_ngram_tree_is_the_chain_then_the_likeliest_branches():
    from specedge.runtime.drafters.ngram import NgramDrafter

    hist = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3, 4, 7, 1, 2, 3]
    prop = NgramDrafter(vocab=16)
    chain = prop.propose(hist, 3, SamplingParams()).tokens
    tree = prop.propose_tree(hist, 3, 8, SamplingParams())
    # the chain's continuation comes first and whole; "1 2 3" went on with 4 twice and 5 once, so
    # the other 4-branch (4 9, score 2/3 x 1/2) and 5 (1/3) join before 5's own follower 6 and 9's 1
    assert chain == [4, 7, 1]
    assert tree.tokens == [3, 4, 7, 1, 5, 9, 6, 1] and tree.parents == [-1, 0, 1, 2, 0, 1, 4, 5]
    paths = {tuple(tree.tokens[j] for j in _root_path(tree, i)[1:]) for i in range(len(tree)) if not tree.children(i)}
    assert paths == {(4, 7, 1), (4, 9, 1), (5, 6)} and max(tree.depths()) == 3
    # allowed deeper than k, the chain's line goes on where the history did (7 1 -> 2)
    deep = prop.propose_tree(hist, 3, 8, SamplingParams(), depth=6)
    assert deep.tokens == [3, 4, 7, 1, 5, 9, 2, 6] and deep.parents == [-1, 0, 1, 2, 0, 1, 3, 4]
    assert max(deep.depths()) == 4
    assert prop.propose_tree(hist, 3, 8, SamplingParams(), depth=1).tokens == tree.tokens  # depth >= k
    assert prop.propose_tree(hist, 3, 1, SamplingParams()) is None
    assert prop.propose_tree([1, 2], 3, 8, SamplingParams()) is None  # no match


def test_ngram_tree_scores_and_vocabulary_match_the_cpp_case():
    """The case cpp/tests/test_tree.cpp checks too, worked by hand: "1 2" was followed by 3, 4
    and 5 (latest last), so the root's children each score 1/3; the chain is the latest match's
    5 6; ties go to the candidate found first (4 before 3, then the chain's own 1 after 6)."""
    from specedge.runtime.drafters.ngram import NgramIndex

    d = NgramIndex((2, 1))
    h = [1, 2, 3, 7, 2, 9, 1, 2, 4, 8, 1, 2, 5, 6, 1, 2]
    assert d.propose_tree(h, 2, 8, 4, 16) == ([2, 5, 6, 4, 3, 1, 8, 7], [-1, 0, 1, 0, 0, 2, 3, 4])
    assert d.propose_tree(h, 2, 8, 2, 16) == ([2, 5, 6, 4, 3, 8, 7], [-1, 0, 1, 0, 0, 3, 4])
    assert d.propose_tree(h, 2, 4, 4, 16) == ([2, 5, 6, 4], [-1, 0, 1, 0])
    # ids the target may not emit (>= 6) are never proposed: the chain stops before 6
    assert d.propose_tree(h, 2, 8, 4, 6) == ([2, 5, 4, 3], [-1, 0, 0, 0])
    assert d.propose_tree(h, 0, 8, 4, 16) == ([], []) and d.propose_tree(h, 2, 1, 4, 16) == ([], [])


def _root_path(tree, i):
    out = [i]
    while tree.parents[out[-1]] >= 0:
        out.append(tree.parents[out[-1]])
    return out[::-1]


def test_top_ids_break_ties_at_the_cut_toward_the_lower_ids():
    """np.argpartition leaves the choice among equal values at the cut unspecified; the tree's
    runner-up siblings must not depend on it (the C++ runtime picks the same set: cpp/src/tree.cpp)."""
    from specedge.runtime.drafters.base import top_ids

    p = np.array([0.1, 0.3, 0.1, 0.3, 0.1, 0.1])
    assert top_ids(p, 1).tolist() == [1]
    assert top_ids(p, 2).tolist() == [1, 3]
    assert top_ids(p, 3).tolist() == [0, 1, 3]
    assert top_ids(p, 5).tolist() == [0, 1, 2, 3, 4]
    assert top_ids(p, 9).tolist() == list(range(6)) and top_ids(p, 0).tolist() == []
    rng = np.random.default_rng(0)
    for _ in range(200):  # random rows with many ties: the n largest, lower ids first among equals
        row = rng.integers(0, 4, size=int(rng.integers(1, 40))).astype(np.float64)
        n = int(rng.integers(0, row.size + 2))
        want = sorted(sorted(range(row.size), key=lambda i: (-row[i], i))[:n])
        assert top_ids(row, n).tolist() == want


def test_chain_tree_siblings_with_tied_probabilities_are_the_lower_ids():
    """Equal runner-ups at the selection cut: the lower ids become the siblings, whatever
    argpartition would have picked."""
    from specedge.runtime.drafters.base import chain_tree

    first = np.zeros(12)
    first[5] = 2.0  # the chain's token; every other id ties
    rows = {5: np.where(np.arange(12) == 7, 4.0, 0.0)}
    tree = chain_tree(1, first, lambda t: rows[t], 2, 6)
    assert tree.tokens[:3] == [1, 5, 7] and tree.parents[:3] == [-1, 0, 1]
    # 3 extra nodes: the ties after the root come before those after node 1 (larger path
    # probability), lowest ids first
    assert tree.tokens[3:] == [0, 1, 2] and tree.parents[3:] == [0, 0, 0]


# ------------------------------------------------------------- sampled chain trees (model drafts)


def chain_tree_outcomes(monkeypatch, target, draft, k, nodes, params, q_rows="kept"):
    """Every tree the real `chain_tree` makes when sampling, with its probability: each chain the
    draft could sample (`sample` forced to every token in turn, weighted by the q rows the tree
    records), then `tree_outcomes` of that tree. The siblings it adds depend on the sampled line
    (they are q's likeliest *other* tokens, ranked along the whole chain)."""
    import specedge.runtime.drafters.base as base

    total = defaultdict(float)
    for chain in itertools.product(range(VOCAB), repeat=k):
        picks = iter(chain)
        monkeypatch.setattr(base, "sample", lambda p, rng: next(picks))
        fed = []

        def step(tok):
            fed.append(tok)
            return np.log(draft(tuple(fed)))

        with np.errstate(divide="ignore"):  # masked draft tokens: log 0 = -inf logits
            tree = base.chain_tree(0, np.log(draft(())), step, k, nodes, params=params, rng=object(), vocab=VOCAB)
        w = math.prod(tree.q[j + 1][x] for j, x in enumerate(chain))
        assert tree.tokens[1 : k + 1] == list(chain) and all(q is None for q in tree.q[k + 1 :])
        if q_rows == "dropped":  # the sampled line tested as point masses: exact, but accepted less
            tree = Tree(tree.tokens, tree.parents, [None] * len(tree))
        elif q_rows == "on siblings":  # a bug: siblings tested as if drawn from their line's q
            tree = Tree(
                tree.tokens,
                tree.parents,
                [tree.q[i] if i <= k else tree.q[tree.parents[i] + 1] for i in range(len(tree))],
            )
        if w > 0:
            for seq, p in tree_outcomes(tree, target).items():
                total[seq] += w * p
    return total


@pytest.mark.parametrize("k,nodes", [(1, 4), (2, 6), (3, 8)])
def test_sampled_chain_tree_is_exact(monkeypatch, k, nodes):
    """A model drafter's sampled tree (the sampled chain with its q rows, then point-mass siblings
    chosen from the drawn line) emits target-only sampling's distribution to 1e-9."""
    params = SamplingParams(temperature=1.0)
    target, draft = Toy(11, params), Toy(12, params)
    dist = chain_tree_outcomes(monkeypatch, target, draft, k, nodes, params)
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-12)
    want, got = target_joint(target, k + 1), completed(dist, target, k + 1)
    assert max(abs(got[s] - want[s]) for s in want) < 1e-9


def test_sampled_chain_tree_is_exact_with_masked_supports(monkeypatch):
    params = SamplingParams(temperature=1.0, top_k=3)
    target, draft = Toy(13, params, mask_frac=0.4), Toy(14, params, mask_frac=0.4)
    dist = chain_tree_outcomes(monkeypatch, target, draft, 2, 6, params)
    want, got = target_joint(target, 3), completed(dist, target, 3)
    assert max(abs(got[s] - want[s]) for s in want) < 1e-9


def test_the_sampled_chain_enumeration_catches_siblings_tested_against_q(monkeypatch):
    params = SamplingParams(temperature=1.0)
    target, draft = Toy(11, params), Toy(12, params)
    got = completed(chain_tree_outcomes(monkeypatch, target, draft, 2, 6, params, q_rows="on siblings"), target, 3)
    want = target_joint(target, 3)
    assert max(abs(got[s] - want[s]) for s in want) > 1e-3


def expected_length(dist) -> float:
    return sum(len(seq) * p for seq, p in dist.items())


@pytest.mark.parametrize("seed", [11, 21, 31])
def test_a_sampled_chain_tree_emits_at_least_what_its_chain_would(monkeypatch, seed):
    """Tokens per call: the tree (its first line tested with q, as the chain round tests it, then
    siblings) never emits fewer on average than the chain alone (the tree cut to k + 1 nodes), and
    more than the same tree whose line is tested as point masses."""
    params = SamplingParams(temperature=1.0)
    target, draft = Toy(seed, params), Toy(seed + 1, params)
    tree = expected_length(chain_tree_outcomes(monkeypatch, target, draft, 2, 6, params))
    chain = expected_length(chain_tree_outcomes(monkeypatch, target, draft, 2, 3, params))
    points = expected_length(chain_tree_outcomes(monkeypatch, target, draft, 2, 6, params, q_rows="dropped"))
    assert tree >= chain - 1e-12 and tree > points + 1e-3, (tree, chain, points)


def test_sampled_chain_tree_draws_the_chain_propose_would_and_keeps_its_q_rows():
    """The same rows and tie rules as the C++ case (cpp/tests/test_tree.cpp): rows over 6 draft
    ids mapped to target ids 10..15 of 16; one draw per chain token; siblings are point masses."""
    from specedge.runtime.drafters.base import chain_tree
    from specedge.runtime.sampling import sample

    first = np.array([1.0, 0.5, 0.0, -1.0, 0.2, 0.1], np.float32)
    second = np.array([0.0, 2.0, 1.0, 0.5, -2.0, 0.3], np.float32)
    ids = np.arange(10, 16)
    warm = SamplingParams(temperature=0.7)
    rng, same = make_rng(3), make_rng(3)
    tree = chain_tree(1, first, lambda t: second, 2, 6, ids=ids, params=warm, rng=rng, vocab=16)
    q1, q2 = probs_from_logits(first, warm), probs_from_logits(second, warm)
    x1, x2 = sample(q1, same), sample(q2, same)
    assert rng.random() == same.random()  # one draw per chain token, no more
    assert len(tree) == 6 and tree.tokens[:3] == [1, 10 + x1, 10 + x2] and tree.parents[:3] == [-1, 0, 1]
    assert tree.q[1].tolist() == [0.0] * 10 + q1.tolist() and tree.q[2].tolist() == [0.0] * 10 + q2.tolist()
    for i in range(3, 6):
        assert tree.q[i] is None and tree.tokens[i] != tree.tokens[tree.parents[i] + 1]
    with pytest.raises(ValueError, match="a sampled chain tree needs the request's rng and the target's vocab"):
        chain_tree(1, first, lambda t: second, 2, 6, ids=ids, params=warm, rng=None, vocab=16)
    assert chain_tree(1, first, lambda t: second, 2, 6, params=SamplingParams()).q is None  # greedy: point masses


def test_first_line_kept_counts_the_chain_nodes_a_sampled_path_kept():
    from specedge.runtime.tree import first_line_kept

    tree = Tree([1, 5, 7, 8, 9], [-1, 0, 1, 0, 1])
    assert first_line_kept(tree, [0, 1, 2]) == 2
    assert first_line_kept(tree, [0, 1, 2], 1) == 1
    assert first_line_kept(tree, [0, 1, 4]) == 1  # a sibling of node 2 taken: the chain stopped there
    assert first_line_kept(tree, [0, 3]) == 0 and first_line_kept(tree, [0]) == 0
