"""GPU backends: clear errors without their packages, their binding logic on the CPU, GPU checks.

* Every GPU backend's constructor raises a BackendError naming the package to install when it is
  missing (simulated with sys.modules[name] = None where the package happens to be installed).
* The ONNX Runtime backend's buffers, IO binding, in-place scatter and single 2-D delta write are
  exercised on ONNX Runtime's CPU provider (device="cpu") with a toy graph that follows the bundle
  contract, against a numpy reference of the cache.
* The torch backend runs eagerly on the CPU against a full-sequence forward of the same module.
* Tests marked `gpu` need an NVIDIA GPU and skip with the reason "no CUDA GPU" otherwise.
"""

from __future__ import annotations

import hashlib
import json
import sys
import types

import numpy as np
import pytest

from specedge.contract import graph_io
from specedge.manifest import ModelSpec, load_manifest
from specedge.runtime.backends.base import BackendError

L, KVH, HD, S, V = 2, 2, 4, 16, 11


def _cuda_available() -> bool:
    # No NVIDIA driver on the machine: no CUDA GPU, and no need to import torch to find out.
    import os

    if not any(
        os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvhost-ctrl-gpu", "/dev/dxg")
    ):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _cuda_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")


# ----------------------------------------------------------------------------- a toy bundle


def toy_onnx(kv_mode: str, seed: int = 0) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A graph with the bundle contract whose logits depend on every cache tensor with a distinct
    weight, so a mis-bound buffer or a missed cache write changes them:

      new      = E[input_ids] as [1, kvh, T, hd];  new_key.i = new + (i + 1);  new_value.i = 2 new + 10 (i + 1)
      scatter: present_* = TensorScatter(past_*, new_*, position, axis=-2); sums over present_*
      delta:   sums over past_* plus sums over new_*
      logits   = W[input_ids] + sum_i 0.01 (i + 1) sum(K_i) + 0.001 (i + 1) sum(V_i)
    """
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    E = rng.standard_normal((V, KVH * HD)).astype(np.float32)
    W = rng.standard_normal((V, V)).astype(np.float32)
    spec = ModelSpec(role="target", kind="model", num_layers=L, num_kv_heads=KVH, head_dim=HD, vocab_size=V)
    ins, outs = graph_io(spec, kv_mode, S)

    def vi(t):
        dt = {"int64": TP.INT64, "float32": TP.FLOAT}[t.dtype]
        return helper.make_tensor_value_info(t.name, dt, list(t.shape))

    c = lambda name, arr: numpy_helper.from_array(np.asarray(arr), name)  # noqa: E731
    inits = [c("E", E), c("W", W), c("shape", np.array([1, -1, KVH, HD], np.int64)), c("two", np.float32(2))]
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["emb"]),
        helper.make_node("Reshape", ["emb", "shape"], ["emb4"]),
        helper.make_node("Transpose", ["emb4"], ["new"], perm=[0, 2, 1, 3]),
        helper.make_node("Mul", ["new", "two"], ["new2"]),
        helper.make_node("Gather", ["W", "input_ids"], ["base"]),
    ]
    terms = []
    for i in range(L):
        inits += [
            c(f"ck{i}", np.float32(i + 1)),
            c(f"cv{i}", np.float32(10 * (i + 1))),
            c(f"wk{i}", np.float32(0.01 * (i + 1))),
            c(f"wv{i}", np.float32(0.001 * (i + 1))),
        ]
        for kind, src, const, w in (("key", "new", f"ck{i}", f"wk{i}"), ("value", "new2", f"cv{i}", f"wv{i}")):
            newname = f"new_{kind}.{i}" if kv_mode == "delta" else f"upd_{kind}.{i}"
            nodes.append(helper.make_node("Add", [src, const], [newname]))
            if kv_mode == "scatter":
                nodes.append(
                    helper.make_node(
                        "TensorScatter", [f"past_{kind}.{i}", newname, "position"], [f"present_{kind}.{i}"], axis=-2
                    )
                )
                nodes.append(helper.make_node("ReduceSum", [f"present_{kind}.{i}"], [f"s_{kind}{i}"], keepdims=0))
            else:
                nodes.append(helper.make_node("ReduceSum", [f"past_{kind}.{i}"], [f"p_{kind}{i}"], keepdims=0))
                nodes.append(helper.make_node("ReduceSum", [newname], [f"n_{kind}{i}"], keepdims=0))
                nodes.append(helper.make_node("Add", [f"p_{kind}{i}", f"n_{kind}{i}"], [f"s_{kind}{i}"]))
            nodes.append(helper.make_node("Mul", [f"s_{kind}{i}", w], [f"t_{kind}{i}"]))
            terms.append(f"t_{kind}{i}")
    nodes.append(helper.make_node("Sum", terms, ["total"]))
    nodes.append(helper.make_node("Add", ["base", "total"], ["logits"]))
    graph = helper.make_graph(nodes, "toy", [vi(t) for t in ins], [vi(t) for t in outs], initializer=inits)
    # TensorScatter needs opset 24; the delta graph stays in the opsets TensorRT 10.3 documents (9..20), which
    # build-engines checks (tensorrt_ops.json)
    opset = 24 if kv_mode == "scatter" else 20
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="specedge-test")
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model.SerializeToString(), E, W


def write_toy_bundle(root, kv_mode: str = "scatter", k: int = 3, chunk: int = 8):
    data, E, W = toy_onnx(kv_mode)
    root.mkdir(parents=True, exist_ok=True)
    (root / "target").mkdir(exist_ok=True)
    (root / "target" / "model.onnx").write_bytes(data)
    spec = ModelSpec(role="target", kind="model", num_layers=L, num_kv_heads=KVH, head_dim=HD, vocab_size=V)
    ins, outs = graph_io(spec, kv_mode, S)
    manifest = {
        "schema_version": 1,
        "created_by": "test",
        "max_seq": S,
        "batch": 1,
        "kv_mode": kv_mode,
        "spec": {"k": k, "prefill_chunk": chunk},
        "tokenizer": {"vocab_size": V, "eos_token_ids": [0], "bos_token_id": None, "add_bos": False, "files": []},
        "models": {
            "target": {
                "kind": "model",
                "family": "toy",
                "source": "",
                "precision": "fp32",
                "kv_dtype": "float32",
                "num_layers": L,
                "num_kv_heads": KVH,
                "head_dim": HD,
                "hidden_size": KVH * HD,
                "vocab_size": V,
                "num_params": int(E.size + W.size),
                "weight_bytes": int(4 * (E.size + W.size)),
                "graphs": [
                    {
                        "flavour": "portable",
                        "path": "target/model.onnx",
                        "backends": ["ort", "ort-cuda", "ort-trt", "tensorrt"],
                    }
                ],
                "inputs": [t.to_json() for t in ins],
                "outputs": [t.to_json() for t in outs],
            },
            "draft": {"kind": "ngram"},
        },
        "files": {"target/model.onnx": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root, E, W


class ToyReference:
    """numpy model of the toy graph and of the cache the backend should hold."""

    def __init__(self, E, W, kv_mode):
        self.E, self.W, self.kv_mode = E, W, kv_mode
        self.cache = np.zeros((2 * L, 1, KVH, S, HD), np.float64)  # [key 0..L-1, value 0..L-1]

    def run(self, ids, pos):
        t = len(ids)
        new = self.E[ids].reshape(1, t, KVH, HD).transpose(0, 2, 1, 3).astype(np.float64)
        upd = [new + (i + 1) for i in range(L)] + [2 * new + 10 * (i + 1) for i in range(L)]
        if self.kv_mode == "scatter":
            for j in range(2 * L):
                self.cache[j][:, :, pos : pos + t] = upd[j]
            sums = [self.cache[j].sum() for j in range(2 * L)]
        else:
            sums = [self.cache[j].sum() + upd[j].sum() for j in range(2 * L)]
            for j in range(2 * L):
                self.cache[j][:, :, pos : pos + t] = upd[j]
        total = sum(0.01 * (i + 1) * sums[i] + 0.001 * (i + 1) * sums[L + i] for i in range(L))
        return self.W[ids].astype(np.float64) + total


def _drive(backend, ref, calls):
    for ids, pos in calls:
        ids = np.array(ids, dtype=np.int64)
        want = ref.run(ids, pos)
        got = backend.run(ids, pos)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(backend.cache_array(), ref.cache, rtol=1e-6, atol=1e-5)


# A prefill in two chunks, decode steps, a verification of k + 1 = 4 tokens, then a rollback:
# position goes back and stale slots are overwritten.
CALLS = [([1, 2, 3, 4, 5, 6, 7, 8], 0), ([9, 10, 1], 8), ([4], 11), ([5, 6, 7, 8], 12), ([3], 13), ([2, 9], 14)]


# ----------------------------------------------------------------------------- missing packages


def _hide(monkeypatch, *names):
    for n in names:
        monkeypatch.setitem(sys.modules, n, None)


@pytest.fixture
def toy_scatter(tmp_path):
    root, E, W = write_toy_bundle(tmp_path / "b", "scatter")
    return load_manifest(root), E, W


@pytest.fixture
def toy_delta(tmp_path):
    root, E, W = write_toy_bundle(tmp_path / "b", "delta")
    return load_manifest(root), E, W


def test_ort_cuda_without_onnxruntime_names_onnxruntime_gpu(monkeypatch, toy_scatter):
    from specedge.runtime.backends.ort_cuda import OrtCudaBackend, OrtTrtBackend

    m = toy_scatter[0]
    _hide(monkeypatch, "onnxruntime")
    for cls in (OrtCudaBackend, OrtTrtBackend):
        with pytest.raises(BackendError, match=r"needs onnxruntime-gpu: pip install 'specedge\[cuda\]'"):
            cls(m, m.target)
    assert not (m.root / "engines").exists()  # nothing written into the bundle on failure


def test_ort_cuda_with_cpu_only_onnxruntime_names_onnxruntime_gpu(monkeypatch, toy_scatter):
    import onnxruntime

    from specedge.runtime.backends.ort_cuda import OrtCudaBackend, OrtTrtBackend

    m = toy_scatter[0]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(BackendError, match="ort-cuda.*needs onnxruntime-gpu.*CUDAExecutionProvider"):
        OrtCudaBackend(m, m.target)
    with pytest.raises(BackendError, match="ort-trt.*needs onnxruntime-gpu.*TensorrtExecutionProvider"):
        OrtTrtBackend(m, m.target)


def test_ort_version_gate_for_one_graph_per_size():
    from specedge.engines.plan_json import parse_version as _version_tuple
    from specedge.runtime.backends.ort_cuda import MIN_ORT_MULTI_GRAPH

    assert _version_tuple("1.18.0+cu124")[:2] >= MIN_ORT_MULTI_GRAPH
    assert _version_tuple("1.17.3")[:2] < MIN_ORT_MULTI_GRAPH
    assert _version_tuple("1.20.0.dev20240101") == (1, 20, 0)


def test_tensorrt_backend_without_tensorrt_names_it(monkeypatch, toy_scatter):
    from specedge.runtime.backends.tensorrt_backend import TensorRTBackend

    m = toy_scatter[0]
    _hide(monkeypatch, "tensorrt")
    with pytest.raises(BackendError, match=r"needs the tensorrt package: pip install 'specedge\[tensorrt\]'"):
        TensorRTBackend(m, m.target)


def test_tensorrt_backend_without_cuda_python_names_it(monkeypatch, toy_scatter):
    from specedge.runtime.backends.tensorrt_backend import TensorRTBackend

    m = toy_scatter[0]
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.15.1.29"))
    _hide(monkeypatch, "cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart")
    with pytest.raises(BackendError, match="needs cuda-python"):
        TensorRTBackend(m, m.target)


def test_tensorrt_backend_refuses_scatter_bundle_on_old_tensorrt(monkeypatch, toy_scatter):
    from specedge.runtime.backends.tensorrt_backend import TensorRTBackend

    m = toy_scatter[0]
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.3.0.30"))
    monkeypatch.setattr("specedge.runtime.backends.tensorrt_backend.CudaRuntime", lambda: object())
    with pytest.raises(BackendError, match="--kv-update delta"):
        TensorRTBackend(m, m.target)


def test_torch_backend_without_torch_names_it(monkeypatch, toy_scatter):
    from specedge.runtime.backends.torch_backend import TorchBackend

    m = toy_scatter[0]
    _hide(monkeypatch, "torch")
    with pytest.raises(BackendError, match="needs PyTorch"):
        TorchBackend(m, m.target)
    with pytest.raises(BackendError, match="needs PyTorch"):
        TorchBackend.from_module(object(), 16)


def test_torch_backend_without_checkpoint_says_how(toy_scatter):
    pytest.importorskip("torch")
    from specedge.runtime.backends.torch_backend import TorchBackend

    m = toy_scatter[0]
    with pytest.raises(BackendError, match="does not record the checkpoint.*from_module"):
        TorchBackend(m, m.target, device="cpu")


def test_torch_backend_rebuilds_the_bundle_source_on_cpu(tiny_bundle_factory):
    """The manifest's source (an HF folder here) is found by specedge.checkpoints.resolve, the
    rules export used, and the rebuilt module computes what the exported graph does."""
    pytest.importorskip("torch")
    from specedge.runtime.backends import create_backend
    from specedge.runtime.backends.torch_backend import TorchBackend

    m = load_manifest(tiny_bundle_factory())
    ref = create_backend("ort-cpu", m, m.target)
    b = TorchBackend(m, m.target, device="cpu", dtype="float32")
    for ids, pos in _exported_calls(m.spec_tokens, m.prefill_chunk):
        np.testing.assert_allclose(b.run(ids, pos), ref.run(ids, pos), atol=2e-3, rtol=1e-3)


def test_torch_backend_checkpoint_relative_to_the_bundle(tiny_checkpoint_factory, tmp_path):
    pytest.importorskip("torch")
    import shutil

    from specedge.runtime.backends.torch_backend import load_checkpoint

    shutil.copytree(tiny_checkpoint_factory(), tmp_path / "ckpt")
    model = load_checkpoint("ckpt", root=tmp_path)
    assert model.config.num_hidden_layers >= 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(BackendError, match=r"checkpoint folder '.*/empty' has no config\.json.*from_module"):
        load_checkpoint("empty", root=tmp_path)


@pytest.mark.parametrize(
    "source, message",
    [
        (
            "/no/such/checkpoint",
            r"checkpoint '/no/such/checkpoint' does not exist; load the model yourself.*from_module",
        ),
        ("someorg/not-cached-anywhere", r"not available offline in the Hugging Face cache.*from_module"),
    ],
)
def test_torch_backend_unresolvable_checkpoint_says_how(source, message):
    from specedge.runtime.backends.torch_backend import load_checkpoint

    with pytest.raises(BackendError, match=message):
        load_checkpoint(source)


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without a CUDA GPU")
def test_torch_backend_on_cuda_without_gpu_is_a_clear_error(tiny_llama):
    from specedge.runtime.backends.torch_backend import TorchBackend

    with pytest.raises(BackendError, match="sees no CUDA GPU"):
        TorchBackend.from_module(tiny_llama, 32, device="cuda")


# ----------------------------------------------------------------------------- ORT binding logic on the CPU


@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
def test_ort_backend_binding_on_cpu_matches_reference(tmp_path, kv_mode):
    from specedge.runtime.backends.ort_cuda import OrtCudaBackend

    root, E, W = write_toy_bundle(tmp_path / kv_mode, kv_mode)
    m = load_manifest(root)
    b = OrtCudaBackend(m, m.target, device="cpu")
    try:
        assert b.describe()["provider"] == "CPUExecutionProvider"
        assert not b.cuda_graphs
        _drive(b, ToyReference(E, W, kv_mode), CALLS)
    finally:
        b.close()


def test_ort_backend_argmax_on_device_session(toy_scatter):
    pytest.importorskip("onnx")
    from specedge.runtime.backends.ort_cuda import OrtCudaBackend

    m, E, W = toy_scatter
    b = OrtCudaBackend(m, m.target, device="cpu")
    assert b.describe()["device_argmax"]
    ref = ToyReference(E, W, "scatter")
    prompt = np.array([3, 1, 4, 1])
    np.testing.assert_array_equal(b.argmax(prompt, 0), np.argmax(ref.run(prompt, 0), axis=-1))
    # draft_greedy = k argmax steps, each feeding the previous token back
    toks = b.draft_greedy(5, 4, 3).tolist()
    seq, tok = [], 5
    for j in range(3):
        tok = int(np.argmax(ref.run(np.array([tok]), 4 + j)[0]))
        seq.append(tok)
    assert toks == seq


def test_ort_backend_rejects_calls_outside_the_cache(toy_scatter):
    from specedge.runtime.backends.ort_cuda import OrtCudaBackend

    m = toy_scatter[0]
    b = OrtCudaBackend(m, m.target, device="cpu")
    with pytest.raises(ValueError, match="do not fit max_seq"):
        b.run(np.arange(3), S - 2)
    with pytest.raises(ValueError, match="at least one token"):
        b.run(np.zeros(0, np.int64), 0)
    b.close()
    with pytest.raises(BackendError, match="closed"):
        b.run(np.arange(1), 0)


def test_ort_backend_refuses_a_graph_off_contract(tmp_path):
    """A manifest whose layer count disagrees with the graph: the session's names do not match."""
    from specedge.runtime.backends.ort_cuda import OrtCudaBackend

    root, _, _ = write_toy_bundle(tmp_path / "b", "scatter")
    obj = json.loads((root / "manifest.json").read_text())
    obj["models"]["target"]["num_layers"] = 3
    (root / "manifest.json").write_text(json.dumps(obj))
    m = load_manifest(root)
    with pytest.raises(BackendError, match="does not follow the bundle's I/O contract.*past_key.2"):
        OrtCudaBackend(m, m.target, device="cpu")


