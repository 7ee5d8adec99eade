"""specedge.bench: statistics, results schema, prompt suite, plot, and a quick `specedge bench` run
on a tiny bundle (with --tune on a copy of it)."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest

from specedge.bench import stats as S
from specedge.bench.runner import (
    CATEGORIES,
    SCHEMA,
    BenchConfig,
    best_per_mode,
    choose_k,
    find,
    load_prompts,
    select_prompts,
    summarize_runs,
    validate_results,
)

# ----------------------------------------------------------------------------- statistics


def test_median_and_quantiles():
    assert S.median([3, 1, 2]) == 2
    assert S.median([4, 1, 3, 2]) == 2.5
    assert S.median([7.0]) == 7.0
    assert math.isnan(S.median([]))
    # numpy "linear": position (n - 1) q in the sorted values
    xs = [10, 20, 30, 40, 50]
    assert S.quantile(xs, 0.25) == 20
    assert S.quantile(xs, 0.75) == 40
    assert S.quantile([1, 2, 3, 4], 0.25) == pytest.approx(1.75)
    assert S.quantile([1, 2, 3, 4], 0.75) == pytest.approx(3.25)
    s = S.summarize([5, 1, 4, 2, 3, None, float("nan")])
    assert s == {"median": 3, "q1": 2, "q3": 4, "iqr": 2, "min": 1, "max": 5, "n": 5}
    assert S.summarize([])["median"] is None and S.summarize([])["n"] == 0
    with pytest.raises(ValueError):
        S.quantile([1], 1.5)


def test_acceptance_pooling_is_a_ratio_of_sums():
    runs = [
        # 10 tokens: first from prefill; 3 rounds of k=4 accepting 4, 2, 0 -> 5 + 3 + 1 = 9 tokens
        {"tokens": 10, "drafted": 12, "accepted": 6, "target_calls": 3, "histogram": [1, 0, 1, 0, 1]},
        # 5 tokens: one round of k=2 accepting 1 (2 tokens) + 2 plain target steps
        {"tokens": 5, "drafted": 2, "accepted": 1, "target_calls": 1, "histogram": [0, 1]},
    ]
    p = S.pool_acceptance(runs)
    assert p["drafted"] == 14 and p["accepted"] == 7 and p["target_calls"] == 4
    assert p["acceptance_rate"] == pytest.approx(7 / 14)
    assert p["mean_accepted"] == pytest.approx((7 + 4) / 4)  # tokens per verification call
    assert p["histogram"] == [1, 1, 1, 0, 1]
    assert p["decode_tokens"] == 9 + 4
    assert p["target_forward_passes"] == 3 + (1 + 2)  # verifications + plain steps
    assert S.decode_target_calls(10, 6, 3) == 3
    assert S.decode_target_calls(5, 1, 1) == 3
    empty = S.pool_acceptance([{"tokens": 8}])
    assert empty["acceptance_rate"] is None and empty["mean_accepted"] is None
    with pytest.raises(ValueError):
        S.pool_acceptance([{"tokens": 3, "drafted": 1, "accepted": 2, "target_calls": 1}])


def test_bandwidth_arithmetic():
    W_t, W_d = 538_551_992, 84_682_424  # the default bundle's fp32 target and int4 self-draft
    # target only: every token reads all target weights once
    assert S.spec_bytes_per_token(W_t, W_d, 0, 1.0) == W_t
    assert S.bandwidth(W_t, 20.0) == pytest.approx(10_771_039_840.0)  # 10.77 GB/s at 20 tok/s
    # k = 4, 3 tokens per target call: (W_t + 4 W_d) / 3 = (538551992 + 338729696) / 3 = 292427229.33
    bpt = S.spec_bytes_per_token(W_t, W_d, 4, 3.0)
    assert bpt == pytest.approx(292_427_229.333, rel=1e-9)
    assert S.bandwidth(bpt, 30.0) == pytest.approx(8_772_816_880.0)
    # n-gram drafter reads no weights: W_t / m
    assert S.spec_bytes_per_token(1000, 0, 8, 2.5) == pytest.approx(400.0)
    # exact count agrees with the closed form when every round has k drafts and no plain step:
    # 10 rounds of k=4, 20 accepted -> 30 decode tokens, 10 target passes, 40 draft passes
    exact = S.bytes_per_token(W_t, W_d, 10, 40, 30)
    assert exact == pytest.approx(S.spec_bytes_per_token(W_t, W_d, 4, 3.0))
    assert S.bytes_per_token(1, 1, 1, 1, 0) is None
    assert S.bandwidth(None, 3.0) is None
    with pytest.raises(ValueError):
        S.spec_bytes_per_token(W_t, W_d, 2, 0.0)


def test_throughput_and_geometric_mean():
    runs = [{"tokens": 11, "decode_s": 1.0}, {"tokens": 21, "decode_s": 3.0}, {"tokens": 1, "decode_s": 0.0}]
    assert S.throughput(runs) == pytest.approx(30 / 4.0)
    assert S.throughput([]) is None
    assert S.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert S.geometric_mean([]) is None


# ----------------------------------------------------------------------------- prompts


def test_prompt_suite():
    prompts = load_prompts()
    assert len(prompts) >= 16
    cats = {p["category"] for p in prompts}
    assert cats == set(CATEGORIES)
    for c in CATEGORIES:
        assert sum(p["category"] == c for p in prompts) >= 4
    assert len({p["id"] for p in prompts}) == len(prompts)
    for p in prompts:
        assert p["messages"][-1]["role"] == "user"
        assert all(m["role"] in ("system", "user", "assistant") for m in p["messages"])
    # grounded and summarization prompts carry the passage they work on
    for p in prompts:
        if p["category"] in ("grounded", "summarization"):
            assert len(p["messages"][-1]["content"]) > 300, p["id"]
    two = select_prompts(prompts, per_category=2)
    assert len(two) == 8 and all(sum(p["category"] == c for p in two) == 2 for c in CATEGORIES)
    assert {p["category"] for p in select_prompts(prompts, categories=["code"])} == {"code"}


def test_bad_prompt_suite_is_refused(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(
        json.dumps(
            {
                "schema": "specedge.bench.prompts/1",
                "prompts": [{"id": "a", "category": "poetry", "messages": [{"role": "user", "content": "x"}]}],
            }
        )
    )
    with pytest.raises(ValueError, match="category"):
        load_prompts(bad)


def test_config_validation():
    with pytest.raises(ValueError):
        BenchConfig(ks=[0, 17]).validate()
    with pytest.raises(ValueError):
        BenchConfig(modes=["beam"]).validate()
    with pytest.raises(ValueError):
        BenchConfig(max_new_tokens=1).validate()
    with pytest.raises(ValueError, match="draft-kv must be auto or own, got 'mine'"):
        BenchConfig(draft_kv="mine").validate()
    q = BenchConfig.quick_defaults(threads=2).validate()
    assert q.ks == [0, 1, 2, 4] and q.repeats == 1 and q.quick
    assert BenchConfig(ks=[4, 0, 2, 2]).validate().ks == [0, 2, 4]
    assert q.seed_for("greedy", 0, 3) is None
    assert q.seed_for("sampled", 1, 3) == 1003


# ----------------------------------------------------------------------------- synthetic results


def _synthetic_runs() -> list[dict]:
    """Runs whose speed follows a simple model: target-only 20 tok/s; k drafts cost 0.1 target
    steps each; acceptance 0.8 on grounded, 0.5 elsewhere (sampled: 0.1 lower)."""
    prompts = load_prompts()
    runs = []
    for mode in ("greedy", "sampled"):
        for k in (0, 1, 2, 4, 8):
            for rep in range(3):
                for p in prompts:
                    a = (0.8 if p["category"] == "grounded" else 0.5) - (0.1 if mode == "sampled" else 0.0)
                    n = 65
                    if k == 0:
                        calls = drafted = accepted = 0
                        hist = []
                        secs = (n - 1) / 20.0
                    else:
                        m = (1 - a ** (k + 1)) / (1 - a)  # expected tokens per call
                        calls = round((n - 1) / m)
                        drafted = calls * k
                        accepted = n - 1 - calls
                        hist = [0] * (k + 1)
                        hist[min(round(m) - 1, k)] = calls
                        secs = calls * (1 + 0.1 * k + 0.02 * k) / 20.0
                    secs *= 1 + 0.01 * rep
                    runs.append(
                        {
                            "mode": mode,
                            "k": k,
                            "repeat": rep,
                            "prompt": p["id"],
                            "category": p["category"],
                            "seed": None if mode == "greedy" else 1000 * rep,
                            "prompt_tokens": 100,
                            "truncated": False,
                            "tokens": n,
                            "finish_reason": "length",
                            "tokens_per_s": (n - 1) / secs,
                            "ttft_s": 0.2,
                            "decode_s": secs,
                            "drafted": drafted,
                            "accepted": accepted,
                            "target_calls": calls,
                            "histogram": hist,
                            "time_draft_s": secs * 0.2 if k else 0.0,
                            "time_verify_s": secs * 0.75,
                            "time_other_s": secs * 0.05,
                            "k_final": k,
                            "fallbacks": 0,
                            "peak_rss_mb": 900.0 + k,
                            "matches_target_only": True if (k and mode == "greedy") else None,
                            "first_diff": None,
                            "output_sha1": "0",
                        }
                    )
    return runs


def _synthetic_results() -> dict:
    runs = _synthetic_runs()
    summary = summarize_runs(runs, 1000.0, 250.0)
    return {
        "schema": SCHEMA,
        "created": "2025-01-01T00:00:00+00:00",
        "command": ["specedge", "bench", "x"],
        "machine": {
            "cpu": "test",
            "logical_cpus": 2,
            "load_avg_start": [0.1, 0.1, 0.1],
            "load_avg_end": [0.1, 0.1, 0.1],
        },
        "bundle": {
            "path": "x",
            "target": {"precision": "fp32", "weight_bytes": 1000},
            "draft": {"kind": "model", "precision": "int4", "weight_bytes": 250},
            "max_seq": 2048,
            "k_manifest": 4,
        },
        "config": {
            "ks": [0, 1, 2, 4, 8],
            "repeats": 3,
            "max_new_tokens": 65,
            "modes": ["greedy", "sampled"],
            "prompts": [p["id"] for p in load_prompts()],
            "categories": list(CATEGORIES),
            "draft": "model",
            "threads": 2,
        },
        "runs": runs,
        "summary": summary,
        "best": best_per_mode(summary),
        "tune": choose_k(summary),
    }


def test_results_schema_from_synthetic_runs():
    res = _synthetic_results()
    validate_results(res)
    json.loads(json.dumps(res, allow_nan=False))
    s = res["summary"]
    assert {r["category"] for r in s} == set(CATEGORIES) | {"all"}
    assert len(s) == 2 * 5 * 5  # modes x ks x (4 categories + all)
    base = find(s, "greedy", 0, "all")
    assert base["speedup"] == 1.0 and base["bytes_per_token"] == 1000.0
    assert base["tokens_per_s"]["median"] == pytest.approx(20.0 / 1.01)  # the middle repeat
    assert base["tokens_per_s"]["min"] == pytest.approx(20.0 / 1.02)
    g4 = find(s, "greedy", 4, "grounded")
    m = (1 - 0.8**5) / (1 - 0.8)
    assert g4["mean_accepted"] == pytest.approx(m, rel=0.05)
    assert g4["acceptance_rate"] == pytest.approx(g4["accepted"] / g4["drafted"])
    # exact bytes/token = (W_t * passes + W_d * drafted) / decode tokens
    assert g4["bytes_per_token"] == pytest.approx(
        (1000.0 * g4["target_forward_passes"] + 250.0 * g4["drafted"]) / g4["decode_tokens"]
    )
    assert g4["bandwidth_gb_s"] == pytest.approx(g4["bytes_per_token"] * g4["tokens_per_s"]["median"] / 1e9)
    assert g4["speedup"] > find(s, "greedy", 4, "chat")["speedup"] > 1.0
    assert g4["greedy_exact"]["identical"] == g4["greedy_exact"]["prompts"] == 5
    assert g4["peak_rss_mb"] == 904.0
    assert g4["time_split"]["verify"] == pytest.approx(0.75)
    for bad in (
        {"schema": "nope"},
        {**res, "runs": [{**res["runs"][0], "mode": "beam"}]},
        {**res, "summary": [{**s[0], "acceptance_rate": 1.5}]},
    ):
        with pytest.raises(ValueError):
            validate_results(bad)


def test_choose_k():
    res = _synthetic_results()
    t = res["tune"]
    # under the synthetic model, the best overall k follows from the acceptance: check by brute force
    scores = {}
    for k in (1, 2, 4, 8):
        sp = [find(res["summary"], m, k)["speedup"] for m in ("greedy", "sampled")]
        scores[k] = math.sqrt(sp[0] * sp[1])
    assert t["k"] == max(scores, key=scores.get)
    assert t["score"] == pytest.approx(max(scores.values()))
    assert f"k={t['k']}" in t["reason"] and "acceptance" in t["reason"]
    # a draft that never pays: no k is chosen, and the reason says so
    slow = [dict(r) for r in _synthetic_runs()]
    for r in slow:
        if r["k"]:
            r["decode_s"] *= 5
    t2 = choose_k(summarize_runs(slow, 1000.0, 250.0))
    assert t2["k"] is None and "no k beats" in t2["reason"]


# ----------------------------------------------------------------------------- plot


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _check_png(path: Path) -> None:
    w, h = _png_size(path)
    assert w >= 400 and h >= 300, (w, h)
    assert path.stat().st_size > 10_000


def test_plot_from_synthetic_results(tmp_path):
    pytest.importorskip("matplotlib")
    from specedge.bench.plot import plot_results

    out = plot_results(_synthetic_results(), tmp_path / "sub" / "bench.png")
    _check_png(out)


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_bundle(request, tmp_path_factory):
    try:
        factory = request.getfixturevalue("tiny_bundle_factory")
    except pytest.FixtureLookupError:
        factory = None
    if factory is not None:
        return Path(
            factory(
                family="llama",
                kv_mode="scatter",
                draft="self",
                precision="fp32",
                draft_precision="int4",
                max_seq=128,
                spec_tokens=4,
            )
        )
    from specedge.export.testing import tiny_bundle

    return Path(tiny_bundle(tmp_path_factory.mktemp("bench") / "tiny", family="llama", draft="self", max_seq=128))


def test_cli_bench_shared_pool_in_its_own_process(tiny_bundle, tmp_path):
    """The CLI default: target-only and speculative pipelines on one process-wide pool; greedy
    speculative output still equals target-only output."""
    import subprocess
    import sys

    out = tmp_path / "out"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "specedge",
            "bench",
            str(tiny_bundle),
            "--quick",
            "--k",
            "0,2",
            "--max-new-tokens",
            "8",
            "--prompts-per-category",
            "1",
            "--categories",
            "code",
            "--modes",
            "greedy",
            "--threads",
            "1",
            "--out",
            str(out),
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "bench.json").read_text())
    assert res["config"]["shared_pool"] is True
    spec = [r for r in res["runs"] if r["k"] == 2]
    assert spec and all(r["matches_target_only"] for r in spec)


def test_cli_bench_quick_and_tune(tiny_bundle, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from specedge.cli.main import main
    from specedge.manifest import load_manifest

    bundle = tmp_path / "bundle"  # shared test bundles are read-only: tune a copy
    shutil.copytree(tiny_bundle, bundle)
    before = {p.name: p.read_bytes() for p in bundle.rglob("*") if p.is_file() and p.name != "manifest.json"}
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            str(bundle),
            "--quick",
            "--k",
            "0,1,3",
            "--max-new-tokens",
            "12",
            "--prompts-per-category",
            "1",
            "--threads",
            "1",
            "--out",
            str(out),
            "--tune",
            "--json",
            "--quiet",
            "--no-shared-pool",
        ]
    )  # in-process: a process pool would bind every later test's sessions
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    res = json.loads((out / "bench.json").read_text())
    validate_results(res)
    assert printed["files"]["json"] == str(out / "bench.json")
    assert res["config"]["ks"] == [0, 1, 3] and res["config"]["quick"] is True
    assert res["config"]["shared_pool"] is False and res["config"]["draft_kv"] == "auto"
    assert len(res["runs"]) == 2 * 3 * 4  # modes x ks x prompts (1 per category, 1 repeat)
    assert {r["category"] for r in res["summary"]} == set(CATEGORIES) | {"all"}
    for r in res["runs"]:
        assert r["tokens"] >= 1 and r["peak_rss_mb"] and r["peak_rss_mb"] > 0
        if r["k"] > 0:
            assert r["drafted"] >= r["accepted"]
        # greedy speculative output equals target-only output (tiny fp32 target)
        if r["mode"] == "greedy" and r["k"] > 0:
            assert r["matches_target_only"] is not None
    g = find(res["summary"], "greedy", 3)
    assert g["bytes_per_token"] > 0 and g["acceptance_rate"] is not None
    _check_png(out / "bench.png")
    # --tune: the manifest holds the chosen k (or is unchanged when no k paid), and still loads
    tune = res["tune"]
    m = load_manifest(bundle, verify="full")
    if tune["k"] is not None:
        assert tune["written"] is True and m.spec_tokens == tune["k"]
        obj = json.loads((bundle / "manifest.json").read_text())
        assert obj["extra"]["bench_tune"]["k"] == tune["k"]
    else:
        assert tune["written"] is False and m.spec_tokens == 4
    after = {p.name: p.read_bytes() for p in bundle.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert after == before  # only manifest.json may change
    assert not list(bundle.glob("*.tmp"))

    # scripts/bench_md.py puts this run into BENCHMARKS.md's bench section, nothing else changes
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(
        "# B\n\n<!-- peers:begin -->\nPEERS\n<!-- peers:end -->\n\n<!-- bench:begin -->\nold\n<!-- bench:end -->\ntail\n"
    )
    import runpy

    bench_md = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "bench_md.py"))
    assert bench_md["main"]([str(out / "bench.json"), "--benchmarks-md", str(md)]) == 0
    text = md.read_text()
    assert "PEERS" in text and text.endswith("tail\n") and "old" not in text
    body = text.split("<!-- bench:begin -->")[1].split("<!-- bench:end -->")[0]
    assert "specedge bench" in body and "greedy    3" in body and "k ∈ [0, 1, 3]" in body


def test_replace_section_appends_a_missing_section_and_keeps_the_rest(tmp_path):
    from specedge.bench.report import replace_section

    md = tmp_path / "B.md"
    md.write_text("# B\n\n<!-- a:begin -->\nA\n<!-- a:end -->\n")
    replace_section(md, "b", "BODY", heading="## Section b")
    replace_section(md, "a", "A2")
    text = md.read_text()
    assert (
        text
        == "# B\n\n<!-- a:begin -->\nA2\n<!-- a:end -->\n\n## Section b\n\n<!-- b:begin -->\nBODY\n<!-- b:end -->\n"
    )
    assert not list(tmp_path.glob("*.tmp"))


def test_tune_manifest_writes_k_atomically(tiny_bundle, tmp_path):
    from specedge.bench.runner import tune_manifest
    from specedge.manifest import load_manifest

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle, bundle)
    assert tune_manifest(bundle, 6, {"reason": "test"}) == 4
    m = load_manifest(bundle, verify="full")
    assert m.spec_tokens == 6
    with pytest.raises(ValueError):
        tune_manifest(bundle, 0)


def test_cli_bench_bad_input(tiny_bundle, tmp_path, capsys):
    from specedge.cli.main import main

    assert main(["bench", str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own errors exit from the parser
        main(["bench", str(tiny_bundle), "--k", "0,x"])
    assert e.value.code == 2
    assert main(["bench", str(tiny_bundle), "--k", "0,20", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
    assert main(["bench", str(tiny_bundle), "--tune", "--k", "1,2", "--out", str(tmp_path / "o")]) == 2
    assert "k = 0" in capsys.readouterr().err


def test_cli_bench_default_output_is_outside_the_committed_results(tiny_bundle, tmp_path):
    """No --out: results go to ./specedge-bench/<bundle>_<drafter>/ in the current folder, never
    into the repository's benchmarks/results/."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    committed = {f: f.stat().st_mtime_ns for f in (repo / "benchmarks" / "results").rglob("*") if f.is_file()}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "specedge",
            "bench",
            str(tiny_bundle),
            "--quick",
            "--k",
            "0,2",
            "--max-new-tokens",
            "4",
            "--prompts-per-category",
            "1",
            "--categories",
            "code",
            "--modes",
            "greedy",
            "--threads",
            "1",
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "specedge-bench" / f"{tiny_bundle.resolve().name}_model"
    assert json.loads(p.stdout)["files"]["json"] == str(Path("specedge-bench") / out.name / "bench.json")
    validate_results(json.loads((out / "bench.json").read_text()))
    assert {f: f.stat().st_mtime_ns for f in (repo / "benchmarks" / "results").rglob("*") if f.is_file()} == committed
    assert p.stderr == ""  # --quiet: no progress line


