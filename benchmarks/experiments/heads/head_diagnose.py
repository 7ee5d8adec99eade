"""Where a draft head's acceptance is lost: the same held-out text through three paths (issue 14).

    python benchmarks/experiments/heads/head_diagnose.py BUNDLE [--checkpoint DIR] [--out FILE.json]

Held-out text: the target's own greedy answers (target-only) to the prompts below, which are
neither training prompts (specedge/training/prompts.py) nor the bench suite. Over the answer
slots (slot j: features of token j, embedding of token j + 1, label: the target's argmax at
j + 1), the script reports

(a) torch: the checkpoint's head (EagleHead.forward_unrolled, k steps, teacher tokens): step 0's
    top-1 against the target's argmax, and step s's top-1 where steps 0..s-1 were all right
    (what a greedy chain's draft s + 1 needs to be accepted);
(b) onnx: the bundle's exported head graph (OrtHeadBackend) over the same features, step 0 in
    prefill chunks, then chains of k - 1 T = 1 steps from sampled slots: the same two numbers;
(c) runtime: `load(bundle, draft="head")` generating the same prompts greedily at k (guard off):
    each proposal against the tokens the target then emits: first draft right, and draft j
    right given drafts 1..j-1 right; acceptance and tokens per target call.

Any gap between (a), (b) and (c) is a bug (a feature row, position or token paired wrongly, the
draft vocabulary, the feature scale, the head's cache after a rejection); (a) itself low means
the head is undertrained.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HELD_OUT = [
    ("chat", "What are some easy ways to save money on groceries?"),
    ("chat", "Explain how a rainbow forms."),
    ("chat", "Write a short thank-you note to a neighbour who watered my plants."),
    ("chat", "What is the difference between a virus and a bacterium?"),
    ("chat", "Give me four ideas for a birthday party for a seven-year-old."),
    ("code", "Write a Python function that returns the largest of three numbers."),
    ("code", "Write a Python function that checks whether a number is prime."),
    ("code", "How do I write a dictionary to a JSON file in Python?"),
    ("code", "Write a Python generator that yields the squares of the numbers from 1 to n."),
    ("code", "Explain the difference between '==' and 'is' in Python with an example."),
    (
        "grounded",
        "Read this text:\n\nThe heapq module provides an implementation of the heap queue algorithm, "
        "also known as the priority queue algorithm. Heaps are binary trees for which every parent node "
        "has a value less than or equal to any of its children.\n\nUsing only the text above, what is "
        "a heap?",
    ),
    (
        "summarization",
        "Summarize in two sentences: The shutil module offers a number of high-level operations "
        "on files and collections of files. In particular, functions are provided which support "
        "file copying and removal. For operations on individual files, see also the os module.",
    ),
]


def held_out_sequences(bundle, n_new: int, threads: int):
    """(category, prompt ids, prompt + answer ids): the target's greedy answers, target-only."""
    from specedge.runtime.api import load

    pipe = load(bundle, threads=threads, warmup=False)
    out = []
    try:
        for cat, msg in HELD_OUT:
            ids = pipe.encode(messages=[{"role": "user", "content": msg}])
            r = pipe.generate(token_ids=ids, max_new_tokens=n_new, speculative=False)
            out.append((cat, list(ids), list(ids) + list(r.token_ids)))
    finally:
        pipe.close()
    return out


