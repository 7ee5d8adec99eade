"""A draft head beside a GPU target backend, tested on the CPU as the GPU backends are.

The head runs on ONNX Runtime's CPU provider; the target backend copies its features output
(contract.FEATURES_OUTPUT) to the host array `Backend.features` after every call and moves those
rows with the K/V entries on a tree commit. The ort-cuda backend runs its binding code on ONNX
Runtime's CPU provider (device="cpu"), the torch backend its module on the CPU, so both paths run
here; the native TensorRT backend's copies need a GPU (tests/test_gpu_backends.py, marked gpu).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from test_gpu_backends import HAS_CUDA, _has_ort_provider, gpu, needs_cuda

from specedge.manifest import load_manifest
from specedge.runtime.backends import create_backend
from specedge.runtime.backends.base import BackendError

TRAIN = dict(
    budget="2k",
    draft_vocab=48,
    seq_len=32,
    batch=2,
    answer_tokens=16,
    max_prompts=4,
    doc_tokens=600,
    threads=1,
    checkpoint_every_s=0.0,
)
PROMPTS = ["hello there", "def add(a, b):", "The quick brown fox", "for i in range(10):"]
# (backend, backend_options, features tolerance against ort-cpu): the torch module computes in
# another order than ONNX Runtime's kernels
GPU_BACKENDS = {
    "ort-cuda": ({"device": "cpu"}, 1e-5),
    "torch": ({"device": "cpu", "dtype": "float32", "cuda_graphs": False}, 2e-3),
}


@pytest.fixture(scope="module", params=["scatter", "delta"])
def head_bundle(request, tiny_bundle_factory, tmp_path_factory) -> Path:
    """A tiny llama bundle with features and a trained head, in each kv mode."""
    from specedge.training.train import TrainOptions, train_draft

    root = tmp_path_factory.mktemp(f"head-{request.param}")
    shutil.copytree(tiny_bundle_factory("llama", kv_mode=request.param, features=True), root / "bundle")
    train_draft(root / "bundle", TrainOptions(**TRAIN, checkpoint=str(root / "ck")))
    return root / "bundle"


def _backend(name: str, m):
    opts, _ = GPU_BACKENDS[name]
    if name == "torch":
        pytest.importorskip("torch")
    return create_backend(name, m, m.target, **opts)


def _calls(m):
    """Prefill in two chunks, then verification-sized and single-token calls."""
    rng = np.random.RandomState(3)
    ids = rng.randint(0, m.target.vocab_size, 40)
    return [(ids[:16], 0), (ids[16:27], 16), (ids[27:32], 27), (ids[32:33], 32), (ids[33:38], 33)]


@pytest.mark.parametrize("name", sorted(GPU_BACKENDS))
def test_gpu_backends_return_the_features_ort_cpu_returns(head_bundle, name):
    m = load_manifest(head_bundle)
    ref, b = create_backend("ort-cpu", m, m.target, threads=1), _backend(name, m)
    try:
        F = m.target.features["dim"]
        assert b.features.shape == (m.batch, m.max_seq, F) and b.features.dtype == np.float32
        for ids, pos in _calls(m):
            b.run(ids, pos)
            ref.run(ids, pos)
        n = 38
        assert np.abs(ref.features[0, :n]).max() > 0.1  # rows were written, not left zero
        np.testing.assert_allclose(b.features[:, :n], ref.features[:, :n], atol=GPU_BACKENDS[name][1], rtol=1e-3)
        # argmax (the greedy fast path) records the rows too
        b.argmax(np.array([5, 6]), 10)
        ref.run(np.array([5, 6]), 10)
        np.testing.assert_allclose(b.features[:, 10:12], ref.features[:, 10:12], atol=GPU_BACKENDS[name][1], rtol=1e-3)
    finally:
        b.close()
        ref.close()


@pytest.mark.parametrize("name", sorted(GPU_BACKENDS))
def test_a_tree_commit_moves_the_features_rows_with_the_kv(head_bundle, name):
    m = load_manifest(head_bundle)
    b = _backend(name, m)
    try:
        b.run(np.arange(1, 13), 0)
        before = b.features.copy()
        # path root 0 -> node 2 -> node 4 at position 8: rows 10 and 12 move to slots 9 and 10
        b.keep_path(8, [0, 2, 4])
        np.testing.assert_array_equal(b.features[:, 8], before[:, 8])
        np.testing.assert_array_equal(b.features[:, 9], before[:, 10])
        np.testing.assert_array_equal(b.features[:, 10], before[:, 12])
        np.testing.assert_array_equal(b.features[:, :8], before[:, :8])
    finally:
        b.close()


def _greedy_equals_target_only(bundle, name: str, opts: dict) -> None:
    """load(draft="head") with target backend `name`: the head runs on ort-cpu; greedy output is
    the target's own and the head's drafts are accepted."""
    from specedge.runtime.api import load

    head = load(bundle, backend=name, draft="head", threads=1, backend_options=opts)
    ref = load(bundle, backend=name, draft="ngram", threads=1, backend_options=opts)
    try:
        assert head.backend_name == name and head.draft_backend_name == "ort-cpu"
        drafted = accepted = 0
        for p in PROMPTS:
            a = head.generate(p, max_new_tokens=32, guard=False)
            r = ref.generate(p, max_new_tokens=32, speculative=False)
            assert a.token_ids == r.token_ids, p
            drafted += a.stats["drafted"]
            accepted += a.stats["accepted"]
        assert drafted > 0 and accepted > 0
        print(name, head.target.describe(), f"drafted {drafted}, accepted {accepted}")
    finally:
        head.close()
        ref.close()


@pytest.mark.parametrize("name", sorted(GPU_BACKENDS))
def test_greedy_with_the_head_beside_a_gpu_backend_equals_target_only(head_bundle, name):
    if name == "torch":
        pytest.importorskip("torch")
    _greedy_equals_target_only(head_bundle, name, GPU_BACKENDS[name][0])


@gpu
@needs_cuda
@pytest.mark.parametrize("head_bundle", ["scatter"], indirect=True)
def test_gpu_torch_target_with_the_head_equals_target_only(head_bundle):
    """On the GPU, with CUDA graphs captured: the features rows come back from the device."""
    _greedy_equals_target_only(head_bundle, "torch", {"device": "cuda", "dtype": "float32"})


@gpu
@pytest.mark.skipif(
    not (HAS_CUDA and _has_ort_provider("CUDAExecutionProvider")),
    reason="no CUDA GPU" if not HAS_CUDA else "onnxruntime-gpu is not installed",
)
@pytest.mark.parametrize("head_bundle", ["scatter"], indirect=True)
def test_gpu_ort_cuda_target_with_the_head_equals_target_only(head_bundle):
    _greedy_equals_target_only(head_bundle, "ort-cuda", {})


def test_a_head_refuses_a_draft_backend_other_than_ort_cpu(head_bundle):
    from specedge.runtime.api import load

    with pytest.raises(
        BackendError,
        match=r"a draft head runs on the ort-cpu backend \(draft_backend 'ort-cuda'\); "
        "its target may use any backend",
    ):
        load(head_bundle, draft="head", draft_backend="ort-cuda", warmup=False)


def test_a_target_backend_without_feature_rows_is_one_clear_error(head_bundle):
    """A backend that kept no feature rows (a custom backend, say) stops the head drafter with a
    sentence naming the backend, not an index error."""
    from specedge.runtime.api import load

    pipe = load(head_bundle, draft="head", threads=1, warmup=False)
    try:
        pipe.target.features = None
        with pytest.raises(
            ValueError,
            match="the target backend 'ort-cpu' does not return target features: "
            "head drafting needs a bundle exported with features",
        ):
            pipe.generate("hello there", max_new_tokens=8, guard=False)
    finally:
        pipe.close()
