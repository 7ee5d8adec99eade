# ruff: noqa: E402, E741  (an experiment script: imports follow its sys.path set-up)
"""What limits a draft head's acceptance: data mix, optimizer steps, lm_head initialisation (issue 14).

    python benchmarks/experiments/heads/head_experiment.py BUNDLE WORKDIR prep DOC_TOKENS
    python benchmarks/experiments/heads/head_experiment.py BUNDLE WORKDIR prep_sampled data_DOC_TOKENS N TEMPERATURE
    python benchmarks/experiments/heads/head_experiment.py BUNDLE WORKDIR prep_many data_DOC_TOKENS ANSWER_BUNDLE N
    python benchmarks/experiments/heads/head_experiment.py BUNDLE WORKDIR train '{"name": ..., "data": "data_DOC_TOKENS", ...}'
    python benchmarks/experiments/heads/head_experiment.py BUNDLE WORKDIR prep_heldout
    python benchmarks/experiments/heads/head_experiment.py BUNDLE WORKDIR prep_soft DATA K
    python benchmarks/experiments/heads/head_experiment.py BUNDLE WORKDIR soft_stats DATA OUT.json

BUNDLE: exported with --features. `prep` saves the held-out set of benchmarks/experiments/heads/head_diagnose.py (the
target's own answers to its 12 prompts, neither training prompts nor the bench suite) and
train-draft's data (specedge/training/data.py: answers to every prompt of prompts.py, 160 tokens
each, plus DOC_TOKENS of pydoc text) under WORKDIR. `train` trains one variant with train.py's
loss and batches (keys: doc_limit: doc tokens kept, in order; init: "scratch" or "target" (lm_head
rows and final norm copied from the target's); opt_steps; lr; batch; seq_len; draft_vocab; unroll;
eval_every; save; bf16: the step's matmuls in bfloat16, as train-draft's --train-dtype) and appends held-out chain statistics (head_diagnose's path (a), teacher-forced,
k = 4) every eval_every steps to WORKDIR/exp_log.jsonl. `prep_sampled` adds N answers per prompt
sampled at TEMPERATURE to the greedy answers of a prepared data folder (more contexts, the same
greedy labels). `prep_heldout` makes the held-out set alone (for a DATA folder made elsewhere, e.g.
train-draft's own `.NAME.train-draft/`), `prep_soft` the target's top-K distribution at every
position of DATA, which `"soft": true` (with `"soft_k"`) trains on as train-draft's
`--soft-labels` does; `soft_stats` how sure the target is there. Results: benchmarks/experiments/heads/results/experiment.jsonl.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import head_diagnose as HD
import torch

from specedge.manifest import load_manifest
from specedge.models.eagle_head import head_for_target
from specedge.training import train as T
from specedge.training.data import Distilled, build_data, save_data, target_rows

B, W = Path(sys.argv[1]), Path(sys.argv[2])


def prep(doc_tokens):
    m = load_manifest(B, verify="size")
    t0 = time.time()
    prep_heldout()
    print("heldout", time.time() - t0, flush=True)
    d = build_data(
        B,
        m,
        answer_tokens=160,
        doc_tokens=doc_tokens,
        seq_len=256,
        threads=2,
        say=lambda st, a, b: print(st, a, b, flush=True) if a % 10 == 0 or a == b else None,
    )
    save_data(d, W / f"data_{doc_tokens}", {"doc_tokens": doc_tokens})
    print("data", d.num_tokens, time.time() - t0, flush=True)


def prep_sampled(src, n, temperature):
    """WORKDIR/data_sampled{n}: the answers of WORKDIR/SRC (greedy, train-draft's) plus n more per
    prompt sampled at `temperature` (seed = prompt index * 100 + j), every sequence labelled with the
    target's greedy choice at each position as train-draft does: more contexts, the same teacher."""
    from specedge.runtime.api import load
    from specedge.training.prompts import distill_prompts

    m = load_manifest(B, verify="size")
    z = np.load(W / src / "data.npz")
    meta = json.loads((W / src / "data.json").read_text())
    off = z["offsets"]
    cut = lambda a: [a[off[i] : off[i + 1]] for i in range(off.size - 1)]
    base = Distilled(cut(z["tokens"]), cut(z["features"]), cut(z["labels"]), meta["sources"])
    keep = [i for i, s in enumerate(base.sources) if s.startswith("answer:")]
    t0 = time.time()
    pipe = load(B, threads=2, warmup=False)
    seqs = []
    try:
        for i, (cat, msg) in enumerate(distill_prompts()):
            ids = pipe.tokenizer.encode_chat([{"role": "user", "content": msg}])
            for j in range(n):
                r = pipe.generate(token_ids=ids, max_new_tokens=160, temperature=temperature, seed=100 * i + j)
                seqs.append((f"answer:{cat}", list(ids) + list(r.token_ids)))
            if i % 10 == 0:
                print("sampled", i, len(seqs), round(time.time() - t0), flush=True)
    finally:
        pipe.close()
    f, l, _ = target_rows(m, [q for _, q in seqs], 2, lambda d, t: None)
    d = Distilled(
        [base.tokens[i] for i in keep] + [np.asarray(q, dtype=np.int64) for _, q in seqs],
        [base.features[i] for i in keep] + f,
        [base.labels[i] for i in keep] + l,
        [base.sources[i] for i in keep] + [c for c, _ in seqs],
    )
    save_data(d, W / f"data_sampled{n}", {"from": src, "sampled_per_prompt": n, "temperature": temperature})
    print("data", d.num_tokens, round(time.time() - t0), flush=True)


def many_prompts() -> list[tuple[str, str]]:
    """The prompts of `prep_many`: train-draft's more_prompts (moved there after experiment F)."""
    from specedge.training.prompts import more_prompts

    return more_prompts()


def prep_many(src, answer_bundle, limit):
    """WORKDIR/data_many{N}: the greedy answers of WORKDIR/SRC plus N more prompts (many_prompts)
    answered greedily by ANSWER_BUNDLE (a faster build of the same model, e.g. its int4 target on
    specedge's kernels: the contexts), every sequence labelled, with features, by BUNDLE's target
    (the teacher) as train-draft does."""
    from specedge.runtime.api import load

    m = load_manifest(B, verify="size")
    z = np.load(W / src / "data.npz")
    meta = json.loads((W / src / "data.json").read_text())
    off = z["offsets"]
    cut = lambda a: [a[off[i] : off[i + 1]] for i in range(off.size - 1)]
    base = Distilled(cut(z["tokens"]), cut(z["features"]), cut(z["labels"]), meta["sources"])
    keep = [i for i, s in enumerate(base.sources) if s.startswith("answer:")]
    prompts = many_prompts()[:limit]
    t0 = time.time()
    pipe = load(answer_bundle, threads=2, warmup=False)
    seqs = []
    try:
        for i, (cat, msg) in enumerate(prompts):
            ids = pipe.tokenizer.encode_chat([{"role": "user", "content": msg}])
            r = pipe.generate(token_ids=ids, max_new_tokens=160)
            seqs.append((f"answer:{cat}", list(ids) + list(r.token_ids)))
            if i % 50 == 0:
                print("answered", i, len(prompts), round(time.time() - t0), flush=True)
    finally:
        pipe.close()
    f, l, _ = target_rows(m, [q for _, q in seqs], 2, lambda d, t: None)
    d = Distilled(
        [base.tokens[i] for i in keep] + [np.asarray(q, dtype=np.int64) for _, q in seqs],
        [base.features[i] for i in keep] + f,
        [base.labels[i] for i in keep] + l,
        [base.sources[i] for i in keep] + [c for c, _ in seqs],
    )
    save_data(d, W / f"data_many{len(seqs)}", {"from": src, "answer_bundle": str(answer_bundle), "prompts": len(seqs)})
    print("data", d.num_tokens, len(seqs), round(time.time() - t0), flush=True)


def prep_heldout():
    """WORKDIR/heldout.npz alone (prep's first half), for a WORKDIR whose data comes from elsewhere."""
    m = load_manifest(B, verify="size")
    seqs = HD.held_out_sequences(B, 96, 2)
    f, l, _ = target_rows(m, [s for _, _, s in seqs], 2, lambda d, t: None)
    np.savez(
        W / "heldout.npz",
        **{f"seq{i}": np.asarray(s) for i, (_, _, s) in enumerate(seqs)},
        **{f"plen{i}": np.asarray(len(p)) for i, (_, p, _) in enumerate(seqs)},
        **{f"f{i}": x for i, x in enumerate(f)},
        **{f"l{i}": x for i, x in enumerate(l)},
        n=np.asarray(len(seqs)),
    )


def prep_soft(src, k):
    """WORKDIR/SRC/soft.npz: the target's K most probable next tokens at every position of SRC's
    sequences (train-draft's data.top_k_probs: ids int32, probabilities float16, aligned with its
    labels), for `"soft": true`."""
    m = load_manifest(B, verify="size")
    z = np.load(W / src / "data.npz")
    off = z["offsets"]
    t0 = time.time()
    _, _, (ids, p) = target_rows(
        m,
        [z["tokens"][off[i] : off[i + 1]].tolist() for i in range(off.size - 1)],
        2,
        lambda d, t: print("soft", d, t, round(time.time() - t0), flush=True) if d % 50 == 0 else None,
        k,
    )
    np.savez(W / src / "soft.npz", ids=np.concatenate(ids), p=np.concatenate(p))
    print("soft done", round(time.time() - t0), flush=True)


def soft_stats(src, out):
    """How sure the target is over SRC's positions (its top-1 probability, from prep_soft's
    soft.npz), written as JSON to OUT: why its argmax alone is a poor label."""
    p = np.load(W / src / "soft.npz")["p"].astype(np.float32)
    top1 = p.max(axis=1)
    res = {
        "kind": "head_soft_label_stats",
        "data": src,
        "positions": int(top1.size),
        "k": int(p.shape[1]),
        "mean_top1_p": round(float(top1.mean()), 4),
        "median_top1_p": round(float(np.median(top1)), 4),
        "share_top1_p_below_0.5": round(float((top1 < 0.5).mean()), 4),
        "share_top1_p_above_0.9": round(float((top1 > 0.9).mean()), 4),
        "mean_top_k_mass": round(float(p.sum(axis=1).mean()), 4),
    }
    Path(out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res), flush=True)


