"""The native TensorRT backend (runtime/backends/tensorrt_backend.py) run end to end on the CPU.

Neither TensorRT nor cuda-python nor a GPU is needed: two in-process fakes stand in for them.

* `FakeCudart` (installed as `cuda.bindings.runtime`): device and pinned host memory are ctypes
  buffers (fresh device memory is filled with 0xFF bytes, i.e. NaN / -1, so a buffer that should
  have been zeroed shows); every copy is bounds-checked against its allocations, and its direction
  (H2D from pinned host memory, D2H, D2D) against where the pointers live. A stream queues its
  operations and runs them only at cudaStreamSynchronize, so a host read before the sync sees
  stale data. While a stream captures, operations are recorded into a graph instead; a launched
  graph enqueues its recorded operations (copies read their memory when they run; engine steps
  keep the tensor addresses bound at capture, as a captured TensorRT enqueue does).
* `FakeTensorRT` (installed as `tensorrt`): a "plan" is a small JSON blob naming the bundle's
  portable ONNX graph and the optimization profiles; the engine's I/O is that graph's plus the
  `argmax` output the real build adds. An execution context checks its profile's T range and the
  256-byte alignment of every bound address; `execute_async_v3` enqueues one step that reads every
  input from its bound address, runs the graph with ONNX Runtime (CPU) and writes every output
  (and argmax of the logits) to its bound address.

What this does not simulate: real TensorRT numerics, kernels or tactics, device memory isolation
(device pointers are host addresses), concurrency between streams, or the real build (the plan.json
is written with the builder's own PlanInfo / profiles_for / write_json_atomic, not by build_engine).
The references are the ort-cpu backend on the same graph and the same calls.
"""

from __future__ import annotations

import ctypes
import enum
import importlib.machinery
import json
import shutil
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from specedge.contract import ARGMAX_OUTPUT, graph_io
from specedge.engines import plan_json as pj
from specedge.engines.profiles import profiles_for
from specedge.manifest import load_manifest, write_json_atomic
from specedge.runtime.backends import create_backend

TRT_VERSION = "10.15.1.29"
GPU_NAME, GPU_CC = "NVIDIA Fake GPU", "9.0"
PLAN_MAGIC = b"FAKE-TRT-PLAN\n"


# ----------------------------------------------------------------------------- fake cuda runtime


