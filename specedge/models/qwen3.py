"""Qwen3 (dense): Llama with an RMSNorm over each query and key head before rope."""

from __future__ import annotations

from torch import nn

from .common import StaticKVAttention
from .llama import Llama
from .qwen2 import layer_window


class Qwen3(Llama):
    family = "qwen3"

    def make_attention(self, cfg, i: int, hd: int) -> nn.Module:
        bias = bool(getattr(cfg, "attention_bias", False))
        return StaticKVAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
            bias=bias,
            o_bias=bias,
            qk_norm_eps=cfg.rms_norm_eps,
            window=self.window_for(cfg, i),
        )

    def window_for(self, cfg, i: int) -> int | None:
        return layer_window(cfg, i)


MODEL = Qwen3
