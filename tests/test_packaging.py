"""`pip install` builds specedge's int4 kernels into the package (scikit-build-core, cpp/ops), and
without a C++ compiler still installs, the kernels absent: into fresh virtual environments,
non-editable, an int4 bundle loading on the fast kernel in one and falling back with its note in
the other, exact on both (docs/cpp.md "The kernels in the Python package")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# run inside the fresh environment: where specedge and its kernels are, and greedy output both ways
PROBE = r"""
import json, sys, warnings
import specedge
from specedge import custom_ops
from specedge.runtime.api import load
try:
    lib = str(custom_ops.library_path())
except custom_ops.CustomOpsError:
    lib = None
with warnings.catch_warnings(record=True) as notes:
    warnings.simplefilter("always")
    with load(sys.argv[1], threads=1, verify="none") as pipe:
        prompt = "the cat sat on the mat and the cat sat on the"
        spec = pipe.generate(prompt, max_new_tokens=24, speculative=True)
        alone = pipe.generate(prompt, max_new_tokens=24, speculative=False)
        d = pipe.describe()
print(json.dumps({"specedge": specedge.__file__, "lib": lib, "spec": spec.token_ids, "alone": alone.token_ids,
                  "target": d["target"], "draft": d["draft"],
                  "notes": [str(w.message) for w in notes if "MatMulNBits" in str(w.message)]}))
"""


def _install(venv: Path, *flags: str, **env) -> subprocess.CompletedProcess:
    """A fresh venv with the project installed non-editable (pip's build isolation takes
    scikit-build-core from the configured index); its dependencies come from this environment
    (a .pth line after its own site-packages), so nothing else is installed."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", where], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECEDGE_OPS_LIB", "SPECEDGE_CPP_BUILD")}
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-cache-dir", "-v", *flags, str(REPO)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**clean, **env},
    )


def _probe(venv: Path, bundle: Path) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECEDGE_OPS_LIB", "SPECEDGE_CPP_BUILD")}
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PROBE, str(bundle)],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean,
        cwd=str(venv),
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_pip_install_builds_the_kernels_and_a_machine_without_a_compiler_still_installs(tiny_bundle_factory, tmp_path):
    bundle = tiny_bundle_factory(precision="int4", draft="self", draft_precision="int4")

    r = _install(tmp_path / "with")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = _probe(tmp_path / "with", bundle)
    pkg = Path(got["specedge"]).parent
    assert str(pkg).startswith(str(tmp_path / "with"))  # the installed copy, not this checkout
    assert got["lib"] == str(pkg / "libspecedge_ops.so")
    from specedge import custom_ops

    if custom_ops.isa() != "portable":
        assert got["target"]["graph"] == got["draft"]["graph"] == "model.specedge.onnx"
        assert got["target"]["int4_kernel"].startswith("specedge (")
        assert got["notes"] == []
    assert got["spec"] == got["alone"]  # exact: greedy speculative = target-only

    r = _install(tmp_path / "without", CXX=str(tmp_path / "no-compiler" / "c++"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "py3-none-any" in r.stdout + r.stderr  # the pure-Python retry
    got = _probe(tmp_path / "without", bundle)
    assert got["lib"] is None
    assert got["target"]["graph"] == got["draft"]["graph"] == "model.onnx"
    assert got["target"]["int4_kernel"].startswith("matmulnbits (libspecedge_ops.so is not installed")
    assert len(got["notes"]) == 1  # one note for target and draft
    assert got["spec"] == got["alone"]  # exact: padded steps on the MatMulNBits graph


@pytest.mark.slow
def test_an_editable_install_finds_its_kernels_in_site_packages(tmp_path):
    """pip install -e (scripts/setup.sh): the sources stay here, the built library in the
    environment; custom_ops finds it through the editable install's import hook."""
    r = _install(tmp_path / "ed", "-e")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECEDGE_OPS_LIB", "SPECEDGE_CPP_BUILD")}
    out = subprocess.run(
        [
            str(tmp_path / "ed" / "bin" / "python"),
            "-c",
            "import specedge; from specedge import custom_ops; "
            "print(specedge.__file__); print(custom_ops.library_path())",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean,
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    src, lib = out.stdout.split()
    assert src == str(REPO / "specedge" / "__init__.py")
    assert lib.startswith(str(tmp_path / "ed")) and lib.endswith("specedge/libspecedge_ops.so")
