"""Building blocks shared by every family: norms, rotary embeddings and static-KV attention.

The static-KV interface (docs/design.md, graph contract): a model is called with the new tokens, the
write offset `position` and one fixed-size cache per layer and K/V, and returns fp32 logits plus
either the updated caches (scatter mode) or only the new entries (delta mode). The attention mask
is derived from `position`, so rolling back rejected draft tokens is just a smaller position.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .attention import apply_rope, attend, attention_mask, cache_write, delta_mask, new_positions, tree_positions
from .gqa import gqa, gqa_lengths


class UnsupportedArchitecture(ValueError):
    pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        # Gemma stores (weight - 1); the offset keeps the checkpoint's numbers untouched.
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        # False writes the fp32 norm out elementwise too: parsers older than opset 23 (TensorRT
        # before 10.15) have no RMSNormalization.
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.fused:
            # One ONNX RMSNormalization node (opset 23) instead of seven elementwise ones: at T=1
            # on a small CPU the per-node overhead is a third of a step.
            w = self.weight + self.offset if self.offset else self.weight
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Rounding follows transformers in half precision: Llama-style norms cast to the input
        # dtype before the weight, Gemma-style ones multiply in fp32 and cast last.
        if self.offset:
            return (xf * (self.weight.float() + self.offset)).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def unfuse_norms(model: nn.Module) -> None:
    """Every RMSNorm of `model` exported as elementwise ops (see RMSNorm.fused)."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.fused = False


