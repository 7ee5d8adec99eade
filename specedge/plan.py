"""Memory plan: will a bundle fit a device, and up to which max_seq?

Pure arithmetic on the manifest (no GPU, no onnx, no torch), so `specedge plan` answers on a laptop
before anyone copies a bundle to a Jetson or builds an engine there. Every figure is in bytes; the
CLI formats them.

What is counted, per model (draft and target each hold their own buffers):

* weights: `weight_bytes` from the manifest, i.e. the bytes of the graph's weights at the precision
  they are stored in (fp32 / fp16 / bf16 / int8 / int4 + scales). GPU backends keep weights as
  stored; nothing is up-cast at load time. A manifest without `weight_bytes` falls back to
  `num_params * BYTES_PER_PARAM[precision]`.
* KV cache: `ModelSpec.kv_bytes(max_seq, batch)`: 2 (K and V) x layers x batch x kv_heads x max_seq x
  head_dim x bytes of the KV dtype. Static: allocated once at max_seq.
* activations, for the largest call the runtime makes, T_max = max(k + 1, prefill_chunk):
  - logits: the backends keep one static fp32 logits buffer [B, T, V] per captured size
    T in {1, k + 1, prefill_chunk}, so B x (sum of those sizes) x V x 4.
  - attention: the portable graph computes scores as plain MatMul + Softmax in fp32
    (specedge/models/common.py `attend`), i.e. [B, heads, T, keys] for scores and again for the
    probabilities, where keys = max_seq (scatter) or max_seq + T (delta: the new entries are
    concatenated to the cache). One layer is live at a time: 2 x B x heads x T_max x keys x 4.
    `heads` (query heads) is not in the manifest's required fields: it is read from
    `extra["num_attention_heads"]` when present, else hidden_size // head_dim (exact for
    llama / mistral / qwen2 / SmolLM), else num_kv_heads.
  - hidden states: ACT_ROWS fp32 rows of hidden_size per token of T_max (residual stream, norms,
    q/k/v/o projections and the MLP's gate/up/down with an intermediate size of at most 4x hidden:
    16 rows is a conservative bound for those live at the same time).
  - delta buffers (delta mode only): the new K/V entries per captured size,
    2 x layers x B x kv_heads x (sum of sizes) x head_dim x KV bytes.
* once per process: WORKSPACE_BYTES for cuBLAS/cuBLASLt workspaces, the ONNX Runtime arena's
  slack or TensorRT's runtime scratch (not the build-time workspace, see `build-engines
  --workspace-gb`).
* per device: what the OS and the CUDA context take (`DeviceProfile`).

Everything but the KV cache and the attention scores is independent of max_seq, and those two are
linear in it, so the largest max_seq that fits is solved exactly from total(S) = base + slope x S.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .manifest import DTYPE_BYTES, MAX_MAX_SEQ, Manifest, ModelSpec

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Weight bytes per parameter when a manifest lacks weight_bytes. int8/int4 include one fp16 scale
# per block of 32 weights (ONNX MatMulNBits / block-wise DequantizeLinear): 1 + 2/32, 0.5 + 2/32.
BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0625, "int4": 0.5625}
ACT_ROWS = 16  # fp32 rows of hidden_size per token live at once (see module docstring)
WORKSPACE_BYTES = 256 * MiB  # cuBLAS(Lt) workspaces + ORT arena slack / TensorRT runtime scratch
SEQ_ALIGN = 64  # the suggested largest max_seq is rounded down to a multiple of this


@dataclass(frozen=True)
class DeviceProfile:
    """A device's memory as far as the planner is concerned.

    memory_bytes: what the OS (unified memory) or the driver (discrete GPU) reports as total, i.e.
    after firmware carve-outs. os_bytes: what the OS and its services typically hold (0 for a
    discrete GPU, whose host RAM is separate). cuda_context_bytes: a CUDA context with the cuBLAS,
    cuDNN and TensorRT libraries loaded.
    """

    name: str
    description: str
    memory_bytes: int
    os_bytes: int
    cuda_context_bytes: int
    unified: bool
    basis: str = ""

    @property
    def reserve_bytes(self) -> int:
        return self.os_bytes + self.cuda_context_bytes

    @property
    def available_bytes(self) -> int:
        return self.memory_bytes - self.reserve_bytes


def _gib(x: float) -> int:
    return int(round(x * GiB))


# Figures and their basis. Jetson: LPDDR5 shared by CPU and GPU. `free -h` on a fresh JetPack 6
# image reports about 7.4 GiB of the Orin Nano's 8 GiB, 15.3 GiB of the Orin NX's 16 GiB and
# 61.3 GiB of the AGX Orin's 64 GiB (the rest is firmware / carve-out memory); a headless image uses
# about 0.8-1.0 GiB after boot, the desktop image 1.2-1.5 GiB; the first CUDA call plus cuBLAS,
# cuDNN and TensorRT libraries adds about 0.8-1.0 GiB on Orin. Together the OS + CUDA context take
# ~1.5-2.5 GB as the planner's reserve. Thor (JetPack 7): 128 GiB; its carve-out is assumed like
# the AGX Orin's (~4 %), not measured here. Discrete GPUs: the driver's total from nvidia-smi
# (H100 SXM 80 GB: 81559 MiB; H200: 143771 MiB, as read on the H200 this project borrows), host
# RAM is separate (os_bytes 0) and a CUDA context with cuBLAS loaded holds ~0.5 GiB of device
# memory on Hopper. These are typical figures; `--memory-gb` / `--reserve-gb` override them.
DEVICES: dict[str, DeviceProfile] = {
    d.name: d
    for d in (
        DeviceProfile(
            "orin-nano-8gb",
            "Jetson Orin Nano 8GB (unified LPDDR5)",
            _gib(7.4),
            _gib(0.9),
            _gib(0.9),
            True,
            "7.4 GiB visible of 8 GiB; headless JetPack 6 ~0.9 GiB; CUDA+TensorRT context ~0.9 GiB",
        ),
        DeviceProfile(
            "orin-nx-16gb",
            "Jetson Orin NX 16GB (unified LPDDR5)",
            _gib(15.3),
            _gib(1.0),
            _gib(0.9),
            True,
            "15.3 GiB visible of 16 GiB; headless JetPack 6 ~1.0 GiB; CUDA+TensorRT context ~0.9 GiB",
        ),
        DeviceProfile(
            "agx-orin-64gb",
            "Jetson AGX Orin 64GB (unified LPDDR5)",
            _gib(61.3),
            _gib(1.4),
            _gib(1.0),
            True,
            "61.3 GiB visible of 64 GiB; desktop JetPack 6 ~1.4 GiB; CUDA+TensorRT context ~1.0 GiB",
        ),
        DeviceProfile(
            "thor",
            "Jetson AGX Thor 128GB (unified LPDDR5X)",
            _gib(122.9),
            _gib(1.5),
            _gib(1.0),
            True,
            "~122.9 GiB visible of 128 GiB (carve-out assumed like AGX Orin); JetPack 7 ~1.5 GiB; context ~1.0 GiB",
        ),
        DeviceProfile(
            "h100-80gb",
            "NVIDIA H100 80GB (HBM3)",
            81559 * MiB,
            0,
            _gib(0.5),
            False,
            "81559 MiB reported by nvidia-smi; CUDA context with cuBLAS ~0.5 GiB",
        ),
        DeviceProfile(
            "h200-141gb",
            "NVIDIA H200 141GB (HBM3e)",
            143771 * MiB,
            0,
            _gib(0.5),
            False,
            "143771 MiB reported by nvidia-smi; CUDA context with cuBLAS ~0.5 GiB",
        ),
    )
}


MAX_MEMORY_GB = 1 << 20  # 1 PiB: far above any device, low enough that every figure stays exact


def check_memory_gb(memory_gb, name: str = "--memory-gb") -> float:
    """A device's memory in GiB: a finite number above 0 and at most MAX_MEMORY_GB."""
    if isinstance(memory_gb, bool) or not isinstance(memory_gb, (int, float)) or not math.isfinite(memory_gb):
        raise ValueError(f"{name} must be a finite number of GiB, got {memory_gb}")
    if not 0 < memory_gb <= MAX_MEMORY_GB:
        raise ValueError(f"{name} must be more than 0 and at most {MAX_MEMORY_GB} GiB, got {memory_gb:g}")
    return float(memory_gb)