def test_ort_trt_options_use_bundle_cache_and_one_profile(toy_scatter):
    from specedge.runtime.backends.ort_cuda import ort_trt_cache_dir, ort_trt_options

    m = toy_scatter[0]
    d = ort_trt_cache_dir(m)
    assert d == m.root / "engines" / "ort-trt" and d.is_dir()
    o = ort_trt_options(m, m.target, d, 0, fp16=True, graphs=True)
    assert o["trt_engine_cache_enable"] == "True" and o["trt_engine_cache_path"] == str(d)
    assert o["trt_timing_cache_enable"] == "True" and o["trt_timing_cache_path"] == str(d)
    assert o["trt_fp16_enable"] == "True" and o["trt_cuda_graph_enable"] == "True"
    # k = 3, prefill chunk 8: T = 1..8, tuned for verification (k + 1 = 4)
    assert (o["trt_profile_min_shapes"], o["trt_profile_opt_shapes"], o["trt_profile_max_shapes"]) == (
        "input_ids:1x1",
        "input_ids:1x4",
        "input_ids:1x8",
    )
    assert "trt_cuda_graph_enable" not in ort_trt_options(m, m.target, d, 0, fp16=False, graphs=False)


# ----------------------------------------------------------------------------- torch backend on the CPU


@pytest.fixture(scope="module")
def tiny_llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from specedge.models import build_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    m = build_model(cfg, "delta")
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m.eval()


