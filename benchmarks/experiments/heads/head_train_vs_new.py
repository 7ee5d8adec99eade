"""A draft head's acceptance on the prompts it was trained on against new prompts (issue 38).

    python benchmarks/experiments/heads/head_train_vs_new.py BUNDLE [--prompts N] [--new-tokens T] [--out FILE.json]

For a head trained with `train-draft --max-prompts N`: its first N training prompts
(specedge/training/prompts.py, chat-templated as train-draft answers them), the same prompts as
plain text (what `specedge generate B PROMPT` without --chat sends), and N of head_diagnose's
held-out prompts, each generated greedily at k = 4 with the guard off. High acceptance on the
training prompts and low on new ones is over-fitting; low on both would be a mismatch between
training and drafting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def acceptance(pipe, prompts, chat: bool, new_tokens: int) -> dict:
    tok = pipe.tokenizer
    drafted = accepted = calls = tokens = 0
    for _, msg in prompts:
        ids = tok.encode_chat([{"role": "user", "content": msg}]) if chat else tok.encode(msg)
        s = pipe.generate(token_ids=ids, max_new_tokens=new_tokens, spec_tokens=4, guard=False).stats
        drafted, accepted = drafted + s["drafted"], accepted + s["accepted"]
        calls, tokens = calls + s["target_calls"], tokens + s["tokens"]
    return {
        "acceptance": round(accepted / max(drafted, 1), 4),
        "tokens_per_call": round(tokens / max(calls, 1), 3),
        "drafted": drafted,
        "accepted": accepted,
    }


def main(argv=None) -> int:
    from head_diagnose import HELD_OUT

    from specedge.runtime.api import load
    from specedge.training.prompts import training_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    pipe = load(a.bundle, draft="head", threads=a.threads)
    t0 = time.time()
    out = {
        "training": pipe.manifest.head.extra.get("training"),
        "train_prompts_chat": acceptance(pipe, training_prompts()[: a.prompts], True, a.new_tokens),
        "new_prompts_chat": acceptance(pipe, HELD_OUT[: a.prompts], True, a.new_tokens),
        "train_prompts_plain": acceptance(pipe, training_prompts()[: a.prompts], False, a.new_tokens),
    }
    out["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
