"""specedge's batch-invariant attention, ai.specedge.GroupQueryAttention (cpp/ops/gqa_attention.cpp):
the same results as ONNX Runtime's com.microsoft GroupQueryAttention on every input form specedge's
graphs use (packed or separate q/k/v, rotary or not, sliding window, tree calls), rows whose bits
do not depend on the call's T (what lets single-token steps run unpadded and stay exact), the
AVX-512 and portable paths giving the same bits, the export swap and the manifest's
`batch_invariant`, and exact greedy speculation with unpadded steps on tiny bundles of every
family. The library is built with the C++ runtime (scripts/test.sh); without it the tests that run
the op skip with that reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specedge import custom_ops
from specedge.export import specedge_kernel as sk

B, H, KVH, D, S = 1, 6, 2, 32, 40


def _lib() -> Path | None:
    try:
        return custom_ops.library_path()
    except custom_ops.CustomOpsError:
        return None


needs_lib = pytest.mark.skipif(_lib() is None, reason="libspecedge_ops.so not built (cmake --build cpp/build)")


def gqa_model(
    domain: str, packed: bool, rotary: bool, window: int = -1, tree: bool = False, d: int = D, softcap: float = 0.0
) -> onnx.ModelProto:
    f, i32, i64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
    vi = helper.make_tensor_value_info
    width = (H + 2 * KVH) * d if packed else H * d
    ins = [vi("query", f, [B, "T", width])]
    if not packed:
        ins += [vi("key", f, [B, "T", KVH * d]), vi("value", f, [B, "T", KVH * d])]
    ins += [
        vi("past_key", f, [B, KVH, S, d]),
        vi("past_value", f, [B, KVH, S, d]),
        vi("seqlens_k", i32, [B]),
        vi("total_sequence_length", i32, []),
    ]
    inits = []
    if rotary:
        pos = np.arange(S, dtype=np.float32)[:, None]
        inv = 1.0 / (10000 ** (np.arange(0, d // 2, dtype=np.float32) / (d // 2)))
        inits = [
            numpy_helper.from_array(np.cos(pos * inv).astype(np.float32), "cos_cache"),
            numpy_helper.from_array(np.sin(pos * inv).astype(np.float32), "sin_cache"),
        ]
    if tree:
        ins += [vi("position_ids", i64, [B, "T"]), vi("attention_bias", f, [B, 1, "T", "total"])]
    node_in = [
        "query",
        "" if packed else "key",
        "" if packed else "value",
        "past_key",
        "past_value",
        "seqlens_k",
        "total_sequence_length",
        "cos_cache" if rotary else "",
        "sin_cache" if rotary else "",
        "position_ids" if tree else "",
        "attention_bias" if tree else "",
    ]
    while node_in[-1] == "":
        node_in.pop()
    node = helper.make_node(
        "GroupQueryAttention",
        node_in,
        ["output", "present_key", "present_value"],
        domain=domain,
        num_heads=H,
        kv_num_heads=KVH,
        scale=float(d) ** -0.5,
        local_window_size=window,
        softcap=softcap,
        do_rotary=int(rotary),
        rotary_interleaved=0,
    )
    outs = [
        vi("output", f, [B, "T", H * d]),
        vi("present_key", f, [B, KVH, S, d]),
        vi("present_value", f, [B, KVH, S, d]),
    ]
    g = helper.make_graph([node], "gqa", ins, outs, inits)
    return helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)], ir_version=10
    )


class Runner:
    """One session with past and present bound to the same numpy buffers, as the runtimes bind them."""

    def __init__(self, proto: onnx.ModelProto, d: int = D):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        so.log_severity_level = 3
        custom_ops.register(so, sk.custom_op_libraries(proto))
        self.s = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.names = {i.name for i in self.s.get_inputs()}
        self.k = np.zeros((B, KVH, S, d), np.float32)
        self.v = np.zeros((B, KVH, S, d), np.float32)

    def run(self, feeds: dict, position: int, t: int) -> np.ndarray:
        b = self.s.io_binding()
        feeds = {
            **feeds,
            "seqlens_k": np.array([position + t - 1], np.int32),
            "total_sequence_length": np.array(position + t, np.int32),
        }
        for name, x in feeds.items():
            if name in self.names:
                b.bind_cpu_input(name, np.ascontiguousarray(x))
        for name, a in (("key", self.k), ("value", self.v)):
            b.bind_input(f"past_{name}", "cpu", 0, np.float32, a.shape, a.ctypes.data)
            b.bind_output(f"present_{name}", "cpu", 0, np.float32, a.shape, a.ctypes.data)
        out = np.zeros((B, t, H * self.k.shape[-1]), np.float32)
        b.bind_output("output", "cpu", 0, np.float32, out.shape, out.ctypes.data)
        self.s.run_with_iobinding(b)
        return out


def qkv(rng, t: int, packed: bool, d: int = D) -> dict:
    q = rng.normal(size=(B, t, H * d)).astype(np.float32)
    k = rng.normal(size=(B, t, KVH * d)).astype(np.float32)
    v = rng.normal(size=(B, t, KVH * d)).astype(np.float32)
    return {"query": np.concatenate([q, k, v], -1)} if packed else {"query": q, "key": k, "value": v}


def tree_feeds(position: int, t: int, chain: bool = False) -> dict:
    # a chain (the lower triangle, as a prefill binds it), or a binary tree: node i's parent is (i - 1) // 2
    anc = np.eye(t, dtype=bool)
    for i in range(1, t):
        anc[i] |= anc[i - 1 if chain else (i - 1) // 2]
    depth = anc.sum(1) - 1
    bias = np.zeros((B, 1, t, position + t), np.float32)
    bias[0, 0, :, position:] = np.where(anc, 0.0, -np.inf)
    return {"position_ids": (position + depth)[None].astype(np.int64), "attention_bias": bias}


@needs_lib
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("window", [-1, 7])
def test_same_results_as_onnxruntime_gqa(packed, rotary, window):
    rng = np.random.default_rng(11)
    ours, ref = (Runner(gqa_model(dom, packed, rotary, window)) for dom in (sk.DOMAIN, "com.microsoft"))
    position = 0
    for t in (9, 1, 1, 4, 1, 6, 1):  # a prefill, steps, verifications
        feeds = qkv(rng, t, packed)
        a, b = ours.run(feeds, position, t), ref.run(feeds, position, t)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
        position += t
    np.testing.assert_allclose(ours.k[:, :, :position], ref.k[:, :, :position], rtol=1e-6, atol=1e-6)
    assert np.array_equal(ours.v, ref.v)


@needs_lib
def test_tree_calls_match_onnxruntime_gqa():
    rng = np.random.default_rng(12)
    ours, ref = (Runner(gqa_model(dom, True, True, tree=True)) for dom in (sk.DOMAIN, "com.microsoft"))
    position = 0
    for t, chain in ((8, True), (1, False), (7, False), (5, False), (6, True)):
        feeds = {**qkv(rng, t, True), **tree_feeds(position, t, chain)}
        np.testing.assert_allclose(ours.run(feeds, position, t), ref.run(feeds, position, t), rtol=2e-5, atol=2e-6)
        position += t


ROWS_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_specedge_attention import Runner, gqa_model, qkv
from specedge import custom_ops
from specedge.export import specedge_kernel as sk
rng = np.random.default_rng(13)
model = gqa_model(sk.DOMAIN, True, True, {window})
batched, single = Runner(model), Runner(model)
prefix = qkv(rng, 10, True)
for t in range(1, 18):
    for r in (batched, single):
        r.k[:], r.v[:] = 0, 0
        r.run(prefix, 0, 10)
    tokens = qkv(rng, t, True)
    rows = batched.run(tokens, 10, t)
    for j in range(t):
        one = single.run({{"query": tokens["query"][:, j:j + 1]}}, 10 + j, 1)
        assert np.array_equal(one[0, 0].view(np.uint32), rows[0, j].view(np.uint32)), (t, j)
    assert np.array_equal(batched.k, single.k) and np.array_equal(batched.v, single.v), t
print(custom_ops.isa())
"""


