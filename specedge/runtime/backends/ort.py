"""ONNX Runtime backend (CPU execution provider by default; providers and options pass through).

Buffers, all allocated once in the constructor (host memory, numpy-owned):

* one **KV arena** [2·L, B, kv_heads, S, head_dim] holding every layer's K then V cache, zeroed
  (stale slots are masked, but 0 × NaN from uninitialised memory would still poison attention);
* `input_ids` [B, T_max], `position` [B] and a flat `logits` buffer of B·T_max·V floats;
* delta mode: a flat **delta arena** with room for [2·L, B, kv_heads, T_max, head_dim].

For every distinct T the backend meets it builds one `IOBinding` that binds every input and
output by address into those buffers (`[1, T, V]` logits are the first T·V floats of the flat
buffer, the delta outputs the first 2·L·B·kv_heads·T·head_dim elements of the delta arena, so
every view is contiguous) and keeps it. A step is then: write ids and position into their
buffers, `run_with_iobinding`, and in delta mode one numpy copy that writes every layer's new
entries at `position`. Nothing is allocated per step beyond what ONNX Runtime does itself.

Scatter mode binds `present_key.i` to the very address of `past_key.i`: ONNX Runtime's
TensorScatter then updates the cache in place (it warns "in-place optimization not activated"
when the two differ, and copies the whole cache every step).
"""

from __future__ import annotations

import threading

import numpy as np

from ...contract import FEATURES_OUTPUT, TREE_INPUT, check_graph_names, expected_names, reserved_call_size
from ...errors import one_line
from ...manifest import DTYPE_BYTES, Manifest, ModelSpec
from ..tree import compaction_moves
from .base import Backend, BackendError, SessionOptions, import_optional
from .binding import ort_element_type

__all__ = ["OrtBackend", "PROVIDER_PACKAGES", "PROVIDER_ALIASES", "normalize_providers", "choose_threading"]

# Which package provides an execution provider that this onnxruntime build lacks.
PROVIDER_PACKAGES = {
    "CPUExecutionProvider": "onnxruntime",
    "AzureExecutionProvider": "onnxruntime",
    "CUDAExecutionProvider": "onnxruntime-gpu",
    "TensorrtExecutionProvider": "onnxruntime-gpu",
    "NvTensorRTRTXExecutionProvider": "onnxruntime-trt-rtx",
    "OpenVINOExecutionProvider": "onnxruntime-openvino",
    "DmlExecutionProvider": "onnxruntime-directml",
    "QNNExecutionProvider": "onnxruntime-qnn",
    "ROCMExecutionProvider": "onnxruntime-rocm",
    "MIGraphXExecutionProvider": "onnxruntime-migraphx",
    "VitisAIExecutionProvider": "onnxruntime-vitisai",
    "CANNExecutionProvider": "onnxruntime-cann",
    "DnnlExecutionProvider": "an onnxruntime build with oneDNN (--use_dnnl)",
    "CoreMLExecutionProvider": "onnxruntime on macOS",
    "XnnpackExecutionProvider": "an onnxruntime build with XNNPACK (--use_xnnpack)",
    "WebGpuExecutionProvider": "onnxruntime-webgpu",
    "NnapiExecutionProvider": "onnxruntime for Android",
}
# Short names accepted on the command line.
PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "directml": "DmlExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
    "dnnl": "DnnlExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
}


def _import_ort():
    return import_optional(
        "onnxruntime", "every ONNX Runtime backend", "the onnxruntime package: pip install onnxruntime"
    )