def _full_logits(model, ids):
    import torch

    a = model.layers[0].self_attn
    cache = [torch.zeros((1, a.kv_heads, 0, a.head_dim)) for _ in range(2 * len(model.layers))]
    with torch.no_grad():
        return model(torch.tensor(ids)[None], torch.zeros(1, dtype=torch.int64), *cache)[0][0].numpy()


def test_torch_backend_incremental_equals_full_forward(tiny_llama):
    from specedge.runtime.backends.torch_backend import TorchBackend

    ids = [1, 5, 9, 3, 7, 2, 8, 4, 6, 10, 11, 12]
    full = _full_logits(tiny_llama, ids)
    b = TorchBackend.from_module(tiny_llama, max_seq=32, device="cpu", dtype="float32", k=3, prefill_chunk=8)
    assert b.describe()["kv_mode"] == "delta" and b.describe()["device"] == "cpu"
    parts = [
        b.run(np.array(ids[:8]), 0).copy(),
        b.run(np.array(ids[8:9]), 8).copy(),
        b.run(np.array(ids[9:]), 9).copy(),
    ]
    np.testing.assert_allclose(np.concatenate(parts), full, atol=1e-5)
    np.testing.assert_array_equal(b.argmax(np.array(ids[9:]), 9), full[9:].argmax(-1))


