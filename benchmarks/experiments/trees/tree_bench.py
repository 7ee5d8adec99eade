"""Tree vs chain verification on one bundle exported with --tree, and what the tree graph costs chains.

Every prompt of the bench suite (specedge/bench/prompts.json, chat template, greedy,
--max-new-tokens) is decoded by each configuration back to back, the order rotated per prompt,
so machine-load drift hits all alike:

* target-only on the tree bundle and, with --plain, on the same model's plain bundle (the tree
  graph's chain speed: the tree_mask input bound to the lower triangle);
* per drafter (n-gram; the bundle's draft model; its draft head when it has one): the chain round and the tree round, and with
  --plain the chain round on the plain bundle.

Per configuration: decode tok/s, tokens per target call, per category the same plus the ratio
to the chain round it replaces; the learned step costs c(T) per pipeline. Greedy outputs of every
configuration must agree with target-only (reported as `mismatches`). With --temperature > 0 every
configuration samples (outputs then differ legitimately, so `mismatches` is null): with --seed S,
prompt i with seed S + i in every configuration (a seeded request is reproducible, so its guard
learns nothing across requests and judges trees afresh in each); without, with fresh entropy,
as an unseeded server request (the guard carries its verdicts across requests). With --no-guard
every round speculates and trees stay on: the raw comparison, whose tree rounds do not depend on
the timings the guard judges by (on a tiny model a draft step costs about a target step, so the
guard may rightly drop speculation there).

    flock /work/bench.lock python benchmarks/experiments/trees/tree_bench.py TREE_BUNDLE --plain PLAIN_BUNDLE \
        > benchmarks/results/tree/smollm2-135m-instruct.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from specedge.bench.runner import load_average, load_prompts, parse_categories, select_prompts  # noqa: E402
from specedge.bench.stats import decode_target_calls  # noqa: E402
from specedge.runtime.api import load  # noqa: E402


def tps(recs: list[dict]) -> float | None:
    toks = sum(max(r["tokens"] - 1, 0) for r in recs)
    secs = sum(r["decode_s"] for r in recs)
    return round(toks / secs, 2) if secs > 0 else None


def per_call(recs: list[dict]) -> float | None:
    """Decode tokens per target forward pass: verification calls and the plain steps the guard
    ran in their place alike (runs 1 and 2 divided by verification calls only, which made a run
    that fell back to plain steps look better than it was)."""
    calls = sum(decode_target_calls(r["tokens"], r["accepted"], r["target_calls"]) for r in recs)
    return round(sum(max(r["tokens"] - 1, 0) for r in recs) / calls, 3) if calls else None


def per_verification(recs: list[dict]) -> float | None:
    """Tokens per verification call (accepted drafts + the target's own), plain steps left out."""
    calls = sum(r["target_calls"] for r in recs)
    return round((sum(r["accepted"] for r in recs) + calls) / calls, 3) if calls else None


def configurations(tree_bundle: str, plain: str | None, threads: int) -> dict:
    """name -> (pipeline, generate kwargs)."""

    def pipe(bundle, draft):
        return load(bundle, threads=threads, verify="size", draft=draft, shared_pool=True)

    tree_pipes = {"ngram": pipe(tree_bundle, "ngram")}
    if tree_pipes["ngram"].manifest.draft.is_model:
        tree_pipes["model"] = pipe(tree_bundle, "model")
    if tree_pipes["ngram"].manifest.head is not None:  # a trained draft head (train-draft)
        tree_pipes["head"] = pipe(tree_bundle, "head")
    configs = {"target-only (tree graph)": (tree_pipes["ngram"], {"speculative": False})}
    plain_pipes = {}
    if plain:
        plain_pipes = {d: pipe(plain, d) for d in tree_pipes if d != "head"}  # a plain bundle has no head
        configs["target-only (plain graph)"] = (plain_pipes["ngram"], {"speculative": False})
    for d, p in tree_pipes.items():
        configs[f"chain ({d})"] = (p, {})
        configs[f"tree ({d})"] = (p, {"tree": True})
        if d in plain_pipes:
            configs[f"chain ({d}, plain graph)"] = (plain_pipes[d], {})
    return configs


def measure(
    tree_bundle: str,
    plain: str | None,
    n: int,
    threads: int,
    per_category: int | None,
    temperature: float = 0.0,
    seed: int | None = None,
    categories: list[str] | None = None,
    guard: bool = True,
) -> dict:
    configs = configurations(tree_bundle, plain, threads)
    first = next(iter(configs.values()))[0]
    tok = first.tokenizer
    suite = [
        {"id": p["id"], "category": p["category"], "ids": tok.encode_chat(p["messages"])}
        for p in select_prompts(load_prompts(), per_category, categories)
    ]
    names = list(configs)
    # generate() keywords every configuration shares
    request = {"temperature": temperature, "seed": seed} if temperature > 0 else {}
    if not guard:
        request["guard"] = False
    for p, kw in configs.values():  # warm-up: every shape once
        p.generate(token_ids=suite[0]["ids"], max_new_tokens=16, **kw, **request)
    recs: dict[str, list[dict]] = {name: [] for name in names}
    outputs: dict[str, dict] = {name: {} for name in names}
    for i, pr in enumerate(suite):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            p, kw = configs[name]
            if temperature > 0 and seed is not None:
                request["seed"] = seed + i  # every configuration draws from the same seed on a prompt
            r = p.generate(token_ids=pr["ids"], max_new_tokens=n, **kw, **request)
            st = r.stats
            outputs[name][pr["id"]] = r.token_ids
            recs[name].append(
                {
                    "id": pr["id"],
                    "category": pr["category"],
                    "tokens": len(r.token_ids),
                    "decode_s": st["decode_s"],
                    "target_calls": st.get("target_calls") or 0,
                    "drafted": st.get("drafted", 0) or 0,
                    "accepted": st.get("accepted", 0) or 0,
                    "fallbacks": st.get("fallbacks", 0) or 0,
                    "tree_rounds": st.get("tree_rounds", 0),
                    "trees_off": bool(st.get("trees_off", False)),
                }
            )
    base = "target-only (tree graph)"
    cats = sorted({p["category"] for p in suite})
    out = {
        "bundle": tree_bundle,
        "plain_bundle": plain,
        "prompts": len(suite),
        "temperature": temperature,
        "seed": seed if temperature > 0 else None,
        "guard": guard,
        "configurations": {},
        "step_costs_ms": {},
    }
    for name in names:
        chain = name.replace("tree (", "chain (") if name.startswith("tree (") else None
        row = {
            "tokens_per_s": tps(recs[name]),
            "tokens_per_call": per_call(recs[name]),
            "tokens_per_verification": per_verification(recs[name]),
            "mismatches": None
            if temperature > 0
            else sum(outputs[name][pid] != outputs[base][pid] for pid in outputs[base]),
            "drafted": sum(r["drafted"] for r in recs[name]),
            "accepted": sum(r["accepted"] for r in recs[name]),
            "fallbacks": sum(r["fallbacks"] for r in recs[name]),
            "tree_rounds": sum(r["tree_rounds"] for r in recs[name]),
            "requests_with_trees_off": sum(r["trees_off"] for r in recs[name]),
            "per_category": {},
        }
        for c in cats:
            sel = [r for r in recs[name] if r["category"] == c]
            cell = {"tokens_per_s": tps(sel), "tokens_per_call": per_call(sel)}
            if chain:
                ref = [r for r in recs[chain] if r["category"] == c]
                a, b = tps(ref), cell["tokens_per_s"]
                cell["vs_chain"] = round(b / a, 3) if a and b else None
                pa, pb = per_call(ref), cell["tokens_per_call"]
                cell["calls_vs_chain"] = round(pb / pa, 3) if pa and pb else None
            row["per_category"][c] = cell
        if chain:
            row["vs_chain"] = round(row["tokens_per_s"] / tps(recs[chain]), 3)
            row["tokens_per_call_vs_chain"] = round(row["tokens_per_call"] / per_call(recs[chain]), 3)
        out["configurations"][name] = row
    seen = set()
    for p, _ in configs.values():
        if id(p) in seen:
            continue
        seen.add(id(p))
        key = f"{p.manifest.root.name} / {p.generator.drafter.kind if p.generator.drafter else '-'}"
        out["step_costs_ms"][key] = {str(t): round(1000 * s, 3) for t, s in sorted(p.costs.target.items())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", help="a bundle exported with --tree")
    ap.add_argument("--plain", default=None, help="the same model's bundle without --tree (chain speed on it)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts-per-category", type=int, default=None)
    ap.add_argument("--categories", default=None, help="comma-separated prompt categories (default all)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="with --temperature: prompt i samples with seed + i (default: fresh entropy)",
    )
    ap.add_argument(
        "--no-guard",
        action="store_true",
        help="every round speculates, trees included (the guard neither shrinks k, falls back nor "
        "turns trees off): the raw tree-vs-chain comparison, and a run whose tree rounds do "
        "not hang on the machine's timings",
    )
    args = ap.parse_args(argv)
    if not args.temperature >= 0 or args.temperature == float("inf"):
        print(f"error: --temperature must be a finite number >= 0, got {args.temperature}", file=sys.stderr)
        return 2
    try:
        cats = parse_categories(args.categories)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = {
        "schema": "specedge.bench.tree/1",
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python benchmarks/experiments/trees/tree_bench.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "load_avg_start": load_average(),
    }
    res.update(
        measure(
            args.bundle,
            args.plain,
            args.max_new_tokens,
            args.threads,
            args.prompts_per_category,
            args.temperature,
            args.seed,
            cats,
            guard=not args.no_guard,
        )
    )
    res["load_avg_end"] = load_average()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
