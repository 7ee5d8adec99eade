"""Tree-capable bundles at runtime (issue 15): the manifest's graph flag, chain calls on a tree
graph, tree calls and the commit after one (the accepted path's K/V moved to contiguous slots).

The commit test is the one that matters for exactness: after a tree call and `keep_path`, the
next call must see the cache it would have seen had the accepted path been fed as a chain."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from specedge.cli.main import main
from specedge.manifest import MANIFEST_NAME, BundleError, load_manifest, parse_manifest
from specedge.runtime.backends.base import BackendError
from specedge.runtime.backends.ort import OrtBackend
from specedge.runtime.cache import CacheTracker
from specedge.runtime.tree import Tree

PROMPT = list(range(3, 23))
# root (pending token) -> 7 -> 11 -> 4 ; root -> 9 -> 13 ; 7 -> 12
TREE = Tree([5, 7, 9, 11, 13, 12, 4], [-1, 0, 0, 1, 2, 1, 3])


def _backend(bundle, role="target"):
    m = load_manifest(bundle, verify="size")
    return OrtBackend(m, m.target if role == "target" else m.draft, threads=1)


@pytest.fixture(scope="module", params=["scatter", "delta"])
def bundles(request, tiny_bundle_factory):
    kw = dict(family="llama", kv_mode=request.param, draft="self", max_seq=64)
    return tiny_bundle_factory(tree=True, **kw), tiny_bundle_factory(**kw)


def test_the_manifest_marks_tree_graphs(bundles, capsys):
    tree_bundle, plain = bundles
    m, old = load_manifest(tree_bundle, verify="size"), load_manifest(plain, verify="size")
    assert all(g.tree for spec in (m.target, m.draft) for g in spec.graphs)
    assert not any(g.tree for g in old.target.graphs)
    raw = json.loads((tree_bundle / MANIFEST_NAME).read_text())
    assert all(g["tree"] is True for g in raw["models"]["target"]["graphs"])
    assert "tree" not in json.loads((plain / MANIFEST_NAME).read_text())["models"]["target"]["graphs"][0]
    assert parse_manifest(m.to_json()).to_json() == m.to_json()
    assert m.extra["export"]["options"]["tree"] is True  # a re-export with --tree is not a reuse
    assert "tree" not in old.extra["export"]["options"]
    assert main(["inspect", str(tree_bundle)]) == 0
    assert "tree calls (tree_mask input)" in capsys.readouterr().out


def test_a_bad_tree_flag_is_refused(bundles, tmp_path):
    bad = tmp_path / "b"
    shutil.copytree(bundles[0], bad)
    raw = json.loads((bad / MANIFEST_NAME).read_text())
    raw["models"]["target"]["graphs"][0]["tree"] = "yes"
    (bad / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(
        BundleError, match="the manifest's 'tree' in models.target.graphs must be true or false, got 'yes'"
    ):
        load_manifest(bad, verify="size")


def test_chain_calls_on_a_tree_graph_equal_the_plain_graph(bundles):
    tree_b, plain_b = (_backend(b) for b in bundles)
    assert tree_b.takes_trees and not plain_b.takes_trees
    for t, pos in ((len(PROMPT), 0), (1, 20), (4, 21), (1, 25), (4, 26)):
        ids = np.arange(t) + 3
        np.testing.assert_allclose(tree_b.run(ids, pos), plain_b.run(ids, pos), atol=1e-4)


@pytest.mark.parametrize("leaf", [0, 3, 4, 5, 6])
def test_keep_path_leaves_the_cache_of_the_path_run_as_a_chain(bundles, leaf):
    backend = _backend(bundles[0])
    cache = CacheTracker(backend, 16)
    cache.feed_chunked(PROMPT)
    position = cache.position
    logits = cache.feed_tree(TREE.tokens, TREE.ancestor_mask()).copy()
    path = [leaf]
    while TREE.parents[path[-1]] >= 0:
        path.append(TREE.parents[path[-1]])
    path = path[::-1]
    cache.keep_path(position, path)
    assert cache.tokens == PROMPT + [TREE.tokens[i] for i in path]
    after = cache.feed([2, 8]).copy()  # the next call reads the compacted slots

    ref = CacheTracker(_backend(bundles[0]), 16)
    ref.feed_chunked(PROMPT)
    chain = ref.feed([TREE.tokens[i] for i in path]).copy()
    np.testing.assert_allclose(logits[path], chain, atol=1e-4)  # tree rows = root-path chain rows
    np.testing.assert_allclose(after, ref.feed([2, 8]), atol=1e-4)


def test_tree_calls_are_checked(bundles):
    plain = _backend(bundles[1])
    with pytest.raises(BackendError, match="takes no tree calls \\(export the bundle with --tree\\)"):
        plain.run_tree(np.array([1, 2]), 0, np.tril(np.ones((2, 2), bool)))
    b = _backend(bundles[0])
    with pytest.raises(ValueError, match="needs a \\[2, 2\\] mask"):
        b.run_tree(np.array([1, 2]), 0, np.ones((3, 3), bool))
    with pytest.raises(ValueError, match="only earlier tokens"):
        b.run_tree(np.array([1, 2]), 0, np.ones((2, 2), bool))
    cache = CacheTracker(b, 16)
    cache.feed_tree([1, 2], np.tril(np.ones((2, 2), bool)))
    with pytest.raises(ValueError, match="outside the 2 fed"):
        cache.keep_path(0, [0, 2])
    with pytest.raises(ValueError, match="must increase"):
        cache.keep_path(0, [1, 0])


# ------------------------------------------------------------- tree rounds end to end

# repeats itself, so the n-gram drafter finds several earlier matches that continue differently
REPEATS = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 10, 11, 5, 6, 7, 12, 5, 6]


@pytest.mark.parametrize("graphs", ["ort", "portable"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"])
def test_greedy_tree_output_equals_target_only(tiny_bundle_factory, family, graphs):
    from specedge.runtime.api import load

    bundle = tiny_bundle_factory(family=family, draft="ngram", max_seq=128, tree=True, graphs=graphs)
    pipe = load(bundle, threads=1, verify="size")
    want = pipe.generate(token_ids=REPEATS, max_new_tokens=48, speculative=False).token_ids
    got = pipe.generate(token_ids=REPEATS, max_new_tokens=48, tree=True, guard=False)
    assert got.token_ids == want
    # trees were verified: more drafted nodes than a chain of depth k could hold per call
    assert got.stats["target_calls"] < len(want) and got.stats["drafted"] > 0


def test_ngram_trees_reach_past_k_exactly_and_never_past_the_tokens_asked_for(tiny_bundle_factory, monkeypatch):
    """An n-gram tree may go deeper than k (its depth costs nothing): with k = 1 and the guard off,
    rounds accept more than one draft, greedy ids stay target-only's, and a request still stops at
    max_new_tokens (the depth is cut to what is left to emit) for every length tried. The tree
    size is fixed (it follows measured step costs otherwise: timing noise)."""
    import specedge.runtime.generator as generator
    from specedge.runtime.api import load

    monkeypatch.setattr(generator, "tree_nodes", lambda costs, k: k + 7)

    pipe = load(tiny_bundle_factory(family="llama", draft="ngram", max_seq=128, tree=True), threads=1, verify="size")
    prompt = REPEATS * 2  # a loop the drafter can follow deeper than one token
    want = pipe.generate(token_ids=prompt, max_new_tokens=40, speculative=False).token_ids
    got = pipe.generate(token_ids=prompt, max_new_tokens=40, spec_tokens=1, tree=True, guard=False)
    assert got.token_ids == want
    hist = got.stats["accepted_histogram"]
    assert len(hist) > 2 and sum(hist[2:]) > 0, hist  # some round kept more than k = 1 drafts
    drafter, asked = pipe.generator.drafter, []
    real = drafter.propose_tree

    def spy(history, k, nodes, params, rng=None, depth=None):
        asked.append((len(history) - len(prompt), depth))
        return real(history, k, nodes, params, rng, depth=depth)

    drafter.propose_tree = spy
    for n in (3, 5, 8, 13):
        asked.clear()
        r = pipe.generate(token_ids=prompt, max_new_tokens=n, spec_tokens=1, tree=True, guard=False)
        assert r.token_ids == want[:n], n
        # a round that has emitted e tokens may draft n - e - 1 deep: its path plus the target's
        # token fill what is left, no node is drafted that could never be emitted
        assert asked and all(depth <= n - emitted - 1 for emitted, depth in asked), (n, asked)
        assert n < 5 or any(depth == n - emitted - 1 and depth > 1 for emitted, depth in asked), (n, asked)
    pipe.close()


def test_tree_sampling_end_to_end_is_reproducible_and_refused_without_tree_graphs(bundles, tiny_bundle_factory):
    from specedge.runtime.api import load

    pipe = load(tiny_bundle_factory(family="llama", draft="ngram", max_seq=128, tree=True), threads=1, verify="size")
    a = pipe.generate(token_ids=REPEATS, max_new_tokens=32, temperature=0.8, seed=3, tree=True)
    b = pipe.generate(token_ids=REPEATS, max_new_tokens=32, temperature=0.8, seed=3, tree=True)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 32
    plain = load(tiny_bundle_factory(family="llama", draft="ngram", max_seq=128), threads=1, verify="size")
    with pytest.raises(ValueError, match="needs a target graph that takes trees: export the bundle with --tree"):
        plain.generate(token_ids=REPEATS, max_new_tokens=4, tree=True)
    # the CLI in a subprocess: an in-process `generate` would make ONNX Runtime's shared pool for
    # every later test of the session
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "specedge",
            "generate",
            str(tiny_bundle_factory(family="llama", draft="ngram", max_seq=128)),
            "hi",
            "--tree",
            "--max-new-tokens",
            "2",
            "--draft",
            "ngram",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "error: tree verification needs a target graph that takes trees: export the bundle with --tree"
    )


@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
def test_greedy_self_draft_tree_equals_target_only(tiny_bundle_factory, kv_mode):
    from specedge.runtime.api import load

    bundle = tiny_bundle_factory(family="llama", kv_mode=kv_mode, draft="self", max_seq=128, tree=True)
    pipe = load(bundle, threads=1, verify="size", draft="model")
    want = pipe.generate(token_ids=REPEATS, max_new_tokens=40, speculative=False).token_ids
    got = pipe.generate(token_ids=REPEATS, max_new_tokens=40, tree=True, guard=False)
    assert got.token_ids == want
    chain = pipe.generate(token_ids=REPEATS, max_new_tokens=40, guard=False)
    # the tree costs the chain's draft calls, and holds the chain: never fewer tokens per call
    assert got.stats["draft_calls"] <= chain.stats["draft_calls"] + 1
    assert got.stats["mean_accepted"] >= chain.stats["mean_accepted"]


def test_self_draft_tree_is_the_greedy_chain_plus_ranked_siblings(tiny_bundle_factory):
    from specedge.runtime.api import load
    from specedge.runtime.sampling import SamplingParams

    pipe = load(
        tiny_bundle_factory(family="llama", draft="self", max_seq=128, tree=True),
        threads=1,
        verify="size",
        draft="model",
    )
    drafter = pipe.generator.drafter
    chain = drafter.propose(REPEATS, 4, SamplingParams()).tokens
    tree = drafter.propose_tree(REPEATS, 4, 9, SamplingParams())
    assert tree.tokens[:5] == [REPEATS[-1], *chain] and tree.parents[:5] == [-1, 0, 1, 2, 3]
    assert len(tree) == 9 and all(p < 4 for p in tree.parents[5:])  # siblings of chain nodes, leaves
    assert all(not tree.children(i) for i in range(5, 9))
    assert drafter.propose_tree(REPEATS, 4, 1, SamplingParams()) is None
    assert_sampled_tree_is_the_sampled_chain(drafter, REPEATS, 9)


def assert_sampled_tree_is_the_sampled_chain(drafter, history, nodes):
    """Sampling: the tree's first line is the chain `propose` samples with the same draws, each
    node with its q row (so it is accepted with min(1, p/q), as in a chain round); siblings are
    point masses unlike the line's token at their depth."""
    from specedge.runtime.sampling import SamplingParams, make_rng

    warm = SamplingParams(temperature=0.9)
    a, b = make_rng(11), make_rng(11)
    chain = drafter.propose(history, 4, warm, a)
    tree = drafter.propose_tree(history, 4, nodes, warm, b)
    assert a.random() == b.random()  # the same number of draws
    assert tree.tokens[1:5] == chain.tokens and tree.parents[:5] == [-1, 0, 1, 2, 3]
    assert all(np.array_equal(tree.q[j + 1], chain.probs[j]) for j in range(4))
    assert len(tree) == nodes and all(tree.q[i] is None for i in range(5, nodes))
    assert all(tree.tokens[i] != tree.tokens[tree.parents[i] + 1] for i in range(5, nodes))