def chain_stats(correct: np.ndarray, k: int) -> dict:
    """correct [N, k] bool (step s right at a start slot, teacher tokens): step 0's top-1, step s's
    top-1 given steps 0..s-1 right, and the mean accepted length + 1 (tokens per target call if
    every slot started a round)."""
    out = {"slots": int(correct.shape[0]), "top1_step0": round(float(correct[:, 0].mean()), 4)}
    run = np.ones(correct.shape[0], dtype=bool)
    cond = []
    for s in range(k):
        if s:
            cond.append(round(float(correct[run, s].mean()), 4) if run.any() else None)
        run &= correct[:, s]
    out["top1_given_previous_right"] = cond  # steps 1..k-1
    acc_len = np.cumprod(correct, axis=1).sum(axis=1)
    out["tokens_per_target_call_if_every_slot"] = round(float(acc_len.mean() + 1), 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--checkpoint", default=None, help="train-draft checkpoint folder (default .BUNDLE.train-draft)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from specedge.manifest import load_manifest
    from specedge.models.eagle_head import head_for_target
    from specedge.runtime.api import load
    from specedge.runtime.backends.ort_head import OrtHeadBackend
    from specedge.runtime.drafters.head import read_draft_vocab
    from specedge.training.data import target_rows
    from specedge.training.train import _target_module, default_checkpoint

    bundle = Path(args.bundle)
    k = args.k
    torch.set_num_threads(args.threads)
    m = load_manifest(bundle, verify="size")
    t0 = time.time()
    seqs = held_out_sequences(bundle, args.max_new_tokens, args.threads)
    feats, labels, _ = target_rows(m, [s for _, _, s in seqs], args.threads, lambda d, t: None)
    d2t = read_draft_vocab(m)

    # (a) torch, from the checkpoint
    ck = Path(args.checkpoint) if args.checkpoint else default_checkpoint(bundle)
    state = torch.load(ck / "checkpoint.pt", weights_only=True)
    head = head_for_target(_target_module(m), int(m.target.features["dim"]), state["d2t"].numel())
    head.load_state_dict(state["head"])
    head.eval()
    if not torch.equal(head.d2t, torch.from_numpy(d2t)):
        print("warning: the checkpoint's draft vocabulary differs from the bundle's", file=sys.stderr)
    a_rows = []
    for (_, prompt, seq), f, lab in zip(seqs, feats, labels):
        L = len(seq)
        ids = torch.tensor([seq[1:]])  # slot j: token j + 1
        fe = torch.from_numpy(f[: L - 1].astype(np.float32))[None]
        with torch.no_grad():
            outs = head.forward_unrolled(ids, fe, k)
        preds = [head.d2t[o[0].argmax(-1)].numpy() for o in outs]  # step s at slot i: start slot i - s
        # answer slots: start slot j with j + 1 >= len(prompt) (the label at j + 1 is an answer token)
        # and room for k steps: j + s + 1 <= L - 1
        for j in range(len(prompt) - 1, L - 1 - k):
            a_rows.append([preds[s][j + s] == lab[j + s + 1] for s in range(k)])
    a = chain_stats(np.asarray(a_rows, dtype=bool), k)

    # (b) the bundle's ONNX head graph over the same features
    hb = OrtHeadBackend(m, m.head, threads=args.threads)
    b_rows, b0 = [], []
    rng = np.random.RandomState(0)
    for (_, prompt, seq), f, lab in zip(seqs, feats, labels):
        L = len(seq)
        f32 = f.astype(np.float32)
        step0, hid0 = np.zeros(L - 1, dtype=np.int64), np.zeros((L - 1, m.head.hidden_size), np.float32)
        for s in range(0, L - 1, m.prefill_chunk):
            e = min(s + m.prefill_chunk, L - 1)
            lg, hd = hb.step(seq[s + 1 : e + 1], s, features=f32[s:e])
            step0[s:e] = d2t[lg.argmax(-1)]
            hid0[s:e] = hd
        b0 += [step0[j] == lab[j + 1] for j in range(len(prompt) - 1, L - 1)]
        starts = [j for j in range(len(prompt) - 1, L - 1 - k)]
        for j in sorted(rng.choice(starts, size=min(24, len(starts)), replace=False)):
            # head cache: slots 0..j hold step 0 (the prefill above wrote them all; the chain
            # overwrites slots > j, so re-prefill the sequence's slots afterwards)
            row = [step0[j] == lab[j + 1]]
            hidden = hid0[j : j + 1].copy()
            for s in range(1, k):
                lg, hd = hb.step([seq[j + s + 1]], j + s, hidden=hidden)  # teacher token
                hidden = hd[-1:].copy()
                row.append(d2t[lg[-1].argmax()] == lab[j + s + 1])
            b_rows.append(row)
            for s in range(j + 1, min(j + k, L - 1), m.prefill_chunk):  # restore step-0 slots j+1..j+k-1
                e = min(s + m.prefill_chunk, j + k, L - 1)
                hb.step(seq[s + 1 : e + 1], s, features=f32[s:e])
    hb.close()
    b = chain_stats(np.asarray(b_rows, dtype=bool), k)
    b["top1_step0_all_answer_slots"] = round(float(np.mean(b0)), 4)

    # (c) runtime proposals against what the target emitted
    pipe = load(bundle, draft="head", threads=args.threads, warmup=False)
    real = pipe.drafter.propose
    first = [0, 0]
    later = [[0, 0] for _ in range(k - 1)]
    tot = {"tokens": 0, "target_calls": 0, "drafted": 0, "accepted": 0}
    equal = 0
    for _cat, prompt, seq in seqs:
        seen = []

        def spy(history, kk, params, rng=None):
            prop = real(history, kk, params, rng)
            seen.append((len(history), list(prop.tokens)))
            return prop

        pipe.drafter.propose = spy
        r = pipe.generate(token_ids=prompt, max_new_tokens=args.max_new_tokens, spec_tokens=k, guard=False)
        pipe.drafter.propose = real
        out = list(prompt) + list(r.token_ids)
        equal += out == seq
        for n, drafts in seen:
            for j, d in enumerate(drafts):
                if n + j >= len(out):
                    break
                ok = d == out[n + j]
                if j == 0:
                    first[0] += ok
                    first[1] += 1
                else:
                    later[j - 1][0] += ok
                    later[j - 1][1] += 1
                if not ok:
                    break
        for key in tot:
            tot[key] += int(r.stats[key])
    pipe.close()
    c = {
        "proposals": first[1],
        "top1_step0": round(first[0] / max(first[1], 1), 4),
        "top1_given_previous_right": [round(h / max(n, 1), 4) if n else None for h, n in later],
        "acceptance_rate": round(tot["accepted"] / max(tot["drafted"], 1), 4),
        "tokens_per_target_call": round(tot["tokens"] / max(tot["target_calls"], 1), 3),
        "outputs_equal_target_only": f"{equal}/{len(seqs)}",
    }

    res = {
        "kind": "head_diagnose",
        "bundle": str(bundle),
        "target_precision": m.target.precision,
        "k": k,
        "prompts": len(seqs),
        "max_new_tokens": args.max_new_tokens,
        "head_training": m.head.extra.get("training"),
        "checkpoint_step": int(state["step"]),
        "a_torch": a,
        "b_onnx": b,
        "c_runtime": c,
        "seconds": round(time.time() - t0, 1),
        "loadavg": os.getloadavg(),
    }
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
