"""torch backend: the `specedge.models` module itself on a CUDA device, with CUDA graphs.

The reference on GPUs without TensorRT or onnxruntime-gpu, and how GPU speed-ups are measured on a
borrowed machine. It follows the same static-KV contract as the graphs:

* one cache tensor [2·L, B, kv_heads, max_seq, head_dim] allocated once (zeroed), the model seeing
  per-layer views of it (the arena layout of binding.py);
* the module runs in **delta** mode (its scatter path goes through a cloning custom op meant for
  export) and the new entries are written in place with `index_copy_` at device-side indices
  position + arange(T), so the write is part of the captured graph;
* static input_ids [B, T] per captured size and one position [B] tensor, updated in place
  between replays; one `torch.cuda.CUDAGraph` per T in 1 .. k + 1 (every call the speculative loop
  makes: short drafts, the guard's smaller k, invariant two-token steps; a longer prefill chunk
  runs eagerly), each with its own memory pool; argmax is computed on the device and only T
  integers reach the host;
* tree calls (`run_tree`, docs/design.md "Tree calls"): the module always takes an ancestor mask
  [B, T, T] after `position`; a chain binds the lower triangle (written once per size), a tree
  writes its own into the same static mask, so one captured graph per T serves both; trees larger
  than k + 1 run eagerly. `keep_path` commits the accepted path with one indexed copy;
* `draft_greedy` captures k draft steps back to back (each step's argmax feeds the next) as one
  graph per k;
* the new K/V of all layers leave the model stacked as one [2·L, B, kv_heads, T, head_dim] tensor
  and reach the cache in one `index_copy_` (one kernel instead of 2·L per step);
* `compile=True` runs the captured sizes through `torch.compile` (inductor fuses the norms, rope
  and the attention's elementwise work: 457 kernels per SmolLM2-135M step instead of 1,795, and
  a small model's replay time is made of kernel count). Shapes are dynamic after the second size
  seen, so there are two compilations (T = 1, then every T >= 2), tens of seconds each, at the
  first calls (a pipeline's warm-up).

Two ways in: `TorchBackend(manifest, spec)` rebuilds the module from the checkpoint the manifest's
`source` names (an HF folder, a .gguf file or the built-in default), or
`TorchBackend.from_module(model, max_seq, device, dtype)` for a module already loaded (a
specedge.models module, or a transformers CausalLM that is converted). device="cpu" runs the same
code eagerly (tests). torch is imported in the constructor: without it, a BackendError names it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from ...checkpoints import resolve
from ...contract import TensorSpec
from ...errors import UserError
from ...manifest import DTYPE_BYTES, KV_DTYPE, GraphSpec, Manifest, ModelSpec
from ..tree import compaction_moves
from .base import Backend, BackendError, import_optional

TORCH_HINT = "pip install torch (see the README for the pinned version)"
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def import_torch():
    return import_optional("torch", "backend 'torch'", f"PyTorch: {TORCH_HINT}")


def _torch_dtype(torch, name: str):
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def load_checkpoint(source: str, root: Path | None = None):
    """A transformers CausalLM from the local checkpoint a manifest's `source` names, found by the
    rules export used (`specedge.checkpoints.resolve`); a relative path is tried inside the bundle
    folder `root` first. Nothing is downloaded; safetensors only (no pickle)."""
    src = (source or "").strip()
    if not src:
        raise BackendError(
            "the bundle does not record the checkpoint it was exported from; "
            "load the model yourself and use TorchBackend.from_module(model, max_seq)"
        )
    p = Path(src).expanduser()
    if not p.is_absolute() and root is not None and (root / p).exists():
        src = str(root / p)
    try:
        kind, path = resolve(src)
    except UserError as e:
        raise BackendError(f"{e}; load the model yourself and use TorchBackend.from_module(model, max_seq)") from None
    try:
        from transformers import AutoModelForCausalLM  # noqa: PLC0415
    except ImportError:
        raise BackendError(
            "rebuilding the torch module from a checkpoint needs transformers: pip install 'specedge[export]'"
        ) from None
    if kind == "gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, use_safetensors=True)


def to_specedge_module(torch, model):
    """A specedge.models module (delta mode) from a specedge or a transformers CausalLM."""
    from ...models.common import CausalLM  # noqa: PLC0415 - torch-only part of the package

    if isinstance(model, CausalLM):
        model.kv_mode = "delta"
        model.fuse_projections()  # one GEMM for q|k|v and one for gate|up: fewer kernel launches
        return model
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "state_dict"):
        raise BackendError("from_module needs a specedge.models module or a transformers CausalLM")
    from ...models import build_model, load_weights  # noqa: PLC0415

    try:
        m = build_model(cfg, "delta")
        load_weights(m, model.state_dict())
    except ValueError as e:
        raise BackendError(str(e)) from None
    m.fuse_projections()
    return m


def synthetic_manifest(
    model, max_seq: int, dtype_name: str, k: int, prefill_chunk: int, batch: int = 1
) -> tuple[Manifest, ModelSpec]:
    """The manifest a module would have had: enough for the Backend interface (no files)."""
    a = model.layers[0].self_attn
    cfg = getattr(model, "config", None)
    precision = {v: kk for kk, v in _DTYPES.items()}[dtype_name]
    vocab = int(model.lm_head.out_features)
    spec = ModelSpec(
        role="target",
        kind="model",
        family=getattr(model, "family", ""),
        source="(module)",
        precision=precision,
        kv_dtype=KV_DTYPE[precision],
        num_layers=len(model.layers),
        num_kv_heads=int(a.kv_heads),
        head_dim=int(a.head_dim),
        hidden_size=int(getattr(cfg, "hidden_size", 0) or 0),
        vocab_size=vocab,
        num_params=sum(p.numel() for p in model.parameters()),
        graphs=[GraphSpec("torch", "", ["torch"])],
        inputs=[TensorSpec("input_ids", "int64", [batch, "T"])],
        outputs=[TensorSpec("logits", "float32", [batch, "T", vocab])],
        extra={"num_attention_heads": int(a.heads)},
    )
    spec.weight_bytes = spec.num_params * DTYPE_BYTES[dtype_name]
    m = Manifest(
        schema_version=1,
        created_by="TorchBackend.from_module",
        max_seq=int(max_seq),
        batch=batch,
        kv_mode="delta",
        spec_tokens=int(k),
        prefill_chunk=int(prefill_chunk),
        tokenizer_vocab_size=vocab,
        eos_token_ids=[0],
        bos_token_id=None,
        add_bos=False,
        tokenizer_files=[],
        chat_template=None,
        target=spec,
        draft=ModelSpec(role="draft", kind="ngram"),
        files={},
    )
    return m, spec


class TorchBackend(Backend):
    """A specedge.models module with static KV tensors and one CUDA graph per captured T."""

    name = "torch"
    has_draft_chain = True

    def __init__(
        self,
        manifest: Manifest,
        spec: ModelSpec,
        *,
        device: str = "cuda",
        dtype: str | None = None,
        cuda_graphs: bool = True,
        graph_sizes: tuple[int, ...] | None = None,
        module=None,
        compile: bool | str = False,
    ):
        super().__init__(manifest, spec)
        torch = import_torch()
        self.torch = torch
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BackendError(
                "backend 'torch' was asked for a CUDA device but torch sees no CUDA GPU (or is a CPU-only build)"
            )
        self.device = dev
        # Precision: the bundle's, except weight-only int8/int4, which run at fp16 on a GPU (fp32 on CPU).
        want = dtype or _DTYPES.get(spec.precision) or ("float16" if dev.type == "cuda" else "float32")
        if want in _DTYPES:
            want = _DTYPES[want]
        if want not in ("float32", "float16", "bfloat16"):
            raise BackendError(f"unsupported dtype {want!r} for the torch backend")
        self.dtype_name = want
        self.dtype = _torch_dtype(torch, want)
        self.batch = manifest.batch
        self.precision_note = (
            "" if _DTYPES.get(spec.precision) == want else f"bundle precision {spec.precision}, running {want}"
        )

        if module is None:
            module = load_checkpoint(spec.source, manifest.root)
        with torch.no_grad():
            model = to_specedge_module(torch, module)
            # A [B, T, T] ancestor mask follows position (chains bind the lower triangle). Set on a
            # shallow copy: the caller's module (from_module) keeps its own signature.
            model = copy.copy(model)
            model.tree = True
            # the bundle's features output (a draft head reads it): the same tapped layers
            model.feature_layers = tuple(spec.features["layers"]) if getattr(spec, "features", None) else None
            model = model.to(device=dev, dtype=self.dtype).eval()
            for p in model.parameters():
                p.requires_grad_(False)
        self.model = model
        a = model.layers[0].self_attn
        L = len(model.layers)
        if (L, a.kv_heads, a.head_dim) != (spec.num_layers, spec.num_kv_heads, spec.head_dim):
            raise BackendError(
                f"the module has {L} layers x {a.kv_heads} kv heads x {a.head_dim}, "
                f"the manifest says {spec.num_layers} x {spec.num_kv_heads} x {spec.head_dim}"
            )
        self.vocab_size = int(model.lm_head.out_features)
        B, S = self.batch, self.max_seq
        self.cache = torch.zeros((2 * L, B, a.kv_heads, S, a.head_dim), dtype=self.dtype, device=dev)
        # past_key.i = cache[i], past_value.i = cache[L + i] (binding.py's arena order; _model_step)
        self._L = L
        self.allocate_features()
        self.position = torch.zeros((B,), dtype=torch.int64, device=dev)
        self._ids: dict[int, object] = {}
        self._masks: dict[int, object] = {}  # static [B, T, T] ancestor masks, one per size
        self._mask_is_chain: dict[int, bool] = {}
        self.takes_trees = True
        self._graphs: dict[int, tuple] = {}
        self._chains: dict[int, tuple] = {}
        k = manifest.spec_tokens
        self.cuda_graphs = bool(cuda_graphs) and dev.type == "cuda"
        self.graph_sizes = sorted(set(graph_sizes if graph_sizes is not None else range(1, k + 2)))
        self.graph_note = "" if dev.type == "cuda" or not cuda_graphs else "CUDA graphs need a CUDA device"
        self.compiled = bool(compile)
        # compile=True uses inductor; a string names another torch.compile backend (tests: "aot_eager").
        # dynamic=None: the first T is specialised, the next marks T dynamic (one program for T >= 2)
        self._compiled_step = (
            torch.compile(
                self._model_step,
                dynamic=None,
                fullgraph=True,
                backend=compile if isinstance(compile, str) else "inductor",
            )
            if compile
            else None
        )
        self._closed = False

    @classmethod
    def from_module(
        cls,
        model,
        max_seq: int,
        device: str = "cuda",
        dtype="float16",
        *,
        k: int = 4,
        prefill_chunk: int = 64,
        cuda_graphs: bool = True,
        graph_sizes: tuple[int, ...] | None = None,
        compile: bool | str = False,
    ) -> TorchBackend:
        """Wrap a module you already have (specedge.models or transformers CausalLM)."""
        torch = import_torch()
        if not isinstance(dtype, str):
            dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
        dtype = _DTYPES.get(dtype, dtype)
        with torch.no_grad():
            m = to_specedge_module(torch, model)
        manifest, spec = synthetic_manifest(m, max_seq, dtype, k, prefill_chunk)
        return cls(
            manifest,
            spec,
            device=device,
            dtype=dtype,
            cuda_graphs=cuda_graphs,
            graph_sizes=graph_sizes,
            module=m,
            compile=compile,
        )

    # ------------------------------------------------------------------ the step

    def keep_path(self, position: int, path) -> None:
        """Commit a tree's accepted path: one indexed copy of every layer's K and V, in place
        (captured CUDA graphs keep reading this very tensor); advanced indexing reads first."""
        moves = compaction_moves(path)
        if not moves or self.cache is None:
            return
        idx = self.torch.tensor(
            [[position + s for s, _ in moves], [position + d for _, d in moves]], device=self.cache.device
        )
        self.cache[:, :, :, idx[1], :] = self.cache[:, :, :, idx[0], :]
        self.keep_path_features(position, moves)

    def copy_kv_from(self, other: Backend, start: int, end: int) -> bool:
        if (
            not isinstance(other, TorchBackend)
            or other.cache is None
            or self.cache is None
            or other.cache.shape != self.cache.shape
            or other.cache.dtype != self.cache.dtype
            or other.cache.device != self.cache.device
        ):
            return False
        # in place: the captured CUDA graphs keep reading this very tensor
        self.cache[:, :, :, start:end, :].copy_(other.cache[:, :, :, start:end, :])
        return True

    def _static_ids(self, t: int):
        x = self._ids.get(t)
        if x is None:
            x = self.torch.zeros((self.batch, t), dtype=self.torch.int64, device=self.device)
            self._ids[t] = x
        return x

    def _static_mask(self, t: int, tree=None):
        """The static [B, t, t] mask of size t holding `tree` (bool [t, t]) or, for a chain, the
        lower triangle; written only when it changes (captured graphs read this very tensor)."""
        torch = self.torch
        m = self._masks.get(t)
        if m is None:
            m = torch.zeros((self.batch, t, t), dtype=torch.bool, device=self.device)
            self._masks[t] = m
            self._mask_is_chain[t] = False
        if tree is not None:
            m.copy_(torch.from_numpy(np.ascontiguousarray(tree)).expand(self.batch, t, t))
            self._mask_is_chain[t] = False
        elif not self._mask_is_chain[t]:
            m.copy_(torch.ones((t, t), dtype=torch.bool).tril().expand(self.batch, t, t))
            self._mask_is_chain[t] = True
        return m

    def _model_step(self, ids, position, mask, cache):
        """model(ids, position, mask, *past) in delta mode: (logits, the new K/V of every layer
        stacked in the cache's order, keys then values: [2·L, B, kv_heads, T, head_dim], the
        features [B, T, F] fp32 or None). Reads the cache only, so torch.compile sees no mutation."""
        L = self._L
        past = []
        for i in range(L):
            past += [cache[i], cache[L + i]]
        out = self.model(ids, position, mask, *past)
        kv = out[1 : 1 + 2 * L]  # a module with feature layers returns them after the caches
        feats = out[1 + 2 * L] if len(out) > 1 + 2 * L else None
        return out[0], self.torch.stack(list(kv[0::2]) + list(kv[1::2])), feats

    def _forward(self, ids, position, mask):
        """The model step, then the new entries written in place with one index_copy_.
        Returns (logits [B, T, V] fp32, argmax [B, T] int64, features [B, T, F] or None);
        everything is capturable (the mask is set by the caller before a capture, never inside one)."""
        torch = self.torch
        t = ids.shape[1]
        step = self._model_step
        if self._compiled_step is not None and t in self.graph_sizes:
            step = self._compiled_step
        logits, new, feats = step(ids, position, mask, self.cache)
        idx = position[0] + torch.arange(t, device=self.device, dtype=torch.int64)
        self.cache.index_copy_(3, idx, new)
        return logits, logits.argmax(dim=-1), feats

    def _capture(self, t: int):
        torch = self.torch
        ids = self._static_ids(t)
        try:
            # Warm-up on a side stream (as torch.cuda.graphs documents) with the live inputs: it is
            # this call's real execution, the capture below does not run anything.
            s = torch.cuda.Stream(device=self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                res = self._forward(ids, self.position, self._masks[t])
            torch.cuda.current_stream(self.device).wait_stream(s)
            g = torch.cuda.CUDAGraph()
            # Capturing re-runs nothing; but the kernels it records write the cache at `position`,
            # exactly as the warm-up did, so replaying later is consistent.
            with torch.cuda.graph(g):  # a private memory pool per graph: replays interleave freely
                static = self._forward(ids, self.position, self._masks[t])
            self._graphs[t] = (g, static)
            return res
        except RuntimeError as e:
            self.graphs_off(f"CUDA graph capture for T={t}", e)
            return self._forward(ids, self.position, self._masks[t])

    def _step(self, input_ids, position: int, tree=None):
        """One call: (logits, argmax) on the device; the features rows go to the host array."""
        out = self._run_step(input_ids, position, tree)
        if out[2] is not None and self.features is not None:
            self.store_features(int(position), out[2].float().cpu().numpy())
        return out[0], out[1]

    def _run_step(self, input_ids, position: int, tree=None):
        torch = self.torch
        if self._closed:
            raise BackendError("the backend is closed")
        ids_np = self.check_call(input_ids, position)
        t = int(ids_np.shape[0])
        with torch.no_grad():
            src = torch.from_numpy(np.ascontiguousarray(np.tile(ids_np, (self.batch, 1))))
            if self.cuda_graphs and t in self.graph_sizes:
                ids = self._static_ids(t)
                ids.copy_(src, non_blocking=False)
                self.position.fill_(int(position))
                self._static_mask(t, tree)  # the captured graph reads it
                entry = self._graphs.get(t)
                if entry is None:
                    return self._capture(t)
                entry[0].replay()
                return entry[1]
            ids = src.to(self.device)
            self.position.fill_(int(position))
            if tree is not None:
                mask = torch.from_numpy(np.ascontiguousarray(tree)).to(self.device).expand(self.batch, t, t)
            else:
                mask = self._static_mask(t)
            return self._forward(ids, self.position, mask)

    def run_tree(self, input_ids: np.ndarray, position: int, mask: np.ndarray) -> np.ndarray:
        ids, m = self.check_tree_call(input_ids, position, mask)
        logits, _ = self._step(ids, position, tree=m)
        return logits[0].float().cpu().numpy()

    def run(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        logits, _ = self._step(input_ids, position)
        return logits[0].float().cpu().numpy()

    def argmax(self, input_ids: np.ndarray, position: int) -> np.ndarray:
        _, amax = self._step(input_ids, position)
        return amax[0].cpu().numpy().astype(np.int64)

    def draft_greedy(self, token: int, position: int, k: int) -> np.ndarray:
        """Feed `token` at `position`, then each argmax at the next slot, k times; the k tokens.
        With CUDA graphs the k steps are one captured graph (one launch, one host sync)."""
        torch = self.torch
        if k < 1:
            return np.zeros(0, dtype=np.int64)
        self.check_chain(position, k)
        if not (self.cuda_graphs and self.batch == 1):
            return super().draft_greedy(token, position, k)
        with torch.no_grad():
            entry = self._chains.get(k)
            if entry is None:
                return self._capture_chain(k, int(token), int(position))
            g, ids0, pos0, toks = entry
            ids0.fill_(int(token))
            pos0.fill_(int(position))
            g.replay()
            return toks.cpu().numpy().reshape(-1).astype(np.int64)

    def _capture_chain(self, k: int, token: int, position: int) -> np.ndarray:
        """Run the k-step chain once eagerly with the live inputs (that is this call's result), then
        capture it; later calls replay the graph."""
        torch = self.torch
        ids0 = torch.full((1, 1), token, dtype=torch.int64, device=self.device)
        pos0 = torch.full((1,), position, dtype=torch.int64, device=self.device)
        toks = torch.zeros((k,), dtype=torch.int64, device=self.device)
        mask1 = self._static_mask(1)  # [[True]] whatever wrote it last: a tree of one node is its root

        def chain():
            ids, pos = ids0, pos0
            for j in range(k):
                _, amax, _ = self._forward(ids, pos, mask1)
                toks[j : j + 1].copy_(amax[0])
                ids = amax.view(1, 1)
                pos = pos + 1
            return toks

        s = torch.cuda.Stream(device=self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            chain()
        torch.cuda.current_stream(self.device).wait_stream(s)
        result = toks.cpu().numpy().reshape(-1).astype(np.int64)
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):  # records; executes nothing
                chain()
            self._chains[k] = (g, ids0, pos0, toks)
        except RuntimeError as e:
            self.graphs_off(f"capture of the {k}-step draft chain", e)
        return result

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._graphs.clear()
        self._chains.clear()
        self._ids.clear()
        self._masks.clear()
        self._compiled_step = None
        self.cache = None
        self.model = None

    def describe(self) -> dict:
        d = super().describe()
        d.update(
            device=str(self.device),
            dtype=self.dtype_name,
            cuda_graphs=self.cuda_graphs,
            graph_sizes=list(self.graph_sizes),
            compiled=self.compiled,
        )
        if self.device.type == "cuda":
            d["gpu"] = self.torch.cuda.get_device_name(self.device)
        if self.precision_note:
            d["precision_note"] = self.precision_note
        if self.graph_note:
            d["note"] = self.graph_note
        return d