def test_sampled_trees_are_judged_against_their_chain(tiny_bundle_factory):
    """The guard judges sampled tree rounds too (the first-line nodes kept stand for the chain),
    so a tree that loses to its chain under sampling is turned off as a greedy one is."""
    from specedge.runtime.api import load

    pipe = load(
        tiny_bundle_factory(family="llama", draft="self", max_seq=128, tree=True),
        threads=1,
        verify="size",
        draft="model",
    )
    r = pipe.generate(token_ids=REPEATS, max_new_tokens=40, temperature=0.8, seed=5, tree=True)
    assert r.stats["tree_rounds"] > 0 and isinstance(r.stats["trees_off"], bool) and len(r.token_ids) == 40


@pytest.fixture(scope="module")
def head_tree_bundle(tiny_bundle_factory, tmp_path_factory):
    """A tiny llama bundle with features and tree graphs, and a head trained on it for a few steps."""
    import shutil

    from specedge.training.train import TrainOptions, train_draft

    dst = tmp_path_factory.mktemp("headtree") / "bundle"
    shutil.copytree(tiny_bundle_factory("llama", features=True, tree=True), dst)
    train_draft(
        dst,
        TrainOptions(
            budget="3k",
            draft_vocab=48,
            seq_len=32,
            batch=2,
            answer_tokens=16,
            max_prompts=4,
            doc_tokens=600,
            threads=1,
            checkpoint_every_s=0.0,
            checkpoint=str(tmp_path_factory.mktemp("headtree_ck")),
        ),
    )
    return dst


