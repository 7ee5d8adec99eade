"""Llama family: Llama 2/3, SmolLM/SmolLM2, TinyLlama (and the base that mistral/qwen2/qwen3 reuse)."""

from __future__ import annotations

from torch import nn

from .common import CausalLM, DecoderLayer, GatedMLP, RMSNorm, StaticKVAttention, make_rotary


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Llama(CausalLM):
    family = "llama"

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        hd = head_dim_of(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(self.make_attention(cfg, i, hd), self.make_mlp(cfg), cfg.hidden_size, cfg.rms_norm_eps)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotaries = nn.ModuleDict({"default": make_rotary(cfg, hd)})
        self.layer_rope = ["default"] * cfg.num_hidden_layers

    def make_attention(self, cfg, i: int, hd: int) -> nn.Module:
        bias = bool(getattr(cfg, "attention_bias", False))
        return StaticKVAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
            bias=bias,
            o_bias=bias,
            window=self.window_for(cfg, i),
        )

    def make_mlp(self, cfg) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bool(getattr(cfg, "mlp_bias", False)))

    def window_for(self, cfg, i: int) -> int | None:
        return None


MODEL = Llama
