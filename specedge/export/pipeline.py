"""checkpoint(s) → bundle: the whole export, written atomically (temp folder, rename at the end)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..checkpoints import resolve
from ..contract import DEFAULT_K_MODEL_DRAFT, DEFAULT_K_NGRAM, MAX_SPEC_TOKENS, NGRAM_SIZES, graph_io
from ..errors import UserError
from ..manifest import (
    KV_DTYPE,
    MANIFEST_NAME,
    MAX_MAX_SEQ,
    PRECISIONS,
    SCHEMA_VERSION,
    GraphSpec,
    Manifest,
    ModelSpec,
    sha256_file,
    write_json_atomic,
)
from .extras import require_export_extra
from .output import OutputPlan, export_record, plan_output, source_identity
from .specedge_kernel import EXPORT_KERNELS, batch_invariant, custom_op_libraries

MIN_MAX_SEQ = 16
DEFAULT_MAX_SEQ = 2048
DEFAULT_PREFILL_CHUNK = 64
# Tokens that end a chat turn in the families we support, stopped on besides the config's eos.
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<eos>", "</s>")


class Progress:
    """Minimal progress sink; the CLI passes one that draws tqdm bars."""

    def stage(self, name: str, total: int | None = None):  # noqa: D401 - context manager
        return _NullStage()

    def note(self, msg: str) -> None:
        pass


class _NullStage:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def update(self, n: int = 1, msg: str | None = None):
        pass


@dataclass
class ExportOptions:
    target: str | None = None
    draft: str | None = "self"  # a checkpoint, "self", "ngram" or None (= ngram)
    out: str | None = None
    precision: str = "fp32"
    # int4: from a GGUF the file's own 4-bit blocks are stored exactly (gguf_exact.py), so the
    # draft agrees with its target far more often than a re-quantized one, and reads fewer bytes
    # per step than int8 (figures: benchmarks/history/self_draft.md)
    # None: int4, or with `tensorrt` the cheapest weight-only form that version builds
    draft_precision: str | None = "int4"
    max_seq: int = DEFAULT_MAX_SEQ
    spec_tokens: int | None = None  # None: by drafter (contract.DEFAULT_K_MODEL_DRAFT / DEFAULT_K_NGRAM)
    kv_mode: str | None = "scatter"  # None: scatter, or with `tensorrt` what that version imports
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    force: bool = False
    block_size: int = 32
    graphs: str = "auto"  # auto | ort | portable | both (see graph_flavours)
    # the target graph also returns hidden states for a draft head (contract.FEATURES_OUTPUT)
    features: bool = False
    # every model graph also takes tree calls (contract.TREE_INPUT; the manifest's graph `tree`)
    tree: bool = False
    # which graphs an int4 model gets for its GGUF Q4_1 weights: "auto" both (one weights file;
    # the runtime picks at load, runtime/int4_kernel.py), "matmulnbits" ONNX Runtime's only (plus
    # a block-min correction), "specedge" ai.specedge.MatMulQ41's only (libspecedge_ops; the graph
    # then needs the library: GraphSpec.custom_ops)
    int4_kernel: str = "auto"
    # a TensorRT version ("10.3"): every graph offered to TensorRT is one it parses and builds
    # (tensorrt_target.py); the manifest records it
    tensorrt: str | None = None


def _resolve_tensorrt(o: ExportOptions):
    """Fill in the options --tensorrt decides (kv mode, draft precision) after refusing the ones
    that contradict it; returns the target (None without --tensorrt)."""
    if o.tensorrt is None:
        o.kv_mode = o.kv_mode or "scatter"
        o.draft_precision = o.draft_precision or "int4"
        return None
    from .tensorrt_target import check_options, default_draft_precision, resolve

    t = resolve(o.tensorrt)
    check_options(
        t,
        kv_mode=o.kv_mode,
        graphs=o.graphs,
        precision=o.precision,
        draft_kind=_draft_kind(o),
        draft_precision=o.draft_precision,
        int4_kernel=o.int4_kernel,
    )
    o.tensorrt = t.version
    # the ONNX Runtime graphs beside TensorRT's keep one int4 kernel (MatMulNBits) rather than a pair
    o.int4_kernel = "matmulnbits"
    o.kv_mode = o.kv_mode or t.kv_mode
    o.draft_precision = o.draft_precision or default_draft_precision(t)
    return t


def validate_options(o: ExportOptions) -> None:
    _resolve_tensorrt(o)
    if o.spec_tokens is None:
        o.spec_tokens = DEFAULT_K_NGRAM if _draft_kind(o) == "ngram" else DEFAULT_K_MODEL_DRAFT
    if o.precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, got '{o.precision}'")
    if o.draft_precision not in PRECISIONS:
        raise UserError(f"--draft-precision must be one of {', '.join(PRECISIONS)}, got '{o.draft_precision}'")
    if o.kv_mode not in ("scatter", "delta"):
        raise UserError(f"--kv-update must be 'scatter' or 'delta', got '{o.kv_mode}'")
    if not (1 <= o.spec_tokens <= MAX_SPEC_TOKENS):
        raise UserError(f"--spec-tokens must be between 1 and {MAX_SPEC_TOKENS}, got {o.spec_tokens}")
    if o.max_seq < MIN_MAX_SEQ:
        raise UserError(f"--max-seq must be at least {MIN_MAX_SEQ}, got {o.max_seq}")
    if o.max_seq > MAX_MAX_SEQ:
        raise UserError(f"--max-seq must be at most {MAX_MAX_SEQ}, got {o.max_seq}")
    if o.prefill_chunk < 1:
        raise UserError(f"--prefill-chunk must be at least 1, got {o.prefill_chunk}")
    graph_flavours(o.graphs, o.kv_mode, o.precision)
    graph_flavours(o.graphs, o.kv_mode, o.draft_precision)
    if o.int4_kernel not in EXPORT_KERNELS:
        raise UserError(f"--int4-kernel must be one of {', '.join(EXPORT_KERNELS)}, got '{o.int4_kernel}'")
    if o.int4_kernel == "specedge" and not _has_int4(o):
        raise UserError(
            "--int4-kernel specedge applies to int4 graphs, and this export has none: "
            "add --precision int4 (or a self-draft with --draft-precision int4)"
        )
    if o.int4_kernel == "specedge":
        _require_kernels()
    if o.block_size not in (16, 32, 64, 128, 256):
        raise UserError(f"--block-size must be 16, 32, 64, 128 or 256, got {o.block_size}")


def check_output(out: Path) -> None:
    """The bundle's temp folder can be made next to `out` (its parent, or the first ancestor that exists)."""
    probe = out.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"output folder '{out}' cannot be created: '{probe}' is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"output folder '{out}' is not writable (no write permission on '{probe}')")
    # Permission bits do not tell everything (root; read-only or virtual file systems such as
    # /proc): create and remove a probe folder where the bundle's temp folder will go.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".specedge-probe-", dir=probe))
    except OSError as e:
        raise UserError(
            f"output folder '{out}' is not writable ({e.strerror or type(e).__name__} in '{probe}')"
        ) from None


