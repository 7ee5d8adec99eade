"""Where `train-draft` writes, checked before any work, and what killed runs left behind.

- `check_paths`: the checkpoint folder (created if missing) and the bundle must be folders this
  process can write; a checkpoint file that is not a regular file is refused. Each failure is one
  sentence (UserError), raised before the minutes of data building.
- `lock_bundle`: one train-draft per bundle at a time (an exclusive `flock` on the bundle folder,
  released when the process ends however it ends), which is what makes the clean-up safe.
- `clean_leftovers`: a run killed while writing its head (SIGKILL, power loss) leaves
  `.head-XXXXXXXX.partial` folders, or `head-XXXXXXXX` folders the manifest does not name (written
  but never committed, or emptied while the old head was removed). Under the lock they belong to
  no live run; each is removed only when it holds nothing but the files a head is made of, so a
  folder of the user's that merely has such a name is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import UserError

HEAD_FILES = frozenset({"model.onnx", "model.onnx.data", "draft_vocab.json"})
_LEFTOVER = re.compile(r"^(\.head-[0-9a-f]{8}\.partial|head-[0-9a-f]{8})$")


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _probe_write(folder: Path, what: str) -> None:
    """Create and drop an unnamed file in `folder`: permissions, a read-only or full file system."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UserError(f"{what} '{folder}' is not writable ({_reason(e)}): nothing was trained") from None


def check_paths(bundle: Path, ck_dir: Path) -> None:
    """Refuse, before any work, a checkpoint folder or a bundle this run could not write."""
    if ck_dir.exists() and not ck_dir.is_dir():
        raise UserError(
            f"--checkpoint '{ck_dir}' exists and is not a folder (the checkpoint is a folder): "
            "choose another --checkpoint"
        )
    try:
        ck_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if e.errno in (errno.EEXIST, errno.ENOTDIR) else _reason(e)
        raise UserError(
            f"cannot create the checkpoint folder '{ck_dir}' ({why}): choose another --checkpoint"
        ) from None
    _probe_write(ck_dir, "the checkpoint folder")
    for name in ("checkpoint.pt", "data.npz", "data.json"):
        p = ck_dir / name
        if (p.exists() or p.is_symlink()) and (p.is_symlink() or not p.is_file()):
            raise UserError(
                f"'{p}' in the checkpoint folder is not a regular file: remove it or choose another --checkpoint"
            )
    _probe_write(bundle, "the bundle folder (the head is written into it)")


def lock_bundle(bundle: Path) -> int:
    """Hold an exclusive lock on the bundle folder for this process's lifetime; returns its fd."""
    import fcntl

    fd = os.open(bundle, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"another train-draft is training a head for '{bundle}': wait for it to finish") from None
    return fd


# the temporary files train-draft writes in its checkpoint folder before renaming them
CHECKPOINT_TEMPS = ("checkpoint.tmp", "data.tmp.npz", "data.json.tmp")


def clean_leftovers(bundle: Path, live_head_folders: set[str], ck_dir: Path | None = None) -> list[str]:
    """Remove what killed runs left in `bundle` (see the module docstring) and the temporary files
    of an interrupted save in `ck_dir`; returns the names removed. `live_head_folders`: the
    folders the manifest uses, never touched."""
    removed = []
    for name in CHECKPOINT_TEMPS if ck_dir is not None else ():
        p = ck_dir / name
        if p.is_file() and not p.is_symlink():
            p.unlink()
            removed.append(name)
    for p in sorted(bundle.iterdir()):
        if not _LEFTOVER.match(p.name) or p.name in live_head_folders or p.is_symlink() or not p.is_dir():
            continue
        entries = list(p.iterdir())
        if all(e.name in HEAD_FILES and e.is_file() and not e.is_symlink() for e in entries):
            shutil.rmtree(p)
            removed.append(p.name)
    return removed


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM are ignored while the block runs: a checkpoint being saved on the way
    out is not cut short by a second Ctrl-C. Outside the main thread nothing changes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
