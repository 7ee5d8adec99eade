"""Attention as one custom op for the ONNX Runtime graph flavour.

`specedge::gqa` = cache write + masked attention over the cache. Exported for ONNX Runtime it
becomes com.microsoft GroupQueryAttention with past and present sharing one buffer, which writes
the new entries in place and attends only to the live context (position + T keys), so a step's
cost follows the context rather than max_seq. The torch implementation is the reference the
graph is checked against.
"""

from __future__ import annotations

import torch

from .common import attend, attention_mask, cache_write


@torch.library.custom_op("specedge::gqa", mutates_args=())
def gqa(
    q: torch.Tensor,  # [B, H, T, D], rope applied
    k: torch.Tensor,  # [B, KVH, T, D]
    v: torch.Tensor,
    past_k: torch.Tensor,  # [B, KVH, S, D]
    past_v: torch.Tensor,
    position: torch.Tensor,  # [B]
    scale: float,
    window: int,  # <= 0: no sliding window
    softcap: float,  # <= 0: none
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kc = cache_write(past_k, k, position)
    vc = cache_write(past_v, v, position)
    mask = attention_mask(position, q.shape[2], past_k.shape[2], window if window > 0 else None)
    out = attend(q, kc, vc, mask, scale, softcap if softcap > 0 else None)
    return out.to(q.dtype), kc, vc


@gqa.register_fake
def _gqa_fake(q, k, v, past_k, past_v, position, scale, window, softcap):
    b, h, t, d = q.shape
    return q.new_empty((b, t, h * v.shape[-1])), torch.empty_like(past_k), torch.empty_like(past_v)


def _gqa_schema():
    from onnx.defs import OpSchema

    FP = OpSchema.FormalParameter
    T = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    ins = [FP(n, "T") for n in ("query", "key", "value", "past_key", "past_value")]
    ins += [FP("seqlens_k", "M"), FP("total_sequence_length", "M")]
    outs = [FP(n, "T") for n in ("output", "present_key", "present_value")]
    A = OpSchema.AttrType
    attrs = [
        OpSchema.Attribute("num_heads", A.INT, "query heads"),
        OpSchema.Attribute("kv_num_heads", A.INT, "key/value heads"),
        OpSchema.Attribute("scale", A.FLOAT, "softmax scale"),
        OpSchema.Attribute("local_window_size", A.INT, "sliding window, -1 for none"),
        OpSchema.Attribute("softcap", A.FLOAT, "logit soft-capping, 0 for none"),
        OpSchema.Attribute("do_rotary", A.INT, "rotary inside the op"),
    ]
    return OpSchema(
        "GroupQueryAttention", "com.microsoft", 1, inputs=ins, outputs=outs,
        type_constraints=[("T", T, "float types"), ("M", ["tensor(int32)"], "lengths")], attributes=attrs,
    )


def gqa_onnx(q, k, v, past_k, past_v, position, scale: float, window: int, softcap: float):
    """ONNX translation: com.microsoft GroupQueryAttention (do_rotary=0: rope is already applied
    by our graph, which keeps every family's rope variant exact)."""
    from onnxscript import values
    from onnxscript.onnx_opset import opset24 as op
    from onnxscript import ir

    # ONNX has no schema for ONNX Runtime's contrib ops; the exporter needs one to emit the node.
    group_query_attention = values.Op(values.Opset("com.microsoft", 1), "GroupQueryAttention", _gqa_schema())
    heads = q.shape[1]
    kv_heads = past_k.shape[1]
    # [B, H, T, D] -> [B, T, H*D], the layout GroupQueryAttention takes.
    qf = op.Reshape(op.Transpose(q, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))
    kf = op.Reshape(op.Transpose(k, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))
    vf = op.Reshape(op.Transpose(v, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))
    t = op.Shape(q, start=2, end=3)
    total = op.Add(position, t)  # [B] int64: keys visible to the last new token
    seqlens = op.Cast(op.Sub(total, op.Constant(value_ints=[1])), to=ir.DataType.INT32)
    total_len = op.Cast(op.ReduceMax(total, keepdims=0), to=ir.DataType.INT32)
    out, pk, pv = group_query_attention(
        qf, kf, vf, past_k, past_v, seqlens, total_len,
        num_heads=int(heads), kv_num_heads=int(kv_heads), scale=float(scale),
        local_window_size=int(window) if window > 0 else -1, softcap=float(softcap) if softcap > 0 else 0.0,
        do_rotary=0,
    )
    return out, pk, pv