def normalize_providers(providers) -> tuple[list[str], list[dict]]:
    """Provider names (aliases allowed) or (name, options) pairs -> (names, options), validated
    against this onnxruntime build. An unknown or missing provider is a BackendError that names
    the package providing it."""
    ort = _import_ort()
    if isinstance(providers, (str, tuple)):
        providers = [providers]
    names, options = [], []
    known = set(ort.get_all_providers()) | set(PROVIDER_PACKAGES)
    available = set(ort.get_available_providers())
    for p in providers:
        opts: dict = {}
        if isinstance(p, tuple):
            if len(p) != 2 or not isinstance(p[1], dict):
                raise BackendError(f"a provider must be a name or a (name, options) pair, got {p!r}")
            p, opts = p
        if not isinstance(p, str) or not p:
            raise BackendError(f"a provider must be a name, got {p!r}")
        name = PROVIDER_ALIASES.get(p.lower(), p)
        if name not in known:
            raise BackendError(f"unknown execution provider '{p}'; this onnxruntime has {', '.join(sorted(available))}")
        if name not in available:
            pkg = PROVIDER_PACKAGES.get(name, "a different onnxruntime build")
            hint = f"pip install {pkg}" if pkg.startswith("onnxruntime") and " " not in pkg else pkg
            raise BackendError(
                f"execution provider '{name}' is not installed (this onnxruntime has "
                f"{', '.join(sorted(available))}); it comes with {pkg}: {hint}"
            )
        names.append(name)
        options.append({str(k): str(v) for k, v in opts.items()})
    if not names:
        raise BackendError("the provider list is empty")
    return names, options


# ONNX Runtime's process-wide intra-op pool: its size once made (0 = ORT's default), -1 when it was
# made outside specedge (size unknown), None while there is none. Once it exists, onnxruntime's
# Python binding refuses sessions with pools of their own, so every later session joins it.
_POOL_LOCK = threading.Lock()
_POOL: int | None = None


def choose_threading(
    threads: int | None, allow_spinning: bool | None, alternating: bool, pool: int | None
) -> tuple[bool, bool]:
    """(shared pool?, spinning?) for a new session, given the process pool (see _POOL).

    On the shared pool a draft and a target take turns on the same hot, spinning threads, where
    two per-session pools would spin against each other (docs/design.md, Threads). Without it a session
    gets its own pool, spinning off when another session alternates with it (auto).
    """
    if pool is None:
        return False, (not alternating) if allow_spinning is None else bool(allow_spinning)
    if threads is not None and pool >= 0 and threads != pool:
        raise BackendError(
            f"threads={threads}, but this process's ONNX Runtime sessions share one pool of "
            f"{pool or 'the default number of'} threads (made by the first load(shared_pool=True)), "
            "and onnxruntime's Python binding cannot mix it with pools of their own: "
            f"use threads={pool or None} or another process"
        )
    if allow_spinning is False:
        raise BackendError(
            "allow_spinning=False, but this process's ONNX Runtime sessions share one spinning "
            "pool (made by load(shared_pool=True)): it cannot be turned off per session"
        )
    return True, True


