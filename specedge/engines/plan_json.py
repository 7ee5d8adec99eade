"""plan.json: what a TensorRT plan was built for, written beside every plan, checked before loading.

A serialized TensorRT engine only runs with the TensorRT version that built it and on the GPU it was
tuned for (same compute capability; another SKU of the same SM deserializes but runs with tactics
timed elsewhere). Loading one built elsewhere fails deep inside TensorRT, or works slowly, so the
runtime refuses it up front with one sentence:

    engine built for NVIDIA H200 sm_90 with TensorRT 10.15; this device is Orin sm_87 with
    TensorRT 10.3 — rebuild with `specedge build-engines BUNDLE`

Schema (version 1), one file `<role>.plan.json` beside `<role>.plan` in `engines/<device-tag>/`:

    schema_version, role, plan_file, plan_sha256, plan_bytes,
    tensorrt_version ("10.15.1.29"), gpu_name, compute_capability ("9.0"), device_tag,
    kv_mode, max_seq, batch, precision, profiles [{name, t_min, t_opt, t_max}],
    build_options {precision_flags, strongly_typed, workspace_bytes, builder_optimization_level,
    timing_cache}, onnx_path, onnx_sha256, extra_outputs ["argmax"], created_by, created_at

Pure Python; `current_gpu` imports cuda-python (or torch, or runs nvidia-smi) lazily.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BackendError, UserError
from ..tensorrt_support import parse_version  # the TensorRT version parser, shared with the table
from .profiles import Profile

PLAN_SCHEMA_VERSION = 1
ENGINES_DIR = "engines"


class EngineError(BackendError):
    """A plan that cannot be used here (built elsewhere, stale, corrupt, missing)."""


def short_version(s: str, n: int = 2) -> str:
    return ".".join(str(x) for x in parse_version(s)[:n])


# How to get TensorRT's Python bindings, for the builder's and the runtime backend's error messages.
TENSORRT_HINT = (
    "pip install 'specedge[tensorrt]' (on a Jetson, TensorRT's Python bindings come with JetPack: "
    "sudo apt install python3-libnvinfer)"
)
SCATTER_MIN_TRT = (10, 15)  # first TensorRT whose ONNX parser maps TensorScatter to an in-place KV update


def check_kv_mode_supported(kv_mode: str, trt_version: str) -> None:
    """Scatter-mode graphs (ONNX TensorScatter, in-place KV) need TensorRT >= 10.15; delta-mode
    graphs run on any TensorRT 10 (JetPack 6 ships 10.3)."""
    v = parse_version(trt_version)
    if v[0] < 10:
        raise UserError(f"specedge needs TensorRT 10 or newer; this machine has TensorRT {trt_version}")
    if kv_mode == "scatter" and (v + (0,))[:2] < SCATTER_MIN_TRT:
        raise UserError(
            f"this bundle updates the KV cache in place (kv mode 'scatter', ONNX TensorScatter), which TensorRT "
            f"supports from {SCATTER_MIN_TRT[0]}.{SCATTER_MIN_TRT[1]}; this machine has TensorRT {short_version(trt_version)} "
            "— export a delta-mode bundle with `export-models --kv-update delta` (for JetPack 6 / TensorRT 10.3) "
            "or install TensorRT >= 10.15"
        )


def same_trt_version(a: str, b: str) -> bool:
    """Plans are tied to major.minor.patch; the fourth (build) number does not matter."""
    return (parse_version(a) + (0, 0, 0))[:3] == (parse_version(b) + (0, 0, 0))[:3]


def cc_string(cc) -> str:
    """(8, 7) or '8.7' -> '8.7'."""
    if isinstance(cc, (tuple, list)):
        return f"{int(cc[0])}.{int(cc[1])}"
    parse_version(str(cc))
    return str(cc)


def sm_name(cc) -> str:
    major, minor = (parse_version(cc_string(cc)) + (0,))[:2]
    return f"sm_{major}{minor}"


def device_tag(gpu_name: str, cc) -> str:
    """Folder name under bundle/engines/: slug of the GPU name + SM, e.g. 'nvidia-h200-sm90'."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"
    return f"{slug}-{sm_name(cc).replace('_', '')}"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class PlanInfo:
    role: str
    plan_file: str
    plan_sha256: str
    plan_bytes: int
    tensorrt_version: str
    gpu_name: str
    compute_capability: str
    kv_mode: str
    max_seq: int
    batch: int
    precision: str
    profiles: list[Profile]
    onnx_path: str
    onnx_sha256: str
    build_options: dict = field(default_factory=dict)
    extra_outputs: list[str] = field(default_factory=list)
    created_by: str = ""
    created_at: str = ""
    schema_version: int = PLAN_SCHEMA_VERSION

    @property
    def device_tag(self) -> str:
        return device_tag(self.gpu_name, self.compute_capability)

    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "role": self.role,
            "plan_file": self.plan_file,
            "plan_sha256": self.plan_sha256,
            "plan_bytes": self.plan_bytes,
            "tensorrt_version": self.tensorrt_version,
            "gpu_name": self.gpu_name,
            "compute_capability": self.compute_capability,
            "device_tag": self.device_tag,
            "kv_mode": self.kv_mode,
            "max_seq": self.max_seq,
            "batch": self.batch,
            "precision": self.precision,
            "profiles": [p.to_json() for p in self.profiles],
            "build_options": dict(self.build_options),
            "onnx_path": self.onnx_path,
            "onnx_sha256": self.onnx_sha256,
            "extra_outputs": list(self.extra_outputs),
            "created_by": self.created_by,
            "created_at": self.created_at,
        }