def _has_int4(o: ExportOptions) -> bool:
    return "int4" in (o.precision, o.draft_precision if _draft_kind(o) == "self" else None)


def _require_kernels() -> None:
    """--int4-kernel specedge writes graphs that only specedge's kernels run: refused where they
    cannot run, rather than a bundle that fails at generate (auto writes both graphs)."""
    from .. import custom_ops

    try:
        # refused here, before any model loads
        isa = custom_ops.isa(custom_ops.library_path(instead="leave --int4-kernel out (auto: both graphs)"))
    except custom_ops.CustomOpsError as e:
        raise UserError(f"--int4-kernel specedge: {e}") from None
    except (OSError, AttributeError) as e:
        raise UserError(f"--int4-kernel specedge: specedge's kernels do not load here ({e})") from None
    if isa == "portable":
        raise UserError(
            "--int4-kernel specedge: specedge's kernels have no fast path on this CPU (no AVX2): "
            "leave --int4-kernel out (auto) to write both graphs"
        )


def _draft_kind(opts: ExportOptions) -> str:
    return "ngram" if opts.draft in (None, "ngram") else ("self" if opts.draft == "self" else "model")


def _check_positions(opts: ExportOptions, limit: int, whose: str) -> None:
    if limit and opts.max_seq > limit:
        raise UserError(f"--max-seq {opts.max_seq} is above the {whose} {limit} positions")


