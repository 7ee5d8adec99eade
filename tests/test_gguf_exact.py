"""GGUF-exact weight quantization (specedge/export/gguf_exact.py): GGUF Q4_0/Q4_1/Q4_K/Q8_0 blocks
stored exactly in MatMulNBits, matched to graph weights per row, with re-quantization as the
fallback. The fast tests build tiny GGUF files; the slow one exports the real default model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specedge.export import gguf_exact as ge
from specedge.export.quantize import quantize_weights

Q4_0, Q4_1, Q8_0, Q4_K = 2, 3, 8, 12
TYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q4_K": Q4_K, "Q8_0": Q8_0}
K = 512  # a multiple of Q4_K's 256-value super-blocks
REL_TOL = 1e-5


def rand_raw(qtype: int, rows: int, k: int, rng) -> np.ndarray:
    """Random but well-formed GGUF rows: raw uint8 [rows, bytes per row] with finite fp16 scales."""
    tsize, bvals = ge._LAYOUT[qtype]
    raw = rng.integers(0, 256, size=(rows * (k // bvals), tsize), dtype=np.uint8)
    nf16 = 2 if qtype in (Q4_1, Q4_K) else 1  # d (and m / dmin) lead every block
    vals = rng.uniform(0.002, 0.02, size=(raw.shape[0], nf16))
    if qtype == Q4_1:
        vals[:, 1] = -rng.uniform(0.0, 0.15, size=raw.shape[0])  # the block min
    raw[:, : 2 * nf16] = vals.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, tensors: dict[str, tuple[int, np.ndarray]]) -> Path:
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(path), "llama")
    for name, (qtype, raw) in tensors.items():
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType(qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequant(qtype: int, raw: np.ndarray) -> np.ndarray:
    """What transformers loads: gguf's own dequantizer."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(raw, GGMLQuantizationType(qtype))


def matmul_model(weights: dict[str, np.ndarray], via_identity: bool = False) -> onnx.ModelProto:
    """x [1, T, K] → one MatMul per weight (B = Wᵀ [K, N]), each an output. via_identity: the
    MatMuls read an intermediate with no shape information."""
    k = next(iter(weights.values())).shape[0]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", k])
    src = "x"
    nodes = []
    if via_identity:
        nodes.append(helper.make_node("Identity", ["x"], ["x_id"], name="id"))
        src = "x_id"
    outs, inits = [], []
    for name, b in weights.items():
        inits.append(numpy_helper.from_array(np.ascontiguousarray(b, dtype=np.float32), f"{name}_w"))
        nodes.append(helper.make_node("MatMul", [src, f"{name}_w"], [f"y_{name}"], name=f"mm_{name}"))
        outs.append(helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, [1, "T", b.shape[1]]))
    g = helper.make_graph(nodes, "g", [x], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def run(proto: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    s = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(names, {"x": x})))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.mark.parametrize("tname", list(TYPES))
def test_decoding_matches_ggufs_dequantizer_bit_for_bit(tname, rng):
    qtype = TYPES[tname]
    raw = rand_raw(qtype, 9, K, rng)
    got = ge.decode_rows(qtype, raw).dequantize()
    assert np.array_equal(got.view(np.uint32), dequant(qtype, raw).view(np.uint32))


