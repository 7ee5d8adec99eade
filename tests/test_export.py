"""The export pipeline (issue 2): exported graphs against the PyTorch modules, the graph contract,
in-place KV updates, the manifest, atomic writes, tokenizer checks and precisions.

Bundles come from the session-scoped `tiny_bundle_factory` (tests/conftest.py): one export per
combination, shared with the runtime's tests. Tests never modify a shared bundle; they copy it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from specedge.contract import graph_io
from specedge.errors import UserError
from specedge.export import pipeline
from specedge.export.pipeline import ExportOptions, export_bundle
from specedge.manifest import MANIFEST_NAME, BundleError, load_manifest, parse_manifest
from specedge.models import FAMILIES, build_model, load_weights

TOL = 1e-4  # fp32 ORT vs the PyTorch module
MODES = ("scatter", "delta")
K = 4  # spec_tokens of the factory's default bundles
CHUNK = 16  # prefill_chunk of the factory's default bundles
ELEM = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32"}
INPLACE_COPY_LOG = "in-place optimization not activated"


def _unique_families() -> list[str]:
    """One name per module: gemma3 and gemma3_text are the same class (the text one is tested)."""
    by_cls: dict[type, list[str]] = {}
    for name, cls in FAMILIES.items():
        by_cls.setdefault(cls, []).append(name)
    out = []
    for names in by_cls.values():
        text = [n for n in names if n.endswith("_text")]
        out.append(text[0] if text else sorted(names)[0])
    return sorted(out)


FAMILY_LIST = _unique_families()
# Figures printed at the end of the module (max |Δ| per graph).
MAX_DIFF: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is None or capman is None or not MAX_DIFF:
        return
    with capman.global_and_fixture_disabled():
        tr.write_line("")
        for k in sorted(MAX_DIFF):
            tr.write_line(f"  max |Δ| {k:50s} {MAX_DIFF[k]:.2e}")


def _bundle_for(factory, family: str, kv_mode: str) -> Path:
    # llama carries an int4 self draft (the factory's default bundle, also used by the runtime's
    # tests); the other families an n-gram draft, to keep the number of exports down.
    return factory(family=family, kv_mode=kv_mode, draft="self" if family == "llama" else "ngram")


def _session(path: Path, log_level: int = 3) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = log_level
    # an int4 model's specedge graph (beside its MatMulNBits twin) needs specedge's kernels
    from specedge import custom_ops
    from specedge.export.specedge_kernel import custom_op_libraries

    custom_ops.register(so, custom_op_libraries(onnx.load(str(path), load_external_data=False)))
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@functools.cache
def _hf_model(ckpt: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, local_files_only=True).eval()


def _torch_model(ckpt: str, kv_mode: str, fake_quant_bits: int | None = None, block: int = 32):
    hf = _hf_model(ckpt)
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    m = build_model(cfg, kv_mode)
    load_weights(m, hf.state_dict())
    m.eval()
    if fake_quant_bits:
        with torch.no_grad():
            for mod in m.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.copy_(_fake_quant(mod.weight, fake_quant_bits, block))
    return m


def _fake_quant(w: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """ORT's symmetric block-wise weight quantization (MatMulNBits, is_symmetric=True): per block of
    `block` inputs, the value of largest magnitude maps to the most negative level."""
    n, k = w.shape
    wb = w.reshape(n, k // block, block)
    v = torch.gather(wb, -1, wb.abs().argmax(-1, keepdim=True))
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    scale = v / lo
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.clamp(torch.round(wb / scale), lo, hi) * scale).reshape(n, k)


def _noise_cache(spec, max_seq: int, seed: int = 123) -> list[np.ndarray]:
    """Start caches full of large noise: slots never written must be masked, whatever they hold."""
    rng = np.random.default_rng(seed)
    shape = (1, spec.num_kv_heads, max_seq, spec.head_dim)
    return [(rng.standard_normal(shape) * 10).astype(np.float32) for _ in range(2 * spec.num_layers)]


def _cache_names(n_layers: int, prefix: str) -> list[str]:
    return [f"{prefix}_{kv}.{i}" for i in range(n_layers) for kv in ("key", "value")]


class OrtDriver:
    """Runs a graph like the runtime does: owns the static cache; in scatter mode feeds present
    back as past, in delta mode writes new_* at `position` itself."""

    def __init__(self, path: Path, spec, kv_mode: str, cache: list[np.ndarray]):
        self.sess = _session(path)
        self.kv_mode = kv_mode
        self.cache = [c.copy() for c in cache]
        self.past = _cache_names(spec.num_layers, "past")
        self.out = ["logits"] + _cache_names(spec.num_layers, "present" if kv_mode == "scatter" else "new")

    def step(self, ids: np.ndarray, pos: int):
        feeds = {"input_ids": ids, "position": np.array([pos], dtype=np.int64)}
        feeds.update(zip(self.past, self.cache))
        outs = self.sess.run(self.out, feeds)
        t = ids.shape[1]
        if self.kv_mode == "scatter":
            self.cache = outs[1:]
        else:
            for c, new in zip(self.cache, outs[1:]):
                c[:, :, pos : pos + t] = new
        return outs[0], outs[1:]


class TorchDriver:
    def __init__(self, model, kv_mode: str, cache: list[np.ndarray]):
        self.model = model
        self.kv_mode = kv_mode
        self.cache = [torch.from_numpy(c.copy()) for c in cache]

    @torch.no_grad()
    def step(self, ids: np.ndarray, pos: int):
        out = self.model(torch.from_numpy(ids), torch.tensor([pos], dtype=torch.int64), *self.cache)
        t = ids.shape[1]
        if self.kv_mode == "scatter":
            self.cache = list(out[1:])
        else:
            for c, new in zip(self.cache, out[1:]):
                c[:, :, pos : pos + t] = new
        return out[0].numpy(), [o.numpy() for o in out[1:]]


# (T, position): every T at position 0 and > 0; the prefill chunk commits 16 tokens, then a
# decode step, a verify chunk, a rollback over two of its tokens and another chunk.
STEPS = [(1, 0), (K + 1, 0), (CHUNK, 0), (1, CHUNK), (K + 1, CHUNK + 1), (K + 1, CHUNK + 4), (CHUNK, CHUNK + 9)]


def _graphs_for_cpu(spec):
    # ORT CPU runs every flavour: the "ort" one (contrib ops) and the portable one (standard ops),
    # and an int4 model's specedge graph where specedge's kernels are here.
    from specedge import custom_ops

    try:
        custom_ops.library_path()
        have = True
    except custom_ops.CustomOpsError:
        have = False
    return [g for g in spec.graphs if have or not g.custom_ops]


def _both(factory) -> Path:
    """llama with both graph flavours (ORT-tuned and portable TensorScatter) and an int8 self draft
    (the default bundle has the int4 one)."""
    return factory(graphs="both", draft_precision="int8")


def _fp16(factory) -> Path:
    return factory(precision="fp16", draft="ngram")


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("kv_mode", MODES)
@pytest.mark.parametrize("family", FAMILY_LIST)
def test_target_graph_matches_pytorch(tiny_bundle_factory, family, kv_mode):
    _parity(_bundle_for(tiny_bundle_factory, family, kv_mode), family, kv_mode)


def test_both_flavours_match_pytorch(tiny_bundle_factory):
    bundle = _both(tiny_bundle_factory)
    assert {g.flavour for g in load_manifest(bundle).target.graphs} == {"ort", "portable"}
    _parity(bundle, "llama", "scatter")


def _parity(bundle: Path, family: str, kv_mode: str) -> None:
    m = load_manifest(bundle)
    spec = m.target
    assert (m.spec_tokens, m.prefill_chunk) == (K, CHUNK)
    model = _torch_model(spec.source, kv_mode)
    rng = np.random.default_rng(7)
    cache0 = _noise_cache(spec, m.max_seq)
    for g in _graphs_for_cpu(spec):
        ours = OrtDriver(m.path(g.path), spec, kv_mode, cache0)
        ref = TorchDriver(model, kv_mode, cache0)
        worst = worst_kv = 0.0
        for t, pos in STEPS:
            ids = rng.integers(3, spec.vocab_size, (1, t)).astype(np.int64)
            lo, kvo = ours.step(ids, pos)
            lr, kvr = ref.step(ids, pos)
            assert lo.shape == (1, t, spec.vocab_size) and lo.dtype == np.float32
            d = float(np.abs(lo - lr).max())
            assert d <= TOL, f"{family}/{kv_mode}/{g.flavour}: T={t} position={pos}: max |Δlogit| {d:.2e}"
            # Scatter mode: the cache up to the last new token must match; slots past it are masked
            # and a graph may leave them as they were or not (ORT's fused attention does not copy
            # them when past and present are separate buffers).
            live = slice(None) if kv_mode == "delta" else slice(0, pos + t)
            dk = max(float(np.abs(a[:, :, live] - b[:, :, live]).max()) for a, b in zip(kvo, kvr))
            assert dk <= TOL, f"{family}/{kv_mode}/{g.flavour}: T={t} position={pos}: max |ΔKV| {dk:.2e}"
            worst, worst_kv = max(worst, d), max(worst_kv, dk)
        # The caches the two drove agree on every written slot.
        end = STEPS[-1][0] + STEPS[-1][1]
        dc = max(float(np.abs(a[:, :, :end] - b.numpy()[:, :, :end]).max()) for a, b in zip(ours.cache, ref.cache))
        assert dc <= TOL
        MAX_DIFF[f"logits {family} {kv_mode} {g.flavour} fp32"] = worst
        MAX_DIFF[f"kv     {family} {kv_mode} {g.flavour} fp32"] = worst_kv


def _quantized_check(bundle: Path, role: str, bits: int, kv_mode: str = "scatter") -> None:
    """A weight-only graph against the PyTorch module whose Linear weights went through the same
    block-wise symmetric quantization: what is left is ORT's int8 activation quantization
    (accuracy_level 4), far below the quantization error itself."""
    m = load_manifest(bundle)
    spec = getattr(m, role)
    exact = _torch_model(spec.source, kv_mode)
    fq = _torch_model(spec.source, kv_mode, fake_quant_bits=bits)
    cache0 = _noise_cache(spec, m.max_seq)
    ids = np.random.default_rng(3).integers(3, spec.vocab_size, (1, 40)).astype(np.int64)
    for g in _graphs_for_cpu(spec):
        ours = OrtDriver(m.path(g.path), spec, kv_mode, cache0)
        lo, _ = ours.step(ids[:, :24], 0)
        lo2, _ = ours.step(ids[:, 24:], 24)
        lq = TorchDriver(fq, kv_mode, cache0).step(ids, 0)[0]
        le = TorchDriver(exact, kv_mode, cache0).step(ids, 0)[0]
        got = np.concatenate([lo, lo2], 1)
        d_fq = float(np.abs(got - lq).max())
        d_exact = float(np.abs(got - le).max())
        scale = float(np.abs(le).max())
        MAX_DIFF[f"logits llama {kv_mode} {role} {g.flavour} int{bits} vs fake-quant"] = d_fq
        MAX_DIFF[f"logits llama {kv_mode} {role} {g.flavour} int{bits} vs fp32"] = d_exact
        assert d_fq <= 0.1 * scale, (
            f"int{bits} graph vs fake-quantized module: max |Δ| {d_fq:.3f} (logit scale {scale:.2f})"
        )
        agree = float((got.argmax(-1) == lq.argmax(-1)).mean())
        assert agree >= 0.8, f"int{bits} greedy top-1 agrees with the fake-quantized module on {agree:.0%} only"


def test_int4_draft_matches_quantized_module(tiny_bundle_factory):
    _quantized_check(tiny_bundle_factory(), "draft", 4)


# ----------------------------------------------------------------------------- graph contract


def _all_nodes(graph):
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _all_nodes(g)


def _io(values) -> list[tuple]:
    return [
        (
            v.name,
            ELEM.get(v.type.tensor_type.elem_type, f"?{v.type.tensor_type.elem_type}"),
            [d.dim_param if d.HasField("dim_param") else d.dim_value for d in v.type.tensor_type.shape.dim],
        )
        for v in values
    ]


def _contract_bundles(factory) -> list[tuple[str, Path]]:
    out = [(f"{f}-{mode}", _bundle_for(factory, f, mode)) for f in FAMILY_LIST for mode in MODES]
    out.append(("llama-scatter-both", _both(factory)))
    out.append(("llama-fp16", _fp16(factory)))
    return out


def check_graph_contract(m, spec, g) -> None:
    path = m.path(g.path)
    where = f"{spec.role} {g.path}"
    proto = onnx.load(str(path), load_external_data=False)
    # onnx's full check runs ONNX shape inference, which knows no com.microsoft schema: graphs with
    # ORT contrib ops get the structural check (ORT validates those nodes when it loads them).
    contrib = sorted({n.op_type for n in proto.graph.node if n.domain == "com.microsoft"})
    onnx.checker.check_model(str(path), full_check=not contrib)
    # No control flow anywhere (subgraphs included).
    ops = [n.op_type for n in _all_nodes(proto.graph)]
    assert not set(ops) & {"If", "Loop", "Scan"}, where
    # Names, dtypes and shapes exactly as the contract (and the manifest) say.
    want_in, want_out = graph_io(spec, m.kv_mode, m.max_seq, m.batch)
    assert _io(proto.graph.input) == [(t.name, t.dtype, t.shape) for t in want_in], where
    assert _io(proto.graph.output) == [(t.name, t.dtype, t.shape) for t in want_out], where
    assert [t.to_json() for t in spec.inputs] == [t.to_json() for t in want_in]
    assert [t.to_json() for t in spec.outputs] == [t.to_json() for t in want_out]
    # Every dimension is a fixed number except T (axis 1 of ids/logits, axis 2 of new_*).
    for v in list(proto.graph.input) + list(proto.graph.output):
        for axis, d in enumerate(v.type.tensor_type.shape.dim):
            if d.HasField("dim_param"):
                assert d.dim_param == "T", f"{where}: {v.name} has symbolic dim {d.dim_param!r}"
                assert (v.name, axis) in {("input_ids", 1), ("logits", 1)} or (
                    v.name.startswith("new_") and axis == 2
                ), f"{where}: {v.name} axis {axis} is dynamic"
            else:
                assert d.dim_value > 0, f"{where}: {v.name} axis {axis} has no size"
    # Opset 24 (TensorScatter), the cache write in scatter mode only.
    opsets = {o.domain: o.version for o in proto.opset_import}
    assert opsets.get("", opsets.get("ai.onnx")) == 24, opsets
    scatters = [n for n in proto.graph.node if n.op_type == "TensorScatter"]
    if m.kv_mode == "delta":
        assert not scatters, f"{where}: delta mode must not contain TensorScatter"
    elif g.flavour == "portable":
        assert len(scatters) == 2 * spec.num_layers, f"{where}: {len(scatters)} TensorScatter"
        for n in scatters:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert attrs.get("axis", -2) in (-2, 2) and attrs.get("mode", b"linear") == b"linear"
            assert n.input[0].startswith("past_") and n.input[2] == "position"
        # …and no whole-cache scatter instead of it.
        assert not {"ScatterND", "ScatterElements"} & set(ops)
    # Weights live in external data, one file next to the graph, listed in the manifest.
    assert g.external_data, where
    data = m.path(g.external_data[0])
    assert data.parent == path.parent and data.stat().st_size > 0
    ext, inline = [], []
    for t in proto.graph.initializer:
        (ext if t.data_location == onnx.TensorProto.EXTERNAL else inline).append(t)
    assert ext, f"{where}: no external weights"
    locs = {e.value for t in ext for e in t.external_data if e.key == "location"}
    assert locs == {data.name}, locs
    biggest_inline = max((t.ByteSize() for t in inline), default=0)
    assert biggest_inline <= 4096, f"{where}: an inline initializer of {biggest_inline} bytes"
    consts = [n for n in proto.graph.node if n.op_type == "Constant"]
    assert all(a.t.ByteSize() <= 4096 for n in consts for a in n.attribute if a.type == onnx.AttributeProto.TENSOR)
    # The recorded precision is what the graph holds.
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    if spec.precision in ("int4", "int8"):
        bits = 4 if spec.precision == "int4" else 8
        assert nbits, f"{where}: {spec.precision} graph without MatMulNBits"
        for n in nbits:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert attrs["bits"] == bits and attrs["block_size"] == 32, attrs
        # Every MatMul with a constant weight was quantized.
        inits = {t.name for t in proto.graph.initializer}
        left = [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
        assert not left, f"{where}: MatMuls left unquantized: {left[:3]}"
    else:
        assert not nbits
        want = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[spec.precision]
        big = {ELEM.get(t.data_type) for t in ext if np.prod(t.dims) >= 1024}
        assert big == {want}, f"{where}: {spec.precision} graph has {big} weights"


def test_every_graph_follows_the_contract(tiny_bundle_factory):
    seen = 0
    for _name, bundle in _contract_bundles(tiny_bundle_factory):
        m = load_manifest(bundle)
        for spec in (m.target, m.draft):
            if not spec.is_model:
                continue
            for g in spec.graphs:
                check_graph_contract(m, spec, g)
                seen += 1
    assert seen >= 2 * len(FAMILY_LIST) + 4


def test_portable_graphs_use_standard_onnx_ops(tiny_bundle_factory):
    """A graph the manifest offers to TensorRT (backend 'tensorrt' or 'ort-trt') may only use the
    standard ONNX domain: TensorRT cannot parse com.microsoft ops such as MatMulNBits. Quantized
    graphs (MatMulNBits) must therefore not be offered to TensorRT at all."""
    bad = []
    offered = 0
    for name, bundle in (
        ("llama-scatter", tiny_bundle_factory()),
        ("llama-scatter-both", _both(tiny_bundle_factory)),
        ("llama-fp16", _fp16(tiny_bundle_factory)),
    ):
        m = load_manifest(bundle)
        for spec in (m.target, m.draft):
            for g in spec.graphs if spec.is_model else []:
                proto = onnx.load(str(m.path(g.path)), load_external_data=False)
                domains = sorted({n.domain for n in proto.graph.node} - {"", "ai.onnx"})
                trt = sorted({"tensorrt", "ort-trt"} & set(g.backends))
                if spec.precision in ("int8", "int4"):
                    assert not trt, f"{name} {spec.role} ({spec.precision}) {g.path} is offered to {trt}"
                if not trt:
                    continue
                offered += 1
                if domains:
                    bad.append(f"{name} {spec.role} ({spec.precision}) {g.path}: {domains}")
    assert offered >= 2, "the fixtures should offer an fp32 and an fp16 portable graph to TensorRT"
    assert not bad, "graphs offered to TensorRT use non-standard ops: " + "; ".join(bad)


# ----------------------------------------------------------------------------- in place


def _bind_and_run(sess, spec, bufs, out_bufs, ids, pos):
    io = sess.io_binding()
    io.bind_cpu_input("input_ids", ids)
    io.bind_cpu_input("position", np.array([pos], dtype=np.int64))
    for name, ov in bufs.items():
        io.bind_ortvalue_input(name, ov)
    for name, ov in out_bufs.items():
        io.bind_ortvalue_output(name, ov)
    io.bind_output("logits")
    sess.run_with_iobinding(io)
    return io


@pytest.mark.parametrize("flavour", ["portable", "ort"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_scatter_updates_the_bound_buffer_in_place(tiny_bundle_factory, capfd, role, flavour):
    m = load_manifest(_both(tiny_bundle_factory))
    spec = getattr(m, role)
    g = next((g for g in spec.graphs if g.flavour == flavour), None)
    if g is None:
        pytest.skip(f"the {role} has no {flavour} graph")
    proto = onnx.load(str(m.path(g.path)), load_external_data=False)
    scatter = any(n.op_type == "TensorScatter" for n in proto.graph.node)
    assert scatter or flavour != "portable"
    # Warning level: ORT's TensorScatter logs "in-place optimization not activated" when it copies.
    sess = _session(m.path(g.path), log_level=2)
    n = spec.num_layers
    rng = np.random.default_rng(11)
    ids = rng.integers(3, spec.vocab_size, (1, 3)).astype(np.int64)
    pos = 5
    base = _noise_cache(spec, m.max_seq, seed=5)
    capfd.readouterr()

    # Control: separate output buffers. ORT copies past into present (and TensorScatter says so).
    arrs = [a.copy() for a in base]
    ins = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in zip(_cache_names(n, "past"), arrs)}
    outs = {
        name: ort.OrtValue.ortvalue_from_numpy(np.zeros_like(a)) for name, a in zip(_cache_names(n, "present"), arrs)
    }
    io = _bind_and_run(sess, spec, ins, outs, ids, pos)
    expect = [outs[name].numpy().copy() for name in _cache_names(n, "present")]
    ref_logits = io.copy_outputs_to_cpu()[-1]
    log = capfd.readouterr().err
    if scatter:
        assert INPLACE_COPY_LOG in log, "the control run should log ORT's copy (is the log captured?)"
    assert all(np.array_equal(a, b) for a, b in zip(arrs, base)), "separate buffers: past must stay untouched"

    # Aliased: past_* and present_* bound to the SAME OrtValue over our numpy arrays.
    arrs = [a.copy() for a in base]
    ptrs = [a.ctypes.data for a in arrs]
    shared = {i: ort.OrtValue.ortvalue_from_numpy(a) for i, a in enumerate(arrs)}
    ins = {name: shared[i] for i, name in enumerate(_cache_names(n, "past"))}
    outs = {name: shared[i] for i, name in enumerate(_cache_names(n, "present"))}
    io = _bind_and_run(sess, spec, ins, outs, ids, pos)
    log = capfd.readouterr().err
    assert INPLACE_COPY_LOG not in log, f"ORT copied the cache although past and present share a buffer:\n{log}"
    out_vals = io.get_outputs()
    # The outputs come back in binding order: present_* first, logits last.
    for i in range(2 * n):
        assert out_vals[i].data_ptr() == shared[i].data_ptr() == ptrs[i]
    np.testing.assert_allclose(io.copy_outputs_to_cpu()[-1], ref_logits, rtol=0, atol=1e-5)
    for a, b, e in zip(arrs, base, expect):
        # The numpy buffer itself now holds the new K/V at position..position+T-1; slots before
        # are untouched. (Slots after may be left as they were or not: they are masked.)
        np.testing.assert_allclose(a[:, :, pos : pos + 3], e[:, :, pos : pos + 3], rtol=0, atol=1e-6)
        assert not np.array_equal(a[:, :, pos : pos + 3], b[:, :, pos : pos + 3])
        np.testing.assert_array_equal(a[:, :, :pos], b[:, :, :pos])
        if scatter:
            np.testing.assert_array_equal(a, e)
            np.testing.assert_array_equal(a[:, :, pos + 3 :], b[:, :, pos + 3 :])
    # A second step keeps writing into the same memory.
    snapshot = [a.copy() for a in arrs]
    _bind_and_run(sess, spec, ins, outs, ids[:, :1], pos + 3)
    assert INPLACE_COPY_LOG not in capfd.readouterr().err
    for a, s in zip(arrs, snapshot):
        assert not np.array_equal(a[:, :, pos + 3], s[:, :, pos + 3])
        np.testing.assert_array_equal(a[:, :, : pos + 3], s[:, :, : pos + 3])


# ----------------------------------------------------------------------------- manifest


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_manifest_records_precision_checksums_and_tokenizer(tiny_bundle_factory):
    bundle = tiny_bundle_factory()
    m = load_manifest(bundle, verify="full")
    raw = json.loads((bundle / MANIFEST_NAME).read_text())
    # Precision per graph.
    assert (m.target.precision, m.target.kv_dtype) == ("fp32", "float32")
    assert (m.draft.precision, m.draft.kv_dtype) == ("int4", "float32")
    assert "int4" in m.draft.extra["weights"] and "MatMulNBits" in m.draft.extra["weights"]
    assert m.draft.extra.get("self_draft_of") == "target"
    assert 0 < m.draft.weight_bytes < m.target.weight_bytes
    assert m.target.num_params > 0 and m.target.num_params == m.draft.num_params
    # Checksums match the files, and every file of the bundle is listed (no scratch left over).
    on_disk = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert on_disk == set(m.files)
    for rel, info in m.files.items():
        p = bundle / rel
        assert info["bytes"] == p.stat().st_size and info["sha256"] == _sha(p), rel
    # Every file gets the mode any new file gets (the weights too: a bundle installed by one user
    # is run by another).
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.relative_to(bundle).as_posix(): oct(p.stat().st_mode & 0o777) for p in bundle.rglob("*") if p.is_file()}
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes
    # Tokenizer files and the chat template.
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(m.tokenizer_files)
    assert m.chat_template == "chat_template.jinja"
    assert "messages" in (bundle / "chat_template.jinja").read_text()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    assert tok.get_vocab_size() == m.tokenizer_vocab_size == 256
    assert tok.token_to_id("</s>") in m.eos_token_ids
    assert m.bos_token_id == tok.token_to_id("<s>")
    # Round trip: file -> Manifest -> JSON is the file; parse(to_json) is stable.
    assert m.to_json() == raw
    assert parse_manifest(m.to_json()).to_json() == raw
    assert m.schema_version == raw["schema_version"] == 2  # 2: optional target features, draft heads
    assert (m.max_seq, m.spec_tokens, m.prefill_chunk, m.kv_mode) == (128, K, CHUNK, "scatter")


def test_load_manifest_refuses_a_tampered_bundle(tiny_bundle_factory, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(tiny_bundle_factory(family="llama", kv_mode="scatter", draft="self"), b)
    data = b / "target" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    load_manifest(b, verify="size")  # same size: only the hash tells
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_manifest(b, verify="full")
    data.write_bytes(bytes(raw[:-4]))
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_manifest(b, verify="size")


def _failing_export_one(calls, exc):
    orig = pipeline._export_one

    def boom(tmp, role, *a, **kw):
        orig(tmp, role, *a, **kw)
        calls.append((role, (Path(tmp) / role / "model.onnx").is_file(), Path(tmp).name))
        raise exc

    return boom


def test_failed_export_leaves_nothing_behind(tiny_checkpoint_factory, tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(pipeline, "_export_one", _failing_export_one(calls, RuntimeError("simulated failure")))
    out = tmp_path / "out" / "bundle"
    opts = ExportOptions(target=str(tiny_checkpoint_factory("llama")), draft="self", out=str(out), max_seq=32)
    with pytest.raises(RuntimeError, match="simulated failure"):
        export_bundle(opts)
    # The target graph had been written (into the temp folder) when it failed…
    assert calls and calls[0][:2] == ("target", True) and ".partial-" in calls[0][2]
    # …and nothing of it is left: no bundle, no partial folder.
    assert not out.exists()
    assert list((tmp_path / "out").iterdir()) == []


def test_failed_forced_reexport_keeps_the_old_bundle(
    tiny_bundle_factory, tiny_checkpoint_factory, tmp_path, monkeypatch
):
    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_factory(), out)
    before = {p.relative_to(out).as_posix(): _sha(p) for p in out.rglob("*") if p.is_file()}
    calls: list = []
    monkeypatch.setattr(pipeline, "_export_one", _failing_export_one(calls, KeyboardInterrupt()))
    opts = ExportOptions(
        target=str(tiny_checkpoint_factory("llama")), draft="ngram", out=str(out), max_seq=32, force=True
    )
    with pytest.raises(KeyboardInterrupt):
        export_bundle(opts)
    assert calls and calls[0][:2] == ("target", True)
    after = {p.relative_to(out).as_posix(): _sha(p) for p in out.rglob("*") if p.is_file()}
    assert after == before
    load_manifest(out, verify="full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"], "a .partial or .old folder was left"


# ----------------------------------------------------------------------------- tokenizers


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _swap_two_tokens(folder: Path) -> None:
    """Same vocabulary size and file names, two ids exchanged: only comparing the vocabularies
    tells the tokenizers apart."""
    p = folder / "tokenizer.json"
    obj = json.loads(p.read_text(encoding="utf-8"))
    vocab = obj["model"]["vocab"]
    specials = {t["content"] for t in obj.get("added_tokens", [])}
    a, b = [t for t in sorted(vocab, key=vocab.get) if t not in specials][40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    p.write_text(json.dumps(obj), encoding="utf-8")


def _smaller_vocab(folder: Path) -> None:
    from specedge.export.testing import tiny_tokenizer

    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).unlink()
    tiny_tokenizer(200).save_pretrained(str(folder))


@pytest.mark.parametrize("change", [_swap_two_tokens, _smaller_vocab], ids=["swapped-ids", "smaller-vocab"])
def test_draft_with_another_tokenizer_is_refused(tiny_checkpoint_factory, tmp_path, change):
    target = tiny_checkpoint_factory("llama")
    draft = _copy_checkpoint(tiny_checkpoint_factory("llama"), tmp_path / "draft")
    change(draft)
    out = tmp_path / "bundle"
    opts = ExportOptions(target=str(target), draft=str(draft), out=str(out), max_seq=32)
    with pytest.raises(UserError, match="tokenizer differs") as e:
        export_bundle(opts)
    msg = str(e.value)
    assert "\n" not in msg and "same vocabulary" in msg
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["draft"]


class _Reached(Exception):
    pass


def test_draft_with_padded_embedding_rows_is_accepted(tiny_checkpoint_factory, tmp_path, monkeypatch):
    """A draft whose embedding (and logits) has rows beyond the tokenizer's vocabulary, as many
    real checkpoints pad to a multiple of 64: same tokenizer, so accepted. (The export is stopped
    where graphs would be traced: every check on the sources has passed by then.)"""
    from specedge.export import sources
    from specedge.export.testing import tiny_tokenizer
    from specedge.models.testing import tiny_config, tiny_hf_model

    target = tiny_checkpoint_factory("llama")
    cfg = tiny_config("llama")
    tok = tiny_tokenizer(cfg.vocab_size)
    cfg.vocab_size += 64
    cfg.bos_token_id, cfg.eos_token_id = tok.convert_tokens_to_ids("<s>"), tok.convert_tokens_to_ids("</s>")
    draft = tmp_path / "padded-draft"
    tiny_hf_model("llama", seed=1, config=cfg).save_pretrained(str(draft))
    tok.save_pretrained(str(draft))
    seen = []

    def reached(tmp, role, ckpt, *a, **kw):
        seen.append((role, ckpt.config.vocab_size))
        raise _Reached()

    monkeypatch.setattr(pipeline, "_export_one", reached)
    out = tmp_path / "out" / "bundle"
    with pytest.raises(_Reached):
        export_bundle(
            ExportOptions(target=str(target), draft=str(draft), out=str(out), max_seq=32, draft_precision="fp32")
        )
    assert seen == [("target", 256)]
    assert not out.exists() and list(out.parent.iterdir()) == []
    # The rule itself: padding rows are fine, fewer rows than the tokenizer are not.
    t = sources.load(str(target)).tokenizer
    sources.check_same_tokenizer(t, tok, 256, 320)
    with pytest.raises(UserError, match="fewer rows"):
        sources.check_same_tokenizer(t, tok, 256, 200)


# ----------------------------------------------------------------------------- precisions


def test_fp16_graph_and_manifest(tiny_bundle_factory):
    bundle = _fp16(tiny_bundle_factory)
    m = load_manifest(bundle)
    t = m.target
    assert (t.precision, t.kv_dtype, t.extra["weights"]) == ("fp16", "float16", "fp16")
    assert all(s.dtype == "float16" for s in t.inputs + t.outputs if s.name.startswith(("past_", "present_")))
    assert next(s for s in t.outputs if s.name == "logits").dtype == "float32"
    for g in t.graphs:
        proto = onnx.load(str(m.path(g.path)), load_external_data=False)
        kinds = {v.name: v.type.tensor_type.elem_type for v in list(proto.graph.input) + list(proto.graph.output)}
        assert kinds["past_key.0"] == kinds["present_value.0"] == onnx.TensorProto.FLOAT16
        assert kinds["logits"] == onnx.TensorProto.FLOAT
    # fp16 weights are about half the bytes of fp32 ones.
    fp32 = load_manifest(tiny_bundle_factory())
    assert 0.4 < t.weight_bytes / fp32.target.weight_bytes < 0.6
    # ORT CPU runs these graphs too (fp16 is meant for GPUs): close to the fp32 module.
    model = _torch_model(t.source, m.kv_mode)
    cache16 = [c.astype(np.float16) for c in _noise_cache(t, m.max_seq)]
    ids = np.random.default_rng(5).integers(3, t.vocab_size, (1, CHUNK)).astype(np.int64)
    ref, _ = TorchDriver(model, m.kv_mode, [c.astype(np.float32) for c in cache16]).step(ids, 0)
    for g in t.graphs:
        try:
            got, kv = OrtDriver(m.path(g.path), t, m.kv_mode, cache16).step(ids, 0)
        except Exception as e:  # pragma: no cover - depends on the ORT build
            pytest.fail(f"ORT CPU cannot run the fp16 {g.flavour} graph: {e}")
        assert got.dtype == np.float32 and kv[0].dtype == np.float16
        d = float(np.abs(got - ref).max())
        MAX_DIFF[f"logits llama scatter {g.flavour} fp16 vs fp32 module"] = d
        assert d <= 0.02 * float(np.abs(ref).max()), f"fp16 {g.flavour} graph: max |Δ| {d:.3f}"


def test_int8_draft_matches_quantized_module(tiny_bundle_factory):
    _quantized_check(_both(tiny_bundle_factory), "draft", 8)


def test_int4_and_int8_weight_bytes(tiny_bundle_factory):
    fp32 = load_manifest(tiny_bundle_factory())
    i8 = load_manifest(_both(tiny_bundle_factory))
    r4 = fp32.draft.weight_bytes / fp32.target.weight_bytes
    r8 = i8.draft.weight_bytes / fp32.target.weight_bytes
    assert r4 < r8 < 0.5, (r4, r8)
