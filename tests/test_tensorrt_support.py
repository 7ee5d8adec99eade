"""The TensorRT support table (tensorrt_ops.json), the checks built on it
(tensorrt_support.py) and `specedge inspect --tensorrt`."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specedge import tensorrt_support as ts
from specedge.cli.main import main
from specedge.errors import UserError

SUPPORTED = "10.3, 10.13, 10.14, 10.15, 10.16, 11.0, 11.1"


# ----------------------------------------------------------------------------- the table


def test_table_lines_cite_their_sources():
    assert ts.TENSORRT_VERSIONS == ("10.3", "10.13", "10.14", "10.15", "10.16", "11.0", "11.1")
    for line in ts.TENSORRT_VERSIONS:
        info = ts.line_info(line)
        assert re.fullmatch(r"[0-9a-f]{40}", info["onnx_tensorrt_commit"]), line
        assert re.fullmatch(r"[0-9a-f]{40}", info["tensorrt_commit"]), line
        assert info["tensorrt_tag"].startswith("v") and info["retrieved"], line
        lo, hi = info["opset"]
        assert lo == 9 and 20 <= hi <= 25 and info["ir_max"] >= 10, line
    # a newer line imports everything an older one does
    for older, newer in zip(ts.TENSORRT_VERSIONS, ts.TENSORRT_VERSIONS[1:]):
        assert ts.ops_for(older) <= ts.ops_for(newer)
        assert ts.line_info(older)["opset"][1] <= ts.line_info(newer)["opset"][1]


def test_table_key_facts():
    assert ts.op_added_in("RMSNormalization") == "10.15"
    assert ts.op_added_in("TensorScatter") == "10.15"
    assert ts.op_added_in("RotaryEmbedding") == "10.15"
    assert ts.op_added_in("Attention") == "10.14"
    assert ts.op_added_in("Swish") == "11.0"
    assert ts.op_added_in("MatMulNBits") is None and ts.op_added_in("GroupQueryAttention") is None
    for op in ("MatMul", "DequantizeLinear", "Gather", "Softmax", "LayerNormalization", "ScatterND", "Concat"):
        assert ts.op_added_in(op) == "10.3", op
    assert {"int8", "int4"} <= ts.dq_types("10.3") and "float4e2m1" not in ts.dq_types("10.3")
    assert ts.dq_type_added_in("float4e2m1") == "10.13" and ts.dq_type_added_in("uint4") is None
    assert ts.line_info("10.3")["opset"] == [9, 20] and ts.line_info("10.15")["opset"] == [9, 24]
    assert ts.opset_added_in(24) == "10.15" and ts.opset_added_in(26) is None


# ----------------------------------------------------------------------------- versions


@pytest.mark.parametrize(
    "text, line",
    [
        ("10.3", "10.3"),
        ("10.3.0", "10.3"),
        ("10.3.0.30", "10.3"),
        (" 10.16 ", "10.16"),
        ("10.13.3.9", "10.13"),
        ("10.8", "10.3"),
        ("10.14.1", "10.14"),
        ("11.1.0.4", "11.1"),
        ("12.0", "11.1"),
    ],
)
def test_parse_tensorrt_version(text, line):
    assert ts.parse_tensorrt_version(text) == line


def test_version_note_says_when_another_line_is_used():
    assert ts.version_note("10.3.0.30") is None
    assert ts.version_note("10.8") == (
        "TensorRT 10.8 is checked against TensorRT 10.3's parser, the newest line in specedge's table at or below it"
    )
    assert ts.version_note("12.0") == (
        "TensorRT 12.0 is checked against TensorRT 11.1's parser, the newest line in specedge's table"
    )


@pytest.mark.parametrize("text", ["", "abc", "10", "10.x", "v10.3", "10.3.0.30.1", "10.3-rc1", "10..3"])
def test_parse_tensorrt_version_refuses_malformed(text):
    with pytest.raises(UserError) as e:
        ts.parse_tensorrt_version(text)
    assert str(e.value) == (
        f"--tensorrt takes a TensorRT version such as 10.3 or 10.3.0.30, got {text!r}: "
        f"the supported versions are {SUPPORTED}"
    )


@pytest.mark.parametrize("text", ["10.2", "10.0.1", "9.3", "8.6.1"])
def test_parse_tensorrt_version_refuses_older_than_the_table(text):
    with pytest.raises(UserError) as e:
        ts.parse_tensorrt_version(text)
    assert str(e.value) == (
        f"TensorRT {text} is older than 10.3, the oldest TensorRT specedge supports: "
        f"use --tensorrt with one of {SUPPORTED}"
    )


def test_installed_line_takes_package_suffixes():
    assert ts.installed_line("10.15.1.post1") == "10.15"
    with pytest.raises(UserError, match=r"^TensorRT 8.6.1 is older than 10.3, .*: install one of"):
        ts.installed_line("8.6.1")


# ----------------------------------------------------------------------------- graphs


def _model(nodes, inputs, outputs, opset=20, inits=(), functions=(), extra_opsets=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    ops = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in extra_opsets)]
    return helper.make_model(g, opset_imports=ops, ir_version=10, functions=list(functions))


def _f(name, shape=(1, 4)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def test_graph_findings_names_each_node_with_its_version_and_flag():
    nodes = [
        helper.make_node("RMSNormalization", ["x", "s"], ["y"], name="norm", axis=-1),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
    ]
    scale = helper.make_tensor("s", TensorProto.FLOAT, [4], [1.0] * 4)
    m = _model(nodes, [_f("x")], [_f("z")], opset=23, inits=[scale])
    assert ts.graph_findings(m, "10.3.0.30", "target/model.onnx") == [
        ts.Finding("target/model.onnx", "", "opset", "ai.onnx", 23, "10.15", "--tensorrt 10.3"),
        ts.Finding("target/model.onnx", "norm", "RMSNormalization", "ai.onnx", 23, "10.15", "--tensorrt 10.3"),
    ]
    assert [f.op for f in ts.graph_findings(m, "10.14")] == ["opset", "RMSNormalization"]
    assert ts.graph_findings(m, "10.15") == [] and ts.graph_findings(m, "11.1") == []


def test_graph_findings_tensorscatter_avoided_by_delta_and_contrib_ops_by_no_version():
    nodes = [
        helper.make_node("TensorScatter", ["c", "n", "p"], ["o"], name="kv", axis=-2),
        helper.make_node("MatMulNBits", ["o", "w"], ["y"], name="q4", domain="com.microsoft"),
    ]
    m = _model(
        nodes,
        [_f("c", (1, 1, 8, 4)), _f("n", (1, 1, 1, 4)), helper.make_tensor_value_info("p", TensorProto.INT64, [1])],
        [_f("y")],
        opset=20,
        extra_opsets=["com.microsoft"],
    )
    got = ts.graph_findings(m, "10.16")
    assert [(f.node, f.op, f.domain, f.added_in, f.avoid_with) for f in got] == [
        ("q4", "MatMulNBits", "com.microsoft", None, "--tensorrt 10.16")
    ]
    got = ts.graph_findings(m, "10.3")
    assert [(f.op, f.added_in, f.avoid_with) for f in got] == [
        ("TensorScatter", "10.15", "--kv-update delta"),
        ("MatMulNBits", None, "--tensorrt 10.3"),
    ]


def _dq_model(dtype, opset, wshape=(4, 2), sshape=(4, 1), axis=1):
    w = helper.make_tensor("w", dtype, list(wshape), [1] * int(np.prod(wshape)))
    scale = helper.make_tensor("s", TensorProto.FLOAT, list(sshape), [0.5] * int(np.prod(sshape)))
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], name="dq", axis=axis),
        helper.make_node("MatMul", ["x", "wf"], ["y"], name="mm"),
    ]
    return _model(nodes, [_f("x", (1, wshape[-2]))], [_f("y", (1, wshape[-1]))], opset=opset, inits=[w, scale])


def test_graph_findings_dequantize_types_and_forms():
    # per-channel int8 (1-D scale) is valid ONNX at opset 13+ and builds everywhere
    assert ts.graph_findings(_dq_model(TensorProto.INT8, 20, sshape=(2,)), "10.3") == []
    # blocked int8: the parser imports it, no TensorRT's IDequantizeLayer builds it
    got = ts.graph_findings(_dq_model(TensorProto.INT8, 21), "11.1")
    assert [(f.node, f.op, f.added_in) for f in got] == [("dq", "DequantizeLinear(blocked int8, rank 2)", None)]
    # blocked int4 weights need opset 21 in ONNX, past 10.3's documented 20; 10.3 builds them (2-D only)
    assert [f.op for f in ts.graph_findings(_dq_model(TensorProto.INT4, 21), "10.3")] == ["opset"]
    assert ts.graph_findings(_dq_model(TensorProto.INT4, 21), "10.15") == []
    got = ts.graph_findings(_dq_model(TensorProto.INT4, 20, (2, 4, 2), (2, 4, 1), 2), "10.3")
    assert [(f.op, f.added_in) for f in got] == [("DequantizeLinear(blocked int4, rank 3)", "10.13")]
    assert ts.graph_findings(_dq_model(TensorProto.INT4, 21, (2, 4, 2), (2, 4, 1), 2), "10.15") == []
    # input types the parser does not take
    got = ts.graph_findings(_dq_model(TensorProto.FLOAT4E2M1, 23), "10.3")
    assert [(f.op, f.added_in) for f in got] == [("opset", "10.15"), ("DequantizeLinear(float4e2m1)", "10.13")]
    got = ts.graph_findings(_dq_model(TensorProto.UINT4, 21), "10.16")
    assert [(f.op, f.added_in) for f in got] == [("DequantizeLinear(uint4)", None)]
    check = ts.BundleCheck(
        Path("b"),
        "11.1",
        "11.1",
        None,
        [ts.GraphCheck("draft", "draft/model.onnx", ts.graph_findings(_dq_model(TensorProto.INT8, 21), "11.1"))],
    )
    assert "DequantizeLinear(blocked int8, rank 2) (opset 21; built by no TensorRT in the table)" in ts.format_findings(
        check
    )


def test_graph_findings_looks_into_subgraphs_and_local_functions():
    inner = helper.make_graph(
        [helper.make_node("TensorScatter", ["c", "n", "p"], ["o"], name="inner_kv", axis=-2)],
        "then",
        [],
        [_f("o", (1, 1, 8, 4))],
    )
    other = helper.make_graph([helper.make_node("Identity", ["c"], ["o2"], name="id")], "else", [], [_f("o2")])
    fn = helper.make_function(
        "local",
        "MyNorm",
        ["x", "s"],
        ["y"],
        [helper.make_node("RMSNormalization", ["x", "s"], ["y"], name="fn_norm")],
        [helper.make_opsetid("", 23)],
    )
    nodes = [
        helper.make_node("If", ["cond"], ["o"], name="if", then_branch=inner, else_branch=other),
        helper.make_node("MyNorm", ["o", "s"], ["y"], name="call", domain="local"),
    ]
    m = _model(
        nodes,
        [
            _f("c", (1, 1, 8, 4)),
            _f("n"),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("p", TensorProto.INT64, [1]),
            _f("s", (4,)),
        ],
        [_f("y")],
        opset=23,
        functions=[fn],
        extra_opsets=["local"],
    )
    got = ts.graph_findings(m, "10.14")
    assert [(f.node, f.op) for f in got] == [
        ("", "opset"),
        ("inner_kv", "TensorScatter"),
        ("fn_norm", "RMSNormalization"),
    ]


def test_graph_findings_reads_no_weights(tmp_path):
    w = numpy_helper.from_array(np.zeros((4, 4), np.float32), "w")  # raw data: written to the external file
    m = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [_f("x")], [_f("y")], inits=[w])
    onnx.save_model(
        m, tmp_path / "model.onnx", save_as_external_data=True, location="model.onnx.data", size_threshold=0
    )
    (tmp_path / "model.onnx.data").unlink()  # a weight file it would have to open
    assert ts.graph_findings(tmp_path / "model.onnx", "10.3") == []
    assert ts.graph_findings(str(tmp_path / "model.onnx"), "10.3", "g.onnx") == []


def test_graph_findings_ir_version():
    m = _model([helper.make_node("Relu", ["x"], ["y"], name="r")], [_f("x")], [_f("y")])
    m.ir_version = 11
    assert [(f.op, f.opset, f.added_in) for f in ts.graph_findings(m, "10.3")] == [("ir_version", 11, "10.13")]
    assert ts.graph_findings(m, "10.13") == []


# ----------------------------------------------------------------------------- bundles and `inspect --tensorrt`


@pytest.fixture(scope="module")
def fp32_scatter(tiny_bundle_factory):
    """Today's fp32 scatter bundle with a portable target graph (RMSNormalization, TensorScatter, opset 24)."""
    return tiny_bundle_factory("llama", kv_mode="scatter", draft="ngram", features=True, graphs="portable")


