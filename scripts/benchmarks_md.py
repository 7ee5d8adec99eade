#!/usr/bin/env python
"""Write the whole of BENCHMARKS.md from the committed result files: the machine, the headline
table (bench_peers), the k sweep (specedge bench), the int4 target's quality (bench_quality), native
vs Python, serving, the GPU section, draft heads and trees, each with its date, load and command.
Nothing is typed by hand; how the figures evolved lives in benchmarks/history/.

    python scripts/benchmarks_md.py [--results benchmarks/results] [--out BENCHMARKS.md]

Each section keeps its `<!-- name:begin -->` / `<!-- name:end -->` markers, so the writer of one
section (bench_peers.py, bench_md.py, gpu_md.py, serve_load.py, ...) can still replace it alone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _load(path: Path):
    """A script that is not a package, as a module (its own folder on sys.path for its imports)."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rel(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _load_avg(x) -> str:
    v = x[0] if isinstance(x, list) else x
    return f"{v:.1f}" if isinstance(v, (int, float)) else "?"


def machine(peers: dict) -> str:
    m = peers["machine"]
    return (
        f"{m['cpu']}, {m['cores']} cores / {m['logical_cpus']} logical CPUs, {m['memory_gb']} GB, {m['platform']}; "
        f"Python {m['python']}, onnxruntime {m['onnxruntime']}, numpy {m['numpy']} (from `{peers['json']}`). "
        "Every CPU figure below was measured on this machine unless its line names another CPU; the GPU section names its own device. "
        "A load average above the thread count means other jobs shared the CPUs: compare ratios measured "
        "within one run, not absolute tokens/s across sections."
    )


def read_bandwidth(peers: dict, path: Path) -> str:
    """The target-only rows' achieved weight bandwidth against the machine's measured read bandwidth."""
    if not path.exists():
        return ""
    rb = _read(path)
    ceiling = rb["read_gb_s"]
    rows = [
        r
        for r in peers["results"]
        if r["status"] == "ok" and r["drafter"] is None and r.get("bandwidth_gb_s") and r["engine"] == "specedge"
    ]
    parts = [f"{r['name']} {r['bandwidth_gb_s']:.1f} GB/s ({r['bandwidth_gb_s'] / ceiling:.0%})" for r in rows]
    return (
        f"Achieved weight bandwidth of the target-only steps against the machine's read bandwidth, "
        f"{ceiling:.1f} GB/s with {rb['threads']} threads (measured {rb['created']}, load "
        f"{_load_avg(rb['machine']['load_avg_start'])}; `{rb['command']}`, JSON: `{_rel(path)}`): "
        + "; ".join(parts)
        + "."
    )


def headline(bp, peers: Path, bandwidth: Path) -> str:
    """Each engine's best configurations, fp32 and int4, from one bench_peers run, and the target-only
    steps' bandwidth against the machine's."""
    res = _read(peers)
    res["json"] = _rel(peers)
    return bp.markdown(res) + "\n\n" + read_bandwidth(res, bandwidth)


def native(path: Path) -> str:
    r = _read(path)
    n, py = r["median"]["native"], r["median"]["python"]
    k = len(r["runs"]["native"])
    rows = [
        f"| figure (median of {k} runs each) | native `specedge_generate` | Python `specedge generate` | native ÷ Python |",
        "|---|---:|---:|---:|",
    ]
    for label, key, spec in (
        ("decode tokens/s", "tokens_per_s", ".1f"),
        ("process start → first text (s)", "first_text_s", ".2f"),
        ("peak RSS (MiB)", "peak_rss_mib", ".0f"),
    ):
        rows.append(f"| {label} | {n[key]:{spec}} | {py[key]:{spec}} | {n[key] / py[key]:.2f}× |")
    return (
        f"Prompt `{r['prompt']}`, greedy, speculative, {r['max_new_tokens']} new tokens, {r['threads']} threads, "
        f"bundle `{Path(r['bundle']).name}`; load average {_load_avg(r['load_avg_start'])} → "
        f"{_load_avg(r['load_avg_end'])}. Command: `python cpp/tools/bench_native_vs_python.py --repeats {k} "
        f"--benchmarks-md BENCHMARKS.md` (JSON: `{_rel(path)}`).\n\n" + "\n".join(rows)
    )