class CudaError(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorStreamCaptureUnsupported = 900
    cudaErrorIllegalAddress = 700


class FakeStream:
    def __init__(self, handle: int):
        self.handle = handle
        self.queue: list = []
        self.capture: list | None = None

    def __int__(self):
        return self.handle


class FakeGraph:
    def __init__(self, ops):
        self.ops = list(ops)
        self.destroyed = False


class FakeCudart(types.ModuleType):
    """The subset of cuda-python's `cuda.bindings.runtime` that CudaRuntime calls."""

    def __init__(self):
        super().__init__("cuda.bindings.runtime")
        self.cudaError_t = CudaError
        self.cudaMemcpyKind = types.SimpleNamespace(
            cudaMemcpyHostToDevice="H2D", cudaMemcpyDeviceToHost="D2H", cudaMemcpyDeviceToDevice="D2D"
        )
        self.cudaStreamCaptureMode = types.SimpleNamespace(cudaStreamCaptureModeThreadLocal=1)
        self.cudaStreamNonBlocking = 1
        self.allocs: dict[int, tuple[object, int, str]] = {}  # ptr -> (ctypes buffer, size, "device"|"host")
        self.streams: dict[int, FakeStream] = {}
        self.stats = {"graph_launches": 0, "captures": 0, "engine_steps": 0}
        self.step_seconds = 0.0  # each engine step's extra time: a GPU's call cost, flat in T
        self.errors: list[str] = []

    # memory
    def _alloc(self, n: int, where: str):
        # like cudaMalloc / cudaMallocHost, 256-byte aligned
        buf = ctypes.create_string_buffer(b"\xff" * (n + 256) if where == "device" else b"\0" * (n + 256), n + 256)
        ptr = -(-ctypes.addressof(buf) // 256) * 256
        self.allocs[ptr] = (buf, n, where)
        return CudaError.cudaSuccess, ptr

    def where(self, ptr: int, n: int) -> str:
        """'device' or 'host' for [ptr, ptr + n) inside one allocation; AssertionError otherwise."""
        for base, (_, size, kind) in self.allocs.items():
            if base <= ptr and ptr + n <= base + size:
                return kind
        raise AssertionError(f"access of {n} bytes at {ptr:#x} is outside every allocation")

    def cudaMalloc(self, n):
        return self._alloc(int(n), "device")

    def cudaMallocHost(self, n):
        return self._alloc(int(n), "host")

    def cudaFree(self, ptr):
        assert self.allocs.pop(int(ptr))[2] == "device"
        return (CudaError.cudaSuccess,)

    def cudaFreeHost(self, ptr):
        assert self.allocs.pop(int(ptr))[2] == "host"
        return (CudaError.cudaSuccess,)

    def cudaMemset(self, ptr, value, n):
        assert self.where(int(ptr), int(n)) == "device"
        ctypes.memset(int(ptr), int(value), int(n))
        return (CudaError.cudaSuccess,)

    # device
    def cudaSetDevice(self, i):
        return (CudaError.cudaSuccess if i == 0 else CudaError.cudaErrorInvalidValue,)

    def cudaGetDeviceProperties(self, i):
        major, minor = GPU_CC.split(".")
        prop = types.SimpleNamespace(name=GPU_NAME.encode() + b"\0" * 200, major=int(major), minor=int(minor))
        return CudaError.cudaSuccess, prop

    def cudaGetErrorName(self, err):
        return CudaError.cudaSuccess, CudaError(int(err)).name.encode()

    # streams
    def stream_of(self, s) -> FakeStream:
        return self.streams[int(s)]

    def cudaStreamCreateWithFlags(self, flags):
        s = FakeStream(1000 + len(self.streams))
        self.streams[s.handle] = s
        return CudaError.cudaSuccess, s

    def cudaStreamDestroy(self, s):
        assert not self.stream_of(s).queue, "stream destroyed with work pending"
        del self.streams[int(s)]
        return (CudaError.cudaSuccess,)

    def enqueue(self, s, op) -> None:
        st = self.stream_of(s)
        (st.capture if st.capture is not None else st.queue).append(op)

    def cudaStreamSynchronize(self, s):
        st = self.stream_of(s)
        if st.capture is not None:
            return (CudaError.cudaErrorStreamCaptureUnsupported,)
        while st.queue:
            st.queue.pop(0)()
        return (CudaError.cudaSuccess,)

    def _check_kind(self, kind, dst, src, n_dst, n_src):
        want = {"H2D": ("device", "host"), "D2H": ("host", "device"), "D2D": ("device", "device")}[kind]
        got = (self.where(dst, n_dst), self.where(src, n_src))
        assert got == want, f"{kind} copy between {got}"

    def cudaMemcpyAsync(self, dst, src, n, kind, s):
        dst, src, n = int(dst), int(src), int(n)
        self._check_kind(kind, dst, src, n, n)

        def op():
            ctypes.memmove(dst, src, n)

        self.enqueue(s, op)
        return (CudaError.cudaSuccess,)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, s):
        dst, dpitch, src, spitch, width, height = map(int, (dst, dpitch, src, spitch, width, height))
        if width > dpitch or width > spitch:
            return (CudaError.cudaErrorInvalidValue,)
        self._check_kind(kind, dst, src, dpitch * (height - 1) + width, spitch * (height - 1) + width)

        def op():
            for r in range(height):
                ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

        self.enqueue(s, op)
        return (CudaError.cudaSuccess,)

    # graphs
    def cudaStreamBeginCapture(self, s, mode):
        st = self.stream_of(s)
        assert st.capture is None, "nested capture"  # work queued before stays queued (and runs first)
        st.capture = []
        return (CudaError.cudaSuccess,)

    def cudaStreamEndCapture(self, s):
        st = self.stream_of(s)
        ops, st.capture = st.capture, None
        self.stats["captures"] += 1
        return CudaError.cudaSuccess, FakeGraph(ops)

    def cudaGraphInstantiate(self, graph, flags):
        assert not graph.destroyed
        return CudaError.cudaSuccess, FakeGraph(graph.ops)

    def cudaGraphLaunch(self, g, s):
        assert not g.destroyed, "launch of a destroyed graph"
        self.stats["graph_launches"] += 1
        for op in g.ops:
            self.enqueue(s, op)
        return (CudaError.cudaSuccess,)

    def cudaGraphDestroy(self, g):
        g.destroyed = True
        return (CudaError.cudaSuccess,)

    cudaGraphExecDestroy = cudaGraphDestroy


# ----------------------------------------------------------------------------- fake tensorrt


class _DType:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"trt.{self.name}"


class FakeTensorRT(types.ModuleType):
    """The subset of the tensorrt module that TensorRTBackend uses; steps run on ONNX Runtime."""

    def __init__(self, cudart: FakeCudart, version: str = TRT_VERSION):
        super().__init__("tensorrt")
        self.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
        self.__version__ = version
        self.int64, self.int32, self.float32, self.float16, self.bool = (
            _DType(n) for n in ("int64", "int32", "float32", "float16", "bool")
        )
        self.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
        fake = self

        class Logger:
            WARNING, ERROR = 2, 1

            def __init__(self, severity):
                self.severity = severity

        class Runtime:
            def __init__(self, logger):
                self.logger = logger

            def deserialize_cuda_engine(self, data):
                if not bytes(data).startswith(PLAN_MAGIC):
                    return None
                return FakeEngine(fake, cudart, json.loads(bytes(data)[len(PLAN_MAGIC) :]))

        self.Logger, self.Runtime = Logger, Runtime


class FakeEngine:
    def __init__(self, trt, cudart, plan: dict):
        import onnxruntime as ort

        self.trt, self.cudart = trt, cudart
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.log_severity_level = 3  # no TensorScatter "in-place optimization not activated" notes
        self.session = ort.InferenceSession(plan["onnx"], so, providers=["CPUExecutionProvider"])
        self.io = {name: (mode, dtype, shape) for name, mode, dtype, shape in plan["io"]}
        graph_names = [i.name for i in self.session.get_inputs()] + [o.name for o in self.session.get_outputs()]
        assert sorted(graph_names) == sorted(n for n in self.io if n != ARGMAX_OUTPUT), "plan I/O is not the graph's"
        self.names = [name for name, *_ in plan["io"]]
        self.profiles = [tuple(p) for p in plan["profiles"]]  # (t_min, t_max)
        self.batch = plan["batch"]

    @property
    def num_io_tensors(self):
        return len(self.names)

    @property
    def num_optimization_profiles(self):
        return len(self.profiles)

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return self.trt.TensorIOMode.INPUT if self.io[name][0] == "input" else self.trt.TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name):
        return getattr(self.trt, self.io[name][1])

    def create_execution_context(self):
        return FakeContext(self)


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.profile: int | None = None
        self.t: int | None = None
        self.addr: dict[str, int] = {}

    def set_optimization_profile_async(self, i, stream):
        self.engine.cudart.stream_of(stream)
        if not 0 <= i < len(self.engine.profiles):
            return False
        self.profile = i
        return True

    def set_input_shape(self, name, shape):
        lo, hi = self.engine.profiles[self.profile]
        if name != "input_ids" or len(shape) != 2 or shape[0] != self.engine.batch or not lo <= shape[1] <= hi:
            return False
        self.t = int(shape[1])
        return True

    def set_tensor_address(self, name, addr):
        if name not in self.engine.io or int(addr) % 256:  # TensorRT wants 256-byte aligned addresses
            return False
        self.engine.cudart.where(int(addr), 1)
        self.addr[name] = int(addr)
        return True

    def execute_async_v3(self, stream):
        eng, t = self.engine, self.t
        missing = [n for n in eng.names if n not in self.addr]
        assert t is not None and not missing, f"execute without shape or addresses: {missing}"
        bound = dict(self.addr)  # a captured enqueue keeps the addresses bound now
        shapes = {n: tuple(t if d == "T" else int(d) for d in shape) for n, (_, _, shape) in eng.io.items()}
        dtypes = {n: np.dtype("bool" if dt == "bool" else dt) for n, (_, dt, _) in eng.io.items()}
        cu = eng.cudart

        def read(name):
            n = int(np.prod(shapes[name])) * dtypes[name].itemsize
            assert cu.where(bound[name], n) == "device"
            raw = (ctypes.c_char * n).from_address(bound[name])
            return np.frombuffer(raw, dtype=dtypes[name]).reshape(shapes[name]).copy()

        def write(name, arr):
            arr = np.ascontiguousarray(arr, dtype=dtypes[name])
            assert arr.shape == shapes[name], (name, arr.shape, shapes[name])
            assert cu.where(bound[name], arr.nbytes) == "device"
            ctypes.memmove(bound[name], arr.ctypes.data, arr.nbytes)

        def step():
            cu.stats["engine_steps"] += 1
            time.sleep(cu.step_seconds)
            feeds = {i.name: read(i.name) for i in eng.session.get_inputs()}
            outs = eng.session.run(None, feeds)
            for o, arr in zip(eng.session.get_outputs(), outs):
                write(o.name, arr)
            if ARGMAX_OUTPUT in bound:
                logits = outs[[o.name for o in eng.session.get_outputs()].index("logits")]
                write(ARGMAX_OUTPUT, np.argmax(logits, axis=-1)[..., None])

        cu.enqueue(stream, step)
        return True


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def fake_gpu(monkeypatch, bundle):
    """Installs the fakes as `cuda.bindings.runtime` and `tensorrt`; returns the fake cudart.
    (After the bundle's export: torch probes for a `tensorrt` module when it is imported.)"""
    return install_fakes(monkeypatch, bundle)


