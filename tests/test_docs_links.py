"""The README and the pages under docs/ link to each other and to the repository's files: a page
moved or renamed would leave a link a newcomer clicks into nothing. Every link is either an
external https URL or a path inside this repository that exists (with, where it names one, a
heading of the page it points to); every page under docs/ is reachable from the README; and the
README stays short enough to be read to the end (issue #32), its details living in docs/."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The repository's own Markdown: the README, the pages, and the two folder READMEs that point
# into them.
PAGES = sorted([README, ROOT / "clients" / "README.md", ROOT / "k8s" / "README.md", *DOCS.rglob("*.md")])
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target) and ![alt](target); a target may carry a "title".
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text a reader sees as Markdown: links inside code blocks and code spans are examples,
    not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def anchors(page: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered."""
    seen: dict[str, int] = {}
    ids = set()
    for title in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


def broken(page: Path, target: str) -> str | None:
    """Why `target`, linked from `page`, leads nowhere; None when it resolves."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
        return None if target.startswith("https://") else "not an https URL"
    path, _, anchor = target.partition("#")
    where = (page.parent / unquote(path)).resolve() if path else page
    if not where.is_relative_to(ROOT.resolve()):
        return "outside the repository"
    if not where.exists():
        return "no such file"
    if anchor:
        if where.is_dir() or where.suffix != ".md":
            return "an anchor into a file that is not a Markdown page"
        if anchor not in anchors(where):
            return f"no heading #{anchor} in {where.relative_to(ROOT)}"
    return None


def test_the_pages_exist() -> None:
    assert README in PAGES and len([p for p in PAGES if p.is_relative_to(DOCS)]) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(page: Path) -> None:
    found = {target: broken(page, target) for target in links(page)}
    assert {t: why for t, why in found.items() if why} == {}


def outside_paths(page: Path) -> list[str]:
    """Paths the page names in code spans that climb out of the repository (`../shared/...`):
    not links, but a reader follows them all the same."""
    spans = [m.group(0).strip("`").strip() for m in CODE_SPAN.finditer(FENCE.sub("", page.read_text()))]
    return [
        span
        for span in spans
        if span.startswith("../") and not (page.parent / span).resolve().is_relative_to(ROOT.resolve())
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_named_in_code_leaves_the_repository(page: Path) -> None:
    assert outside_paths(page) == []


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached: set[Path] = set()
    todo = [README]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for target in links(page):
            path = target.partition("#")[0]
            if "://" in target or not path:
                continue
            where = (page.parent / unquote(path)).resolve()
            if where.is_dir():
                where = where / "README.md"
            if where.suffix == ".md" and where.exists():
                todo.append(where)
    orphans = [str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md") if p.resolve() not in reached]
    assert orphans == []


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) < README_MAX_LINES


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    """The checker itself: what it must refuse, it refuses."""
    assert broken(README, "docs/no-such-page.md") == "no such file"
    assert broken(README, "../outside.md") == "outside the repository"
    assert broken(README, "http://example.com") == "not an https URL"
    assert broken(README, "docs/README.md#no-such-heading") is not None
    assert broken(README, "https://example.com/page#any") is None
    assert broken(README, "docs/README.md") is None
    page = tmp_path / "page.md"
    page.write_text("# A title, with `code`\n\n## A title, with `code`\n\n```\n[x](nowhere.md)\n```\n")
    assert anchors(page) == {"a-title-with-code", "a-title-with-code-1"}
    assert links(page) == []
    readme = tmp_path / "README.md"
    readme.write_text("The architecture is in `../shared/DESIGN.md`; the map is `docs/`.\n")
    assert outside_paths(readme) == ["../shared/DESIGN.md"]
