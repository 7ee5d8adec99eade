"""Does the speculation guard keep every drafter within 3% of target-only, per prompt category?

For each bundle given, one pipeline per drafter the bundle has (n-gram always, its draft model and
its trained draft head when it has them); every prompt of the bench suite
(specedge/bench/prompts.json, chat template, greedy, --max-new-tokens) is decoded target-only and with each drafter back to back, the order rotated per
prompt and the whole suite --repeats times, so machine-load drift hits every configuration alike
(each configuration in its own run, minutes apart, is what made the peers table's 0.87x on code).
Target-only runs on the n-gram pipeline with speculation off: the same sessions.

Per category and configuration: decode tok/s (total decode tokens / total decode seconds), the
ratio to target-only, and what the guard did (rounds, fallbacks and their tokens, k histogram,
acceptance, draft/verify/other seconds); per pipeline the learned step costs c(T).

    python benchmarks/experiments/self_draft/guard_categories.py BUNDLE [BUNDLE ...] [--repeats 2] > benchmarks/experiments/self_draft/results/guard_categories.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from specedge.bench.runner import load_average, load_prompts, parse_categories, select_prompts  # noqa: E402
from specedge.runtime.api import load  # noqa: E402

GUARD_KEYS = (
    "fallbacks",
    "fallback_tokens",
    "k_shrinks",
    "target_calls",
    "drafted",
    "accepted",
    "time_draft_s",
    "time_verify_s",
    "time_other_s",
)


def measure_bundle(
    bundle: str,
    prompts_per_category: int | None,
    n: int,
    threads: int,
    repeats: int,
    categories: list[str] | None = None,
) -> dict:
    pipes = {"ngram": load(bundle, threads=threads, verify="size", draft="ngram", shared_pool=True)}
    if pipes["ngram"].manifest.draft.is_model:
        pipes["model"] = load(bundle, threads=threads, verify="size", draft="model", shared_pool=True)
    if pipes["ngram"].manifest.head is not None:  # a trained draft head (train-draft)
        pipes["head"] = load(bundle, threads=threads, verify="size", draft="head", shared_pool=True)
    tok = pipes["ngram"].tokenizer
    suite = [
        {"id": p["id"], "category": p["category"], "ids": tok.encode_chat(p["messages"])}
        for p in select_prompts(load_prompts(), prompts_per_category, categories)
    ]
    # configuration name -> (pipeline, speculative)
    configs = {"target-only": (pipes["ngram"], False)}
    configs.update({f"speculative ({d})": (p, True) for d, p in pipes.items()})
    names = list(configs)
    for pipe, spec in configs.values():  # warm-up: every shape once
        pipe.generate(token_ids=suite[0]["ids"], max_new_tokens=16, speculative=spec)
    recs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(repeats):
        for i, p in enumerate(suite):
            shift = (i + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                pipe, spec = configs[name]
                r = pipe.generate(token_ids=p["ids"], max_new_tokens=n, speculative=spec)
                st = r.stats
                rec = {
                    "id": p["id"],
                    "category": p["category"],
                    "repeat": rep,
                    "tokens": len(r.token_ids),
                    "decode_s": st["decode_s"],
                    "k_histogram": st.get("k_histogram", {}),
                }
                rec.update({k: st.get(k, 0) or 0 for k in GUARD_KEYS})
                recs[name].append(rec)
    cats = sorted({p["category"] for p in suite})
    out = {
        "bundle": bundle,
        "target_precision": pipes["ngram"].manifest.target.precision,
        # padded single-token steps, as the pipeline chose them (a batch-invariant graph runs unpadded)
        "invariant_steps": bool(pipes["ngram"].describe()["target"].get("invariant_steps")),
        "k": pipes["ngram"].manifest.spec_tokens,
        "prompts": len(suite),
        "repeats": repeats,
        "configurations": {},
        "step_costs_ms": {},
    }
    for name in names:
        row = {"tokens_per_s": tps(recs[name]), "per_category": {}}
        for c in cats:
            sel = [r for r in recs[name] if r["category"] == c]
            cell = {"tokens_per_s": tps(sel)}
            base = tps([r for r in recs["target-only"] if r["category"] == c])
            cell["vs_target_only"] = round(cell["tokens_per_s"] / base, 3) if base and cell["tokens_per_s"] else None
            if name != "target-only":
                cell.update({k: round(sum(r[k] for r in sel), 4) for k in GUARD_KEYS})
                hist: dict[str, int] = {}
                for r in sel:
                    for k, v in r["k_histogram"].items():
                        hist[k] = hist.get(k, 0) + v
                cell["k_histogram"] = hist
                cell["min_prompt_vs_target_only"] = min_prompt_ratio(recs["target-only"], sel)
            row["per_category"][c] = cell
        row["min_vs_target_only"] = min(
            (v["vs_target_only"] for v in row["per_category"].values() if v["vs_target_only"] is not None), default=None
        )
        out["configurations"][name] = row
    for d, p in pipes.items():
        out["step_costs_ms"][d] = {
            "target": {str(t): round(1000 * s, 3) for t, s in sorted(p.costs.target.items())},
            "draft": round(1000 * p.costs.draft, 4),
        }
        p.close()
    return out


def tps(recs: list[dict]) -> float | None:
    toks = sum(max(r["tokens"] - 1, 0) for r in recs)
    secs = sum(r["decode_s"] for r in recs)
    return round(toks / secs, 2) if secs > 0 else None


def min_prompt_ratio(base: list[dict], spec: list[dict]) -> float | None:
    """The lowest per-prompt ratio (repeats pooled): where a single prompt loses."""
    ratios = []
    for pid in sorted({r["id"] for r in spec}):
        a, b = tps([r for r in base if r["id"] == pid]), tps([r for r in spec if r["id"] == pid])
        if a and b:
            ratios.append(b / a)
    return round(min(ratios), 3) if ratios else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts-per-category", type=int, default=None)
    ap.add_argument("--categories", default=None, help="comma-separated prompt categories (default all)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        return 2
    try:
        cats = parse_categories(args.categories)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = {
        "schema": "specedge.bench.guard_categories/1",
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python benchmarks/experiments/self_draft/guard_categories.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "load_avg_start": load_average(),
        "bundles": [],
    }
    for b in args.bundles:
        res["bundles"].append(
            measure_bundle(b, args.prompts_per_category, args.max_new_tokens, args.threads, args.repeats, cats)
        )
        print(
            b,
            {n: c["min_vs_target_only"] for n, c in res["bundles"][-1]["configurations"].items()},
            file=sys.stderr,
            flush=True,
        )
    res["load_avg_end"] = load_average()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