def install_fakes(monkeypatch, bundle):
    """fake_gpu's work, with a TensorRT of the version `bundle` was exported for."""
    rt = FakeCudart()
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    for mod in (cuda, bindings, rt):
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None)
    cuda.bindings, bindings.runtime = bindings, rt
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", rt)
    monkeypatch.setitem(sys.modules, "tensorrt", FakeTensorRT(rt, trt_version_for(load_manifest(bundle))))
    return rt


def trt_version_for(m) -> str:
    """The TensorRT the fake reports: the one a `--tensorrt X.Y` bundle was exported for."""
    return f"{m.tensorrt}.0" if m.tensorrt else TRT_VERSION


def write_fake_plan(manifest, spec, folder: Path, trt_version: str = TRT_VERSION) -> Path:
    """A fake plan of `spec` and its plan.json (the builder's PlanInfo, profiles and writer), as
    built by TensorRT `trt_version`. The C++ fakes (cpp/tests/fake_tensorrt) read the same plan."""
    graph = spec.graph_for("tensorrt")
    profiles = profiles_for(manifest)
    inputs, outputs = graph_io(spec, manifest.kv_mode, manifest.max_seq, manifest.batch, tree=graph.tree)
    io = [[ts.name, "input", ts.dtype, list(ts.shape)] for ts in inputs]
    io += [[ts.name, "output", ts.dtype, list(ts.shape)] for ts in outputs]
    io.append([ARGMAX_OUTPUT, "output", "int64", [manifest.batch, "T", 1]])
    data = (
        PLAN_MAGIC
        + json.dumps(
            {
                "onnx": str(manifest.path(graph.path)),
                "io": io,
                "batch": manifest.batch,
                "profiles": [[p.t_min, p.t_max] for p in profiles],
            }
        ).encode()
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{spec.role}.plan").write_bytes(data)
    info = pj.PlanInfo(
        role=spec.role,
        plan_file=f"{spec.role}.plan",
        plan_sha256=pj.sha256_bytes(data),
        plan_bytes=len(data),
        tensorrt_version=trt_version,
        gpu_name=GPU_NAME,
        compute_capability=GPU_CC,
        kv_mode=manifest.kv_mode,
        max_seq=manifest.max_seq,
        batch=manifest.batch,
        precision=spec.precision,
        profiles=profiles,
        onnx_path=graph.path,
        onnx_sha256=str((manifest.files.get(graph.path) or {}).get("sha256", "")),
        extra_outputs=[ARGMAX_OUTPUT],
        created_by="tests/test_tensorrt_fake.py",
    )
    write_json_atomic(folder / f"{spec.role}.plan.json", info.to_json())
    return folder


@pytest.fixture(params=["scatter", "delta", "tensorrt-10.3"])
def bundle(request, tiny_bundle_factory):
    """A tiny fp32 llama bundle whose target has a portable graph (TensorRT's) and a features
    output; the ngram draft keeps the export small. tensorrt-10.3: exported with --tensorrt 10.3
    (delta, opset 18, the norms written out)."""
    if request.param == "tensorrt-10.3":
        return tiny_bundle_factory("llama", kv_mode=None, draft="ngram", features=True, tensorrt="10.3")
    kw = {"graphs": "portable"} if request.param == "scatter" else {}
    return tiny_bundle_factory("llama", kv_mode=request.param, draft="ngram", features=True, **kw)


@pytest.fixture
def engines(bundle, tmp_path):
    m = load_manifest(bundle)
    return m, write_fake_plan(m, m.target, tmp_path / "engines", trt_version_for(m))


def make_pair(m, folder, cuda_graphs=True):
    from specedge.runtime.backends.tensorrt_backend import TensorRTBackend

    trt = TensorRTBackend(m, m.target, cuda_graphs=cuda_graphs, engine_dir=folder)
    ref = create_backend("ort-cpu", m, m.target, threads=1)
    return trt, ref


def tokens(n, seed=0, vocab=256):
    return np.random.default_rng(seed).integers(3, vocab, size=n).astype(np.int64)


def cache_tensors(be) -> np.ndarray:
    """The backend's device cache arena as [2L, B, H, S, D] (a copy)."""
    layout = be.cache
    raw = (ctypes.c_char * layout.total_bytes).from_address(be._cache_ptr)
    flat = np.frombuffer(raw, dtype=np.dtype(be.spec.kv_dtype)).copy()
    return layout.tensors(flat)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_calls_match_ort_cpu(fake_gpu, engines, cuda_graphs):
    m, folder = engines
    trt, ref = make_pair(m, folder, cuda_graphs)
    ids = tokens(60)
    # (method, T, position): prefill chunks (16, 16, a short 3), verification (k+1 = 5), single
    # steps, and rollbacks to an earlier position (the next call simply writes there again)
    calls = [
        ("run", 16, 0),
        ("run", 16, 16),
        ("run", 3, 32),
        ("run", 5, 35),
        ("run", 1, 38),
        ("run", 1, 39),
        ("run", 5, 40),
        ("argmax", 5, 42),
        ("argmax", 1, 45),
        ("run", 1, 46),
        ("run", 1, 20),
        ("run", 5, 21),
        ("argmax", 16, 26),
        ("run", 1, 42),
    ]
    try:
        for method, t, pos in calls:
            x = ids[pos : pos + t]
            want = ref.run(x, pos).copy()
            if method == "run":
                got = trt.run(x, pos)
                assert got.shape == (t, m.target.vocab_size)
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"T={t} at {pos}")
                got = np.argmax(got, axis=-1)
            else:
                got = trt.argmax(x, pos)
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, np.argmax(want, axis=-1), err_msg=f"argmax T={t} at {pos}")
        n = 43  # every slot written by the last calls
        np.testing.assert_allclose(trt.features[0, :n], ref.features[0, :n], atol=1e-4, rtol=0)
        d = trt.describe()
        assert d["device_argmax"] and d["cuda_graphs"] == cuda_graphs and "note" not in d
        if cuda_graphs:  # T = 1 and T = 5 were captured once each, then replayed
            assert trt.graph_sizes == [1, 5] and sorted(trt._graphs) == [1, 5]
            assert fake_gpu.stats["captures"] == 2 and fake_gpu.stats["graph_launches"] == 8  # 5 at T = 1, 3 at T = 5
        else:
            assert fake_gpu.stats["captures"] == 0 and fake_gpu.stats["graph_launches"] == 0
    finally:
        trt.close()
    assert not fake_gpu.allocs, "close() freed every device and host buffer"


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_draft_greedy_equals_stepping_argmax(fake_gpu, engines, cuda_graphs):
    m, folder = engines
    trt, ref = make_pair(m, folder, cuda_graphs)
    ids = tokens(40, seed=1)
    try:
        trt.run(ids[:16], 0), ref.run(ids[:16], 0)
        trt.run(ids[16:17], 16), ref.run(ids[16:17], 16)  # the T = 1 graph exists before the chain
        # a first chain of more steps than the pinned position buffer holds: the step loop, not a
        # broadcast error
        k = trt._pos_host.size + 1
        np.testing.assert_array_equal(trt.draft_greedy(int(ids[17]), 17, k), ref.draft_greedy(int(ids[17]), 17, k))
        pos = 17
        for k, start in ((4, pos), (2, pos + 4), (4, pos), (3, pos + 2), (1, pos + 1)):
            tok = int(ids[start])
            want = ref.draft_greedy(tok, start, k)  # ort-cpu: the base class loop over argmax
            got = trt.draft_greedy(tok, start, k)
            np.testing.assert_array_equal(got, want, err_msg=f"k={k} at {start}")
        # a plain step after the chains: the T = 1 bindings (and its graph) are the step's again
        x = ids[30:31]
        np.testing.assert_allclose(trt.run(x, 25), ref.run(x, 25), atol=1e-4, rtol=0)
        chain = cuda_graphs and m.kv_mode == "scatter"
        # scatter mode with graphs: one captured chain per k, replayed for the second k = 4
        assert sorted(trt._chain_graphs) == ([1, 2, 3, 4] if chain else [])
        assert "note" not in trt.describe()
    finally:
        trt.close()


