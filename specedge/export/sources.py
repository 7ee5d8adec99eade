"""Checkpoint sources: an HF folder, a .gguf file, a locally cached hub id, or the built-in default.

Nothing is downloaded: a source that is not on this machine is a clear error. Every failure is a
`UserError` with one sentence naming the file and the reason.
"""

from __future__ import annotations

import contextlib
import functools
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoints import resolve
from ..errors import UserError

DEFAULT_NAME = "smollm2-135m-instruct"

# GGUF architecture names → transformers model_type, for the families we support.
GGUF_ARCHS = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}


@dataclass
class Checkpoint:
    """A loaded checkpoint: transformers config, fp32 state dict, tokenizer and provenance."""

    source: str  # what the user gave (or "default")
    path: str  # the resolved file or folder
    name: str  # a short name for bundle folders
    config: object
    state_dict: dict
    tokenizer: object  # a transformers tokenizer
    chat_template: str | None = None
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- GGUF


def gguf_header_check(path: Path) -> dict:
    """Read the GGUF metadata with the gguf package, turning truncation/corruption into one sentence.
    Returns the fields we use (architecture, chat template)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise UserError(f"cannot read checkpoint '{path}': {e.strerror}") from None
    if magic != b"GGUF":
        raise UserError(f"'{path}' is not a GGUF file (bad magic bytes)")
    try:
        from gguf import GGUFReader
    except ImportError as e:
        from .extras import missing_extra_error

        raise missing_extra_error([e.name or "gguf"]) from None
    try:
        reader = GGUFReader(str(path))
    except (ValueError, struct.error, IndexError, OSError, KeyError) as e:
        raise UserError(f"GGUF file '{path}' is truncated or corrupt ({type(e).__name__}: {e})") from None
    except Exception as e:  # numpy memmap errors on short files surface as assorted types
        raise UserError(f"GGUF file '{path}' is truncated or corrupt ({type(e).__name__})") from None

    def field_str(name: str) -> str | None:
        f = reader.fields.get(name)
        if f is None:
            return None
        try:
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        except Exception:
            return None

    # Tensor data must fit in the file: the reader memory-maps lazily, so check the extents.
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise UserError(f"GGUF file '{path}' is truncated: tensor '{t.name}' ends past the end of the file")
    arch = field_str("general.architecture")
    return {
        "architecture": arch,
        "chat_template": field_str("tokenizer.chat_template"),
        "context_length": field_int(reader, f"{arch}.context_length"),
    }


def field_int(reader, name: str) -> int | None:
    f = reader.fields.get(name)
    try:
        return int(f.parts[f.data[0]][0]) if f is not None else None
    except Exception:
        return None


def default_name(kind: str, path: Path) -> str:
    """The bundle folder name for a checkpoint: bundles/<this> when --out is not given."""
    return path.stem.split(".")[0].lower() if kind == "gguf" else path.name.lower()


def check_header(kind: str, path: Path) -> dict:
    """Every check on a checkpoint that needs no model loaded: the GGUF header or config.json and
    safetensors headers, the architecture. Returns the header's fields: architecture (the
    transformers model_type), chat_template (GGUF only) and max_positions (0 when none is stated)."""
    if kind == "gguf":
        meta = gguf_header_check(path)
        arch = meta["architecture"]
        if arch not in GGUF_ARCHS:
            raise UserError(
                f"architecture '{arch}' of '{path}' is not supported; supported families: {', '.join(_supported_types())}"
            )
        _check_arch(GGUF_ARCHS[arch], str(path))
        return {
            "architecture": GGUF_ARCHS[arch],
            "chat_template": meta["chat_template"],
            "max_positions": int(meta["context_length"] or 0),
        }
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read '{path / 'config.json'}': {_short(e)}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"'{path / 'config.json'}' is not a JSON object")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    mt = cfg.get("model_type")
    if mt == "gemma3" and text:
        mt = "gemma3_text"
    _check_arch(mt, str(path))
    _check_safetensors(path)
    positions = cfg.get("max_position_embeddings", text.get("max_position_embeddings", 0))
    return {
        "architecture": mt,
        "chat_template": None,
        "max_positions": positions if isinstance(positions, int) and positions > 0 else 0,
    }


# ----------------------------------------------------------------------------- loading


def _supported_types() -> list[str]:
    from ..models import supported_families

    return supported_families()


def _check_arch(model_type: str | None, source: str) -> None:
    from ..models import FAMILIES

    if model_type not in FAMILIES:
        raise UserError(
            f"architecture '{model_type}' of '{source}' is not supported; supported families: "
            f"{', '.join(_supported_types())}"
        )


def load(source: str | None, progress=None) -> Checkpoint:
    """Load a checkpoint in fp32. `progress(msg)` is told what is happening (for the CLI's bars)."""
    kind, path = resolve(source)
    say = progress or (lambda msg: None)
    # The headers are read before torch and transformers are imported (seconds on a small CPU):
    # a truncated or corrupt file is reported at once.
    meta = check_header(kind, path)
    try:
        import torch  # noqa: F401  (export extra)
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        from .extras import missing_extra_error

        raise missing_extra_error([e.name or "torch"]) from None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # transformers draws its own "Loading weights" bar on stderr: the CLI shows its own progress
    # (and nothing with --quiet), and an error must stay one line.
    hf_logging.disable_progress_bar()
    chat_template = None
    extra: dict = {}
    if kind == "gguf":
        chat_template = meta["chat_template"]
        folder, fname = str(path.parent), path.name
        say(f"loading {path.name} (dequantizing GGUF)")
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=fname)
            with _no_gguf_bar():
                model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
            say("loading tokenizer")
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"cannot load GGUF checkpoint '{path}': {_short(e)}") from None
        name = default_name(kind, path)
        extra["gguf"] = path.name
    else:
        say(f"loading {path.name}")
        try:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
            if getattr(config, "model_type", None) == "gemma3":
                config = config.text_config
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
            say("loading tokenizer")
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:
            raise UserError(f"cannot load checkpoint '{path}': {_short(e)}") from None
        tmpl = path / "chat_template.jinja"
        chat_template = tmpl.read_text(encoding="utf-8") if tmpl.is_file() else None
        name = default_name(kind, path)
    chat_template = getattr(tok, "chat_template", None) or chat_template
    state = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}
    if hasattr(model, "config"):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return Checkpoint(
        source=source or "default",
        path=str(path),
        name=name,
        config=config,
        state_dict=state,
        tokenizer=tok,
        chat_template=chat_template,
        extra=extra,
    )