def _copy_with(src, dst, **manifest_changes):
    b = Path(shutil.copytree(src, dst))
    m = json.loads((b / "manifest.json").read_text())
    for key, change in manifest_changes.items():
        change(m) if callable(change) else m.__setitem__(key, change)
    (b / "manifest.json").write_text(json.dumps(m))
    return b


def test_check_bundle_on_todays_fp32_scatter_bundle(fp32_scatter):
    check = ts.check_bundle(fp32_scatter, "10.3.0.30")
    assert not check.ok and check.line == "10.3" and check.exported_for is None and check.not_offered == []
    [g] = check.graphs
    assert (g.role, g.path) == ("target", "target/model.onnx")
    ops = {f.op: f for f in g.findings}
    assert set(ops) == {"opset", "RMSNormalization", "TensorScatter"}
    assert (ops["TensorScatter"].added_in, ops["TensorScatter"].avoid_with) == ("10.15", "--kv-update delta")
    assert (ops["RMSNormalization"].added_in, ops["RMSNormalization"].avoid_with) == ("10.15", "--tensorrt 10.3")
    assert ops["opset"].opset == 24
    layers = json.loads((fp32_scatter / "manifest.json").read_text())["models"]["target"]["num_layers"]
    assert sum(f.op == "TensorScatter" for f in g.findings) == 2 * layers  # every node, not just one
    assert ts.refusal(check) == (
        "TensorRT 10.3's ONNX parser cannot import this bundle (target/model.onnx uses opset 24 (from 10.15), "
        "RMSNormalization (from 10.15), TensorScatter (from 10.15)): export the bundle with "
        "`export-models --tensorrt 10.3`"
    )
    for version in ("10.13", "10.14"):
        assert not ts.check_bundle(fp32_scatter, version).ok
    for version in ("10.15", "10.16", "11.1"):
        check = ts.check_bundle(fp32_scatter, version)
        assert check.ok and [g.findings for g in check.graphs] == [[]], version