def heldout_eval(head, k=4):
    z = np.load(W / "heldout.npz")
    rows = []
    head.eval()
    for i in range(int(z["n"])):
        seq, plen, f, lab = z[f"seq{i}"], int(z[f"plen{i}"]), z[f"f{i}"], z[f"l{i}"]
        L = len(seq)
        ids = torch.from_numpy(np.asarray(seq[1:], dtype=np.int64))[None]
        fe = torch.from_numpy(f[: L - 1].astype(np.float32))[None]
        with torch.no_grad():
            outs = head.forward_unrolled(ids, fe, k)
        preds = [head.d2t[o[0].argmax(-1)].numpy() for o in outs]
        for j in range(plen - 1, L - 1 - k):
            rows.append([preds[s][j + s] == lab[j + s + 1] for s in range(k)])
    head.train()
    return HD.chain_stats(np.asarray(rows, dtype=bool), k)


def train(cfg):
    name = cfg["name"]
    doc_limit = cfg.get("doc_limit")
    init = cfg.get("init", "scratch")
    lr = cfg.get("lr", 2e-3)
    steps_opt = cfg["opt_steps"]
    ev = cfg.get("eval_every", 40)
    batch = cfg.get("batch", 4)
    seq_len = cfg.get("seq_len", 256)
    dv = cfg.get("draft_vocab", 8192)
    unroll = cfg.get("unroll", 3)
    warm = cfg.get("warmup", 20)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    m = load_manifest(B, verify="size")
    z = np.load(W / cfg["data"] / "data.npz")
    meta = json.loads((W / cfg["data"] / "data.json").read_text())
    off = z["offsets"]
    cut = lambda a: [a[off[i] : off[i + 1]] for i in range(off.size - 1)]
    data = Distilled(cut(z["tokens"]), cut(z["features"]), cut(z["labels"]), meta["sources"])
    if doc_limit is not None:
        keep, used = [], 0
        for i, s in enumerate(data.sources):
            if s.startswith("doc:"):
                if used >= doc_limit:
                    continue
                used += data.tokens[i].size
            keep.append(i)
        data = Distilled(*[[x[i] for i in keep] for x in (data.tokens, data.features, data.labels, data.sources)])
    vocab = min(m.tokenizer_vocab_size, m.target.vocab_size)
    d2t = T.draft_vocabulary(data, dv, vocab, m.eos_token_ids)
    target = T._target_module(m)
    head = head_for_target(target, int(m.target.features["dim"]), d2t.size)
    head.d2t.copy_(torch.from_numpy(d2t))
    if init == "target":
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight[torch.from_numpy(d2t)])
            head.norm.weight.copy_(target.norm.weight)
    del target
    head.set_feature_scale(T.feature_rms(data, len(m.target.features["layers"])))
    t2d = np.full(vocab, -100, dtype=np.int64)
    t2d[d2t] = np.arange(d2t.size)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    wins = T._windows(data, seq_len)
    soft = cfg.get("soft")
    if soft:
        zs = np.load(W / cfg["data"] / "soft.npz")
        kk = int(cfg.get("soft_k", zs["ids"].shape[1]))
        assert doc_limit is None, "soft labels index the whole data"
        data.soft_ids, data.soft_p = cut(zs["ids"]), cut(zs["p"])
    print(name, "data tokens", data.num_tokens, "windows", len(wins), flush=True)
    t0 = time.time()
    acc_ema = None
    for step in range(steps_opt):
        epoch, pos = divmod(step * batch, len(wins))
        order = np.random.RandomState(epoch).permutation(len(wins))
        pick = [wins[order[(pos + b) % len(wins)]] for b in range(batch)]
        ids, feats, dl, lab = T._batch(data, pick, t2d, seq_len)
        w = min(1.0, (step + 1) / warm)
        for g in opt.param_groups:
            g["lr"] = lr * w * max(0.05, 1 - step / steps_opt)
        sb = T._soft_batch(data, pick, t2d, seq_len, kk) if soft else None
        with T.step_autocast("cpu", "bf16" if cfg.get("bf16") else "fp32"):
            loss, hits, n = T._loss(head, ids, feats, dl, lab, unroll, head.d2t, sb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        a = hits / max(n, 1)
        acc_ema = a if acc_ema is None else 0.9 * acc_ema + 0.1 * a
        if (step + 1) % ev == 0 or step + 1 == steps_opt:
            st = heldout_eval(head)
            rec = {
                "name": name,
                "step": step + 1,
                "epoch": round(step * batch / len(wins), 2),
                "loss": round(float(loss.detach()), 3),
                "train_top1": round(acc_ema, 3),
                "held": st,
                "s": round(time.time() - t0),
            }
            print(json.dumps(rec), flush=True)
            with open(W / "exp_log.jsonl", "a") as fh:
                fh.write(json.dumps(rec) + "\n")
    if cfg.get("save"):
        torch.save({"head": head.state_dict(), "d2t": head.d2t}, W / f"{name}.pt")


if __name__ == "__main__":
    if sys.argv[3] == "prep":
        prep(int(sys.argv[4]))
    elif sys.argv[3] == "prep_sampled":
        prep_sampled(sys.argv[4], int(sys.argv[5]), float(sys.argv[6]))
    elif sys.argv[3] == "prep_heldout":
        prep_heldout()
    elif sys.argv[3] == "prep_soft":
        prep_soft(sys.argv[4], int(sys.argv[5]))
    elif sys.argv[3] == "soft_stats":
        soft_stats(sys.argv[4], sys.argv[5])
    elif sys.argv[3] == "prep_many":
        prep_many(sys.argv[4], sys.argv[5], int(sys.argv[6]))
    else:
        train(json.loads(sys.argv[4]))