def check_reserve_gb(reserve_gb, memory_bytes: int) -> float:
    """A reserve in GiB: finite, >= 0 and less than the device's memory (else nothing is left)."""
    if isinstance(reserve_gb, bool) or not isinstance(reserve_gb, (int, float)) or not math.isfinite(reserve_gb):
        raise ValueError(f"--reserve-gb must be a finite number of GiB, got {reserve_gb}")
    if reserve_gb < 0:
        raise ValueError(f"--reserve-gb must be >= 0, got {reserve_gb:g}")
    if _gib(reserve_gb) >= memory_bytes:
        raise ValueError(
            f"--reserve-gb {reserve_gb:g} is not less than the device's memory "
            f"({memory_bytes / GiB:g} GiB): nothing would be left for the bundle"
        )
    return float(reserve_gb)


def check_max_seq(max_seq) -> int:
    """A max_seq to plan for: 1 to the manifest's bound (MAX_MAX_SEQ)."""
    if isinstance(max_seq, bool) or not isinstance(max_seq, int) or not 1 <= max_seq <= MAX_MAX_SEQ:
        raise ValueError(f"--max-seq must be between 1 and {MAX_MAX_SEQ}, got {max_seq}")
    return max_seq


def custom_device(memory_gb: float, reserve_gb: float | None = None) -> DeviceProfile:
    """`--memory-gb X`: X GiB of device memory; by default only a CUDA context is reserved."""
    memory_gb = check_memory_gb(memory_gb)
    memory = _gib(memory_gb)
    ctx = _gib(0.5) if reserve_gb is None else _gib(check_reserve_gb(reserve_gb, memory))
    return DeviceProfile(
        "custom",
        f"{memory_gb:g} GiB device",
        memory,
        0,
        ctx,
        False,
        "given with --memory-gb" + ("" if reserve_gb is None else "; reserve given with --reserve-gb"),
    )


