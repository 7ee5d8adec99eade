"""Tiny random checkpoints and bundles for tests: real HF folders (config + safetensors + a small
trained tokenizer) exported through the same pipeline users run."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a few tokens and the target verifies them in one pass.",
    "User: hello there! Assistant: hi, how can I help you today?",
    "Replace every comma with a semicolon: a, b, c -> a; b; c",
    "for i in range(10):\n    print(i * i)\n",
    "Edge devices such as the Jetson Orin Nano run small language models.",
    "Ünïcödé ça va? 東京 🙂",
]
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def tiny_tokenizer(vocab_size: int):
    """A SentencePiece-style BPE (metaspace, byte fallback) trained on a small corpus, wrapped as a
    transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_checkpoint(folder: Path, family: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random HF checkpoint of `family` to `folder` and return it."""
    from ..models.testing import tiny_config, tiny_hf_model

    cfg = tiny_config(family, seed)
    tok = tiny_tokenizer(cfg.vocab_size if hasattr(cfg, "vocab_size") else cfg.text_config.vocab_size)
    for attr, name in (("bos_token_id", "<s>"), ("eos_token_id", "</s>")):
        tid = tok.convert_tokens_to_ids(name)
        setattr(cfg, attr, tid)
        if hasattr(cfg, "text_config"):
            setattr(cfg.text_config, attr, tid)
    model = tiny_hf_model(family, seed, config=cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def tiny_bundle(
    out_dir: Path,
    family: str = "llama",
    draft: str = "self",
    kv_mode: str = "scatter",
    precision: str = "fp32",
    draft_precision: str = "int4",
    max_seq: int = 128,
    spec_tokens: int = 4,
    seed: int = 0,
    prefill_chunk: int = 16,
    features: bool = False,
) -> Path:
    """Export a tiny bundle to `out_dir` (replaced if present). draft: "self", "ngram", or
    "model" (a second tiny checkpoint of the same family and tokenizer, another seed)."""
    from .pipeline import ExportOptions, export_bundle

    out_dir = Path(out_dir)
    ck = tiny_checkpoint(out_dir.parent / f"{out_dir.name}-ckpt", family, seed)
    d = draft
    if draft == "model":
        d = str(tiny_checkpoint(out_dir.parent / f"{out_dir.name}-draft-ckpt", family, seed + 1))
    opts = ExportOptions(
        target=str(ck),
        draft=d,
        out=str(out_dir),
        precision=precision,
        draft_precision=draft_precision,
        max_seq=max_seq,
        spec_tokens=spec_tokens,
        kv_mode=kv_mode,
        prefill_chunk=prefill_chunk,
        force=True,
        features=features,
    )
    path, _ = export_bundle(opts)
    return path
