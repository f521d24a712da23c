"""The README is the front door and docs/ holds the rest: every link resolves, every page is reached.

Anchors follow GitHub's rule: heading text lowercased, markup and punctuation dropped (word
characters, hyphens and spaces kept), spaces turned into hyphens, repeats suffixed -1, -2, ...
Links inside fenced code blocks and inline code are not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250  # issue 15: the front door stays short; reference pages live in docs/
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str, keep_code_spans: bool = False) -> str:
    """The text outside fenced code blocks (lines kept, for line numbers), inline code removed
    unless asked to keep it (a heading's anchor includes its code spans' text)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line if keep_code_spans else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path.read_text(encoding="utf-8"), keep_code_spans=True).split("\n"):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(md: Path) -> list[tuple[int, str]]:
    text = prose(md.read_text(encoding="utf-8"))  # a link's text may span lines
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def broken_links(root: Path) -> list[str]:
    bad = []
    for md in [root / "README.md"] + sorted((root / "docs").glob("*.md")):
        for line, target in links(md):
            if re.match(r"[a-z]+:", target):  # http:, mailto:
                continue
            where = f"{md.relative_to(root)}:{line}: {target}"
            path, _, anchor = target.partition("#")
            dest = (md.parent / unquote(path)).resolve() if path else md
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                bad.append(f"{where}: no heading with that anchor")
    return bad


def test_every_link_resolves():
    assert broken_links(ROOT) == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / unquote(t.partition("#")[0])).resolve() for _, t in links(ROOT / "README.md")}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages and [p.name for p in pages if p.resolve() not in linked] == []


def test_the_readme_stays_a_front_door():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= README_MAX_LINES


def test_the_check_catches_broken_links(tmp_path):
    """Negative control: a missing page and a missing anchor, in a copy, are both reported."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Some `code` section\n\n[back](../README.md)\n")
    (tmp_path / "README.md").write_text("# R\n\n[a](docs/a.md#some-code-section) [b](docs/a.md#gone) [c](docs/c.md)\n"
                                        "```\n[not a link](nowhere.md)\n```\n")
    assert broken_links(tmp_path) == ["README.md:3: docs/a.md#gone: no heading with that anchor",
                                      "README.md:3: docs/c.md: no such file"]
