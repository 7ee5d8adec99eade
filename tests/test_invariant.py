"""Batch-invariant target steps (runtime/invariant.py, runtime/cache.py): a single-token step run as two
tokens gives bit for bit the logits of the matching row of a verification call, so greedy
speculation on an int4 target equals its target-only output. Tiny int4 bundles in CI; the slow
test exports the real default model's int4 target."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.manifest import load_manifest
from specedge.runtime.api import load
from specedge.runtime.backends import create_backend
from specedge.runtime.cache import CacheTracker
from specedge.runtime.invariant import wants_invariant_steps

PROMPTS = ["the cat sat on the mat and the cat sat on the", "1 2 3 4 5 6 7 8 1 2 3 4", "hello world, hello"]


@pytest.fixture(scope="module")
def int4_bundle(tiny_bundle_factory):
    # ONNX Runtime's MatMulNBits graph only: the graph whose single-token steps are padded
    return tiny_bundle_factory(precision="int4", draft="ngram", max_seq=128, int4_kernel="matmulnbits")


def test_padded_steps_equal_verification_rows_bit_for_bit(int4_bundle):
    m = load_manifest(int4_bundle, verify="none")
    steps = CacheTracker(create_backend("ort-cpu", m, m.target, threads=1), m.prefill_chunk, invariant_steps=True)
    verify = create_backend("ort-cpu", m, m.target, threads=1)
    ids = np.random.default_rng(0).integers(3, m.target.vocab_size, size=60).astype(np.int64)
    for start in (5, 21, 40):
        steps.run(ids[:start], 0)
        verify.run(ids[:start], 0)
        rows = np.array(verify.run(ids[start : start + 5], start))
        for j in range(5):
            one = np.array(steps.run(ids[start + j : start + j + 1], start + j))
            assert one.shape == (1, m.target.vocab_size)
            assert np.array_equal(one[0], rows[j]), (start, j)
            assert steps.argmax(ids[start + j : start + j + 1], start + j).tolist() == [int(rows[j].argmax())]


def test_last_slot_is_a_plain_single_token_call(int4_bundle):
    m = load_manifest(int4_bundle, verify="none")
    seen = []

    class Spy:
        max_seq = m.max_seq

        def run(self, ids, position):
            seen.append((list(ids), position))
            return np.zeros((len(ids), 4), np.float32)

    w = CacheTracker(Spy(), 1, invariant_steps=True)
    assert w.run(np.array([7]), 3).shape == (1, 4)
    assert w.run(np.array([7]), m.max_seq - 1).shape == (1, 4)
    assert w.run(np.array([7, 8, 9]), 10).shape == (3, 4)
    assert seen == [([7, 0], 3), ([7], m.max_seq - 1), ([7, 8, 9], 10)]


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_greedy_speculation_on_an_int4_target_equals_target_only(tiny_bundle_factory, draft):
    bundle = tiny_bundle_factory(
        precision="int4", draft="self" if draft == "model" else "ngram", max_seq=128, int4_kernel="matmulnbits"
    )
    pipe = load(bundle, threads=1, verify="none", draft=draft)
    assert pipe.describe()["target"]["invariant_steps"] is True  # the int4 default
    for prompt in PROMPTS:
        ref = pipe.generate(prompt, max_new_tokens=40, speculative=False)
        spec = pipe.generate(prompt, max_new_tokens=40, speculative=True, guard=False)
        assert spec.stats["drafted"] > 0
        assert spec.token_ids == ref.token_ids, prompt
    pipe.close()


def test_defaults_and_bad_input(tiny_bundle_factory):
    assert wants_invariant_steps("int4") and wants_invariant_steps("fp16") and not wants_invariant_steps("fp32")
    fp32 = tiny_bundle_factory()
    pipe = load(fp32, threads=1, verify="none")
    assert "invariant_steps" not in pipe.describe()["target"]
    pipe.close()
    pipe = load(fp32, threads=1, verify="none", invariant_steps=True)
    assert pipe.describe()["target"]["invariant_steps"] is True
    pipe.close()
    with pytest.raises(ValueError, match="invariant_steps must be True, False or None, got 'yes'"):
        load(fp32, threads=1, verify="none", invariant_steps="yes")


@pytest.mark.slow
def test_real_int4_target_speculation_is_exact(tmp_path):
    """The default model's GGUF-exact int4 target with the n-gram drafter: 4 bench prompts,
    speculative == target-only token for token (plain T=1 steps fail this on most prompts:
    benchmarks/experiments/int4/results/int4_exactness.json)."""
    from specedge.bench.runner import load_prompts
    from specedge.export.pipeline import ExportOptions, export_bundle

    path, _ = export_bundle(ExportOptions(out=str(tmp_path / "b"), precision="int4", draft="ngram", force=True))
    pipe = load(path, threads=2, verify="none", draft="ngram")
    for p in load_prompts()[::5]:
        ids = pipe.tokenizer.encode_chat(p["messages"])
        ref = pipe.generate(token_ids=ids, max_new_tokens=64, speculative=False)
        spec = pipe.generate(token_ids=ids, max_new_tokens=64, speculative=True)
        assert spec.token_ids == ref.token_ids, p["id"]
    pipe.close()


def test_int4_export_defaults_to_the_ngram_drafter_and_inspect_says_the_step_mode(
    tiny_checkpoint_factory, tmp_path, capsys
):
    from specedge.cli import export_models
    from specedge.cli.export_models import default_draft
    from specedge.cli.main import main

    assert default_draft("int4") == "ngram" and default_draft("int8") == "ngram" and default_draft("fp32") == "self"
    out = tmp_path / "b"
    rc = export_models.main(
        [
            "--target",
            str(tiny_checkpoint_factory()),
            "--precision",
            "int4",
            "--out",
            str(out),
            "--max-seq",
            "64",
            "--quiet",
        ]
    )
    assert rc == 0
    m = load_manifest(out, verify="none")
    assert m.target.precision == "int4" and not m.draft.is_model
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "steps      batch-invariant" in text and "n-gram" in text
    assert "default    export-models' draft for an int4 target" in text