@needs_lib
@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("window", [-1, 5])
def test_rows_do_not_depend_on_how_many_tokens_a_call_has(window, isa):
    """Row j of a T-token call at position p has, bit for bit, the output of a single-token call
    at p + j after the same earlier tokens (the property exact unpadded speculation needs), for
    T = 1..17 on every path (aarch64's: tests/test_ops_aarch64.py)."""
    from test_specedge_ops import run_on_path

    ran = run_on_path(ROWS_SCRIPT, isa, window=window)
    if isa == "portable":
        assert ran == "portable"


@needs_lib
def test_present_not_sharing_past_gets_a_copy_first():
    """Bound as the contract says, present is past's memory; a caller that lets ONNX Runtime
    allocate present still gets the whole cache with the new entries written."""
    import onnxruntime as ort

    rng = np.random.default_rng(14)
    model = gqa_model(sk.DOMAIN, True, True)
    so = ort.SessionOptions()
    custom_ops.register(so, [custom_ops.LIBRARY])
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    past_k = rng.normal(size=(B, KVH, S, D)).astype(np.float32)
    past_v = rng.normal(size=(B, KVH, S, D)).astype(np.float32)
    feeds = qkv(rng, 3, True)
    out, pk, pv = s.run(
        None,
        {
            **feeds,
            "past_key": past_k,
            "past_value": past_v,
            "seqlens_k": np.array([12], np.int32),
            "total_sequence_length": np.array(13, np.int32),
        },
    )
    r = Runner(model)
    r.k[:], r.v[:] = past_k, past_v
    assert np.array_equal(out, r.run(feeds, 10, 3))
    assert np.array_equal(pk, r.k) and np.array_equal(pv, r.v)
    assert np.array_equal(pk[:, :, :10], past_k[:, :, :10]) and np.array_equal(pk[:, :, 13:], past_k[:, :, 13:])


