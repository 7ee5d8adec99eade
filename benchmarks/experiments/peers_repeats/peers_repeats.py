"""Summarize repeated `bench_peers.py` runs (one folder per run, each with its peers.json): every
configuration's tokens/s per run and the median, and the issue's figures (each a ratio measured
within one run) per run and their median. Prints a markdown table; writes summary.json.

    for r in 1 2 3; do python scripts/bench_peers.py --threads 2 --max-new-tokens 128 \\
        --only "specedge,onnxruntime-genai fp32" --out benchmarks/experiments/peers_repeats/results/run$r; done
    python benchmarks/experiments/peers_repeats/peers_repeats.py benchmarks/experiments/peers_repeats/results
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", help="holds run*/peers.json")
    a = ap.parse_args()
    root = Path(a.folder)
    runs = [json.loads(p.read_text()) for p in sorted(root.glob("run*/peers.json"))]
    if not runs:
        raise SystemExit(f"no run*/peers.json under {root}")
    names = [r["name"] for r in runs[0]["results"] if r["status"] == "ok"]
    tok = {
        n: [
            next((r["tokens_per_s"] for r in run["results"] if r["name"] == n and r["status"] == "ok"), None)
            for run in runs
        ]
        for n in names
    }
    figs = {k: [run["figures"][k]["value"] for run in runs] for k in runs[0]["figures"]}
    summary = {
        "runs": [run["created"] for run in runs],
        "command": runs[0]["command"],
        "tokens_per_s": {
            n: {"runs": v, "median": statistics.median(x for x in v if x is not None)} for n, v in tok.items()
        },
        "figures": {
            k: {
                "what": runs[-1]["figures"][k]["what"],
                "target": runs[0]["figures"][k]["target"],
                "runs": v,
                "median": statistics.median(x for x in v if x is not None) if any(x is not None for x in v) else None,
            }
            for k, v in figs.items()
        },
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{len(runs)} runs: {', '.join(summary['runs'])}\n")
    print("| configuration | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median |")
    print("|---|" + "---:|" * (len(runs) + 1))
    for n, d in summary["tokens_per_s"].items():
        cells = " | ".join("–" if x is None else f"{x:.1f}" for x in d["runs"])
        print(f"| {n} | {cells} | **{d['median']:.1f}** |")
    print()
    for d in summary["figures"].values():
        if d["median"] is None:
            continue
        cells = ", ".join("–" if x is None else f"{x:.2f}×" for x in d["runs"])
        print(f"- {d['what']}: {cells}; median {d['median']:.2f}× (target {d['target']}×)")


if __name__ == "__main__":
    main()
