"""The docs against the CLI: each command's synopsis (a ```text block starting with the command, in
exactly one page of README.md and docs/*.md) names exactly the options its `--help` shows and the
same choices, and the defaults the help states are the ones its page states. Adding an option to a
command without documenting it fails here."""

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


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# `--draft {model,ngram,head}` in argparse's usage line; `--draft model|ngram|head` in a synopsis
HELP_CHOICES = re.compile(r"(--[a-z][a-z0-9-]*) \{([^}]*)\}")
DOC_CHOICES = re.compile(r"(--[a-z][a-z0-9-]*)[ =]([a-z0-9][a-z0-9._-]*(?:\|[a-z0-9][a-z0-9._-]*)+)")


def _synopsis(command: str) -> tuple[Path, str]:
    """The page holding the command's synopsis, and the synopsis: exactly one in all the docs."""
    found = [
        (page, b)
        for page in PAGES
        for b in re.findall(r"```text\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
        if b.startswith(command + " ")
    ]
    pages = [str(page.relative_to(REPO)) for page, _ in found]
    assert len(found) == 1, (
        f"README.md and docs/*.md need exactly one ```text synopsis block starting with '{command} ', found {pages}"
    )
    return found[0]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_readme_synopsis_lists_the_options_of_help(command):
    in_help = _usage_options(_help(command))
    page, synopsis = _synopsis(command)
    in_doc = set(OPTION.findall(synopsis))
    assert in_help, command
    assert not in_help - in_doc, (
        f"{command}: in --help, missing from the synopsis in {page.name}: {sorted(in_help - in_doc)}"
    )
    assert not in_doc - in_help, f"{command}: in the synopsis in {page.name}, not in --help: {sorted(in_doc - in_help)}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_synopsis_choices_are_those_of_help(command):
    """An option whose --help lists its choices lists the same ones in the synopsis."""
    usage = _help(command).split("\n\n")[0]
    page, synopsis = _synopsis(command)
    in_doc = {opt: set(values.split("|")) for opt, values in DOC_CHOICES.findall(synopsis)}
    for opt, values in HELP_CHOICES.findall(usage):
        choices = set(values.split(","))
        if opt in in_doc:
            assert in_doc[opt] == choices, (
                f"{command} {opt}: {page.name} lists {sorted(in_doc[opt])}, --help {sorted(choices)}"
            )


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_synopsis_lives_on_its_topic_page(command):
    """The README shows each command's common use; its full synopsis is on one page of docs/."""
    page, _ = _synopsis(command)
    assert page.parent == REPO / "docs", f"{command}: its synopsis is in {page.name}, not in a page of docs/"


def test_export_models_defaults_agree():
    """Every default export-models has is the one its page (docs/export.md) states (the self-draft is
    int4), and its help says so too."""
    import argparse

    from specedge.cli.export_models import build_parser

    page, _ = _synopsis("export-models")
    readme = " ".join(page.read_text(encoding="utf-8").split())
    text = " ".join(_help("export-models").split())
    assert "with an int4 self-draft" in text and "(default int4)" in text
    checked = 0
    for action in build_parser()._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        if not long or action.default in (None, False, argparse.SUPPRESS):
            continue
        assert f"`{long[0]} {action.default}`" in readme, (
            f"{page.name} does not state the default `{long[0]} {action.default}`"
        )
        if long[0] != "--draft":  # its help words it: "'self' (target at --draft-precision, default)"
            assert f"(default {action.default})" in text.replace("(default)", ""), (
                f"--help hides the default of {long[0]}"
            )
        checked += 1
    assert checked >= 9