def test_keep_path_moves_cache_and_feature_rows(fake_gpu, engines):
    m, folder = engines
    trt, ref = make_pair(m, folder)
    ids = tokens(40, seed=2)
    try:
        for be in (trt, ref):
            be.run(ids[:16], 0)
            be.run(ids[16:21], 16)  # a "tree" call of 5 nodes at position 16
        pos = 16
        np.testing.assert_allclose(trt.features[0, :21], ref.features[0, :21], atol=1e-4, rtol=0)
        feats, kv = trt.features.copy(), cache_tensors(trt)
        trt.keep_path(pos, [0, 2, 4])
        ref.keep_path(pos, [0, 2, 4])
        after = cache_tensors(trt)
        for new, old in ((pos, pos), (pos + 1, pos + 2), (pos + 2, pos + 4)):
            np.testing.assert_array_equal(trt.features[:, new], feats[:, old])
            np.testing.assert_array_equal(after[..., new, :], kv[..., old, :])
        np.testing.assert_array_equal(after[..., :pos, :], kv[..., :pos, :])
        np.testing.assert_allclose(trt.features[0, :21], ref.features[0, :21], atol=1e-4, rtol=0)
        # the next call sees the compacted path, like ort-cpu's
        x = ids[25:26]
        np.testing.assert_allclose(trt.run(x, pos + 3), ref.run(x, pos + 3), atol=1e-4, rtol=0)
    finally:
        trt.close()