@contextlib.contextmanager
def _no_gguf_bar():
    """transformers' GGUF reader draws a plain tqdm bar that disable_progress_bar() does not reach
    (it printed even under --quiet); the CLI's own "loading" stage stands for it."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    orig = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(orig, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = orig


def _check_safetensors(folder: Path) -> None:
    """Open each safetensors header before transformers does, so corruption is one sentence."""
    files = sorted(folder.glob("*.safetensors"))
    if not files and not any(folder.glob("*.bin")):
        raise UserError(f"checkpoint folder '{folder}' has no weights (*.safetensors)")
    for f in files:
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise ValueError("file shorter than its header")
                n = struct.unpack("<Q", head)[0]
                if n > size - 8 or n > 100_000_000:
                    raise ValueError("header length exceeds the file")
                meta = json.loads(fh.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in meta.items() if k != "__metadata__"), default=0)
            if 8 + n + end > size:
                raise ValueError("tensor data ends past the end of the file")
        except PermissionError:
            raise UserError(f"safetensors file '{f}' is not readable (permission denied)") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"safetensors file '{f}' is truncated or corrupt ({_short(e)})") from None


def _short(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    msg = s[0] if s else type(e).__name__
    return msg[:300]


def vocab_of(tokenizer) -> dict[str, int]:
    return dict(tokenizer.get_vocab())


def check_same_tokenizer(target_tok, draft_tok, target_rows: int, draft_rows: int) -> None:
    """Refuse a draft whose vocabulary differs from the target's; embedding rows beyond the
    tokenizer's vocabulary (padding) are fine."""
    tv, dv = vocab_of(target_tok), vocab_of(draft_tok)
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        only_d = len(set(dv.items()) - set(tv.items()))
        example = next(iter(sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])), None)
        raise UserError(
            f"the draft's tokenizer differs from the target's ({len(tv)} vs {len(dv)} tokens; "
            f"{only_t} target entries and {only_d} draft entries differ, e.g. {example!r}); "
            "speculative decoding needs the same vocabulary"
        )
    n = max(tv.values()) + 1 if tv else 0
    if target_rows < n or draft_rows < n:
        raise UserError(
            f"a model's output has fewer rows than the tokenizer's vocabulary ({min(target_rows, draft_rows)} < {n})"
        )
