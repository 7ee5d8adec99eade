"""ONNX -> TensorRT plans, built on the device that will run them (`specedge build-engines`).

One plan per model (target, and the draft when it is a model), each with the optimization profiles
of `profiles.py` (T = 1, k + 1 and the prefill chunk) sharing one set of weights, written with a
`<role>.plan.json` (see plan_json.py) into `bundle/engines/<device-tag>/`. The folder is built
under a temporary name and renamed at the end, so a bundle never holds half a set of engines.

Precision: by default the network is *strongly typed*, i.e. TensorRT keeps the types the export
wrote (fp16 / bf16 activations, int8 / int4 weights behind DequantizeLinear). `--fp16` / `--bf16`
build a weakly typed network with that reduced-precision flag instead (for an fp32 bundle).

The ONNX graph is parsed from its file (`OnnxParser.parse_from_file`), so external weight files
next to it are found. An extra `argmax` output (TopK k=1 over the logits, int64 when the network can
cast) lets the backend return greedy tokens without copying [T, V] logits to the host.

`tensorrt` is imported lazily: this module (and the pure checks in it) work without it.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..bundle_files import check_graph_files
from ..contract import ARGMAX_OUTPUT, check_graph_names, expected_names, graph_io
from ..errors import UserError, import_optional
from ..manifest import Manifest, ModelSpec, load_manifest
from ..tensorrt_support import check_bundle, check_bundle_target, installed_line, parse_error_hint, refusal
from .plan_json import (
    TENSORRT_HINT,
    EngineError,
    PlanInfo,
    check_against_manifest,
    check_compatible,
    check_kv_mode_supported,
    current_gpu,
    device_tag,
    engines_root,
    load_plan_info,
    sha256_bytes,
    short_version,
)
from .profiles import input_shapes, profiles_for

GiB = 1 << 30
TIMING_CACHE = "timing.cache"


def import_tensorrt():
    return import_optional("tensorrt", "building TensorRT engines", f"the tensorrt package: {TENSORRT_HINT}", UserError)


@dataclass
class BuildOptions:
    precision: str | None = None  # None: as exported (strongly typed); "fp16" / "bf16": reduced-precision flag
    workspace_gb: float | None = None  # None: TensorRT's default (the device's memory)
    optimization_level: int | None = None  # builder_optimization_level 0..5, None: TensorRT's default (3)
    argmax_output: bool = True
    force: bool = False
    roles: tuple[str, ...] = ("target", "draft")
    device_id: int = 0

    def requested(self) -> dict:
        """The options that make a plan differ (recorded in plan.json, compared for up-to-date)."""
        return {
            "precision": self.precision,
            "workspace_gb": self.workspace_gb,
            "optimization_level": self.optimization_level,
            "argmax_output": self.argmax_output,
        }

    def validate(self) -> None:
        if self.precision not in (None, "fp16", "bf16"):
            raise UserError(f"precision must be fp16 or bf16, got {self.precision!r}")
        if self.workspace_gb is not None and not self.workspace_gb > 0:
            raise UserError(f"--workspace-gb must be positive, got {self.workspace_gb}")
        if self.optimization_level is not None and not 0 <= self.optimization_level <= 5:
            raise UserError(f"--opt-level must be 0..5, got {self.optimization_level}")


def typing_mode(spec_precision: str, requested: str | None, has_strong_typing: bool) -> tuple[bool, list[str]]:
    """(strongly typed?, builder precision flags) for a graph exported at `spec_precision`."""
    if requested in ("fp16", "bf16"):
        return False, [requested.upper()]
    if spec_precision == "fp32":
        return False, []
    if has_strong_typing:
        return True, []
    # TensorRT without strong typing: allow the exported reduced precision explicitly.
    return False, (["BF16"] if spec_precision == "bf16" else ["FP16"])


class _Cancel:
    """Ctrl-C during a build: TensorRT polls the progress monitor, which then asks it to stop."""

    def __init__(self):
        self.flag = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        self.flag = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def _progress_monitor(trt, log: Callable[[str], None], cancel: _Cancel):
    """An IProgressMonitor printing the top two levels of TensorRT's build phases (TensorRT >= 10)."""
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self._depth: dict[str, int] = {}
            self._lock = threading.Lock()

        def phase_start(self, phase_name, parent_phase, num_steps):
            with self._lock:
                depth = (self._depth.get(parent_phase, 0) + 1) if parent_phase else 0
                self._depth[phase_name] = depth
            if depth <= 1:
                log(f"  {'  ' * depth}{phase_name} ({num_steps} step{'s' if num_steps != 1 else ''})")

        def step_complete(self, phase_name, step):
            return not cancel.flag  # False asks TensorRT to cancel the build

        def phase_finish(self, phase_name):
            with self._lock:
                self._depth.pop(phase_name, None)

    return Monitor()