def test_head_tree_is_its_greedy_chain_plus_ranked_siblings_in_its_vocabulary(head_tree_bundle):
    from specedge.runtime.api import load
    from specedge.runtime.sampling import SamplingParams

    pipe = load(head_tree_bundle, threads=1, verify="size", draft="head")
    pipe.generate(token_ids=REPEATS, max_new_tokens=8, speculative=False)
    drafter, target = pipe.generator.drafter, pipe.generator.target
    history = list(target.tokens[: target.position]) + [5]  # what the cache holds, then a pending token
    chain = drafter.propose(history, 4, SamplingParams()).tokens
    calls = drafter.calls
    tree = drafter.propose_tree(history, 4, 10, SamplingParams())
    assert tree.tokens[:5] == [history[-1], *chain] and tree.parents[:5] == [-1, 0, 1, 2, 3]
    assert len(tree) == 10 and all(p < 4 for p in tree.parents[5:]) and all(not tree.children(i) for i in range(5, 10))
    allowed = set(drafter.d2t.tolist())
    assert set(tree.tokens[1:]) <= allowed  # mapped through the draft vocabulary, never outside it
    for i in range(5, 10):  # a sibling differs from the chain token at its depth
        assert tree.tokens[i] != tree.tokens[tree.parents[i] + 1]
    assert drafter.calls - calls <= 4  # the chain's calls (a catch-up plus k - 1 steps), no more
    assert drafter.propose_tree(history, 4, 1, SamplingParams()) is None
    assert drafter.propose_tree(history[:1], 4, 8, SamplingParams()) is None  # no features yet
    assert_sampled_tree_is_the_sampled_chain(drafter, history, 10)


