"""The tree follows its formatters and linter: ruff (format and lint, configured in pyproject.toml)
for Python, clang-format (.clang-format) for C and C++. Both are pinned in the `dev` extra, so a
new release cannot fail an unchanged tree. To fix what these tests report:

    ruff format . && ruff check --fix .
    git ls-files 'cpp/*.cpp' 'cpp/*.h' 'cpp/*.hpp' 'cpp/*.c' | grep -v third_party | xargs clang-format -i
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLANG_FORMAT_VERSION = "23.1.5"  # = the dev extra's pin


def _tool(name: str) -> str:
    """The dev extra's copy, installed beside this Python (not another version on PATH)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed beside {sys.executable}: install the dev extra (pip install -e '.[dev]')")
    return found


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


def _cpp_sources() -> list[str]:
    files = _run("git", "ls-files", "cpp/*.cpp", "cpp/*.h", "cpp/*.hpp", "cpp/*.c").stdout.split()
    if not files:
        pytest.skip("not a git checkout: the C/C++ sources cannot be listed")
    return [f for f in files if "third_party" not in Path(f).parts]


def test_python_is_formatted():
    res = _run(_tool("ruff"), "format", "--check", ".")
    assert res.returncode == 0, f"run `ruff format .`:\n{res.stdout[-4000:]}{res.stderr[-2000:]}"


def test_python_passes_the_linter():
    res = _run(_tool("ruff"), "check", "--output-format", "concise", ".")
    assert res.returncode == 0, (
        f"run `ruff check --fix .`, then fix the rest:\n{res.stdout[-4000:]}{res.stderr[-2000:]}"
    )


def test_cpp_is_formatted():
    tool = _tool("clang-format")
    assert CLANG_FORMAT_VERSION in _run(tool, "--version").stdout, "clang-format is not the dev extra's version"
    files = _cpp_sources()
    assert any(f.startswith("cpp/src/") for f in files)
    res = _run(tool, "--dry-run", "-Werror", "--style=file", *files)
    assert res.returncode == 0, f"run clang-format -i on these files:\n{res.stderr[-4000:]}"


def test_the_formatter_would_catch_a_change(tmp_path):
    """The checks above are not vacuous: each tool refuses a file written against its rules."""
    py = tmp_path / "bad.py"
    py.write_text("import os\nx = {  'a':1 }\n", encoding="utf-8")
    assert _run(_tool("ruff"), "format", "--check", "--config", str(REPO / "pyproject.toml"), str(py)).returncode != 0
    assert _run(_tool("ruff"), "check", "--config", str(REPO / "pyproject.toml"), str(py)).returncode != 0
    cc = tmp_path / "bad.cpp"
    cc.write_text("int  f( int x ){return x;}\n", encoding="utf-8")
    res = _run(_tool("clang-format"), "--dry-run", "-Werror", f"--style=file:{REPO / '.clang-format'}", str(cc))
    assert res.returncode != 0
