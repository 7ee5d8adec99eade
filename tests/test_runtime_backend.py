"""The ONNX Runtime backend: static buffers bound once, in-place scatter, delta writes, rollback by
position, prefix reuse, and the backend registry / provider errors."""

import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import onnxruntime as ort
import pytest

from specedge.manifest import ModelSpec, load_manifest
from specedge.runtime.backends import BACKENDS, BackendError, create_backend, resolve_backend_name
from specedge.runtime.backends.ort import OrtBackend, normalize_providers
from specedge.runtime.cache import CacheTracker, run_chunked


@pytest.fixture(scope="module")
def scatter_bundle(tiny_bundle_factory):
    return tiny_bundle_factory()  # llama, fp32 target, int4 self draft (shared with the other tests)


@pytest.fixture(scope="module")
def delta_bundle(tiny_bundle_factory):
    return tiny_bundle_factory(kv_mode="delta")  # the same weights in delta mode


def backend(bundle, **kw):
    m = load_manifest(bundle)
    return m, OrtBackend(m, m.target, threads=1, **kw)


def reference(m, ids, past=None):
    """Plain session.run with fresh numpy feeds (no binding): logits and the cache outputs."""
    sess = ort.InferenceSession(str(m.path(m.target.graph_for("ort-cpu").path)), providers=["CPUExecutionProvider"])
    L, H, S, D = m.target.num_layers, m.target.num_kv_heads, m.max_seq, m.target.head_dim
    feeds = {"input_ids": np.array([ids], dtype=np.int64), "position": np.array([0], dtype=np.int64)}
    for i in range(L):
        for kv in ("key", "value"):
            feeds[f"past_{kv}.{i}"] = np.zeros((1, H, S, D), np.float32)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


# ----------------------------------------------------------------------------- buffers


def test_scatter_updates_the_bound_cache_in_place(scatter_bundle):
    m, be = backend(scatter_bundle)
    L = m.target.num_layers
    arena_ptr = be.kv.ctypes.data
    key_ptrs = [be.kv_tensor(k, i).ctypes.data for k in (0, 1) for i in range(L)]
    ids = [5, 9, 13]
    logits = be.run(np.array(ids), 0)
    # same memory, no copy: the arena and each layer's tensor keep their addresses ...
    assert be.kv.ctypes.data == arena_ptr
    assert [be.kv_tensor(k, i).ctypes.data for k in (0, 1) for i in range(L)] == key_ptrs
    assert np.shares_memory(logits, be._logits)
    # ... and hold exactly what the graph computed for the new slots
    ref = reference(m, ids)
    np.testing.assert_allclose(logits, ref["logits"][0], rtol=1e-5, atol=1e-5)
    for i in range(L):
        for kind, name in ((0, "key"), (1, "value")):
            got = be.kv_tensor(kind, i)
            np.testing.assert_allclose(got[:, :, :3], ref[f"present_{name}.{i}"][:, :, :3], rtol=1e-5, atol=1e-6)
            assert not got[:, :, :3].any() == 0  # something was written
            assert (got[:, :, 3:] == 0).all()  # nothing else was touched
    # a further step writes its slot and leaves the others bit for bit
    before = be.kv.copy()
    be.run(np.array([7]), 3)
    assert be.kv.ctypes.data == arena_ptr
    assert (be.kv[:, :, :, :3] == before[:, :, :, :3]).all()
    assert (be.kv[:, :, :, 3] != 0).any()
    assert (be.kv[:, :, :, 4:] == 0).all()
    ref4 = reference(m, ids + [7])
    np.testing.assert_allclose(be.kv_tensor(0, 0)[:, :, 3], ref4["present_key.0"][:, :, 3], rtol=1e-5, atol=1e-6)


