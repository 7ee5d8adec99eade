"""A trained draft head (models/eagle_head.py) → ONNX graph, and into an existing bundle atomically.

The head follows the graph contract's rules (contract.head_graph_io): static shapes except T, the
cache written in place by TensorScatter (scatter bundles) or returned as new entries (delta), no
control flow. One flavour (standard ONNX ops) serves every backend.

Writing into a bundle never touches its existing files: the head goes to a folder of its own
with a fresh name, and the one commit point is the atomic replacement of manifest.json. An
interrupted or failed write leaves the manifest as it was (and removes its folder); a head that
is replaced is deleted only after the new manifest is in place.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import onnx
import torch

from ..contract import head_graph_io
from ..manifest import (
    MANIFEST_NAME,
    GraphSpec,
    Manifest,
    ModelSpec,
    load_manifest,
    sha256_file,
    target_fingerprint,
    write_json_atomic,
)
from .onnx_graph import (
    FORBIDDEN_OPS,
    OPSET,
    _drop_unused_initializers,
    _name_dynamic_dim,
    _optimize,
    _quiet,
    _tensor_scatter,
    save_with_external_data,
)

__all__ = ["export_head_graph", "head_spec", "write_head"]

HEAD_BACKENDS = ["ort-cpu", "ort-cuda"]


def export_head_graph(head: torch.nn.Module, out_path: Path, max_seq: int, kv_mode: str) -> None:
    """Trace `head` (an EagleHead, fp32) to `out_path` (+ `.data`) with the head contract."""
    head = head.eval().float()
    head.kv_mode = kv_mode
    hc = head.hc
    cache = head.empty_cache(max_seq)
    t = 3
    args = (
        torch.zeros((1, t), dtype=torch.int64),
        torch.zeros((1,), dtype=torch.int64),
        torch.zeros((1, t, hc.feature_dim)),
        torch.zeros((1, t, hc.hidden_size)),
        *cache,
    )
    prefix = "present" if kv_mode == "scatter" else "new"
    in_names = ["input_ids", "position", "features", "hidden", "past_key.0", "past_value.0"]
    out_names = ["logits", "hidden_out", f"{prefix}_key.0", f"{prefix}_value.0"]
    dim = torch.export.Dim.DYNAMIC
    dyn = {
        "input_ids": {1: dim},
        "position": None,
        "features": {1: dim},
        "hidden": {1: dim},
        "past_key": None,
        "past_value": None,
    }
    from ..models.attention import cache_write

    with _quiet(), torch.no_grad():
        ep = torch.export.export(head, args, dynamic_shapes=dyn)
        prog = torch.onnx.export(
            ep,
            args,
            None,
            input_names=in_names,
            output_names=out_names,
            dynamo=True,
            opset_version=OPSET,
            optimize=False,
            verbose=False,
            custom_translation_table={cache_write._opoverload: _tensor_scatter},
        )
        proto = _optimize(prog.model)
    _name_dynamic_dim(proto, "T")
    _drop_unused_initializers(proto)
    save_with_external_data(proto, out_path)


def head_spec(head, rel: str, kv_mode: str, max_seq: int, extra: dict) -> ModelSpec:
    """The manifest entry of a head graph saved at bundle-relative `rel`."""
    hc = head.hc
    # per step the head reads every weight but the embedding table (one row per token is gathered)
    params = sum(p.numel() for n, p in head.named_parameters() if n != "embed_tokens.weight")
    spec = ModelSpec(
        role="head",
        kind="head",
        family="eagle_head",
        source="specedge train-draft",
        precision="fp32",
        kv_dtype="float32",
        num_layers=1,
        num_kv_heads=hc.num_kv_heads,
        head_dim=hc.head_dim,
        hidden_size=hc.hidden_size,
        vocab_size=hc.draft_vocab,
        num_params=sum(p.numel() for p in head.parameters()),
        weight_bytes=4 * params,
        graphs=[GraphSpec("portable", rel, list(HEAD_BACKENDS), [rel + ".data"])],
        extra={"feature_dim": hc.feature_dim, "config": hc.to_json(), **extra},
    )
    spec.inputs, spec.outputs = head_graph_io(spec, kv_mode, max_seq)
    return spec


def check_head_graph(path: Path, spec: ModelSpec, kv_mode: str, max_seq: int) -> None:
    """The saved head graph has exactly the contract's tensors, static dims but T, no control flow."""
    onnx.checker.check_model(str(path), full_check=True)
    proto = onnx.load(str(path), load_external_data=False)
    bad = sorted({n.op_type for n in proto.graph.node} & FORBIDDEN_OPS)
    if bad:
        raise RuntimeError(f"the head graph contains control flow ops {bad}")
    elem = {1: "float32", 7: "int64"}
    want_in, want_out = head_graph_io(spec, kv_mode, max_seq)
    for want, got in ((want_in, proto.graph.input), (want_out, proto.graph.output)):
        got_l = [
            (
                g.name,
                elem.get(g.type.tensor_type.elem_type, "?"),
                [d.dim_param if d.HasField("dim_param") else d.dim_value for d in g.type.tensor_type.shape.dim],
            )
            for g in got
        ]
        if got_l != [(w.name, w.dtype, list(w.shape)) for w in want]:
            raise RuntimeError(f"the head graph does not match the contract: {got_l} vs {[w.to_json() for w in want]}")


def write_head(bundle: Path, head, training: dict) -> Manifest:
    """Export `head` into `bundle` and commit it by replacing manifest.json atomically."""
    bundle = Path(bundle)
    m = load_manifest(bundle, verify="size")
    folder = f"head-{uuid.uuid4().hex[:8]}"
    tmp = bundle / f".{folder}.partial"
    try:
        tmp.mkdir()
        export_head_graph(head, tmp / "model.onnx", m.max_seq, m.kv_mode)
        d2t = [int(x) for x in head.d2t.tolist()]
        (tmp / "draft_vocab.json").write_text(json.dumps({"d2t": d2t}) + "\n", encoding="utf-8")
        rel = f"{folder}/model.onnx"
        spec = head_spec(
            head,
            rel,
            m.kv_mode,
            m.max_seq,
            {
                "draft_vocab_file": f"{folder}/draft_vocab.json",
                "target_fingerprint": target_fingerprint(m),
                "training": training,
            },
        )
        check_head_graph(tmp / "model.onnx", spec, m.kv_mode, m.max_seq)
        os.replace(tmp, bundle / folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = m.head
    try:
        files = dict(m.files)
        if old is not None:
            for rel in _head_rels(old):
                files.pop(rel, None)
        for name in ("model.onnx", "model.onnx.data", "draft_vocab.json"):
            p = bundle / folder / name
            files[f"{folder}/{name}"] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        m.files, m.head, m.schema_version = files, spec, max(m.schema_version, 2)
        write_json_atomic(bundle / MANIFEST_NAME, m.to_json())
    except BaseException:
        shutil.rmtree(bundle / folder, ignore_errors=True)
        raise
    if old is not None:
        for top in {r.split("/")[0] for r in _head_rels(old)}:
            if top.startswith("head-"):
                shutil.rmtree(bundle / top, ignore_errors=True)
    return load_manifest(bundle, verify="size")


def _head_rels(spec: ModelSpec) -> list[str]:
    rels = [spec.extra.get("draft_vocab_file", "")]
    for g in spec.graphs:
        rels += [g.path, *g.external_data]
    return [r for r in rels if r]
