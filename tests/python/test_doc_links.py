"""Links between the project's Markdown files (README.md, docs/*.md): every link to a local .md
file names a file that exists, and every #anchor names a heading of its target, by GitHub's rule
for heading ids (lower case; characters other than letters, digits, '_', '-' and spaces dropped;
spaces to '-'; a repeated id gets -1, -2, ...). A renamed heading otherwise breaks the README's
links to the figures without a sound."""
import re
from pathlib import Path

import pytest

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]*)(#[^)\s]+)?\)")


def heading_ids(text: str) -> set:
    ids, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def local_links(path: Path):
    for m in LINK.finditer(path.read_text()):
        target, anchor = m.group(1), m.group(2)
        if target.endswith(".md") or (target == "" and anchor):
            yield target, anchor


def test_heading_ids_follow_githubs_rule():
    text = "# A `code` title (2026-12-04, at `abc`)\n```\n# not a heading\n```\n## Same\n## Same\n"
    assert heading_ids(text) == {"a-code-title-2026-12-04-at-abc", "same", "same-1"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_local_links_resolve(doc):
    assert doc.is_file()
    broken = []
    for target, anchor in local_links(doc):
        path = (doc.parent / target) if target else doc
        if not path.is_file():
            broken.append(f"{target}: no such file")
        elif anchor and anchor[1:] not in heading_ids(path.read_text()):
            broken.append(f"{target}{anchor}: no such heading")
    assert not broken, f"{doc.name}: " + "; ".join(broken)


def test_the_readme_links_to_the_figures():
    # the check above has something to check
    assert any(t.endswith("benchmarks.md") and a for t, a in local_links(ROOT / "README.md"))
