#!/usr/bin/env python
"""What a quantized target trades against the fp32 target: greedy agreement on the bench prompts and
perplexity on held-out text, next to its target-only speed, for each bundle (and int4 kernel).

    python scripts/bench_quality.py bundles/smollm2-135m-instruct INT4_BUNDLE \\
        --out benchmarks/results/quality/quality.json

REFERENCE is an fp32 bundle; each BUNDLE a bundle of the same model (same tokenizer) at another
precision, e.g. `export-models --precision int4`. An int4 bundle with two graphs (the default
`--int4-kernel auto`) is measured on each kernel this machine runs, since their numerics differ.
For every one (specedge.bench.quality says how each figure is computed):

  greedy agreement   the prompt suite (specedge/bench/prompts.json, rendered with the chat template)
                     decoded greedily with the target alone, --max-new-tokens each: prompts whose
                     whole output equals the reference's, mean tokens before the first divergence,
                     and teacher-forced top-1 agreement on the reference's continuations
  perplexity         the held-out text (--text, default benchmarks/data/heldout.txt) in windows of
                     --window tokens (at most the shortest max_seq), the same windows for every bundle
  speed              decode tokens/s of that greedy run (target-only, --threads threads); every
                     bundle is loaded at once on one shared thread pool and the bundles alternate
                     prompt by prompt (the order rotated), so a change in the load reaches them alike

Writes --out (schema "specedge.bench.quality/1", with the command, date, machine and load averages);
scripts/benchmarks_md.py renders it in BENCHMARKS.md. Bad input (a missing bundle, a reference that
is not fp32, bundles whose tokenizers or contexts give other prompt tokens) is one `error:` line,
exit code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMA = "specedge.bench.quality/1"
DEFAULT_TEXT = REPO / "benchmarks" / "data" / "heldout.txt"


def log(msg: str) -> None:
    print(f"[bench_quality {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def kernels(bundle: Path, reference: bool) -> list[str]:
    """The int4 kernels to measure `bundle` on: each one its ort-cpu graphs offer and this machine
    runs ("auto" alone for a bundle without a choice)."""
    from specedge.manifest import load_manifest
    from specedge.runtime.int4_kernel import KernelChoiceError, choose

    spec = load_manifest(bundle, verify="none").target
    if not reference and spec.precision == "fp32":
        raise ValueError(f"{bundle}: its target is fp32, like the reference: nothing to compare")
    if reference and spec.precision != "fp32":
        raise ValueError(f"{bundle}: the reference's target must be fp32, this one is {spec.precision}")
    found = []
    for want in ("specedge", "matmulnbits"):
        try:
            c = choose(spec, "ort-cpu", want, note=False)
        except KernelChoiceError as e:
            log(f"{bundle.name}: not measured on {want}: {e}")
            continue
        if c.kernel is None:
            return ["auto"]
        if c.kernel == want and c.graph not in [g for g, _ in found]:
            found.append((c.graph, want))
    return [k for _, k in found] or ["auto"]


def encoded(bundle: Path, prompts: list[dict], text: str, max_new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """The prompts' token ids (chat template, cut to the bundle's context as the bench cuts them)
    and the text's, from the bundle's tokenizer: checked before any session is made."""
    from types import SimpleNamespace

    from specedge.bench.runner import _encode
    from specedge.manifest import load_manifest
    from specedge.runtime.tokenizer import Tokenizer

    m = load_manifest(bundle, verify="none")
    view = SimpleNamespace(tokenizer=Tokenizer(m), manifest=m)
    return [_encode(view, p, max_new_tokens)[0] for p in prompts], view.tokenizer.encode(text)


def decode(pipes: list, ids: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Every prompt greedily with each pipeline's target alone, the pipelines alternated prompt by
    prompt (the order rotated per prompt), so a change in the machine's load reaches them alike:
    per pipeline its outputs and decode tokens/s."""
    n = len(pipes)
    for pipe in pipes:
        pipe.generate(token_ids=ids[0], max_new_tokens=8, speculative=False)  # warm-up
    runs = [{"outputs": [], "tokens": 0, "secs": 0.0} for _ in pipes]
    for j, x in enumerate(ids):
        for i in [(i + j) % n for i in range(n)]:
            r = pipes[i].generate(token_ids=x, max_new_tokens=max_new_tokens, speculative=False)
            runs[i]["outputs"].append([int(t) for t in r.token_ids])
            runs[i]["tokens"] += max(len(r.token_ids) - 1, 0)
            runs[i]["secs"] += r.stats["decode_s"]
    return [
        {"outputs": r["outputs"], "tokens_per_s": round(r["tokens"] / r["secs"], 1) if r["secs"] > 0 else None}
        for r in runs
    ]


