"""How fast train-draft's two answer writers are on one bundle (issue 14).

    python benchmarks/experiments/heads/answer_writers.py BUNDLE [--prompts 20] [--repeats 2] --out benchmarks/experiments/heads/results/answer_writers.json

`--answers-by draft` (the bundle's draft graph alone, greedy, T = 1 steps) against `--answers-by
target` (the bundle's runtime with its default drafter, as train-draft uses it), alternated, on
every 37th training prompt, 160 new tokens each, 2 threads. Wall seconds include loading each
writer, as train-draft's do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from specedge.manifest import load_manifest  # noqa: E402
from specedge.training.data import generate_answers, write_with_draft  # noqa: E402
from specedge.training.prompts import training_prompts  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    m = load_manifest(a.bundle)
    prompts = training_prompts()[::37][: a.prompts]
    say = lambda d, t: None  # noqa: E731
    runs: dict[str, list[dict]] = {"draft": [], "target": []}
    load_before = os.getloadavg()
    for _ in range(a.repeats):
        for name in runs:
            t0 = time.perf_counter()
            out = (
                write_with_draft(m, prompts, 160, 2, say)
                if name == "draft"
                else generate_answers(a.bundle, prompts, 160, 2, say)
            )
            runs[name].append({"seconds": round(time.perf_counter() - t0, 2), "tokens": sum(len(x[1]) for x in out)})
    med = {n: statistics.median(r["seconds"] for r in v) for n, v in runs.items()}
    res = {
        "kind": "answer_writers",
        "bundle": str(a.bundle),
        "prompts": len(prompts),
        "max_new_tokens": 160,
        "threads": 2,
        "draft": m.draft.precision,
        "runs": runs,
        "median_seconds": med,
        "target_over_draft": round(med["target"] / med["draft"], 3),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: res[k] for k in ("median_seconds", "target_over_draft")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