def test_torch_backend_copies_another_backends_kv(tiny_llama):
    from specedge.runtime.backends.torch_backend import TorchBackend

    mk = lambda: TorchBackend.from_module(tiny_llama, max_seq=32, device="cpu", dtype="float32", k=3, prefill_chunk=8)  # noqa: E731
    target, draft = mk(), mk()
    ids = [1, 5, 9, 3, 7, 2, 8, 4, 6]
    target.run(np.array(ids[:8]), 0)
    assert draft.copy_kv_from(target, 0, 8)
    assert bool((draft.cache[:, :, :, :8] == target.cache[:, :, :, :8]).all())
    # the draft continues from the copied slots as if it had run them itself
    np.testing.assert_allclose(draft.run(np.array(ids[8:]), 8), _full_logits(tiny_llama, ids)[8:], atol=1e-5)
    assert not draft.copy_kv_from(object(), 0, 8)


@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
def test_ort_cuda_backend_copies_another_backends_kv_on_cpu(tmp_path, kv_mode):
    from specedge.runtime.backends.ort_cuda import OrtCudaBackend

    root, E, W = write_toy_bundle(tmp_path / kv_mode, kv_mode)
    m = load_manifest(root)
    target, draft, ref = (OrtCudaBackend(m, m.target, device="cpu") for _ in range(3))
    try:
        ids = np.array([1, 5, 9, 3, 7, 2])
        target.run(ids[:5], 0)
        ref.run(ids[:5], 0)
        assert draft.copy_kv_from(target, 0, 5)
        np.testing.assert_allclose(draft.run(ids[5:], 5), ref.run(ids[5:], 5), atol=1e-6)
    finally:
        for b in (target, draft, ref):
            b.close()


