"""`export-models --tensorrt VERSION`: graphs that version's table takes, computing what the
default graphs compute.

The matrix (family x precision x mode) exports one graph pair per case straight from the tiny
checkpoints (the default delta graph and the --tensorrt 10.3 one), checks the latter against the
10.3 table and runs both with ONNX Runtime on the CPU. One case per precision and mode runs by
default; the other families are marked slow (`-m slow`).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from test_engines import _trt_table_ops
from test_export_cli import assert_bad_input, run

from specedge.manifest import load_manifest
from specedge.tensorrt_support import check_bundle, graph_findings

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
PRECISIONS = ("fp32", "fp16", "bf16")
MODES = ("chain", "tree", "features")
FAST = {("llama", p, m) for p in PRECISIONS for m in MODES} | {("gemma3", "fp32", "chain")}
# fp32 graphs differ only in how the norm is written (one RMSNormalization node vs elementwise
# ops), so they agree to float rounding; the fp16 graphs are the same ops at another opset
# (tolerance: about one fp16 ulp of the logits); bf16 graphs are compared node by node
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3}
MAX_SEQ = 32
T, POSITION = 3, 5


def _cases():
    for fam in FAMILIES:
        for prec in PRECISIONS:
            for mode in MODES:
                marks = () if (fam, prec, mode) in FAST else (pytest.mark.slow,)
                yield pytest.param(fam, prec, mode, marks=marks, id=f"{fam}-{prec}-{mode}")


@pytest.fixture(scope="module")
def graph_pair(tiny_checkpoint_factory, tmp_path_factory):
    """(family, precision, mode) -> (default delta graph, --tensorrt 10.3 graph), exported once."""
    from specedge.export import sources
    from specedge.export.onnx_graph import OPSET, export_graph
    from specedge.export.tensorrt_target import TRT_OPSET
    from specedge.models import build_model, load_weights
    from specedge.models.common import default_feature_layers

    root = tmp_path_factory.mktemp("trt-graphs")
    loaded: dict = {}

    def make(family, precision, mode):
        if family not in loaded:
            loaded[family] = sources.load(str(tiny_checkpoint_factory(family)))
        ck = loaded[family]
        paths = []
        for opset in (OPSET, TRT_OPSET):
            model = build_model(ck.config, "delta")
            load_weights(model, ck.state_dict)
            if mode == "features":
                model.feature_layers = default_feature_layers(ck.config.num_hidden_layers)
            path = root / f"{family}-{precision}-{mode}-{opset}" / "model.onnx"
            export_graph(model, path, MAX_SEQ, "delta", precision, tree=mode == "tree", opset=opset)
            paths.append(path)
        return paths

    return make


def _feeds(sess, precision):
    rng = np.random.default_rng(0)
    dtype = {"fp32": np.float32, "fp16": np.float16}[precision]
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(3, 200, size=(1, T)).astype(np.int64)
        elif i.name == "position":
            feeds[i.name] = np.array([POSITION], np.int64)
        elif i.name == "tree_mask":
            # a root with two children: rows are ancestor sets, not a chain
            feeds[i.name] = np.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], bool)
        else:
            shape = [d if isinstance(d, int) else T for d in i.shape]
            x = (rng.standard_normal(shape) * 0.5).astype(dtype)
            x[..., POSITION:, :] = 0
            feeds[i.name] = x
    return feeds


def _run(path, feeds, precision):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = feeds if feeds is not None else _feeds(sess, precision)
    return feeds, sess.run(None, feeds)


def _nodes(path):
    """The computation of a graph: each node's operator and attributes in order, and the
    initializers' contents (value names are the exporter's counters, which differ between exports)."""
    m = onnx.load(str(path))
    nodes = [(n.domain, n.op_type, sorted(a.SerializeToString() for a in n.attribute)) for n in m.graph.node]
    inits = sorted((t.data_type, tuple(t.dims), t.raw_data) for t in m.graph.initializer)
    return nodes, inits


@pytest.mark.parametrize("family,precision,mode", list(_cases()))
def test_tensorrt_103_graph_passes_the_table_and_computes_the_default(graph_pair, family, precision, mode):
    default, trt = graph_pair(family, precision, mode)
    head = onnx.load(str(trt), load_external_data=False)
    assert [(o.domain, o.version) for o in head.opset_import] == [("", 18)] and head.ir_version == 8
    assert graph_findings(str(trt), "10.3") == []
    assert not {n.op_type for n in head.graph.node} & {"RMSNormalization", "TensorScatter", "MatMulNBits"}
    # what the engine tests' TensorRT stand-in parses on 10.3 (its own reading of the table)
    assert {(n.domain, n.op_type) for n in head.graph.node} <= {("", op) for op in _trt_table_ops("10.3")}
    # the default graph is what it was: opset 24, one RMSNormalization per norm in fp32
    dhead = onnx.load(str(default), load_external_data=False)
    assert dhead.opset_import[0].version == 24
    assert ("RMSNormalization" in {n.op_type for n in dhead.graph.node}) == (precision == "fp32")
    if precision == "fp32":
        assert graph_findings(str(default), "10.3"), "the default fp32 graph is not one TensorRT 10.3 parses"
    if precision == "bf16":
        # ONNX Runtime's CPU provider has no bf16 kernels (Mul): the two graphs must be the same
        # nodes and weights, except that an opset-24 Gelu (tanh form, gemma3) is written out at
        # opset 18 as the ops of its definition (4 Mul, 2 Add, Pow, Tanh)
        from collections import Counter

        (tn, ti), (dn, di) = _nodes(trt), _nodes(default)
        g = sum(n[1] == "Gelu" for n in dn)
        if not g:
            assert tn == dn and ti == di
        # the same weights; the written-out Gelu adds its scalar constants
        assert not Counter(di) - Counter(ti) and all(not t[1] for t in Counter(ti) - Counter(di))

        ct, cd = Counter(n[1] for n in tn), Counter(n[1] for n in dn)
        assert ct - cd == Counter({"Mul": 4 * g, "Add": 2 * g, "Pow": g, "Tanh": g}) - Counter()
        assert cd - ct == Counter({"Gelu": g}) - Counter()
        return
    feeds, want = _run(default, None, precision)
    _, got = _run(trt, feeds, precision)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), atol=TOLERANCE[precision], rtol=TOLERANCE[precision]
        )


# ----------------------------------------------------------------------------- bundles


def _ops(path):
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


@pytest.mark.parametrize(
    "version,kv,int4,draft",
    [
        ("10.3", "delta", False, "ngram"),
        ("10.13", "delta", False, "ngram"),
        ("10.14", "delta", False, "ngram"),
        ("10.15", "scatter", True, "self"),
        ("10.16", "scatter", True, "self"),
        ("11.0", "scatter", True, "self"),
    ],
)
def test_what_each_tensorrt_gets(version, kv, int4, draft):
    from specedge.cli.export_models import default_draft
    from specedge.export.tensorrt_target import resolve

    t = resolve(version)
    assert (t.version, t.kv_mode, t.int4, t.int8) == (version, kv, int4, True)
    assert default_draft("fp16", version) == draft
    assert default_draft("int4", version) == "ngram" and default_draft("fp16") == "self"


def test_fp16_bundle_for_tensorrt_103_has_an_int8_dequantizelinear_self_draft(tiny_bundle_factory):
    from specedge.runtime.backends import create_backend

    b = tiny_bundle_factory("llama", precision="fp16", kv_mode=None, draft_precision=None, tensorrt="10.3")
    m = load_manifest(b)
    assert m.tensorrt == "10.3" and json.loads((b / "manifest.json").read_text())["tensorrt"] == "10.3"
    assert m.kv_mode == "delta"
    # 10.3 documents opsets up to 20: the int4 blocked form (opset 21) is out, so a self-draft
    # asked for without a precision is per-channel int8
    assert m.draft.kind == "model" and m.draft.precision == "int8"
    assert "DequantizeLinear" in m.draft.extra["weights"]
    check = check_bundle(b, "10.3")
    assert check.ok, check
    for spec in (m.target, m.draft):
        g = spec.graph_for("tensorrt")
        assert g is not None and "tensorrt" in g.backends
        assert "MatMulNBits" not in _ops(b / g.path)
    assert "DequantizeLinear" in _ops(b / m.draft.graph_for("tensorrt").path)
    # the int8 draft runs (ONNX Runtime) and stays close to the fp16 target
    ids = np.arange(3, 19, dtype=np.int64)
    target = create_backend("ort-cpu", m, m.target, threads=1).run(ids, 0)
    draft = create_backend("ort-cpu", m, m.draft, threads=1).run(ids, 0)
    assert np.abs(draft - target).max() < 0.1 * np.abs(target).max()


def test_bundle_for_tensorrt_1016_keeps_scatter_and_takes_a_blocked_int4_draft(tiny_bundle_factory):
    b = tiny_bundle_factory("llama", kv_mode=None, draft_precision=None, tensorrt="10.16")
    m = load_manifest(b)
    assert m.tensorrt == "10.16" and m.kv_mode == "scatter" and m.draft.precision == "int4"
    g = m.draft.graph_for("tensorrt")
    head = onnx.load(str(b / g.path), load_external_data=False)
    dq = [n for n in head.graph.node if n.op_type == "DequantizeLinear"]
    assert dq and all(any(a.name == "block_size" for a in n.attribute) for n in dq)
    assert check_bundle(b, "10.16").ok
    assert not check_bundle(b, "10.3").ok  # TensorScatter, opset 24
    # the blocked int4 draft TensorRT gets runs (ONNX Runtime) and is as close to the fp32 target as
    # the MatMulNBits int4 draft ONNX Runtime gets (both round to nearest, blocks of 32)
    import onnxruntime as ort

    def logits(graph):
        sess = ort.InferenceSession(str(b / graph.path), providers=["CPUExecutionProvider"])
        feeds = {
            i.name: np.zeros([d if isinstance(d, int) else 3 for d in i.shape], np.float32) for i in sess.get_inputs()
        }
        feeds.update(input_ids=np.array([[5, 17, 42]], np.int64), position=np.array([0], np.int64))
        return sess.run(["logits"], feeds)[0]

    want = logits(m.target.graph_for("tensorrt"))
    dq = np.abs(logits(m.draft.graph_for("tensorrt")) - want).mean()
    nbits = np.abs(logits(m.draft.graph_for("ort-cpu")) - want).mean()
    assert m.draft.graph_for("ort-cpu").flavour == "ort" and dq < 1.5 * nbits, (dq, nbits)


def test_default_export_is_unchanged(tiny_bundle_factory):
    """Without --tensorrt: opset 24, RMSNormalization in fp32, MatMulNBits drafts, no manifest key."""
    b = tiny_bundle_factory("llama")
    m = load_manifest(b)
    assert m.tensorrt is None and "tensorrt" not in json.loads((b / "manifest.json").read_text())
    head = onnx.load(str(b / m.target.graphs[0].path), load_external_data=False)
    assert head.opset_import[0].version == 24 and head.ir_version == 10
    assert "RMSNormalization" in _ops(b / m.target.graphs[0].path)
    assert "MatMulNBits" in _ops(b / m.draft.graphs[0].path)


@pytest.mark.parametrize(
    "extra,fragments",
    [
        (["--tensorrt", "ten"], ["--tensorrt", "10.3"]),
        (["--tensorrt", "8.6"], ["8.6", "10.3", "--tensorrt"]),
        (["--tensorrt", "10.3", "--kv-update", "scatter"], ["--tensorrt 10.3", "--kv-update delta", "TensorScatter"]),
        (["--tensorrt", "10.3", "--int4-kernel", "specedge"], ["--int4-kernel specedge", "--tensorrt 10.3"]),
        (["--tensorrt", "10.3", "--graphs", "ort"], ["--tensorrt 10.3", "--graphs ort"]),
        (
            ["--tensorrt", "10.3", "--draft", "self", "--draft-precision", "int4"],
            ["--draft-precision int4", "TensorRT 10.3", "int8"],
        ),
        (["--tensorrt", "10.3", "--precision", "int4"], ["--precision int4", "TensorRT 10.3"]),
    ],
    ids=["malformed", "too-old", "scatter", "int4-kernel", "graphs-ort", "draft-int4", "target-int4"],
)
def test_tensorrt_option_refusals(tiny_checkpoint_factory, tmp_path, extra, fragments):
    out = tmp_path / "b"
    res = run(
        ["--target", str(tiny_checkpoint_factory("llama")), "--out", str(out), "--max-seq", "32", "--quiet", *extra],
        tmp_path,
    )
    assert_bad_input(res, *fragments, out=out)


# ----------------------------------------------------------------------------- the onnxruntime a bundle needs


def test_onnxruntime_floor_follows_the_bundles_opset(tiny_bundle_factory, monkeypatch):
    import onnxruntime

    from specedge.runtime.api import load
    from specedge.runtime.backends.base import BackendError
    from specedge.runtime.ort_version import ORT_MIN_VERSION, bundle_opset, required_version

    assert (required_version(18), required_version(21), required_version(24)) == ("1.17.3", "1.20.1", ORT_MIN_VERSION)
    b = tiny_bundle_factory("llama", precision="fp16", kv_mode=None, draft_precision=None, tensorrt="10.3")
    m = load_manifest(b)
    assert bundle_opset(m) == 18 and {g.opset for s in (m.target, m.draft) for g in s.graphs} == {18}
    default = load_manifest(tiny_bundle_factory("llama"))
    assert bundle_opset(default) == 24
    assert all(
        "opset" not in g for g in json.loads((default.root / "manifest.json").read_text())["models"]["target"]["graphs"]
    )
    # JetPack 6's onnxruntime-gpu (Jetson AI Lab index, cu126) is 1.23.0: it runs this bundle, not the default one
    monkeypatch.setattr(onnxruntime, "__version__", "1.23.0")
    with load(b, backend="ort-cpu", threads=1) as p:
        assert p.generate("hello", max_new_tokens=4).text is not None
    with pytest.raises(BackendError, match=r"onnxruntime 1\.23\.0 is too old: .*opset 24.* >= 1\.24\.1.*--tensorrt"):
        load(default.root, backend="ort-cpu", threads=1)
    monkeypatch.setattr(onnxruntime, "__version__", "1.16.3")
    with pytest.raises(BackendError, match=r"onnxruntime 1\.16\.3 is too old: .*opset 18.* >= 1\.17\.3"):
        load(b, backend="ort-cpu", threads=1)