def test_greedy_head_tree_output_equals_target_only(head_tree_bundle):
    from specedge.runtime.api import load

    pipe = load(head_tree_bundle, threads=1, verify="size", draft="head")
    for ids in (REPEATS, [3, 9, 27, 14, 2, 8]):
        want = pipe.generate(token_ids=ids, max_new_tokens=40, speculative=False).token_ids
        got = pipe.generate(token_ids=ids, max_new_tokens=40, tree=True, guard=False)
        assert got.token_ids == want
        chain = pipe.generate(token_ids=ids, max_new_tokens=40, guard=False)
        assert chain.token_ids == want
        assert got.stats["drafted"] > 0 and got.stats["target_calls"] <= chain.stats["target_calls"]


@pytest.mark.parametrize("max_seq,batch,path", [(32, 1, [0, 2, 3, 6]), (33, 2, [0, 1, 5]), (17, 1, [0, 1, 2])])
def test_gpu_path_copies_move_the_same_slots_as_numpy(max_seq, batch, path):
    """The GPU backends' tree commit (cudaMemcpy2D arguments, `binding.path_copies`) replayed on
    a host arena, in order, in place: the same cache as the numpy commit, padding untouched."""
    from types import SimpleNamespace

    from specedge.runtime.backends.binding import KVLayout, path_copies
    from specedge.runtime.tree import compaction_moves

    spec = SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=64 if max_seq != 33 else 8, kv_dtype="float16")
    cache = KVLayout.for_cache(spec, max_seq, batch)
    a = np.random.default_rng(max_seq).standard_normal((cache.num_tensors,) + cache.tensor_shape).astype(np.float16)
    arena = np.full(cache.total_bytes, 0xAB, np.uint8)
    cache.tensors(arena.view(np.float16))[...] = a
    position = 9
    moves = compaction_moves(path)
    want = a.copy()
    if moves:
        want[:, :, :, [position + d for _, d in moves]] = a[:, :, :, [position + s for s, _ in moves]]
    copies = path_copies(cache, position, moves)
    assert len(copies) == len(moves) * (1 if cache.dense else cache.num_tensors)
    for c in copies:
        for r in range(c.height):
            arena[c.dst_offset + r * c.dpitch : c.dst_offset + r * c.dpitch + c.width] = arena[
                c.src_offset + r * c.spitch : c.src_offset + r * c.spitch + c.width
            ]
    np.testing.assert_array_equal(cache.tensors(arena.view(np.float16)), want)
    pad = np.ones(cache.total_bytes, bool)
    for j in range(cache.num_tensors):
        pad[j * cache.tensor_stride : j * cache.tensor_stride + cache.tensor_bytes] = False
    assert (arena[pad] == 0xAB).all()
    with pytest.raises(ValueError, match="is not a move back inside a cache of"):
        path_copies(cache, max_seq - 2, [(3, 1)])


