#!/usr/bin/env python
"""The C API's binary interface, as recorded for its ABI version (cpp/abi.json).

libspecedge's soname is libspecedge.so.<SPECEDGE_ABI_VERSION> (cpp/include/specedge.h; CMake reads
it from there). A program built against one layout of the public structs must never load a library
with another: `specedge_gen_params_init` writes the library's struct into the caller's memory, so a
struct that grew at its end is written past the caller's (this is how a ctypes mirror lacking the
`tree` field crashed a benchmark). So every declaration of specedge.h (structs, enums, the callback
type, every SPECEDGE_API function) is recorded here with the ABI version it belongs to, and
tests/test_c_abi.py fails when one changes while the version stays: change a declaration, bump
SPECEDGE_ABI_VERSION, then record it again. New functions and new types may be added under the same
version (an older program never calls them).

    python scripts/c_abi.py            # compare specedge.h with cpp/abi.json (exit 1 on a break)
    python scripts/c_abi.py --write    # record specedge.h (after bumping SPECEDGE_ABI_VERSION)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "cpp" / "include" / "specedge.h"
RECORD = REPO / "cpp" / "abi.json"


def _strip(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _norm(decl: str) -> str:
    decl = re.sub(r"\s+", " ", decl).strip()
    return re.sub(r"\s*([(){}\[\],;*])\s*", r"\1", decl)


def abi_version(text: str) -> int:
    m = re.search(r"#define SPECEDGE_ABI_VERSION (\d+)", text)
    if not m:
        raise SystemExit(f"{HEADER} defines no SPECEDGE_ABI_VERSION")
    return int(m.group(1))


def declarations(text: str) -> dict[str, str]:
    """name -> the declaration without comments, whitespace normalised."""
    code = _strip(text)
    out: dict[str, str] = {}
    for m in re.finditer(r"typedef (struct|enum) (\w+) \{.*?\} \2;", code, re.S):
        out[m.group(2)] = _norm(m.group(0))
    for m in re.finditer(r"typedef [^;{]*\(\*(\w+)\)\([^;]*\);", code):
        out[m.group(1)] = _norm(m.group(0))
    for m in re.finditer(r"SPECEDGE_API ([^;]*?\b(\w+)\([^;]*\));", code, re.S):
        out[m.group(2)] = _norm(m.group(1))
    for m in re.finditer(r"#define (SPECEDGE_MAX_SPEC_TOKENS) (\S+)", code):  # sizes an array in specedge_stats
        out[m.group(1)] = m.group(2)
    return out


def breaks(recorded: dict, text: str) -> list[str]:
    """What in the header breaks the recorded ABI under the same version (empty: compatible)."""
    now = declarations(text)
    if abi_version(text) != recorded["abi_version"]:
        return [
            f"SPECEDGE_ABI_VERSION is {abi_version(text)} but cpp/abi.json records version "
            f"{recorded['abi_version']}: record the new interface (python scripts/c_abi.py --write)"
        ]
    out = []
    for name, decl in recorded["declarations"].items():
        if name not in now:
            out.append(f"{name} was removed")
        elif now[name] != decl:
            out.append(f"{name} changed:\n  recorded: {decl}\n  now:      {now[name]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="record specedge.h's declarations in cpp/abi.json")
    args = ap.parse_args(argv)
    text = HEADER.read_text()
    if args.write:
        RECORD.write_text(
            json.dumps({"abi_version": abi_version(text), "declarations": declarations(text)}, indent=1) + "\n"
        )
        print(f"recorded {len(declarations(text))} declarations of ABI version {abi_version(text)} in {RECORD}")
        return 0
    problems = breaks(json.loads(RECORD.read_text()), text)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        print(
            "a changed declaration needs a new SPECEDGE_ABI_VERSION (cpp/include/specedge.h), then "
            "python scripts/c_abi.py --write",
            file=sys.stderr,
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