def test_copy_kv_from_another_tensorrt_backend(fake_gpu, engines):
    from specedge.runtime.backends.tensorrt_backend import TensorRTBackend

    m, folder = engines
    target, ref = make_pair(m, folder)
    draft = TensorRTBackend(m, m.target, engine_dir=folder)
    ids = tokens(40, seed=3)
    try:
        target.run(ids[:16], 0), target.run(ids[16:20], 16)
        ref.run(ids[:16], 0), ref.run(ids[16:20], 16)
        assert draft.copy_kv_from(target, 0, 20)
        assert not draft.copy_kv_from(ref, 0, 20)  # another backend type: the caller feeds the tokens
        got = draft.draft_greedy(int(ids[20]), 20, 4)
        np.testing.assert_array_equal(got, ref.draft_greedy(int(ids[20]), 20, 4))
        np.testing.assert_array_equal(cache_tensors(draft)[..., :20, :], cache_tensors(target)[..., :20, :])
    finally:
        target.close()
        draft.close()


def test_refuses_a_plan_for_another_bundle_graph_or_a_corrupt_plan(fake_gpu, engines):
    from specedge.runtime.backends.tensorrt_backend import TensorRTBackend

    m, folder = engines
    meta = folder / "target.plan.json"
    info = json.loads(meta.read_text())
    meta.write_text(json.dumps({**info, "gpu_name": "NVIDIA H200"}))
    with pytest.raises(pj.EngineError, match="engine built for NVIDIA H200 sm_90"):
        TensorRTBackend(m, m.target, engine_dir=folder)
    meta.write_text(json.dumps(info))
    (folder / "target.plan").write_bytes((folder / "target.plan").read_bytes() + b" ")
    with pytest.raises(pj.EngineError, match="does not match its plan.json checksum"):
        TensorRTBackend(m, m.target, engine_dir=folder)


