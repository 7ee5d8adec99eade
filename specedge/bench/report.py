"""BENCHMARKS.md sections: each script owns the text between `<!-- NAME:begin -->` and
`<!-- NAME:end -->` and replaces only that, atomically, so other sections (other scripts, other
devices) keep theirs."""

from __future__ import annotations

import os
from pathlib import Path


def replace_section(path: str | os.PathLike, name: str, body: str, heading: str | None = None) -> None:
    """Put `body` between the NAME markers of `path`; a missing section is appended under
    `heading` (or `## NAME`)."""
    path = Path(path)
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if begin not in text or end not in text:
        text = text.rstrip("\n") + f"\n\n{heading or '## ' + name}\n\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(head + begin + "\n" + body.strip() + "\n" + end + tail, encoding="utf-8")
    os.replace(tmp, path)
