"""The docs hold together: every relative link of README.md, DEVELOPERS.md and docs/**/*.md reaches a file
that exists, every ``#anchor`` a heading of its page (GitHub's slugs), and no page outgrows its guide's size:
docs pages 300 lines at most, DEVELOPERS.md 150 (DEVELOPERS.md, "Conventions")."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from helpers import REPO_ROOT

PAGES = sorted([REPO_ROOT / "README.md", REPO_ROOT / "DEVELOPERS.md", *(REPO_ROOT / "docs").rglob("*.md")])
MAX_LINES = {REPO_ROOT / "DEVELOPERS.md": 150}
MAX_DOCS_LINES = 300

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor, repeated headings numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link or image outside code."""
    return [
        (number, match.group(1))
        for number, line in prose_lines(path)
        for match in LINK.finditer(INLINE_CODE.sub("", line))
    ]


def rel(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def test_the_slug_rules() -> None:
    assert slug("The testbed: the tiny default and `config/standard.yaml`") == (
        "the-testbed-the-tiny-default-and-configstandardyaml"
    )
    assert slug("Memory plan: `d3s plan`") == "memory-plan-d3s-plan"
    assert slug("Generation (`--backend`)") == "generation---backend"
    assert slug("vLLM's importance-sampling correction") == "vllms-importance-sampling-correction"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for number, target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http(s):, mailto:, ...
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / unquote(file_part)).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{rel(page)}:{number}: {target}: no such file")
        elif anchor and linked.suffix == ".md" and unquote(anchor) not in anchors(linked):
            broken.append(f"{rel(page)}:{number}: {target}: no heading #{anchor} in {rel(linked)}")
    assert not broken, "\n".join(broken)


def line_limit(page: Path) -> int | None:
    return MAX_LINES.get(page, MAX_DOCS_LINES if page.is_relative_to(REPO_ROOT / "docs") else None)


@pytest.mark.parametrize("page", [p for p in PAGES if line_limit(p)], ids=rel)
def test_pages_stay_short(page: Path) -> None:
    limit = line_limit(page)
    lines = len(page.read_text().splitlines())
    assert lines <= limit, f"{rel(page)} has {lines} lines, over {limit}: split it by topic"
