"""Attention as one custom op for the ONNX Runtime graph flavour.

`specedge::gqa` = cache write + masked attention over the cache. Exported for ONNX Runtime it
becomes com.microsoft GroupQueryAttention with past and present sharing one buffer, which writes
the new entries in place and attends only to the live context (position + T keys), so a step's
cost follows the context rather than max_seq. The torch implementation is the reference the
graph is checked against.
"""

from __future__ import annotations

import torch

from .attention import apply_rope, attend, attention_mask, cache_write, new_positions, tree_positions


@torch.library.custom_op("specedge::gqa", mutates_args=())
def gqa(
    q: torch.Tensor,  # [B, T, H*D]; packed [B, T, (H + 2 KVH)*D] when k and v are None
    k: torch.Tensor | None,  # [B, T, KVH*D]
    v: torch.Tensor | None,
    past_k: torch.Tensor,  # [B, KVH, S, D]
    past_v: torch.Tensor,
    cos: torch.Tensor | None,  # [S, rot/2]: rotate q and k inside (rotate-half layout); None: done
    sin: torch.Tensor | None,
    seqlens_k: torch.Tensor,  # int32 [B]: position + T - 1, GroupQueryAttention's own input
    total_len: torch.Tensor,  # int32 scalar: max over the batch of position + T
    tree: torch.Tensor | None,  # bool [B, T, T] ancestor mask of a tree call; None: a causal chain
    scale: float,
    window: int,  # <= 0: no sliding window
    softcap: float,  # <= 0: none
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, t, _ = q.shape
    kvh, d = past_k.shape[1], past_k.shape[3]
    position = seqlens_k.long() + 1 - t
    if k is None or v is None:
        q, k, v = q.split([num_heads * d, kvh * d, kvh * d], dim=-1)
    qh = q.reshape(b, t, num_heads, d).transpose(1, 2)
    kh = k.reshape(b, t, kvh, d).transpose(1, 2)
    vh = v.reshape(b, t, kvh, d).transpose(1, 2)
    if cos is not None and sin is not None:
        pos = new_positions(position, t) if tree is None else tree_positions(position, tree)  # [B, T]
        c = torch.cat([cos[pos], cos[pos]], dim=-1)[:, None]  # [B, 1, T, rot]
        s_ = torch.cat([sin[pos], sin[pos]], dim=-1)[:, None]
        qh, kh = apply_rope(qh, c, s_), apply_rope(kh, c, s_)
    kc = cache_write(past_k, kh, position)
    vc = cache_write(past_v, vh, position)
    mask = attention_mask(position, t, past_k.shape[2], window if window > 0 else None, tree)
    out = attend(qh, kc, vc, mask, scale, softcap if softcap > 0 else None)
    return out.to(q.dtype), kc, vc


@gqa.register_fake
def _gqa_fake(q, k, v, past_k, past_v, cos, sin, seqlens_k, total_len, tree, scale, window, softcap, num_heads):
    b, t, _ = q.shape
    return q.new_empty((b, t, num_heads * past_v.shape[-1])), torch.empty_like(past_k), torch.empty_like(past_v)


def _gqa_schema():
    from onnx.defs import OpSchema

    FP = OpSchema.FormalParameter
    T = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    ins = [FP(n, "T") for n in ("query", "key", "value", "past_key", "past_value")]
    ins[1] = FP("key", "T", param_option=OpSchema.FormalParameterOption.Optional)
    ins[2] = FP("value", "T", param_option=OpSchema.FormalParameterOption.Optional)
    ins += [FP("seqlens_k", "M"), FP("total_sequence_length", "M")]
    ins += [FP(n, "T", param_option=OpSchema.FormalParameterOption.Optional) for n in ("cos_cache", "sin_cache")]
    ins += [
        FP("position_ids", "P", param_option=OpSchema.FormalParameterOption.Optional),
        FP("attention_bias", "T", param_option=OpSchema.FormalParameterOption.Optional),
    ]
    outs = [FP(n, "T") for n in ("output", "present_key", "present_value")]
    A = OpSchema.AttrType
    attrs = [
        OpSchema.Attribute("num_heads", A.INT, "query heads"),
        OpSchema.Attribute("kv_num_heads", A.INT, "key/value heads"),
        OpSchema.Attribute("scale", A.FLOAT, "softmax scale"),
        OpSchema.Attribute("local_window_size", A.INT, "sliding window, -1 for none"),
        OpSchema.Attribute("softcap", A.FLOAT, "logit soft-capping, 0 for none"),
        OpSchema.Attribute("do_rotary", A.INT, "rotary inside the op"),
        OpSchema.Attribute("rotary_interleaved", A.INT, "0: rotate-half layout"),
    ]
    return OpSchema(
        "GroupQueryAttention",
        "com.microsoft",
        1,
        inputs=ins,
        outputs=outs,
        type_constraints=[
            ("T", T, "float types"),
            ("M", ["tensor(int32)"], "lengths"),
            ("P", ["tensor(int64)"], "positions"),
        ],
        attributes=attrs,
    )


def gqa_onnx(
    q,
    k,
    v,
    past_k,
    past_v,
    cos,
    sin,
    seqlens_k,
    total_len,
    tree,
    scale: float,
    window: int,
    softcap: float,
    num_heads: int,
):
    """ONNX translation: com.microsoft GroupQueryAttention. With cos/sin tables the op rotates q
    and k itself (do_rotary=1, positions from seqlens_k, or from position_ids in a tree call);
    without, rope was applied in the graph (longrope, or tables the kernel cannot take).

    A tree call's ancestor mask becomes the op's attention_bias [B, 1, T, position + T]: 0 for
    every past slot, 0 / -inf among the new tokens. The op's own causal mask stays on: a tree's
    tokens come in topological order, so every ancestor sits at an earlier slot anyway."""
    from onnxscript import values

    # ONNX has no schema for ONNX Runtime's contrib ops; the exporter needs one to emit the node.
    group_query_attention = values.Op(values.Opset("com.microsoft", 1), "GroupQueryAttention", _gqa_schema())
    kv_heads = past_k.shape[1]
    rotary = cos is not None
    position_ids = bias = None
    if tree is not None:
        position_ids, bias = _tree_inputs(q, tree, seqlens_k, total_len, window)
        if not rotary:
            position_ids = None
        window = 0  # the bias holds the window (see _tree_inputs)
    out, pk, pv = group_query_attention(
        q,
        k,
        v,
        past_k,
        past_v,
        seqlens_k,
        total_len,
        cos,
        sin,
        position_ids,
        bias,
        num_heads=int(num_heads),
        kv_num_heads=int(kv_heads),
        scale=float(scale),
        local_window_size=int(window) if window > 0 else -1,
        softcap=float(softcap) if softcap > 0 else 0.0,
        do_rotary=int(rotary),
        rotary_interleaved=0,
    )
    return out, pk, pv


def _tree_inputs(q, tree, seqlens_k, total_len, window: int):
    """GroupQueryAttention's position_ids (position + depth) and attention_bias for an ancestor
    mask, in ONNX ops (the bias's width, position + T, is only known at run time).

    The op's local window counts from a query's slot, position + t; a tree token's position is
    position + depth (<= its slot), so its window starts earlier than the op's would and the op's
    window must be off: for sliding layers the bias drops the keys outside the window counted
    from position + depth. (Sliding layers of a tree graph then attend over the whole live
    context; the families with windows pay that, full-attention models do not.)"""
    import numpy as np
    from onnxscript import ir
    from onnxscript.onnx_opset import opset24 as op

    i64 = ir.DataType.INT64
    one = op.Constant(value_ints=[1])
    t = op.Shape(q, start=1, end=2)
    b = op.Shape(q, start=0, end=1)
    depth = op.Sub(
        op.ReduceSum(op.Cast(tree, to=i64), op.Constant(value_ints=[-1]), keepdims=0), op.Constant(value_int=1)
    )
    # seqlens_k = position + T - 1
    position = op.Sub(op.Add(op.Cast(seqlens_k, to=i64), op.Constant(value_int=1)), t)
    position_ids = op.Add(op.Unsqueeze(position, one), depth)  # [B, T]
    past = op.Sub(op.Cast(op.Reshape(total_len, one), to=i64), t)
    zero = op.CastLike(op.Constant(value_float=0.0), q)
    ninf = op.CastLike(op.Constant(value_float=float(-np.inf)), q)
    if window > 0:
        # key j (a past slot) or u (a new token at position_ids[u]) is in query t's window iff
        # its position > position_ids[t] - window
        lo = op.Unsqueeze(op.Sub(position_ids, op.Constant(value_int=int(window))), op.Constant(value_ints=[-1]))
        j = op.Range(op.Constant(value_int=0), op.Reshape(past, op.Constant(value_ints=[])), op.Constant(value_int=1))
        old_seen = op.Greater(
            op.Unsqueeze(op.Unsqueeze(j, op.Constant(value_ints=[0])), op.Constant(value_ints=[0])), lo
        )
        new_seen = op.And(tree, op.Greater(op.Unsqueeze(position_ids, one), lo))
        seen = op.Concat(op.Expand(old_seen, op.Concat(b, t, past, axis=0)), new_seen, axis=-1)
        return position_ids, op.Unsqueeze(op.Where(seen, zero, ninf), one)
    new = op.Where(op.Unsqueeze(tree, one), zero, ninf)
    old = op.Expand(zero, op.Concat(b, one, t, past, axis=0))
    return position_ids, op.Concat(old, new, axis=-1)


def gqa_lengths(position: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupQueryAttention's seqlens_k and total_sequence_length, computed once per forward (not
    once per layer) from the write offset and the number of new tokens."""
    total = position + t
    return (total - 1).to(torch.int32), total.max().to(torch.int32)
