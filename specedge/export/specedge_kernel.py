"""GGUF Q4_1 weights for specedge's own int4 CPU kernel, ai.specedge.MatMulQ41
(cpp/ops/specedge_ops.cpp): the layout it reads and the check that a weight fits it.

MatMulNBits cannot hold a Q4_1 block's min, so the default int4 graph computes it as a correction
(four nodes per weight, ~a quarter of a decode step on SmolLM2-135M); MatMulQ41 reads codes, scale
and min together, 0.625 bytes per weight as in the GGUF file, and needs no correction."""

from __future__ import annotations

import numpy as np

from ..custom_ops import DOMAIN, LIBRARY

OP = "MatMulQ41"
# ai.specedge.MatMulQ80: MatMulNBits' own 8-bit inputs (the lm_head's GGUF Q8_0 embedding), rows
# independent of T and one weight read for all rows of a verification call
Q8_OP = "MatMulQ80"
# Which kernel runs an int4 graph's 4-bit affine weights (export-models --int4-kernel):
# ONNX Runtime's MatMulNBits + a block-min correction, or specedge's MatMulQ41.
KERNELS = ("matmulnbits", "specedge")
# export-models --int4-kernel: which graphs an int4 model gets. "auto" (the default) both, over
# one weights file (int4_graphs.py), the runtime choosing at load; otherwise that one only.
EXPORT_KERNELS = ("auto", *KERNELS)
ROWS = 16  # output rows per packed group
BLOCK_BYTES = 320  # per group and block of 32 inputs: 256 code bytes, 16 fp16 scales, 16 fp16 mins


def _fp16_exact(x: np.ndarray) -> np.ndarray | None:
    h = x.astype(np.float16)
    return h if np.array_equal(h.astype(np.float32), x) else None


