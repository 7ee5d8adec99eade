"""A feature-level draft head in the style of EAGLE-3 (Li et al. 2025), trained by `specedge train-draft`.

One decoder layer drafts from the target's own hidden states. Slot i of the head's cache pairs
g_i, the fused target features of token x_i (contract.FEATURES_OUTPUT: a low, a middle and a high
layer, concatenated, mapped by `fc` to the hidden size), with the embedding of the next token
x_{i+1}; its output predicts the token after that. Later steps of a chain have no target features
(the target has not run the drafted tokens), so the head's own output hidden state of the step
before takes g's place. Features are first scaled per tapped layer by 1 / their RMS over the
training data (`feature_scale`, a constant of the graph). `fc` has no bias, so one graph serves
both: inputs `features` and `hidden` are summed after `fc`, and the caller zeroes the one it does
not use.

The lm_head covers a reduced draft vocabulary (the target tokens most frequent in the training
data); `d2t` maps a draft id to the target's id, and the runtime proposes only mapped ids.

Static-KV interface as the target's (docs/design.md, graph contract), one layer:
forward(input_ids, position, features, hidden, past_key.0, past_value.0) ->
(logits [B, T, Vd] fp32, hidden_out [B, T, H], present_key.0 / new_key.0, present_value.0 / new_value.0).

`forward_unrolled` is the training-time test: K chain steps over a whole sequence at once, each
step fed the previous step's own hidden states, with the attention each step would see at run
time (docs/design.md, "Draft heads").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from .attention import apply_rope, attend, attention_mask, cache_write, delta_mask, new_positions
from .common import GatedMLP, RMSNorm, Rotary

__all__ = ["EagleHead", "HeadConfig", "head_for_target", "unrolled_mask"]


def head_for_target(target, feature_dim: int, draft_vocab: int) -> EagleHead:
    """A new head for `target`: its widths, a copy of its rotary embedding (the last layer's kind)
    and of its token embedding, which stays frozen (the head embeds tokens as the target does;
    the RMSNorm after it makes a family's embedding scale irrelevant)."""
    hc = HeadConfig.for_target(target, feature_dim, draft_vocab)
    rot = target.rotaries[target.layer_rope[-1]]
    head = EagleHead(
        hc,
        Rotary(
            rot.inv_freq.clone(),
            rot.scaling,
            None if rot.long_inv_freq is None else rot.long_inv_freq.clone(),
            rot.original_max,
        ),
    )
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.embed_tokens.weight)
    head.embed_tokens.weight.requires_grad_(False)
    return head


@dataclass
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    feature_dim: int
    target_vocab: int
    draft_vocab: int
    hidden_act: str = "silu"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(cls, target, feature_dim: int, draft_vocab: int) -> HeadConfig:
        """The head of `target` (a specedge.models module of any family): its widths, one layer.
        Read from the module rather than the config, so families with nested or renamed config
        fields need nothing of their own."""
        attn = target.layers[0].self_attn
        mlp = target.layers[0].mlp
        inter = mlp.down_proj.in_features
        return cls(
            hidden_size=target.embed_tokens.weight.shape[1],
            num_heads=attn.heads,
            num_kv_heads=attn.kv_heads,
            head_dim=attn.head_dim,
            intermediate_size=inter,
            rms_norm_eps=float(target.norm.eps),
            feature_dim=int(feature_dim),
            target_vocab=target.embed_tokens.weight.shape[0],
            draft_vocab=int(draft_vocab),
            hidden_act=getattr(mlp, "act", None) or getattr(target.config, "hidden_act", None) or "silu",
        )


class EagleHead(nn.Module):
    kv_mode: str = "scatter"
    family = "eagle_head"

    def __init__(self, hc: HeadConfig, rotary):
        super().__init__()
        self.hc = hc
        h, d = hc.hidden_size, hc.head_dim
        self.fc = nn.Linear(hc.feature_dim, h, bias=False)
        self.embed_tokens = nn.Embedding(hc.target_vocab, h)
        self.embed_norm = RMSNorm(h, hc.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, hc.rms_norm_eps)
        # attention reads [norm(embedding); norm(g)]: twice the hidden size in, the hidden size out
        self.q_proj = nn.Linear(2 * h, hc.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, hc.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, hc.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(hc.num_heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, hc.rms_norm_eps)
        self.mlp = GatedMLP(h, hc.intermediate_size, hc.hidden_act)
        self.norm = RMSNorm(h, hc.rms_norm_eps)
        self.lm_head = nn.Linear(h, hc.draft_vocab, bias=False)
        self.rotary = rotary  # the target's rotary embedding (models/common.py Rotary)
        self.scale = d**-0.5
        # draft id -> target id; a buffer so that it travels with the state dict
        self.register_buffer("d2t", torch.arange(hc.draft_vocab, dtype=torch.int64))
        # per feature column: 1 / RMS of its tapped layer over the training data (set_feature_scale),
        # so that fused features and token embedding start at comparable magnitudes; a constant of the graph
        self.register_buffer("feature_scale", torch.ones(hc.feature_dim, dtype=torch.float32))

    def set_feature_scale(self, rms_per_layer) -> None:
        """Scale each tapped layer's block of features by 1 / its RMS (clamped to [1e-3, 1e3]);
        one RMS per block of `hidden_size` columns (one value for a width that does not divide)."""
        rms = torch.as_tensor(rms_per_layer, dtype=torch.float32).reshape(-1)
        blocks = rms.numel()
        if self.hc.feature_dim % blocks:
            raise ValueError(f"{blocks} feature RMS values for {self.hc.feature_dim} feature columns")
        scale = (1.0 / rms.clamp(min=1e-12)).clamp(1e-3, 1e3)
        self.feature_scale.copy_(scale.repeat_interleave(self.hc.feature_dim // blocks))

    # -- pieces shared by the static-KV forward and the unrolled training forward

    def _project(self, ids, g, positions):
        """q [B, H, T, D] and k, v [B, KVH, T, D] (rotated) for tokens `ids` over fused features `g`."""
        b, t = ids.shape
        x = torch.cat([self.embed_norm(self.embed_tokens(ids)), self.hidden_norm(g)], dim=-1)
        d = self.hc.head_dim
        q = self.q_proj(x).reshape(b, t, self.hc.num_heads, d).transpose(1, 2)
        k = self.k_proj(x).reshape(b, t, self.hc.num_kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).reshape(b, t, self.hc.num_kv_heads, d).transpose(1, 2)
        cos, sin = self.rotary(positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish(self, g, attn):
        h = g + self.o_proj(attn)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)).float(), h

    def forward(self, input_ids, position, features, hidden, past_key, past_value):
        t = input_ids.shape[1]
        g = self.fc(features * self.feature_scale) + hidden
        q, k, v = self._project(input_ids, g, new_positions(position, t))
        slots = past_key.shape[-2]
        if self.kv_mode == "scatter":
            kc, vc = cache_write(past_key, k, position), cache_write(past_value, v, position)
            attn = attend(q, kc, vc, attention_mask(position, t, slots, None), self.scale)
        else:
            kc, vc = k, v
            attn = attend(
                q,
                torch.cat([past_key, k], 2),
                torch.cat([past_value, v], 2),
                delta_mask(position, t, slots, None),
                self.scale,
            )
        logits, h = self._finish(g, attn)
        return logits, h, kc, vc

    def empty_cache(self, max_seq: int, batch: int = 1, dtype=torch.float32):
        shape = (batch, self.hc.num_kv_heads, max_seq, self.hc.head_dim)
        return [torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)]

    def forward_unrolled(self, input_ids, features, steps: int) -> list[torch.Tensor]:
        """Training-time test over whole sequences: slot i holds (features_i, input_ids_i).
        Step 0 is what the runtime computes from target features; step s > 0 feeds slot i the
        hidden state step s - 1 produced at slot i - 1 (a chain started s slots earlier), and
        attends to what it would at run time: step 0 up to the chain's start, then the chain's
        own earlier steps. Returns each step's logits [B, T, Vd] (slot i < s is meaningless)."""
        b, t = input_ids.shape
        positions = torch.arange(t, dtype=torch.int64, device=input_ids.device)[None].expand(b, t)
        g = self.fc(features * self.feature_scale)
        keys, values, out = [], [], []
        for s in range(steps):
            if s:
                g = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # own hidden, one slot on
            q, k, v = self._project(input_ids, g, positions)
            keys.append(k)
            values.append(v)
            mask = unrolled_mask(t, s, input_ids.device)
            attn = attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask[None, None], self.scale)
            logits, g = self._finish(g, attn)
            out.append(logits)
        return out


def unrolled_mask(t: int, s: int, device=None) -> torch.Tensor:
    """Bool [T, (s + 1) * T]: which keys step s's query at slot i sees, the keys of steps 0..s
    side by side. Step 0's keys up to slot i - s (the chain's start), and step u's key at slot
    i - s + u for u = 1..s (the chain's earlier steps and itself)."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    parts = [j <= i - s]
    for u in range(1, s + 1):
        parts.append(j == i - s + u)
    return torch.cat(parts, dim=1)
