"""How many tokens per target call any prompt-lookup (n-gram) tree could win over the chain (issue 15).

Greedy speculation emits the target's own greedy output whatever the drafter does, so tokens per
target call can be computed exactly from that output alone, without running a draft round: each
round accepts the longest root path of the proposed tree that matches the output, plus the
target's token. The script decodes every bench-suite prompt target-only once (greedy, chat
template, --max-new-tokens) and replays the rounds offline for:

* `chain k=K`: the n-gram chain specedge drafts (NgramIndex.propose), for K = nodes - 1;
* `product tree`: specedge's n-gram tree as a tree round asks for it (NgramDrafter.propose_tree,
  k = 4, depth nodes - 1): the chain first, then best first over the latest 8 matches' counts;
* `best-first tree`: the same rule over every earlier occurrence (not the latest 8) and with no
  chain put first: every node's children are the distinct tokens that followed the longest
  matching suffix (n = 3, 2, 1) of its context anywhere earlier in the history, scored by their
  share; nodes are added in order of the product of shares along their path, with no depth limit
  besides the node count;
* `unbounded`: the ceiling of all n-gram trees: a drafted token counts as accepted when it
  followed the matching suffix of its context anywhere earlier (every candidate at every depth
  in the tree at once, at any depth).

Tokens per call here count every round's accepted tokens plus the target's one, with no guard
(the runtime's figures also count guard fallbacks). Output: JSON on stdout.

    python benchmarks/experiments/trees/ngram_tree_bound.py BUNDLE > benchmarks/experiments/trees/results/ngram_tree_bound.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from specedge.bench.runner import load_average, load_prompts  # noqa: E402
from specedge.runtime.drafters.ngram import NgramDrafter, NgramIndex  # noqa: E402
from specedge.runtime.sampling import SamplingParams  # noqa: E402
from specedge.runtime.tree import Tree  # noqa: E402

SIZES = (3, 2, 1)


def followers(ctx: list[int]) -> Counter:
    """Tokens that followed the longest suffix of ctx (sizes 3, 2, 1) seen earlier in ctx."""
    length = len(ctx)
    for n in SIZES:
        if length <= n:
            continue
        suffix = ctx[length - n :]
        seen = Counter(ctx[s + n] for s in range(length - n) if ctx[s : s + n] == suffix)
        if seen:
            return seen
    return Counter()


def best_first_tree(history: list[int], nodes: int) -> Tree | None:
    tokens, parents = [history[-1]], [-1]
    heap: list = []
    order = 0

    def expand(node: int, path: list[int], score: float) -> None:
        nonlocal order
        seen = followers(history + path)
        total = sum(seen.values())
        for tok, count in seen.items():
            heapq.heappush(heap, (-score * count / total, order, node, tok, path))
            order += 1

    expand(0, [], 1.0)
    while heap and len(tokens) < nodes:
        neg, _, node, tok, path = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(node)
        expand(len(tokens) - 1, path + [tok], -neg)
    return Tree(tokens, parents) if len(tokens) > 1 else None


def accepted(tree: Tree | None, truth: list[int]) -> int:
    node, n = 0, 0
    while tree is not None and n < len(truth):
        nxt = [c for c in tree.children(node) if tree.tokens[c] == truth[n]]
        if not nxt:
            break
        node, n = nxt[0], n + 1
    return n


def unbounded(history: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(truth) and truth[n] in followers(history + truth[:n]):
        n += 1
    return n


def replay(outputs: list[dict], rule) -> dict:
    """Tokens per call over all prompts and per category; rule(history, truth) -> accepted."""
    per: dict[str, list[int]] = {}
    for item in outputs:
        prompt, out = item["prompt"], item["output"]
        i = 0
        state = {}
        while i < len(out):
            step = min(rule(prompt + out[:i], out[i:], state) + 1, len(out) - i)
            i += step
            c = per.setdefault(item["category"], [0, 0])
            c[0] += step
            c[1] += 1
    tokens, calls = sum(a for a, _ in per.values()), sum(b for _, b in per.values())
    return {
        "tokens_per_call": round(tokens / calls, 3),
        "per_category": {c: round(a / b, 3) for c, (a, b) in sorted(per.items())},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--nodes", default="5,7,9,12,16,32", help="tree sizes, root included")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from specedge.runtime.api import load

    started, load_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), load_average()
    pipe = load(args.bundle, threads=args.threads, verify="size")
    outputs = []
    try:
        for p in load_prompts():
            ids = pipe.tokenizer.encode_chat(p["messages"])
            r = pipe.generate(token_ids=ids, max_new_tokens=args.max_new_tokens, speculative=False)
            outputs.append(
                {
                    "id": p["id"],
                    "category": p["category"],
                    "prompt": [int(t) for t in ids],
                    "output": [int(t) for t in r.token_ids],
                }
            )
        vocab = pipe.vocab
    finally:
        pipe.close()
    print(f"decoded {len(outputs)} prompts", file=sys.stderr, flush=True)

    def chain(k):
        def rule(h, truth, state):
            d = state.setdefault("d", NgramIndex(SIZES, k))
            prop = d.propose(h, k)
            n = 0
            while n < len(prop) and n < len(truth) and prop[n] == truth[n]:
                n += 1
            return n

        return rule

    def product_tree(nodes):
        def rule(h, truth, state):
            prop = state.setdefault("p", NgramDrafter(vocab, SIZES))
            return accepted(prop.propose_tree(h, 4, nodes, SamplingParams(), depth=nodes - 1), truth)

        return rule

    rows = []
    chain4 = replay(outputs, chain(4))
    rows.append({"drafter": "chain k=4", "nodes": 5, **chain4})
    for nodes in (int(x) for x in args.nodes.split(",")):
        if nodes != 5:
            rows.append({"drafter": f"chain k={nodes - 1}", "nodes": nodes, **replay(outputs, chain(nodes - 1))})
        rows.append({"drafter": "product tree", "nodes": nodes, **replay(outputs, product_tree(nodes))})
        rows.append(
            {
                "drafter": "best-first tree",
                "nodes": nodes,
                **replay(outputs, lambda h, t, s, n=nodes: accepted(best_first_tree(h, n), t)),
            }
        )
        print(f"nodes {nodes} done", file=sys.stderr, flush=True)
    rows.append({"drafter": "unbounded", "nodes": None, **replay(outputs, lambda h, t, s: unbounded(h, t))})
    for r in rows:
        r["vs_chain_k4"] = round(r["tokens_per_call"] / chain4["tokens_per_call"], 3)
    json.dump(
        {
            "schema": "specedge.ngram_tree_bound/1",
            "created": started,
            "command": "python benchmarks/experiments/trees/ngram_tree_bound.py " + " ".join(sys.argv[1:]),
            "bundle": str(args.bundle),
            "max_new_tokens": args.max_new_tokens,
            "load_avg_start": load_start,
            "load_avg_end": load_average(),
            "decoded_tokens": sum(len(o["output"]) for o in outputs),
            "rows": rows,
        },
        sys.stdout,
        indent=1,
    )
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
