"""Post-passes on exported graphs: weight-only int8/int4 (MatMulNBits, through onnxruntime's own
quantizer; or DequantizeLinear before each MatMul, the form TensorRT parses) and sharing the tied
embedding / lm_head weight."""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

BLOCK_SIZE = 32
# accuracy_level 4 lets ORT's CPU kernel quantize activations to int8 for the int4 matmul:
# the fast path onnxruntime-genai also takes on CPU.
ACCURACY_LEVEL = 4


def quantize_weights(
    proto: onnx.ModelProto,
    bits: int,
    block_size: int = BLOCK_SIZE,
    accuracy_level: int = ACCURACY_LEVEL,
    *,
    gguf: str | None = None,
    say=None,
    info: dict | None = None,
    kernel: str = "matmulnbits",
) -> onnx.ModelProto:
    """Weight-only quantization of every MatMul with a constant weight (lm_head included).

    With `gguf` (the checkpoint's GGUF file), weights that came from its Q4_0/Q4_1/Q4_K/Q8_0
    tensors are stored exactly as the file holds them (gguf_exact.py); the other MatMuls are
    re-quantized by onnxruntime's quantizer (symmetric, `block_size`). `info`, when given, is
    filled with how each weight was quantized (recorded in the manifest). `kernel`: which kernel
    runs 4-bit affine weights (gguf_exact.rewrite_exact)."""
    say = say or (lambda msg: None)
    exact = None
    if gguf is not None:
        from .gguf_exact import rewrite_exact, row_index

        index = row_index(gguf, say=say)
        exact = rewrite_exact(proto, index, bits, accuracy_level, say=say, kernel=kernel)
    inits = {t.name for t in proto.graph.initializer}
    keep = exact.helper_nodes if exact is not None else set()
    rest = [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits and n.name not in keep]
    out = proto
    if rest:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        say(f"re-quantizing {len(rest)} MatMul weights (int{bits}, block {block_size})")
        for name in ("onnxruntime.quantization", "root"):
            logging.getLogger(name).setLevel(logging.WARNING)
        q = MatMulNBitsQuantizer(
            proto,
            bits=bits,
            block_size=block_size,
            is_symmetric=True,
            accuracy_level=accuracy_level,
            nodes_to_exclude=sorted(keep),
        )
        q.process()
        out = q.model.model
    attention = q8 = 0
    if kernel == "specedge":
        from .specedge_kernel import use_specedge_attention, use_specedge_q8

        # the kernel's attention: same contract, rows independent of T (no padded steps needed)
        attention = use_specedge_attention(out)
        # the 8-bit lm_head on specedge's MatMulQ80: one weight read for all rows of a call
        q8 = use_specedge_q8(out)
    # MatMulQ41 (the specedge int4 kernel) replaces MatMulNBits for GGUF-exact Q4_1 weights.
    total = sum(n.op_type in ("MatMulNBits", "MatMulQ41", "MatMulQ80") for n in out.graph.node)
    if not total:
        raise RuntimeError("int quantization found no MatMul with constant weights to quantize")
    if info is not None:
        n_exact = exact.exact if exact is not None else 0
        info.clear()
        info["method"] = "gguf-exact" if n_exact == total else "gguf-exact+requantized" if n_exact else "requantized"
        info["exact_matmuls"] = n_exact
        info["requantized_matmuls"] = total - n_exact
        if exact is not None:
            info.update(exact.to_json())
        if total - n_exact:
            info["requantized"] = {
                "bits": bits,
                "block_size": block_size,
                "symmetric": True,
                "tool": "onnxruntime MatMulNBitsQuantizer",
            }
        info["accuracy_level"] = accuracy_level
        if attention:
            info["specedge_attention"] = attention
        if q8:
            info["specedge_q8_matmuls"] = q8
    return out