def recorded_options(opts: ExportOptions) -> dict:
    """The options that shape a bundle, as its manifest records them (keys read as CLI flags)."""
    kind = _draft_kind(opts)
    return {
        "precision": opts.precision,
        "draft_precision": opts.draft_precision if kind != "ngram" else None,
        "max_seq": opts.max_seq,
        "spec_tokens": opts.spec_tokens,
        "kv_update": opts.kv_mode,
        "prefill_chunk": min(opts.prefill_chunk, opts.max_seq),
        "block_size": opts.block_size,
        "graphs": opts.graphs,
        **({"features": True} if opts.features else {}),
        **({"tree": True} if opts.tree else {}),
        **({"int4_kernel": opts.int4_kernel} if _has_int4(opts) and opts.int4_kernel != "matmulnbits" else {}),
        **({"tensorrt": opts.tensorrt} if opts.tensorrt else {}),
    }


def prepare(opts: ExportOptions) -> OutputPlan:
    """Every check that needs no model loaded: options, installed modules, sources, their position
    limit, and what to do with the output folder (export, replace, or reuse a current bundle)."""
    from . import sources

    validate_options(opts)
    require_export_extra()
    kind = _draft_kind(opts)
    tkind, tpath = resolve(opts.target)
    dsource: dict | str = kind
    if kind == "model":
        dkind, dpath = resolve(opts.draft)
        dsource = source_identity(dkind, dpath)
    out = Path(opts.out) if opts.out is not None else Path("bundles") / sources.default_name(tkind, tpath)
    record = export_record(recorded_options(opts), source_identity(tkind, tpath), dsource)
    plan = plan_output(out, record, opts.force)
    if plan.action == "reuse":  # the very files that made a valid bundle: nothing more to check
        return plan
    theader = sources.check_header(tkind, tpath)
    dheader = sources.check_header(dkind, dpath) if kind == "model" else None
    check_output(out)
    _check_positions(opts, theader["max_positions"], "model's")
    if dheader is not None:
        _check_positions(opts, dheader["max_positions"], "draft model's")
    return plan


def export_bundle(
    opts: ExportOptions, progress: Progress | None = None, plan: OutputPlan | None = None
) -> tuple[Path, Manifest]:
    """Run the whole export; returns the bundle path and its manifest. A current bundle already at
    the output (see output.py) is returned as it is: `prepare(opts).action == "reuse"` tells."""
    from . import sources

    progress = progress or Progress()
    plan = plan or prepare(opts)
    if plan.action == "reuse":
        return plan.out, plan.manifest
    draft_kind = _draft_kind(opts)
    with progress.stage("loading the export libraries (torch, transformers, onnx)", total=1) as st:
        _import_export_stack()
        st.update(1)
    with progress.stage("loading target", total=1) as st:
        target = sources.load(opts.target, progress=lambda m: st.update(0, m))
        st.update(1)
    # The header's limit was checked before loading; transformers' config is the last word.
    _check_positions(opts, int(getattr(target.config, "max_position_embeddings", 0) or 0), "model's")
    if opts.prefill_chunk > opts.max_seq:
        opts.prefill_chunk = opts.max_seq
    draft = None
    if draft_kind == "model":
        with progress.stage("loading draft", total=1) as st:
            draft = sources.load(opts.draft, progress=lambda m: st.update(0, m))
            st.update(1)
        sources.check_same_tokenizer(
            target.tokenizer, draft.tokenizer, target.config.vocab_size, draft.config.vocab_size
        )
        _check_positions(opts, int(getattr(draft.config, "max_position_embeddings", 0) or 0), "draft model's")

    out = plan.out
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"cannot create the output folder '{out}': {e.strerror or e}") from None
    try:
        manifest = _write_bundle(tmp, opts, target, draft, draft_kind, progress, plan.record)
        _commit(tmp, out)
    except BaseException:
        with _signals_held():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest.root = out
    return out, manifest


