"""benchmarks/experiments/self_draft/guard_categories.py refuses a repeat count below one (its end-to-end run loads pipelines on a
process-wide ORT thread pool, which breaks later sessions in the same pytest process)."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="module")
def trained_head_bundle(tiny_bundle_factory, tmp_path_factory):
    """A tiny llama bundle with target features and a draft head trained for a few steps."""
    from specedge.training.train import TrainOptions, train_draft

    root = tmp_path_factory.mktemp("guard_head")
    shutil.copytree(tiny_bundle_factory("llama", features=True, max_seq=512), root / "bundle")
    train_draft(
        root / "bundle",
        TrainOptions(
            budget="1k",
            draft_vocab=48,
            seq_len=32,
            batch=2,
            answer_tokens=16,
            max_prompts=4,
            doc_tokens=600,
            threads=1,
            checkpoint_every_s=0.0,
            checkpoint=str(root / "ck"),
        ),
    )
    return root / "bundle"


def test_repeats_below_one_is_refused_with_one_line(load_script, tiny_bundle_factory, capsys):
    bundle = tiny_bundle_factory()
    capsys.readouterr()  # the tiny export's progress
    assert load_script("benchmarks/experiments/self_draft/guard_categories").main([str(bundle), "--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --repeats must be at least 1"]


def test_unknown_category_is_refused_with_one_line(load_script, tiny_bundle_factory, capsys):
    bundle = tiny_bundle_factory()
    capsys.readouterr()
    assert (
        load_script("benchmarks/experiments/self_draft/guard_categories").main(
            [str(bundle), "--categories", "code,poetry"]
        )
        == 2
    )
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: unknown category 'poetry'; categories: code, chat, grounded, summarization"
    ]


def test_a_bundle_with_a_draft_head_is_measured_with_it(trained_head_bundle, tmp_path):
    """Every drafter the bundle has, the trained head included, against target-only (in a
    subprocess: the script makes the process-wide ONNX Runtime pool)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "self_draft" / "guard_categories.py"
    p = subprocess.run(
        [
            sys.executable,
            str(script),
            str(trained_head_bundle),
            "--categories",
            "code,chat",
            "--prompts-per-category",
            "1",
            "--max-new-tokens",
            "8",
            "--repeats",
            "1",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    (b,) = json.loads(p.stdout)["bundles"]
    assert set(b["configurations"]) >= {"target-only", "speculative (ngram)", "speculative (head)"}
    head = b["configurations"]["speculative (head)"]
    assert set(head["per_category"]) == {"code", "chat"} and head["tokens_per_s"] > 0
    assert "head" in b["step_costs_ms"]
