"""Draft heads against the training budget, and against the other drafters (issue 14).

    python scripts/head_eval.py acceptance BUNDLE... --out benchmarks/results/head/acceptance.json
    flock /work/bench.lock python scripts/head_eval.py speed BUNDLE --out benchmarks/results/head/speed.json

acceptance: each BUNDLE holds a head trained with another budget for the same target; every head
drafts greedily at k = 4 (chain, guard off, so every round drafts) over the bench suite, and the
script reports, per category and overall, the draft acceptance rate and the tokens per target call
(tokens / target calls), with the budget each head was trained with.

speed: on one bundle (fp32 target, its int4 self-draft and a head), one run alternating the
drafters prompt by prompt: target-only, n-gram, int4 self-draft and head, greedy, the default
guard; tok/s as the median over prompts and as ratios measured in the same run. Records the load
average. Every greedy output is checked against target-only (drafts are only proposals).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from specedge.bench.runner import load_prompts
from specedge.manifest import load_manifest
from specedge.runtime.api import load


def _suite(per_category: int | None):
    out, seen = [], {}
    for p in load_prompts():
        seen[p["category"]] = seen.get(p["category"], 0) + 1
        if per_category is None or seen[p["category"]] <= per_category:
            out.append(p)
    return out


def acceptance(bundles, args) -> dict:
    rows = []
    for b in bundles:
        m = load_manifest(b, verify="size")
        t = m.head.extra["training"]
        pipe = load(b, draft="head", threads=args.threads)
        per: dict[str, dict] = {}
        for p in _suite(args.per_category):
            r = pipe.generate(messages=p["messages"], max_new_tokens=args.max_new_tokens, spec_tokens=4, guard=False)
            s = r.stats
            c = per.setdefault(p["category"], {"tokens": 0, "target_calls": 0, "drafted": 0, "accepted": 0})
            for k in c:
                c[k] += int(s[k])
        pipe.close()
        tot = {k: sum(c[k] for c in per.values()) for k in ("tokens", "target_calls", "drafted", "accepted")}

        def summary(c):
            return {**c, "acceptance_rate": round(c["accepted"] / max(c["drafted"], 1), 4),
                    "tokens_per_target_call": round(c["tokens"] / max(c["target_calls"], 1), 3)}

        rows.append({"bundle": str(b), "budget": t.get("budget"), "training_tokens": t.get("tokens"),
                     "training_seconds": t.get("seconds"), "train_top1": t.get("top1"),
                     "data_tokens": t.get("data_tokens"), "draft_vocab": m.head.vocab_size,
                     "head_weight_bytes": m.head.weight_bytes, "target_weight_bytes": m.target.weight_bytes,
                     "overall": summary(tot), "per_category": {k: summary(v) for k, v in sorted(per.items())}})
        print(f"{t.get('tokens')} training tokens: {rows[-1]['overall']}", file=sys.stderr)
    return {"kind": "head_acceptance", "k": 4, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
            "guard": False, "results": rows}


def speed(bundle, args) -> dict:
    modes = {"target-only": ("ngram", False), "ngram": ("ngram", True), "int4-self-draft": ("model", True),
             "head": ("head", True)}
    pipes = {name: load(bundle, draft=d, threads=args.threads, shared_pool=True) for name, (d, _) in modes.items()}
    tps: dict[str, list[float]] = {n: [] for n in modes}
    calls: dict[str, list[float]] = {n: [] for n in modes}
    mismatches = []
    load_before = os.getloadavg()
    t0 = time.time()
    for p in _suite(args.per_category):
        ref = None
        for name, (_, spec) in modes.items():
            r = pipes[name].generate(messages=p["messages"], max_new_tokens=args.max_new_tokens, speculative=spec)
            tps[name].append(r.stats["tokens_per_s"])
            calls[name].append(r.stats["tokens"] / max(r.stats["target_calls"], 1) if spec else 1.0)
            if ref is None:
                ref = r.token_ids
            elif r.token_ids != ref:
                mismatches.append({"prompt": p["id"], "mode": name})
    med = {n: statistics.median(v) for n, v in tps.items()}
    m = load_manifest(bundle, verify="size")
    return {"kind": "head_speed", "bundle": str(bundle), "threads": args.threads, "max_new_tokens": args.max_new_tokens,
            "prompts": len(tps["head"]), "seconds": round(time.time() - t0, 1),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "head_training": m.head.extra["training"],
            "median_tokens_per_s": {n: round(v, 2) for n, v in med.items()},
            "mean_tokens_per_target_call": {n: round(statistics.mean(v), 3) for n, v in calls.items()},
            "ratio_head_vs_int4_self_draft": round(med["head"] / med["int4-self-draft"], 3),
            "ratio_head_vs_target_only": round(med["head"] / med["target-only"], 3),
            "ratio_head_vs_ngram": round(med["head"] / med["ngram"], 3),
            "outputs_differing_from_target_only": mismatches}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("acceptance", "speed"))
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--per-category", type=int, default=None, help="first N prompts of each category (default all)")
    args = ap.parse_args(argv)
    res = acceptance(args.bundles, args) if args.what == "acceptance" else speed(args.bundles[0], args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res.get("median_tokens_per_s") or [r["overall"] for r in res["results"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