ISA_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_specedge_attention import Runner, gqa_model, qkv, tree_feeds
from specedge.export import specedge_kernel as sk
rng = np.random.default_rng(15)
r = Runner(gqa_model(sk.DOMAIN, True, True, tree=True))
outs = [r.run({{**qkv(rng, t, True), **tree_feeds(p, t, p == 0)}}, p, t) for p, t in ((0, 23), (23, 1), (24, 5))]
np.save({out!r}, np.concatenate([o.reshape(-1) for o in outs] + [r.k.reshape(-1), r.v.reshape(-1)]))
"""


@needs_lib
def test_vector_and_portable_paths_give_the_same_bits(tmp_path):
    from test_specedge_ops import run_on_path

    outs = {}
    for isa in ("native", "avx2", "portable"):  # avx2 on an AVX-512 CPU; any path it lacks falls back
        out = tmp_path / f"{isa}.npy"
        run_on_path(ISA_SCRIPT, isa, out=str(out))
        outs[isa] = np.load(out)
    for isa in ("avx2", "portable"):
        assert np.array_equal(outs["native"].view(np.uint32), outs[isa].view(np.uint32)), (custom_ops.isa(), isa)


@needs_lib
@pytest.mark.parametrize(
    "bad,message", [({"softcap": 30.0}, "softcap is not supported"), ({"d": 24}, "head size must be a multiple of 16")]
)
def test_unsupported_nodes_are_refused_with_the_reason(bad, message):
    d = bad.get("d", D)
    with pytest.raises(Exception, match=message):  # at session creation (attributes) or the first run (shapes)
        r = Runner(gqa_model(sk.DOMAIN, True, False, d=d, softcap=bad.get("softcap", 0.0)), d=d)
        r.run(qkv(np.random.default_rng(0), 2, True, d=d), 0, 2)


@needs_lib
def test_tokens_outside_the_cache_are_refused():
    r = Runner(gqa_model(sk.DOMAIN, True, False))
    with pytest.raises(Exception, match="seqlens_k puts the new tokens outside the cache"):
        r.run(qkv(np.random.default_rng(0), 3, True), S - 1, 3)


def test_the_export_swap_takes_only_supported_nodes():
    ok = gqa_model("com.microsoft", True, True)
    assert sk.use_specedge_attention(ok) == 1 and ok.graph.node[0].domain == sk.DOMAIN
    assert any(o.domain == sk.DOMAIN for o in ok.opset_import)
    for model in (gqa_model("com.microsoft", True, True, d=24), gqa_model("com.microsoft", True, True, softcap=5.0)):
        assert sk.use_specedge_attention(model) == 0 and model.graph.node[0].domain == "com.microsoft"


def test_batch_invariance_is_judged_by_the_ops():
    assert not sk.batch_invariant(gqa_model("com.microsoft", True, True))
    assert sk.batch_invariant(gqa_model(sk.DOMAIN, True, True))

    def with_node(node):
        m = gqa_model(sk.DOMAIN, True, True)
        m.graph.node.append(node)
        return m

    assert not sk.batch_invariant(with_node(helper.make_node("MatMul", ["output", "w"], ["y"])))
    nbits = dict(K=64, N=64, bits=4, block_size=32)
    assert sk.batch_invariant(
        with_node(
            helper.make_node(
                "MatMulNBits", ["output", "w", "s"], ["y"], domain="com.microsoft", accuracy_level=4, **nbits
            )
        )
    )
    assert not sk.batch_invariant(
        with_node(
            helper.make_node(
                "MatMulNBits", ["output", "w", "s"], ["y"], domain="com.microsoft", accuracy_level=0, **nbits
            )
        )
    )


def test_manifest_batch_invariant_field(tiny_bundle_factory, tmp_path):
    from specedge.manifest import BundleError, load_manifest

    src = tiny_bundle_factory(draft="ngram")
    data = json.loads((src / "manifest.json").read_text())
    g = data["models"]["target"]["graphs"][0]
    assert "batch_invariant" not in g  # an fp32 graph (MatMul, ONNX Runtime's attention) is not
    bundle = tmp_path / "b"
    shutil.copytree(src, bundle)

    def load(value):
        g["batch_invariant"] = value
        (bundle / "manifest.json").write_text(json.dumps(data))
        return load_manifest(bundle, verify="none")

    assert load(True).target.graphs[0].batch_invariant is True
    assert load(True).target.graphs[0].to_json()["batch_invariant"] is True
    assert load(False).target.graphs[0].to_json().get("batch_invariant") is None
    with pytest.raises(BundleError, match="'batch_invariant' in models.target.graphs must be true or false, got 'yes'"):
        load("yes")


class _Rows:
    """A backend stand-in whose single-token row differs from a two-token call's row 0 or not."""

    max_seq = 8

    def __init__(self, differ: bool):
        self.differ = differ

    def run(self, ids, position):
        out = np.tile(np.arange(4, dtype=np.float32), (len(ids), 1))
        if self.differ and len(ids) == 1:
            out[0, 0] = np.nextafter(np.float32(0), np.float32(1))
        return out