def measure(plan: list[tuple[Path, str]], ids: list[list[int]], text_ids: list[int], args) -> list[dict]:
    """Each (bundle, kernel) of `plan`, all loaded at once on one shared thread pool: the greedy
    outputs and speed, agreement with the first (the reference) and held-out perplexity."""
    from specedge.bench import quality
    from specedge.runtime.api import load

    pipes = []
    try:
        for bundle, kernel in plan:
            log(f"loading {bundle} ({kernel})")
            pipes.append(
                load(bundle, threads=args.threads, draft="ngram", verify="size", int4_kernel=kernel, shared_pool=True)
            )
        runs = decode(pipes, ids, args.max_new_tokens)
        wins = quality.windows(text_ids, args.window, args.max_windows)
        rows = []
        for (bundle, kernel), pipe, run in zip(plan, pipes, runs):
            spec = pipe.manifest.target
            row = {
                "bundle": _rel(bundle),
                "precision": spec.precision,
                "source": Path(spec.source).name or None,
                "quantization": spec.quantization.get("method"),
                "kernel": getattr(getattr(pipe.target, "kernel_choice", None), "kernel", None),
                "tokens_per_s": run["tokens_per_s"],
            }
            if rows:
                row["greedy"] = quality.greedy_agreement(runs[0]["outputs"], run["outputs"])
            row["teacher_forced"] = quality.teacher_forced(pipe, ids, runs[0]["outputs"])
            row["perplexity"] = {"window": args.window, "windows": len(wins), **quality.held_out_perplexity(pipe, wins)}
            log(f"{bundle.name} ({kernel}): {row['tokens_per_s']} tok/s, perplexity {row['perplexity']['perplexity']}")
            rows.append(row)
        return rows
    finally:
        for pipe in pipes:
            pipe.close()


def _sources(rows: list[dict]) -> str:
    """Where the targets come from, and what that means for the comparison."""
    names = {r.get("source") for r in rows}
    one = next(iter(names)) if len(names) == 1 else None
    if not one:
        return ""
    text = f"Every target is exported from the same checkpoint, `{one}`"
    if all(r["precision"] == "fp32" or r.get("quantization") == "gguf-exact" for r in rows):
        # the fp32 weights are the GGUF's blocks dequantized, and the int4 ones those very blocks
        text += (
            ", and the quantized ones keep its own blocks (`gguf-exact`): they differ from fp32 in the kernels' "
            "arithmetic (activations rounded to 8 bits, another order of sums), not in the weights"
        )
    return text + ". "