def test_parse_error_hint_names_every_operator_the_installed_tensorrt_lacks(fp32_scatter):
    graph = fp32_scatter / "target" / "model.onnx"
    assert ts.parse_error_hint(graph, "10.3.0.30") == (
        " (TensorRT 10.3 does not import opset 24 (from 10.15), RMSNormalization (from 10.15), TensorScatter "
        "(from 10.15): export with `export-models --tensorrt 10.3`)"
    )
    assert ts.parse_error_hint(graph, "10.16.0.31") == ""


def test_inspect_tensorrt_exit_3_lists_nodes(fp32_scatter, capsys):
    capsys.readouterr()
    assert main(["inspect", str(fp32_scatter), "--tensorrt", "10.3"]) == 3
    out = capsys.readouterr().out
    report = out[out.index("\ntensorrt check") :]
    assert "TensorRT 10.3: opsets 9..20" in report
    assert "target target/model.onnx: " in report and "TensorRT 10.3's parser would refuse it" in report
    assert (
        "    opset 24 (TensorRT 10.3 documents 9..20; documented from TensorRT 10.15); "
        "avoid with export-models --tensorrt 10.3\n"
    ) in report
    assert re.search(
        r"    TensorScatter \(opset 24; imported from TensorRT 10\.15\); avoid with export-models "
        r"--kv-update delta x\d+: \S+",
        report,
    )
    assert re.search(
        r"    RMSNormalization \(opset 24; imported from TensorRT 10\.15\); avoid with export-models "
        r"--tensorrt 10\.3 x\d+: ",
        report,
    )
    assert report.rstrip().endswith("export the bundle with `export-models --tensorrt 10.3`")
    assert "tensorrt     exported for" not in out