def test_torch_backend_rollback_overwrites_stale_slots(tiny_llama):
    from specedge.runtime.backends.torch_backend import TorchBackend

    b = TorchBackend.from_module(tiny_llama, max_seq=32, device="cpu", dtype="float32", k=3, prefill_chunk=8)
    b.run(np.array([1, 2, 3, 4]), 0)
    b.run(np.array([50, 51, 52, 53]), 4)  # a rejected verification
    got = b.run(np.array([7, 8]), 4)  # roll back to position 4
    np.testing.assert_allclose(got, _full_logits(tiny_llama, [1, 2, 3, 4, 7, 8])[4:], atol=1e-5)
    # k greedy draft steps = feeding each argmax back
    toks = b.draft_greedy(9, 6, 3)
    seq, ctx = [], [1, 2, 3, 4, 7, 8, 9]
    for _ in range(3):
        seq.append(int(_full_logits(tiny_llama, ctx)[-1].argmax()))
        ctx.append(seq[-1])
    assert toks.tolist() == seq


def test_torch_backend_compiled_step_equals_eager_on_cpu(tiny_llama):
    """compile= traces the captured sizes whole (fullgraph): a graph break or a changed result fails
    here. aot_eager runs dynamo + AOTAutograd without code generation, so the test stays fast; the
    inductor path itself is checked on a GPU below."""
    import copy

    from specedge.runtime.backends.torch_backend import TorchBackend

    ids = [1, 5, 9, 3, 7, 2, 8, 4, 6, 10, 11, 12, 13]
    eager = TorchBackend.from_module(copy.deepcopy(tiny_llama), 32, device="cpu", dtype="float32", k=3, prefill_chunk=8)
    comp = TorchBackend.from_module(
        copy.deepcopy(tiny_llama), 32, device="cpu", dtype="float32", k=3, prefill_chunk=8, compile="aot_eager"
    )
    assert comp.describe()["compiled"] and not eager.describe()["compiled"]
    for b in (eager, comp):
        b.run(np.array(ids[:8]), 0)  # T=8: not a captured size, runs eagerly
    assert comp.graph_sizes == [1, 2, 3, 4]  # every call the loop makes at k=3
    pos = 8
    for step in ([ids[8]], ids[9:13], ids[10:12], ids[9:12], [ids[12]]):  # T=1, then T>=2 (dynamic shapes)
        np.testing.assert_allclose(comp.run(np.array(step), pos), eager.run(np.array(step), pos), atol=1e-5)
        pos += len(step)
    assert comp.draft_greedy(3, pos, 3).tolist() == eager.draft_greedy(3, pos, 3).tolist()
    np.testing.assert_allclose(comp.run(np.array(ids[:5]), 0), _full_logits(tiny_llama, ids[:5]), atol=1e-4)


def test_torch_backend_writes_every_layers_kv_in_its_cache_slot(tiny_llama):
    """The stacked K/V land where binding.py's arena order says: keys of layer i at cache[i], values
    at cache[L + i], slots position .. position + T - 1, nothing else touched."""
    import copy

    import torch

    from specedge.runtime.backends.torch_backend import TorchBackend

    b = TorchBackend.from_module(copy.deepcopy(tiny_llama), 16, device="cpu", dtype="float32", k=3, prefill_chunk=8)
    b.cache.fill_(7.0)
    ids = torch.tensor([[4, 2, 9]])
    pos = torch.tensor([5])
    past = []
    for i in range(b._L):
        past += [b.cache[i].clone(), b.cache[b._L + i].clone()]
    with torch.no_grad():
        out = b.model(ids, pos, torch.ones((3, 3), dtype=torch.bool).tril()[None], *past)  # a chain's mask
        b.run(np.array([4, 2, 9]), 5)
    L = b._L
    for i in range(L):
        torch.testing.assert_close(b.cache[i][:, :, 5:8], out[1 + 2 * i])
        torch.testing.assert_close(b.cache[L + i][:, :, 5:8], out[2 + 2 * i])
    untouched = torch.cat([b.cache[:, :, :, :5], b.cache[:, :, :, 8:]], dim=3)
    assert bool((untouched == 7.0).all())


# a tree of 7 nodes: root 0; 1 and 4 its children; 2, 3 under 1; 5 under 4; 6 under 5
TREE_PARENTS = [-1, 0, 1, 1, 0, 4, 5]
TREE_TOKENS = [3, 8, 9, 10, 11, 12, 13]


def _tree_mask(parents):
    m = np.eye(len(parents), dtype=bool)
    for i, p in enumerate(parents):
        while p >= 0:
            m[i, p] = True
            p = parents[p]
    return m


