"""What callers pass, checked in one place: load's options, a request's settings and its prompt.

Every check raises ValueError with one sentence (the CLI and the server turn it into their own
error); the pipeline, the generator and the server call these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..contract import MAX_SPEC_TOKENS
from .int4_kernel import CHOICES as INT4_KERNELS
from .sampling import SamplingParams

__all__ = [
    "CLI_FLAGS",
    "MAX_THREADS",
    "GenerationConfig",
    "check_load_options",
    "check_messages",
    "check_prompt",
    "check_text",
]

# ONNX Runtime intra-op threads per session: more than any CPU has cores; a larger number is a
# typo that would spawn threads until memory runs out (the C API and both CLIs share the cap).
MAX_THREADS = 1024

VERIFY_MODES = ("full", "size", "none")
DRAFT_KV_MODES = ("auto", "own")


def check_load_options(*, verify: str, threads, draft_kv: str, invariant_steps, int4_kernel: str) -> None:
    """load()'s options that need no bundle (the drafter's name is drafters.check_draft_name)."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be full, size or none, got {verify!r}")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS
    ):
        raise ValueError(f"threads must be an integer in 1..{MAX_THREADS}, got {threads!r}")
    check_draft_kv(draft_kv)
    if invariant_steps is not None and not isinstance(invariant_steps, bool):
        raise ValueError(f"invariant_steps must be True, False or None, got {invariant_steps!r}")
    if int4_kernel not in INT4_KERNELS:
        raise ValueError(f"int4_kernel must be one of {', '.join(INT4_KERNELS)}, got {int4_kernel!r}")


def check_draft_kv(draft_kv: str) -> None:
    if draft_kv not in DRAFT_KV_MODES:
        raise ValueError(f"draft_kv must be 'auto' or 'own', got {draft_kv!r}")


@dataclass
class GenerationConfig:
    """Everything one request can set. `spec_tokens=None` takes the bundle's k."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] | None = None
    spec_tokens: int | None = None
    speculative: bool = True
    adaptive_k: bool = False
    guard: bool = True
    # verify a token tree per round (the drafter's propose_tree) instead of a chain; needs a
    # target graph that takes trees (export-models --tree)
    tree: bool = False

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    def validate(self, names: Mapping[str, str] | None = None) -> GenerationConfig:
        """Raise ValueError (one sentence) on a bad setting; the one check of a request's settings
        (Pipeline, the server and the CLIs call it). `names` shows a field under the caller's name
        for it (CLI_FLAGS: `--max-new-tokens` for max_new_tokens)."""
        n = (names or {}).get
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"{n('max_new_tokens', 'max_new_tokens')} must be an integer >= 1, got {m!r}")
        self.sampling.validate(names)
        k = self.spec_tokens
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_SPEC_TOKENS
        ):
            raise ValueError(
                f"{n('spec_tokens', 'spec_tokens (k)')} must be between 1 and {MAX_SPEC_TOKENS}, got {k!r}"
            )
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            for s in self.stop:
                if not isinstance(s, str):
                    raise ValueError(f"{n('stop', 'stop')} strings must be strings, got {s!r}")
                if not s:
                    raise ValueError(f"{n('stop', 'stop')} strings must not be empty")
        return self


# The generate and chat commands' flag for each field, for validate(names=CLI_FLAGS).
CLI_FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "seed": "--seed",
    "spec_tokens": "--spec-tokens",
    "stop": "--stop",
}


def check_prompt(prompt: Sequence[int], max_seq: int) -> list[int]:
    """The prompt as ints, refused (ValueError, one sentence) when empty or when no new token fits."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) >= max_seq:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens but the bundle's context holds {max_seq} "
            "(prompt + at least one new token must fit)"
        )
    return prompt


def check_messages(messages) -> None:
    """Chat messages: a non-empty list of {'role': str, 'content': str} dicts of valid text."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each message must be a dict with string 'role' and 'content'")
        check_text(m["role"], "a message's role")
        check_text(m["content"], "a message's content")


def check_text(text: str, what: str) -> None:
    """Refuse text that is not encodable Unicode: lone surrogates, which is how Python carries
    bytes that were not UTF-8 (command-line arguments, surrogateescape streams)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} is not valid Unicode text (a lone surrogate at character {e.start}: bytes that were not UTF-8)"
        ) from None
