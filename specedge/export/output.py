"""What to do with the output folder, decided before any model is loaded.

- missing, or an empty folder: export into it;
- a valid specedge bundle made from the same sources with the same options by this specedge
  version and manifest schema ("current"): nothing to do, the caller reuses it;
- any other specedge bundle: refused, or replaced with --force;
- anything else (a file, a folder of the user's): always refused, --force included.

"The same sources" is the resolved file or folder with each file's size and modification time
(what `make` trusts), so a re-downloaded or edited checkpoint makes the bundle stale. The record
is kept in the manifest's `extra.export` entry; bundles written before it existed are stale.

Earlier runs that died (SIGKILL, power loss) leave `.<name>.partial-<pid>` / `.<name>.old-<pid>`
folders next to the bundle; those whose process is gone are removed here.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..errors import UserError
from ..manifest import MANIFEST_NAME, SCHEMA_VERSION, BundleError, Manifest, load_manifest, read_manifest_json

CREATED_BY = f"specedge {__version__} export-models"
# Files of a Hugging Face folder that decide what gets exported (weights, config, tokenizer).
_HF_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".jinja", ".txt", ".gguf")


def source_identity(kind: str | None, path: Path | None) -> dict | None:
    """A checkpoint as recorded in the manifest: its resolved path and, per file, size and mtime."""
    if kind is None:
        return None
    if kind == "gguf":
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in _HF_SUFFIXES)
    return {
        "kind": kind,
        "path": str(path.resolve()),
        "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files},
    }


def export_record(options: dict, target: dict, draft: dict | str) -> dict:
    return {
        "created_by": CREATED_BY,
        "schema_version": SCHEMA_VERSION,
        "options": options,
        "target": target,
        "draft": draft,
    }


@dataclass
class OutputPlan:
    out: Path
    action: str  # "new" | "replace" | "reuse"
    record: dict  # what the new bundle's manifest records in extra.export
    manifest: Manifest | None = None  # the existing bundle's, for "reuse"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale_partials(out: Path) -> None:
    """Remove the temp folders of earlier exports into `out` whose process is gone; refuse while
    another live export is writing the same bundle."""
    parent = out.parent
    if not parent.is_dir():
        return
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(partial|old)-(\d+)$")
    for p in parent.iterdir():
        m = pattern.match(p.name)
        if not m or not p.is_dir() or p.is_symlink():
            continue
        pid = int(m.group(2))
        if pid == os.getpid():
            continue
        if _pid_alive(pid):
            raise UserError(
                f"another export-models (pid {pid}) is writing '{out}' (its temp folder '{p}' exists); "
                "wait for it or choose another --out"
            )
        shutil.rmtree(p, ignore_errors=True)


def _read_manifest_json(out: Path) -> dict | None:
    """The folder's manifest.json as a dict when it is a specedge bundle's, else None."""
    mpath = out / MANIFEST_NAME
    if not mpath.is_file() or mpath.is_symlink():
        return None
    try:
        obj = read_manifest_json(mpath)
    except BundleError:
        return None
    if not isinstance(obj, dict) or not str(obj.get("created_by", "")).startswith("specedge "):
        return None
    return obj


def _differences(old: dict, new: dict) -> list[str]:
    """Which recorded items differ, in words (for the refusal's message)."""
    if not isinstance(old, dict):
        return ["it records no sources and options (written by an older specedge)"]
    diffs = []
    if old.get("created_by") != new["created_by"] or old.get("schema_version") != new["schema_version"]:
        diffs.append(
            f"made by {old.get('created_by', '?')} (schema {old.get('schema_version', '?')}), "
            f"this is {new['created_by']} (schema {new['schema_version']})"
        )
    # sources first: another draft explains the options that follow from it (k, its precision)
    for role in ("target", "draft"):
        o, n = old.get(role), new[role]
        if o != n:
            if _source_name(o) == _source_name(n):
                diffs.append(f"the {role} checkpoint '{_source_name(n)}' changed since")
            else:
                diffs.append(f"{role} {_source_name(o)} there, {_source_name(n)} now")
    oo = old.get("options") if isinstance(old.get("options"), dict) else {}
    no = new["options"]
    for k in no:
        if oo.get(k) != no[k]:
            diffs.append(f"--{k.replace('_', '-')} {oo.get(k)} there, {no[k]} now")
    return diffs


def _source_name(source) -> str | None:
    """A recorded source in words: a checkpoint's path, or the draft kind ('self', 'ngram')."""
    return source.get("path") if isinstance(source, dict) else source


# What specedge itself writes into a bundle besides the files its manifest lists: TensorRT plans
# (build-engines), the manifest's own temp file, and a draft head's folders (train-draft).
_OWN_EXTRAS = re.compile(
    r"^(engines/.+|manifest\.json\.tmp|\.?head-[0-9a-f]{8}(\.partial)?/"
    r"(model\.onnx|model\.onnx\.data|draft_vocab\.json))$"
)


def _unverified(out: Path) -> str | None:
    """Why `out` is not verifiably a specedge bundle (its manifest does not load with every listed
    file at its size, or it holds files the bundle does not account for), or None when it is."""
    try:
        m = load_manifest(out, verify="size")
    except BundleError as e:
        return f"it is damaged ({e})"
    listed = set(m.files) | {MANIFEST_NAME}
    stray = []
    for dirpath, dirnames, filenames in os.walk(out):
        base = Path(dirpath).relative_to(out)
        for name in filenames + [d for d in dirnames if Path(dirpath, d).is_symlink()]:
            rel = (base / name).as_posix()
            if rel not in listed and not _OWN_EXTRAS.match(rel):
                stray.append(rel)
    if stray:
        shown = ", ".join(f"'{r}'" for r in sorted(stray)[:3])
        return f"it holds files its manifest does not list ({shown}{', …' if len(stray) > 3 else ''})"
    return None


def plan_output(out: Path, record: dict, force: bool) -> OutputPlan:
    """Decide about `out` (see the module docstring); raises UserError for a refusal."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(
            f"output path '{out}' exists and is not a folder (or is a symbolic link): nothing replaced; "
            "choose another --out"
        )
    clean_stale_partials(out)
    if not out.exists():
        return OutputPlan(out, "new", record)
    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise UserError(f"output folder '{out}' cannot be read ({e.strerror or type(e).__name__})") from None
    if empty:
        return OutputPlan(out, "replace", record)
    obj = _read_manifest_json(out)
    if obj is None:
        raise UserError(
            f"output folder '{out}' already exists and is not a specedge bundle: nothing replaced "
            "(--force replaces only a specedge bundle; choose another --out)"
        )
    extra = obj.get("extra")
    diffs = _differences(extra.get("export") if isinstance(extra, dict) else None, record)
    damage = None
    if not diffs:
        try:
            manifest = load_manifest(out, verify="size")
        except BundleError as e:
            damage = str(e)
        else:
            return OutputPlan(out, "reuse", record, manifest)
    if force:
        if damage is None:
            damage = _unverified(out)
        if damage is None:
            return OutputPlan(out, "replace", record)
        raise UserError(
            f"output folder '{out}' is not verifiably a specedge bundle: {damage}; nothing replaced "
            "(--force replaces only a bundle whose files match its manifest: remove the folder yourself "
            "or choose another --out)"
        )
    why = f"it is damaged ({damage})" if damage else "; ".join(diffs[:3])
    raise UserError(
        f"output folder '{out}' already exists and holds a specedge bundle that is not current: "
        f"{why} (use --force to replace it)"
    )
