"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama-shaped, with fused qkv and gate/up projections, optional
partial rotary and longrope, and a sliding window on every layer when the config sets one.

The fused projections are kept as in the checkpoint: one MatMul instead of three (or two) is also
what we want in the exported graph."""

from __future__ import annotations

import torch
from torch import nn

from .common import StaticKVAttention, activation, effective_window
from .llama import Llama


class FusedQKVAttention(StaticKVAttention):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, window: int | None):
        super().__init__(hidden, heads, kv_heads, head_dim, window=window)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)

    def project(self, x: torch.Tensor):
        b, t, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.reshape(b, t, self.heads, self.head_dim),
            k.reshape(b, t, self.kv_heads, self.head_dim),
            v.reshape(b, t, self.kv_heads, self.head_dim),
        )


class FusedGatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = activation(act)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act_fn(gate))


class Phi3(Llama):
    family = "phi3"

    def make_attention(self, cfg, i: int, hd: int) -> nn.Module:
        return FusedQKVAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, hd, window=self.window_for(cfg, i)
        )

    def make_mlp(self, cfg) -> nn.Module:
        return FusedGatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def window_for(self, cfg, i: int) -> int | None:
        return effective_window(getattr(cfg, "sliding_window", None), cfg)


MODEL = Phi3