@pytest.mark.parametrize("precision_bits", [4, 8])
@pytest.mark.parametrize("tname", list(TYPES))
def test_exact_matmul_equals_the_gguf_weight(tname, precision_bits, rng, tmp_path):
    qtype = TYPES[tname]
    n = 48
    raw = rand_raw(qtype, n, K, rng)
    path = write_gguf(tmp_path / "w.gguf", {"blk.0.w": (qtype, raw)})
    w = dequant(qtype, raw)  # [N, K]
    proto = matmul_model({"a": w.T})
    rep = ge.rewrite_exact(proto, ge.GGUFRowIndex(path), precision_bits, accuracy_level=0)
    assert rep.exact == 1 and not rep.unmatched and rep.source_types == {tname: 1}
    ops = [nd.op_type for nd in proto.graph.node]
    assert "MatMul" not in ops or tname in ("Q4_1", "Q4_K")  # only the fp32 min correction stays
    nb = [nd for nd in proto.graph.node if nd.op_type == "MatMulNBits"]
    attrs = {a.name: helper.get_attribute_value(a) for a in nb[0].attribute}
    want_bits = 8 if precision_bits == 8 or tname == "Q8_0" else 4
    assert attrs["bits"] == want_bits and attrs["block_size"] == 32 and attrs["accuracy_level"] == 0
    affine = tname in ("Q4_1", "Q4_K")
    assert len(nb[0].input) == 3  # default zero point: affine codes are centred (see to_nbits)
    assert ops.count("ReduceSum") == (1 if affine else 0)
    assert not any(t.name == "a_w" for t in proto.graph.initializer)  # the fp32 weight is gone
    x = rng.normal(size=(1, 5, K)).astype(np.float32)
    ref = x[0].astype(np.float64) @ w.T.astype(np.float64)
    err = rel_err(run(proto, x)["y_a"][0], ref)
    print(f"{tname} bits {want_bits}: rel err {err:.2e}")
    assert err <= REL_TOL, f"{tname} at {want_bits} bits: relative error {err:.2e}"


def test_affine_blocks_whose_centred_min_is_inexact_use_zero_points(rng, tmp_path):
    """m + 8·d not representable in fp32 (a subnormal d next to a large m): the weight keeps its
    unsigned codes with explicit zero points 0 and the plain mins. Still exact."""
    raw = rand_raw(Q4_1, 8, K, rng)
    blk = raw.reshape(-1, 20)
    blk[5, 0:4] = np.array([2.0**-24, 1024.0], dtype=np.float16).view(np.uint8)
    path = write_gguf(tmp_path / "w.gguf", {"w": (Q4_1, raw)})
    w = dequant(Q4_1, raw)
    proto = matmul_model({"a": w.T})
    rep = ge.rewrite_exact(proto, ge.GGUFRowIndex(path), 4, accuracy_level=0)
    assert rep.storage == {"4-bit+zp+mins": 1}
    x = rng.normal(size=(1, 3, K)).astype(np.float32)
    assert rel_err(run(proto, x)["y_a"][0], x[0].astype(np.float64) @ w.T.astype(np.float64)) <= REL_TOL


def test_fused_permuted_projections_share_one_blocksum(rng, tmp_path):
    """q/k (Q4_1, Q4_K) rows concatenated and permuted like transformers' llama q/k reordering,
    a second MatMul on the same input (Q4_1): exact, with one blocksum for both."""
    q, kk, up = rand_raw(Q4_1, 64, K, rng), rand_raw(Q4_K, 32, K, rng), rand_raw(Q4_1, 40, K, rng)
    path = write_gguf(tmp_path / "w.gguf", {"attn_q": (Q4_1, q), "attn_k": (Q4_K, kk), "ffn_up": (Q4_1, up)})
    fused = np.concatenate([dequant(Q4_1, q), dequant(Q4_K, kk)])
    perm = rng.permutation(fused.shape[0])
    fused = fused[perm]
    w_up = dequant(Q4_1, up)
    proto = matmul_model({"qk": fused.T, "up": w_up.T})
    rep = ge.rewrite_exact(proto, ge.GGUFRowIndex(path), 4, accuracy_level=0)
    assert rep.exact == 2 and rep.source_types == {"Q4_1": 2, "Q4_K": 1}
    assert [nd.op_type for nd in proto.graph.node].count("ReduceSum") == 1
    x = rng.normal(size=(1, 3, K)).astype(np.float32)
    out = run(proto, x)
    for name, w in (("qk", fused), ("up", w_up)):
        assert rel_err(out[f"y_{name}"][0], x[0].astype(np.float64) @ w.T.astype(np.float64)) <= REL_TOL


