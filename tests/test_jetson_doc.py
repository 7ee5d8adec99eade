"""docs/jetson.md's recipes run as written: each `<!-- recipe: JetPack …, TensorRT V -->` block's
specedge commands run on the CPU against a tiny checkpoint, `build-engines` against the TensorRT
stand-in of tests/test_engines.py reporting TensorRT V. The shell lines (sudo, pip) are skipped.
The JetPack 6 recipe runs by default, the others with `-m slow`."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from test_engines import FakeTRT

from specedge.manifest import load_manifest

DOC = Path(__file__).resolve().parents[1] / "docs" / "jetson.md"
RECIPE = re.compile(r"<!-- recipe: (?P<name>[^>]*?), TensorRT (?P<trt>[\d.]+) -->\s*```bash\n(?P<body>.*?)```", re.S)
# a full version string per line, as the tensorrt module of that release reports it
REPORTED = {
    "10.3": "10.3.0.30",
    "10.13": "10.13.0.35",
    "10.14": "10.14.1.48",
    "10.16": "10.16.0.72",
    "11.0": "11.0.0.114",
}


def recipes() -> list[tuple[str, str, list[list[str]]]]:
    out = []
    for m in RECIPE.finditer(DOC.read_text()):
        cmds = []
        for line in m["body"].splitlines():
            argv = shlex.split(line, comments=True)
            if argv and (argv[0] == "export-models" or argv[:1] == ["specedge"]):
                cmds.append(argv)
        out.append((m["name"], m["trt"], cmds))
    return out


def test_the_doc_has_a_recipe_per_line():
    got = {trt: name for name, trt, _ in recipes()}
    assert got == {
        "10.3": "JetPack 6.x",
        "10.13": "JetPack 7.0",
        "10.14": "JetPack 7.1",
        "10.16": "JetPack 7.2",
        "11.0": "JetPack 7.2.2+",
    }
    for name, trt, cmds in recipes():
        assert [c[0] for c in cmds][:1] == ["export-models"] and f"--tensorrt {trt}" in " ".join(cmds[0])
        assert any(c[1:2] == ["build-engines"] for c in cmds), name


def _params():
    for _name, trt, cmds in recipes():
        yield pytest.param(trt, cmds, id=trt, marks=() if trt == "10.3" else (pytest.mark.slow,))


@pytest.mark.parametrize("trt,cmds", list(_params()))
def test_recipe_runs_up_to_build_engines(trt, cmds, tiny_checkpoint_factory, tmp_path, monkeypatch):
    from specedge.cli.export_models import main as export_main
    from specedge.cli.main import main as specedge_main

    monkeypatch.chdir(tmp_path)  # the recipes write bundles/…, relative to here
    ckpt = str(tiny_checkpoint_factory("llama"))
    for argv in cmds:
        if argv[0] == "export-models":
            rc = export_main(argv[1:] + ["--target", ckpt, "--max-seq", "64", "--prefill-chunk", "16", "--quiet"])
        else:
            if argv[1] == "build-engines":
                m = load_manifest(argv[2])
                fake = FakeTRT(REPORTED[trt], m.target, m.kv_mode, m.max_seq)
                monkeypatch.setitem(sys.modules, "tensorrt", fake)
                monkeypatch.setattr("specedge.engines.builder.current_gpu", lambda device_id=0: ("Orin (nvgpu)", "8.7"))
            rc = specedge_main(argv[1:])
        assert rc == 0, f"`{shlex.join(argv)}` exited {rc}"
    m = load_manifest(cmds[0][cmds[0].index("--out") + 1])
    assert m.tensorrt == trt
    # one engine per model: the target, and the self-draft where the line builds its weight-only form
    models = [s for s in (m.target, m.draft) if s.is_model]
    assert fake.calls["builds"] == len(models) and len(fake.calls["parsed"]) == len(models)
