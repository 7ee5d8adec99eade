"""ONNX Runtime on NVIDIA GPUs: the CUDA execution provider (`ort-cuda`) and the TensorRT
execution provider (`ort-trt`), with IO binding and CUDA graphs.

* Every buffer is a device OrtValue (or a pointer into one) allocated once: one cache arena for all
  layers' K and V (layout in binding.py), one position [B] int64, and per call size T an
  input_ids [B, T], a logits [B, T, V] fp32 and, in delta mode, a delta arena. Each T has its own
  IOBinding; in scatter mode `past_*` and `present_*` bind to the same address, so the graph's
  TensorScatter updates the cache in place.
* CUDA graphs: `enable_cuda_graph` (CUDA EP) or `trt_cuda_graph_enable` (TensorRT EP) with one
  captured graph per T in {1, k + 1}, chosen per run with the `gpu_graph_id` run option (ONNX
  Runtime captures a graph per id with fixed shapes and addresses); ids and position are updated in
  place (`update_inplace`) between replays. Other sizes (prefill) run with gpu_graph_id = -1. When
  the session cannot capture (nodes left on the CPU, an old onnxruntime-gpu) it falls back to
  plain runs and says why in describe() and the log.
* Delta mode: after each run 2-D device copies (cuda-python's cudaMemcpy2D) write every layer's
  new entries at `position`: one copy, or one per K/V tensor when the arenas are padded (arena
  tensors start on 256-byte boundaries, binding.ARENA_ALIGN, which the TensorRT EP needs too).
* Greedy: `argmax` runs a one-node ArgMax session bound to the logits buffer (when the onnx package
  is there to build it), so only T int64 values are copied to the host.

`device="cpu"` runs the same binding code on ONNX Runtime's CPU provider (no graphs): it is how
the layout and in-place logic are tested without a GPU. onnxruntime is imported in the
constructor; a CPU-only onnxruntime is a BackendError naming onnxruntime-gpu.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path

import numpy as np

from ...contract import check_graph_names, expected_names
from ...engines.plan_json import parse_version
from ...engines.profiles import input_shapes, range_profile
from ...manifest import Manifest, ModelSpec
from ..tree import compaction_moves
from .base import Backend, BackendError, import_optional
from .binding import (
    KVLayout,
    binding_plan,
    delta_copy,
    graph_id_for,
    numpy_dtype,
    ort_element_type,
    ort_trt_profile_options,
    path_copies,
    slot_copy,
)

log = logging.getLogger(__name__)

# One captured graph per `gpu_graph_id` (and -1 = run without capture) arrived in onnxruntime 1.18;
# an older one would replay its single graph for every call size, so graphs stay off there.
MIN_ORT_MULTI_GRAPH = (1, 18)


GPU_HINT = "pip install 'specedge[cuda]' (replace the CPU-only onnxruntime: pip uninstall onnxruntime first; on a Jetson use NVIDIA's Jetson AI Lab wheel, see docs/jetson.md)"


def import_onnxruntime(backend: str, provider: str | None):
    ort = import_optional("onnxruntime", f"backend '{backend}'", f"onnxruntime-gpu: {GPU_HINT}")
    if provider is not None and provider not in ort.get_available_providers():
        raise BackendError(
            f"backend '{backend}' needs onnxruntime-gpu (the installed onnxruntime {ort.__version__} has no "
            f"{provider}): {GPU_HINT}"
        )
    return ort


class _HostCopier:
    """2-D copies between host buffers (device="cpu" test mode)."""

    def memset0(self, ptr: int, nbytes: int) -> None:
        ctypes.memset(ptr, 0, nbytes)

    def copy2d(self, dst, dpitch, src, spitch, width, height) -> None:
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)


class _CudaCopier:
    """The same on the GPU through cuda-python (synchronous: ONNX Runtime has finished its run)."""

    def __init__(self, device_id: int):
        from .tensorrt_backend import CudaRuntime  # lazy: cuda-python is only needed here

        self.cu = CudaRuntime()
        self.cu.set_device(device_id)

    def memset0(self, ptr: int, nbytes: int) -> None:
        self.cu.memset(ptr, 0, nbytes)

    def copy2d(self, dst, dpitch, src, spitch, width, height) -> None:
        rt = self.cu.rt
        self.cu.check(rt.cudaMemcpy2D(dst, dpitch, src, spitch, width, height, self.cu.D2D), "cudaMemcpy2D")


class _Slot:
    """Buffers and IO binding for one call size T."""

    def __init__(self, t: int, graph_id: int):
        self.t = t
        self.graph_id = graph_id
        self.binding = None
        self.ids = None
        self.logits = None
        self.delta = None
        self.feat = None
        self.amax = None
        self.amax_binding = None
        self.run_options = None
        self.ran = False


def _argmax_model_bytes(vocab: int, batch: int) -> bytes | None:
    """A one-node ONNX model: argmax over the last axis of logits [B, T, V] -> int64 [B, T]."""
    try:
        from onnx import TensorProto, helper  # noqa: PLC0415 - optional: without it argmax runs on the host
    except ImportError:
        return None
    node = helper.make_node("ArgMax", ["logits"], ["argmax"], axis=-1, keepdims=0, select_last_index=0)
    graph = helper.make_graph(
        [node],
        "argmax",
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, "T", vocab])],
        [helper.make_tensor_value_info("argmax", TensorProto.INT64, [batch, "T"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="specedge")
    model.ir_version = 8
    return model.SerializeToString()


class OrtCudaBackend(Backend):
    """ONNX Runtime CUDA execution provider with IO binding and one CUDA graph per T."""

    name = "ort-cuda"
    provider = "CUDAExecutionProvider"
    graph_option = "enable_cuda_graph"

    def __init__(
        self,
        manifest: Manifest,
        spec: ModelSpec,
        *,
        device_id: int = 0,
        cuda_graphs: bool = True,
        graph_sizes: tuple[int, ...] | None = None,
        device_argmax: bool = True,
        provider_options: dict | None = None,
        device: str = "cuda",
    ):
        super().__init__(manifest, spec)
        if device not in ("cuda", "cpu"):
            raise BackendError(f"device must be 'cuda' or 'cpu' (test mode), got {device!r}")
        self.device_type = device
        ort = import_onnxruntime(self.name, self.provider if device == "cuda" else None)
        self.ort = ort
        self.device_id = int(device_id)
        self.batch = manifest.batch
        self.extra_provider_options = dict(provider_options or {})
        self.graph_note = ""
        self._closed = False
        k = manifest.spec_tokens
        self.graph_sizes = sorted(set(graph_sizes if graph_sizes is not None else (1, k + 1)))
        self.cuda_graphs = bool(cuda_graphs) and device == "cuda"
        if cuda_graphs and device != "cuda":
            self.graph_note = "CUDA graphs need device='cuda'"
        elif self.cuda_graphs and parse_version(ort.__version__)[:2] < MIN_ORT_MULTI_GRAPH:
            self.cuda_graphs = False
            self.graph_note = (
                f"onnxruntime {ort.__version__} captures a single CUDA graph per session; "
                f"one per call size needs >= {MIN_ORT_MULTI_GRAPH[0]}.{MIN_ORT_MULTI_GRAPH[1]}: running without graphs"
            )
            log.warning("%s: %s", self.name, self.graph_note)

        g = spec.graph_for(self.name)
        self.graph_path = manifest.path(g.path)
        self.elem_type = ort_element_type(spec.kv_dtype)
        self.cache = KVLayout.for_cache(spec, self.max_seq, self.batch)

        # Device copies: cuda-python on the GPU (needed for delta writes and zeroing a bf16 cache).
        self._copier = None
        if device == "cpu":
            self._copier = _HostCopier()
        else:
            try:
                self._copier = _CudaCopier(self.device_id)
            except BackendError:
                if self.kv_mode == "delta" or spec.kv_dtype == "bfloat16":
                    raise BackendError(
                        f"backend '{self.name}' with a {self.kv_mode}-mode {spec.kv_dtype} bundle needs cuda-python: "
                        "pip install 'specedge[cuda]'"
                    ) from None

        self.session = self._create_session()
        self._check_io()
        self._allocate()
        self._argmax_sess = None
        if device_argmax:
            self._argmax_sess = self._create_argmax_session()
        self._slots: dict[int, _Slot] = {}
        self._eager_order: list[int] = []

    # ------------------------------------------------------------------ session

    def _provider_list(self, graphs: bool) -> list:
        if self.device_type == "cpu":
            return ["CPUExecutionProvider"]
        opts = {"device_id": str(self.device_id), self.graph_option: "1" if graphs else "0"}
        opts.update(self.extra_provider_options)
        return [(self.provider, opts), "CPUExecutionProvider"]

    def _session_options(self):
        from . import ort as ort_cpu

        so = self.ort.SessionOptions()
        so.log_severity_level = 4  # errors reach the caller as exceptions, one line (ort.py)
        # a process pool made by a shared_pool CPU backend: onnxruntime then refuses sessions with
        # pools of their own (the GPU session's CPU threads only run the few host-side nodes)
        if ort_cpu._POOL is not None:
            so.use_per_session_threads = False
        return so

    def _create_session(self):
        ort = self.ort
        graphs = self.cuda_graphs
        try:
            return ort.InferenceSession(
                str(self.graph_path), sess_options=self._session_options(), providers=self._provider_list(graphs)
            )
        except Exception as e:  # onnxruntime raises its own exception types
            if not graphs:
                raise BackendError(
                    f"onnxruntime ({self.name}) cannot load {self.graph_path.name}: {str(e).splitlines()[0]}"
                ) from None
            self.cuda_graphs = False
            self.graph_note = f"CUDA graphs unavailable ({str(e).splitlines()[0]}); running without them"
            log.warning("%s: %s", self.name, self.graph_note)
        try:
            return ort.InferenceSession(
                str(self.graph_path), sess_options=self._session_options(), providers=self._provider_list(False)
            )
        except Exception as e:
            raise BackendError(
                f"onnxruntime ({self.name}) cannot load {self.graph_path.name}: {str(e).splitlines()[0]}"
            ) from None

    def _check_io(self) -> None:

        ins = [i.name for i in self.session.get_inputs()]
        outs = [o.name for o in self.session.get_outputs()]
        want_in, want_out = expected_names(self.spec, self.kv_mode, self.max_seq, self.batch)
        try:
            check_graph_names(self.spec.role, want_in, want_out, ins, outs)
        except ValueError as e:
            raise BackendError(str(e)) from None
        self._extra_outputs = [o for o in outs if o not in want_out]
        if self.device_type == "cuda":
            used = self.session.get_providers()
            if self.provider not in used:
                raise BackendError(f"onnxruntime did not enable {self.provider} (providers in use: {', '.join(used)})")

    def _ortvalue(self, shape, elem_type):
        return self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), elem_type, self.device_type, self.device_id)

    def _allocate(self) -> None:
        n = self.cache.total_elems  # padding included (binding.ARENA_ALIGN)
        if self._copier is not None:
            self.arena = self._ortvalue([n], self.elem_type)
            self._copier.memset0(self.arena.data_ptr(), self.cache.total_bytes)
        else:  # GPU without cuda-python (scatter mode, fp16/fp32): zero through a host copy
            self.arena = self.ort.OrtValue.ortvalue_from_numpy(
                np.zeros(n, dtype=numpy_dtype(self.spec.kv_dtype)), self.device_type, self.device_id
            )
        self.arena_ptr = self.arena.data_ptr()
        self.allocate_features()  # host rows for a draft head, which runs on the CPU
        self.position = self._ortvalue([self.batch], np.int64)
        self._pos_host = np.zeros(self.batch, dtype=np.int64)

    def _create_argmax_session(self):
        data = _argmax_model_bytes(self.vocab_size, self.batch)
        if data is None:
            return None
        providers = ["CPUExecutionProvider"]
        if self.device_type == "cuda":  # one ArgMax node: the CUDA EP, whatever the main session uses
            providers = [("CUDAExecutionProvider", {"device_id": str(self.device_id)}), "CPUExecutionProvider"]
        try:
            return self.ort.InferenceSession(data, sess_options=self._session_options(), providers=providers)
        except Exception as e:
            log.warning("%s: on-device argmax unavailable (%s); using the host", self.name, str(e).splitlines()[0])
            return None

    # ------------------------------------------------------------------ per-T buffers

    def _slot(self, t: int) -> _Slot:
        s = self._slots.get(t)
        if s is not None:
            return s
        gid = graph_id_for(self.graph_sizes, t) if self.cuda_graphs else -1
        s = _Slot(t, gid)
        B = self.batch
        s.ids = self._ortvalue([B, t], np.int64)
        s.logits = self._ortvalue([B, t, self.vocab_size], np.float32)
        if self.kv_mode == "delta":
            s.delta = self._ortvalue([KVLayout.for_delta(self.spec, t, B).total_elems], self.elem_type)
        b = self.session.io_binding()
        dev, did = self.device_type, self.device_id
        for bd in binding_plan(self.spec, self.kv_mode, self.max_seq, t, B):
            if bd.buffer == "input_ids":
                b.bind_ortvalue_input(bd.name, s.ids)
            elif bd.buffer == "position":
                b.bind_ortvalue_input(bd.name, self.position)
            elif bd.buffer == "logits":
                b.bind_ortvalue_output(bd.name, s.logits)
            elif bd.buffer == "cache" and bd.io == "input":
                b.bind_input(bd.name, dev, did, self.elem_type, list(bd.shape), self.arena_ptr + bd.offset)
            elif bd.buffer == "cache":  # scatter mode: present_* on the very memory of past_*
                b.bind_output(bd.name, dev, did, self.elem_type, list(bd.shape), self.arena_ptr + bd.offset)
            elif bd.buffer == "delta":
                b.bind_output(bd.name, dev, did, self.elem_type, list(bd.shape), s.delta.data_ptr() + bd.offset)
            elif bd.buffer == "features":  # [B, t, F] fp32, copied to the host after each run
                s.feat = self._ortvalue(list(bd.shape), np.float32)
                b.bind_ortvalue_output(bd.name, s.feat)
        for name in self._extra_outputs:  # named extras (hidden states): let onnxruntime allocate them
            b.bind_output(name, dev, did)
        s.binding = b
        ro = self.ort.RunOptions()
        if self.device_type == "cuda":
            ro.add_run_config_entry("gpu_graph_id", str(s.graph_id))
        s.run_options = ro
        if self._argmax_sess is not None:
            s.amax = self._ortvalue([B, t], np.int64)
            ab = self._argmax_sess.io_binding()
            ab.bind_ortvalue_input("logits", s.logits)
            ab.bind_ortvalue_output("argmax", s.amax)
            s.amax_binding = ab
        self._slots[t] = s
        if s.graph_id < 0:  # keep a few eager sizes (prefill remainders), not every one ever seen
            self._eager_order.append(t)
            while len(self._eager_order) > 6:
                self._slots.pop(self._eager_order.pop(0), None)
        return s

    # ------------------------------------------------------------------ one step

    def _step(self, input_ids, position: int) -> _Slot:
        if self._closed:
            raise BackendError("the backend is closed")
        ids = self.check_call(input_ids, position)
        t = int(ids.shape[0])
        s = self._slot(t)
        s.ids.update_inplace(np.ascontiguousarray(np.tile(ids, (self.batch, 1))))
        self._pos_host[:] = position
        self.position.update_inplace(self._pos_host)
        try:
            self.session.run_with_iobinding(s.binding, s.run_options)
        except Exception as e:
            if s.graph_id < 0:
                raise BackendError(f"onnxruntime ({self.name}) failed: {str(e).splitlines()[0]}") from None
            # Capture or replay failed: no graphs from now on (this slot and every later one).
            self.graphs_off(f"CUDA graph for T={t}", e)
            self._slots.clear()
            self._eager_order.clear()
            s = self._slot(t)
            s.ids.update_inplace(np.ascontiguousarray(np.tile(ids, (self.batch, 1))))
            self.session.run_with_iobinding(s.binding, s.run_options)
        if self.kv_mode == "delta":
            src = s.delta.data_ptr()
            for c in delta_copy(self.cache, t, position):  # one, or one per K/V tensor when padded
                self._copier.copy2d(
                    self.arena_ptr + c.dst_offset, c.dpitch, src + c.src_offset, c.spitch, c.width, c.height
                )
        if s.feat is not None:  # F floats per token, far less than the logits row
            self.store_features(position, s.feat.numpy())
        s.ran = True
        return s

    def keep_path(self, position: int, path) -> None:
        """Commit a tree's accepted path: device-to-device slot copies inside the arena, in order
        (`binding.path_copies`)."""
        if self._copier is None:
            raise BackendError("this ort-cuda backend has no device copier for a tree commit")
        moves = compaction_moves(path)
        for c in path_copies(self.cache, position, moves):
            self._copier.copy2d(
                self.arena_ptr + c.dst_offset, c.dpitch, self.arena_ptr + c.src_offset, c.spitch, c.width, c.height
            )
        self.keep_path_features(position, moves)

    def copy_kv_from(self, other: Backend, start: int, end: int) -> bool:
        if (
            not isinstance(other, OrtCudaBackend)
            or other.cache != self.cache
            or self._copier is None
            or (other.device_type, other.device_id) != (self.device_type, self.device_id)
        ):
            return False
        for c in slot_copy(self.cache, start, end):  # device to device, both arenas on one GPU
            self._copier.copy2d(
                self.arena_ptr + c.dst_offset, c.dpitch, other.arena_ptr + c.src_offset, c.spitch, c.width, c.height
            )
        return True

    def run(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        s = self._step(input_ids, position)
        return s.logits.numpy()[0]

    def argmax(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        s = self._step(input_ids, position)
        if s.amax_binding is not None:
            self._argmax_sess.run_with_iobinding(s.amax_binding)
            return s.amax.numpy()[0].astype(np.int64)
        return np.argmax(s.logits.numpy()[0], axis=-1)

    def draft_greedy(self, token: int, position: int, k: int) -> np.ndarray:
        """k greedy draft steps (ONNX Runtime replays one graph per step; no cross-run capture)."""
        out, tok = [], int(token)
        for j in range(k):
            tok = int(self.argmax(np.array([tok], dtype=np.int64), position + j)[0])
            out.append(tok)
        return np.array(out, dtype=np.int64)

    def cache_array(self) -> np.ndarray:
        """The whole cache arena as a host array [2L, B, kv_heads, S, head_dim] (a copy; tests)."""
        return self.cache.tensors(self.arena.numpy()).copy()

    # ------------------------------------------------------------------ lifecycle

    def warmup(self, sizes: tuple[int, ...]) -> None:
        # ONNX Runtime runs a graph id normally a couple of times before it captures it.
        for t in sizes:
            for _ in range(3 if (self.cuda_graphs and t in self.graph_sizes) else 1):
                self.run(np.zeros(t, dtype=np.int64), 0)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._slots.clear()
        self.session = None
        self._argmax_sess = None
        self.arena = None

    def describe(self) -> dict:
        d = super().describe()
        d.update(
            provider=self.provider if self.device_type == "cuda" else "CPUExecutionProvider",
            device=f"{self.device_type}:{self.device_id}",
            onnxruntime=self.ort.__version__,
            cuda_graphs=self.cuda_graphs,
            graph_sizes=list(self.graph_sizes),
            device_argmax=self._argmax_sess is not None,
        )
        if self.graph_note:
            d["note"] = self.graph_note
        return d


def ort_trt_cache_dir(manifest: Manifest) -> Path:
    """bundle/engines/ort-trt/, or a per-user cache folder when the bundle is read-only."""
    d = Path(manifest.root) / "engines" / "ort-trt"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    key = hashlib.sha256(str(Path(manifest.root).resolve()).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    d = base / "specedge" / "ort-trt" / key
    d.mkdir(parents=True, exist_ok=True)
    return d


def ort_trt_options(
    manifest: Manifest, spec: ModelSpec, cache_dir: Path, device_id: int, fp16: bool, graphs: bool
) -> dict:
    """TensorRT EP options: engine + timing caches in the bundle, fp16, one profile T = 1..chunk
    (opt k + 1) covering decode, verification and prefill."""

    prof = range_profile(manifest.spec_tokens, manifest.prefill_chunk)
    shapes = input_shapes(spec, manifest.kv_mode, manifest.max_seq, manifest.batch, prof)
    opts = {
        "device_id": str(device_id),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache_dir),
        "trt_fp16_enable": "True" if fp16 else "False",
        **ort_trt_profile_options([shapes]),
    }
    if graphs:
        opts["trt_cuda_graph_enable"] = "True"
    return opts


class OrtTrtBackend(OrtCudaBackend):
    """ONNX Runtime with the TensorRT execution provider (CUDA EP for whatever TensorRT leaves)."""

    name = "ort-trt"
    provider = "TensorrtExecutionProvider"
    graph_option = "trt_cuda_graph_enable"

    def __init__(self, manifest: Manifest, spec: ModelSpec, *, fp16: bool = True, **kwargs):
        self.fp16 = bool(fp16)
        self._trt_cache_dir: Path | None = None
        super().__init__(manifest, spec, **kwargs)

    @property
    def trt_cache_dir(self) -> Path:
        if self._trt_cache_dir is None:  # created on first use, once onnxruntime-gpu is known to be there
            self._trt_cache_dir = ort_trt_cache_dir(self.manifest)
        return self._trt_cache_dir

    def _provider_list(self, graphs: bool) -> list:
        if self.device_type == "cpu":
            return ["CPUExecutionProvider"]
        trt_opts = ort_trt_options(self.manifest, self.spec, self.trt_cache_dir, self.device_id, self.fp16, graphs)
        trt_opts.update(self.extra_provider_options)
        cuda_opts = {"device_id": str(self.device_id)}
        return [(self.provider, trt_opts), ("CUDAExecutionProvider", cuda_opts), "CPUExecutionProvider"]

    def describe(self) -> dict:
        d = super().describe()
        d.update(engine_cache=str(self.trt_cache_dir), fp16=self.fp16)
        return d
