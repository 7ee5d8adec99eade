"""specedge's own int4 CPU kernel ai.specedge.MatMulQ41 (cpp/ops/specedge_ops.cpp, libspecedge_ops.so):
its arithmetic against the numpy reference, the packing, batch invariance (a row's bits do not
depend on how many rows a call has: exact speculation needs it), the AVX-512 and portable paths
giving the same bits, the export rewrite and the manifest field. The library is built with the C++
runtime (scripts/test.sh); without it the tests that run the op skip with that reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_gguf_exact import Q4_0, Q4_1, Q8_0, dequant, matmul_model, rand_raw, rel_err, write_gguf

from specedge import custom_ops
from specedge.export import gguf_exact as ge
from specedge.export import specedge_kernel as sk
from specedge.export.quantize import describe, quantize_weights

K = 512


def _lib() -> Path | None:
    try:
        return custom_ops.library_path()
    except custom_ops.CustomOpsError:
        return None


needs_lib = pytest.mark.skipif(_lib() is None, reason="libspecedge_ops.so not built (cmake --build cpp/build)")


@pytest.fixture
def rng():
    return np.random.default_rng(4321)


def random_q41(rng, n: int, k: int, zero_block: bool = False):
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    d = rng.uniform(0.002, 0.02, size=(n, k // 32)).astype(np.float16).astype(np.float32)
    m = -rng.uniform(0.0, 0.15, size=(n, k // 32)).astype(np.float16).astype(np.float32)
    if zero_block:
        d[:, 0], m[:, 0] = 0, 0
    return codes, d, m


def q41_model(packed: np.ndarray, k: int) -> onnx.ModelProto:
    n = packed.shape[0] * sk.ROWS
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, "T", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", n])
    node = helper.make_node(sk.OP, ["a", "w"], ["y"], domain=sk.DOMAIN, name="q41")
    g = helper.make_graph([node], "g", [a], [y], [numpy_helper.from_array(packed, "w")])
    return helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(sk.DOMAIN, 1)], ir_version=10
    )


def session(proto: onnx.ModelProto, threads: int = 2):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    custom_ops.register(so, sk.custom_op_libraries(proto))
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_pack_unpack_roundtrip_and_refusals(rng):
    codes, d, m = random_q41(rng, 48, 96)
    packed = sk.pack_q41(codes, d, m)
    assert packed.shape == (3, 3, sk.BLOCK_BYTES) and packed.dtype == np.uint8
    c2, d2, m2 = sk.unpack_q41(packed)
    assert np.array_equal(c2, codes) and np.array_equal(d2, d) and np.array_equal(m2, m)
    assert sk.pack_q41(codes[:40], d[:40], m[:40]) is None  # N not a multiple of 16
    inexact = d.copy()
    inexact[0, 0] = 0.1  # fp16 does not hold 0.1 exactly
    assert sk.pack_q41(codes, inexact, m) is None
    assert sk.pack_q41(codes, d, m[:, :2]) is None


@needs_lib
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (80, 1536)])
@pytest.mark.parametrize("t", [1, 2, 5])
def test_matmulq41_matches_the_reference(rng, n, k, t):
    codes, d, m = random_q41(rng, n, k, zero_block=k > 32)  # a zero block (d = m = 0) beside others
    packed = sk.pack_q41(codes, d, m)
    a = rng.normal(size=(1, t, k)).astype(np.float32)
    a[0, 0, k - 32 :] = 0 if k > 32 else a[0, 0, k - 32 :]  # an all-zero activation block: scale 0, no division by it
    got = session(q41_model(packed, k)).run(["y"], {"a": a})[0]
    want = sk.reference(a, packed)
    assert got.shape == (1, t, n)
    assert rel_err(got, want.astype(np.float64)) <= 1e-5
    # and close to the fp32 weight itself (int8 activations lose ~1e-2 at most)
    w = codes.astype(np.float32) * np.repeat(d, 32, axis=1) + np.repeat(m, 32, axis=1)
    assert rel_err(got, a.astype(np.float64) @ w.T.astype(np.float64)) <= 2e-2


def rows_of_one_row_calls(proto: onnx.ModelProto, a: np.ndarray) -> np.ndarray:
    """The bits of each row of `a` [1, 17, K] computed alone, after asserting that row i of every
    T-row call (T = 1..17), with one thread or two, has those bits."""
    for threads in (1, 2):
        s = session(proto, threads)
        ones = [s.run(["y"], {"a": a[:, i : i + 1]})[0][0, 0].view(np.uint32) for i in range(a.shape[1])]
        for t in range(1, a.shape[1] + 1):
            full = s.run(["y"], {"a": a[:, :t]})[0]
            for i in range(t):
                assert np.array_equal(ones[i], full[0, i].view(np.uint32)), (threads, t, i)
    return np.stack(ones)


ROWS_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_specedge_ops import q41_model, random_q41, rows_of_one_row_calls
from specedge import custom_ops
from specedge.export import specedge_kernel as sk
rng = np.random.default_rng(4321)
codes, d, m = random_q41(rng, 576, 576)
rows_of_one_row_calls(q41_model(sk.pack_q41(codes, d, m), 576), rng.normal(size=(1, 17, 576)).astype(np.float32))
print(custom_ops.isa())
"""


