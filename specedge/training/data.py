"""Self-distilled training data for a draft head: token sequences with the target's own features
and greedy choices at every position.

Sequences come from two sources on the machine: answers to the prompts of `prompts.py` (one
greedy answer per prompt, optionally more sampled ones, which give more contexts to learn the same
greedy choices in), and plain documentation text (pydoc). The answers are written either by the
bundle's runtime (the target itself) or, when the bundle carries a self-draft, by that int4 copy of
the target run alone (`write_with_draft`): faster than the speculating runtime on a small CPU
(benchmarks/experiments/heads/answer_writers.py), and the contexts are still the model's own wording. Either way the
labels below are the target's. Each sequence is then run through the
target graph in prefill chunks on ONNX Runtime, which returns, per position, the features the
runtime will hand the head (contract.FEATURES_OUTPUT) and the logits whose argmax is the label:
the token the target itself would choose there. With `top_k` the target's K most probable tokens
and their probabilities are kept too (`soft_ids`, `soft_p`): the head then learns the target's
distribution, not its argmax alone, which on a model often unsure of its top token
(benchmarks/history/heads.md, head_experiment.py variant G) carries much more per position. Features are stored in fp16 (half the memory;
the head sees fp32 at run time, a difference far below what training resolves).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from .prompts import DOC_MODULES, module_doc, training_prompts

__all__ = ["Distilled", "add_soft_labels", "answer_writer", "build_data", "load_data", "save_data", "top_k_probs"]


@dataclass
class Distilled:
    tokens: list[np.ndarray]  # int64 [L] per sequence
    features: list[np.ndarray]  # fp16 [L, F]
    labels: list[np.ndarray]  # int64 [L]: the target's argmax at each position
    sources: list[str]  # "answer:<category>" or "doc:<module>"
    # the target's top-K next tokens at each position, most probable first: int32 [L, K] and fp16 [L, K]
    soft_ids: list[np.ndarray] | None = None
    soft_p: list[np.ndarray] | None = None

    @property
    def soft_k(self) -> int:
        return int(self.soft_ids[0].shape[1]) if self.soft_ids else 0

    @property
    def num_tokens(self) -> int:
        return int(sum(t.size for t in self.tokens))


# temperature of the extra sampled answers: the target's own distribution, sharpened a little so
# the answers stay on topic; the labels stay the target's greedy choices whatever the context
SAMPLE_TEMPERATURE = 0.8


# an answer shorter than this teaches little: a prompt leaving less room in the context is skipped
MIN_ANSWER_TOKENS = 8


def answer_room(prompt_tokens: int, max_new_tokens: int, max_seq: int) -> int:
    """New tokens an answer may have after a prompt in a context of max_seq slots: max_new_tokens,
    cut to what fits (a short-context bundle still gets answers), or 0 when under MIN_ANSWER_TOKENS."""
    n = min(max_new_tokens, max_seq - prompt_tokens)
    return n if n >= min(MIN_ANSWER_TOKENS, max_new_tokens) else 0


def generate_answers(
    bundle, prompts, max_new_tokens: int, threads: int | None, say, sampled: int = 0, seed: int = 0
) -> list[tuple[str, list[int]]]:
    """(category, prompt + answer ids) for each prompt, answered greedily by the bundle's runtime,
    plus `sampled` answers per prompt sampled at SAMPLE_TEMPERATURE (seeded per prompt and answer
    from `seed`): more contexts the target itself writes, for the same teacher."""
    from ..runtime.api import load

    out = []
    pipe = load(bundle, threads=threads, warmup=False)
    try:
        for i, (cat, msg) in enumerate(prompts):
            messages = [{"role": "user", "content": msg}]
            tok = pipe.tokenizer
            ids = tok.encode_chat(messages) if tok.chat_template else tok.encode(msg)
            n = answer_room(len(ids), max_new_tokens, pipe.max_seq)
            if n == 0:
                say(i + 1, len(prompts))
                continue
            r = pipe.generate(token_ids=ids, max_new_tokens=n)
            out.append((cat, list(ids) + list(r.token_ids)))
            for j in range(sampled):
                r = pipe.generate(
                    token_ids=ids,
                    max_new_tokens=n,
                    temperature=SAMPLE_TEMPERATURE,
                    seed=(seed * 1_000_003 + i * 101 + j) % (1 << 62),
                )
                out.append((cat, list(ids) + list(r.token_ids)))
            say(i + 1, len(prompts))
    finally:
        pipe.close()
    return out


def answer_writer(manifest, answers_by: str) -> str:
    """Who writes the answers: "target" (the bundle's runtime) or "draft" (its draft model alone).
    "auto" takes the draft when it is a self-draft (the target's own checkpoint, quantized): on a
    CPU the int4 copy alone writes faster than the speculating fp32 target (1.6x), in the model's own
    wording, and the target still labels every position."""
    if answers_by not in ("auto", "target", "draft"):
        raise UserError(f"--answers-by must be auto, target or draft, got '{answers_by}'")
    d = manifest.draft
    if answers_by == "draft" and not d.is_model:
        raise UserError(
            "--answers-by draft needs a bundle with a draft model (this one drafts with n-gram "
            "lookup): use --answers-by target"
        )
    if answers_by == "auto":
        return "draft" if d.is_model and d.source == manifest.target.source else "target"
    return answers_by


def write_with_draft(
    manifest, prompts, max_new_tokens: int, threads: int | None, say, sampled: int = 0, seed: int = 0
) -> list[tuple[str, list[int]]]:
    """generate_answers' sequences written by the bundle's draft graph alone (greedy, then
    `sampled` answers at SAMPLE_TEMPERATURE, seeded per prompt and answer as generate_answers does),
    each ending at an end-of-sequence token or after max_new_tokens."""
    from ..runtime.api import Tokenizer
    from ..runtime.backends import create_backend
    from ..runtime.cache import CacheTracker
    from ..runtime.sampling import SamplingParams, make_rng, probs_from_logits, sample

    tok = Tokenizer(manifest)
    backend = create_backend("ort-cpu", manifest, manifest.draft, threads=threads)
    cache = CacheTracker(backend, manifest.prefill_chunk)
    vocab = min(manifest.tokenizer_vocab_size, backend.vocab_size)
    eos = set(int(e) for e in manifest.eos_token_ids)
    params = SamplingParams(temperature=SAMPLE_TEMPERATURE)

    def answer(ids, max_new_tokens: int, rng) -> list[int]:
        cache.reset()
        row = cache.feed_chunked(ids)
        out: list[int] = []
        while True:
            t = int(np.argmax(row[:vocab])) if rng is None else sample(probs_from_logits(row[:vocab], params), rng)
            out.append(t)
            if t in eos or len(out) >= max_new_tokens:
                return out
            row = cache.feed([t])[0]

    out = []
    try:
        for i, (cat, msg) in enumerate(prompts):
            ids = tok.encode_chat([{"role": "user", "content": msg}]) if tok.chat_template else tok.encode(msg)
            n = answer_room(len(ids), max_new_tokens, manifest.max_seq)
            if n == 0:
                say(i + 1, len(prompts))
                continue
            out.append((cat, list(ids) + answer(ids, n, None)))
            for j in range(sampled):
                out.append((cat, list(ids) + answer(ids, n, make_rng((seed * 1_000_003 + i * 101 + j) % (1 << 62)))))
            say(i + 1, len(prompts))
    finally:
        backend.close()
    return out


def doc_sequences(tokenizer, total_tokens: int, piece_len: int) -> list[tuple[str, list[int]]]:
    """Documentation text cut into sequences of `piece_len` tokens, `total_tokens` in all, taken
    round-robin over the modules so that a small budget still sees many of them. Training cuts
    them again into overlapping windows (train.py `_windows`), so long pieces keep left context."""
    per_module = []
    for name in DOC_MODULES:
        ids = tokenizer.encode(module_doc(name))
        pieces = [ids[i : i + piece_len] for i in range(0, len(ids) - piece_len // 2, piece_len)]
        per_module.append((name, pieces))
    out, used, r = [], 0, 0
    while used < total_tokens and any(r < len(p) for _, p in per_module):
        for name, pieces in per_module:
            if r < len(pieces) and used < total_tokens:
                out.append((f"doc:{name}", pieces[r]))
                used += len(pieces[r])
        r += 1
    return out


def top_k_probs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most probable tokens of each row of `logits` [T, V], most probable first (ties to the
    lower id), and their softmax probabilities over the whole row: int32 [T, k], fp16 [T, k]."""
    x = np.asarray(logits, dtype=np.float32)
    k = min(k, x.shape[1])
    part = np.argpartition(-x, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(x, part, 1)
    order = np.lexsort((part, -vals), axis=1)
    ids = np.take_along_axis(part, order, 1)
    top = np.take_along_axis(vals, order, 1)
    mx = x.max(axis=1, keepdims=True)
    p = np.exp(top - mx) / np.exp(x - mx).sum(axis=1, keepdims=True)
    return ids.astype(np.int32), p.astype(np.float16)


def target_rows(manifest, seqs: list[list[int]], threads: int | None, say, top_k: int = 0):
    """Features (fp16 [L, F]) and greedy labels ([L]) of every sequence, from the target graph, and
    with top_k > 0 its top_k tokens and probabilities at each position (else None):
    (features, labels, (soft_ids, soft_p) or None)."""
    from ..runtime.backends import create_backend

    backend = create_backend("ort-cpu", manifest, manifest.target, threads=threads)
    chunk = max(manifest.prefill_chunk, 64)
    vocab = manifest.tokenizer_vocab_size
    feats, labels, s_ids, s_p = [], [], [], []
    try:
        for n, seq in enumerate(seqs):
            ids = np.asarray(seq[: manifest.max_seq], dtype=np.int64)
            lab = np.empty(ids.size, dtype=np.int64)
            si = np.empty((ids.size, top_k), dtype=np.int32)
            sp = np.empty((ids.size, top_k), dtype=np.float16)
            for s in range(0, ids.size, chunk):
                logits = backend.run(ids[s : s + chunk], s)[:, :vocab]
                lab[s : s + logits.shape[0]] = logits.argmax(-1)
                if top_k:
                    si[s : s + logits.shape[0]], sp[s : s + logits.shape[0]] = top_k_probs(logits, top_k)
            feats.append(backend.features[0, : ids.size].astype(np.float16))
            labels.append(lab)
            s_ids.append(si)
            s_p.append(sp)
            say(n + 1, len(seqs))
    finally:
        backend.close()
    return feats, labels, ((s_ids, s_p) if top_k else None)


def add_soft_labels(data: Distilled, manifest, top_k: int, threads: int | None, say) -> Distilled:
    """`data` with the target's top_k distribution at every position, for data saved without one
    (or with fewer than top_k tokens): the target runs over the saved sequences again, and the
    answers are not written again."""
    feats, labels, soft = target_rows(manifest, [t.tolist() for t in data.tokens], threads, say, top_k)
    return Distilled(data.tokens, feats, labels, data.sources, soft[0], soft[1])


def doc_piece_len(manifest, seq_len: int) -> int:
    """Tokens per documentation sequence: four training windows' worth, within the bundle's context."""
    return max(2, min(manifest.max_seq, 4 * seq_len))


def build_data(
    bundle: Path,
    manifest,
    *,
    answer_tokens: int,
    doc_tokens: int,
    seq_len: int,
    threads: int | None,
    max_prompts: int | None = None,
    sampled_answers: int = 0,
    seed: int = 0,
    answers_by: str = "auto",
    top_k: int = 0,
    say=lambda stage, done, total: None,
) -> Distilled:
    from ..runtime.api import Tokenizer

    prompts = training_prompts()[: max_prompts or None]
    seqs: list[tuple[str, list[int]]] = []
    if answer_tokens > 0 and prompts:
        if answer_writer(manifest, answers_by) == "draft":
            written = write_with_draft(
                manifest,
                prompts,
                answer_tokens,
                threads,
                lambda d, t: say("answers", d, t),
                sampled=sampled_answers,
                seed=seed,
            )
        else:
            written = generate_answers(
                bundle,
                prompts,
                answer_tokens,
                threads,
                lambda d, t: say("answers", d, t),
                sampled=sampled_answers,
                seed=seed,
            )
        seqs += [(f"answer:{c}", ids) for c, ids in written]
    if doc_tokens > 0:
        seqs += doc_sequences(Tokenizer(manifest), doc_tokens, doc_piece_len(manifest, seq_len))
    seqs = [(src, ids) for src, ids in seqs if len(ids) >= 3]
    feats, labels, soft = target_rows(
        manifest, [ids for _, ids in seqs], threads, lambda d, t: say("features", d, t), top_k
    )
    return Distilled(
        [np.asarray(ids[: manifest.max_seq], dtype=np.int64) for _, ids in seqs],
        feats,
        labels,
        [src for src, _ in seqs],
        *(soft or (None, None)),
    )


def save_data(d: Distilled, folder: Path, meta: dict) -> None:
    """One .npz (sequences concatenated, with offsets) and its meta JSON, each replaced atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    offsets = np.cumsum([0] + [t.size for t in d.tokens]).astype(np.int64)
    tmp = folder / "data.tmp.npz"
    soft = {"soft_ids": np.concatenate(d.soft_ids), "soft_p": np.concatenate(d.soft_p)} if d.soft_ids else {}
    np.savez(
        tmp,
        tokens=np.concatenate(d.tokens),
        features=np.concatenate(d.features),
        labels=np.concatenate(d.labels),
        offsets=offsets,
        **soft,
    )
    tmp.replace(folder / "data.npz")
    (folder / "data.json.tmp").write_text(json.dumps({**meta, "sources": d.sources}) + "\n", encoding="utf-8")
    (folder / "data.json.tmp").replace(folder / "data.json")


def load_data(folder: Path, meta: dict) -> Distilled | None:
    """The data saved for the same target and data options, else None (it is built again)."""
    try:
        saved = json.loads((folder / "data.json").read_text(encoding="utf-8"))
        if {k: saved.get(k) for k in meta} != meta:
            return None
        z = np.load(folder / "data.npz", allow_pickle=False)
        off = z["offsets"]
        cut = lambda a: [a[off[i] : off[i + 1]] for i in range(off.size - 1)]  # noqa: E731
        soft = (cut(z["soft_ids"]), cut(z["soft_p"])) if "soft_ids" in z.files else (None, None)
        return Distilled(cut(z["tokens"]), cut(z["features"]), cut(z["labels"]), list(saved["sources"]), *soft)
    except (OSError, ValueError, KeyError):
        return None
