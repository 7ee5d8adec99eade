"""Trace a static-KV model to one ONNX graph that follows the graph contract of docs/design.md.

Only T (new tokens per call) is symbolic; batch, cache length, heads and vocabulary are fixed.
The cache write is the custom op `specedge::cache_write`, mapped to ONNX TensorScatter (opset 24)
so ONNX Runtime updates the cache in place when past and present share one buffer.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path

import onnx
import torch

from ..contract import FEATURES_OUTPUT, TREE_INPUT, graph_io
from ..manifest import GRAPH_OPSET
from ..models.common import unfuse_norms
from ..models.gqa import gqa_onnx

FLAVOURS = ("portable", "ort")

OPSET = GRAPH_OPSET
FORBIDDEN_OPS = {"If", "Loop", "Scan"}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _tensor_scatter(cache, new, position):
    from onnxscript.onnx_opset import opset24 as op

    return op.TensorScatter(cache, new, position, axis=-2)


@contextlib.contextmanager
def _quiet():
    """torch.onnx prints pages of notes and warnings; the CLI shows its own progress instead."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(io.StringIO()):
                yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def export_graph(
    model: torch.nn.Module,
    out_path: Path,
    max_seq: int,
    kv_mode: str,
    precision: str = "fp32",
    batch: int = 1,
    flavour: str = "portable",
    tree: bool = False,
    opset: int = OPSET,
) -> None:
    """Export `model` (a specedge.models module) to `out_path` (+ `out_path.data`).

    precision fp32/fp16/bf16 sets the weight and KV dtype; int8/int4 are exported in fp32 and
    quantized afterwards by `quantize.py`.

    flavour "portable" uses standard ONNX ops only (what TensorRT parses); "ort" (scatter contract
    only) fuses each layer's cache write + attention into ONNX Runtime's GroupQueryAttention, which
    updates the shared cache buffer in place and attends to the live context only.

    tree: the graph also takes the `tree_mask` input (contract.TREE_INPUT): the ancestor mask
    among the new tokens, from which it derives their rotary positions (position + depth) and
    masks (docs/design.md, "Tree calls").

    opset below OPSET (an older TensorRT's range, export/tensorrt_target.py): the graph declares
    it and the IR version that goes with it, and every norm is written out elementwise.
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown graph flavour '{flavour}'")
    if flavour == "ort" and kv_mode != "scatter":
        raise ValueError("the ort graph flavour follows the scatter KV contract")
    dtype = TORCH_DTYPES.get(precision, torch.float32)
    model = model.eval().to(dtype)
    model.kv_mode = "gqa" if flavour == "ort" else kv_mode
    model.tree = bool(tree)
    model.fuse_projections()
    if opset < OPSET:
        unfuse_norms(model)
    if flavour == "ort":
        model.prepare_rope_tables(max_seq, dtype)
    cache = model.empty_cache(max_seq, batch, dtype)
    ids = torch.zeros((batch, 3), dtype=torch.int64)
    pos = torch.zeros((batch,), dtype=torch.int64)
    n = model.num_layers
    in_names = ["input_ids", "position"] + [f"past_{kv}.{i}" for i in range(n) for kv in ("key", "value")]
    prefix = "present" if kv_mode == "scatter" else "new"
    out_names = ["logits"] + [f"{prefix}_{kv}.{i}" for i in range(n) for kv in ("key", "value")]
    rest = tuple(cache)
    dyn_t = torch.export.Dim.DYNAMIC
    rest_dyn = tuple(None for _ in cache)
    if tree:
        # one symbol for the three T's, so the graph has a single dynamic dimension
        dyn_t = torch.export.Dim.AUTO
        rest = (torch.tril(torch.ones(batch, 3, 3, dtype=torch.bool)), *cache)
        rest_dyn = ({1: dyn_t, 2: dyn_t}, *rest_dyn)
        in_names.insert(2, TREE_INPUT)
    dyn = {"input_ids": {1: dyn_t}, "position": None, "past": rest_dyn}
    if getattr(model, "feature_layers", None):
        out_names.append(FEATURES_OUTPUT)
    with _quiet(), torch.no_grad():
        ep = torch.export.export(model, (ids, pos, *rest), dynamic_shapes=dyn)
        prog = torch.onnx.export(
            ep,
            (ids, pos, *rest),
            None,
            input_names=in_names,
            output_names=out_names,
            dynamo=True,
            opset_version=opset,
            custom_translation_table={
                torch.ops.specedge.cache_write.default: _tensor_scatter,
                torch.ops.specedge.gqa.default: gqa_onnx,
            },
            optimize=False,
            verbose=False,
        )
        proto = _optimize(prog.model)
    if opset < OPSET:
        proto.ir_version = onnx.helper.find_min_ir_version_for(list(proto.opset_import))
    _name_dynamic_dim(proto, "T")
    _drop_unused_initializers(proto)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_with_external_data(proto, out_path)


def _optimize(model) -> onnx.ModelProto:
    """Common-subexpression elimination first (the per-layer rope/mask subgraphs are traced 30
    times), then one round of onnxscript's optimizer: the same graph as `optimize=True` in about a
    quarter of the time, which is most of the export's wall time on a small CPU."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    import onnxscript.optimizer

    common.RemoveUnusedNodesPass()(model)
    common.CommonSubexpressionEliminationPass()(model)
    onnxscript.optimizer.optimize_ir(model, num_iterations=1)
    common.RemoveUnusedNodesPass()(model)
    return ir.serde.serialize_model(model)


