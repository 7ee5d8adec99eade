"""The dependency rule of docs/design.md, checked on the source: every module of specedge/ is
parsed (function-level imports included, since a lazy import is still a dependency) and the
import graph must have no cycle and no import from a lower layer to a higher one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "specedge"
DESIGN = ROOT / "docs" / "design.md"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported specedge module, line, at module level) for every import statement in the file.
    `from pkg import x` names the submodule pkg.x when there is one, else pkg itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    top_level = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = []
            for a in node.names:
                sub = f"{mod}.{a.name}"
                targets.append(sub if sub in modules else mod)
        else:
            continue
        for t in targets:
            if t == "specedge" or t.startswith("specedge."):
                while t not in modules:  # `import specedge.x.y` of a name inside a module
                    t = t.rpartition(".")[0]
                found.append((t, node.lineno, id(node) in top_level))
    return found


def third_party_imports(path: Path) -> list[tuple[str, int, bool]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    top_level = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".")[0], node.lineno, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.module.split(".")[0], node.lineno, id(node) in top_level))
    return out


def layers_from_design() -> dict[str, int]:
    """The layer table of docs/design.md: lines `N  unit, unit` in the block after the
    'layers (lowest first)' marker; a unit is a module or package path under specedge."""
    text = DESIGN.read_text(encoding="utf-8")
    m = re.search(r"```text\nlayers \(lowest first\)\n(.*?)```", text, re.S)
    assert m, "docs/design.md has no layer table (a ```text block starting 'layers (lowest first)')"
    layers = {}
    for line in m.group(1).splitlines():
        lm = re.match(r"^\s*(\d+)\s+(.+?)\s*$", line)
        if not lm:
            continue
        for unit in lm.group(2).split(","):
            unit = unit.strip().split()[0]
            layers["specedge" if unit == "specedge" else f"specedge.{unit}"] = int(lm.group(1))
    return layers


def unit_of(module: str, layers: dict[str, int]) -> str:
    """The most specific unit of the table containing `module`."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in layers:
            return cand
    raise AssertionError(f"{module} is in no layer of docs/design.md's table")


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    mods = all_modules()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a path a -> ... -> a, or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str):
        color[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if color.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in color:
                c = visit(m)
                if c:
                    return c
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(edges):
        if n not in color:
            c = visit(n)
            if c:
                return c
    return None


def test_import_graph_parses_relative_and_lazy_imports():
    g = graph()
    # a relative import, a function-level one and a `from package import submodule` are all seen
    assert any(t == "specedge.contract" and top for t, _, top in g["specedge.runtime.backends.binding"])
    assert any(t == "specedge.models" and not top for t, _, top in g["specedge.runtime.backends.torch_backend"])
    assert any(t == "specedge.export.sources" for t, _, _ in g["specedge.export.pipeline"])


def test_find_cycle_reports_a_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None


def test_no_import_cycle():
    g = graph()
    edges = {n: {t for t, _, _ in imps if t != n} for n, imps in g.items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer():
    layers = layers_from_design()
    for name in all_modules():
        unit_of(name, layers)


def test_no_upward_import():
    """A module imports its own unit, or units of strictly lower layers (docs/design.md)."""
    layers = layers_from_design()
    bad = []
    for name, imps in graph().items():
        mine = unit_of(name, layers)
        for target, line, _ in imps:
            theirs = unit_of(target, layers)
            if theirs != mine and layers[theirs] >= layers[mine]:
                bad.append(f"{name}:{line} imports {target} (layer {layers[theirs]} >= {layers[mine]})")
    assert not bad, "imports against the layering rule:\n" + "\n".join(bad)


# Imports that the layer order alone would allow but the design rules out (docs/design.md,
# "The dependency rule"): the runtime runs without torch, transformers and the build-time code.
FORBIDDEN = {"specedge.runtime": ("specedge.export", "specedge.engines.builder")}
TORCH_ONLY_IN_RUNTIME = {"specedge.runtime.backends.torch_backend"}


def test_runtime_never_imports_build_time_code():
    bad = []
    for name, imps in graph().items():
        for scope, banned in FORBIDDEN.items():
            if name == scope or name.startswith(scope + "."):
                for target, line, _ in imps:
                    if any(target == b or target.startswith(b + ".") for b in banned):
                        bad.append(f"{name}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_runtime_needs_no_torch():
    """torch, transformers and the torch model code only in the optional torch backend, and
    there only inside functions (imported on use)."""
    bad = []
    for name, path in all_modules().items():
        if not name.startswith("specedge.runtime"):
            continue
        for mod, line, top in third_party_imports(path):
            if mod in ("torch", "transformers") and (top or name not in TORCH_ONLY_IN_RUNTIME):
                bad.append(f"{name}:{line} imports {mod}")
        for target, line, top in graph()[name]:
            if target.startswith("specedge.models") and (top or name not in TORCH_ONLY_IN_RUNTIME):
                bad.append(f"{name}:{line} imports {target}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("unit", ["specedge.contract", "specedge.errors"])
def test_the_bottom_layer_imports_nothing_of_specedge(unit):
    assert [t for t, _, _ in graph()[unit]] == []


def test_the_runtime_api_is_its_top():
    """runtime/api.py is the public surface (Pipeline, load): the runtime's other modules never
    import it, so the assembly's parts (tokenizer, stream, requests, drafters, backends) stand alone."""
    bad = [
        f"{name}:{line}"
        for name, imps in graph().items()
        if name.startswith("specedge.runtime") and name != "specedge.runtime.api"
        for target, line, _ in imps
        if target == "specedge.runtime.api"
    ]
    assert not bad, "\n".join(bad)