def with_reserve(device: DeviceProfile, reserve_gb: float) -> DeviceProfile:
    """The device with its OS + CUDA context reserve replaced (`--reserve-gb`)."""
    reserve_gb = check_reserve_gb(reserve_gb, device.memory_bytes)
    return DeviceProfile(
        device.name,
        device.description,
        device.memory_bytes,
        0,
        _gib(reserve_gb),
        device.unified,
        device.basis + "; reserve given with --reserve-gb",
    )


def step_sizes(k: int, prefill_chunk: int) -> list[int]:
    """The call sizes T a backend keeps static buffers (and CUDA graphs) for: 1, k + 1, chunk."""
    return sorted({1, k + 1, prefill_chunk})


def weight_bytes(spec: ModelSpec) -> int:
    if spec.weight_bytes > 0:
        return int(spec.weight_bytes)
    return int(round(spec.num_params * BYTES_PER_PARAM.get(spec.precision, 4.0)))


def num_query_heads(spec: ModelSpec) -> int:
    h = spec.extra.get("num_attention_heads") if isinstance(spec.extra, dict) else None
    if isinstance(h, int) and not isinstance(h, bool) and h > 0:
        return h
    if spec.hidden_size > 0 and spec.head_dim > 0 and spec.hidden_size % spec.head_dim == 0:
        return spec.hidden_size // spec.head_dim
    return spec.num_kv_heads


@dataclass
class ModelMemory:
    role: str
    kind: str
    family: str = ""
    precision: str = ""
    kv_dtype: str = ""
    weights: int = 0
    kv_cache: int = 0
    logits: int = 0
    attention: int = 0
    hidden: int = 0
    delta: int = 0
    per_seq_token: int = 0  # bytes added per extra token of max_seq (KV + attention scores)

    @property
    def activations(self) -> int:
        return self.logits + self.attention + self.hidden + self.delta

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    def to_json(self) -> dict:
        d = asdict(self)
        d["activations"] = self.activations
        d["total"] = self.total
        return d


