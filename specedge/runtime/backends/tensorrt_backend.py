"""Native TensorRT backend: a plan from `specedge build-engines`, device buffers from cuda-python.

* The plan and its plan.json are checked first (TensorRT version, GPU, SM, the bundle's graph and
  kv mode; see engines/plan_json.py): a plan built elsewhere is refused with one sentence.
* One execution context per optimization profile (T = 1, k + 1, prefill chunk; engines/profiles.py),
  all sharing the engine's weights. Every tensor is bound by address (`set_tensor_address`) into
  buffers allocated once (layout in binding.py): one cache arena for all layers' K and V, per
  profile an input_ids / logits / argmax buffer and, in delta mode, a delta arena. TensorRT wants
  every bound address 256-byte aligned: arena tensors are padded to 256-byte strides
  (binding.ARENA_ALIGN) and the draft chain's per-step slots are 256 bytes apart.
* Scatter mode (TensorRT >= 10.15): `present_*` are bound to the addresses of `past_*` and TensorRT
  updates the cache in place (IKVCacheUpdateLayer). Delta mode: after each step cudaMemcpy2DAsync
  writes every layer's new entries at `position` (one copy, or one per K/V tensor when the arenas
  are padded; binding.delta_copy).
* Inputs travel from pinned host buffers; `execute_async_v3` runs on a stream of our own. For each
  exact-shape profile a CUDA graph (H2D copies + the engine) is captured after a warm-up enqueue and
  replayed every step; capture failure falls back to plain enqueues with the reason in describe().
* `argmax` reads the engine's extra `argmax` output (TopK added at build time), so greedy decoding
  copies T integers, not [T, V] logits, to the host. `draft_greedy` runs k draft steps as one
  captured graph (scatter mode: each step's argmax buffer is the next step's input_ids).

tensorrt and cuda-python are imported in the constructor; a missing one is a BackendError naming it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ...contract import ARGMAX_OUTPUT, check_graph_names, expected_names
from ...engines import plan_json as pj
from ...engines.profiles import select_profile
from ...errors import UserError
from ...manifest import Manifest, ModelSpec
from ..tree import compaction_moves
from .base import Backend, BackendError, import_optional
from .binding import ARENA_ALIGN, KVLayout, binding_plan, delta_copy, path_copies, slot_copy

CUDA_HINT = "pip install 'specedge[tensorrt]' (cuda-python)"


def import_cudart():
    """cuda-python's runtime module (new layout first), or a BackendError naming the package."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6 (cuda-bindings)
    except ImportError:
        try:
            from cuda import cudart  # type: ignore[no-redef]  # cuda-python < 12.6
        except ImportError:
            raise BackendError(f"this backend needs cuda-python: {CUDA_HINT}") from None
    return cudart


