"""Which graph of a model an ONNX Runtime CPU session runs, when an int4 model has two over one
weights file (export/int4_graphs.py): the specedge graph (ai.specedge.MatMulQ41 and the
batch-invariant attention, libspecedge_ops) where its kernels have a fast path on this CPU, its
MatMulNBits twin elsewhere. `int4_kernel` overrides: "specedge" or "matmulnbits" (docs/design.md
"Choosing the int4 kernel at load"). The C++ runtime chooses the same way (cpp/src/ort_backend.cpp).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..manifest import GraphSpec, ModelSpec

CHOICES = ("auto", "specedge", "matmulnbits")


class KernelChoiceError(Exception):
    """The kernel asked for cannot run this bundle here; one sentence for the user."""


@dataclass(frozen=True)
class Choice:
    graph: GraphSpec
    kernel: str | None  # "specedge" or "matmulnbits" for an int4 model, else None
    reason: str

    def describe(self) -> str:
        return f"{self.kernel} ({self.reason})" if self.kernel else ""


def kernels_here() -> tuple[bool, str]:
    """(whether specedge's kernels run fast here, why: their path, or why not)."""
    from .. import custom_ops

    try:
        isa = custom_ops.isa()
    except custom_ops.CustomOpsError:
        return False, "libspecedge_ops.so is not installed (specedge was installed without a C++ compiler)"
    except (OSError, AttributeError) as e:
        return False, f"libspecedge_ops.so does not load ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if isa == "portable":
        return False, "specedge's kernels have no fast path on this CPU (no AVX2)"
    return True, f"specedge's kernels have their {isa} path on this CPU"


def choose(spec: ModelSpec, backend: str, want: str = "auto", note: bool = True) -> Choice:
    """The graph `backend` runs for `spec`, and for an int4 model which kernel and why (a
    fallback to MatMulNBits is noted once per process when `note`)."""
    if want not in CHOICES:
        raise KernelChoiceError(f"int4_kernel must be one of {', '.join(CHOICES)}, got {want!r}")
    mine = [g for g in spec.graphs if backend in g.backends]
    if not mine:
        return Choice(spec.graph_for(backend), None, "")
    fast = next((g for g in mine if g.custom_ops), None)
    plain = next((g for g in mine if not g.custom_ops), None)
    int4 = spec.precision == "int4"
    if fast is None or plain is None:
        only = fast or plain
        kind = "specedge" if only is fast else "matmulnbits"
        if int4 and want not in ("auto", kind):
            raise KernelChoiceError(
                f"--int4-kernel {want}: the {spec.role} model has only a {kind} graph "
                f"(exported with --int4-kernel {kind}); re-export it without --int4-kernel"
            )
        return Choice(only, kind if int4 else None, "the bundle's only graph" if int4 else "")
    if want == "matmulnbits":
        return Choice(plain, "matmulnbits", "asked for with --int4-kernel matmulnbits")
    ok, why = kernels_here()
    if want == "specedge":
        if not ok:
            raise KernelChoiceError(f"--int4-kernel specedge: {why}")
        return Choice(fast, "specedge", "asked for with --int4-kernel specedge; " + why)
    if ok:
        return Choice(fast, "specedge", why)
    if note:
        _note_once(why)
    return Choice(plain, "matmulnbits", why)


_noted = False


def _note_once(why: str) -> None:
    """One note per process when int4 graphs fall back to ONNX Runtime's kernels."""
    global _noted
    if _noted:
        return
    _noted = True
    warnings.warn(
        f"int4 graphs run on ONNX Runtime's MatMulNBits: {why} (exact either way; specedge's kernels "
        "are faster where they run)",
        RuntimeWarning,
        stacklevel=4,
    )