def save_with_external_data(proto: onnx.ModelProto, out_path: Path, data_name: str | None = None) -> None:
    data_name = data_name or out_path.name + ".data"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if (out_path.parent / data_name).exists():
        os.remove(out_path.parent / data_name)
    onnx.save_model(
        proto,
        str(out_path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=1024,
    )
    # onnx (1.23 here) creates the external data file with mode 0600: a bundle installed by one user
    # and run by another (a service account, a Jetson image) could not read its weights. Give it
    # the mode any new file gets.
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(out_path.parent / data_name, 0o666 & ~mask)


def _name_dynamic_dim(proto: onnx.ModelProto, name: str) -> None:
    """The exporter names T after an internal symbol (s70…); the contract calls it T."""
    symbols = set()
    for vi in list(proto.graph.input) + list(proto.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                symbols.add(d.dim_param)
    if len(symbols) > 1:
        raise RuntimeError(f"exported graph has more than one dynamic dimension: {sorted(symbols)}")
    for vi in list(proto.graph.input) + list(proto.graph.output) + list(proto.graph.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in symbols:
                d.dim_param = name


def drop_features_output(proto: onnx.ModelProto) -> bool:
    """Remove the features output and the nodes only it used (a self-draft made from a target
    graph with features must not pay for them). True when there was one."""
    outs = [o for o in proto.graph.output if o.name != FEATURES_OUTPUT]
    if len(outs) == len(proto.graph.output):
        return False
    del proto.graph.output[:]
    proto.graph.output.extend(outs)
    while True:
        used = {i for n in proto.graph.node for i in n.input} | {o.name for o in proto.graph.output}
        keep = [n for n in proto.graph.node if any(o in used for o in n.output)]
        if len(keep) == len(proto.graph.node):
            break
        del proto.graph.node[:]
        proto.graph.node.extend(keep)
    _drop_unused_initializers(proto)
    return True


def _drop_unused_initializers(proto: onnx.ModelProto) -> None:
    used = {i for n in proto.graph.node for i in n.input}
    used |= {o.name for o in proto.graph.output}
    keep = [t for t in proto.graph.initializer if t.name in used]
    if len(keep) != len(proto.graph.initializer):
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(keep)


def check_graph(path: Path, spec, kv_mode: str, max_seq: int, batch: int = 1, tree: bool = False) -> None:
    """The exported graph must match the contract exactly: names, dtypes, static dims but T,
    no control flow, and onnx.checker's full check."""
    # full_check runs ONNX shape inference, which has no schema for com.microsoft ops: the ort
    # flavour gets the structural check (ONNX Runtime itself validates those nodes at load).
    proto_head = onnx.load(str(path), load_external_data=False)
    has_contrib = any(n.domain == "com.microsoft" for n in proto_head.graph.node)
    onnx.checker.check_model(str(path), full_check=not has_contrib)
    proto = onnx.load(str(path), load_external_data=False)
    bad = sorted({n.op_type for n in proto.graph.node} & FORBIDDEN_OPS)
    if bad:
        raise RuntimeError(f"exported graph contains control flow ops {bad}")
    want_in, want_out = graph_io(spec, kv_mode, max_seq, batch, tree)
    elem = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 9: "bool"}
    for want, got in ((want_in, proto.graph.input), (want_out, proto.graph.output)):
        got_l = [
            (
                g.name,
                elem.get(g.type.tensor_type.elem_type, "?"),
                [d.dim_param if d.HasField("dim_param") else d.dim_value for d in g.type.tensor_type.shape.dim],
            )
            for g in got
        ]
        want_l = [(w.name, w.dtype, list(w.shape)) for w in want]
        if got_l != want_l:
            diff = next(
                (f"{a} != {b}" for a, b in zip(got_l, want_l) if a != b), f"{len(got_l)} vs {len(want_l)} tensors"
            )
            raise RuntimeError(f"exported graph does not match the contract: {diff}")