def _import_export_stack() -> None:
    """Import the heavy modules export uses, with Ctrl-C and SIGTERM postponed until they are in.

    Their handlers raise an exception wherever Python happens to be; raised while a C extension
    module (torch, onnx, onnxscript) is being initialised, it left a half-made module behind and
    the process died of SIGSEGV before its clean-up (seen in about 1 of 20 interrupted exports).
    A signal that arrives meanwhile is re-raised, with its usual handler, once the imports are done.
    """
    main = threading.current_thread() is threading.main_thread()
    caught: list[int] = []
    previous = {}
    if main:
        for s in (signal.SIGINT, signal.SIGTERM):
            previous[s] = signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        import onnx  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401

        from ..models import build_model  # noqa: F401
        from . import onnx_graph, quantize, sources  # noqa: F401
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])


@contextlib.contextmanager
def _signals_held():
    """A second Ctrl-C or SIGTERM must not stop the clean-up half way: hold them until it is done."""
    held = (signal.SIGINT, signal.SIGTERM)
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def _commit(tmp: Path, out: Path) -> None:
    """Swap the finished bundle into place; an old bundle is only removed once the new one is in
    (an interrupt between the two renames would leave neither in place: signals wait)."""
    old = None
    with _signals_held():
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def graph_flavours(option: str, kv_mode: str, precision: str, tensorrt: bool = False) -> list[str]:
    """Which graph flavours to ship. auto: the ONNX Runtime flavour for CPU precisions (fp32,
    int8, int4), both flavours for GPU precisions (fp16, bf16: ONNX Runtime CUDA and TensorRT), and
    only the portable one for delta bundles (TensorRT 10.3 on JetPack 6); `tensorrt` (a bundle
    exported for a TensorRT version): the portable one always."""
    if kv_mode == "delta":
        if option == "ort":
            raise UserError(
                "--graphs ort needs --kv-update scatter (the ONNX Runtime flavour updates the cache in place)"
            )
        return ["portable"]
    if option == "auto":
        return ["ort", "portable"] if precision in ("fp16", "bf16") or tensorrt else ["ort"]
    if option == "both":
        return ["ort", "portable"]
    if option in ("ort", "portable"):
        return [option]
    raise UserError(f"--graphs must be auto, ort, portable or both, got '{option}'")


def _backends_for(flavour: str, flavours: list[str], precision: str = "fp32", dq: bool = False) -> list[str]:
    """Which runtime backends may run a graph. int8/int4 graphs hold ONNX Runtime's MatMulNBits,
    which TensorRT cannot parse, so they are never offered to TensorRT (whatever their flavour),
    unless `dq` (--tensorrt): their weights then go through DequantizeLinear, which it parses."""
    ort_only = ["ort-cpu", "ort-cuda"]
    if flavour == "ort" or (precision in ("int8", "int4") and not dq):
        return ort_only
    return ["ort-trt", "tensorrt"] + ([] if "ort" in flavours else ort_only)


