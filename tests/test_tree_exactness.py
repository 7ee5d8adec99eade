"""benchmarks/experiments/trees/tree_exactness.py (the evidence behind refusing trees on padded steps) on tiny tree
bundles, in a subprocess (its pipeline shares ONNX Runtime's process-wide thread pool)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "trees" / "tree_exactness.py"


def exactness(bundle, *args):
    # code and chat: the tiny byte-level tokenizer makes the other categories' prompts longer
    # than the tiny model's 512 positions
    return subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(bundle),
            "--categories",
            "code,chat",
            "--max-new-tokens",
            "24",
            "--threads",
            "1",
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_fp32_trees_equal_target_only(tiny_bundle_factory):
    """An fp32 target steps unpadded: chains and trees both give target-only's greedy output."""
    p = exactness(tiny_bundle_factory(family="llama", draft="self", max_seq=512, tree=True))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["schema"] == "specedge.bench.tree_exactness/1" and not res["target"].get("invariant_steps")
    assert {r["id"].split("-")[0] for r in res["rows"]} == {"code", "chat"} and res["prompts"] == len(res["rows"]) > 1
    assert res["chain_mismatches"] == res["tree_mismatches"] == 0
    assert all(r["tree_equal"] and r["tree_first_difference"] is None for r in res["rows"])
    assert sum(r["tree_rounds"] for r in res["rows"]) > 0  # trees were verified, not only chains
    assert p.stderr.count("tree = target-only") == res["prompts"]


def test_padded_int4_target_is_measured_despite_the_refusal(tiny_bundle_factory):
    """On a MatMulNBits int4 target (padded single-token steps) the runtime refuses trees; the
    script lifts the refusal to measure what it prevents, and reports every prompt."""
    from specedge.runtime.api import load
    from specedge.runtime.generator import inexact_tree_refusal

    bundle = tiny_bundle_factory(
        family="llama", precision="int4", draft="ngram", max_seq=512, tree=True, int4_kernel="matmulnbits"
    )
    with load(bundle, threads=1, verify="size") as pipe:
        with pytest.raises(ValueError) as refused:
            pipe.generate("hello", max_new_tokens=4, tree=True)
        assert str(refused.value) == inexact_tree_refusal("int4")
    p = exactness(bundle)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["target"]["invariant_steps"] and res["target"]["precision"] == "int4"
    assert res["prompts"] == len(res["rows"]) > 1
    assert res["chain_mismatches"] == 0  # chain rows are bit-exact for any call size there
    assert res["tree_mismatches"] == sum(not r["tree_equal"] for r in res["rows"])
    assert sum(r["tree_rounds"] for r in res["rows"]) > 0


def test_bad_arguments_are_one_sentence(tiny_bundle_factory):
    bundle = tiny_bundle_factory(family="llama", draft="self", max_seq=512, tree=True)
    p = exactness(bundle, "--categories", "poetry")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: unknown category 'poetry'; categories: code, chat, grounded, summarization"
    ]
    p = exactness(bundle, "--max-new-tokens", 0)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: --max-new-tokens must be >= 1, got 0"]