def test_mixed_block_types_in_one_weight(rng, tmp_path):
    """Q4_0 and Q4_1 columns → 4-bit with mins; with a Q8_0 column → 8-bit with mins. Exact both."""
    a, b, c = rand_raw(Q4_0, 16, K, rng), rand_raw(Q4_1, 16, K, rng), rand_raw(Q8_0, 16, K, rng)
    path = write_gguf(tmp_path / "w.gguf", {"a": (Q4_0, a), "b": (Q4_1, b), "c": (Q8_0, c)})
    w4 = np.concatenate([dequant(Q4_0, a), dequant(Q4_1, b)])
    w8 = np.concatenate([dequant(Q4_1, b), dequant(Q8_0, c), dequant(Q4_0, a)])
    proto = matmul_model({"w4": w4.T, "w8": w8.T}, via_identity=True)  # rank unknown: dynamic reshape
    rep = ge.rewrite_exact(proto, ge.GGUFRowIndex(path), 4, accuracy_level=0)
    assert rep.exact == 2 and rep.storage == {"4-bit+mins": 1, "8-bit+mins": 1}
    x = rng.normal(size=(1, 4, K)).astype(np.float32)
    out = run(proto, x)
    for name, w in (("w4", w4), ("w8", w8)):
        assert rel_err(out[f"y_{name}"][0], x[0].astype(np.float64) @ w.T.astype(np.float64)) <= REL_TOL


def test_a_column_that_matches_no_row_falls_back_to_requantization(rng, tmp_path):
    good, bad = rand_raw(Q4_1, 32, K, rng), rand_raw(Q4_0, 32, K, rng)
    path = write_gguf(tmp_path / "w.gguf", {"good": (Q4_1, good), "bad": (Q4_0, bad)})
    w_bad = dequant(Q4_0, bad)
    w_bad[7, 3] = np.nextafter(w_bad[7, 3], np.float32(1))  # one value off by one ulp
    proto = matmul_model({"good": dequant(Q4_1, good).T, "bad": w_bad.T})
    info: dict = {}
    out = quantize_weights(proto, 4, 32, accuracy_level=0, gguf=str(path), info=info)
    assert info["method"] == "gguf-exact+requantized"
    assert info["exact_matmuls"] == 1 and info["requantized_matmuls"] == 1, info
    nb = {nd.name: nd for nd in out.graph.node if nd.op_type == "MatMulNBits"}
    assert len(nb) == 2
    # the min-correction MatMul was left in fp32, the unmatched weight re-quantized by ORT
    inits = {t.name: t for t in out.graph.initializer}
    fp32_mm = [nd for nd in out.graph.node if nd.op_type == "MatMul"]
    assert len(fp32_mm) == 1 and fp32_mm[0].name.endswith("_gguf_mins")
    assert not any(name.endswith("_w") and inits[name].data_type == TensorProto.FLOAT for name in inits)
    x = rng.normal(size=(1, 2, K)).astype(np.float32)
    y = run(out, x)
    ref = x[0].astype(np.float64) @ dequant(Q4_1, good).T.astype(np.float64)
    assert rel_err(y["y_good"][0], ref) <= REL_TOL
    ref_bad = x[0].astype(np.float64) @ w_bad.T.astype(np.float64)
    assert 0 < rel_err(y["y_bad"][0], ref_bad) < 0.2  # re-quantized: close, not exact


def test_without_a_gguf_every_weight_is_requantized(rng):
    w = rng.normal(size=(64, K)).astype(np.float32)
    info: dict = {}
    out = quantize_weights(matmul_model({"a": w.T}), 4, 32, info=info)
    assert info["method"] == "requantized" and info["exact_matmuls"] == 0 and info["requantized_matmuls"] == 1
    assert [nd.op_type for nd in out.graph.node] == ["MatMulNBits"]


