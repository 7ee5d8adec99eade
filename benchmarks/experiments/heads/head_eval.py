"""Draft heads against the training budget, and against the other drafters (issue 14).

    python benchmarks/experiments/heads/head_eval.py acceptance BUNDLE... --out benchmarks/results/head/acceptance.json
    flock /work/bench.lock python benchmarks/experiments/heads/head_eval.py speed BUNDLE --out benchmarks/experiments/heads/results/speed.json
    python benchmarks/experiments/heads/head_eval.py markdown benchmarks/results/head/acceptance.json benchmarks/experiments/heads/results/speed.json \
        [benchmarks/experiments/heads/results/diagnose*.json] --out BENCHMARKS.md

acceptance: each BUNDLE holds a head trained with another budget for the same target; every head
drafts greedily at k = 4 (chain, guard off, so every round drafts) over the bench suite, and the
script reports, per category and overall, the draft acceptance rate and the tokens per target call
(tokens / target calls), with the budget each head was trained with.

speed: on one bundle (fp32 target, its int4 self-draft and a head; or an int4 target with a head,
whose bundle has no self-draft), one run alternating the drafters prompt by prompt: target-only,
n-gram, int4 self-draft (when there is one) and head, greedy, the default
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
            return {
                **c,
                "acceptance_rate": round(c["accepted"] / max(c["drafted"], 1), 4),
                "tokens_per_target_call": round(c["tokens"] / max(c["target_calls"], 1), 3),
            }

        rows.append(
            {
                "bundle": str(b),
                "budget": t.get("budget"),
                "training_tokens": t.get("tokens"),
                "training_seconds": t.get("seconds"),
                "train_top1": t.get("top1"),
                "data_tokens": t.get("data_tokens"),
                "draft_vocab": m.head.vocab_size,
                "soft_labels": t.get("soft_labels", 0),
                "train_dtype": t.get("train_dtype", "fp32"),
                "target_precision": m.target.precision,
                "head_weight_bytes": m.head.weight_bytes,
                "target_weight_bytes": m.target.weight_bytes,
                "overall": summary(tot),
                "per_category": {k: summary(v) for k, v in sorted(per.items())},
            }
        )
        print(f"{t.get('tokens')} training tokens: {rows[-1]['overall']}", file=sys.stderr)
    return {
        "kind": "head_acceptance",
        "k": 4,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "guard": False,
        "results": rows,
    }


def speed(bundle, args) -> dict:
    m = load_manifest(bundle, verify="size")
    modes = {
        "target-only": ("ngram", False),
        "ngram": ("ngram", True),
        "int4-self-draft": ("model", True),
        "head": ("head", True),
    }
    if m.draft is None or not m.draft.is_model:  # e.g. an int4 target, whose auto draft is n-gram
        del modes["int4-self-draft"]
    pipes = {name: load(bundle, draft=d, threads=args.threads, shared_pool=True) for name, (d, _) in modes.items()}
    tps: dict[str, list[float]] = {n: [] for n in modes}
    calls: dict[str, list[float]] = {n: [] for n in modes}
    fallbacks: dict[str, list[int]] = {n: [] for n in modes}
    clock = {n: [0.0, 0.0] for n in modes}  # seconds drafting, seconds in target calls
    mismatches = []
    load_before = os.getloadavg()
    t0 = time.time()
    for p in _suite(args.per_category):
        ref = None
        for name, (_, spec) in modes.items():
            r = pipes[name].generate(messages=p["messages"], max_new_tokens=args.max_new_tokens, speculative=spec)
            tps[name].append(r.stats["tokens_per_s"])
            # per verification call (tokens / target_calls would count the guard's target-only steps as free)
            calls[name].append(r.stats["mean_accepted"] if spec and r.stats["target_calls"] else 1.0)
            fallbacks[name].append(int(r.stats.get("fallbacks", 0)))
            clock[name][0] += float(r.stats.get("time_draft_s", 0.0))
            clock[name][1] += float(r.stats.get("time_verify_s", 0.0))
            if ref is None:
                ref = r.token_ids
            elif r.token_ids != ref:
                mismatches.append({"prompt": p["id"], "mode": name})
    med = {n: statistics.median(v) for n, v in tps.items()}
    return {
        "kind": "head_speed",
        "bundle": str(bundle),
        "target_precision": m.target.precision,
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(tps["head"]),
        "seconds": round(time.time() - t0, 1),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "head_training": m.head.extra["training"],
        "median_tokens_per_s": {n: round(v, 2) for n, v in med.items()},
        "mean_tokens_per_verify_call": {n: round(statistics.mean(v), 3) for n, v in calls.items()},
        "guard_fallbacks": {n: sum(v) for n, v in fallbacks.items()},
        # where a drafter's time goes: the share of drafting in drafting + target calls
        "draft_time_share": {n: round(d / max(d + v, 1e-9), 3) for n, (d, v) in clock.items()},
        "ratio_head_vs_int4_self_draft": (
            round(med["head"] / med["int4-self-draft"], 3) if "int4-self-draft" in med else None
        ),
        "ratio_head_vs_target_only": round(med["head"] / med["target-only"], 3),
        "ratio_head_vs_ngram": round(med["head"] / med["ngram"], 3),
        "outputs_differing_from_target_only": mismatches,
    }


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def markdown(files) -> str:
    """The head section of BENCHMARKS.md from acceptance / speed / diagnose JSON files."""
    res = [(f, json.loads(Path(f).read_text(encoding="utf-8"))) for f in files]
    acc = [(f, r) for f, r in res if r["kind"] == "head_acceptance"]
    if len(acc) > 1:  # one table: runs of one budget each (same settings), ordered by training tokens
        keys = ("k", "max_new_tokens", "threads", "guard")
        if any({k: r[k] for k in keys} != {k: acc[0][1][k] for k in keys} for _, r in acc):
            raise SystemExit("the acceptance files were run with different settings")
        rows = sorted(
            (row for _, r in acc for row in r["results"]),
            key=lambda row: (
                row.get("target_precision", "fp32") != "fp32",
                row["training_tokens"] or 0,
                row.get("soft_labels", 0),
                row.get("train_dtype", "fp32"),
            ),
        )
        merged = ("`, `".join(f for f, _ in acc), {**acc[0][1], "results": rows})
        res = [merged] + [(f, r) for f, r in res if r["kind"] != "head_acceptance"]
    out = []
    for f, r in res:
        if r["kind"] == "head_acceptance":
            cats = sorted({c for row in r["results"] for c in row["per_category"]})
            out += [
                f"### Acceptance against the training budget (`{f}`)",
                "",
                f"Greedy chain, k = {r['k']}, guard off, {r['max_new_tokens']} new tokens per prompt, "
                f"{r['threads']} threads; tokens per target call (acceptance rate).",
                "",
                "| training tokens | target; labels; training steps | seconds of its train-draft run | train top-1 (EMA, training data) | head bytes / target bytes | overall | "
                + " | ".join(cats)
                + " |",
                "|---:|---|---:|---:|---:|---:|" + "---:|" * len(cats),
            ]
            for row in r["results"]:
                o = row["overall"]
                cells = [
                    f"{row['per_category'][c]['tokens_per_target_call']:.2f} "
                    f"({_pct(row['per_category'][c]['acceptance_rate'])})"
                    if c in row["per_category"]
                    else "–"
                    for c in cats
                ]
                labels = (
                    f"{row.get('target_precision', 'fp32')}; "
                    + (f"top-{row['soft_labels']}" if row.get("soft_labels") else "argmax")
                    + f"; {row.get('train_dtype', 'fp32')}"
                )
                out.append(
                    f"| {row['training_tokens']} | {labels} | {row['training_seconds']} | {_pct(row['train_top1'])} | "
                    f"{row['head_weight_bytes'] / max(row['target_weight_bytes'], 1):.1%} | "
                    f"**{o['tokens_per_target_call']:.2f}** ({_pct(o['acceptance_rate'])}) | "
                    + " | ".join(cells)
                    + " |"
                )
            out.append("")
        elif r["kind"] == "head_speed":
            la, lb = r["loadavg_before"], r["loadavg_after"]
            out += [
                f"### Speed (`{f}`)",
                "",
                f"{r['prompts']} prompts, {r['max_new_tokens']} new tokens, {r['threads']} threads, greedy, "
                f"default guard; the drafters alternate prompt by prompt in one run ({r['seconds']} s). "
                f"Load average before {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}, "
                f"after {lb[0]:.2f} / {lb[1]:.2f} / {lb[2]:.2f}. Head: {r['head_training'].get('tokens')} "
                "training tokens"
                + (
                    f", soft labels top-{r['head_training']['soft_labels']}"
                    if r["head_training"].get("soft_labels")
                    else ""
                )
                + ".",
                "",
                "| drafter | median tok/s | tokens per verification call (mean over prompts) | guard fallbacks "
                "| time drafting (of drafting + target calls) |",
                "|---|---:|---:|---:|---:|",
            ]
            for n, v in r["median_tokens_per_s"].items():
                share = r.get("draft_time_share", {}).get(n)
                out.append(
                    f"| {n} | {v:.2f} | {r['mean_tokens_per_verify_call'][n]:.2f} | "
                    f"{r['guard_fallbacks'][n]} | {_pct(share)} |"
                )
            x = r["ratio_head_vs_int4_self_draft"]
            out += [
                "",
                (f"Head / int4 self-draft: **{x:.3f}x**; " if x is not None else "")
                + f"head / {r.get('target_precision', 'fp32')} target-only: "
                f"{'**' if x is None else ''}{r['ratio_head_vs_target_only']:.3f}x{'**' if x is None else ''}; "
                f"head / n-gram: {r['ratio_head_vs_ngram']:.3f}x. "
                f"Outputs differing from target-only: {len(r['outputs_differing_from_target_only'])}.",
                "",
            ]
        elif r["kind"] == "head_diagnose":
            a, b, c = r["a_torch"], r["b_onnx"], r["c_runtime"]
            t = r.get("head_training") or {}
            la = r["loadavg"]
            cond = lambda x: ", ".join(_pct(v) for v in x["top1_given_previous_right"])  # noqa: E731
            out += [
                f"### Where acceptance is lost (`{f}`, benchmarks/experiments/heads/head_diagnose.py)",
                "",
                f"Head of {t.get('tokens')} training tokens ({t.get('budget')}"
                f"{', soft labels top-' + str(t['soft_labels']) if t.get('soft_labels') else ''}"
                f"{', ' + t['train_dtype'] + ' steps' if t.get('train_dtype') else ''}"
                f"{', ' + r['target_precision'] + ' target' if r.get('target_precision') else ''}); held-out text: the target's own "
                f"answers to {r['prompts']} prompts of the script (not training, not bench), "
                f"{r['max_new_tokens']} new tokens, k = {r['k']}. Load average {la[0]:.2f}.",
                "",
                "| path | slots / proposals | draft 1 top-1 | draft 2..k top-1 given the ones before right |",
                "|---|---:|---:|---|",
                f"| (a) torch, teacher-forced | {a['slots']} | {_pct(a['top1_step0'])} | {cond(a)} |",
                f"| (b) ONNX head graph | {b['slots']} | {_pct(b['top1_step0_all_answer_slots'])} | {cond(b)} |",
                f"| (c) runtime proposals vs target | {c['proposals']} | {_pct(c['top1_step0'])} | {cond(c)} |",
                "",
                f"Runtime: acceptance {_pct(c['acceptance_rate'])}, {c['tokens_per_target_call']:.2f} tokens "
                f"per target call, outputs equal to target-only {c['outputs_equal_target_only']}.",
                "",
            ]
    goals = []
    for _, r in res:
        if r["kind"] == "head_acceptance":
            fp32 = [row for row in r["results"] if row.get("target_precision", "fp32") == "fp32"]  # the goals' target
            best = max(fp32 or r["results"], key=lambda row: row["overall"]["tokens_per_target_call"])
            ratio = best["head_weight_bytes"] / max(best["target_weight_bytes"], 1)
            tpc = best["overall"]["tokens_per_target_call"]
            goals.append(
                f"- head weight bytes per step: {ratio:.1%} of the fp32 target's (goal <= 10%: "
                f"{'met' if ratio <= 0.10 else 'missed'})"
            )
            goals.append(
                f"- tokens per target call at k = {r['k']} (best budget, {best['training_tokens']} tokens): "
                f"{tpc:.2f} (goal >= 3.0: {'met' if tpc >= 3.0 else f'missed by {3.0 - tpc:.2f}'})"
            )
        elif r["kind"] == "head_speed":
            x = r["ratio_head_vs_int4_self_draft"]
            if x is not None:
                goals.append(
                    f"- head tok/s / int4 self-draft tok/s: {x:.3f}x (goal >= 1.25x: "
                    f"{'met' if x >= 1.25 else f'missed by {1.25 - x:.3f}x'})"
                )
            if r.get("target_precision") == "int4":
                y = r["ratio_head_vs_target_only"]
                goals.append(
                    f"- int4 target, head tok/s / int4 target-only tok/s: {y:.3f}x (goal >= 1.3x: "
                    f"{'met' if y >= 1.3 else f'missed by {1.3 - y:.3f}x'})"
                )
    if goals:
        out += ["### Goals (issue 14)", ""] + goals + [""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("acceptance", "speed", "markdown"))
    ap.add_argument("bundles", nargs="+", help="bundles (markdown: result JSON files)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--per-category", type=int, default=None, help="first N prompts of each category (default all)")
    args = ap.parse_args(argv)
    if args.what == "markdown":
        from specedge.bench.report import replace_section

        replace_section(
            args.out,
            "head",
            markdown(args.bundles),
            heading="## Draft heads (issue 14, `benchmarks/experiments/heads/head_eval.py`)",
        )
        return 0
    res = acceptance(args.bundles, args) if args.what == "acceptance" else speed(args.bundles[0], args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res.get("median_tokens_per_s") or [r["overall"] for r in res["results"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