def test_cli_bench_tree(tiny_bundle_factory, tiny_bundle, tmp_path, capsys):
    """--tree verifies trees of drafts: greedy tree output equals target-only on every prompt, the
    config says so, the default folder is apart from the chain's; a bundle without tree graphs
    is refused in one line before anything runs."""
    from specedge.cli.main import main

    assert main(["bench", str(tiny_bundle), "--tree", "--k", "0,2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "error: --tree needs a bundle exported with --tree" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()

    bundle = tiny_bundle_factory(draft="ngram", max_seq=128, tree=True)
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            str(bundle),
            "--tree",
            "--quick",
            "--k",
            "0,3",
            "--max-new-tokens",
            "16",
            "--prompts-per-category",
            "1",
            "--modes",
            "greedy",
            "--threads",
            "1",
            "--out",
            str(out),
            "--json",
            "--quiet",
            "--no-shared-pool",
        ]
    )
    assert rc == 0
    capsys.readouterr()
    res = json.loads((out / "bench.json").read_text())
    validate_results(res)
    assert res["config"]["tree"] is True
    spec = [r for r in res["runs"] if r["k"] == 3]
    assert spec and all(r["matches_target_only"] for r in spec)


def test_plot_shares_each_rows_scale_spans_the_rates_and_names_the_load():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from specedge.bench.plot import make_figure

    res = _synthetic_results()
    res["machine"]["load_avg_start"], res["machine"]["load_avg_end"] = [1.4, 1.0, 0.5], [7.0, 3.0, 1.0]
    fig = make_figure(res)
    try:
        top, bottom = fig.axes[: len(fig.axes) // 2], fig.axes[len(fig.axes) // 2 :]
        assert len(top) == len(CATEGORIES) + 1
        # one tokens/s scale across the categories, one acceptance scale
        assert len({ax.get_ylim() for ax in top}) == 1 and top[0].get_ylim()[0] == 0
        speeds = [y for ax in top for line in ax.get_lines() for y in line.get_ydata()]
        assert max(speeds) <= top[0].get_ylim()[1]
        assert len({ax.get_ylim() for ax in bottom}) == 1
        rates = [y for ax in bottom for line in ax.get_lines() for y in line.get_ydata() if y == y]
        lo, hi = bottom[0].get_ylim()
        assert lo <= min(rates) and max(rates) <= hi
        assert hi - lo < 1.5 * (max(rates) - min(rates)) + 0.05  # the measured span, not all of 0..1
        assert "load average 1.40 to 7.00 on 2 logical CPUs" in fig._suptitle.get_text()
    finally:
        plt.close(fig)