def model_memory(spec: ModelSpec, *, max_seq: int, batch: int, k: int, prefill_chunk: int, kv_mode: str) -> ModelMemory:
    """The bytes one model's backend holds on the device (see the module docstring)."""
    if not spec.is_model:  # n-gram drafter: a few host-side dicts, nothing on the device
        return ModelMemory(role=spec.role, kind=spec.kind)
    sizes = step_sizes(k, prefill_chunk)
    t_max = max(sizes)
    kvb = DTYPE_BYTES.get(spec.kv_dtype, 4)
    heads = num_query_heads(spec)
    keys = max_seq + (t_max if kv_mode == "delta" else 0)
    per_token_kv = 2 * spec.num_layers * batch * spec.num_kv_heads * spec.head_dim * kvb
    return ModelMemory(
        role=spec.role,
        kind=spec.kind,
        family=spec.family,
        precision=spec.precision,
        kv_dtype=spec.kv_dtype,
        weights=weight_bytes(spec),
        kv_cache=per_token_kv * max_seq,
        logits=batch * sum(sizes) * spec.vocab_size * 4,
        attention=2 * batch * heads * t_max * keys * 4,
        hidden=ACT_ROWS * batch * t_max * spec.hidden_size * 4,
        delta=(per_token_kv * sum(sizes)) if kv_mode == "delta" else 0,
        per_seq_token=per_token_kv + 2 * batch * heads * t_max * 4,
    )


# ----------------------------------------------------------------------------- the plan


@dataclass
class MemoryPlan:
    device: DeviceProfile
    max_seq: int
    batch: int
    kv_mode: str
    models: list[ModelMemory]
    workspace: int
    needed: int  # models + workspace
    available: int  # device memory - reserve
    fits: bool
    largest_max_seq: int  # 0 when not even the smallest context fits
    position_limit: int = 0  # the models' max_position_embeddings (0: not stated)
    memory_max_seq: int = 0  # largest_max_seq by memory alone, before the position limit
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def headroom(self) -> int:
        return self.available - self.needed

    def to_json(self) -> dict:
        return {
            "device": asdict(self.device) | {"reserve_bytes": self.device.reserve_bytes},
            "max_seq": self.max_seq,
            "batch": self.batch,
            "kv_mode": self.kv_mode,
            "models": [m.to_json() for m in self.models],
            "workspace_bytes": self.workspace,
            "needed_bytes": self.needed,
            "reserve_bytes": self.device.reserve_bytes,
            "total_bytes": self.needed + self.device.reserve_bytes,
            "device_memory_bytes": self.device.memory_bytes,
            "available_bytes": self.available,
            "headroom_bytes": self.headroom,
            "fits": self.fits,
            "largest_max_seq": self.largest_max_seq,
            "position_limit": self.position_limit,
            "reason": self.reason,
            "notes": list(self.notes),
        }


def needed_bytes(manifest: Manifest, max_seq: int) -> tuple[list[ModelMemory], int]:
    models = [
        model_memory(
            s,
            max_seq=max_seq,
            batch=manifest.batch,
            k=manifest.spec_tokens,
            prefill_chunk=manifest.prefill_chunk,
            kv_mode=manifest.kv_mode,
        )
        for s in (manifest.target, manifest.draft)
    ]
    return models, sum(m.total for m in models) + WORKSPACE_BYTES


def position_limit(manifest: Manifest) -> int:
    """The fewest positions any of the bundle's models takes (its max_position_embeddings, which
    export-models checks --max-seq against: GGUF context_length or config.json); 0 when none
    states one."""
    limits = [int(s.extra.get("max_position_embeddings") or 0) for s in (manifest.target, manifest.draft) if s.is_model]
    return min((n for n in limits if n > 0), default=0)


