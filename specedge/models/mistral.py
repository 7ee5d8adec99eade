"""Mistral: Llama with a sliding window on every layer (transformers' Mistral ignores layer_types)."""

from __future__ import annotations

from .common import effective_window
from .llama import Llama


class Mistral(Llama):
    family = "mistral"

    def window_for(self, cfg, i: int) -> int | None:
        return effective_window(getattr(cfg, "sliding_window", None), cfg)


MODEL = Mistral