def test_inspect_tensorrt_exit_0_when_every_graph_parses(fp32_scatter, capsys):
    capsys.readouterr()
    assert main(["inspect", str(fp32_scatter), "--tensorrt", "10.16.0"]) == 0
    out = capsys.readouterr().out
    assert (
        "TensorRT 10.16 (asked for 10.16.0): opsets 9..24\n  target target/model.onnx: parses\n  all graphs parse"
        in out
    )
    assert main(["inspect", str(fp32_scatter)]) == 0  # no check asked: no exit 3
    assert "tensorrt check" not in capsys.readouterr().out


def test_inspect_tensorrt_json(fp32_scatter, capsys):
    capsys.readouterr()
    assert main(["inspect", str(fp32_scatter), "--json", "--tensorrt", "10.3.0.30"]) == 3
    obj = json.loads(capsys.readouterr().out)
    assert obj["tensorrt"] is None
    c = obj["tensorrt_check"]
    assert (c["version"], c["checked_against"], c["ok"], c["not_offered"]) == ("10.3.0.30", "10.3", False, [])
    [g] = c["graphs"]
    assert g["path"] == "target/model.onnx" and g["parses"] is False
    scatter = [f for f in g["findings"] if f["op"] == "TensorScatter"]
    assert scatter and scatter[0]["added_in"] == "10.15" and scatter[0]["avoid_with"] == "--kv-update delta"
    assert scatter[0]["node"] and scatter[0]["opset"] == 24
    assert main(["inspect", str(fp32_scatter), "--json", "--tensorrt", "10.15"]) == 0
    assert json.loads(capsys.readouterr().out)["tensorrt_check"]["ok"] is True


