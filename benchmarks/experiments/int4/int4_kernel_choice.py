#!/usr/bin/env python
"""The default bundle (fp32 target, int4 self-draft) with its self-draft on each int4 kernel,
alternated prompt by prompt (issue 37, item 2):

    flock /tmp/specedge-bench.lock python benchmarks/experiments/int4/int4_kernel_choice.py BUNDLE \
        --out benchmarks/experiments/int4/results/int4_kernel_choice.json

BUNDLE must carry both int4 graphs (export-models with the default --int4-kernel auto). One
pipeline per kernel (load(..., int4_kernel=...)), loaded and warmed once; for every prompt each
decodes greedily in turn, the order swapped every prompt. Decode tok/s per prompt is the
generator's (new tokens - 1) / decode seconds; the JSON keeps every prompt, the medians, the
median per-prompt ratio specedge / matmulnbits, the 1-minute load average before and after, and
whether both gave the same tokens (they must: the fp32 target decides every token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

SCHEMA = "specedge.bench.int4_kernel_choice/1"
KERNELS = ("matmulnbits", "specedge")


def draft_step_ms(pipes: dict, steps: int) -> dict:
    """Median ms of one single-token step of each pipeline's draft session, the kernels taking
    turns every step (less exposed to a busy machine than whole generations)."""
    import numpy as np

    if not steps:
        return {}
    times: dict[str, list[float]] = {k: [] for k in pipes}
    ids = np.array([42], dtype=np.int64)
    for i in range(steps + 10):
        for k in KERNELS if i % 2 == 0 else KERNELS[::-1]:
            t0 = time.perf_counter()
            pipes[k].draft_backend.run(ids, 64 + i % 32)
            if i >= 10:  # warm-up steps not counted
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    from specedge.bench.runner import load_prompts, select_prompts
    from specedge.manifest import BundleError
    from specedge.runtime.api import load
    from specedge.runtime.backends.base import BackendError

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--per-category", type=int, default=2, help="prompts per category (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--steps",
        type=int,
        default=300,
        help="single-token draft steps timed per kernel, alternated (default 300; 0 = none)",
    )
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout only)")
    args = p.parse_args(argv)
    if args.per_category < 1 or args.max_new_tokens < 2 or args.threads < 1 or args.steps < 0:
        print("error: --per-category, --threads must be >= 1, --max-new-tokens >= 2, --steps >= 0", file=sys.stderr)
        return 2

    prompts = select_prompts(load_prompts(), per_category=args.per_category)
    load_before = os.getloadavg()[0]
    pipes, load_s = {}, {}
    for k in KERNELS:  # load time includes the MatMulNBits twin's constant folding
        t0 = time.perf_counter()
        try:
            pipes[k] = load(args.bundle, threads=args.threads, int4_kernel=k)
        except (BackendError, BundleError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        load_s[k] = time.perf_counter() - t0
    for k, pipe in pipes.items():
        if pipe.draft_backend is None or pipe.draft_backend.describe().get("int4_kernel", "").split()[0] != k:
            print(
                f"error: the bundle's draft does not run on {k} here (export it with --int4-kernel auto)",
                file=sys.stderr,
            )
            return 2
    step_ms = draft_step_ms(pipes, args.steps)
    rows, skipped = [], []
    for pr in prompts:
        ids = pipes[KERNELS[0]].tokenizer.encode_chat(pr["messages"])
        if len(ids) + args.max_new_tokens > pipes[KERNELS[0]].manifest.max_seq:  # a small test bundle's context
            skipped.append(pr["id"])
            continue
        order = KERNELS if len(rows) % 2 == 0 else KERNELS[::-1]
        row = {"id": pr["id"], "category": pr["category"]}
        for k in order:
            r = pipes[k].generate(token_ids=ids, max_new_tokens=args.max_new_tokens)
            row[k] = {
                "tokens_per_s": r.stats["tokens_per_s"],
                "tokens": r.stats["tokens"],
                "acceptance_rate": r.stats["acceptance_rate"],
                "mean_accepted": r.stats["mean_accepted"],
                "time_draft_s": r.stats["time_draft_s"],
                "time_verify_s": r.stats["time_verify_s"],
                "token_ids": r.token_ids,
            }
        row["same_tokens"] = row["matmulnbits"]["token_ids"] == row["specedge"]["token_ids"]
        row["ratio"] = row["specedge"]["tokens_per_s"] / row["matmulnbits"]["tokens_per_s"]
        for k in KERNELS:
            del row[k]["token_ids"]
        rows.append(row)
        print(
            f"{pr['id']}: matmulnbits {row['matmulnbits']['tokens_per_s']:.1f}  specedge "
            f"{row['specedge']['tokens_per_s']:.1f} tok/s  x{row['ratio']:.2f}",
            file=sys.stderr,
        )
    if not rows:
        print("error: no prompt fits the bundle's context", file=sys.stderr)
        return 2
    out = {
        "schema": SCHEMA,
        "bundle": str(args.bundle),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "cpu_count": os.cpu_count(),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "draft_kernels": {k: pipes[k].draft_backend.describe()["int4_kernel"] for k in KERNELS},
        "load_s": load_s,
        "draft_step_ms_median": step_ms,
        "draft_step_ratio_specedge_over_matmulnbits": step_ms["specedge"] / step_ms["matmulnbits"] if step_ms else None,
        "median_tokens_per_s": {k: statistics.median(r[k]["tokens_per_s"] for r in rows) for k in KERNELS},
        "median_ratio_specedge_over_matmulnbits": statistics.median(r["ratio"] for r in rows),
        "all_same_tokens": all(r["same_tokens"] for r in rows),
        "prompts": rows,
        "skipped_prompts_longer_than_the_context": skipped,
    }
    for pipe in pipes.values():
        pipe.close()
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(
        json.dumps(
            {
                k: out[k]
                for k in (
                    "median_tokens_per_s",
                    "median_ratio_specedge_over_matmulnbits",
                    "all_same_tokens",
                    "load_average_1min",
                )
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