def _field(obj: dict, key: str, typ, where: str):
    if key not in obj:
        raise EngineError(f"{where} lacks '{key}' — rebuild with `specedge build-engines`")
    v = obj[key]
    if (typ is int and isinstance(v, bool)) or not isinstance(v, typ):
        raise EngineError(f"{where} has a malformed '{key}' — rebuild with `specedge build-engines`")
    return v


def parse_plan_info(obj, where: str = "plan.json") -> PlanInfo:
    if not isinstance(obj, dict):
        raise EngineError(f"{where} is not a JSON object — rebuild with `specedge build-engines`")
    version = obj.get("schema_version")
    if version != PLAN_SCHEMA_VERSION:
        raise EngineError(
            f"{where} has schema version {version!r}, this specedge reads {PLAN_SCHEMA_VERSION} — "
            "rebuild with `specedge build-engines`"
        )
    plan_file = _field(obj, "plan_file", str, where)
    if "/" in plan_file or "\\" in plan_file or plan_file in ("", ".", ".."):
        raise EngineError(f"{where} names a plan file outside its folder: {plan_file!r}")
    try:
        profiles = [Profile.from_json(p) for p in _field(obj, "profiles", list, where)]
        cc = cc_string(_field(obj, "compute_capability", str, where))
        parse_version(_field(obj, "tensorrt_version", str, where))
    except ValueError as e:
        raise EngineError(f"{where} is malformed ({e}) — rebuild with `specedge build-engines`") from None
    if not profiles:
        raise EngineError(f"{where} lists no optimization profile — rebuild with `specedge build-engines`")
    sha = _field(obj, "plan_sha256", str, where)
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise EngineError(f"{where} has a malformed plan_sha256 — rebuild with `specedge build-engines`")
    return PlanInfo(
        role=_field(obj, "role", str, where),
        plan_file=plan_file,
        plan_sha256=sha,
        plan_bytes=_field(obj, "plan_bytes", int, where),
        tensorrt_version=obj["tensorrt_version"],
        gpu_name=_field(obj, "gpu_name", str, where),
        compute_capability=cc,
        kv_mode=_field(obj, "kv_mode", str, where),
        max_seq=_field(obj, "max_seq", int, where),
        batch=_field(obj, "batch", int, where),
        precision=_field(obj, "precision", str, where),
        profiles=profiles,
        onnx_path=_field(obj, "onnx_path", str, where),
        onnx_sha256=_field(obj, "onnx_sha256", str, where),
        build_options=dict(obj.get("build_options") or {}),
        extra_outputs=[str(x) for x in obj.get("extra_outputs") or []],
        created_by=str(obj.get("created_by", "")),
        created_at=str(obj.get("created_at", "")),
    )