def _root_path(parents, leaf):
    path = [leaf]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _check_torch_tree(make):
    """A tree call's rows on every root path equal that path fed as a chain; after keep_path
    the next call reads the compacted slots as if the path had been fed; a chain after a tree
    of the same size binds the lower triangle again."""
    prompt = [1, 5, 9, 3, 7, 2, 8, 4]
    mask = _tree_mask(TREE_PARENTS)
    for leaf in (2, 3, 6):
        b, ref = make(), make()
        for x in (b, ref):
            x.run(np.array(prompt), 0)
        logits = b.run_tree(np.array(TREE_TOKENS), 8, mask).copy()
        path = _root_path(TREE_PARENTS, leaf)
        chain = ref.run(np.array([TREE_TOKENS[i] for i in path]), 8).copy()
        np.testing.assert_allclose(logits[path], chain, atol=1e-4)
        b.keep_path(8, path)
        nxt = 8 + len(path)
        np.testing.assert_allclose(b.run(np.array([2, 6]), nxt), ref.run(np.array([2, 6]), nxt), atol=1e-4)
        # size 4 = a captured size (k = 3): a tree of 4 nodes, then a chain of 4 through the same mask
        small = _tree_mask([-1, 0, 0, 1])
        b.run_tree(np.array([4, 5, 6, 7]), nxt + 2, small)
        ref.run(np.array([4, 5, 6, 7]), nxt + 2)  # stale slots in ref: both are overwritten below
        np.testing.assert_allclose(
            b.run(np.array([9, 8, 7, 6]), nxt + 2), ref.run(np.array([9, 8, 7, 6]), nxt + 2), atol=1e-4
        )


def test_torch_backend_tree_calls_on_cpu(tiny_llama):
    import copy

    from specedge.runtime.backends.torch_backend import TorchBackend

    _check_torch_tree(
        lambda: TorchBackend.from_module(
            copy.deepcopy(tiny_llama), 32, device="cpu", dtype="float32", k=3, prefill_chunk=8
        )
    )
    b = TorchBackend.from_module(copy.deepcopy(tiny_llama), 32, device="cpu", dtype="float32", k=3, prefill_chunk=8)
    assert b.takes_trees
    with pytest.raises(ValueError, match="only earlier tokens"):
        b.run_tree(np.array([1, 2]), 0, np.ones((2, 2), bool))
    # from_module leaves the caller's module callable without a mask
    np.testing.assert_allclose(_full_logits(tiny_llama, [1, 2, 3])[-1], b.run(np.array([1, 2, 3]), 0)[-1], atol=1e-5)


def test_torch_backend_greedy_tree_generation_equals_target_only(tiny_llama):
    """The tree round end to end on the torch backend (no tree-flagged bundle needed: the module
    always takes masks): n-gram trees, greedy, the same ids as target-only decoding."""
    import copy

    from specedge.runtime.backends.torch_backend import TorchBackend
    from specedge.runtime.drafters.ngram import NgramDrafter
    from specedge.runtime.generator import GenerationConfig, Generator

    b = TorchBackend.from_module(copy.deepcopy(tiny_llama), 96, device="cpu", dtype="float32", k=3, prefill_chunk=8)
    drafter = NgramDrafter(64)
    gen = Generator(b, drafter, vocab=64, eos_ids=[], prefill_chunk=8, max_seq=96, spec_tokens=3, decode=lambda ids: "")
    drafter.follow_target(gen.target)
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 10, 11, 5, 6, 7, 12, 5, 6]

    def result(cfg):
        it = gen.run(prompt, cfg)
        while True:
            try:
                next(it)
            except StopIteration as stop:
                return stop.value

    want = result(GenerationConfig(max_new_tokens=40, speculative=False).validate())
    got = result(GenerationConfig(max_new_tokens=40, tree=True, guard=False).validate())
    assert list(got.token_ids) == list(want.token_ids) and len(want.token_ids) == 40
    assert got.stats["drafted"] > 0 and got.stats["target_calls"] < 40 and got.stats["tree_rounds"] > 0
    # with the guard, trees may give way to chains (or to target-only steps): the same tokens
    guarded = result(GenerationConfig(max_new_tokens=40, tree=True).validate())
    assert list(guarded.token_ids) == list(want.token_ids)


def test_torch_backend_converts_a_transformers_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from specedge.runtime.backends.torch_backend import TorchBackend

    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        want = hf(torch.tensor(ids)[None]).logits[0].numpy()
    b = TorchBackend.from_module(hf, max_seq=16, device="cpu", dtype=torch.float32)
    np.testing.assert_allclose(b.run(np.array(ids), 0), want, atol=1e-4)


# ----------------------------------------------------------------------------- on a GPU


@gpu
@needs_cuda
def test_gpu_torch_graphs_match_eager(tiny_llama):
    import copy

    from specedge.runtime.backends.torch_backend import TorchBackend

    ids = [1, 5, 9, 3, 7, 2, 8, 4, 6, 10, 11, 12, 13, 14]
    eager = TorchBackend.from_module(
        copy.deepcopy(tiny_llama), 32, device="cuda", dtype="float32", k=3, prefill_chunk=8, cuda_graphs=False
    )
    graph = TorchBackend.from_module(
        copy.deepcopy(tiny_llama), 32, device="cuda", dtype="float32", k=3, prefill_chunk=8
    )
    for b in (eager, graph):
        b.run(np.array(ids[:8]), 0)
    pos = 8
    for step in ([ids[8]], ids[9:13], [ids[13]], [ids[13]]):  # T=1, T=k+1, T=1 twice (replays)
        e = eager.run(np.array(step), pos).copy()
        g = graph.run(np.array(step), pos).copy()
        np.testing.assert_allclose(g, e, atol=1e-4)
        assert graph.argmax(np.array(step), pos).tolist() == e.argmax(-1).tolist()
        pos += len(step) if len(step) > 1 else 1
    assert graph.cuda_graphs and sorted(graph._graphs) == [1, 4], graph.describe()
    np.testing.assert_allclose(graph.run(np.array(ids[:2]), 0), _full_logits(tiny_llama, ids[:2]), atol=1e-4)