def _model_spec(
    role: str,
    ckpt,
    precision: str,
    graphs: list[GraphSpec],
    kv_mode: str,
    max_seq: int,
    proto,
    quantization: dict | None = None,
    feature_layers: tuple[int, ...] | None = None,
) -> ModelSpec:
    from ..models.llama import head_dim_of
    from .quantize import describe, weight_bytes

    cfg = ckpt.config
    spec = ModelSpec(
        role=role,
        kind="model",
        family=cfg.model_type,
        source=ckpt.path,
        precision=precision,
        kv_dtype=KV_DTYPE[precision],
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim_of(cfg),
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        num_params=sum(
            int(v.numel())
            for k, v in ckpt.state_dict.items()
            if k != "lm_head.weight" or not getattr(cfg, "tie_word_embeddings", False)
        ),
        weight_bytes=weight_bytes(proto),
        graphs=graphs,
        quantization=dict(quantization or {}),
    )
    if feature_layers:
        spec.features = {"layers": list(feature_layers), "dim": len(feature_layers) * cfg.hidden_size}
    spec.extra = {
        "weights": describe(precision, spec.quantization) if precision in ("int4", "int8") else precision,
        "max_position_embeddings": int(getattr(cfg, "max_position_embeddings", 0) or 0),
    }
    spec.inputs, spec.outputs = graph_io(spec, kv_mode, max_seq)
    return spec


def _export_one(
    tmp: Path, role: str, ckpt, precision: str, opts: ExportOptions, progress, reuse_fp32: dict | None = None
):
    """Export (or re-use) each flavour's fp32/fp16/bf16 graph, then quantize if asked.
    Returns the spec and, per flavour, the fp32 graph (proto or saved path) for a `self` draft."""
    import onnx

    from ..models import build_model, load_weights
    from ..models.common import default_feature_layers
    from .onnx_graph import OPSET, check_graph, drop_features_output, export_graph, save_with_external_data
    from .quantize import quantize_dq, quantize_weights, share_tied_embedding
    from .tensorrt_target import TRT_OPSET, trt_weight_opset

    flavours = graph_flavours(opts.graphs, opts.kv_mode, precision, bool(opts.tensorrt))
    base_prec = precision if precision in ("fp16", "bf16") else "fp32"
    graphs: list[GraphSpec] = []
    fp32_out: dict = {}
    proto = None
    qinfo: dict = {}
    # A GGUF source: weights from its 4/8-bit blocks are stored exactly (gguf_exact.py).
    gguf = ckpt.path if (getattr(ckpt, "extra", None) or {}).get("gguf") else None
    taps = default_feature_layers(ckpt.config.num_hidden_layers) if role == "target" and opts.features else None
    for flavour in flavours:
        name = "model.onnx" if flavour == flavours[0] else f"model.{flavour}.onnx"
        rel = f"{role}/{name}"
        path = tmp / rel
        reuse = (reuse_fp32 or {}).get(flavour) if base_prec == "fp32" else None
        # TensorScatter is opset 24: only a delta graph can declare an older TensorRT's opset
        opset = TRT_OPSET if opts.tensorrt and opts.kv_mode == "delta" else OPSET
        if reuse is not None:
            # Either the proto itself or the path of the saved fp32 graph (saving turns a proto's
            # tensors into external references, so a saved one is re-read from disk).
            proto = onnx.load(str(reuse)) if isinstance(reuse, Path) else reuse
            # a self-draft made from a target graph with features must not pay for them
            drop_features_output(proto)
        else:
            with progress.stage(f"tracing {role} ({base_prec}, {flavour} graph)", total=1) as st:
                model = build_model(ckpt.config, opts.kv_mode)
                load_weights(model, ckpt.state_dict)
                model.feature_layers = taps
                scratch = tmp / f".{role}-trace" / "model.onnx"
                export_graph(
                    model, scratch, opts.max_seq, opts.kv_mode, base_prec, flavour=flavour, tree=opts.tree, opset=opset
                )
                del model
                proto = onnx.load(str(scratch))
                shutil.rmtree(scratch.parent)
                st.update(1)
        if precision in ("int8", "int4"):
            fp32_out[flavour] = proto
            with progress.stage(f"quantizing {role} ({precision}, block {opts.block_size})", total=1) as st:
                work = onnx.ModelProto()
                work.CopyFrom(proto)
                kernel = opts.int4_kernel if precision == "int4" and flavour == "ort" else "matmulnbits"
                bits = 4 if precision == "int4" else 8
                if opts.tensorrt:  # the standard-op form TensorRT parses (no MatMulNBits)
                    proto = quantize_dq(work, bits, opts.block_size, trt_weight_opset(precision), info=qinfo)
                else:
                    proto = quantize_weights(
                        work,
                        bits,
                        opts.block_size,
                        gguf=gguf,
                        say=lambda m: st.update(0, m),
                        info=qinfo,
                        kernel="specedge" if kernel == "auto" else kernel,
                    )
                st.update(1)
            if kernel == "auto" and custom_op_libraries(proto):
                graphs += _write_int4_pair(tmp, rel, proto, flavour, flavours, opts.tree, progress, role)
                continue
        else:
            share_tied_embedding(proto)
            if base_prec == "fp32":
                fp32_out[flavour] = path
        with progress.stage(f"writing {role} ({flavour} graph)", total=1) as st:
            save_with_external_data(proto, path)
            st.update(1)
        ops = custom_op_libraries(proto)
        # MatMulQ41 is a CPU kernel: under ort-cuda every call would copy its tensors to the host
        backends = ["ort-cpu"] if ops else _backends_for(flavour, flavours, precision, bool(opts.tensorrt))
        graphs.append(
            GraphSpec(
                flavour,
                rel,
                backends,
                [rel + ".data"],
                tree=opts.tree,
                custom_ops=ops,
                batch_invariant=batch_invariant(proto),
                opset=next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
            )
        )
    spec = _model_spec(role, ckpt, precision, graphs, opts.kv_mode, opts.max_seq, proto, qinfo, taps)
    with progress.stage(f"checking {role} graphs", total=len(graphs)) as st:
        for g in graphs:
            check_graph(tmp / g.path, spec, opts.kv_mode, opts.max_seq, tree=g.tree)
            st.update(1)
    return spec, fp32_out


