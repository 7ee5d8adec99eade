"""Every relative link and every `#anchor` in README.md and docs/*.md resolves: the file or folder
exists and, for an anchor, the page it points to has a heading with that slug as GitHub makes it
(lower case, punctuation dropped, spaces to hyphens, `-1`, `-2`, ... for repeats) or an explicit
`<a id=...>` / `<a name=...>`. Links inside code (fenced blocks, `inline code`) are not links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HTML_HREF = re.compile(r"<a\s[^>]*href=\"([^\"]+)\"", re.I)
HTML_ID = re.compile(r"<a\s[^>]*(?:id|name)=\"([^\"]+)\"", re.I)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (``` or ~~~, indented ones included)."""
    out, fence = [], None
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        elif fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is None:
            out.append(line)
    return out


def _prose(text: str) -> str:
    """Prose with inline code removed (a link written inside backticks is not a link)."""
    return CODE_SPAN.sub("", "\n".join(_prose_lines(text)))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (code spans keep their text, emphasis and
    link syntax go), lower-cased, every character that is not a letter, digit, `_`, `-` or a space
    dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    out.update(HTML_ID.findall(text))
    return out


def links(page: Path) -> list[str]:
    prose = _prose(page.read_text(encoding="utf-8"))
    return INLINE_LINK.findall(prose) + REFERENCE_DEF.findall(prose) + HTML_HREF.findall(prose)


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """Every relative link of the page that does not resolve, with the reason."""
    bad = []
    for target in links(page):
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: {dest.relative_to(root) if dest.is_relative_to(root) else dest} does not exist")
        elif anchor:
            if dest.suffix != ".md":
                bad.append(f"{target}: an anchor into a file that is not a markdown page")
            elif anchor not in anchors(dest):
                bad.append(f"{target}: {dest.name} has no heading with the anchor #{anchor}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    assert links(page) or page.name != "README.md", "the README links to nothing"
    assert not broken_links(page), f"{page.relative_to(REPO)}: broken links:\n" + "\n".join(broken_links(page))


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link to: {missing}"


@pytest.mark.parametrize(
    "heading, slug",
    [
        ("Tree calls (issue 15)", "tree-calls-issue-15"),
        ("specedge — design", "specedge--design"),
        ("Ray Serve: `--ray`", "ray-serve---ray"),
        ("What each TensorRT parses (`tensorrt_ops.json`)", "what-each-tensorrt-parses-tensorrt_opsjson"),
        ("specedge's CPU kernels on ARM", "specedges-cpu-kernels-on-arm"),
        ("Draft heads (`--draft head`, `specedge train-draft`)", "draft-heads---draft-head-specedge-train-draft"),
        ("The **bold** [link](x.md) part", "the-bold-link-part"),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_broken_links_and_anchors_are_found(tmp_path):
    """The checker itself: a missing file, a missing anchor (also in the same page), a repeated
    heading's second anchor, code that looks like a link, and links that are fine."""
    (tmp_path / "other.md").write_text("# Other\n\n## Part\n\n## Part\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md) [ok](other.md#part) [ok](other.md#part-1) [ok](#page) [web](https://example.com/x#y)\n"
        "[gone](missing.md) [no anchor](other.md#nothing) [no anchor here](#nowhere)\n"
        "`[code](missing2.md)`\n\n```\n[fenced](missing3.md)\n```\n\n[ref]: missing4.md\n",
        encoding="utf-8",
    )
    bad = broken_links(page, root=tmp_path)
    assert [b.split(":")[0] for b in bad] == ["missing.md", "other.md#nothing", "#nowhere", "missing4.md"], bad
