"""`specedge train-draft`: train an EAGLE-3-style draft head for a bundle's target and write it in.

1. data (data.py): self-distilled sequences with the target's features and greedy labels, saved in
   the checkpoint folder so that a resumed run does not build them again;
2. windows of `seq_len` slots at half overlap, each slot scored once with its left context
   (`_windows`), and the features' RMS per tapped layer, which the head divides by;
   the draft vocabulary: the `draft_vocab` labels most frequent in the data (the tokens the target
   actually emits), plus its end-of-sequence ids; labels outside it cannot be proposed and count as
   misses in the accuracy, but not in the loss;
3. training with the training-time test (EagleHead.forward_unrolled): every step unrolls `steps`
   chain steps, each fed the head's own hidden states, and the loss weighs step s by 0.8^s; the
   label of a slot is the target's distribution over its `soft_labels` most probable tokens (those
   in the draft vocabulary, renormalised), as EAGLE distils, or with 0 its argmax alone;
   AdamW with linear warm-up and (for a token budget) linear decay; deterministic under `seed`;
4. a checkpoint (head, optimizer, step, tokens) every `checkpoint_every_s` seconds, from which a
   later run resumes; it records the target's fingerprint, and a checkpoint of another target
   is refused;
5. the head written into the bundle atomically (export/head_graph.py `write_head`).

Nothing in the bundle changes before step 5, so an interrupted or failed run leaves it as it was.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError, write_failure
from ..manifest import MAX_MAX_SEQ, Manifest, load_manifest, target_fingerprint
from ..runtime.sampling import check_seed
from .paths import check_paths, clean_leftovers, lock_bundle, signals_held

__all__ = ["TrainOptions", "parse_budget", "train_draft"]

# which prompt list the saved data answers (2: prompts.training_prompts); data of another is rebuilt
PROMPT_SET = 2
STEP_WEIGHT = 0.8  # loss weight of chain step s: 0.8^s (later steps matter less: fewer rounds reach them)


@dataclass
class TrainOptions:
    # training tokens ("200000", "200k") or minutes of wall time for the whole run ("30m")
    # held-out acceptance still rises at this budget on the default data
    # (benchmarks/history/heads.md, head_experiment.py variant F)
    budget: str = "1M"
    seed: int = 0
    device: str = "cpu"
    steps: int = 3  # chain steps unrolled by the training-time test
    draft_vocab: int = 8192
    seq_len: int = 256
    batch: int = 4
    lr: float = 2e-3
    warmup: int = 20
    answer_tokens: int = 160  # new tokens written per prompt
    sampled_answers: int = 0  # answers per prompt sampled besides the greedy one
    answers_by: str = "auto"  # who writes the answers: target, draft, auto (the self-draft when there is one)
    doc_tokens: int = 0  # tokens of documentation text (24k of it gave no held-out gain: benchmarks/history/heads.md)
    soft_labels: int = 32  # the target's top-K distribution as each slot's label; 0: its argmax only
    # matmuls of the training step in bfloat16 (weights and optimizer stay float32): auto = where
    # the device computes bfloat16 natively (1.82x the steps per second on an AVX512-BF16 CPU:
    # benchmarks/history/heads.md, head_experiment.py variant H)
    train_dtype: str = "auto"
    max_prompts: int | None = None  # None: every prompt of prompts.training_prompts
    threads: int | None = None
    checkpoint: str | None = None  # folder; default: .<bundle>.train-draft next to the bundle
    resume: bool = True
    checkpoint_every_s: float = 60.0


def parse_budget(text) -> tuple[str, float]:
    """("tokens", n) or ("minutes", m) from '200000', '200k', '1.5M' (tokens) or '30m', '30min'."""
    raw = str(text).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(k|K|M|m|min|minutes)?", raw)
    if not m:
        raise UserError(f"--budget must be a number of tokens (200000, 200k, 1.5M) or minutes (30m), got '{raw}'")
    value, unit = float(m.group(1)), m.group(2) or ""
    if unit in ("m", "min", "minutes"):
        kind, amount = "minutes", value
    else:
        kind, amount = "tokens", value * {"": 1, "k": 1e3, "K": 1e3, "M": 1e6}[unit]
    if amount <= 0:
        raise UserError(f"--budget must be more than 0, got '{raw}'")
    if not amount <= (1e15 if kind == "tokens" else 1e9):
        raise UserError(f"--budget must be at most 1e15 tokens or 1e9 minutes, got '{raw}'")
    return kind, amount


# (option, lowest, highest): the highest far above any useful value, low enough that no size derived
# from it overflows or asks for absurd memory before the first step
_BOUNDS = (
    ("steps", 1, 64),
    ("draft_vocab", 2, 4_000_000),
    ("seq_len", 8, MAX_MAX_SEQ),
    ("batch", 1, 1 << 16),
    ("warmup", 0, 1 << 30),
    ("answer_tokens", 0, MAX_MAX_SEQ),
    ("doc_tokens", 0, 1 << 30),
    ("sampled_answers", 0, 1000),
    ("soft_labels", 0, 1024),
)


def _check_options(o: TrainOptions) -> None:
    if o.device not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda, got '{o.device}'")
    for name, lo, hi in _BOUNDS:
        v = getattr(o, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise UserError(f"--{name.replace('_', '-')} must be an integer of at least {lo}, got {v!r}")
        if v > hi:
            raise UserError(f"--{name.replace('_', '-')} must be at most {hi}, got {v}")
    from ..runtime.api import MAX_THREADS

    for name, v, hi in (("max-prompts", o.max_prompts, 1 << 20), ("threads", o.threads, MAX_THREADS)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi):
            raise UserError(f"--{name} must be an integer from 1 to {hi}, got {v!r}")
    if o.train_dtype not in ("auto", "fp32", "bf16"):
        raise UserError(f"--train-dtype must be auto, fp32 or bf16, got '{o.train_dtype}'")
    if o.answers_by not in ("auto", "target", "draft"):
        raise UserError(f"--answers-by must be auto, target or draft, got '{o.answers_by}'")
    if not (o.lr > 0 and math.isfinite(o.lr)):
        raise UserError(f"--lr must be a finite number more than 0, got {o.lr}")
    try:
        check_seed(o.seed, "--seed")
    except ValueError as e:
        raise UserError(str(e)) from None
    if o.answer_tokens == 0 and o.doc_tokens == 0:
        raise UserError("no training data: --answer-tokens and --doc-tokens are both 0")


def default_checkpoint(bundle: Path) -> Path:
    return bundle.resolve().parent / f".{bundle.resolve().name}.train-draft"


def _windows(data, seq_len: int) -> list[tuple[int, int, int]]:
    """(sequence, start, first scored slot) of every training window. A sequence of L tokens has
    L - 1 slots (slot j: features of token j, token j + 1, the target's label at j + 1); windows of
    `seq_len` slots start every seq_len // 2 slots, and each window after a sequence's first scores
    only the slots the window before did not hold, so every slot is trained with at least
    seq_len // 2 slots of left context (all it has, near the start) and scored exactly once."""
    half = max(seq_len // 2, 1)
    out = []
    for i, t in enumerate(data.tokens):
        slots = t.size - 1
        if slots < 1:
            continue
        out.append((i, 0, 0))
        start = half
        while start + seq_len - half < slots:  # the window before ended at slot start + seq_len - half - 1
            out.append((i, start, seq_len - half))
            start += half
    return out


def _batch(data, wins, t2d, seq_len: int):
    """ids [B, W], features [B, W, F] (float32), draft labels [B, W] (-100: none), target labels
    (-1: none, and for the slots a window does not score)."""
    import torch

    B, W = len(wins), seq_len
    F = data.features[0].shape[1]
    ids = np.zeros((B, W), dtype=np.int64)
    feats = np.zeros((B, W, F), dtype=np.float32)
    lab = np.full((B, W), -1, dtype=np.int64)
    for b, (i, s, first) in enumerate(wins):
        tok, fe, la = data.tokens[i], data.features[i], data.labels[i]
        n = min(W, tok.size - 1 - s)  # slot j: features of s + j, token s + j + 1, label at s + j + 1
        ids[b, :n] = tok[s + 1 : s + 1 + n]
        feats[b, :n] = fe[s : s + n]
        lab[b, first:n] = la[s + 1 + first : s + 1 + n]
    dl = np.where(lab >= 0, t2d[np.maximum(lab, 0)], -100)
    return torch.from_numpy(ids), torch.from_numpy(feats), torch.from_numpy(dl), torch.from_numpy(lab)


def _soft_batch(data, wins, t2d, seq_len: int, k: int):
    """The soft labels of the slots `_batch` labels, laid out as its labels: draft ids [B, W, k]
    (-100: outside the draft vocabulary, or no label) and the target's probabilities [B, W, k],
    renormalised over the ids inside (a slot with none inside has all zeros)."""
    import torch

    B, W = len(wins), seq_len
    ids = np.full((B, W, k), -1, dtype=np.int64)
    p = np.zeros((B, W, k), dtype=np.float32)
    for b, (i, s, first) in enumerate(wins):
        n = min(W, data.tokens[i].size - 1 - s)
        ids[b, first:n] = data.soft_ids[i][s + 1 + first : s + 1 + n, :k]
        p[b, first:n] = data.soft_p[i][s + 1 + first : s + 1 + n, :k]
    d = np.where(ids >= 0, t2d[np.maximum(ids, 0)], -100)
    p = np.where(d >= 0, p, 0.0)
    p /= np.maximum(p.sum(-1, keepdims=True), 1e-12)
    return torch.from_numpy(d), torch.from_numpy(p.astype(np.float32))


def feature_rms(data, layers: int) -> np.ndarray:
    """RMS of each tapped layer's block of feature columns over every position of the data."""
    sq, n = np.zeros(layers, dtype=np.float64), 0
    for f in data.features:
        x = f.astype(np.float32).reshape(f.shape[0], layers, -1)
        sq += np.square(x, dtype=np.float64).mean(axis=2).sum(axis=0)
        n += f.shape[0]
    return np.sqrt(sq / max(n, 1))


def draft_vocabulary(data, size: int, vocab: int, eos_ids) -> np.ndarray:
    """The `size` labels most frequent in the data (ties to the lower id), eos ids first."""
    counts = np.bincount(np.concatenate(data.labels), minlength=vocab)[:vocab].astype(np.int64)
    size = min(size, vocab)
    keep = [int(e) for e in eos_ids if e < vocab][:size]
    order = np.lexsort((np.arange(vocab), -counts))
    chosen = set(keep)
    for t in order:
        if len(keep) >= size:
            break
        if int(t) not in chosen:
            keep.append(int(t))
            chosen.add(int(t))
    return np.asarray(sorted(keep), dtype=np.int64)


def _target_module(manifest: Manifest):
    """The target as a specedge.models module, from the checkpoint the bundle was exported from:
    the head copies its token embedding and rotary embedding."""
    from ..checkpoints import resolve
    from ..export import sources
    from ..models import build_model, load_weights

    src = manifest.target.source
    try:
        resolve(src)
    except UserError as e:
        raise UserError(f"the target's checkpoint '{src}' is needed to train a head (its embedding): {e}") from None
    ck = sources.load(src)
    model = build_model(ck.config)
    load_weights(model, ck.state_dict)
    return model


def uses_bf16(device, train_dtype: str) -> bool:
    """Whether a training step on `device` runs its matmuls in bfloat16 (--train-dtype)."""
    return train_dtype == "bf16" or (train_dtype == "auto" and native_bf16(device))


def native_bf16(device) -> bool:
    """Whether `device` computes bfloat16 matmuls natively: a CUDA device that says so, or a CPU
    with AVX512-BF16 or AMX. Elsewhere bfloat16 is emulated and slower than float32."""
    import torch

    if torch.device(device).type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    cpu = torch.cpu
    return any(
        bool(getattr(cpu, probe, lambda: False)()) for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )


def step_autocast(device, train_dtype: str):
    """The autocast context of a training step: bfloat16 matmuls for "bf16", and for "auto" where
    `native_bf16`; float32 otherwise. Softmax and the loss stay float32 (autocast's own policy,
    and the head's logits are cast to float32)."""
    import torch

    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=uses_bf16(device, train_dtype))


def _loss(head, ids, feats, dl, lab, steps: int, d2t, soft=None):
    """Cross-entropy of each unrolled step against the draft labels `dl`, or with `soft` (draft
    ids, probabilities: _soft_batch) against the target's distribution; weighted by 0.8^step.
    Also the step-0 top-1 hits against the target's labels `lab`, and how many were scored."""
    import torch
    from torch.nn import functional as F

    outs = head.forward_unrolled(ids, feats, steps)
    total, weight = 0.0, 0.0
    for s, logits in enumerate(outs):
        if soft is None:
            tgt = dl[:, s:]
            if not (tgt != -100).any():
                continue
            ce = F.cross_entropy(logits[:, s:].reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
        else:
            sid, sp = soft[0][:, s:], soft[1][:, s:]
            rows = sp.sum(-1) > 0
            if not rows.any():
                continue
            logp = F.log_softmax(logits[:, s:], -1).gather(-1, sid.clamp(min=0))
            ce = -(sp * logp).sum(-1)[rows].mean()
        total = total + (STEP_WEIGHT**s) * ce
        weight += STEP_WEIGHT**s
    with torch.no_grad():
        valid = lab >= 0
        pred = d2t[outs[0].argmax(-1)]
        hits, n = int(((pred == lab) & valid).sum()), int(valid.sum())
    return total / max(weight, 1e-9), hits, n


def train_draft(bundle, opts: TrainOptions | None = None, progress=None) -> Manifest:
    """Train a head for `bundle`'s target and write it into the bundle; returns the new manifest.
    `progress(stage, done, total, info)` is told how far each stage is (the CLI draws bars)."""
    from ..export.extras import require_export_extra

    o = opts or TrainOptions()
    _check_options(o)
    require_export_extra()  # torch, onnx: one error line naming the extra when they are missing
    import torch

    kind, amount = parse_budget(o.budget)
    say = progress or (lambda stage, done, total, info=None: None)
    bundle = Path(bundle)
    m = load_manifest(bundle, verify="size")
    if not m.target.features:
        raise UserError(
            f"the target graph of '{bundle}' returns no features (a draft head needs them): "
            "re-export it with `export-models --features` (or `--draft head`)"
        )
    if o.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but torch sees no CUDA device here")
    ck_dir = Path(o.checkpoint) if o.checkpoint else default_checkpoint(bundle)
    check_paths(bundle, ck_dir)  # before minutes of work: a path this run could not write is refused now
    lock = lock_bundle(bundle)
    try:
        m = load_manifest(
            bundle, verify="size"
        )  # read again under the lock: a run that just ended may have added a head
        clean_leftovers(bundle, {rel.split("/")[0] for rel in m.files}, ck_dir)  # folders the manifest uses stay
        return _train(bundle, m, o, kind, amount, ck_dir, say)
    finally:
        os.close(lock)


def _train(bundle: Path, m: Manifest, o: TrainOptions, kind: str, amount: float, ck_dir: Path, say) -> Manifest:
    import torch

    from ..export.head_graph import write_head
    from ..models.eagle_head import head_for_target
    from .data import add_soft_labels, answer_writer, build_data, doc_piece_len, load_data, save_data

    t_start = time.monotonic()
    deadline = t_start + 60 * amount if kind == "minutes" else None
    fp = target_fingerprint(m)
    ck_file = ck_dir / "checkpoint.pt"
    state = None
    if o.resume and ck_file.is_file():
        try:
            state = torch.load(ck_file, weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many types for a damaged file
            raise UserError(
                f"the checkpoint '{ck_file}' cannot be read ({type(e).__name__}): remove it or pass --no-resume"
            ) from None
        if not isinstance(state, dict) or state.get("target_fingerprint") != fp:
            raise UserError(
                f"the checkpoint '{ck_file}' was trained for another target (its target checksum "
                "differs): remove it or pass --no-resume"
            )

    writer = answer_writer(m, o.answers_by) if o.answer_tokens > 0 else None
    data_meta = {
        "target_fingerprint": fp,
        "answer_tokens": o.answer_tokens,
        "doc_tokens": o.doc_tokens,
        "prompt_set": PROMPT_SET,
        "answers_by": writer,
        "seq_len": o.seq_len,
        "max_prompts": o.max_prompts,
        "doc_piece": doc_piece_len(m, o.seq_len),
        # sampled answers depend on the seed too
        "sampled_answers": o.sampled_answers,
        "sample_seed": o.seed if o.sampled_answers else None,
    }
    data = load_data(ck_dir, data_meta)  # the same target and data options make the same data
    if data is None:
        data = build_data(
            bundle,
            m,
            answer_tokens=o.answer_tokens,
            doc_tokens=o.doc_tokens,
            seq_len=o.seq_len,
            threads=o.threads,
            max_prompts=o.max_prompts,
            sampled_answers=o.sampled_answers,
            seed=o.seed,
            answers_by=o.answers_by,
            top_k=o.soft_labels,
            say=lambda stage, d, t: say(stage, d, t, None),
        )
        if not data.tokens:
            raise UserError(
                f"no training data could be made: every prompt leaves too little room for an answer "
                f"in the bundle's max_seq ({m.max_seq}); add documentation text with --doc-tokens N"
            )
        _save_data(save_data, data, ck_dir, data_meta)
    elif data.soft_k < o.soft_labels:
        # data saved by a run with fewer (or no) soft labels: label it again rather than write it again
        data = add_soft_labels(data, m, o.soft_labels, o.threads, lambda d, t: say("labels", d, t, None))
        _save_data(save_data, data, ck_dir, data_meta)

    data_seconds = time.monotonic() - t_start
    torch.manual_seed(o.seed)
    if o.threads:
        torch.set_num_threads(o.threads)
    vocab = min(m.tokenizer_vocab_size, m.target.vocab_size)
    d2t = draft_vocabulary(data, o.draft_vocab, vocab, m.eos_token_ids)
    target = _target_module(m)
    head = head_for_target(target, int(m.target.features["dim"]), d2t.size)
    del target
    head.d2t.copy_(torch.from_numpy(d2t))
    head.set_feature_scale(feature_rms(data, len(m.target.features["layers"])))
    t2d = np.full(vocab, -100, dtype=np.int64)
    t2d[d2t] = np.arange(d2t.size)
    dev = torch.device(o.device)
    head.to(dev)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=0.0, betas=(0.9, 0.95))
    wins = _windows(data, o.seq_len)
    # for the learning-rate schedule: the mean number of slots a window scores
    per_step = o.batch * sum(t.size - 1 for t in data.tokens) / max(len(wins), 1)
    total_steps = max(1, math.ceil(amount / per_step)) if kind == "tokens" else None
    step, tokens, hits_n, acc = 0, 0, [0, 0], 0.0
    if state is not None:
        if state.get("d2t") is not None and not torch.equal(state["d2t"], head.d2t):
            raise UserError(f"the checkpoint '{ck_file}' has another draft vocabulary: pass --no-resume")
        if "feature_scale" not in state["head"]:
            raise UserError(
                f"the checkpoint '{ck_file}' was written by an older train-draft (no feature scale): pass --no-resume"
            )
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, tokens = int(state["step"]), int(state["tokens"])
    d2t_dev = head.d2t
    step_dtype = "bf16" if uses_bf16(dev, o.train_dtype) else "fp32"  # probed once, not every step

    def lr_at(i: int) -> float:
        w = min(1.0, (i + 1) / max(o.warmup, 1))
        if total_steps is None:
            return o.lr * w
        return o.lr * w * max(0.05, 1.0 - i / total_steps)

    def save_checkpoint() -> None:
        tmp = ck_file.with_suffix(".tmp")
        try:
            ck_dir.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "head": head.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "tokens": tokens,
                    "target_fingerprint": fp,
                    "d2t": head.d2t.cpu(),
                    "options": asdict(o),
                },
                tmp,
            )
            os.replace(tmp, ck_file)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise write_failure(e, f"the checkpoint '{ck_file}'") from None

    last_save = time.monotonic()
    loss_ema = acc_ema = None
    head.train()
    total_tok = int(amount) if kind == "tokens" else None
    saved_step = step
    try:
        while True:
            if kind == "tokens" and tokens >= amount:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            epoch, pos = divmod(step * o.batch, len(wins))
            order = np.random.RandomState((o.seed + epoch) % 2**32).permutation(len(wins))
            pick = [wins[order[(pos + b) % len(wins)]] for b in range(o.batch)]
            ids, feats, dl, lab = (x.to(dev) for x in _batch(data, pick, t2d, o.seq_len))
            soft = (
                tuple(x.to(dev) for x in _soft_batch(data, pick, t2d, o.seq_len, o.soft_labels))
                if o.soft_labels
                else None
            )
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with step_autocast(dev, step_dtype):
                loss, hits, n = _loss(head, ids, feats, dl, lab, o.steps, d2t_dev, soft)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            tokens += n
            hits_n = [hits_n[0] + hits, hits_n[1] + n]
            lv = float(loss.detach())
            loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
            acc = hits / max(n, 1)
            acc_ema = acc if acc_ema is None else 0.9 * acc_ema + 0.1 * acc
            elapsed = time.monotonic() - t_start
            say(
                "training",
                tokens if total_tok else int(elapsed),
                total_tok or int(60 * amount),
                {"loss": loss_ema, "top1": acc_ema, "step": step},
            )
            if time.monotonic() - last_save >= o.checkpoint_every_s:
                save_checkpoint()
                last_save, saved_step = time.monotonic(), step
    except BaseException:
        # Ctrl-C, SIGTERM (raised as an exception by the CLI) or a failure: keep the steps made since
        # the last checkpoint, so that a later run resumes from them; a second signal waits.
        if step > saved_step:
            with signals_held():
                save_checkpoint()
        raise
    if step == 0:
        # a minutes budget counts the whole run: data building can use all of it, and a head that
        # never trained must not replace the bundle's (the data is saved: a second run starts training)
        raise UserError(
            f"the budget of {o.budget} was used up before the first training step "
            f"({time.monotonic() - t_start:.0f} s building or loading the data, saved in '{ck_dir}'): "
            "run again with a larger budget; nothing was written to the bundle"
        )
    save_checkpoint()
    head.eval().cpu()
    training = {
        "tokens": tokens,
        "steps": step,
        "loss": round(loss_ema or 0.0, 4),
        "top1": round(acc_ema or 0.0, 4),
        "top1_all_steps": round(hits_n[0] / max(hits_n[1], 1), 4),
        "seconds": round(time.monotonic() - t_start, 1),
        "data_seconds": round(data_seconds, 1),
        "seed": o.seed,
        "budget": str(o.budget),
        "data_tokens": data.num_tokens,
        "sequences": len(data.tokens),
        "unrolled_steps": o.steps,
        "soft_labels": o.soft_labels,
        "train_dtype": step_dtype,
        "answers_by": writer,
    }
    try:
        return write_head(bundle, head, training)
    except OSError as e:
        raise write_failure(e, f"the draft head into '{bundle}'") from None


def _save_data(save_data, data, ck_dir: Path, meta: dict) -> None:
    try:
        save_data(data, ck_dir, meta)
    except OSError as e:
        raise write_failure(e, f"the training data into '{ck_dir}'") from None