def test_tied_gather_keeps_its_fp32_table(rng, tmp_path):
    """The graph gathers embedding columns from the lm_head weight: lm_head becomes MatMulNBits,
    the table stays for the Gather."""
    emb = rand_raw(Q8_0, 50, K, rng)
    path = write_gguf(tmp_path / "w.gguf", {"token_embd": (Q8_0, emb)})
    proto = matmul_model({"head": dequant(Q8_0, emb).T})
    g = proto.graph
    g.input.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "T"]))
    g.node.append(helper.make_node("Gather", ["head_w", "ids"], ["cols"], axis=1, name="embed"))
    g.output.append(helper.make_tensor_value_info("cols", TensorProto.FLOAT, [K, 1, "T"]))
    rep = ge.rewrite_exact(proto, ge.GGUFRowIndex(path), 4, accuracy_level=0)
    assert rep.exact == 1 and rep.storage == {"8-bit": 1}
    assert any(t.name == "head_w" for t in proto.graph.initializer)


def test_manifest_records_and_validates_quantization(tiny_bundle_factory, tmp_path):
    from specedge.manifest import BundleError, load_manifest, parse_manifest

    m = load_manifest(tiny_bundle_factory(), verify="none")  # int4 draft from an HF checkpoint
    q = m.draft.quantization
    assert q["method"] == "requantized" and q["exact_matmuls"] == 0 and q["requantized_matmuls"] > 0
    obj = m.to_json()
    assert parse_manifest(obj).draft.quantization == q
    assert "quantization" not in obj["models"]["target"]  # fp32: nothing to say
    obj["models"]["draft"]["quantization"] = {"method": "gguf-exact", "exact_matmuls": -1}
    with pytest.raises(BundleError, match="quantization.exact_matmuls"):
        parse_manifest(json.loads(json.dumps(obj)))
    obj["models"]["draft"]["quantization"] = "exact"
    with pytest.raises(BundleError, match="must be an object"):
        parse_manifest(obj)


# ----------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_default_gguf_weights_are_all_exact():
    """Every linear weight of the default SmolLM2 GGUF (Q4_1, Q8_0 tied head) matches GGUF rows
    after transformers' loading (incl. its q/k row permutation) and is taken exactly."""
    from specedge.export import sources

    ck = sources.load(None)
    path = ck.path
    index = ge.row_index(path)
    assert index.skipped == {}
    seen = set()
    for name, w in ck.state_dict.items():
        if w.dim() != 2 or w.data_ptr() in seen:  # the tied lm_head is the embedding
            continue
        seen.add(w.data_ptr())
        rows, types, found = index.match(w.numpy().T)
        assert rows is not None, f"{name}: {found} of {w.shape[0]} rows found in the GGUF"
    assert len(seen) == 30 * 7 + 1  # 7 projections per layer + the tied embedding / lm_head


def test_one_blocksum_serves_every_matmul_reading_an_input(rng, tmp_path):
    """Two Q4_1 weights on one input: one Reshape + ReduceSum feeds both min corrections, and the
    outputs are the dequantized weights' to the test tolerance."""
    q, up = rand_raw(Q4_1, 64, K, rng), rand_raw(Q4_1, 40, K, rng)
    path = write_gguf(tmp_path / "w.gguf", {"attn_q": (Q4_1, q), "ffn_up": (Q4_1, up)})
    weights = {"q": dequant(Q4_1, q).T, "up": dequant(Q4_1, up).T}
    x = rng.normal(size=(1, 7, K)).astype(np.float32)
    proto = matmul_model(weights)
    rep = ge.rewrite_exact(proto, ge.GGUFRowIndex(path), 4, accuracy_level=0)
    assert rep.exact == 2
    ops = [nd.op_type for nd in proto.graph.node]
    assert ops.count("ReduceSum") == 1 and ops.count("Reshape") == 1
    outs = run(proto, x)
    for name, w in weights.items():
        assert rel_err(outs[f"y_{name}"][0], x[0].astype(np.float64) @ w.astype(np.float64)) <= REL_TOL


def test_the_measured_but_unused_forms_are_not_options():
    """Float zero points and a block-indicator blocksum were measured and not kept
    (benchmarks/history/int4.md): the export offers neither."""
    import inspect

    for fn in (ge.rewrite_exact, quantize_weights):
        params = inspect.signature(fn).parameters
        assert "min_form" not in params and "blocksum" not in params
    assert not hasattr(ge, "block_indicator") and not hasattr(ge, "float_zero_points")
