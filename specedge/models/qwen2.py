"""Qwen2 / Qwen2.5: Llama with biased q/k/v projections (o_proj has none) and, when
use_sliding_window is set, a sliding window on the layers that config.layer_types marks."""

from __future__ import annotations

from torch import nn

from .common import StaticKVAttention, effective_window
from .llama import Llama


def layer_window(cfg, i: int) -> int | None:
    # The config already clears sliding_window when use_sliding_window is off, and layer_types
    # says which layers slide (those from max_window_layers on).
    types = getattr(cfg, "layer_types", None)
    if types is not None and types[i] != "sliding_attention":
        return None
    return effective_window(getattr(cfg, "sliding_window", None), cfg)


class Qwen2(Llama):
    family = "qwen2"

    def make_attention(self, cfg, i: int, hd: int) -> nn.Module:
        return StaticKVAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
            bias=True,
            o_bias=False,
            window=self.window_for(cfg, i),
        )

    def window_for(self, cfg, i: int) -> int | None:
        return layer_window(cfg, i)


MODEL = Qwen2