def trees(path: Path) -> str:
    r = _read(path)
    lines = [
        f"Measured {r['created']}, {r['prompts']} prompts, {r['max_new_tokens']} new tokens, {r['threads']} threads, "
        f"temperature {r['temperature']}, load average {_load_avg(r['load_avg_start'])} → "
        f"{_load_avg(r['load_avg_end'])}. Command: `{r['command']}`, its bundle the default model exported with "
        f"`--tree` (JSON: `{_rel(path)}`)." + (f" {r['note']}" if r.get("note") else ""),
        "",
        "| configuration | tok/s | tokens per target call | mismatches with target-only |",
        "|---|---:|---:|---:|",
    ]
    for name, c in r["configurations"].items():
        tps, tpc = c.get("tokens_per_s"), c.get("tokens_per_call")
        lines.append(
            f"| {name} | {tps if tps is not None else '–'} | {tpc if tpc is not None else '–'} | "
            f"{'–' if c.get('mismatches') is None else c['mismatches']} |"
        )
    return "\n".join(lines)


HEADER = """# Benchmarks

Current figures only, written by `python scripts/benchmarks_md.py` from the JSON files under
benchmarks/results/ (each section names its file and the command that wrote it). How the figures
evolved and what the experiments decided: benchmarks/history/. How to reproduce: docs/benchmarks.md.
"""


def _section(name: str, heading: str, body: str) -> str:
    return f"## {heading}\n\n<!-- {name}:begin -->\n{body.strip()}\n<!-- {name}:end -->\n"


def render(results: Path) -> str:
    bp = _load(ROOT / "scripts" / "bench_peers.py")
    bench_md = _load(ROOT / "scripts" / "bench_md.py")
    gpu_md = _load(ROOT / "scripts" / "gpu_md.py")
    serve = _load(ROOT / "scripts" / "serve_load.py")
    head_eval = _load(ROOT / "benchmarks" / "experiments" / "heads" / "head_eval.py")
    bench_quality = _load(ROOT / "scripts" / "bench_quality.py")
    peers = results / "peers" / "peers.json"
    serve_json = results / "serve" / "smollm2-135m-instruct.json"
    quality = results / "quality" / "quality.json"
    head = results / "head"
    tree_runs = sorted((results / "tree").glob("smollm2-135m-instruct_run*.json"))
    parts = [
        HEADER,
        _section("machine", "Machine", machine({**_read(peers), "json": _rel(peers)})),
        _section(
            "peers",
            "specedge against the field (`scripts/bench_peers.py`)",
            headline(bp, peers, results / "machine" / "read_bandwidth.json"),
        ),
        _section(
            "bench",
            "`specedge bench` (k sweep on the default bundle)",
            bench_md.section(Path(_rel(results / "smollm2-135m-instruct_model" / "bench.json"))),
        ),
        _section(
            "quality",
            "What the int4 target trades: agreement with fp32 and perplexity (`scripts/bench_quality.py`)",
            bench_quality.markdown(_read(quality), _rel(quality)),
        ),
        _section("native", "Native (C++) vs Python runtime", native(results / "native_vs_python.json")),
        _section("serve", "Serving (`specedge serve`)", serve.md_section(_read(serve_json), _rel(serve_json))),
        _section("gpu", "GPU: torch backend on an NVIDIA H200", gpu_md.section(results / "gpu")),
        _section(
            "head",
            "Draft heads",
            head_eval.markdown(
                [_rel(p) for p in sorted(head.glob("acceptance_*.json"))] + [_rel(head / "speed_int4.json")]
            ),
        ),
    ]
    # the newest greedy run (outputs compared with target-only) and the newest sampled one
    newest = {}
    for p in sorted(tree_runs, key=lambda p: _read(p)["created"]):
        newest[bool(_read(p).get("temperature"))] = p
    if newest:
        body = "\n\n".join(trees(newest[key]) for key in (False, True) if key in newest)
        parts.append(_section("trees", "Tree verification", body))
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    a = ap.parse_args(argv)
    if not a.results.is_dir():
        print(f"error: --results {a.results}: not a folder", file=sys.stderr)
        return 2
    with contextlib.chdir(ROOT):  # the section writers name their files relative to the repository
        text = render(a.results.resolve())
    a.out.write_text(text, encoding="utf-8")
    print(f"wrote {a.out} ({len(text.splitlines())} lines)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
