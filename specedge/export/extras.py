"""The export half's third-party modules (the `export` extra): found without importing them.

A runtime-only install (`pip install specedge`) has the `export-models` script too; what it lacks
must be one sentence naming the extra, not an error about the file it was given.
"""

from __future__ import annotations

import importlib.util

from ..errors import UserError

# Import names of the `export` extra in pyproject.toml that the export code imports.
EXPORT_MODULES = ("torch", "transformers", "onnx", "onnxscript", "onnx_ir", "gguf", "safetensors")
INSTALL_HINT = "pip install 'specedge[export]' (from a clone: pip install -e '.[export]')"


def missing_export_modules() -> list[str]:
    missing = []
    for name in EXPORT_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken install or a module set to None in sys.modules
            found = False
        if not found:
            missing.append(name)
    return missing


def missing_extra_error(names: list[str]) -> UserError:
    return UserError(
        f"export-models needs the 'export' extra, which is not installed (missing: {', '.join(names)}): {INSTALL_HINT}"
    )


def require_export_extra() -> None:
    missing = missing_export_modules()
    if missing:
        raise missing_extra_error(missing)