def run_on_path(script: str, isa: str, **fmt) -> str:
    """`script` in a fresh interpreter whose kernels take path `isa` ("native": the widest this CPU
    has; a path it lacks falls back to the widest it has); returns its last line of output."""
    env = dict(os.environ)
    env.pop("SPECEDGE_OPS_ISA", None)
    if isa != "native":
        env["SPECEDGE_OPS_ISA"] = isa
    p = subprocess.run(
        [sys.executable, "-c", script.format(tests=str(Path(__file__).parent), **fmt)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return (p.stdout.strip().splitlines() or [""])[-1]


@needs_lib
@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
def test_rows_do_not_depend_on_the_batch(isa):
    """Batch invariance: row i of a T-row call has the bits of the same row alone (T=1), for
    T = 1..17, with one thread or two, on every path: greedy speculation on an int4 target equals
    target-only decoding because of it (aarch64's path: tests/test_ops_aarch64.py)."""
    ran = run_on_path(ROWS_SCRIPT, isa)
    if isa == "portable":
        assert ran == "portable"


ISA_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_specedge_ops import q41_model, random_q41, session
from specedge.export import specedge_kernel as sk
rng = np.random.default_rng(7)
codes, d, m = random_q41(rng, 96, 1536)
a = rng.normal(size=(1, 5, 1536)).astype(np.float32)
y = session(q41_model(sk.pack_q41(codes, d, m), 1536)).run(["y"], {{"a": a}})[0]
np.save({out!r}, y)
"""


@needs_lib
def test_vector_and_portable_paths_give_the_same_bits(tmp_path):
    native = custom_ops.isa()
    assert native in ("avx512vnni", "avx2", "neondot", "portable")
    outs = {}
    for isa in ("native", "avx2", "portable"):  # avx2 on an AVX-512 CPU; any path it lacks falls back
        out = tmp_path / f"{isa}.npy"
        run_on_path(ISA_SCRIPT, isa, out=str(out))
        outs[isa] = np.load(out)
    for isa in ("avx2", "portable"):
        assert np.array_equal(outs["native"].view(np.uint32), outs[isa].view(np.uint32)), (native, isa)


def test_rewrite_uses_the_kernel_for_q41_weights_only(rng, tmp_path):
    q41, q40, q80 = rand_raw(Q4_1, 48, K, rng), rand_raw(Q4_0, 32, K, rng), rand_raw(Q8_0, 16, K, rng)
    path = write_gguf(tmp_path / "w.gguf", {"a": (Q4_1, q41), "b": (Q4_0, q40), "c": (Q8_0, q80)})
    weights = {"a": dequant(Q4_1, q41).T, "b": dequant(Q4_0, q40).T, "c": dequant(Q8_0, q80).T}
    proto = matmul_model(weights)
    rep = ge.rewrite_exact(proto, ge.GGUFRowIndex(path), 4, accuracy_level=4, kernel="specedge")
    assert rep.exact == 3 and rep.kernel_matmuls == 1
    assert rep.to_json()["specedge_kernel_matmuls"] == 1
    ops = [(nd.domain, nd.op_type) for nd in proto.graph.node]
    assert ops.count((sk.DOMAIN, sk.OP)) == 1 and ops.count(("com.microsoft", "MatMulNBits")) == 2
    assert "ReduceSum" not in [o for _, o in ops]  # no block-min correction left
    assert sk.custom_op_libraries(proto) == [custom_ops.LIBRARY]
    assert any(o.domain == sk.DOMAIN for o in proto.opset_import)
    with pytest.raises(ValueError, match="kernel must be one of matmulnbits, specedge, got 'fast'"):
        ge.rewrite_exact(matmul_model(weights), ge.GGUFRowIndex(path), 4, accuracy_level=4, kernel="fast")
    if _lib() is not None:
        x = rng.normal(size=(1, 3, K)).astype(np.float32)
        names = ["y_a", "y_b", "y_c"]
        outs = dict(zip(names, session(proto).run(names, {"x": x})))
        for name, w in weights.items():
            assert rel_err(outs[f"y_{name}"][0], x[0].astype(np.float64) @ w.astype(np.float64)) <= 2e-2


def test_quantize_weights_counts_and_describes_kernel_matmuls(rng, tmp_path):
    q41 = rand_raw(Q4_1, 48, K, rng)
    path = write_gguf(tmp_path / "w.gguf", {"a": (Q4_1, q41)})
    info: dict = {}
    proto = quantize_weights(matmul_model({"a": dequant(Q4_1, q41).T}), 4, gguf=str(path), info=info, kernel="specedge")
    assert [nd.op_type for nd in proto.graph.node] == [sk.OP]
    assert info["method"] == "gguf-exact" and info["exact_matmuls"] == 1 and info["requantized_matmuls"] == 0
    assert info["specedge_kernel_matmuls"] == 1
    assert "1 run by the specedge int4 kernel MatMulQ41" in describe("int4", info)


def test_manifest_custom_ops_field(tiny_bundle_factory, tmp_path):
    from specedge.manifest import BundleError, load_manifest

    src = tiny_bundle_factory(draft="ngram")
    data = json.loads((src / "manifest.json").read_text())
    g = data["models"]["target"]["graphs"][0]
    assert "custom_ops" not in g  # absent unless a graph needs a library
    bundle = tmp_path / "b"
    shutil.copytree(src, bundle)

    def load(value):
        g["custom_ops"] = value
        (bundle / "manifest.json").write_text(json.dumps(data))
        return load_manifest(bundle, verify="none")

    m = load(["specedge_ops"])
    assert m.target.graphs[0].custom_ops == ["specedge_ops"]
    assert m.target.graphs[0].to_json()["custom_ops"] == ["specedge_ops"]
    with pytest.raises(BundleError, match="'custom_ops' in models.target.graphs must be a list of library names"):
        load("specedge_ops")
    with pytest.raises(BundleError, match="names 'libevil', which this specedge does not provide"):
        load(["libevil"])


def test_a_missing_library_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(custom_ops.ENV, str(tmp_path / "nowhere.so"))
    with pytest.raises(
        custom_ops.CustomOpsError,
        match="libspecedge_ops.so was not found .*nowhere.so.*re-export the bundle without --int4-kernel specedge",
    ):
        custom_ops.library_path()
    import onnxruntime as ort

    with pytest.raises(custom_ops.CustomOpsError, match="needs custom-op library 'other'"):
        custom_ops.register(ort.SessionOptions(), ["other"])
    bad = tmp_path / "bad.so"
    bad.write_bytes(b"not a library")
    monkeypatch.setenv(custom_ops.ENV, str(bad))
    with pytest.raises(custom_ops.CustomOpsError, match="cannot load the custom-op library .*bad.so"):
        custom_ops.register(ort.SessionOptions(), [custom_ops.LIBRARY])


def test_cli_refuses_the_kernel_without_an_int4_graph(tiny_checkpoint_factory, tmp_path):
    p = subprocess.run(
        [
            "export-models",
            "--target",
            str(tiny_checkpoint_factory()),
            "--draft",
            "ngram",
            "--int4-kernel",
            "specedge",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        "error: --int4-kernel specedge applies to int4 graphs, and this export has none: add --precision int4 "
        "(or a self-draft with --draft-precision int4)"
    )
    assert not (tmp_path / "o").exists()


CPP_GENERATE = (
    Path(os.environ.get("SPECEDGE_CPP_BUILD", Path(__file__).resolve().parents[1] / "cpp" / "build"))
    / "specedge_generate"
)


@pytest.mark.skipif(not CPP_GENERATE.is_file(), reason=f"C++ runtime not built ({CPP_GENERATE})")
def test_cpp_runtime_reads_custom_ops_and_loads_the_library(tiny_bundle_factory, tmp_path):
    """The C++ runtime follows the same manifest rules: it loads the named library (found beside
    libspecedge or at $SPECEDGE_OPS_LIB), refuses unknown ones and says how to get a missing one."""
    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle_factory(draft="ngram"), bundle)
    data = json.loads((bundle / "manifest.json").read_text())

    def generate(value, env_lib=None):
        data["models"]["target"]["graphs"][0]["custom_ops"] = value
        (bundle / "manifest.json").write_text(json.dumps(data))
        env = {k: v for k, v in os.environ.items() if k != custom_ops.ENV}
        if env_lib:
            env[custom_ops.ENV] = env_lib
        return subprocess.run(
            [str(CPP_GENERATE), str(bundle), "def add(a, b):", "--max-new-tokens", "4", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )

    ok = generate(["specedge_ops"])
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["token_ids"]) >= 1
    bad = generate(["libevil"])
    assert bad.returncode != 0 and "names 'libevil', which this specedge does not provide" in bad.stderr
    bad = generate("specedge_ops")
    assert bad.returncode != 0 and "'custom_ops' in models.target.graphs must be a list of library names" in bad.stderr
    missing = generate(["specedge_ops"], env_lib=str(tmp_path / "nowhere.so"))
    assert missing.returncode != 0
    assert "libspecedge_ops.so was not found (looked at " + str(tmp_path / "nowhere.so") in missing.stderr
    assert "re-export the bundle without --int4-kernel specedge" in missing.stderr


@pytest.mark.slow
@needs_lib
def test_default_model_with_the_kernel_is_exact_and_cpp_agrees(tmp_path):
    """The real default model exported with --int4-kernel specedge: every Q4_1 weight runs in
    MatMulQ41 and every attention layer in specedge's batch-invariant GroupQueryAttention, so the
    pipeline runs plain single-token steps, greedy speculation (n-gram) equals target-only
    decoding, and the C++ runtime gives Python's tokens."""
    from specedge.runtime.api import load

    out = tmp_path / "q41"
    p = subprocess.run(
        [
            "export-models",
            "--precision",
            "int4",
            "--draft",
            "ngram",
            "--int4-kernel",
            "specedge",
            "--out",
            str(out),
            "--quiet",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr
    m = json.loads((out / "manifest.json").read_text())
    g = m["models"]["target"]["graphs"][0]
    assert g["custom_ops"] == ["specedge_ops"] and g["backends"] == ["ort-cpu"]
    assert (
        m["models"]["target"]["quantization"]["specedge_kernel_matmuls"] == 30 * 4
    )  # q|k|v, o, gate|up, down per layer
    assert m["models"]["target"]["quantization"]["specedge_attention"] == 30 and g["batch_invariant"] is True
    prompts = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea."]
    with load(out, threads=2) as pipe:
        assert not pipe.describe()["target"].get("invariant_steps")  # confirmed at load: unpadded steps
        spec = [pipe.generate(q, max_new_tokens=32, speculative=True).token_ids for q in prompts]
        plain = [pipe.generate(q, max_new_tokens=32, speculative=False).token_ids for q in prompts]
    assert spec == plain
    if CPP_GENERATE.is_file():
        for q, ids in zip(prompts, spec):
            r = subprocess.run(
                [str(CPP_GENERATE), str(out), q, "--json", "--max-new-tokens", "32", "--threads", "2"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["token_ids"] == ids, q
