"""What a new user meets first, outside export-models (tests/test_export_cli.py) and the README
synopses (tests/test_cli_help.py): a refusal before any weights load, and progress that moves."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _base_model_bundle(tiny_bundle_factory, tmp_path) -> Path:
    """A copy of a tiny bundle without a chat template (as a base model's is) whose target
    weights are truncated, so that loading it would fail."""
    b = tmp_path / "base-model"
    shutil.copytree(tiny_bundle_factory(), b)
    m = json.loads((b / "manifest.json").read_text())
    m["tokenizer"]["chat_template"] = None
    m["tokenizer"]["files"] = [f for f in m["tokenizer"]["files"] if f != "chat_template.jinja"]
    m["files"].pop("chat_template.jinja", None)
    (b / "chat_template.jinja").unlink()
    (b / "manifest.json").write_text(json.dumps(m))
    # Loading would fail on this truncated graph: the refusal must come first.
    data = b / "target" / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:64])
    return b


def test_chat_on_a_bundle_without_template_is_refused_before_loading(tiny_bundle_factory, tmp_path):
    b = _base_model_bundle(tiny_bundle_factory, tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "generate", str(b), "Hello", "--chat"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [
        "error: the bundle has no chat template (a base model?): drop --chat and give a plain prompt"
    ]
    # Without --chat the damage is what is reported.
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "generate", str(b), "Hello"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 2 and "model.onnx.data" in p.stderr


def test_chat_command_on_a_bundle_without_template_is_refused_before_loading(tiny_bundle_factory, tmp_path):
    b = _base_model_bundle(tiny_bundle_factory, tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "chat", str(b)],
        input="Hello\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [
        "error: the bundle has no chat template (a base model?): use `specedge generate` for plain prompts"
    ]
    assert p.stdout == ""


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _ticking_output(monkeypatch, step: str) -> str:
    from specedge import progress

    monkeypatch.setattr(progress, "TICK_S", 0.05)
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    with progress.TickingBar("tracing target (fp32, ort graph)", total=1) as bar:
        bar.update(0, step)
        time.sleep(0.6)  # one long step: no update from the caller
        bar.update(1)
    return err.getvalue()


def test_the_bar_redraws_during_a_long_step_and_names_it_in_full(monkeypatch):
    step = "loading SmolLM2-135M-Instruct.Q4_1.gguf (dequantizing GGUF), a step name well over sixty characters"
    out = _ticking_output(monkeypatch, step)
    frames = [f for f in out.split("\r") if f.strip()]
    during = [f for f in frames if step in f and "0/1" in f]
    assert len(during) >= 5, f"the bar was drawn {len(during)} times during a 0.6 s step:\n{out!r}"
    assert f"tracing target (fp32, ort graph): {step}" in out


def test_off_a_terminal_a_stage_writes_lines_at_its_steps_not_at_every_tick(monkeypatch):
    """A log file gets whole lines: the stage's start, each step's start, the first status, one
    line per interval while nothing changes, its end; not a redraw per tick or per update."""
    from specedge import progress

    monkeypatch.setattr(progress, "TICK_S", 0.01)
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.25)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with progress.TickingBar("quantizing draft", total=400) as bar:
        bar.step("packing")
        for _ in range(200):
            bar.update(1)  # many quick updates: no line of their own
        bar.status("loss 1.0")  # the step's first status: a line
        bar.status("loss 1.0")  # later ones wait for the interval
        time.sleep(0.6)  # one long step: a line per interval
        bar.update(200, "checking")
    out = err.getvalue()
    assert "\r" not in out and out.endswith("\n")
    lines = out.splitlines()
    assert lines[0] == "quantizing draft 0/400 [00:00]"
    assert lines[1] == "quantizing draft: packing 0/400 [00:00]"
    assert lines[2] == "quantizing draft: packing 200/400 (loss 1.0) [00:00]"
    waiting = lines[3:-2]
    assert 1 <= len(waiting) <= 3, lines
    assert all(w.startswith("quantizing draft: packing 200/400 (loss 1.0) [00:0") for w in waiting), lines
    assert lines[-2].startswith("quantizing draft: checking 200/400 (loss 1.0) [00:0")
    assert lines[-1].startswith("quantizing draft 400/400 (loss 1.0) [00:0")


def test_quiet_draws_nothing(monkeypatch):
    from specedge import progress

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with progress.TickingBar("stage", total=2, quiet=True) as bar:
        bar.update(1, "a step")
        bar.step("another")
    assert err.getvalue() == ""


def test_export_progress_names_every_stage_in_full(tiny_checkpoint_factory, tmp_path):
    out = tmp_path / "bundle"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "specedge.cli.export_models",
            "--target",
            str(tiny_checkpoint_factory("llama")),
            "--out",
            str(out),
            "--max-seq",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    final = [f.strip() for line in p.stderr.splitlines() for f in line.split("\r")[-1:] if f.strip()]
    for stage in (
        "loading target",
        "tracing target (fp32, ort graph)",
        "writing target (ort graph)",
        "quantizing draft (int4, block 32)",
        "checksums",
    ):
        assert any(stage in f for f in final), (stage, final)
    assert all(f.endswith("]") for f in final), final  # each stage line ends with its elapsed time


def test_generate_shows_loading_progress_on_a_terminal_only(tiny_bundle_factory):
    """On a terminal, stderr shows the bundle loading step by step; piped, stderr stays for the
    stats (and errors) alone."""
    import os
    import pty

    bundle = tiny_bundle_factory()
    cmd = [sys.executable, "-m", "specedge", "generate", str(bundle), "Hello", "--max-new-tokens", "4", "--stats"]
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # a 200-column terminal
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, text=True, timeout=300, cwd=REPO)
        os.close(slave)
        slave = -1
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not data:
                break
            chunks.append(data)
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert p.returncode == 0
    shown = b"".join(chunks).decode("utf-8", "replace")
    for step in ("checking files (sha256)", "target session (ort-cpu)", "draft session (ort-cpu)", "warm-up"):
        assert f"loading {bundle}: {step}" in shown, shown
    assert "stats: " in shown
    piped = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert piped.returncode == 0 and piped.stderr.startswith("stats: ") and "loading" not in piped.stderr


def test_version_prints_the_version_and_exits_0():
    import tomllib

    want = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for prog, module in (("specedge", "specedge"), ("export-models", "specedge.cli.export_models")):
        p = subprocess.run(
            [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120, cwd=REPO
        )
        assert (p.returncode, p.stdout, p.stderr) == (0, f"{prog} {want}\n", ""), prog