def _rope_params(config, layer_type: str | None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return params


def rope_inv_freq(
    config, head_dim: int, layer_type: str | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for a config, using transformers' own rope
    initialisers so that llama3 / linear / dynamic / yarn / longrope scaling match exactly.
    `seq_len` past the original context selects longrope's long factors."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _rope_params(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
        dim = int(head_dim * partial)
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedArchitecture(f"rope type '{rope_type}' is not supported")
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len, layer_type=layer_type)
    return inv.float(), float(scale)


def make_rotary(config, head_dim: int, layer_type: str | None = None) -> Rotary:
    """The rotary embedding of a config (per layer type where the config has several).

    Dynamic NTK only grows past max_position_embeddings, so within the model's context it is
    the base rope; longrope switches to its long factors once a call reaches past the original
    context, like transformers does for a cached forward."""
    inv, scale = rope_inv_freq(config, head_dim, layer_type)
    params = _rope_params(config, layer_type)
    if params.get("rope_type") == "longrope":
        orig = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        if orig:
            long_inv, _ = rope_inv_freq(config, head_dim, layer_type, seq_len=int(orig) + 1)
            return Rotary(inv, scale, long_inv_freq=long_inv, original_max=int(orig))
    return Rotary(inv, scale)


class Rotary(nn.Module):
    def __init__(
        self,
        inv_freq: torch.Tensor,
        scaling: float = 1.0,
        long_inv_freq: torch.Tensor | None = None,
        original_max: int | None = None,
    ):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        if long_inv_freq is not None:
            self.register_buffer("long_inv_freq", long_inv_freq.float(), persistent=False)
        else:
            self.long_inv_freq = None
        self.original_max = original_max
        self.scaling = scaling

    def _apply(self, fn, recurse=True):
        # A model cast to fp16/bf16 must keep fp32 frequencies: rounded ones shift every angle
        # at large positions. Only the device follows the cast.
        keep = {n: b for n, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for n, b in keep.items():
            self._buffers[n] = b.to(self._buffers[n].device)
        return self

    def cache(self, max_seq: int, dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin [max_seq, rot_dim / 2] for attention ops that rotate q and k themselves
        (GroupQueryAttention's do_rotary), with the attention scaling folded in; None when this
        rope cannot be a fixed table (longrope switches tables at run time) or the op's kernel
        does not take its width (a multiple of 8)."""
        half = self.inv_freq.shape[0]
        if self.long_inv_freq is not None or half % 8:
            return None
        freqs = torch.arange(max_seq, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] -> cos, sin [B, 1, T, rot_dim]
        inv = self.inv_freq
        if self.long_inv_freq is not None:
            # A select rather than control flow keeps the graph static.
            use_long = positions.amax(-1, keepdim=True)[..., None] >= self.original_max
            inv = torch.where(use_long, self.long_inv_freq, self.inv_freq)
        freqs = positions.float()[..., None] * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling)[:, None], (emb.sin() * self.scaling)[:, None]


class StaticKVAttention(nn.Module):
    """Self-attention with the static-KV contract; families differ in projections and norms."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_offset: float = 0.0,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, qk_norm_offset) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, qk_norm_offset) if qk_norm_eps is not None else None
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.window = window
        self.softcap = softcap

    # Set by CausalLM.prepare_rope_cache for the ort graph flavour: cos/sin arrive as tables and
    # GroupQueryAttention rotates q and k itself.
    rope_in_op: bool = False

    def fuse_projections(self) -> None:
        """Replace q/k/v by one qkv_proj (rows concatenated): one MatMul per layer instead of
        three. Idempotent; the outputs are unchanged up to float summation order."""
        if not hasattr(self, "q_proj"):
            return
        self.qkv_proj = _concat_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def _split_sizes(self) -> list[int]:
        return [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]

    def project_flat(self, x: torch.Tensor):
        """q, k, v as [B, T, heads * head_dim] (the layout GroupQueryAttention reads)."""
        if hasattr(self, "qkv_proj"):
            return self.qkv_proj(x).split(self._split_sizes(), dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project(self, x: torch.Tensor):
        b, t, _ = x.shape
        q, k, v = self.project_flat(x)
        return (
            q.reshape(b, t, self.heads, self.head_dim),
            k.reshape(b, t, self.kv_heads, self.head_dim),
            v.reshape(b, t, self.kv_heads, self.head_dim),
        )

    def _forward_gqa(self, x, cos, sin, position, past_k, past_v):
        # Scatter contract, one fused op: ONNX Runtime's GroupQueryAttention in the graph.
        b, t, _ = x.shape
        # In gqa mode the model passes (seqlens_k, total_len, tree) where other modes get `position`.
        args = (*position, float(self.scale), int(self.window or 0), float(self.softcap or 0.0), self.heads)
        if self.rope_in_op and self.q_norm is None and hasattr(self, "qkv_proj"):
            # Packed q|k|v straight from the fused projection: no split, no transposes.
            out, kc, vc = gqa(self.qkv_proj(x).to(past_k.dtype), None, None, past_k, past_v, cos, sin, *args)
            return self.o_proj(out.to(x.dtype)), kc, vc
        q, k, v = self.project_flat(x)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(b, t, self.heads, self.head_dim)).reshape(b, t, -1)
            k = self.k_norm(k.reshape(b, t, self.kv_heads, self.head_dim)).reshape(b, t, -1)
        if not self.rope_in_op:
            q = _flat(apply_rope(q.reshape(b, t, self.heads, self.head_dim).transpose(1, 2), cos, sin))
            k = _flat(apply_rope(k.reshape(b, t, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin))
            cos = sin = None
        dt = past_k.dtype
        out, kc, vc = gqa(q.to(dt), k.to(dt), v.to(dt), past_k, past_v, cos, sin, *args)
        return self.o_proj(out.to(x.dtype)), kc, vc

    def forward(self, x, cos, sin, position, past_k, past_v, kv_mode: str):
        if kv_mode == "gqa":
            return self._forward_gqa(x, cos, sin, position, past_k, past_v)
        b, t, _ = x.shape
        # a tree call (CausalLM.tree) passes (position, ancestor mask)
        position, tree = position if isinstance(position, tuple) else (position, None)
        q, k, v = self.project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin).to(past_k.dtype)
        v = v.transpose(1, 2).to(past_v.dtype)
        slots = past_k.shape[-2]
        if kv_mode == "scatter":
            kc = cache_write(past_k, k, position)
            vc = cache_write(past_v, v, position)
            mask = attention_mask(position, t, slots, self.window, tree)
            out = attend(q, kc, vc, mask, self.scale, self.softcap)
            return self.o_proj(out.to(x.dtype)), kc, vc
        mask = delta_mask(position, t, slots, self.window, tree)
        out = attend(q, torch.cat([past_k, k], 2), torch.cat([past_v, v], 2), mask, self.scale, self.softcap)
        return self.o_proj(out.to(x.dtype)), k, v


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H * D]."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


@torch.no_grad()
def _concat_linears(linears: list[nn.Linear]) -> nn.Linear:
    first = linears[0]
    bias = [lin.bias for lin in linears]
    if any(b is not None for b in bias):
        bias = [
            b if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
            for b, lin in zip(bias, linears)
        ]
    fused = nn.Linear(
        first.in_features,
        sum(lin.out_features for lin in linears),
        bias=bias[0] is not None,
        dtype=first.weight.dtype,
        device=first.weight.device,
    )
    fused.weight.copy_(torch.cat([lin.weight for lin in linears], 0))
    if fused.bias is not None:
        fused.bias.copy_(torch.cat(bias, 0))
    return fused


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise UnsupportedArchitecture(f"activation '{name}' is not supported")
    return _ACTIVATIONS[name]


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = act
        self.act_fn = activation(act)

    def fuse_projections(self) -> None:
        """One gate|up MatMul instead of two. Idempotent."""
        if not hasattr(self, "gate_proj"):
            return
        self.gate_up_proj = _concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act_fn(gate) * up)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def effective_window(window: int | None, config) -> int | None:
    """The sliding window a layer needs, or None when it can never bind: a window at least as
    long as the model's context masks nothing and would only add ops to the graph."""
    if not window:
        return None
    limit = getattr(config, "max_position_embeddings", None)
    if limit and int(window) >= int(limit):
        return None
    return int(window)


class CausalLM(nn.Module):
    """Common outer loop: embed → layers → norm → lm_head, with the static-KV signature
    forward(input_ids, position, past_key.0, past_value.0, ...) -> (logits, kv...)."""

    kv_mode: str = "scatter"
    family: str = ""
    # Tree-capable graph (docs/design.md, "Tree calls"): a third input `tree_mask` [B, T, T], the
    # ancestor mask among the new tokens, follows `position`.
    tree: bool = False
    # Layers whose output hidden states the graph also returns, concatenated, after the caches
    # (contract.FEATURES_OUTPUT, for a feature-level draft head); None: logits and caches only.
    feature_layers: tuple[int, ...] | None = None

    def embed(self, input_ids):
        return self.embed_tokens(input_ids)

    def final_logits(self, h):
        logits = self.lm_head(self.norm(h)).float()
        cap = getattr(self, "final_softcap", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor, *past: torch.Tensor):
        t = input_ids.shape[1]
        tree = None
        if self.tree:
            tree, past = past[0], past[1:]
            # one dynamic dimension in the exported graph: the mask is [B, T, T]
            torch._check(tree.shape[1] == t)
            torch._check(tree.shape[2] == t)
        h = self.embed(input_ids)
        pos = new_positions(position, t) if tree is None else tree_positions(position, tree)
        # cos/sin once per rotary kind (gemma3 has a local and a global one), not once per layer.
        tables = {}
        if self.kv_mode == "gqa":
            tables = getattr(self, "rope_tables", {})
            # (seqlens_k, total_len, tree) for every layer's attention
            position = (*gqa_lengths(position, t), tree)
        elif tree is not None:
            position = (position, tree)
        rope = {name: tables[name] if name in tables else r(pos) for name, r in self.rotaries.items()}
        outs = []
        taps = {}
        for i, layer in enumerate(self.layers):
            cos, sin = rope[self.layer_rope[i]]
            h, k, v = layer(h, cos, sin, position, past[2 * i], past[2 * i + 1], self.kv_mode)
            outs += [k, v]
            taps[i] = h
        if self.feature_layers:
            return (self.final_logits(h), *outs, tapped_features(taps, self.feature_layers))
        return (self.final_logits(h), *outs)

    # -- helpers used by export and tests
    def fuse_projections(self) -> None:
        """Fused q|k|v and gate|up projections (fewer, larger MatMuls in the graph)."""
        for m in self.modules():
            if m is not self and hasattr(m, "fuse_projections"):
                m.fuse_projections()

    def prepare_rope_tables(self, max_seq: int, dtype) -> None:
        """cos/sin tables for attention that rotates inside GroupQueryAttention (ort flavour);
        layers whose rope cannot be a table keep rotating in the graph."""
        self.rope_tables = {}
        for name, r in self.rotaries.items():
            t = r.cache(max_seq, dtype)
            if t is not None:
                self.rope_tables[name] = t
        for i, layer in enumerate(self.layers):
            layer.self_attn.rope_in_op = self.layer_rope[i] in self.rope_tables

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def empty_cache(self, max_seq: int, batch: int = 1, dtype=torch.float32):
        a = self.layers[0].self_attn
        shape = (batch, a.kv_heads, max_seq, a.head_dim)
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * self.num_layers)]


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's taps: a low, a middle and a high layer (2, L/2, L-3), clamped for shallow models."""
    last = num_layers - 1
    return tuple(sorted(min(max(i, 0), last) for i in (2, num_layers // 2, num_layers - 3)))


def tapped_features(taps: dict, layers) -> torch.Tensor:
    """The tapped layers' outputs concatenated on the last axis, in fp32 like the logits."""
    return torch.cat([taps[i].float() for i in layers], dim=-1)


class DecoderLayer(nn.Module):
    """Pre-norm block used by llama, mistral, qwen2/3 and phi3."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, h, cos, sin, position, pk, pv, kv_mode):
        a, k, v = self.self_attn(self.input_layernorm(h), cos, sin, position, pk, pv, kv_mode)
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k, v