def test_tree_refused_on_a_backend_without_tree_calls_names_the_backend_not_the_export(tiny_bundle_factory):
    """A bundle exported with --tree on a backend that runs no tree calls (TensorRT's engines take
    no mask): the refusal must not tell the user to re-export with --tree, which they did."""
    from specedge.runtime.api import load

    pipe = load(tiny_bundle_factory(family="llama", draft="ngram", max_seq=128, tree=True), threads=1, verify="size")
    backend = pipe.generator.target.backend
    backend.takes_trees = False  # what the tensorrt backend reports for the same bundle
    backend.name = "tensorrt"
    with pytest.raises(ValueError) as e:
        pipe.generate(token_ids=REPEATS, max_new_tokens=4, tree=True)
    assert str(e.value) == (
        "tree verification is not available on the tensorrt backend, although the bundle's "
        "target graph takes trees: use the ort-cpu or torch backend, or leave tree off"
    )
    assert "export the bundle with --tree" not in str(e.value)
    # chains still run on it
    assert len(pipe.generate(token_ids=REPEATS, max_new_tokens=4).token_ids) == 4


INEXACT_INT4 = (
    "tree verification would not be exact on this int4 target: ONNX Runtime's attention orders a tree "
    "node's sums differently from a chain's, enough to change its picks; leave tree off, or re-export "
    "with --int4-kernel specedge (batch-invariant kernels, exact trees)"
)


def test_trees_are_refused_where_single_token_steps_are_padded(tiny_bundle_factory):
    """An int4 target on ONNX Runtime's kernels pads its single-token steps to stay exact; the same
    attention sums a tree node's keys in another order than a chain's (masked siblings between
    them), which changed greedy picks on 2 of 10 bench prompts of the int4 default model: a tree
    request there is one sentence, in Python (and C++: tests/test_cpp.py). Target-only requests
    with tree=True, and a pipeline loaded with padding turned off on purpose, are not refused."""
    from specedge.runtime.api import load

    bundle = tiny_bundle_factory(
        family="llama", precision="int4", draft="ngram", max_seq=128, tree=True, int4_kernel="matmulnbits"
    )
    pipe = load(bundle, threads=1, verify="size")
    assert pipe.describe()["target"].get("invariant_steps") is True
    with pytest.raises(ValueError) as e:
        pipe.generate(token_ids=REPEATS, max_new_tokens=8, tree=True)
    assert str(e.value) == INEXACT_INT4
    with pytest.raises(ValueError, match="would not be exact on this int4 target"):
        pipe.stream(token_ids=REPEATS, max_new_tokens=8, tree=True, temperature=0.7)
    plain = pipe.generate(token_ids=REPEATS, max_new_tokens=8, speculative=False, tree=True)
    assert len(plain.token_ids) == 8
    unpadded = load(bundle, threads=1, verify="size", invariant_steps=False)
    assert len(unpadded.generate(token_ids=REPEATS, max_new_tokens=8, tree=True).token_ids) == 8
