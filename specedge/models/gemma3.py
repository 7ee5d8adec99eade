"""Gemma 3 text decoder (model_type gemma3_text; a multimodal gemma3 config contributes its
text_config and its checkpoint its language_model weights).

Differences from Llama: embeddings scaled by sqrt(hidden), RMSNorm weights stored as (w - 1),
four norms per layer (around attention and around the MLP), per-head q/k norms, attention
scaled by query_pre_attn_scalar, sliding and full layers interleaved by config.layer_types,
each kind with its own rope, a GeLU-tanh gated MLP and optional final-logit softcapping."""

from __future__ import annotations

import torch
from torch import nn

from .common import (
    CausalLM,
    GatedMLP,
    RMSNorm,
    StaticKVAttention,
    UnsupportedArchitecture,
    effective_window,
    make_rotary,
)
from .llama import head_dim_of

# Gemma norms multiply by (1 + weight).
NORM_OFFSET = 1.0


def text_config(cfg):
    """The gemma3_text config inside a multimodal gemma3 config (or the config itself)."""
    if getattr(cfg, "model_type", None) == "gemma3" and getattr(cfg, "text_config", None) is not None:
        return cfg.text_config
    return cfg


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, NORM_OFFSET)
        self.post_attention_layernorm = RMSNorm(hidden, eps, NORM_OFFSET)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, NORM_OFFSET)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, NORM_OFFSET)

    def forward(self, h, cos, sin, position, pk, pv, kv_mode):
        a, k, v = self.self_attn(self.input_layernorm(h), cos, sin, position, pk, pv, kv_mode)
        h = h + self.post_attention_layernorm(a)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h, k, v


class Gemma3(CausalLM):
    family = "gemma3"

    def __init__(self, config):
        super().__init__()
        cfg = text_config(config)
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedArchitecture("bidirectional Gemma 3 (an embedding model) is not a causal LM")
        self.config = cfg
        hd = head_dim_of(cfg)
        n = cfg.num_hidden_layers
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise UnsupportedArchitecture(f"gemma3 layer types {unknown} are not supported")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # transformers rounds the scale to the embedding dtype before multiplying (a bf16 model
        # uses 25.25, not 25.298 for hidden=640); a buffer follows the model's dtype the same way.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.layers = nn.ModuleList()
        for i in range(n):
            window = effective_window(cfg.sliding_window, cfg) if types[i] == "sliding_attention" else None
            attn = StaticKVAttention(
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                hd,
                bias=bool(cfg.attention_bias),
                o_bias=bool(cfg.attention_bias),
                qk_norm_eps=cfg.rms_norm_eps,
                qk_norm_offset=NORM_OFFSET,
                scale=scale,
                window=window,
                # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies
                # it (Gemma 3 replaced softcapping by q/k norms; released configs set None). We
                # follow the reference we are checked against rather than the field's docstring.
                softcap=None,
            )
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation)
            self.layers.append(Gemma3DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, NORM_OFFSET)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.final_softcap = cfg.final_logit_softcapping
        self.rotaries = nn.ModuleDict({t: make_rotary(cfg, hd, t) for t in sorted(set(types))})
        self.layer_rope = types

    def embed(self, input_ids):
        h = self.embed_tokens(input_ids)
        return h * self.embed_scale.to(h.dtype)

    def convert_state_dict(self, sd: dict) -> dict:
        # A multimodal checkpoint nests the decoder under language_model; the vision tower and
        # projector are not ours.
        if not any(k.startswith("language_model.") for k in sd):
            return sd
        out = {}
        for k, v in sd.items():
            if k.startswith("language_model."):
                out[k[len("language_model.") :]] = v
            elif k.startswith("lm_head."):
                out[k] = v
        return out


MODEL = Gemma3
