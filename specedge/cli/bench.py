"""`specedge bench BUNDLE`: sweep k over the built-in prompt suite; JSON + PNG; `--tune` sets k.

    specedge bench bundles/smollm2-135m-instruct --quick --threads 2
    specedge bench BUNDLE --k 0,1,2,4 --repeats 3 --max-new-tokens 128 --out my-results/
    specedge bench BUNDLE --draft ngram --tune

Writes OUT/bench.json (OUT defaults to ./specedge-bench/<bundle>_<drafter>) (schema in `specedge.bench.runner`) and OUT/bench.png, prints a table (or the
JSON with --json). --tune writes the k with the best overall speed-up into the bundle's manifest
(atomically: only manifest.json changes; it is not in its own checksum list) and says why.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Outside any committed results: a plain run writes here (relative to the current folder); the
# repository's published figures live in benchmarks/results/ and are written only with --out.
DEFAULT_OUT = "specedge-bench"


def _int_list(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not ks:
        raise argparse.ArgumentTypeError("expected at least one k")
    return ks


def _str_list(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark speculative decoding on a bundle (k sweep, JSON + PNG)",
        description="Sweep k (0 = target only) over a built-in suite of 20 prompts in 4 categories (code, chat, "
        "grounded edit/extraction, summarization), greedy and sampled (temperature 0.7, fixed seeds). "
        "Reports tokens/s (median and IQR over repeats), time to first token, acceptance rate, mean tokens "
        "per target call, peak RSS and achieved weight bandwidth per category and overall; writes "
        "OUT/bench.json and OUT/bench.png.",
    )
    p.add_argument("bundle", help="bundle folder")
    p.add_argument(
        "--k",
        type=_int_list,
        default=None,
        metavar="LIST",
        help="k values to sweep, e.g. 0,1,2,4 (0 = target only; default 0..8, --quick: 0,1,2,4)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed repeats of every prompt (default 3, --quick: 1)")
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="new tokens per generation (default 128, --quick: 64)"
    )
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per ONNX Runtime session")
    p.add_argument(
        "--draft-kv",
        choices=("auto", "own"),
        default="auto",
        help="auto: a self-draft takes the target's K/V for the prompt (default); own: it prefills itself",
    )
    p.add_argument(
        "--no-shared-pool",
        action="store_true",
        help="a thread pool per ONNX Runtime session, spinning off when a draft runs (the library's "
        "default) instead of one process-wide spinning pool (the CLI's)",
    )
    p.add_argument(
        "--draft",
        choices=("model", "ngram", "head"),
        default=None,
        help="drafter: the bundle's draft model, prompt lookup or its trained draft head "
        "(default: the bundle's own kind)",
    )
    p.add_argument("--backend", default="auto", help="runtime backend (auto, ort-cpu, ort-cuda, ...)")
    p.add_argument("--modes", type=_str_list, default=None, metavar="LIST", help="greedy,sampled (default both)")
    p.add_argument(
        "--prompts-per-category",
        type=int,
        default=None,
        metavar="N",
        help="use the first N prompts of each category (default all 5, --quick: 2)",
    )
    p.add_argument(
        "--categories",
        type=_str_list,
        default=None,
        metavar="LIST",
        help="only these categories (code,chat,grounded,summarization)",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed of the sampled runs (default 0)")
    p.add_argument(
        "--guard",
        action="store_true",
        help="keep the runtime's speculation guard on (default off: each k is measured as itself)",
    )
    p.add_argument(
        "--tree",
        action="store_true",
        help="verify a tree of drafts per target call instead of a chain (a bundle exported with --tree, "
        "or --backend torch)",
    )
    p.add_argument(
        "--quick", action="store_true", help="short run: k 0,1,2,4, 1 repeat, 64 tokens, 2 prompts per category"
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output folder for bench.json and bench.png (default ./specedge-bench/<bundle>_<drafter> in the "
        "current folder)",
    )
    p.add_argument(
        "--tune", action="store_true", help="write the best k into the bundle's manifest (atomically) and say why"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)
    return p


def _config(args):
    from ..bench.runner import BenchConfig

    kw = dict(
        ks=args.k,
        repeats=args.repeats,
        max_new_tokens=args.max_new_tokens,
        modes=args.modes,
        per_category=args.prompts_per_category,
        categories=args.categories,
    )
    if args.quick:
        cfg = BenchConfig.quick_defaults(**kw)
    else:
        cfg = BenchConfig(**{k: v for k, v in kw.items() if v is not None})
    cfg.threads = args.threads
    cfg.draft = args.draft
    cfg.backend = args.backend
    from ..runtime.sampling import check_seed

    check_seed(args.seed, "--seed")  # one seed range everywhere (docs/security.md): a ValueError, exit 2
    cfg.seed = args.seed
    cfg.guard = bool(args.guard)
    cfg.tree = bool(args.tree)
    cfg.shared_pool = not args.no_shared_pool
    cfg.draft_kv = args.draft_kv
    return cfg.validate()


def run(args) -> int:
    from ..errors import UserError
    from ..manifest import load_manifest

    bundle = Path(args.bundle)
    try:
        cfg = _config(args)
    except ValueError as e:
        raise UserError(str(e)) from None
    manifest = load_manifest(bundle, verify="full")
    own = "model" if manifest.draft.is_model else "ngram"
    drafter = cfg.draft or own
    if args.tune:
        if drafter != own:
            raise UserError(
                f"--tune sets the k of the bundle's own drafter ({own}); this run measures the {drafter} drafter "
                f"(drop --draft or use --draft {own})"
            )
        if 0 not in cfg.ks or not any(k > 0 for k in cfg.ks):
            raise UserError("--tune needs k = 0 (the target-only baseline) and at least one k >= 1 in --k")
    if cfg.tree and cfg.backend != "torch" and not any(g.tree for g in manifest.target.graphs):
        raise UserError("--tree needs a bundle exported with --tree (export-models --tree) or --backend torch")
    cfg.verify = "none"  # just checked in full above
    tree = "_tree" if cfg.tree else ""
    out = Path(args.out) if args.out else Path(DEFAULT_OUT) / f"{bundle.resolve().name}_{drafter}{tree}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output folder {out}: {e}") from None
    try:
        import matplotlib  # noqa: F401

        can_plot = True
    except ImportError:
        can_plot = False
        print(
            "warning: matplotlib is not installed, so no plot will be written (pip install 'specedge[bench]')",
            file=sys.stderr,
        )

    from ..bench.runner import format_table, run_bench, tune_manifest, validate_results

    results = run_bench(bundle, cfg, progress=not args.quiet, command=_reconstruct(args))
    files = {"json": str(out / "bench.json")}
    tune = results["tune"]
    if args.tune:
        if tune.get("k") is not None:
            prev = tune_manifest(
                bundle,
                tune["k"],
                {
                    "score": tune["score"],
                    "reason": tune["reason"],
                    "drafter": drafter,
                    "results": str(out / "bench.json"),
                },
            )
            tune["written"] = True
            tune["previous_k"] = prev
            load_manifest(bundle, verify="size")  # the bundle still loads
        else:
            tune["written"] = False
            tune["previous_k"] = manifest.spec_tokens
    validate_results(results)
    from ..manifest import write_json_atomic

    write_json_atomic(out / "bench.json", results)
    if can_plot:
        from ..bench.plot import plot_results

        files["png"] = str(plot_results(results, out / "bench.png"))
    if args.json:
        print(json.dumps({**results, "files": files}, indent=2))
    else:
        print(format_table(results))
        print()
        for kind, path in files.items():
            print(f"{kind}: {path}")
        la0, la1 = results["machine"].get("load_avg_start"), results["machine"].get("load_avg_end")
        if la0 and la1:
            print(
                f"load average (1 min) at start / end: {la0[0]} / {la1[0]} on {results['machine']['logical_cpus']} CPUs"
            )
    if args.tune:
        msg = (
            f"tune: wrote k={tune['k']} into {bundle / 'manifest.json'} (was {tune['previous_k']}): {tune['reason']}"
            if tune.get("written")
            else f"tune: left k={tune['previous_k']} unchanged: {tune['reason']}"
        )
        print(msg, file=sys.stderr if args.json else sys.stdout)
    elif not args.json and tune.get("reason"):
        print(f"best k: {tune['k'] if tune.get('k') is not None else 'none'} ({tune['reason']})")
    return 0


def _reconstruct(args) -> list[str]:
    """The command line that reproduces this run (when not started through the console script)."""
    cmd = ["specedge", "bench", str(args.bundle)]
    for flag, val in (
        ("--k", args.k and ",".join(map(str, args.k))),
        ("--repeats", args.repeats),
        ("--max-new-tokens", args.max_new_tokens),
        ("--threads", args.threads),
        ("--draft", args.draft),
        ("--modes", args.modes and ",".join(args.modes)),
        ("--prompts-per-category", args.prompts_per_category),
        ("--categories", args.categories and ",".join(args.categories)),
        ("--out", args.out),
    ):
        if val is not None:
            cmd += [flag, str(val)]
    if args.backend != "auto":
        cmd += ["--backend", args.backend]
    if args.seed:
        cmd += ["--seed", str(args.seed)]
    for flag in ("quick", "guard", "tree", "tune"):
        if getattr(args, flag):
            cmd.append(f"--{flag}")
    return cmd
