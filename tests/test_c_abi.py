"""The C API's binary interface stays what its ABI version says (scripts/c_abi.py, cpp/abi.json): a
changed struct, enum or function under the same SPECEDGE_ABI_VERSION fails here, so the soname
(libspecedge.so.<version>) always changes with the layouts a program was built against."""

from __future__ import annotations

import json

import pytest


@pytest.fixture()
def abi(load_script):
    return load_script("c_abi")


def test_the_header_matches_its_recorded_abi(abi, capsys):
    assert abi.main([]) == 0, capsys.readouterr().err


def test_a_struct_that_grows_under_the_same_version_is_a_break(abi):
    text = abi.HEADER.read_text()
    recorded = json.loads(abi.RECORD.read_text())
    grown = text.replace("  int tree;", "  int tree;\n  int a_new_field;", 1)
    assert grown != text
    (problem,) = abi.breaks(recorded, grown)
    assert problem.startswith("specedge_gen_params changed:") and "a_new_field" in problem


def test_a_changed_function_or_enum_is_a_break_and_a_new_function_is_not(abi):
    text = abi.HEADER.read_text()
    recorded = json.loads(abi.RECORD.read_text())
    changed = text.replace(
        "SPECEDGE_API int specedge_max_seq(const specedge_model* model);",
        "SPECEDGE_API long specedge_max_seq(const specedge_model* model);",
        1,
    )
    assert changed != text and abi.breaks(recorded, changed)[0].startswith("specedge_max_seq changed:")
    enum = text.replace("SPECEDGE_ERR_IO = 4", "SPECEDGE_ERR_IO = 7", 1)
    assert enum != text and abi.breaks(recorded, enum)[0].startswith("specedge_status changed:")
    added = text.replace(
        "SPECEDGE_API int specedge_abi_version(void);",
        "SPECEDGE_API int specedge_abi_version(void);\nSPECEDGE_API int specedge_new_thing(void);",
        1,
    )
    assert added != text and abi.breaks(recorded, added) == []
    removed = text.replace("SPECEDGE_API int specedge_vocab_size(const specedge_model* model);", "", 1)
    assert abi.breaks(recorded, removed) == ["specedge_vocab_size was removed"]


def test_a_bumped_version_must_be_recorded(abi):
    text = abi.HEADER.read_text()
    recorded = json.loads(abi.RECORD.read_text())
    v = recorded["abi_version"]
    bumped = text.replace(f"#define SPECEDGE_ABI_VERSION {v}", f"#define SPECEDGE_ABI_VERSION {v + 1}", 1)
    (problem,) = abi.breaks(recorded, bumped)
    assert f"SPECEDGE_ABI_VERSION is {v + 1} but cpp/abi.json records version {v}" in problem
