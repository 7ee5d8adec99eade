"""scripts/tree_bench.py on a tiny tree bundle, greedy and sampled, in a subprocess (its pipelines
share ONNX Runtime's process-wide thread pool, which would outlive this test in pytest's process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tree_bench.py"


def bench(bundle, *args):
    # code and chat: the tiny byte-level tokenizer makes the grounded and summarization prompts
    # longer than the tiny model's 512 positions
    return subprocess.run([sys.executable, str(SCRIPT), str(bundle), "--prompts-per-category", "1", "--categories", "code,chat",
                           "--max-new-tokens", "12", "--threads", "1", *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def test_tree_bench_greedy_and_sampled(tiny_bundle_factory):
    bundle = tiny_bundle_factory(family="llama", draft="self", max_seq=512, tree=True)
    for temperature, seed in ((0.0, None), (0.8, 4), (0.8, None)):
        p = bench(bundle, "--temperature", temperature, *(("--seed", seed) if seed is not None else ()))
        assert p.returncode == 0, p.stderr[-3000:]
        res = json.loads(p.stdout)
        assert res["prompts"] == 2 and res["temperature"] == temperature
        assert res["seed"] == seed
        rows = res["configurations"]
        assert set(rows) == {"target-only (tree graph)", "chain (ngram)", "tree (ngram)", "chain (model)",
                             "tree (model)"}
        for name, row in rows.items():
            # greedy: every configuration's output is target-only's; sampled outputs differ legitimately
            assert row["mismatches"] == (None if temperature else 0), name
            assert row["tokens_per_s"] > 0 and set(row["per_category"]) == {"code", "chat"}
        assert rows["tree (model)"]["tree_rounds"] > 0 and "vs_chain" in rows["tree (model)"]
        assert rows["chain (model)"]["tree_rounds"] == 0


def test_tree_bench_refuses_a_negative_temperature(tiny_bundle_factory):
    p = bench(tiny_bundle_factory(family="llama", draft="self", max_seq=512, tree=True), "--temperature", -1)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: --temperature must be a finite number >= 0, got -1.0"]
    p = bench(tiny_bundle_factory(family="llama", draft="self", max_seq=512, tree=True), "--categories", "code,poetry")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: unknown category 'poetry'; categories: code, chat, grounded, summarization"]