def load_plan_info(path: Path) -> PlanInfo:
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EngineError(f"{path} is missing — build engines with `specedge build-engines`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineError(f"cannot read {path} ({e}) — rebuild with `specedge build-engines`") from None
    return parse_plan_info(obj, str(path))


def describe_target(gpu_name: str, cc, trt_version: str, other_trt: str | None = None) -> str:
    """'NVIDIA H200 sm_90 with TensorRT 10.15' (full version when the short forms would tie)."""
    v = short_version(trt_version)
    if other_trt is not None and short_version(other_trt) == v and not same_trt_version(trt_version, other_trt):
        v = short_version(trt_version, 3)
    return f"{gpu_name} {sm_name(cc)} with TensorRT {v}"


def mismatch_message(info: PlanInfo, gpu_name: str, cc, trt_version: str, bundle: str = "BUNDLE") -> str:
    built = describe_target(info.gpu_name, info.compute_capability, info.tensorrt_version, trt_version)
    here = describe_target(gpu_name, cc, trt_version, info.tensorrt_version)
    return f"engine built for {built}; this device is {here} — rebuild with `specedge build-engines {bundle}`"


def check_compatible(info: PlanInfo, gpu_name: str, cc, trt_version: str, bundle: str = "BUNDLE") -> None:
    """Refuse a plan built with another TensorRT version, for another SM or another GPU model."""
    same_sm = cc_string(cc) == info.compute_capability
    same_gpu = info.gpu_name.strip().lower() == gpu_name.strip().lower()
    if not (same_trt_version(info.tensorrt_version, trt_version) and same_sm and same_gpu):
        raise EngineError(mismatch_message(info, gpu_name, cc, trt_version, bundle))


def check_against_manifest(info: PlanInfo, manifest, spec, onnx_path: str, bundle: str = "BUNDLE") -> None:
    """The plan must come from this bundle's graph, with its kv mode and shapes."""
    rebuild = f"rebuild with `specedge build-engines {bundle}`"
    if info.role != spec.role:
        raise EngineError(f"the {spec.role} engine's plan.json describes the {info.role} model — {rebuild}")
    if info.kv_mode != manifest.kv_mode or info.max_seq != manifest.max_seq or info.batch != manifest.batch:
        raise EngineError(
            f"the {spec.role} engine was built for kv mode {info.kv_mode}, max_seq {info.max_seq}, batch {info.batch}; "
            f"the bundle has {manifest.kv_mode}, {manifest.max_seq}, {manifest.batch} — {rebuild}"
        )
    want = (manifest.files.get(onnx_path) or {}).get("sha256")
    if info.onnx_path != onnx_path or (want and want != info.onnx_sha256):
        raise EngineError(f"the {spec.role} engine was built from another {onnx_path} than the bundle's — {rebuild}")


def verify_plan_bytes(info: PlanInfo, data: bytes, where: str) -> None:
    if len(data) != info.plan_bytes or sha256_bytes(data) != info.plan_sha256:
        raise EngineError(
            f"{where} does not match its plan.json checksum — rebuild with `specedge build-engines --force`"
        )


def engines_root(bundle_root: Path) -> Path:
    return Path(bundle_root) / ENGINES_DIR


def other_engines(bundle_root: Path, role: str) -> list[PlanInfo]:
    """plan.json files for `role` in every device folder of the bundle (unreadable ones skipped)."""
    out = []
    root = engines_root(bundle_root)
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        p = d / f"{role}.plan.json"
        if p.is_file():
            try:
                out.append(load_plan_info(p))
            except EngineError:
                continue
    return out


def no_engine_message(bundle_root: Path, role: str, gpu_name: str, cc, trt_version: str) -> str:
    bundle = str(bundle_root)
    others = other_engines(bundle_root, role)
    if others:
        return mismatch_message(others[0], gpu_name, cc, trt_version, bundle)
    return (
        f"the bundle has no TensorRT engine for this device ({describe_target(gpu_name, cc, trt_version)}) — "
        f"build one with `specedge build-engines {bundle}`"
    )


# ----------------------------------------------------------------------------- the current GPU


def current_gpu(device_id: int = 0) -> tuple[str, str]:
    """(GPU name, compute capability 'X.Y') of CUDA device `device_id`, from cuda-python, else torch,
    else nvidia-smi. Raises EngineError when none can tell."""
    try:
        try:
            from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
        except ImportError:
            from cuda import cudart  # type: ignore[no-redef]  # older cuda-python
        err, prop = cudart.cudaGetDeviceProperties(device_id)
        if int(err) == 0:
            name = prop.name
            if isinstance(name, (bytes, bytearray)):
                name = bytes(name).split(b"\0", 1)[0].decode("utf-8", "replace")
            return str(name).strip(), f"{prop.major}.{prop.minor}"
    except Exception:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(device_id)
            return torch.cuda.get_device_name(device_id), f"{major}.{minor}"
    except Exception:
        pass
    try:
        import subprocess

        out = (
            subprocess.run(
                ["nvidia-smi", f"--id={device_id}", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
            .stdout.strip()
            .splitlines()
        )
        if out:
            name, cc = [x.strip() for x in out[0].rsplit(",", 1)]
            return name, cc_string(cc)
    except Exception:
        pass
    raise EngineError(
        f"cannot identify CUDA device {device_id}: install cuda-python (pip install 'specedge[tensorrt]') "
        "or check that the NVIDIA driver is loaded"
    )