def test_load_pipeline_on_tensorrt_greedy_equals_target_only(fake_gpu, bundle, tmp_path):
    from specedge.runtime.api import load

    # a copy of the bundle with its engine where `build-engines` puts it: engines/<device tag>/
    b = tmp_path / "bundle"
    shutil.copytree(bundle, b)
    m = load_manifest(b)
    write_fake_plan(m, m.target, pj.engines_root(b) / pj.device_tag(GPU_NAME, GPU_CC), trt_version_for(m))
    prompt = [int(x) for x in np.tile(tokens(7, seed=4), 3)]  # repetitive: the n-gram drafter proposes
    pipe = load(b, backend="tensorrt", draft="ngram", backend_options={"cuda_graphs": True})
    ort = load(bundle, backend="ort-cpu", threads=1, draft="ngram", warmup=False)
    try:
        assert pipe.target.describe()["backend"] == "tensorrt"
        want = ort.generate(token_ids=prompt, max_new_tokens=24, speculative=False)
        alone = pipe.generate(token_ids=prompt, max_new_tokens=24, speculative=False)
        spec = pipe.generate(token_ids=prompt, max_new_tokens=24, guard=False)
        assert alone.token_ids == want.token_ids
        assert spec.token_ids == want.token_ids
        assert spec.stats["drafted"] > 0
    finally:
        pipe.close()
        ort.close()


