"""Is greedy speculation exact on a bundle's target? For each of the bench suite's 20 prompts
(specedge/bench/prompts.json, chat template, greedy, --max-new-tokens), decode target-only and
speculatively with each drafter the bundle has, with the target's single-token steps plain
(T = 1) and batch-invariant (T = 2, runtime/invariant.py), or as the bundle chooses (auto: plain
steps on a graph marked batch_invariant and confirmed at load, padded ones on other quantized
targets), and compare every speculative output
token for token with the target-only output of the same mode. Also reports decode tokens/s per
configuration and prompt category (one run, 2 threads, guard on: what an application gets), so
the guard's figure (every drafter >= 0.97x target-only per category) comes from the same run.

    python benchmarks/experiments/int4/int4_exactness.py BUNDLE [--max-new-tokens 128] > benchmarks/experiments/int4/results/int4_exactness.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from specedge.bench.runner import load_prompts  # noqa: E402
from specedge.runtime.api import load  # noqa: E402


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode(pipe, prompts, n, speculative):
    pipe.generate(token_ids=prompts[0]["ids"], max_new_tokens=16, speculative=speculative)  # warm-up
    out = []
    for p in prompts:
        r = pipe.generate(token_ids=p["ids"], max_new_tokens=n, speculative=speculative)
        out.append(
            {
                "id": p["id"],
                "category": p["category"],
                "tokens": list(r.token_ids),
                "decode_s": r.stats["decode_s"],
                "fallbacks": r.stats.get("fallbacks", 0),
            }
        )
    return out


def tps(recs, category=None):
    sel = [r for r in recs if category in (None, r["category"])]
    toks = sum(max(len(r["tokens"]) - 1, 0) for r in sel)
    secs = sum(r["decode_s"] for r in sel)
    return round(toks / secs, 1) if secs > 0 else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="plain,invariant", help="subset of plain,invariant,auto")
    args = ap.parse_args(argv)
    out = {
        "bundle": args.bundle,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "load_avg_start": os.getloadavg()[0],
        "modes": {},
    }
    suite = None
    for mode in args.modes.split(","):
        inv = {"plain": False, "invariant": True, "auto": None}[mode]
        drafters = ["ngram"]
        probe = load(
            args.bundle, threads=args.threads, verify="size", invariant_steps=inv, draft="ngram", shared_pool=True
        )
        res_steps = "padded (T = 2)" if probe.describe()["target"].get("invariant_steps") else "plain (T = 1)"
        if probe.manifest.draft.is_model:
            drafters.append("model")
        if suite is None:
            suite = [
                {"id": p["id"], "category": p["category"], "ids": probe.tokenizer.encode_chat(p["messages"])}
                for p in load_prompts()
            ]
        ref = decode(probe, suite, args.max_new_tokens, False)
        res = {"single_token_steps": res_steps, "target-only": {"tokens_per_s": tps(ref), "per_category": {}}}
        cats = sorted({p["category"] for p in suite})
        for c in cats:
            res["target-only"]["per_category"][c] = tps(ref, c)
        probe.close()
        for d in drafters:
            pipe = load(
                args.bundle, threads=args.threads, verify="size", invariant_steps=inv, draft=d, shared_pool=True
            )
            spec = decode(pipe, suite, args.max_new_tokens, True)
            pipe.close()
            diffs = {r["id"]: first_diff(r["tokens"], s["tokens"]) for r, s in zip(ref, spec)}
            row = {
                "equal_prompts": sum(v is None for v in diffs.values()),
                "prompts": len(suite),
                "first_diff": {k: v for k, v in diffs.items() if v is not None},
                "tokens_per_s": tps(spec),
                "per_category": {},
                "fallbacks": sum(s["fallbacks"] for s in spec),
            }
            for c in cats:
                t, base = tps(spec, c), res["target-only"]["per_category"][c]
                row["per_category"][c] = {
                    "tokens_per_s": t,
                    "vs_target_only": round(t / base, 3) if t and base else None,
                }
            res[f"speculative ({d})"] = row
            print(mode, d, {k: row[k] for k in ("equal_prompts", "tokens_per_s")}, file=sys.stderr, flush=True)
        out["modes"][mode] = res
    out["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