def quantize_matrix(w, bits: int, block_size: int, name: str = "w"):
    """Symmetric weight-only quantization of a MatMul weight W [K, N] as DequantizeLinear
    inputs: (quantized initializer, scale initializer, node attributes). int8: one scale per
    output column; int4: one per `block_size` rows of each column (opset 21's blocked form)."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if bits == 8:
        scale = np.abs(w).max(axis=0) / 127.0
        scale[scale == 0] = 1.0
        q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        return (
            numpy_helper.from_array(q, name + "_q"),
            numpy_helper.from_array(scale.astype(np.float32), name + "_s"),
            {"axis": 1},
        )
    if k % block_size:
        raise ValueError(f"{k} rows are not a multiple of the block size {block_size}")
    blocks = np.abs(w.reshape(k // block_size, block_size, n)).max(axis=1)
    scale = blocks / 7.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / np.repeat(scale, block_size, axis=0)), -8, 7).astype(np.int8)
    qt = helper.make_tensor(name + "_q", TensorProto.INT4, [k, n], q.flatten().tolist())
    return qt, numpy_helper.from_array(scale.astype(np.float32), name + "_s"), {"axis": 0, "block_size": block_size}


def quantize_dq(
    proto: onnx.ModelProto, bits: int, block_size: int = BLOCK_SIZE, opset: int | None = None, info: dict | None = None
) -> onnx.ModelProto:
    """Weight-only quantization as standard ops: every MatMul with a constant 2-D weight reads it
    through a DequantizeLinear (quantize_matrix). `opset`: the opset the result declares (int4's
    blocked form needs 21; a graph below it is converted by onnx's version converter)."""
    from onnx import version_converter

    inits = {t.name: t for t in proto.graph.initializer}
    nodes = []
    done: dict[str, str] = {}
    for n in proto.graph.node:
        w = inits.get(n.input[1]) if n.op_type == "MatMul" else None
        if w is not None and len(w.dims) == 2 and (bits == 8 or w.dims[0] % block_size == 0):
            if w.name not in done:
                q, s, attrs = quantize_matrix(numpy_helper.to_array(w), bits, block_size, name=w.name)
                proto.graph.initializer.extend([q, s])
                out = w.name + "_dq"
                nodes.append(helper.make_node("DequantizeLinear", [q.name, s.name], [out], name=out, **attrs))
                done[w.name] = out
            n.input[1] = done[w.name]
        nodes.append(n)
    if not done:
        raise RuntimeError("int quantization found no MatMul with constant weights to quantize")
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    used = {i for n in proto.graph.node for i in n.input}  # a tied embedding's Gather keeps its table
    keep = [t for t in proto.graph.initializer if t.name not in done or t.name in used]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    if info is not None:
        info.clear()
        info.update(
            {
                "method": "dequantizelinear",
                "bits": bits,
                "symmetric": True,
                "granularity": "per-channel" if bits == 8 else f"block {block_size}",
                "matmuls": len(done),
            }
        )
    current = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    if opset is not None and opset > current:
        proto = version_converter.convert_version(proto, opset)
        proto.ir_version = helper.find_min_ir_version_for(list(proto.opset_import))
    return proto


def describe(precision: str, info: dict) -> str:
    """One line for the manifest's `weights` field (shown by `specedge inspect`)."""
    if info.get("method") == "dequantizelinear":
        return f"{precision} weight-only (DequantizeLinear, {info['granularity']}, symmetric)"
    head = f"{precision} weight-only (MatMulNBits"
    if not info or not info.get("exact_matmuls"):
        return head + ")"
    n, m = info["exact_matmuls"], info.get("requantized_matmuls", 0)
    types = ", ".join(info.get("source_types", {}))
    tail = f"; {m} re-quantized to {precision}" if m else ""
    k = info.get("specedge_kernel_matmuls", 0)
    kern = f"; {k} run by the specedge int4 kernel MatMulQ41" if k else ""
    a = info.get("specedge_attention", 0)
    kern += f"; {a} attention layers on specedge's batch-invariant GroupQueryAttention" if a else ""
    q8 = info.get("specedge_q8_matmuls", 0)
    kern += f"; {q8} 8-bit MatMulNBits as specedge's MatMulQ80 (one weight read per call)" if q8 else ""
    return f"{head}; {n} of {n + m} weights GGUF-exact from {types}{tail}{kern})"


def share_tied_embedding(proto: onnx.ModelProto) -> bool:
    """With tied embeddings the exporter stores the table twice: [V, H] for the Gather and a
    transposed copy [H, V] for lm_head. Keep only the copy and gather columns from it, so the
    bundle (and RSS) carries the weight once. Returns whether it changed anything."""
    inits = {t.name: t for t in proto.graph.initializer}
    gathers = [n for n in proto.graph.node if n.op_type == "Gather" and n.input[0] in inits]
    for g in gathers:
        emb = inits[g.input[0]]
        if len(emb.dims) != 2:
            continue
        v, h = emb.dims
        for n in proto.graph.node:
            if n.op_type != "MatMul" or n.input[1] not in inits:
                continue
            w = inits[n.input[1]]
            if list(w.dims) != [h, v]:
                continue
            e_arr, w_arr = numpy_helper.to_array(emb), numpy_helper.to_array(w)
            if not np.array_equal(e_arr.T, w_arr):
                continue
            # Gather(W [H, V], ids [B, T], axis=1) -> [H, B, T] -> transpose to [B, T, H].
            cols = g.output[0] + "/cols"
            new_g = helper.make_node("Gather", [w.name, g.input[1]], [cols], axis=1, name=g.name + "/tied")
            tr = helper.make_node("Transpose", [cols], [g.output[0]], perm=[1, 2, 0], name=g.name + "/tied_t")
            idx = list(proto.graph.node).index(g)
            proto.graph.node.remove(g)
            proto.graph.node.insert(idx, tr)
            proto.graph.node.insert(idx, new_g)
            if not any(emb.name in x.input for x in proto.graph.node):
                proto.graph.initializer.remove(emb)
            return True
    return False


def weight_bytes(proto: onnx.ModelProto) -> int:
    """Bytes of weights read per forward pass: every initializer except tables only indexed by
    Gather (an embedding lookup reads T rows, not the table)."""
    gather_only = set()
    users: dict[str, set[str]] = {}
    for n in proto.graph.node:
        for i, x in enumerate(n.input):
            users.setdefault(x, set()).add(n.op_type if not (n.op_type == "Gather" and i == 0) else "GatherData")
    for name, ops in users.items():
        if ops == {"GatherData"}:
            gather_only.add(name)
    total = 0
    for t in proto.graph.initializer:
        if t.name in gather_only:
            continue
        total += _nbytes(t)
    return total


def _nbytes(t: onnx.TensorProto) -> int:
    n = int(np.prod(t.dims)) if len(t.dims) else 1
    size = {1: 4, 10: 2, 16: 2, 7: 8, 6: 4, 2: 1, 3: 1, 21: 1, 22: 1}.get(t.data_type, 4)
    return n * size


def num_params(proto: onnx.ModelProto) -> int:
    return sum(
        int(np.prod(t.dims)) if len(t.dims) else 1 for t in proto.graph.initializer if t.data_type in (1, 10, 16)
    )