def test_rows_independent_of_t_compares_bits():
    from specedge.runtime.invariant import rows_independent_of_t

    assert rows_independent_of_t(_Rows(False))
    assert not rows_independent_of_t(_Rows(True))  # one ulp is a difference


@needs_lib
@pytest.mark.parametrize("family", ["llama", "mistral", "phi3", "qwen2", "qwen3", "gemma3"])
def test_tiny_int4_bundles_step_unpadded_and_stay_exact(tiny_bundle_factory, family):
    """--int4-kernel specedge on a tiny int4 target of every family: every attention layer runs
    on specedge's op, the manifest marks the graph batch-invariant, the pipeline confirms it and
    runs plain single-token steps, whose logits equal verification rows bit for bit, and greedy
    speculation (n-gram) equals target-only output."""
    from specedge.manifest import load_manifest
    from specedge.runtime.api import load
    from specedge.runtime.backends import create_backend

    bundle = tiny_bundle_factory(family=family, precision="int4", draft="ngram", int4_kernel="specedge")
    m = load_manifest(bundle, verify="none")
    g = m.target.graphs[0]
    assert g.batch_invariant and g.custom_ops == [custom_ops.LIBRARY]
    proto = onnx.load(str(bundle / g.path), load_external_data=False)
    assert not any(n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft" for n in proto.graph.node)
    assert (
        sum(n.op_type == "GroupQueryAttention" and n.domain == sk.DOMAIN for n in proto.graph.node)
        == m.target.num_layers
    )
    assert m.target.quantization["specedge_attention"] == m.target.num_layers

    steps, verify = (create_backend("ort-cpu", m, m.target, threads=1) for _ in range(2))
    ids = np.random.default_rng(1).integers(3, m.target.vocab_size, size=40).astype(np.int64)
    steps.run(ids[:20], 0)
    verify.run(ids[:20], 0)
    rows = np.array(verify.run(ids[20:25], 20))
    for j in range(5):
        assert np.array_equal(np.array(steps.run(ids[20 + j : 21 + j], 20 + j))[0], rows[j]), j

    prompts = ["the cat sat on the mat and the cat sat on the", "1 2 3 4 5 6 7 8 1 2 3 4", "hello world, hello"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the load-time check passes: no warning
        pipe = load(bundle, threads=1, verify="none")
    with pipe:
        assert not pipe.describe()["target"].get("invariant_steps")
        for p in prompts:
            want = pipe.generate(p, max_new_tokens=24, speculative=False).token_ids
            assert pipe.generate(p, max_new_tokens=24, speculative=True).token_ids == want, p


def test_a_graph_this_machine_does_not_confirm_keeps_padded_steps(tiny_bundle_factory, tmp_path, monkeypatch):
    """A manifest that marks a graph batch-invariant is checked at load; when this machine's
    kernels disagree, the pipeline warns and pads single-token steps (exactness is kept)."""
    from specedge.runtime import api, invariant

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle_factory(precision="int4", draft="ngram"), bundle)
    data = json.loads((bundle / "manifest.json").read_text())
    data["models"]["target"]["graphs"][0]["batch_invariant"] = True
    (bundle / "manifest.json").write_text(json.dumps(data))
    monkeypatch.setattr(invariant, "rows_independent_of_t", lambda backend: False)
    with pytest.warns(RuntimeWarning, match="marked batch-invariant, but on this machine a single-token call's row"):
        pipe = api.load(bundle, threads=1, verify="none")
    with pipe:
        assert pipe.describe()["target"].get("invariant_steps") is True
    monkeypatch.setattr(invariant, "rows_independent_of_t", lambda backend: True)
    with api.load(bundle, threads=1, verify="none") as pipe:
        assert not pipe.describe()["target"].get("invariant_steps")


CPP_GENERATE = (
    Path(os.environ.get("SPECEDGE_CPP_BUILD", Path(__file__).resolve().parents[1] / "cpp" / "build"))
    / "specedge_generate"
)


@needs_lib
@pytest.mark.skipif(not CPP_GENERATE.is_file(), reason=f"C++ runtime not built ({CPP_GENERATE})")
def test_cpp_runtime_steps_unpadded_with_python_tokens(tiny_bundle_factory, tmp_path):
    """The C++ runtime reads `batch_invariant`, confirms it the same way, and gives Python's
    tokens target-only and speculative; a malformed flag is one clear error."""
    from specedge.runtime.api import load

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle_factory(precision="int4", draft="ngram", int4_kernel="specedge"), bundle)
    prompt = "the cat sat on the mat and the cat sat on the"
    with load(bundle, threads=1, verify="none") as pipe:
        want = pipe.generate(prompt, max_new_tokens=24, speculative=False).token_ids

    def generate(*extra):
        return subprocess.run(
            [str(CPP_GENERATE), str(bundle), prompt, "--max-new-tokens", "24", "--threads", "1", "--json", *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )

    for extra in ((), ("--no-spec",)):
        r = generate(*extra)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == want, extra
        assert "warning" not in r.stderr  # confirmed on this machine: no fallback to padded steps
    data = json.loads((bundle / "manifest.json").read_text())
    data["models"]["target"]["graphs"][0]["batch_invariant"] = "yes"
    (bundle / "manifest.json").write_text(json.dumps(data))
    bad = generate()
    assert bad.returncode != 0
    assert "the manifest's 'batch_invariant' in models.target.graphs must be true or false, got \"yes\"" in bad.stderr


@needs_lib
def test_a_cpu_without_avx2_is_warned_once(monkeypatch):
    """The portable path is ~10x slower: loading the library there warns once, saying what to do;
    asking for it (SPECEDGE_OPS_ISA=portable) does not warn."""
    import onnxruntime as ort

    monkeypatch.delenv("SPECEDGE_OPS_ISA", raising=False)
    monkeypatch.setattr(custom_ops, "isa", lambda path=None: "portable")
    monkeypatch.setattr(custom_ops, "_warned", set())
    with pytest.warns(RuntimeWarning, match="portable path on this CPU .*re-export the bundle without --int4-kernel"):
        custom_ops.register(ort.SessionOptions(), [custom_ops.LIBRARY])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        custom_ops.register(ort.SessionOptions(), [custom_ops.LIBRARY])  # once per library
        monkeypatch.setattr(custom_ops, "_warned", set())
        monkeypatch.setenv("SPECEDGE_OPS_ISA", "portable")
        custom_ops.register(ort.SessionOptions(), [custom_ops.LIBRARY])


@needs_lib
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tree_verification_on_the_batch_invariant_graph_is_exact(tiny_bundle_factory, family):
    """Tree calls (ancestor masks through attention_bias, depths through position_ids) on the
    specedge attention: greedy tree speculation with unpadded steps equals target-only output
    (gemma3: sliding-window layers, whose window the tree bias carries)."""
    from specedge.runtime.api import load

    bundle = tiny_bundle_factory(
        family=family, precision="int4", draft="ngram", max_seq=128, tree=True, int4_kernel="specedge"
    )
    repeats = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 10, 11, 5, 6, 7, 12, 5, 6]
    with load(bundle, threads=1, verify="size") as pipe:
        assert not pipe.describe()["target"].get("invariant_steps")
        want = pipe.generate(token_ids=repeats, max_new_tokens=48, speculative=False).token_ids
        got = pipe.generate(token_ids=repeats, max_new_tokens=48, tree=True, guard=False)
    assert got.token_ids == want
    assert got.stats["target_calls"] < len(want) and got.stats["drafted"] > 0