def _write_int4_pair(
    tmp: Path, rel: str, proto, flavour: str, flavours: list[str], tree: bool, progress, role: str
) -> list[GraphSpec]:
    """An int4 model's two graphs (int4_graphs.py): the MatMulNBits twin at `rel`, listed first
    (the one a reader without the choice takes), and the specedge graph beside it, one weights file."""
    from .int4_graphs import matmulnbits_twin, save_pair
    from .onnx_graph import save_with_external_data

    twin = matmulnbits_twin(proto)
    fast_rel = rel[: -len(".onnx")] + ".specedge.onnx"
    with progress.stage(f"writing {role} ({flavour} graphs: MatMulNBits and specedge kernels)", total=1) as st:
        data = save_pair(proto, tmp / fast_rel, twin, tmp / rel, save_with_external_data)
        st.update(1)
    data_rel = str(Path(rel).parent / data)
    return [
        GraphSpec(
            flavour,
            rel,
            _backends_for(flavour, flavours, "int4"),
            [data_rel],
            tree=tree,
            batch_invariant=batch_invariant(twin),
        ),
        GraphSpec(
            flavour,
            fast_rel,
            ["ort-cpu"],
            [data_rel],
            tree=tree,
            custom_ops=custom_op_libraries(proto),
            batch_invariant=batch_invariant(proto),
        ),
    ]