def test_inspect_tensorrt_no_graph_offered(fp32_scatter, tmp_path, capsys):
    def ort_only(m):
        for g in m["models"]["target"]["graphs"]:
            g["flavour"], g["backends"] = "ort", ["ort-cpu", "ort-cuda"]

    b = _copy_with(fp32_scatter, tmp_path / "ort-only", models=ort_only)
    capsys.readouterr()
    assert main(["inspect", str(b), "--tensorrt", "10.16"]) == 3
    out = capsys.readouterr().out
    assert (
        "  would not parse: this bundle offers TensorRT no graph (its graphs are for ONNX Runtime only): "
        "export it with `export-models --tensorrt 10.16`" in out
    )
    assert main(["inspect", str(b), "--json", "--tensorrt", "10.16"]) == 3
    c = json.loads(capsys.readouterr().out)["tensorrt_check"]
    assert c["ok"] is False and c["graphs"] == []


def test_inspect_shows_the_manifests_tensorrt(fp32_scatter, tmp_path, capsys):
    b = _copy_with(fp32_scatter, tmp_path / "for-10.16", tensorrt="10.16")
    capsys.readouterr()
    assert main(["inspect", str(b)]) == 0
    assert "tensorrt     exported for TensorRT 10.16 (export-models --tensorrt)\n" in capsys.readouterr().out
    assert main(["inspect", str(b), "--json", "--tensorrt", "10.16"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["tensorrt"] == "10.16" and obj["tensorrt_check"]["exported_for"] == "10.16"


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "abc",
            f"error: --tensorrt takes a TensorRT version such as 10.3 or 10.3.0.30, got 'abc': "
            f"the supported versions are {SUPPORTED}\n",
        ),
        (
            "8.6",
            f"error: TensorRT 8.6 is older than 10.3, the oldest TensorRT specedge supports: "
            f"use --tensorrt with one of {SUPPORTED}\n",
        ),
    ],
)
def test_inspect_tensorrt_bad_version(fp32_scatter, capsys, value, message):
    capsys.readouterr()
    assert main(["inspect", str(fp32_scatter), "--tensorrt", value]) == 2
    captured = capsys.readouterr()
    assert captured.err == message and captured.out == ""
