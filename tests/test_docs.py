"""The docs describe what is: every link between them (and to the repository's files) resolves, with its anchor, and
dated measurement prose lives in one place, the results log (docs/results.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "notebooks" / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def test_every_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#") and not target[1:]:
                continue  # a web address
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_dated_prose_lives_in_the_results_log() -> None:
    results = ROOT / "docs" / "results.md"
    dated = []
    for page in PAGES:
        if page == results:
            continue
        text = LINK.sub("]()", page.read_text())  # a link into the log may name an entry's date
        dated += [f"{page.relative_to(ROOT)}: {line.strip()[:80]}" for line in text.splitlines() if DATE.search(line)]
    assert not dated, dated


def test_each_results_entry_is_dated_with_its_command_and_table() -> None:
    entries = (ROOT / "docs" / "results.md").read_text().split("\n## ")[1:]
    assert len(entries) >= 10
    for entry in entries:
        heading, _, body = entry.partition("\n")
        assert DATE.search(heading), heading
        assert "`" in body and "|" in body, heading  # a command and a table
