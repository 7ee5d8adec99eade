"""One int4 model, two graphs over one weights file: the specedge graph (ai.specedge.MatMulQ41 and
the batch-invariant attention, libspecedge_ops) and its MatMulNBits twin (ONNX Runtime's own
kernels), so that the runtime picks the kernel at load (runtime/int4_kernel.py) and the bundle
stays one size (docs/design.md "Choosing the int4 kernel at load").

The twin reads the same packed Q4_1 tensors as MatMulQ41 and turns them into MatMulNBits's codes,
scales and block-min correction with standard ONNX ops on initializers only: ONNX Runtime folds
them once when it creates the session (constant folding, any optimization level but "none"), and
MatMulNBits then pre-packs the folded weights as if they had been stored."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .gguf_exact import _blocksum_nodes, _ranks
from .specedge_kernel import ATTENTION_OP, DOMAIN, OP, Q8_OP, ROWS

# fp16 exponent e (0..31) -> the value of one mantissa unit: subnormal 2^-24, else 2^(e-25)
_UNIT = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 32)], dtype=np.float32)
_LEAD = np.array([0.0] + [1024.0] * 31, dtype=np.float32)  # the implicit leading 1, in mantissa units


class _Builder:
    def __init__(self, graph: onnx.GraphProto):
        self.taken = (
            {n.name for n in graph.node}
            | {t.name for t in graph.initializer}
            | {o for n in graph.node for o in n.output}
            | {i.name for i in graph.input}
        )
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.consts: dict[tuple, str] = {}

    def name(self, base: str) -> str:
        out, i = base, 1
        while out in self.taken:
            out, i = f"{base}_{i}", i + 1
        self.taken.add(out)
        return out

    def const(self, value, dtype) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self.consts:
            self.consts[key] = self.name("q41_twin_const")
            self.inits.append(numpy_helper.from_array(arr, self.consts[key]))
        return self.consts[key]

    def op(self, op_type: str, inputs: list[str], base: str, **attrs) -> str:
        out = self.name(base)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out


def _bytes_slice(b: _Builder, packed: str, start: int, stop: int, shape: list[int], base: str) -> str:
    i64 = np.int64
    s = b.op("Slice", [packed, b.const([start], i64), b.const([stop], i64), b.const([2], i64)], base)
    return b.op("Reshape", [s, b.const(shape, i64)], base + "_r")


def _fp16(b: _Builder, packed: str, start: int, g: int, nb: int, base: str) -> str:
    """fp32 [N, nb] of the 16 fp16 values per group and block stored at bytes start..start+32
    (little-endian), decoded exactly with integer arithmetic: sign, exponent, mantissa."""
    pairs = b.op(
        "Cast",
        [_bytes_slice(b, packed, start, start + 32, [g, nb, ROWS, 2], base)],
        base + "_i32",
        to=TensorProto.INT32,
    )
    lo = b.op("Gather", [pairs, b.const(0, np.int64)], base + "_lo", axis=3)
    hi = b.op("Gather", [pairs, b.const(1, np.int64)], base + "_hi", axis=3)
    h = b.op("Add", [lo, b.op("Mul", [hi, b.const(256, np.int32)], base + "_hi256")], base + "_bits")
    mant = b.op(
        "Cast", [b.op("Mod", [h, b.const(1024, np.int32)], base + "_mant")], base + "_mantf", to=TensorProto.FLOAT
    )
    exp = b.op("Mod", [b.op("Div", [h, b.const(1024, np.int32)], base + "_h10"), b.const(32, np.int32)], base + "_exp")
    sign = b.op("Cast", [b.op("Div", [h, b.const(32768, np.int32)], base + "_s")], base + "_sf", to=TensorProto.FLOAT)
    units = b.op(
        "Add", [mant, b.op("Gather", [b.const(_LEAD, np.float32), exp], base + "_lead", axis=0)], base + "_units"
    )
    mag = b.op("Mul", [units, b.op("Gather", [b.const(_UNIT, np.float32), exp], base + "_unit", axis=0)], base + "_mag")
    signed = b.op(
        "Mul",
        [
            mag,
            b.op(
                "Sub",
                [b.const(1.0, np.float32), b.op("Mul", [sign, b.const(2.0, np.float32)], base + "_2s")],
                base + "_sgn",
            ),
        ],
        base + "_val",
    )  # [g, nb, 16]
    rows = b.op("Transpose", [signed], base + "_t", perm=[0, 2, 1])  # [g, 16, nb]
    return b.op("Reshape", [rows, b.const([g * ROWS, nb], np.int64)], base + "_n")


def _nbits_inputs(b: _Builder, packed: str, g: int, nb: int) -> tuple[str, str, str]:
    """(codes uint8 [N, nb, 16], scales fp32 [N·nb], mins' fp32 [nb, N]) of MatMulNBits and its
    correction (gguf_exact.to_nbits: codes c as stored, mins' = m + 8·d) from a packed Q4_1
    tensor [g, nb, 320] (specedge_kernel.pack_q41)."""
    base = b.name(packed + "_twin")
    u8 = np.uint8
    body = _bytes_slice(b, packed, 0, 256, [g, nb, 4, ROWS, 4], base + "_body")
    low = b.op("BitwiseAnd", [body, b.const(15, u8)], base + "_low")
    high = b.op("BitShift", [body, b.const(4, u8)], base + "_high", direction="RIGHT")
    codes = b.op("Concat", [low, high], base + "_slices", axis=2)  # [g, nb, 8 slices, row, 4]
    codes = b.op("Transpose", [codes], base + "_rows", perm=[0, 3, 1, 2, 4])  # [g, row, nb, 8, 4]
    pairs = b.op("Reshape", [codes, b.const([g * ROWS, nb, 16, 2], np.int64)], base + "_pairs")
    even = b.op("Gather", [pairs, b.const(0, np.int64)], base + "_even", axis=3)
    odd = b.op(
        "BitShift",
        [b.op("Gather", [pairs, b.const(1, np.int64)], base + "_odd", axis=3), b.const(4, u8)],
        base + "_odd4",
        direction="LEFT",
    )
    nbits = b.op("BitwiseOr", [even, odd], base + "_codes")
    d = _fp16(b, packed, 256, g, nb, base + "_scale")
    m = _fp16(b, packed, 288, g, nb, base + "_min")
    scales = b.op("Reshape", [d, b.const([g * ROWS * nb], np.int64)], base + "_scales")
    centred = b.op("Add", [m, b.op("Mul", [d, b.const(8.0, np.float32)], base + "_8d")], base + "_m8d")
    return nbits, scales, b.op("Transpose", [centred], base + "_mins", perm=[1, 0])


def matmulnbits_twin(proto: onnx.ModelProto, accuracy_level: int = 4) -> onnx.ModelProto:
    """The graph of `proto` (a specedge int4 graph) with ONNX Runtime's kernels: each MatMulQ41
    becomes MatMulNBits + the block-min correction (as --int4-kernel matmulnbits writes it), each
    ai.specedge attention com.microsoft's, each MatMulQ80 the MatMulNBits it was. Initializers keep their names, so both graphs can
    read one external-data file (save_pair)."""
    twin = onnx.ModelProto()
    twin.CopyFrom(proto)
    g = twin.graph
    dims = {t.name: list(t.dims) for t in g.initializer}
    ranks = _ranks(g)
    b = _Builder(g)
    weights: dict[str, tuple] = {}
    blocksums: dict[str, str] = {}
    out_nodes: list[onnx.NodeProto] = []
    for node in g.node:
        if node.domain == DOMAIN and node.op_type == ATTENTION_OP:
            node.domain = "com.microsoft"
        if node.domain == DOMAIN and node.op_type == Q8_OP:  # MatMulQ80 takes MatMulNBits' own inputs
            node.domain, node.op_type = "com.microsoft", "MatMulNBits"
        if not (node.domain == DOMAIN and node.op_type == OP):
            out_nodes.append(node)
            continue
        a, packed = node.input
        grp, nb, _ = dims[packed]
        k, n = nb * 32, grp * ROWS
        start = len(b.nodes)
        if packed not in weights:
            weights[packed] = _nbits_inputs(b, packed, grp, nb)
        codes, scales, mins = weights[packed]
        if a not in blocksums:
            bs = _blocksum_nodes(a, k, ranks.get(a), b.name, b.inits)
            b.nodes += bs
            blocksums[a] = bs[-1].output[0]
        y = node.output[0]
        mm = b.name(f"{y}_nbits")
        corr = b.name(f"{y}_min_corr")
        b.nodes += [
            helper.make_node(
                "MatMulNBits",
                [a, codes, scales],
                [mm],
                name=b.name(f"{node.name}_nbits"),
                domain="com.microsoft",
                K=k,
                N=n,
                bits=4,
                block_size=32,
                accuracy_level=accuracy_level,
            ),
            helper.make_node("MatMul", [blocksums[a], mins], [corr], name=b.name(f"{node.name}_mins")),
            helper.make_node("Add", [mm, corr], [y], name=b.name(f"{node.name}_add")),
        ]
        out_nodes.extend(b.nodes[start:])
    del g.node[:]
    g.node.extend(out_nodes)
    g.initializer.extend(b.inits)
    keep = [o for o in twin.opset_import if o.domain != DOMAIN]
    del twin.opset_import[:]
    twin.opset_import.extend(keep)
    if not any(o.domain == "com.microsoft" for o in twin.opset_import):
        twin.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    if not any(o.domain in ("", "ai.onnx") and o.version >= 18 for o in twin.opset_import):
        raise ValueError("the twin graph needs ONNX opset 18 or later (BitwiseAnd, BitwiseOr)")
    return twin


def save_pair(specedge: onnx.ModelProto, specedge_path: Path, twin: onnx.ModelProto, twin_path: Path, save) -> str:
    """Write both graphs with one external-data file, named after the twin's (the graph an older
    reader picks): `save(proto, path, data_name)` writes the specedge graph and its weights, then
    the twin's initializers of the same name point at the same bytes. Returns the data file's
    name (relative to the graphs' folder)."""
    data_name = twin_path.name + ".data"
    save(specedge, specedge_path, data_name)
    external = {t.name: t for t in specedge.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    for t in twin.graph.initializer:
        if t.name in external:
            t.CopyFrom(external[t.name])
    # the twin's own tensors are the small constants of its decoding: stored inline
    big = [t.name for t in twin.graph.initializer if t.data_location != TensorProto.EXTERNAL and t.ByteSize() > 1 << 20]
    if big:
        raise ValueError(f"the twin graph has weights of its own ({big[0]}...): it would not share the weights file")
    twin_path.parent.mkdir(parents=True, exist_ok=True)
    with open(twin_path, "wb") as f:
        f.write(twin.SerializeToString())
    os.chmod(twin_path, 0o666 & ~_umask())
    return data_name


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