def _check_network(trt, network, manifest: Manifest, spec: ModelSpec, onnx_rel: str) -> None:
    ins = [network.get_input(i).name for i in range(network.num_inputs)]
    outs = [network.get_output(i).name for i in range(network.num_outputs)]
    want_in, want_out = expected_names(spec, manifest.kv_mode, manifest.max_seq, manifest.batch)
    try:
        check_graph_names(spec.role, want_in, want_out, ins, outs)
    except ValueError as e:
        raise UserError(f"{onnx_rel}: {e}") from None
    # Only T may be dynamic: every other dimension must match the manifest.
    specs = {t.name: t for t in graph_io(spec, manifest.kv_mode, manifest.max_seq, manifest.batch)[0]}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        want = specs[t.name].shape
        got = list(t.shape)
        ok = len(got) == len(want) and all(
            (w == "T" and (g == -1 or g >= 1)) or (w != "T" and g == w) for g, w in zip(got, want)
        )
        if not ok:
            raise UserError(f"{onnx_rel}: input '{t.name}' has shape {got}, the manifest says {want}")


def build_engine(
    trt,
    manifest: Manifest,
    spec: ModelSpec,
    out_dir: Path,
    options: BuildOptions,
    gpu: tuple[str, str],
    timing_cache: bytes,
    log: Callable[[str], None],
    quiet: bool = False,
) -> tuple[PlanInfo, bytes]:
    """Build one model's plan into out_dir; returns its PlanInfo and the updated timing cache."""
    graph = spec.graph_for("tensorrt")
    onnx_path = manifest.path(graph.path)
    logger = trt.Logger(trt.Logger.ERROR if quiet else trt.Logger.WARNING)
    builder = trt.Builder(logger)
    has_strong = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
    strongly, flags = typing_mode(spec.precision, options.precision, has_strong)
    net_flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly else 0
    network = builder.create_network(net_flags)
    parser = trt.OnnxParser(network, logger)
    log(f"{spec.role}: parsing {graph.path}")
    if not parser.parse_from_file(str(onnx_path)):
        errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        first = errs[0].strip().splitlines()[0] if errs else "unknown error"
        hint = parse_error_hint(onnx_path, trt.__version__)
        raise UserError(f"TensorRT {short_version(trt.__version__)} cannot parse {graph.path}: {first}{hint}")
    _check_network(trt, network, manifest, spec, graph.path)

    extra_outputs = []
    if options.argmax_output:
        logits = next(
            network.get_output(i) for i in range(network.num_outputs) if network.get_output(i).name == "logits"
        )
        topk = network.add_topk(logits, trt.TopKOperation.MAX, 1, 1 << (len(logits.shape) - 1))
        idx = topk.get_output(1)
        if hasattr(network, "add_cast"):
            idx = network.add_cast(idx, trt.int64).get_output(0)
        idx.name = ARGMAX_OUTPUT
        network.mark_output(idx)
        extra_outputs.append(ARGMAX_OUTPUT)

    config = builder.create_builder_config()
    if options.workspace_gb is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gb * GiB))
    for f in flags:
        config.set_flag(getattr(trt.BuilderFlag, f))
    if options.optimization_level is not None:
        config.builder_optimization_level = int(options.optimization_level)
    cache = config.create_timing_cache(timing_cache or b"")
    config.set_timing_cache(cache, False)  # ignore_mismatch=False: a cache from another GPU is not reused

    profiles = profiles_for(manifest)
    for p in profiles:
        prof = builder.create_optimization_profile()
        for name, (lo, opt, hi) in input_shapes(spec, manifest.kv_mode, manifest.max_seq, manifest.batch, p).items():
            prof.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(prof)
    sizes = ", ".join(f"T={p.t_min}" if p.exact else f"T={p.t_min}..{p.t_max}" for p in profiles)
    log(f"{spec.role}: building ({'strongly typed' if strongly else ' '.join(flags) or 'fp32'}; profiles {sizes})")

    with _Cancel() as cancel:
        monitor = _progress_monitor(trt, log, cancel)
        if monitor is not None:
            config.progress_monitor = monitor
        serialized = builder.build_serialized_network(network, config)
        if cancel.flag:
            raise KeyboardInterrupt
    if serialized is None:
        raise UserError(f"TensorRT could not build the {spec.role} engine (see its messages above)")
    data = bytes(memoryview(serialized))
    plan_file = f"{spec.role}.plan"
    with open(out_dir / plan_file, "wb") as f:
        f.write(data)
    new_cache = bytes(memoryview(config.get_timing_cache().serialize()))
    from .. import __version__

    info = PlanInfo(
        role=spec.role,
        plan_file=plan_file,
        plan_sha256=sha256_bytes(data),
        plan_bytes=len(data),
        tensorrt_version=str(trt.__version__),
        gpu_name=gpu[0],
        compute_capability=gpu[1],
        kv_mode=manifest.kv_mode,
        max_seq=manifest.max_seq,
        batch=manifest.batch,
        precision=spec.precision,
        profiles=profiles,
        onnx_path=graph.path,
        onnx_sha256=str((manifest.files.get(graph.path) or {}).get("sha256", "")),
        build_options={
            "requested": options.requested(),
            "strongly_typed": strongly,
            "precision_flags": flags,
            "workspace_bytes": int(options.workspace_gb * GiB) if options.workspace_gb else None,
            "builder_optimization_level": options.optimization_level,
            "timing_cache": TIMING_CACHE,
        },
        extra_outputs=extra_outputs,
        created_by=f"specedge {__version__}",
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
    from ..manifest import write_json_atomic

    write_json_atomic(out_dir / f"{spec.role}.plan.json", info.to_json())
    log(f"{spec.role}: {plan_file} written ({len(data) / (1 << 20):.1f} MiB)")
    return info, new_cache


def _up_to_date(final: Path, manifest: Manifest, spec: ModelSpec, gpu, trt_version: str, options: BuildOptions) -> bool:
    try:
        info = load_plan_info(final / f"{spec.role}.plan.json")
        check_compatible(info, gpu[0], gpu[1], trt_version)
        check_against_manifest(info, manifest, spec, spec.graph_for("tensorrt").path)
        plan = final / info.plan_file
        if not plan.is_file() or plan.stat().st_size != info.plan_bytes:
            return False
    except EngineError:
        return False
    return info.build_options.get("requested") == options.requested()


def build_engines(
    bundle: str | os.PathLike, options: BuildOptions, log: Callable[[str], None] = print, quiet: bool = False
) -> list[PlanInfo]:
    """Build (or confirm up to date) the plans of a bundle for this device."""
    options.validate()
    manifest = load_manifest(bundle, verify="full")
    # TensorRT's ONNX parser opens the weight files a graph names, like ONNX Runtime: the same check first
    check_graph_files(manifest)
    trt = import_tensorrt()
    check_bundle_target(manifest.root, trt.__version__)
    check_kv_mode_supported(manifest.kv_mode, trt.__version__)
    gpu = current_gpu(options.device_id)
    tag = device_tag(*gpu)
    specs = [s for s in (manifest.target, manifest.draft) if s.is_model and s.role in options.roles]
    if not specs:
        raise UserError("nothing to build: the selected models have no graph (an n-gram draft needs no engine)")
    for s in specs:
        # without --tensorrt, int4/int8 weights are ONNX Runtime's MatMulNBits (never TensorRT's form);
        # a --tensorrt bundle writes them as DequantizeLinear, which the table check below judges
        if s.precision in ("int8", "int4") and not manifest.tensorrt:
            raise UserError(
                f"the {s.role} is {s.precision} (ONNX Runtime's MatMulNBits), which TensorRT cannot parse; "
                "export an fp16/bf16 bundle for TensorRT (export-models --precision fp16 --draft-precision fp16), "
                "or export with --tensorrt VERSION"
            )
    # The parser's own error names one node; the table names every one, with the export flag to use.
    check = check_bundle(
        manifest.root, installed_line(trt.__version__), roles=tuple(s.role for s in specs), manifest=manifest
    )
    if not check.ok:
        raise UserError(refusal(check))
    root = engines_root(manifest.root)
    final = root / tag
    log(f"device {gpu[0]} (sm_{gpu[1].replace('.', '')}), TensorRT {trt.__version__} -> {final}")

    todo = specs
    if final.is_dir() and not options.force:
        todo = [s for s in specs if not _up_to_date(final, manifest, s, gpu, trt.__version__, options)]
        if not todo:
            log(f"engines in {final} are up to date (use --force to rebuild)")
            return [load_plan_info(final / f"{s.role}.plan.json") for s in specs]

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{tag}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        # Keep what is already built for the models not rebuilt now, and the timing cache.
        if final.is_dir():
            for p in final.iterdir():
                role = p.name.split(".", 1)[0]
                if p.is_file() and (p.name == TIMING_CACHE or role not in {s.role for s in todo}):
                    shutil.copy2(p, tmp / p.name)
        cache_path = tmp / TIMING_CACHE
        cache = cache_path.read_bytes() if cache_path.is_file() else b""
        infos = []
        for spec in todo:
            info, cache = build_engine(trt, manifest, spec, tmp, options, gpu, cache, log, quiet)
            infos.append(info)
        with open(cache_path, "wb") as f:
            f.write(cache)
        if final.exists():
            old = root / f".{tag}.old-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    done = {i.role for i in infos}
    return infos + [load_plan_info(final / f"{s.role}.plan.json") for s in specs if s.role not in done]
