"""The README against the CLI: each command's synopsis (a ```text block in README.md starting with
the command) names exactly the options its `--help` shows, and the defaults the help states are
the ones the README states. Adding an option to a command without documenting it fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "export-models": ["-m", "specedge.cli.export_models"],
    "specedge generate": ["-m", "specedge", "generate"],
    "specedge chat": ["-m", "specedge", "chat"],
    "specedge serve": ["-m", "specedge", "serve"],
    "specedge inspect": ["-m", "specedge", "inspect"],
    "specedge bench": ["-m", "specedge", "bench"],
    "specedge plan": ["-m", "specedge", "plan"],
    "specedge build-engines": ["-m", "specedge", "build-engines"],
    "specedge train-draft": ["-m", "specedge", "train-draft"],
}
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _help(command: str) -> str:
    p = subprocess.run(
        [sys.executable, *COMMANDS[command], "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={
            "COLUMNS": "200",
            "PATH": "/usr/bin:/bin",
            **{k: v for k, v in __import__("os").environ.items() if k == "PYTHONPATH"},
        },
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def _usage_options(help_text: str) -> set[str]:
    """The options of the usage line (argparse lists every option there), less argparse's own
    --help and --version (tests/test_first_hour.py checks --version)."""
    usage = help_text.split("\n\n")[0]
    return set(OPTION.findall(usage)) - {"--help", "--version"}


def _synopsis(command: str) -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```text\n(.*?)```", readme, flags=re.S) if b.startswith(command + " ")]
    assert len(blocks) == 1, f"README.md needs exactly one ```text synopsis block starting with '{command} '"
    return blocks[0]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_readme_synopsis_lists_the_options_of_help(command):
    in_help = _usage_options(_help(command))
    in_readme = set(OPTION.findall(_synopsis(command)))
    assert in_help, command
    assert not in_help - in_readme, (
        f"{command}: in --help, missing from the README synopsis: {sorted(in_help - in_readme)}"
    )
    assert not in_readme - in_help, f"{command}: in the README synopsis, not in --help: {sorted(in_readme - in_help)}"


def test_export_models_defaults_agree():
    """Every default export-models has is the one the README states (the self-draft is int4), and
    its help says so too."""
    import argparse

    from specedge.cli.export_models import build_parser

    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    text = " ".join(_help("export-models").split())
    assert "with an int4 self-draft" in text and "(default int4)" in text
    checked = 0
    for action in build_parser()._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        if not long or action.default in (None, False, argparse.SUPPRESS):
            continue
        assert f"`{long[0]} {action.default}`" in readme, (
            f"README does not state the default `{long[0]} {action.default}`"
        )
        if long[0] != "--draft":  # its help words it: "'self' (target at --draft-precision, default)"
            assert f"(default {action.default})" in text.replace("(default)", ""), (
                f"--help hides the default of {long[0]}"
            )
        checked += 1
    assert checked >= 9
