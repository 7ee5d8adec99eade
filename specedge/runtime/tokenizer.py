"""The bundle's tokenizer (HF `tokenizers` format) and its chat template (sandboxed jinja2)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..manifest import BundleError, Manifest
from .chat_template import ChatTemplate
from .requests import check_messages

__all__ = ["Tokenizer"]


def _token_string(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """The bundle's tokenizer (HF `tokenizers` format) and chat template (sandboxed jinja2)."""

    def __init__(self, manifest: Manifest):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:  # pragma: no cover - a hard dependency
            raise BundleError(
                "the tokenizers package is needed to read the bundle's tokenizer: pip install tokenizers"
            ) from None
        files = {Path(f).name: f for f in manifest.tokenizer_files}
        if "tokenizer.json" not in files:
            raise BundleError("the bundle lists no tokenizer.json")
        path = manifest.path(files["tokenizer.json"])
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise BundleError(
                f"cannot read the bundle's tokenizer.json: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
        self.config: dict = {}
        if "tokenizer_config.json" in files:
            try:
                self.config = json.loads(manifest.path(files["tokenizer_config.json"]).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise BundleError(f"cannot read the bundle's tokenizer_config.json: {e}") from None
            if not isinstance(self.config, dict):
                raise BundleError("the bundle's tokenizer_config.json is not a JSON object")
        self.bos_token_id = manifest.bos_token_id
        self.add_bos = manifest.add_bos
        self.eos_token_ids = list(manifest.eos_token_ids)
        self.special_tokens = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            s = _token_string(self.config.get(name))
            if s is not None:
                self.special_tokens[name] = s
        if "bos_token" not in self.special_tokens and self.bos_token_id is not None:
            s = self.tok.id_to_token(self.bos_token_id)
            if s is not None:
                self.special_tokens["bos_token"] = s
        if "eos_token" not in self.special_tokens:
            s = self.tok.id_to_token(self.eos_token_ids[0])
            if s is not None:
                self.special_tokens["eos_token"] = s
        self.chat_template: str | None = None
        if manifest.chat_template:
            try:
                self.chat_template = manifest.path(manifest.chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise BundleError(f"cannot read the bundle's chat template: {e}") from None
        else:
            ct = self.config.get("chat_template")
            if isinstance(ct, list):  # named templates: take the default one
                ct = next((t.get("template") for t in ct if isinstance(t, dict) and t.get("name") == "default"), None)
            self.chat_template = ct if isinstance(ct, str) else None
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text` without the tokenizer's own special tokens; the bundle's BOS is
        prepended when `add_bos` (default: the manifest's add_bos)."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template rendered in a sandbox under limits (templates in bundles are
        untrusted; see chat_template.py). Failures are ValueError (ChatTemplateError) sentences."""
        if not self.chat_template:
            raise ValueError("the bundle has no chat template, so chat messages cannot be formatted")
        check_messages(messages)
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        """Rendered template -> ids, without adding special tokens (the template has them)."""
        return self.encode(self.render_chat(messages), add_bos=False)
