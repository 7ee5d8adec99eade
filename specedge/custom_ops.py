"""specedge's own ONNX Runtime CPU kernels (cpp/ops/specedge_ops.cpp, libspecedge_ops.so, built
into the package by `pip install`, and beside libspecedge by the C++ runtime's build): where the
library is, and how a session loads it.

A graph that uses them names the library in its manifest entry (`GraphSpec.custom_ops`): an int4
bundle's specedge graph, whose GGUF Q4_1 weights run in ai.specedge.MatMulQ41 instead of
MatMulNBits plus a block-min correction and whose attention runs in
ai.specedge.GroupQueryAttention (docs/design.md "The specedge int4 kernel")."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path

DOMAIN = "ai.specedge"
LIBRARY = "specedge_ops"  # the name a manifest records
ENV = "SPECEDGE_OPS_LIB"
_FILE = "libspecedge_ops.so"
_PACKAGE = Path(__file__).resolve().parent
_REPO = _PACKAGE.parent


class CustomOpsError(Exception):
    """The library a graph needs cannot be found or loaded; one sentence for the user."""


def _installed() -> Path | None:
    """The copy `pip install` built into the package. An editable install keeps it in
    site-packages, not beside this file: its import hook knows it as a module file."""
    try:
        spec = importlib.util.find_spec(f"{__package__}.{_FILE[:-3]}")
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def candidates() -> list[Path]:
    """Where the library is looked for, in order: $SPECEDGE_OPS_LIB (an override: only there),
    the copy installed with the package, the C++ build of this checkout ($SPECEDGE_CPP_BUILD or
    cpp/build), then an installed copy beside Python's prefix."""
    out = [_PACKAGE / _FILE]
    if os.environ.get(ENV):
        return [Path(os.environ[ENV])]
    installed = _installed()
    if installed is not None and installed not in out:
        out.append(installed)
    build = os.environ.get("SPECEDGE_CPP_BUILD")
    if build:
        out.append(Path(build) / _FILE)
    out += [_REPO / "cpp" / "build" / _FILE, Path(sys.prefix) / "lib" / _FILE, Path("/usr/local/lib") / _FILE]
    return out


# How to get the library, for the messages that miss it: the package build needs a C++ compiler;
# in a checkout, the kernels alone build in seconds where cpp/build is looked in.
HOW_TO_GET = (
    "reinstall specedge where a C++ compiler is present (pip builds them), or build them in a checkout "
    "(cmake -S cpp/ops -B cpp/build && cmake --build cpp/build --target specedge_ops)"
)


def library_path(name: str = LIBRARY, instead: str = "re-export the bundle without --int4-kernel specedge") -> Path:
    """The file of custom-op library `name`, or CustomOpsError saying how to get it (or what to do
    `instead`)."""
    if name != LIBRARY:
        raise CustomOpsError(
            f"the graph needs custom-op library '{name}', which this specedge does not know (it knows '{LIBRARY}')"
        )
    for p in candidates():
        if p.is_file():
            return p
    where = ", ".join(str(p) for p in candidates())
    raise CustomOpsError(
        f"the graph uses specedge's CPU kernels, but {_FILE} was not found (looked in {where}): "
        f"{HOW_TO_GET}, or set {ENV} to its path, or {instead}"
    )


def isa(path: Path | None = None) -> str:
    """Which code path the kernels take on this CPU: "avx512vnni", "avx2" or "portable"
    ($SPECEDGE_OPS_ISA=avx2|portable forces a narrower one; every path gives the same bits)."""
    lib = ctypes.CDLL(str(path or library_path()))
    lib.specedge_ops_isa.restype = ctypes.c_char_p
    return lib.specedge_ops_isa().decode()


SLOW_PATH_WARNING = (
    "specedge's CPU kernels run their portable path on this CPU (it has no AVX2): a step takes "
    "about 10x as long as with AVX2 or AVX-512; re-export the bundle without --int4-kernel specedge "
    "for ONNX Runtime's kernels"
)


def register(session_options, names: list[str]) -> None:
    """Load every library in `names` into onnxruntime SessionOptions (warning once when the
    kernels can only take their slow portable path here)."""
    for name in names:
        path = library_path(name)
        _warn_if_portable(path)
        try:
            session_options.register_custom_ops_library(str(path))
        except Exception as e:  # onnxruntime raises its own Fail type
            raise CustomOpsError(f"cannot load the custom-op library {path}: {str(e).splitlines()[0]}") from None


_warned: set[str] = set()


def _warn_if_portable(path: Path) -> None:
    if str(path) in _warned or os.environ.get("SPECEDGE_OPS_ISA") == "portable":  # asked for: no warning
        return
    _warned.add(str(path))
    try:
        slow = isa(path) == "portable"
    except (OSError, AttributeError):  # a library too old to say; loading it reports what is wrong
        return
    if slow:
        import warnings

        warnings.warn(SLOW_PATH_WARNING, RuntimeWarning, stacklevel=3)