@gpu
@needs_cuda
def test_gpu_torch_draft_chain_equals_steps(tiny_llama):
    import copy

    from specedge.runtime.backends.torch_backend import TorchBackend

    a = TorchBackend.from_module(copy.deepcopy(tiny_llama), 32, device="cuda", dtype="float32", k=3, prefill_chunk=8)
    b = TorchBackend.from_module(
        copy.deepcopy(tiny_llama), 32, device="cuda", dtype="float32", k=3, prefill_chunk=8, cuda_graphs=False
    )
    for x in (a, b):
        x.run(np.array([1, 2, 3, 4, 5]), 0)
    for pos, tok in ((5, 6), (9, 7), (5, 8)):  # first call captures, later ones replay (one after a rollback)
        assert a.draft_greedy(tok, pos, 4).tolist() == b.draft_greedy(tok, pos, 4).tolist()


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_torch_compiled_graphs_match_eager(tiny_llama, dtype):
    """inductor's kernels inside our captured graphs: logits within rounding of the eager step, the
    same argmax, and the graphs still on after replays."""
    import copy

    from specedge.runtime.backends.torch_backend import TorchBackend

    ids = [1, 5, 9, 3, 7, 2, 8, 4, 6, 10, 11, 12, 13, 14]
    eager = TorchBackend.from_module(
        copy.deepcopy(tiny_llama), 32, device="cuda", dtype=dtype, k=3, prefill_chunk=8, cuda_graphs=False
    )
    comp = TorchBackend.from_module(
        copy.deepcopy(tiny_llama), 32, device="cuda", dtype=dtype, k=3, prefill_chunk=8, compile=True
    )
    for b in (eager, comp):
        b.run(np.array(ids[:8]), 0)
    pos, tol = 8, (1e-4 if dtype == "float32" else 2e-2)
    for step in ([ids[8]], ids[9:13], [ids[13]], [ids[13]]):
        e = eager.run(np.array(step), pos).copy()
        np.testing.assert_allclose(comp.run(np.array(step), pos), e, atol=tol)
        pos += len(step)
    assert comp.cuda_graphs and sorted(comp._graphs) == [1, 4], comp.describe()


@gpu
@needs_cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_torch_tree_calls_with_graphs(tiny_llama, compiled):
    import copy

    from specedge.runtime.backends.torch_backend import TorchBackend

    _check_torch_tree(
        lambda: TorchBackend.from_module(
            copy.deepcopy(tiny_llama), 32, device="cuda", dtype="float32", k=3, prefill_chunk=8, compile=compiled
        )
    )


def _has_ort_provider(name):
    try:
        import onnxruntime
    except ImportError:
        return False
    return name in onnxruntime.get_available_providers()


@gpu
@pytest.mark.skipif(
    not (HAS_CUDA and _has_ort_provider("CUDAExecutionProvider")),
    reason="no CUDA GPU" if not HAS_CUDA else "onnxruntime-gpu is not installed",
)
@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_ort_cuda_matches_reference(tmp_path, kv_mode, graphs):
    from specedge.runtime.backends.ort_cuda import OrtCudaBackend

    root, E, W = write_toy_bundle(tmp_path / "b", kv_mode)
    m = load_manifest(root)
    b = OrtCudaBackend(m, m.target, cuda_graphs=graphs)
    b.warmup((1, 4))
    b.arena.update_inplace(np.zeros(b.cache.total_elems, np.float32))
    _drive(b, ToyReference(E, W, kv_mode), CALLS + [([1], 15)])
    print(b.describe())


@gpu
@needs_cuda
def test_gpu_tensorrt_toy_engine(tmp_path):
    trt = pytest.importorskip("tensorrt", reason="tensorrt is not installed")
    from specedge.engines.builder import BuildOptions, build_engines
    from specedge.engines.plan_json import SCATTER_MIN_TRT, parse_version
    from specedge.runtime.backends.tensorrt_backend import TensorRTBackend

    kv_mode = "scatter" if parse_version(trt.__version__)[:2] >= SCATTER_MIN_TRT else "delta"
    root, E, W = write_toy_bundle(tmp_path / "b", kv_mode)
    build_engines(root, BuildOptions(), log=lambda s: None)
    m = load_manifest(root)
    b = TensorRTBackend(m, m.target)
    ref = ToyReference(E, W, kv_mode)
    for ids, pos in CALLS:
        np.testing.assert_allclose(b.run(np.array(ids), pos), ref.run(np.array(ids), pos), rtol=1e-4, atol=1e-3)
    print(b.describe())


# ----------------------------------------------------------------------------- exported bundles on a GPU

EXPORTED_CALLS_SEED = 0


def _exported_calls(k: int, chunk: int):
    """Prefill chunks, decode steps, verifications of k + 1 and a rollback."""
    rng = np.random.default_rng(EXPORTED_CALLS_SEED)
    return [
        (rng.integers(0, 100, chunk), 0),
        (rng.integers(0, 100, k + 1), chunk),
        (rng.integers(0, 100, 1), chunk + k + 1),
        (rng.integers(0, 100, k + 1), chunk + 2),
        (rng.integers(0, 100, 1), chunk + k + 3),
        (rng.integers(0, 100, 1), chunk + k + 4),
    ]


