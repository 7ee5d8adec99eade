"""`export-models --tensorrt VERSION`: what a bundle for that TensorRT is made of.

Every decision is asked of the TensorRT support table (tensorrt_support.py) with a
one-node probe graph, so the table is the only place that knows what a version parses:

- the kv mode: scatter when the version imports TensorScatter, else delta;
- the opset: TRT_OPSET, the lowest the exporter writes (torch writes 18; onnx's version
  converter has no adapter that takes Split below 18), inside every 10.x and 11.x range;
- the weight-only form of int4/int8 graphs: DequantizeLinear on a constant weight before its
  MatMul, symmetric (onnx-tensorrt requires an all-zero zero point). int8 per output channel
  (opset 13 and later); int4 in blocks along the input axis, which needs opset 21 (the INT4 type
  and DequantizeLinear's block_size), so only where the version's range reaches 21;
- the draft: TensorRT documents INT4 as its weight-only type and INT8 as quantizing activations
  and weights ("Working with Quantized Types"), so only an int4 self-draft is known to be cheaper
  than the target on TensorRT; where int4 is out of range the default draft is the n-gram drafter,
  and an int8 self-draft (which the parser takes) is exported only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

TRT_OPSET = 18
BLOCKED_OPSET = 21


@dataclass(frozen=True)
class TensorRTTarget:
    version: str
    kv_mode: str  # "scatter" | "delta"
    int4: bool  # blocked int4 weights parse (and TensorRT documents INT4 weight-only builds)
    int8: bool  # per-channel int8 weights parse

    def weight_precisions(self) -> list[str]:
        return [p for p, ok in (("int4", self.int4), ("int8", self.int8)) if ok]


def trt_weight_opset(precision: str) -> int:
    """The opset a --tensorrt graph of `precision` declares."""
    return BLOCKED_OPSET if precision == "int4" else TRT_OPSET


def _probe(op: str, opset: int, version: str, **kw) -> bool:
    """Whether `version`'s table takes a one-node graph of `op` at `opset`."""
    from ..tensorrt_support import graph_findings

    return not graph_findings(probe_graph(op, opset, **kw), version)


def probe_graph(op: str, opset: int, bits: int = 8):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from .quantize import quantize_matrix

    f = TensorProto.FLOAT
    if op == "TensorScatter":
        x = [helper.make_tensor_value_info(n, f, [1, 2, 8, 4]) for n in ("cache", "new")]
        node = helper.make_node("TensorScatter", ["cache", "new", "pos"], ["out"], axis=-2)
        inputs = [
            x[0],
            helper.make_tensor_value_info("new", f, [1, 2, 1, 4]),
            helper.make_tensor_value_info("pos", TensorProto.INT64, [1]),
        ]
        outputs = [helper.make_tensor_value_info("out", f, [1, 2, 8, 4])]
        inits = []
        nodes = [node]
    else:  # weight-only DequantizeLinear -> MatMul
        w = np.ones((32, 8), np.float32)
        qw, scale, attrs = quantize_matrix(w, bits, 32)
        inits = [qw, scale]
        nodes = [
            helper.make_node("DequantizeLinear", [qw.name, scale.name], ["w"], **attrs),
            helper.make_node("MatMul", ["x", "w"], ["out"]),
        ]
        inputs = [helper.make_tensor_value_info("x", f, [1, 32])]
        outputs = [helper.make_tensor_value_info("out", f, [1, 8])]
    g = helper.make_graph(nodes, "probe", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = helper.find_min_ir_version_for(list(m.opset_import))
    return onnx.shape_inference.infer_shapes(m)


def resolve(version_text: str) -> TensorRTTarget:
    """The target for `--tensorrt VERSION` (a UserError for a bad or unknown version)."""
    from ..tensorrt_support import parse_tensorrt_version

    version = parse_tensorrt_version(version_text)
    return TensorRTTarget(
        version=version,
        kv_mode="scatter" if _probe("TensorScatter", 24, version) else "delta",
        int4=_probe("DequantizeLinear", BLOCKED_OPSET, version, bits=4),
        int8=_probe("DequantizeLinear", TRT_OPSET, version, bits=8),
    )


def check_options(
    t: TensorRTTarget,
    *,
    kv_mode: str | None,
    graphs: str,
    precision: str,
    draft_kind: str,
    draft_precision: str,
    int4_kernel: str,
) -> None:
    """Refuse, in one sentence, export options that contradict --tensorrt."""
    flag = f"--tensorrt {t.version}"
    if kv_mode == "scatter" and t.kv_mode != "scatter":
        raise UserError(
            f"{flag} needs --kv-update delta: TensorRT {t.version} does not import TensorScatter "
            "(scatter mode); leave --kv-update out"
        )
    if graphs == "ort":
        raise UserError(f"{flag} needs the portable graphs, and --graphs ort has none; leave --graphs out")
    if int4_kernel == "specedge":
        raise UserError(
            f"--int4-kernel specedge is specedge's own CPU kernel, which {flag} graphs never hold; "
            "leave --int4-kernel out"
        )
    for what, p in (
        ("--precision", precision),
        ("--draft-precision", draft_precision if draft_kind == "self" else None),
    ):
        if p in ("int4", "int8") and p not in t.weight_precisions():
            ok = ", ".join(t.weight_precisions()) or "none"
            raise UserError(
                f"{what} {p} does not build on TensorRT {t.version} (weight-only forms it takes: {ok}); "
                f"choose another {what} or a newer --tensorrt"
            )


def default_draft(t: TensorRTTarget, precision: str) -> str:
    """export-models' draft for --tensorrt when none is named: a self-draft where this TensorRT
    takes int4 weights (and the target is not quantized already), else the n-gram drafter."""
    return "self" if t.int4 and precision not in ("int4", "int8") else "ngram"


def default_draft_precision(t: TensorRTTarget) -> str:
    """A self-draft's precision when none is named: int4 where this TensorRT takes it, else int8."""
    return (t.weight_precisions() or ["fp16"])[0]