def pack_q41(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> np.ndarray | None:
    """uint8 [N/16, K/32, 320] for w[n, 32b + j] = scales[n, b]·codes[n, 32b + j] + mins[n, b]
    (codes uint8 0..15 [N, K]; scales, mins fp32 [N, K/32]), or None when the weight does not fit
    the kernel: N not a multiple of 16, or a scale or min that fp16 does not hold exactly (Q4_1's
    are fp16 in the file; Q4_K's products of two scales may not be)."""
    n, k = codes.shape
    nb = k // 32
    if n % ROWS or k % 32 or codes.max(initial=0) > 15 or scales.shape != (n, nb) or mins.shape != (n, nb):
        return None
    d16, m16 = _fp16_exact(scales.astype(np.float32)), _fp16_exact(mins.astype(np.float32))
    if d16 is None or m16 is None:
        return None
    g = n // ROWS
    # [g, b, h (0..7: 4-value slices of the block), row, i] -> byte 64h + 4row + i holds slice h
    # in its low nibble and slice h + 4 in its high nibble
    c = codes.astype(np.uint8).reshape(g, ROWS, nb, 8, 4).transpose(0, 2, 3, 1, 4)
    body = (c[:, :, :4] | (c[:, :, 4:] << 4)).reshape(g, nb, 256)

    def per_group(x16: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x16.reshape(g, ROWS, nb).transpose(0, 2, 1)).view(np.uint8).reshape(g, nb, 32)

    return np.ascontiguousarray(np.concatenate([body, per_group(d16), per_group(m16)], axis=2))


def unpack_q41(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of pack_q41: (codes [N, K], scales [N, K/32], mins [N, K/32])."""
    g, nb, _ = packed.shape
    body = packed[:, :, :256].reshape(g, nb, 4, ROWS, 4)
    c = np.concatenate([body & 0x0F, body >> 4], axis=2)  # [g, b, 8, row, i]
    codes = c.transpose(0, 3, 1, 2, 4).reshape(g * ROWS, nb * 32)

    def back(x: np.ndarray) -> np.ndarray:
        return (
            np.ascontiguousarray(x)
            .view(np.float16)
            .reshape(g, nb, ROWS)
            .transpose(0, 2, 1)
            .reshape(g * ROWS, nb)
            .astype(np.float32)
        )

    return codes, back(packed[:, :, 256:288]), back(packed[:, :, 288:320])


def reference(a: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """What MatMulQ41 computes, in numpy (float64 sums; the kernel's own are fp32): A quantized to
    int8 per block of 32 (scale max|a|/127, round half to even), codes centred on 8, mins times
    the fp32 block sums. For tests."""
    codes, d, m = unpack_q41(packed)
    n, k = codes.shape
    nb = k // 32
    x = a.reshape(-1, nb, 32).astype(np.float32)
    scale = (np.abs(x).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0).astype(np.float32)
    aq = np.rint(x * inv[..., None])
    cw = codes.reshape(n, nb, 32).astype(np.float64) - 8
    dot = np.einsum("rbj,nbj->rnb", aq.astype(np.float64), cw)
    y = np.einsum("rnb,nb,rb->rn", dot, d.astype(np.float64), scale.astype(np.float64))
    y += np.einsum("rb,nb->rn", x.sum(-1, dtype=np.float64), (m + 8 * d).astype(np.float64))
    return y.reshape(*a.shape[:-1], n).astype(np.float32)


def custom_op_libraries(proto) -> list[str]:
    """The custom-op libraries an ONNX graph needs (its manifest entry's `custom_ops`)."""
    return [LIBRARY] if any(n.domain == DOMAIN for n in proto.graph.node) else []


ATTENTION_OP = "GroupQueryAttention"  # ai.specedge's: com.microsoft's contract, rows independent of T

# (domain, op) of nodes whose rows depend on how many rows a call has (an M = 1 path that sums
# in another order than M >= 2 on ONNX Runtime's CPU kernels): a graph holding any of them
# needs padded single-token steps for exact speculation (runtime/invariant.py).
_BATCH_VARIANT = {
    ("com.microsoft", "GroupQueryAttention"),
    ("com.microsoft", "MultiHeadAttention"),
    ("com.microsoft", "Attention"),
    ("", "Attention"),
    ("", "MatMul"),
    ("", "Gemm"),
}


def _head_size(graph, past: str) -> int | None:
    for v in graph.input:
        if v.name == past:
            dims = v.type.tensor_type.shape.dim
            return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None
    return None


def use_specedge_attention(proto) -> int:
    """Swap each com.microsoft GroupQueryAttention that ai.specedge.GroupQueryAttention
    (cpp/ops/gqa_attention.cpp) supports for it: fp32 K/V read from a graph input, no softcap,
    rotate-half rotary, a head size that is a multiple of 16. Same inputs, outputs and
    attributes; in place. Returns how many were swapped."""
    from onnx import TensorProto

    g = proto.graph
    kv_fp32 = {v.name for v in g.input if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    n = 0
    for node in g.node:
        if (node.domain, node.op_type) != ("com.microsoft", "GroupQueryAttention") or len(node.input) < 5:
            continue
        attrs = {a.name: a for a in node.attribute}
        head = _head_size(g, node.input[3])
        if (
            node.input[3] not in kv_fp32
            or head is None
            or head % 16
            or ("softcap" in attrs and attrs["softcap"].f != 0)
            or ("rotary_interleaved" in attrs and attrs["rotary_interleaved"].i != 0)
        ):
            continue
        node.domain = DOMAIN
        n += 1
    if n and not any(o.domain == DOMAIN for o in proto.opset_import):
        from onnx import helper

        proto.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return n


def use_specedge_q8(proto) -> int:
    """Swap each com.microsoft MatMulNBits of 8 bits, block 32, no zero point, with B and scales
    initializers and N a multiple of 16 for ai.specedge.MatMulQ80 (cpp/ops/specedge_ops.cpp), which
    takes the same inputs (so the weights file is unchanged); in place. Returns how many."""
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    n = 0
    for node in g.node:
        if (node.domain, node.op_type) != ("com.microsoft", "MatMulNBits") or len(node.input) != 3:
            continue
        attrs = {a.name: a.i for a in node.attribute}
        b = inits.get(node.input[1])
        if (
            attrs.get("bits") != 8
            or attrs.get("block_size") != 32
            or b is None
            or node.input[2] not in inits
            or len(b.dims) != 3
            or b.dims[2] != 32
            or b.dims[0] % ROWS
        ):
            continue
        node.domain, node.op_type = DOMAIN, Q8_OP
        n += 1
    if n and not any(o.domain == DOMAIN for o in proto.opset_import):
        from onnx import helper

        proto.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return n


def batch_invariant(proto) -> bool:
    """Whether every row of the graph's output is computed the same whatever the number of rows
    (T) of the call, judged by its ops: no ONNX Runtime attention or fp32 MatMul/Gemm (M = 1
    paths), and MatMulNBits only at accuracy level 4 (int8 activations per row). The runtimes
    check it once more on the machine they run on before they rely on it."""
    for node in proto.graph.node:
        if (node.domain, node.op_type) in _BATCH_VARIANT:
            return False
        if node.op_type == "MatMulNBits":
            level = next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
            if level != 4:
                return False
    return True