def largest_max_seq(manifest: Manifest, device: DeviceProfile, *, memory_only: bool = False) -> int:
    """The largest max_seq (a multiple of SEQ_ALIGN, at most the manifest's hard bound and, unless
    memory_only, the models' position limit) whose plan fits, solved from total(S) = base + slope * S;
    0 if even SEQ_ALIGN tokens do not fit."""
    _, base = needed_bytes(manifest, 0)
    _, one = needed_bytes(manifest, 1)
    slope = one - base
    room = device.available_bytes - base
    if slope <= 0 or room < slope * SEQ_ALIGN:
        return 0
    s = min(room // slope, MAX_MAX_SEQ)
    s -= s % SEQ_ALIGN
    limit = 0 if memory_only else position_limit(manifest)
    return int(min(s, limit) if limit else s)


def plan_memory(manifest: Manifest, device: DeviceProfile, max_seq: int | None = None) -> MemoryPlan:
    max_seq = manifest.max_seq if max_seq is None else check_max_seq(max_seq)
    models, needed = needed_bytes(manifest, max_seq)
    available = device.available_bytes
    fits = needed <= available
    best = largest_max_seq(manifest, device)
    limit = position_limit(manifest)
    reason = ""
    if not fits:
        reason = (
            f"needs {fmt_bytes(needed)} but {device.name} has {fmt_bytes(available)} available "
            f"({fmt_bytes(device.memory_bytes)} minus {fmt_bytes(device.reserve_bytes)} for the OS and CUDA context)"
        )
        if best > 0:
            reason += f"; max_seq {best} would fit (re-export with a smaller max_seq)"
        else:
            reason += f"; not even max_seq {SEQ_ALIGN} fits: use a smaller model, a lower precision or a bigger device"
    notes = []
    if limit and max_seq > limit:
        notes.append(f"max_seq {max_seq} is above the model's {limit} positions, which export-models refuses")
    if device.unified:
        notes.append("unified memory: CPU and GPU share it, so other processes on the device reduce the headroom")
    notes.append("building TensorRT engines on the device needs extra temporary memory (build-engines --workspace-gb)")
    notes.append(
        "the tensorrt backend keeps one execution context per optimization profile (3), each with the largest "
        "profile's activation memory: allow up to 2 x the activations above again for it"
    )
    return MemoryPlan(
        device=device,
        max_seq=max_seq,
        batch=manifest.batch,
        kv_mode=manifest.kv_mode,
        models=models,
        workspace=WORKSPACE_BYTES,
        needed=needed,
        available=available,
        fits=fits,
        largest_max_seq=best,
        position_limit=limit,
        memory_max_seq=largest_max_seq(manifest, device, memory_only=True),
        reason=reason,
        notes=notes,
    )


# ----------------------------------------------------------------------------- formatting


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= GiB:
        return f"{sign}{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{sign}{n / MiB:.1f} MiB"
    if n >= KiB:
        return f"{sign}{n / KiB:.1f} KiB"
    return f"{sign}{int(n)} B"


def format_plan(plan: MemoryPlan, bundle_name: str = "") -> str:
    d = plan.device
    lines = [
        f"memory plan{(' for ' + bundle_name) if bundle_name else ''} on {d.name}: {d.description}",
        f"  max_seq {plan.max_seq}, batch {plan.batch}, kv mode {plan.kv_mode}",
        "",
        f"  {'model':<8}{'kind':<14}{'weights':>12}{'KV cache':>12}{'activations':>13}{'total':>12}",
    ]
    for m in plan.models:
        kind = "n-gram (host)" if m.kind == "ngram" else f"{m.family} {m.precision}"
        lines.append(
            f"  {m.role:<8}{kind:<14}{fmt_bytes(m.weights):>12}{fmt_bytes(m.kv_cache):>12}"
            f"{fmt_bytes(m.activations):>13}{fmt_bytes(m.total):>12}"
        )
    lines += [
        f"  {'runtime workspace (cuBLAS / ORT arena / TensorRT scratch)':<60}{fmt_bytes(plan.workspace):>11}",
        f"  {'needed by specedge':<60}{fmt_bytes(plan.needed):>11}",
        f"  {'OS + CUDA context (typical for this device)':<60}{fmt_bytes(d.reserve_bytes):>11}",
        f"  {'total':<60}{fmt_bytes(plan.needed + d.reserve_bytes):>11}",
        f"  {'device memory':<60}{fmt_bytes(d.memory_bytes):>11}",
        "",
    ]
    if plan.fits:
        lines.append(f"  fits, {fmt_bytes(plan.headroom)} to spare")
    else:
        lines.append(f"  does not fit: {plan.reason}")
    if plan.largest_max_seq > 0:
        per_k = sum(m.per_seq_token for m in plan.models) * 1024
        if plan.memory_max_seq > plan.largest_max_seq:
            why = (
                f"the model's limit, {plan.position_limit} positions; memory alone would take "
                f"{plan.memory_max_seq}, each 1024 tokens of context costing {fmt_bytes(per_k)}"
            )
        else:
            why = f"memory only; each 1024 tokens of context cost {fmt_bytes(per_k)}"
        lines.append(f"  largest max_seq that fits: {plan.largest_max_seq} ({why})")
    else:
        lines.append("  no max_seq fits")
    lines.append(f"  figures: {d.basis}")
    for n in plan.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)
