"""Greedy tree output against target-only on one bundle: why trees are refused on targets whose
single-token steps are padded (docs/design.md, "Where trees are refused").

Every other bench prompt (chat template, greedy) is decoded target-only, with chains and with
n-gram trees (guard off, so trees run every round), with the runtime's tree refusal lifted for
the measurement. Reports, per prompt, whether the chain and the tree output equal target-only.

    python benchmarks/experiments/trees/tree_exactness.py BUNDLE [--max-new-tokens 64] [--categories code,chat] \
        > benchmarks/experiments/trees/results/exactness_NAME.json
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
from specedge.runtime.generator import Generator  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--categories", default=None, help="comma-separated prompt categories, of the every-other prompts (default all)"
    )
    args = ap.parse_args(argv)
    try:
        cats = parse_categories(args.categories)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.max_new_tokens < 1:
        print(f"error: --max-new-tokens must be >= 1, got {args.max_new_tokens}", file=sys.stderr)
        return 2
    Generator.check_tree = lambda self, cfg: None  # measure what the refusal prevents
    pipe = load(args.bundle, threads=args.threads, verify="size", draft="ngram")
    rows = []
    for pr in select_prompts(load_prompts()[::2], None, cats):
        ids = pipe.tokenizer.encode_chat(pr["messages"])
        want = pipe.generate(token_ids=ids, max_new_tokens=args.max_new_tokens, speculative=False).token_ids
        chain = pipe.generate(token_ids=ids, max_new_tokens=args.max_new_tokens, guard=False).token_ids
        tree = pipe.generate(token_ids=ids, max_new_tokens=args.max_new_tokens, tree=True, guard=False)
        first = next((i for i, (a, b) in enumerate(zip(tree.token_ids, want)) if a != b), None)
        rows.append(
            {
                "id": pr["id"],
                "chain_equal": chain == want,
                "tree_equal": tree.token_ids == want,
                "tree_first_difference": first,
                "tree_rounds": tree.stats.get("tree_rounds", 0),
            }
        )
        print(
            f"{pr['id']}: chain {'=' if chain == want else '!='} target-only, tree "
            f"{'=' if tree.token_ids == want else '!='} target-only",
            file=sys.stderr,
        )
    res = {
        "schema": "specedge.bench.tree_exactness/1",
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python benchmarks/experiments/trees/tree_exactness.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "bundle": args.bundle,
        "target": pipe.describe()["target"],
        "load_avg": load_average(),
        "prompts": len(rows),
        "chain_mismatches": sum(not r["chain_equal"] for r in rows),
        "tree_mismatches": sum(not r["tree_equal"] for r in rows),
        "rows": rows,
    }
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