def _process_pool(ort, threads: int | None) -> int:
    """Make the process pool with `threads` unless there is one; return its size (-1: not ours)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            try:
                ort.capi._pybind_state.set_global_thread_pool_sizes(threads or 0, 1)
                _POOL = threads or 0
            except Exception:  # made outside specedge: sessions must join it all the same
                _POOL = -1
        return _POOL


class OrtBackend(Backend):
    """One model on an ONNX Runtime session with static, IO-bound buffers (see module docstring).

    threads: intra-op threads (None = ONNX Runtime's default, one per physical core).
    shared_pool: run on ONNX Runtime's process-wide pool, made with `threads` by the first
      backend that asks; once it exists every session of the process runs on it (onnxruntime's
      Python binding allows nothing else), always spinning (`choose_threading`).
    allow_spinning: None (auto): on a pool of its own, spin unless `alternating`. False / True:
      off / on.
    alternating: another session runs in turn with this one in the process (the drafter).
    providers: execution providers (names, aliases such as "cuda", or (name, options) pairs).
    session_config: extra `add_session_config_entry` pairs.
    use_env_allocators: share the environment's registered allocator between sessions.
    graph_optimization: all (default), extended, basic or none. log_level: ONNX Runtime's
      severity threshold (0 verbose .. 4 fatal; default 4: ONNX Runtime's own error lines, often
      several per failure, stay off stderr, and the failure reaches the caller as one BackendError).
    """

    name = "ort-cpu"
    device_type = "cpu"  # where the bound buffers live

    @classmethod
    def session_kwargs(cls, session: SessionOptions) -> dict:
        return {
            "threads": session.threads,
            "providers": session.providers,
            "allow_spinning": session.allow_spinning,
            "alternating": session.alternating,
            "shared_pool": session.shared_pool,
            "int4_kernel": session.int4_kernel,
        }

    def __init__(
        self,
        manifest: Manifest,
        spec: ModelSpec,
        *,
        threads: int | None = None,
        providers=None,
        allow_spinning: bool | None = None,
        alternating: bool = False,
        shared_pool: bool = False,
        session_config: dict | None = None,
        use_env_allocators: bool = False,
        graph_optimization: str = "all",
        int4_kernel: str = "auto",
        log_level: int = 4,
    ):
        super().__init__(manifest, spec)
        ort = _import_ort()
        self.ort = ort
        self.batch = manifest.batch
        self.threads = threads
        if allow_spinning is not None and not isinstance(allow_spinning, bool):
            raise BackendError(f"allow_spinning must be True, False or None, got {allow_spinning!r}")
        names, popts = normalize_providers(providers if providers is not None else ["CPUExecutionProvider"])
        self.providers = names

        so = ort.SessionOptions()
        levels = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }
        if graph_optimization not in levels:
            raise BackendError(f"graph_optimization must be one of {', '.join(levels)}, got '{graph_optimization}'")
        so.graph_optimization_level = levels[graph_optimization]
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise BackendError(f"threads must be a positive integer, got {threads!r}")
        pool = _process_pool(ort, threads) if shared_pool else _POOL
        self.shared_pool, self.allow_spinning = choose_threading(threads, allow_spinning, alternating, pool)
        if self.shared_pool:
            so.use_per_session_threads = False
        else:
            so.inter_op_num_threads = 1
            if threads is not None:
                so.intra_op_num_threads = threads
        so.log_severity_level = int(log_level)  # 4 = fatal only; 2 shows warnings (tests look for copies)
        if not self.allow_spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        if use_env_allocators:
            so.add_session_config_entry("session.use_env_allocators", "1")
        for k, v in (session_config or {}).items():
            so.add_session_config_entry(str(k), str(v))

        from ..int4_kernel import KernelChoiceError, choose

        try:
            # an int4 model with two graphs: specedge's kernels where they run fast, else MatMulNBits
            self.kernel_choice = choose(spec, self.name, int4_kernel)
        except KernelChoiceError as e:
            raise BackendError(str(e)) from None
        graph = self.graph_spec = self.kernel_choice.graph
        self.takes_trees = bool(getattr(graph, "tree", False))
        self._mask_for = 0  # the T whose lower triangle the mask buffer holds (0: none, or a tree's)
        self.graph_path = manifest.path(graph.path)
        if graph.custom_ops:
            from ...custom_ops import CustomOpsError, register

            try:
                register(so, graph.custom_ops)
            except CustomOpsError as e:
                raise BackendError(f"the {spec.role} graph '{graph.path}': {e}") from None
        try:
            self.session = ort.InferenceSession(str(self.graph_path), so, providers=names, provider_options=popts)
        except Exception as e:  # onnxruntime raises its own exception types (Fail, InvalidGraph, ...)
            first = one_line(e) or type(e).__name__
            raise BackendError(f"ONNX Runtime cannot load the {spec.role} graph '{graph.path}': {first}") from None

        want_in, want_out = self._expected_names()
        got_in = [i.name for i in self.session.get_inputs()]
        got_out = [o.name for o in self.session.get_outputs()]
        try:
            check_graph_names(spec.role, want_in, want_out, got_in, got_out, optional_outputs=())
        except ValueError as e:
            raise BackendError(str(e)) from None
        # One RunOptions for every call: with run_options=None, ONNX Runtime's Python binding
        # leaks a little memory per run_with_iobinding call (seen with tracemalloc).
        self._run_options = ort.RunOptions()
        self._outputs = want_out  # extra named outputs (if any) are left unbound: ORT allocates them
        self._extra_outputs = [n for n in got_out if n not in want_out]

        if spec.kv_dtype not in DTYPE_BYTES or spec.kv_dtype in ("int64", "int32"):
            raise BackendError(f"unsupported KV dtype '{spec.kv_dtype}'")
        self._kv_elem = ort_element_type(spec.kv_dtype)
        # bfloat16 has no numpy type: its bits live in uint16 arrays (copies are bit copies).
        self._kv_np = np.uint16 if spec.kv_dtype == "bfloat16" else np.dtype(self._kv_elem)
        self._allocate(reserved_call_size(manifest.prefill_chunk))

    def _expected_names(self) -> tuple[list[str], list[str]]:
        """The graph's tensor names by the contract (a draft head's graph has its own)."""
        return expected_names(self.spec, self.kv_mode, self.max_seq, self.batch, self.takes_trees)

    # ------------------------------------------------------------------ buffers

    def _allocate(self, t_max: int) -> None:
        B, L, H, S, D, V = (
            self.batch,
            self.spec.num_layers,
            self.spec.num_kv_heads,
            self.max_seq,
            self.spec.head_dim,
            self.vocab_size,
        )
        self.t_max = int(t_max)
        if not hasattr(self, "kv"):
            self.kv = np.zeros((2 * L, B, H, S, D), dtype=self._kv_np)
        self._ids = np.zeros(B * self.t_max, dtype=np.int64)
        self._pos = np.zeros(B, dtype=np.int64)
        self._logits = np.zeros(B * self.t_max * V, dtype=np.float32)
        self._delta = np.zeros(2 * L * B * H * self.t_max * D, dtype=self._kv_np) if self.kv_mode == "delta" else None
        self._bindings: dict[int, object] = {}
        self._mask = np.zeros(B * self.t_max * self.t_max, dtype=bool) if self.takes_trees else None
        self._mask_for = 0
        F = self.feature_dim()
        self._feat = np.zeros(B * self.t_max * F, dtype=np.float32) if F else None
        self.allocate_features()

    def kv_tensor(self, kind: int, layer: int) -> np.ndarray:
        """The cache tensor [B, kv_heads, S, head_dim] of layer `layer` (kind 0 = key, 1 = value),
        a view of the arena that the graph reads (and, in scatter mode, writes) in place."""
        return self.kv[kind * self.spec.num_layers + layer]

    def _binding(self, t: int):
        b = self._bindings.get(t)
        if b is not None:
            return b
        B, L, H, D, V = self.batch, self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, self.vocab_size
        dev = self.device_type
        b = self.session.io_binding()
        b.bind_input("input_ids", dev, 0, np.int64, [B, t], self._ids.ctypes.data)
        b.bind_input("position", dev, 0, np.int64, [B], self._pos.ctypes.data)
        b.bind_output("logits", dev, 0, np.float32, [B, t, V], self._logits.ctypes.data)
        if self._mask is not None:
            b.bind_input(TREE_INPUT, dev, 0, np.bool_, [B, t, t], self._mask.ctypes.data)
        cache_shape = list(self.kv.shape[1:])
        delta_elems = B * H * t * D
        isz = self.kv.itemsize
        for kind, kname in ((0, "key"), (1, "value")):
            for i in range(L):
                j = kind * L + i
                ptr = self.kv[j].ctypes.data
                b.bind_input(f"past_{kname}.{i}", dev, 0, self._kv_elem, cache_shape, ptr)
                if self.kv_mode == "scatter":
                    b.bind_output(f"present_{kname}.{i}", dev, 0, self._kv_elem, cache_shape, ptr)
                else:
                    dptr = self._delta.ctypes.data + j * delta_elems * isz
                    b.bind_output(f"new_{kname}.{i}", dev, 0, self._kv_elem, [B, H, t, D], dptr)
        if self._feat is not None:
            F = self.feature_dim()
            b.bind_output(FEATURES_OUTPUT, dev, 0, np.float32, [B, t, F], self._feat.ctypes.data)
        for name in self._extra_outputs:
            b.bind_output(name, dev)
        self._bindings[t] = b
        return b

    # ------------------------------------------------------------------ one step

    def run(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        position = int(position)
        ids = self.check_call(input_ids, position)
        return self._call(ids, position, None)

    def run_tree(self, input_ids: np.ndarray, position: int, mask: np.ndarray) -> np.ndarray:
        position = int(position)
        ids, m = self.check_tree_call(input_ids, position, mask)
        return self._call(ids, position, m)

    def keep_path(self, position: int, path) -> None:
        moves = compaction_moves(path)
        if not moves:
            return
        src = [position + s for s, _ in moves]
        dst = [position + d for _, d in moves]
        if max(src) >= self.max_seq:
            raise ValueError(
                f"tree nodes {max(src) - position} past position {position} are outside max_seq {self.max_seq}"
            )
        # fancy indexing reads every source before writing: one copy for every layer, K and V
        self.kv[:, :, :, dst, :] = self.kv[:, :, :, src, :]
        self.keep_path_features(position, moves)

    def _call(self, ids: np.ndarray, position: int, tree_mask: np.ndarray | None) -> np.ndarray:
        t = int(ids.shape[0])
        if t > self.t_max:
            self._allocate(t)  # a larger prefill chunk than planned: grow once, rebind lazily
        if self._mask is not None:
            self._write_mask(t, tree_mask)
        B = self.batch
        if B == 1:
            self._ids[:t] = ids
        else:
            self._ids[: B * t].reshape(B, t)[:] = ids
        self._pos[:] = position
        b = self._binding(t)
        try:
            self.session.run_with_iobinding(b, self._run_options)
        except Exception as e:
            raise BackendError(
                f"ONNX Runtime failed to run the {self.spec.role} graph (T={t}, position {position}): {one_line(e)}"
            ) from None
        if self.kv_mode == "delta":
            L2, H, D = 2 * self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim
            new = self._delta[: L2 * B * H * t * D].reshape(L2, B, H, t, D)
            self.kv[:, :, :, position : position + t, :] = new  # every layer, K and V: one copy
        if self._feat is not None:
            self.store_features(position, self._feat[: B * t * self.feature_dim()])
        return self._logits[: t * self.vocab_size].reshape(t, self.vocab_size)  # batch row 0

    def _write_mask(self, t: int, tree_mask: np.ndarray | None) -> None:
        """Fill the [B, t, t] mask: the tree's, or for a chain the lower triangle, which stays
        in the buffer while chain calls of the same T follow (no per-call cost)."""
        view = self._mask[: self.batch * t * t].reshape(self.batch, t, t)
        if tree_mask is not None:
            view[:] = tree_mask
            self._mask_for = 0
        elif self._mask_for != t:
            view[:] = np.tri(t, dtype=bool)
            self._mask_for = t

    def copy_kv_from(self, other: Backend, start: int, end: int) -> bool:
        if not isinstance(other, OrtBackend) or other.kv.shape != self.kv.shape or other.kv.dtype != self.kv.dtype:
            return False
        self.kv[:, :, :, start:end, :] = other.kv[:, :, :, start:end, :]  # every layer, K and V: one copy
        return True

    def close(self) -> None:
        self._bindings = {}
        self.session = None

    def describe(self) -> dict:
        d = super().describe()
        d.update(
            providers=list(self.providers),
            threads=self.threads,
            allow_spinning=self.allow_spinning,
            shared_pool=self.shared_pool,
            graph=str(self.graph_path.name),
            **({"int4_kernel": self.kernel_choice.describe()} if self.kernel_choice.kernel else {}),
        )
        return d