def _write_tokenizer(tmp: Path, ckpt) -> tuple[list[str], str | None, dict]:
    tok = ckpt.tokenizer
    scratch = tmp / ".tok"
    tok.save_pretrained(str(scratch))
    files = []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (scratch / name).is_file():
            shutil.copy(scratch / name, tmp / name)
            files.append(name)
    if "tokenizer.json" not in files:
        raise UserError(f"the tokenizer of '{ckpt.path}' cannot be saved as tokenizer.json (fast tokenizer needed)")
    shutil.rmtree(scratch)
    template = None
    if ckpt.chat_template:
        (tmp / "chat_template.jinja").write_text(ckpt.chat_template, encoding="utf-8")
        template = "chat_template.jinja"
        files.append(template)
    vocab = tok.get_vocab()
    eos: list[int] = []
    cfg_eos = getattr(ckpt.config, "eos_token_id", None)
    for e in cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]:
        if isinstance(e, int):
            eos.append(e)
    if tok.eos_token_id is not None:
        eos.append(int(tok.eos_token_id))
    for t in END_OF_TURN:
        if t in vocab and (t in (ckpt.chat_template or "") or t in (tok.eos_token or "")):
            eos.append(int(vocab[t]))
    eos = sorted(set(eos))
    if not eos:
        raise UserError(f"'{ckpt.path}' defines no end-of-sequence token")
    with_special = tok("a").input_ids
    without = tok("a", add_special_tokens=False).input_ids
    add_bos = tok.bos_token_id is not None and len(with_special) > len(without) and with_special[0] == tok.bos_token_id
    info = {
        "vocab_size": max(vocab.values()) + 1,
        "eos_token_ids": eos,
        "bos_token_id": tok.bos_token_id,
        "add_bos": bool(add_bos),
    }
    return files, template, info


def _write_bundle(tmp: Path, opts: ExportOptions, target, draft, draft_kind: str, progress, record: dict) -> Manifest:
    t0 = time.time()
    tok_files, template, tok_info = _write_tokenizer(tmp, target)
    tspec, fp32 = _export_one(tmp, "target", target, opts.precision, opts, progress)
    if draft_kind == "self":
        dspec, _ = _export_one(tmp, "draft", target, opts.draft_precision, opts, progress, reuse_fp32=fp32)
        dspec.extra["self_draft_of"] = "target"
    elif draft_kind == "model":
        dspec, _ = _export_one(tmp, "draft", draft, opts.draft_precision, opts, progress)
    else:
        dspec = ModelSpec(role="draft", kind="ngram", extra={"ngram_sizes": list(NGRAM_SIZES)})
    del fp32
    files: dict[str, dict] = {}
    rels = list(tok_files)
    for spec in (tspec, dspec):
        for g in spec.graphs:
            rels += [g.path, *g.external_data]
    rels = list(dict.fromkeys(rels))  # an int4 model's two graphs share one weights file
    with progress.stage("checksums", total=len(rels)) as st:
        for rel in rels:
            p = tmp / rel
            files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            st.update(1)
    m = Manifest(
        schema_version=SCHEMA_VERSION,
        created_by=record["created_by"],
        max_seq=opts.max_seq,
        batch=1,
        kv_mode=opts.kv_mode,
        spec_tokens=opts.spec_tokens,
        prefill_chunk=min(opts.prefill_chunk, opts.max_seq),
        tokenizer_vocab_size=tok_info["vocab_size"],
        eos_token_ids=tok_info["eos_token_ids"],
        bos_token_id=tok_info["bos_token_id"],
        add_bos=tok_info["add_bos"],
        tokenizer_files=tok_files,
        chat_template=template,
        target=tspec,
        draft=dspec,
        files=files,
        tensorrt=opts.tensorrt,
        extra={
            "export_seconds": round(time.time() - t0, 1),
            "source_target": target.source,
            "source_draft": opts.draft if draft_kind != "self" else "self",
            "export": record,
        },
    )
    write_json_atomic(tmp / MANIFEST_NAME, m.to_json())
    # Round-trip through the loader: never ship a bundle our own runtime would refuse.
    from ..manifest import load_manifest

    load_manifest(tmp, verify="size")
    json.loads((tmp / MANIFEST_NAME).read_text())
    return m
