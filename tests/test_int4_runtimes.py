"""benchmarks/experiments/int4/int4_runtimes.py drives libspecedge through ctypes mirrors of specedge.h's structs: the
mirrors must name the header's fields in its order and keep room after them. A mirror that lacked
specedge_gen_params' `tree` let specedge_gen_params_init write past the Python-owned struct, and the
C worker died with SIGSEGV a few prompts into a benchmark. (tests/test_cpp.py runs the worker
against the built library.)"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

HEADER = Path(__file__).resolve().parents[1] / "cpp" / "include" / "specedge.h"


def c_fields(struct: str) -> list[str]:
    """The member names of `typedef struct NAME { ... } NAME;` in specedge.h, in order."""
    text = HEADER.read_text()
    m = re.search(r"typedef struct %s \{(.*?)\} %s;" % (struct, struct), text, re.S)
    assert m, f"specedge.h has no struct {struct}"
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    names = []
    for decl in body.split(";"):
        decl = re.sub(r"\[[^\]]*\]", "", decl).strip()
        if not decl:
            continue
        first, *more = decl.split(",")
        names.append(re.findall(r"[A-Za-z_]\w*", first)[-1])
        names += [re.findall(r"[A-Za-z_]\w*", d)[-1] for d in more]
    return names


def test_c_fields_reads_declarations_with_pointers_lists_and_arrays():
    assert c_fields("specedge_gen_params")[:3] == ["max_new_tokens", "temperature", "top_k"]
    assert "stop" in c_fields("specedge_gen_params")  # const char* const* stop
    stats = c_fields("specedge_stats")
    assert stats[stats.index("time_draft_s") : stats.index("time_draft_s") + 3] == [
        "time_draft_s",
        "time_verify_s",
        "time_other_s",
    ]
    assert "accepted_histogram" in stats and "n_accepted_histogram" in stats


@pytest.mark.parametrize(
    "mirror,struct,whole",
    [
        ("_OpenOptions", "specedge_open_options", True),
        ("_GenParams", "specedge_gen_params", True),
        ("_Stats", "specedge_stats", False),  # the leading fields the script reads, then room
    ],
)
def test_ctypes_mirrors_match_the_header(load_script, mirror, struct, whole):
    cls = getattr(load_script("benchmarks/experiments/int4/int4_runtimes"), mirror)
    named = [f[0] for f in cls._fields_]
    assert named[-1] == "_rest" and ctypes.sizeof(cls._fields_[-1][1]) >= 256
    header = c_fields(struct)
    if whole:
        assert named[:-1] == header, f"{mirror} mirrors {named[:-1]}, specedge.h has {header}"
    else:
        assert named[:-1] == header[: len(named) - 1]


def test_mirrors_follow_the_headers_abi_version(load_script):
    """The script refuses a library of another ABI version: its mirrors follow one layout."""
    want = int(re.search(r"#define SPECEDGE_ABI_VERSION (\d+)", HEADER.read_text()).group(1))
    assert load_script("benchmarks/experiments/int4/int4_runtimes").ABI_VERSION == want
