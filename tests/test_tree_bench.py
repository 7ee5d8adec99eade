"""benchmarks/experiments/trees/tree_bench.py on a tiny tree bundle, greedy and sampled, in a subprocess (its pipelines
share ONNX Runtime's process-wide thread pool, which would outlive this test in pytest's process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "trees" / "tree_bench.py"


def bench(bundle, *args):
    # code and chat: the tiny byte-level tokenizer makes the grounded and summarization prompts
    # longer than the tiny model's 512 positions
    return subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(bundle),
            "--prompts-per-category",
            "1",
            "--categories",
            "code,chat",
            "--max-new-tokens",
            "12",
            "--threads",
            "1",
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def check_rows(res, temperature, seed, guard):
    assert res["prompts"] == 2 and res["temperature"] == temperature
    assert res["seed"] == seed and res["guard"] is guard
    rows = res["configurations"]
    assert set(rows) == {"target-only (tree graph)", "chain (ngram)", "tree (ngram)", "chain (model)", "tree (model)"}
    for name, row in rows.items():
        # greedy: every configuration's output is target-only's; sampled outputs differ legitimately
        assert row["mismatches"] == (None if temperature else 0), name
        assert row["tokens_per_s"] > 0 and set(row["per_category"]) == {"code", "chat"}
        assert row["requests_with_trees_off"] == 0 or name.startswith("tree ("), name
    assert rows["chain (model)"]["tree_rounds"] == 0 and "vs_chain" in rows["tree (model)"]
    return rows


def test_tree_bench_greedy_and_sampled(tiny_bundle_factory):
    bundle = tiny_bundle_factory(family="llama", draft="self", max_seq=512, tree=True)
    # without the guard every round of a tree configuration is a tree round: whether the guard
    # keeps speculating on a tiny model hangs on timings (a draft step costs about a target step
    # there), and an unseeded request inherits the warm-up's verdict (CI once saw 0 tree rounds)
    for temperature, seed in ((0.0, None), (0.8, 4), (0.8, None)):
        p = bench(bundle, "--temperature", temperature, "--no-guard", *(("--seed", seed) if seed is not None else ()))
        assert p.returncode == 0, p.stderr[-3000:]
        rows = check_rows(json.loads(p.stdout), temperature, seed, guard=False)
        # the model drafter proposes every round; the n-gram one only where the text repeats
        # itself, which fresh random draws from a tiny random model need not do
        for d in ("ngram", "model") if seed is not None or not temperature else ("model",):
            assert rows[f"tree ({d})"]["tree_rounds"] > 0, d
        for d in ("ngram", "model"):
            assert rows[f"tree ({d})"]["fallbacks"] == 0 and rows[f"tree ({d})"]["requests_with_trees_off"] == 0, d
    # the default, guarded: greedy outputs stay target-only's whatever the guard decides
    p = bench(bundle)
    assert p.returncode == 0, p.stderr[-3000:]
    check_rows(json.loads(p.stdout), 0.0, None, guard=True)


def test_tree_bench_refuses_a_negative_temperature(tiny_bundle_factory):
    p = bench(tiny_bundle_factory(family="llama", draft="self", max_seq=512, tree=True), "--temperature", -1)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: --temperature must be a finite number >= 0, got -1.0"]
    p = bench(tiny_bundle_factory(family="llama", draft="self", max_seq=512, tree=True), "--categories", "code,poetry")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: unknown category 'poetry'; categories: code, chat, grounded, summarization"
    ]