def markdown(res: dict, json_path: str) -> str:
    """The BENCHMARKS.md section: one row per bundle and kernel."""
    m = res["machine"]
    t = res["text"]
    w = res["results"][0]["perplexity"]
    lines = [
        f"Measured {res['date_utc']}, {res['prompts']} prompts (the bench suite, chat template), greedy, "
        f"target-only, {res['max_new_tokens']} new tokens, {res['threads']} threads; load average "
        f"{m['load_avg_start'][0]} → {m['load_avg_end'][0]}. Perplexity: `{t['path']}` ({t['source']}), "
        f"{t['tokens']} tokens, {w['windows']} windows of {w['window']} tokens from slot 0 (all but each first "
        "token scored). Teacher-forced: the fp32 answer fed back, share of its tokens that are the bundle's argmax. "
        f"{_sources(res['results'])}A bundle with two int4 graphs (`--int4-kernel auto`) is measured on each "
        "kernel, forced at load. The speeds come from one run, every row loaded at once on one shared pool of "
        f"threads and the rows alternated prompt by prompt. Command: `{res['command']}` (JSON: `{json_path}`).",
        "",
        "| target | kernel | target-only tok/s | output = fp32 | tokens before the first divergence (mean) "
        "| teacher-forced top-1 = fp32 | held-out perplexity (tokens scored) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["results"]:
        g = r.get("greedy")
        same = f"{g['same_output']}/{g['prompts']}" if g else "reference"
        div = f"{g['mean_tokens_before_divergence']:.1f}" if g else "–"
        tf = r["teacher_forced"]
        ppl = r["perplexity"]
        lines.append(
            f"| {r['precision']} | {r['kernel'] or '–'} | {r['tokens_per_s']} | {same} | {div} | "
            f"{100 * tf['rate']:.1f}% | {ppl['perplexity']:.2f} ({ppl['tokens']}) |"
        )
    lines += [
        "",
        "The fp32 row's teacher-forced figure is the fp32 target against its own greedy answers: multi-token calls "
        "round differently from single-token steps, so it is the floor of what a different rounding alone changes.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("reference", type=Path, help="the fp32 bundle (e.g. bundles/smollm2-135m-instruct)")
    ap.add_argument("bundles", type=Path, nargs="+", help="bundles of the same model at other precisions")
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="held-out text (default %(default)s)")
    ap.add_argument("--window", type=int, default=1024, help="perplexity window, tokens (default 1024)")
    ap.add_argument("--max-windows", type=int, default=None, help="score at most this many windows")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts-per-category", type=int, default=None, help="first N prompts of each category")
    a = ap.parse_args(argv)
    command = shlex.join(["python", "scripts/bench_quality.py", *(sys.argv[1:] if argv is None else argv)])
    from specedge.bench import quality
    from specedge.bench.runner import load_average, load_prompts, machine_info, select_prompts
    from specedge.errors import BackendError
    from specedge.manifest import BundleError, load_manifest
    from specedge.runtime.int4_kernel import KernelChoiceError

    try:
        if a.window < 2 or a.max_new_tokens < 1 or a.threads < 1 or (a.max_windows is not None and a.max_windows < 1):
            raise ValueError("--window must be >= 2, --max-new-tokens, --threads and --max-windows >= 1")
        if not a.text.is_file():
            raise ValueError(f"--text {a.text}: no such file")
        plan = [(a.reference, k) for k in kernels(a.reference, True)]
        for b in a.bundles:
            plan += [(b, k) for k in kernels(b, False)]
        # one window length for every bundle: the shortest context among them bounds it
        a.window = min([a.window] + [load_manifest(b, verify="none").max_seq for b, _ in plan])
        prompts = select_prompts(load_prompts(), a.prompts_per_category)
        text = a.text.read_text(encoding="utf-8")
        ids, text_ids = encoded(a.reference, prompts, text, a.max_new_tokens)
        for b in a.bundles:
            b_ids, b_text = encoded(b, prompts, text, a.max_new_tokens)
            if b_text != text_ids:
                raise ValueError(f"{b}: its tokenizer differs from the reference's: the texts would not compare")
            if b_ids != ids:  # a prompt cut to another context length
                raise ValueError(f"{b}: its prompts are not the reference's tokens (another max_seq?)")
        if not quality.windows(text_ids, a.window, a.max_windows):
            raise ValueError(f"{a.text}: fewer than {a.window} tokens, not one window to score")
        la0 = load_average()
        results = measure(plan, ids, text_ids, a)
    except (BundleError, BackendError, KernelChoiceError, ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    mach = machine_info(a.threads)
    mach["load_avg_start"], mach["load_avg_end"] = la0, load_average()
    source = a.text.with_suffix(".source")
    res = {
        "schema": SCHEMA,
        "command": command,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": mach,
        "threads": a.threads,
        "max_new_tokens": a.max_new_tokens,
        "prompts": len(prompts),
        "schedule": "alternated",
        "prompt_ids": [p["id"] for p in prompts],
        "text": {
            "path": _rel(a.text),
            "source": source.read_text(encoding="utf-8").strip() if source.is_file() else "",
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "tokens": len(text_ids),
        },
        "reference": _rel(a.reference),
        "results": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