def test_scatter_runs_without_the_copy_fallback(scatter_bundle):
    """ONNX Runtime warns 'in-place optimization not activated' when present and past differ and
    then copies the whole cache each step; the bound backend must never trigger it. A plain
    session.run of the same session is the control that shows the warning is observable."""
    import onnx

    m = load_manifest(scatter_bundle)
    graph = onnx.load(str(m.path(m.target.graph_for("ort-cpu").path)), load_external_data=False)
    ops = {n.op_type for n in graph.graph.node}
    if "TensorScatter" not in ops:
        pytest.skip(
            f"the ort-cpu graph writes its cache with {sorted(ops & {'GroupQueryAttention', 'ScatterND'})}, "
            "not TensorScatter (in-place content and addresses are checked above)"
        )
    script = textwrap.dedent(f"""
        import sys, numpy as np
        from specedge.manifest import ModelSpec, load_manifest
        from specedge.runtime.backends.ort import OrtBackend
        m = load_manifest({str(scatter_bundle)!r})
        be = OrtBackend(m, m.target, threads=1, log_level=2)
        be.run(np.array([1, 2, 3]), 0); be.run(np.array([4]), 3); be.run(np.array([5, 6]), 4)
        print("BOUND-DONE", file=sys.stderr, flush=True)
        feeds = {{"input_ids": np.array([[1]]), "position": np.array([0])}}
        for i in be.session.get_inputs()[2:]:
            feeds[i.name] = np.zeros(i.shape, np.float32)
        be.session.run(None, feeds)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    bound, _, control = p.stderr.partition("BOUND-DONE")
    assert "in-place optimization not activated" not in bound, bound
    assert "in-place optimization not activated" in control, "the control run should show ORT's copy warning"


def test_delta_mode_writes_new_entries_at_position(scatter_bundle, delta_bundle):
    ms, sc = backend(scatter_bundle)
    md, de = backend(delta_bundle)
    assert md.kv_mode == "delta"
    arena_ptr = de.kv.ctypes.data
    calls = [([3, 4, 5, 6], 0), ([7], 4), ([8, 9, 10], 5), ([11, 12], 6), ([13], 8)]  # (6 rolls back)
    L2, H, D = 2 * md.target.num_layers, md.target.num_kv_heads, md.target.head_dim
    for ids, pos in calls:
        a = sc.run(np.array(ids), pos).copy()
        b = de.run(np.array(ids), pos).copy()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        t = len(ids)
        new = de._delta[: L2 * H * t * D].reshape(L2, 1, H, t, D)
        assert (de.kv[:, :, :, pos : pos + t] == new).all()  # written exactly at position
        np.testing.assert_allclose(sc.kv[:, :, :, : pos + t], de.kv[:, :, :, : pos + t], rtol=1e-5, atol=1e-6)
    assert de.kv.ctypes.data == arena_ptr


def test_buffers_are_reused_between_steps(scatter_bundle):
    m, be = backend(scatter_bundle)
    ptrs = (be._ids.ctypes.data, be._pos.ctypes.data, be._logits.ctypes.data, be.kv.ctypes.data)
    for t, pos in ((1, 0), (5, 1), (1, 6), (5, 7), (1, 12)):
        out = be.run(np.arange(1, t + 1), pos)
        assert out.shape == (t, m.target.vocab_size) and np.shares_memory(out, be._logits)
    assert sorted(be._bindings) == [1, 5]  # one IOBinding per distinct T, kept
    assert (be._ids.ctypes.data, be._pos.ctypes.data, be._logits.ctypes.data, be.kv.ctypes.data) == ptrs
    # the hot loop allocates no logits-sized array on the Python side (a [5, V] copy would be
    # 20 * V bytes), and nothing accumulates
    ids = np.array([3, 4, 5, 6, 7])
    be.run(ids, 13)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for pos in range(13, 63, 5):
        be.run(ids, pos)
    middle = tracemalloc.get_traced_memory()[0]
    for pos in range(13, 63, 5):
        be.run(ids, pos)
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak - base < 20 * m.target.vocab_size, f"{peak - base} bytes allocated in the step loop"
    assert current - middle < 256, "memory grows with the number of steps"


def test_rollback_is_a_smaller_position(scatter_bundle):
    m, be = backend(scatter_bundle)
    a = [5, 6, 7, 8, 9, 10, 11, 12]
    be.run(np.array(a), 0)
    got = be.run(np.array([40, 41]), 5).copy()  # drop 10, 11, 12
    _, fresh = backend(scatter_bundle)
    want = fresh.run(np.array(a[:5] + [40, 41]), 0)[5:]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_and_exact_prefix_reuse(scatter_bundle):
    m, be = backend(scatter_bundle)
    chunk = m.prefill_chunk
    prompt = list(range(3, 3 + 2 * chunk + 5))
    _, one = backend(scatter_bundle)
    whole = one.run(np.array(prompt), 0)[-1].copy()
    last = run_chunked(be, prompt, 0, chunk).copy()
    np.testing.assert_allclose(last, whole, rtol=1e-5, atol=1e-5)

    tr = CacheTracker(be, chunk)
    row = tr.feed_chunked(prompt).copy()
    assert tr.position == len(prompt) and tr.exact == 2 * chunk
    tr.feed([1, 2, 3])  # a decode step: those slots are not reusable
    second = prompt[: 2 * chunk + 2] + [90, 91, 92]
    n = tr.reuse(second)
    assert n == 2 * chunk and tr.position == n
    reused = tr.feed_chunked(second[n:]).copy()
    _, clean = backend(scatter_bundle)
    fresh = CacheTracker(clean, chunk).feed_chunked(second)
    assert (reused == fresh).all()  # bit-identical to starting from scratch
    assert np.isfinite(row).all()


def test_bad_calls_are_refused(scatter_bundle):
    m, be = backend(scatter_bundle)
    with pytest.raises(ValueError, match="do not fit"):
        be.run(np.array([1, 2]), m.max_seq - 1)
    with pytest.raises(ValueError, match="at least one token"):
        be.run(np.array([], dtype=np.int64), 0)
    big = be.t_max + 3  # a call larger than planned grows the buffers once
    out = be.run(np.arange(big) % 50, 0)
    assert out.shape == (big, m.target.vocab_size)


def test_corrupt_graph_is_a_backend_error(scatter_bundle, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(scatter_bundle, bad)
    m = load_manifest(bad, verify="none")
    (bad / m.target.graph_for("ort-cpu").path).write_bytes(b"not an onnx file")
    with pytest.raises(BackendError, match="cannot load the target graph"):
        OrtBackend(m, m.target)


# ----------------------------------------------------------------------------- registry and providers


def test_registry_names_and_errors(scatter_bundle, monkeypatch):
    m = load_manifest(scatter_bundle)
    with pytest.raises(BackendError, match="unknown backend 'nope'; valid backends: auto, ort-cpu"):
        create_backend("nope", m, m.target)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert resolve_backend_name("auto") == "ort-cpu"
    be = create_backend("auto", m, m.target, threads=1)
    assert be.describe()["backend"] in ("ort-cpu", "ort-cuda")
    with pytest.raises(BackendError, match="n-gram drafter"):
        create_backend("ort-cpu", m, ModelSpec(role="draft", kind="ngram"))
    monkeypatch.setitem(BACKENDS, "torch", ("no_such_module_here", "TorchBackend"))
    with pytest.raises(BackendError, match="backend 'torch' is not available in this build"):
        create_backend("torch", m, m.target)
    with pytest.raises(BackendError, match="threads must be a positive integer"):
        create_backend("ort-cpu", m, m.target, threads=0)


@pytest.mark.parametrize(
    "provider, package",
    [
        ("CUDAExecutionProvider", "onnxruntime-gpu"),
        ("cuda", "onnxruntime-gpu"),
        ("TensorrtExecutionProvider", "onnxruntime-gpu"),
        ("OpenVINOExecutionProvider", "onnxruntime-openvino"),
        ("DmlExecutionProvider", "onnxruntime-directml"),
    ],
)
def test_missing_provider_names_its_package(provider, package):
    from specedge.runtime.backends.ort import PROVIDER_ALIASES

    full = PROVIDER_ALIASES.get(provider, provider)
    if full in ort.get_available_providers():
        pytest.skip(f"{full} is installed here")
    with pytest.raises(BackendError, match=package):
        normalize_providers([provider])


def test_unknown_provider_and_pass_through(scatter_bundle):
    with pytest.raises(BackendError, match="unknown execution provider 'FooExecutionProvider'"):
        normalize_providers(["FooExecutionProvider"])
    names, opts = normalize_providers([("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"}), "cpu"])
    assert names == ["CPUExecutionProvider", "CPUExecutionProvider"] and opts[0] == {
        "arena_extend_strategy": "kSameAsRequested"
    }
    m = load_manifest(scatter_bundle)
    be = OrtBackend(
        m,
        m.target,
        providers=[("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})],
        allow_spinning=False,
        session_config={"session.intra_op.allow_spinning": "0"},
    )
    assert be.describe()["providers"] == ["CPUExecutionProvider"] and be.describe()["allow_spinning"] is False
    assert be.run(np.array([1, 2]), 0).shape == (2, m.target.vocab_size)


def test_choose_threading_rules():
    from specedge.runtime.backends.ort import choose_threading

    # no process pool: a pool of its own, spinning off where a draft alternates (auto)
    assert choose_threading(2, None, True, None) == (False, False)
    assert choose_threading(2, None, False, None) == (False, True)
    assert choose_threading(None, True, True, None) == (False, True)
    assert choose_threading(None, False, False, None) == (False, False)
    # a process pool: every session joins it, spinning
    assert choose_threading(2, None, True, 2) == (True, True)
    assert choose_threading(None, None, False, 2) == (True, True)
    assert choose_threading(None, True, True, 0) == (True, True)
    assert choose_threading(3, None, False, -1) == (True, True)  # made outside specedge: size unknown
    with pytest.raises(
        BackendError,
        match=r"threads=4, but this process's ONNX Runtime sessions share one pool "
        r"of 2 threads .* use threads=2 or another process",
    ):
        choose_threading(4, None, True, 2)
    with pytest.raises(BackendError, match="use threads=None or another process"):
        choose_threading(4, None, True, 0)
    with pytest.raises(BackendError, match="allow_spinning=False, but .* one spinning pool"):
        choose_threading(2, False, False, 2)


SHARED_POOL_CHILD = """
import sys, numpy as np
from specedge.manifest import load_manifest
from specedge.runtime.backends.base import BackendError
from specedge.runtime.backends.ort import OrtBackend
m = load_manifest(sys.argv[1])
own = OrtBackend(m, m.target, threads=1, alternating=True)
assert own.describe()["shared_pool"] is False and own.describe()["allow_spinning"] is False
target = OrtBackend(m, m.target, threads=1, shared_pool=True)
draft = OrtBackend(m, m.target, threads=1, alternating=True)  # joins: ORT allows nothing else now
assert target.describe()["shared_pool"] and draft.describe()["shared_pool"] and draft.describe()["allow_spinning"]
ids = np.array([1, 2, 3])
np.testing.assert_allclose(draft.run(ids, 0), own.run(ids, 0), rtol=1e-4, atol=1e-4)
try:
    OrtBackend(m, m.target, threads=2)
    raise SystemExit("a 2-thread session was made beside a 1-thread process pool")
except BackendError as e:
    assert "share one pool of 1 threads" in str(e), e
print("ok")
"""


def test_sessions_share_the_process_pool(scatter_bundle):
    # a process of its own: once made, the pool would be forced on every later test's sessions
    p = subprocess.run(
        [sys.executable, "-c", SHARED_POOL_CHILD, str(scatter_bundle)], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr


def test_allow_spinning_must_be_a_bool_or_none(scatter_bundle):
    m = load_manifest(scatter_bundle)
    with pytest.raises(BackendError, match="allow_spinning must be True, False or None, got 'yes'"):
        OrtBackend(m, m.target, allow_spinning="yes")