@gpu
@pytest.mark.skipif(
    not (HAS_CUDA and _has_ort_provider("CUDAExecutionProvider")),
    reason="no CUDA GPU" if not HAS_CUDA else "onnxruntime-gpu is not installed",
)
@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
def test_gpu_ort_cuda_on_exported_bundle_matches_cpu(tiny_bundle_factory, kv_mode):
    from specedge.runtime.backends import create_backend
    from specedge.runtime.backends.ort_cuda import OrtCudaBackend

    m = load_manifest(tiny_bundle_factory(kv_mode=kv_mode))
    for graphs in (False, True):
        ref = create_backend("ort-cpu", m, m.target)
        b = OrtCudaBackend(m, m.target, cuda_graphs=graphs)
        b.warmup((1, m.spec_tokens + 1))
        for ids, pos in _exported_calls(m.spec_tokens, m.prefill_chunk):
            np.testing.assert_allclose(b.run(ids, pos), ref.run(ids, pos), atol=2e-3, rtol=1e-3)
        print(b.describe())
        b.close()


@gpu
@needs_cuda
def test_gpu_torch_backend_from_bundle_source_matches_cpu(tiny_bundle_factory):
    from specedge.runtime.backends import create_backend
    from specedge.runtime.backends.torch_backend import TorchBackend

    m = load_manifest(tiny_bundle_factory())
    ref = create_backend("ort-cpu", m, m.target)
    b = TorchBackend(m, m.target, device="cuda", dtype="float32")
    b.warmup((1, m.spec_tokens + 1))
    for ids, pos in _exported_calls(m.spec_tokens, m.prefill_chunk):
        np.testing.assert_allclose(b.run(ids, pos), ref.run(ids, pos), atol=2e-3, rtol=1e-3)
    assert b.cuda_graphs, b.describe()


def test_gpu_check_script_logic_runs_on_cpu(tmp_path):
    """scripts/gpu_check.py only meets a GPU on a borrowed machine, where a crash wastes the borrowed time:
    its whole flow (model, exactness, timings, table) runs here on the CPU with a 2-layer
    random-weight model, so a broken script fails CI instead."""
    import subprocess
    from pathlib import Path

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [
            sys.executable,
            str(root / "scripts/gpu_check.py"),
            "--device",
            "cpu",
            "--random-weights",
            "--layers",
            "2",
            "--tokens",
            "8",
            "--repeats",
            "1",
            "--dtypes",
            "float32",
            "--no-compile",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    (res,) = report["results"]
    assert res["backend"] == "torch-fp32" and res["exactness"]["status"] == "exact" and res["ok"]
    assert set(res["timings"]) == {"target", "target+graphs", "speculative", "speculative+graphs"}
    assert all(t["same_tokens"] for t in res["timings"].values())
    assert any("RANDOM weights" in n for n in report["notes"]) and report["ok"] is True
    assert "torch-fp32         speculative   yes" in p.stdout and p.stdout.rstrip().endswith("gpu_check.json")


def test_gpu_check_tree_table_runs_on_cpu(load_script, tiny_bundle_factory):
    """gpu_check's tree vs chain table (issue 15's GPU figures) only runs on a borrowed GPU: its
    logic runs here on the torch backend on CPU, so a broken table fails CI, not the borrowed machine."""
    pytest.importorskip("torch")
    gc = load_script("gpu_check")
    bundle = tiny_bundle_factory(family="llama", draft="ngram", max_seq=512)
    row = gc.check_trees(bundle, "cpu", "float32", tokens=12, n_prompts=3, cuda_graphs=False)
    assert row["ok"] and row["prompts"] == 3 and row["drafter"] == "ngram"
    for c in ("target-only", "chain", "tree"):
        assert row[c]["equal_to_target_only"] and row[c]["tokens_per_s"] > 0 and row[c]["tokens_per_call"] >= 1
    assert row["target-only"]["tokens_per_call"] == 1.0
    assert set(row["per_category_tree_vs_chain"]) == {"code", "chat", "grounded"}
    assert row["tree_nodes_at_end"] >= row["k"] + 1 and "1" in row["costs_ms"]
    assert row["tree"]["tree_rounds"] > 0  # trees were verified, not only chains


def test_gpu_md_renders_the_tree_table(load_script):
    """BENCHMARKS.md's GPU section is written from gpu_check.json by scripts/gpu_md.py: a run with
    the pipeline's tree table gets its line (a run from before the table gets none)."""
    import copy
    from pathlib import Path

    md = load_script("gpu_md")
    run = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/gpu/h200_run3.json").read_text())
    assert not any("pipeline trees" in line for line in md.run_table("h200_run3.json", run))
    run = copy.deepcopy(run)
    run["pipeline"]["trees"] = {
        "drafter": "ngram",
        "prompts": 8,
        "ok": True,
        "tree_nodes_at_end": 12,
        "chain": {"tokens_per_s": 250.0, "tokens_per_call": 1.8},
        "tree": {"tokens_per_s": 280.0, "tokens_per_call": 2.2},
        "tree_vs_chain_tokens_per_s": 1.12,
        "tree_vs_chain_tokens_per_call": 2.2 / 1.8,
        "per_category_tree_vs_chain": {"chat": 1.1, "code": 1.05},
    }
    (line,) = [x for x in md.run_table("h200_run3.json", run) if "pipeline trees" in x]
    assert "tree 280.0 tok/s, 2.20 tokens/call" in line and "1.120x tok/s" in line and "chat 1.100x" in line
    assert "up to 12 nodes" in line and "**True**" in line