class CudaRuntime:
    """The few CUDA runtime calls the GPU backends need, with errors turned into BackendError."""

    def __init__(self):
        self.rt = import_cudart()
        rt = self.rt
        self.H2D = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.D2H = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self.D2D = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice

    def check(self, result, what: str):
        if isinstance(result, tuple):
            err, rest = result[0], result[1:]
        else:
            err, rest = result, ()
        if err != self.rt.cudaError_t.cudaSuccess:
            try:
                name = self.rt.cudaGetErrorName(err)[1]
                name = name.decode() if isinstance(name, (bytes, bytearray)) else str(name)
            except Exception:  # pragma: no cover - best effort
                name = str(err)
            raise BackendError(f"CUDA call {what} failed: {name}")
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else rest

    def set_device(self, device_id: int) -> None:
        self.check(self.rt.cudaSetDevice(device_id), "cudaSetDevice")

    def device_props(self, device_id: int) -> tuple[str, str]:
        prop = self.check(self.rt.cudaGetDeviceProperties(device_id), "cudaGetDeviceProperties")
        name = prop.name
        if isinstance(name, (bytes, bytearray)):
            name = bytes(name).split(b"\0", 1)[0].decode("utf-8", "replace")
        return str(name).strip(), f"{prop.major}.{prop.minor}"

    def malloc(self, nbytes: int) -> int:
        return int(self.check(self.rt.cudaMalloc(max(int(nbytes), 1)), "cudaMalloc"))

    def free(self, ptr: int) -> None:
        if ptr:
            self.rt.cudaFree(ptr)

    def malloc_host(self, nbytes: int) -> int:
        return int(self.check(self.rt.cudaMallocHost(max(int(nbytes), 1)), "cudaMallocHost"))

    def free_host(self, ptr: int) -> None:
        if ptr:
            self.rt.cudaFreeHost(ptr)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self.check(self.rt.cudaMemset(ptr, value, nbytes), "cudaMemset")

    def stream(self):
        flags = getattr(self.rt, "cudaStreamNonBlocking", 1)
        return self.check(self.rt.cudaStreamCreateWithFlags(flags), "cudaStreamCreateWithFlags")

    def destroy_stream(self, stream) -> None:
        if stream is not None:
            self.rt.cudaStreamDestroy(stream)

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind, stream) -> None:
        self.check(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")

    def memcpy2d_async(self, dst, dpitch, src, spitch, width, height, kind, stream) -> None:
        self.check(
            self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream), "cudaMemcpy2DAsync"
        )

    def sync(self, stream) -> None:
        self.check(self.rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def begin_capture(self, stream) -> None:
        mode = self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        self.check(self.rt.cudaStreamBeginCapture(stream, mode), "cudaStreamBeginCapture")

    def end_capture(self, stream):
        return self.check(self.rt.cudaStreamEndCapture(stream), "cudaStreamEndCapture")

    def abort_capture(self, stream) -> None:
        try:
            graph = self.rt.cudaStreamEndCapture(stream)
            if isinstance(graph, tuple) and len(graph) > 1 and graph[1] is not None:
                self.rt.cudaGraphDestroy(graph[1])
        except Exception:  # pragma: no cover - best effort cleanup
            pass

    def instantiate(self, graph):
        return self.check(self.rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")

    def launch(self, graph_exec, stream) -> None:
        self.check(self.rt.cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch")

    def destroy_graph(self, graph) -> None:
        if graph is not None:
            self.rt.cudaGraphDestroy(graph)

    def destroy_exec(self, graph_exec) -> None:
        if graph_exec is not None:
            self.rt.cudaGraphExecDestroy(graph_exec)


def host_view(ptr: int, nbytes: int, dtype) -> np.ndarray:
    """A numpy array over host memory at `ptr` (pinned buffers from cudaMallocHost)."""
    raw = (ctypes.c_byte * int(nbytes)).from_address(int(ptr))
    return np.frombuffer(raw, dtype=np.uint8).view(dtype)


def import_tensorrt():
    return import_optional("tensorrt", "backend 'tensorrt'", f"the tensorrt package: {pj.TENSORRT_HINT}")


class TensorRTBackend(Backend):
    """TensorRT plan of one model (target or draft) with static buffers and CUDA graphs."""

    name = "tensorrt"
    has_draft_chain = True

    def __init__(
        self,
        manifest: Manifest,
        spec: ModelSpec,
        *,
        device_id: int = 0,
        cuda_graphs: bool = True,
        engine_dir: str | Path | None = None,
    ):
        super().__init__(manifest, spec)
        trt = import_tensorrt()
        cu = CudaRuntime()
        try:
            pj.check_kv_mode_supported(manifest.kv_mode, trt.__version__)
        except UserError as e:
            raise BackendError(str(e)) from None
        self.trt, self.cu = trt, cu
        self.device_id = device_id
        self.batch = manifest.batch
        self._closed = False
        self._graphs: dict[int, object] = {}
        self._chain_graphs: dict[int, object] = {}
        self._dev: list[int] = []
        self._host: list[int] = []
        self._stream = None
        self.graph_note = ""

        cu.set_device(device_id)
        gpu_name, cc = cu.device_props(device_id)
        bundle = str(manifest.root)
        folder = Path(engine_dir) if engine_dir else pj.engines_root(manifest.root) / pj.device_tag(gpu_name, cc)
        meta = folder / f"{spec.role}.plan.json"
        if not meta.is_file():
            raise pj.EngineError(pj.no_engine_message(manifest.root, spec.role, gpu_name, cc, trt.__version__))
        info = pj.load_plan_info(meta)
        pj.check_compatible(info, gpu_name, cc, trt.__version__, bundle)
        pj.check_against_manifest(info, manifest, spec, spec.graph_for("tensorrt").path, bundle)
        plan_path = folder / info.plan_file
        try:
            data = plan_path.read_bytes()
        except OSError as e:
            raise pj.EngineError(
                f"cannot read {plan_path} ({e}) — rebuild with `specedge build-engines {bundle}`"
            ) from None
        pj.verify_plan_bytes(info, data, str(plan_path))
        self.info, self.gpu_name = info, gpu_name

        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise pj.EngineError(
                f"TensorRT could not load {plan_path} — rebuild with `specedge build-engines {bundle} --force`"
            )
        self.engine = engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        ins = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outs = [n for n in names if n not in ins]
        # a graph exported with --tree takes tree_mask: every call binds it (lower-triangular for chains)
        self.takes_trees = bool(spec.graph_for("tensorrt").tree)
        want_in, want_out = expected_names(spec, self.kv_mode, self.max_seq, self.batch, self.takes_trees)
        try:
            check_graph_names(spec.role, want_in, want_out, ins, outs)
        except ValueError as e:
            raise BackendError(str(e)) from None
        self.has_argmax = ARGMAX_OUTPUT in outs
        self._amax_dtype = np.int64
        if self.has_argmax and engine.get_tensor_dtype(ARGMAX_OUTPUT) != trt.int64:
            self._amax_dtype = np.int32
        self.profiles = list(info.profiles)
        if engine.num_optimization_profiles != len(self.profiles):
            raise pj.EngineError(
                f"{plan_path} has {engine.num_optimization_profiles} profiles, its plan.json {len(self.profiles)} — rebuild"
            )

        try:
            self._allocate()
        except BaseException:
            self.close()
            raise
        self.cuda_graphs = bool(cuda_graphs)
        self.graph_sizes = [p.t_min for p in self.profiles if p.exact]
        self.max_call_tokens = max(p.t_max for p in self.profiles)

    # ------------------------------------------------------------------ buffers

    def _dmalloc(self, nbytes: int, zero: bool = False) -> int:
        p = self.cu.malloc(nbytes)
        self._dev.append(p)
        if zero:
            self.cu.memset(p, 0, max(int(nbytes), 1))
        return p

    def _hmalloc(self, nbytes: int) -> int:
        p = self.cu.malloc_host(nbytes)
        self._host.append(p)
        return p

    def _allocate(self) -> None:
        B, V = self.batch, self.vocab_size
        self.cache = KVLayout.for_cache(self.spec, self.max_seq, B)
        # Zeroed: stale slots are masked, but 0 x NaN from uninitialised memory would still poison
        # the attention sum.
        self._cache_ptr = self._dmalloc(self.cache.total_bytes, zero=True)
        self._pos_dev = self._dmalloc(8 * B)
        t_all = max(p.t_max for p in self.profiles)
        k = self.manifest.spec_tokens
        n_pos = max(t_all, k)
        self._pos_host_ptr = self._hmalloc(8 * B * n_pos)
        self._pos_host = host_view(self._pos_host_ptr, 8 * B * n_pos, np.int64)
        self._ids_host_ptr = self._hmalloc(8 * B * t_all)
        self._ids_host = host_view(self._ids_host_ptr, 8 * B * t_all, np.int64)
        if self.takes_trees:
            self._mask_host_ptr = self._hmalloc(B * t_all * t_all)
            self._mask_host = host_view(self._mask_host_ptr, B * t_all * t_all, np.bool_)
        self._logits_host_ptr = self._hmalloc(4 * B * t_all * V)
        self._logits_host = host_view(self._logits_host_ptr, 4 * B * t_all * V, np.float32)
        isz = np.dtype(self._amax_dtype).itemsize
        self._amax_host_ptr = self._hmalloc(isz * B * max(t_all, k))
        self._amax_host = host_view(self._amax_host_ptr, isz * B * max(t_all, k), self._amax_dtype)
        F = self.feature_dim()
        if F:  # the target features of each call, for a draft head running on the CPU
            self._feat_host_ptr = self._hmalloc(4 * B * t_all * F)
            self._feat_host = host_view(self._feat_host_ptr, 4 * B * t_all * F, np.float32)
            self.allocate_features()
        self._bufs = []
        for p in self.profiles:
            t = p.t_max
            b = {
                "input_ids": self._dmalloc(8 * B * t),
                "logits": self._dmalloc(4 * B * t * V),
                "position": self._pos_dev,
                "cache": self._cache_ptr,
            }
            if self.has_argmax:
                b["argmax"] = self._dmalloc(isz * B * t)
            if self.takes_trees:
                b["tree_mask"] = self._dmalloc(B * t * t)
            if F:
                b["features"] = self._dmalloc(4 * B * t * F)
            if self.kv_mode == "delta":  # padded strides: the layout of any T <= t_max fits in it
                b["delta"] = self._dmalloc(KVLayout.for_delta(self.spec, t, B).total_bytes)
            self._bufs.append(b)
        self._stream = self.cu.stream()
        self._contexts = []
        for i in range(len(self.profiles)):
            ctx = self.engine.create_execution_context()
            if ctx is None:
                raise BackendError("TensorRT could not create an execution context (out of device memory?)")
            if not ctx.set_optimization_profile_async(i, int(self._stream)):
                raise BackendError(f"TensorRT refused optimization profile {i}")
            self._contexts.append(ctx)
        self.cu.sync(self._stream)

    # ------------------------------------------------------------------ one step

    def _profile_index(self, t: int) -> int:

        try:
            return select_profile(self.profiles, t)
        except ValueError as e:
            raise BackendError(str(e)) from None

    def _bind(self, pi: int, t: int, overrides: dict | None = None) -> None:
        ctx, bufs = self._contexts[pi], self._bufs[pi]
        if not ctx.set_input_shape("input_ids", (self.batch, t)):
            raise BackendError(f"TensorRT refused input_ids shape ({self.batch}, {t})")
        for b in binding_plan(
            self.spec, self.kv_mode, self.max_seq, t, self.batch, argmax=self.has_argmax, tree=self.takes_trees
        ):
            addr = bufs[b.buffer] + b.offset
            if overrides and b.name in overrides:
                addr = overrides[b.name]
            if not ctx.set_tensor_address(b.name, addr):
                raise BackendError(f"TensorRT refused the address of '{b.name}'")

    def _enqueue(self, pi: int, t: int) -> None:
        cu, s = self.cu, self._stream
        cu.memcpy_async(self._bufs[pi]["input_ids"], self._ids_host_ptr, 8 * self.batch * t, cu.H2D, s)
        cu.memcpy_async(self._pos_dev, self._pos_host_ptr, 8 * self.batch, cu.H2D, s)
        if self.takes_trees:
            cu.memcpy_async(self._bufs[pi]["tree_mask"], self._mask_host_ptr, self.batch * t * t, cu.H2D, s)
        if not self._contexts[pi].execute_async_v3(int(s)):
            raise BackendError("TensorRT failed to enqueue the engine")

    def _capture(self, pi: int, t: int) -> bool:
        """Run this step once eagerly (TensorRT's warm-up before capture) and capture a graph of it.
        Returns True: the step has been executed either way."""
        cu, s = self.cu, self._stream
        self._bind(pi, t)
        self._enqueue(pi, t)
        cu.sync(s)
        try:
            cu.begin_capture(s)
            try:
                self._enqueue(pi, t)
            except BaseException:
                cu.abort_capture(s)
                raise
            graph = cu.end_capture(s)
            self._graphs[t] = cu.instantiate(graph)
            cu.destroy_graph(graph)
        except BackendError as e:
            self.graphs_off(f"CUDA graph capture for T={t}", e)
        return True

    def _check_call(self, input_ids, position: int) -> np.ndarray:
        if self._closed:
            raise BackendError("the backend is closed")
        return self.check_call(input_ids, position)

    def _step(self, ids: np.ndarray, position: int, mask: np.ndarray | None = None) -> tuple[int, int]:
        t = int(ids.shape[0])
        B = self.batch
        self._ids_host[: B * t] = np.tile(ids, B)
        self._pos_host[:B] = position
        if self.takes_trees:  # a tree's mask, or a chain's (lower-triangular)
            m = np.tril(np.ones((t, t), dtype=bool)) if mask is None else mask
            self._mask_host[: B * t * t] = np.tile(m.reshape(-1), B)
        pi = self._profile_index(t)
        if self.cuda_graphs and t in self.graph_sizes and self.profiles[pi].exact:
            g = self._graphs.get(t)
            if g is not None:
                self.cu.launch(g, self._stream)
            else:
                self._capture(pi, t)
        else:
            self._bind(pi, t)
            self._enqueue(pi, t)
        if self.kv_mode == "delta":
            delta_ptr = self._bufs[pi]["delta"]
            for c in delta_copy(self.cache, t, position):  # one, or one per K/V tensor when padded
                self.cu.memcpy2d_async(
                    self._cache_ptr + c.dst_offset,
                    c.dpitch,
                    delta_ptr + c.src_offset,
                    c.spitch,
                    c.width,
                    c.height,
                    self.cu.D2D,
                    self._stream,
                )
        if self.features is not None:  # queued behind the engine; read after the caller's sync
            F = self.features.shape[-1]
            self.cu.memcpy_async(
                self._feat_host_ptr, self._bufs[pi]["features"], 4 * B * t * F, self.cu.D2H, self._stream
            )
        return pi, t

    def _synced(self, position: int, t: int) -> None:
        """After the stream's sync: record the call's features rows on the host."""
        if self.features is not None:
            self.store_features(position, self._feat_host[: self.batch * t * self.features.shape[-1]])

    def keep_path(self, position: int, path) -> None:
        """Commit a tree's accepted path: device-to-device slot copies inside the cache arena, in
        order on the backend's stream (`binding.path_copies`), finished before the next call."""
        moves = compaction_moves(path)
        for c in path_copies(self.cache, position, moves):
            self.cu.memcpy2d_async(
                self._cache_ptr + c.dst_offset,
                c.dpitch,
                self._cache_ptr + c.src_offset,
                c.spitch,
                c.width,
                c.height,
                self.cu.D2D,
                self._stream,
            )
        self.keep_path_features(position, moves)
        self.cu.sync(self._stream)

    def copy_kv_from(self, other: Backend, start: int, end: int) -> bool:
        if not isinstance(other, TensorRTBackend) or other.cache != self.cache or other.device_id != self.device_id:
            return False
        # the target's run() synchronized its stream before returning: its cache is complete
        for c in slot_copy(self.cache, start, end):
            self.cu.memcpy2d_async(
                self._cache_ptr + c.dst_offset,
                c.dpitch,
                other._cache_ptr + c.src_offset,
                c.spitch,
                c.width,
                c.height,
                self.cu.D2D,
                self._stream,
            )
        return True

    def run(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        return self._logits(self._check_call(input_ids, position), position)

    def run_tree(self, input_ids: np.ndarray, position: int, mask: np.ndarray) -> np.ndarray:
        if self._closed:
            raise BackendError("the backend is closed")
        ids, m = self.check_tree_call(input_ids, position, mask)
        return self._logits(ids, position, m)

    def _logits(self, ids: np.ndarray, position: int, mask: np.ndarray | None = None) -> np.ndarray:
        pi, t = self._step(ids, position, mask)
        V = self.vocab_size
        self.cu.memcpy_async(self._logits_host_ptr, self._bufs[pi]["logits"], 4 * t * V, self.cu.D2H, self._stream)
        self.cu.sync(self._stream)
        self._synced(position, t)
        return self._logits_host[: t * V].reshape(t, V)  # batch row 0

    def argmax(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        if not self.has_argmax:
            return np.argmax(self.run(input_ids, position), axis=-1)
        ids = self._check_call(input_ids, position)
        pi, t = self._step(ids, position)
        isz = np.dtype(self._amax_dtype).itemsize
        self.cu.memcpy_async(self._amax_host_ptr, self._bufs[pi]["argmax"], isz * t, self.cu.D2H, self._stream)
        self.cu.sync(self._stream)
        self._synced(position, t)
        return self._amax_host[:t].astype(np.int64)

    # ------------------------------------------------------------------ k draft steps, one launch

    def draft_greedy(self, token: int, position: int, k: int) -> np.ndarray:
        """Feed `token` at `position`, then each step's argmax at the next slot, k times; return the
        k greedy tokens. Scatter mode with an int64 argmax output captures the k steps as one CUDA
        graph (one launch, one host sync); otherwise it loops over `argmax`."""
        if k < 1:
            return np.zeros(0, dtype=np.int64)
        self.check_chain(position, k)
        chain_ok = (
            self.cuda_graphs
            and self.kv_mode == "scatter"
            and self.has_argmax
            and self._amax_dtype == np.int64
            and 1 in self.graph_sizes
            and self.batch == 1
            and not self.takes_trees  # the chain binds no tree_mask
            and k <= getattr(self, "_chain_slots", k)  # the chain buffers, once allocated, hold this many steps
            and k <= self._pos_host.size  # the positions of the k steps travel in one copy from this buffer
        )
        if not chain_ok:
            return super().draft_greedy(token, position, k)
        cu, s = self.cu, self._stream
        self._ids_host[0] = int(token)
        self._pos_host[:k] = np.arange(position, position + k, dtype=np.int64)
        g = self._chain_graphs.get(k)
        if g is None:
            g = self._capture_chain(k)
        if g is None:  # capture failed: graphs are off now
            return self.draft_greedy(token, position, k)
        cu.launch(g, s)
        # step j's argmax sits at _chain_amax + j * ARENA_ALIGN: gather the k values into the host buffer
        cu.memcpy2d_async(self._amax_host_ptr, 8, self._chain_amax, ARENA_ALIGN, 8, k, cu.D2H, s)
        cu.sync(s)
        return self._amax_host[:k].astype(np.int64).copy()

    def _capture_chain(self, k: int):
        cu, s = self.cu, self._stream
        pi = self._profile_index(1)
        # One slot of ARENA_ALIGN bytes per step (an int64 each): every address bound below is
        # 256-byte aligned, as set_tensor_address requires (binding.ARENA_ALIGN).
        slot = ARENA_ALIGN
        if not hasattr(self, "_chain_amax"):  # once: captured chains keep these addresses
            n = max(k, self.manifest.spec_tokens)
            self._chain_amax = self._dmalloc(slot * n)
            self._chain_pos = self._dmalloc(slot * n)
            self._chain_slots = n
        ids0 = self._bufs[pi]["input_ids"]

        def enqueue_chain():
            cu.memcpy_async(ids0, self._ids_host_ptr, 8, cu.H2D, s)
            # positions from the packed host buffer into one slot per step
            cu.memcpy2d_async(self._chain_pos, slot, self._pos_host_ptr, 8, 8, k, cu.H2D, s)
            for j in range(k):
                self._bind(
                    pi,
                    1,
                    {
                        "input_ids": ids0 if j == 0 else self._chain_amax + slot * (j - 1),
                        "position": self._chain_pos + slot * j,
                        ARGMAX_OUTPUT: self._chain_amax + slot * j,
                    },
                )
                if not self._contexts[pi].execute_async_v3(int(s)):
                    raise BackendError("TensorRT failed to enqueue the engine")

        try:
            # No eager warm-up here: the T=1 context has run (and been captured) before in warmup().
            cu.begin_capture(s)
            try:
                enqueue_chain()
            except BaseException:
                cu.abort_capture(s)
                raise
            graph = cu.end_capture(s)
            g = cu.instantiate(graph)
            cu.destroy_graph(graph)
        except BackendError as e:
            self.graphs_off(f"capture of the {k}-step draft chain", e)
            return None
        finally:
            self._bind(pi, 1)  # the T=1 step graph captured earlier keeps its own addresses
        self._chain_graphs[k] = g
        return g

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        cu = self.cu
        try:
            if self._stream is not None:
                cu.sync(self._stream)
        except BackendError:
            pass
        for g in list(self._graphs.values()) + list(self._chain_graphs.values()):
            cu.destroy_exec(g)
        self._graphs.clear()
        self._chain_graphs.clear()
        self._contexts = []
        for p in self._dev:
            cu.free(p)
        for p in self._host:
            cu.free_host(p)
        self._dev, self._host = [], []
        cu.destroy_stream(self._stream)
        self._stream = None
        self.engine = None

    def __del__(self):  # pragma: no cover - GC timing
        try:
            self.close()
        except Exception:
            pass

    def describe(self) -> dict:
        d = super().describe()
        d.update(
            device=f"{self.gpu_name} (cuda:{self.device_id})",
            tensorrt=str(self.trt.__version__),
            cuda_graphs=self.cuda_graphs,
            graph_sizes=list(self.graph_sizes),
            device_argmax=self.has_argmax,
            profiles=[p.to_json() for p in self.profiles],
        )
        if self.graph_note:
            d["note"] = self.graph_note
        return d