@pytest.fixture
def tree_bundle(tiny_bundle_factory):
    """A `--tensorrt 10.3 --tree` bundle: its TensorRT graph takes `tree_mask`."""
    return tiny_bundle_factory("llama", kv_mode=None, draft="ngram", tensorrt="10.3", tree=True)


def test_tree_calls_match_ort_cpu(monkeypatch, tree_bundle, tmp_path):
    """Chains bind the lower-triangular mask, tree calls the tree's; keep_path commits the path in
    the cache arena; logits equal ort-cpu's on the same calls."""
    install_fakes(monkeypatch, tree_bundle)
    m = load_manifest(tree_bundle)
    trt, ref = make_pair(m, write_fake_plan(m, m.target, tmp_path / "engines", trt_version_for(m)))
    ids = tokens(40, seed=5)
    # a tree of 5 nodes at 16: root, two children of the root, a child of each
    parents = [-1, 0, 0, 1, 2]
    mask = np.eye(5, dtype=bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p], p = True, parents[p]
    try:
        assert trt.takes_trees and ref.takes_trees
        np.testing.assert_allclose(trt.run(ids[:16], 0), ref.run(ids[:16], 0), atol=1e-4, rtol=0)
        np.testing.assert_allclose(
            trt.run_tree(ids[16:21], 16, mask), ref.run_tree(ids[16:21], 16, mask), atol=1e-4, rtol=0
        )
        trt.keep_path(16, [0, 2, 4])
        ref.keep_path(16, [0, 2, 4])
        for t, pos in ((1, 19), (5, 20), (3, 25)):  # chains after the path: the kept slots are the ones read
            x = ids[pos : pos + t]
            np.testing.assert_allclose(trt.run(x, pos), ref.run(x, pos), atol=1e-4, rtol=0, err_msg=f"T={t}")
    finally:
        trt.close()


@pytest.mark.parametrize("step_seconds", [0.0, 0.02], ids=["cpu-cost", "flat-cost"])
def test_tree_generation_on_tensorrt_equals_target_only(monkeypatch, tree_bundle, tmp_path, step_seconds):
    """flat-cost: every call costs about the same whatever its T, as small calls on a GPU, so trees
    grow to the largest size measured (+ TREE_GROWTH) and past the engine's largest profile unless
    the backend's max_call_tokens bounds them."""
    from specedge.runtime.api import load

    install_fakes(monkeypatch, tree_bundle).step_seconds = step_seconds
    b = tmp_path / "bundle"
    shutil.copytree(tree_bundle, b)
    m = load_manifest(b)
    write_fake_plan(m, m.target, pj.engines_root(b) / pj.device_tag(GPU_NAME, GPU_CC), trt_version_for(m))
    prompt = [int(x) for x in np.tile(tokens(7, seed=4), 3)]
    pipe = load(b, backend="tensorrt", draft="ngram")
    calls = []
    run_tree = pipe.target.run_tree
    pipe.target.run_tree = lambda ids, pos, mask: calls.append(len(ids)) or run_tree(ids, pos, mask)
    try:
        n = 90 if step_seconds else 24  # flat cost: trees grow by TREE_GROWTH a round, up to the profile's 16
        want = pipe.generate(token_ids=prompt, max_new_tokens=n, speculative=False)
        got = pipe.generate(token_ids=prompt, max_new_tokens=n, tree=True, guard=False)
        assert got.token_ids == want.token_ids
        assert got.stats["tree_rounds"] > 0
        assert pipe.target.max_call_tokens == 16 and max(calls) <= 16  # the prefill chunk's profile
    finally:
        pipe.close()