@needs_lib
def test_inspect_says_how_steps_run_and_where_the_kernels_are(tiny_bundle_factory, monkeypatch):
    from specedge.cli.inspect import format_report
    from specedge.manifest import load_manifest

    bundle = tiny_bundle_factory(precision="int4", draft="ngram", int4_kernel="specedge")
    text = format_report(load_manifest(bundle, verify="none"), str(bundle))
    assert "steps      batch-invariant graph: single-token steps run as 1 token" in text
    assert f"kernels    specedge_ops: {custom_ops.library_path()}, {custom_ops.isa()} path on this CPU" in text
    monkeypatch.setenv(custom_ops.ENV, "/nowhere/libspecedge_ops.so")
    text = format_report(load_manifest(bundle, verify="none"), str(bundle))
    assert (
        "kernels    specedge_ops: libspecedge_ops.so not found here (reinstall specedge where a C++ compiler is "
        "present, or set SPECEDGE_OPS_LIB)"
    ) in text
    plain = format_report(
        load_manifest(tiny_bundle_factory(precision="int4", draft="ngram", int4_kernel="matmulnbits"), verify="none"),
        "b",
    )
    assert "steps      batch-invariant: single-token steps run as 2 tokens" in plain and "kernels" not in plain


def _loose(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph's inputs with every dimension symbolic, so a run can feed any shape."""
    for v in model.graph.input:
        for i, dim in enumerate(v.type.tensor_type.shape.dim):
            dim.Clear()
            dim.dim_param = f"{v.name}_{i}"
    return model


@needs_lib
@pytest.mark.parametrize(
    "bad,message",
    [
        ("key", "key and value must be \\[B, T, kv_heads \\* D\\]"),
        ("past_value", "past_key and past_value must both be \\[B, kv_heads, S, D\\]"),
        ("seqlens_k", "seqlens_k must be \\[B\\]"),
        ("attention_bias", "attention_bias must be \\[B, 1, T, total_sequence_length\\]"),
        ("position_ids", "position_ids must be \\[B, T\\]"),
    ],
)
def test_inconsistent_shapes_from_an_untrusted_graph_are_refused(bad, message):
    """A bundle's graph is untrusted: tensors whose shapes do not match what the op indexes them by
    are refused with the reason, never read out of bounds."""
    import onnxruntime as ort

    rng = np.random.default_rng(16)
    model = _loose(gqa_model(sk.DOMAIN, packed=False, rotary=True, tree=True))
    so = ort.SessionOptions()
    so.log_severity_level = 4
    custom_ops.register(so, [custom_ops.LIBRARY])
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    t, position = 3, 4
    feeds = {
        **qkv(rng, t, packed=False),
        **tree_feeds(position, t, chain=True),
        "past_key": np.zeros((B, KVH, S, D), np.float32),
        "past_value": np.zeros((B, KVH, S, D), np.float32),
        "seqlens_k": np.array([position + t - 1], np.int32),
        "total_sequence_length": np.array(position + t, np.int32),
    }
    s.run(None, feeds)  # consistent: runs
    broken = {
        "key": feeds["key"][:, :, :-16],
        "past_value": feeds["past_value"][:, :, :-1],
        "seqlens_k": np.array([position + t - 1] * 2, np.int32),
        "attention_bias": np.repeat(feeds["attention_bias"], 2, axis=1),
        "position_ids": feeds["position_ids"][:, :-1],
    }[bad]
    with pytest.raises(Exception, match=message):
        s.run(None, {**feeds, bad: np.ascontiguousarray(broken)})


@needs_lib
def test_export_suggests_the_kernels_where_they_are_fast(tiny_checkpoint_factory, tmp_path, capsys, monkeypatch):
    from specedge.cli import export_models

    ckpt = str(tiny_checkpoint_factory())
    args = ["--target", ckpt, "--precision", "int4", "--max-seq", "64"]
    assert export_models.main([*args, "--int4-kernel", "matmulnbits", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    if custom_ops.isa() != "portable":
        assert (
            f"tip: this machine has specedge's int4 kernels ({custom_ops.isa()}): without --int4-kernel "
            "matmulnbits the bundle also gets their graph, which makes the int4 target steps about twice as "
            "fast, and exact without padded steps"
        ) in out
    # the default (auto) writes their graph too; --int4-kernel specedge only theirs
    for extra in (["--quiet"], ["--int4-kernel", "specedge"], ["--int4-kernel", "auto"]):
        assert export_models.main([*args, *extra, "--out", str(tmp_path / extra[-1])]) == 0
        assert "tip:" not in capsys.readouterr().out
    monkeypatch.setattr(custom_ops, "isa", lambda path=None: "portable")  # no fast path: no tip
    assert export_models.main([*args, "--int4-kernel", "matmulnbits", "--out", str(tmp_path / "p")]) == 0
    assert "tip:" not in capsys.readouterr().out
