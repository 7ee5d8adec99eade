"""Optimization profiles: which shapes a TensorRT engine (or the TensorRT EP) is built for.

The graph contract has one dynamic dimension, T (new tokens per call). The runtime makes three kinds
of call: T = 1 (a draft step or plain decoding), T = k + 1 (target verification) and T = prefill
chunk (prompt processing, whose last chunk may be shorter). Each gets its own profile:

* every size but the largest gets an exact profile (min = opt = max = T): TensorRT picks kernels
  for exactly that shape, and a CUDA graph captured for it replays with fixed shapes;
* the largest (normally the prefill chunk) gets min = 1, opt = max = T, so every T up to it runs
  (a prompt's last, shorter chunk; a draft that proposed fewer than k tokens).

All profiles share one set of weights in one engine; the backend keeps one execution context per
profile. Pure Python: no tensorrt import.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import graph_io
from ..manifest import Manifest, ModelSpec


@dataclass(frozen=True)
class Profile:
    name: str
    t_min: int
    t_opt: int
    t_max: int

    def __post_init__(self):
        if not (1 <= self.t_min <= self.t_opt <= self.t_max):
            raise ValueError(
                f"profile '{self.name}' needs 1 <= min <= opt <= max, got {self.t_min}/{self.t_opt}/{self.t_max}"
            )

    @property
    def exact(self) -> bool:
        return self.t_min == self.t_max

    def covers(self, t: int) -> bool:
        return self.t_min <= t <= self.t_max

    def to_json(self) -> dict:
        return {"name": self.name, "t_min": self.t_min, "t_opt": self.t_opt, "t_max": self.t_max}

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        try:
            return cls(str(d["name"]), int(d["t_min"]), int(d["t_opt"]), int(d["t_max"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed profile entry {d!r}: {e}") from None


def profile_sizes(k: int, prefill_chunk: int) -> list[int]:
    """The call sizes the runtime uses, ascending and without duplicates: 1, k + 1, prefill_chunk."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    return sorted({1, k + 1, prefill_chunk})


def _size_name(t: int, k: int, prefill_chunk: int) -> str:
    names = []
    if t == 1:
        names.append("decode")
    if t == k + 1:
        names.append("verify")
    if t == prefill_chunk:
        names.append("prefill")
    return "+".join(names)


def build_profiles(k: int, prefill_chunk: int) -> list[Profile]:
    sizes = profile_sizes(k, prefill_chunk)
    out = [Profile(_size_name(t, k, prefill_chunk), t, t, t) for t in sizes[:-1]]
    top = sizes[-1]
    out.append(Profile(_size_name(top, k, prefill_chunk), 1, top, top))
    return out


def profiles_for(manifest: Manifest) -> list[Profile]:
    return build_profiles(manifest.spec_tokens, manifest.prefill_chunk)


def range_profile(k: int, prefill_chunk: int) -> Profile:
    """One profile covering every call size, tuned for verification (k + 1). Used for the
    TensorRT execution provider of ONNX Runtime, which is safest with a single profile."""
    top = max(profile_sizes(k, prefill_chunk))
    return Profile("all", 1, min(k + 1, top), top)


def select_profile(profiles: list[Profile], t: int) -> int:
    """Index of the profile a call with T = t runs under: an exact one if any, else the first
    range that covers t."""
    for i, p in enumerate(profiles):
        if p.exact and p.t_min == t:
            return i
    for i, p in enumerate(profiles):
        if p.covers(t):
            return i
    top = max(p.t_max for p in profiles) if profiles else 0
    raise ValueError(f"no optimization profile covers T = {t} (the engine was built for T <= {top})")


def resolve_shape(shape: list, t: int) -> tuple[int, ...]:
    return tuple(t if d == "T" else int(d) for d in shape)


def input_shapes(
    spec: ModelSpec, kv_mode: str, max_seq: int, batch: int, profile: Profile, dynamic_only: bool = True
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """min / opt / max shape of each graph input under `profile`. With dynamic_only, only the inputs
    with a T dimension (TensorRT needs profiles for dynamic inputs only; static ones are fixed)."""
    inputs, _ = graph_io(spec, kv_mode, max_seq, batch)
    out = {}
    for ts in inputs:
        if dynamic_only and "T" not in ts.shape:
            continue
        out[ts.name] = (
            resolve_shape(ts.shape, profile.t_min),
            resolve_shape(ts.shape, profile.t_opt),
            resolve_shape(ts.shape, profile.t_max),
        )
    return out
