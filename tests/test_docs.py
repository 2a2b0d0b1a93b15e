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


# words only the code defined, once used in texts people read; the field's words replace them (docs/glossary.md)
PRIVATE = re.compile(r"\b(what pays|pays for|it pays|drafting pays|priced|rests|rested|payoff|further depth|catch-up|"
                     r"one-row floor|summed apart|graft|grafted|grafts|dear|side rows|bytes' prediction|seed for seed|"
                     r"as set)\b", re.IGNORECASE)
# the dated log keeps each entry's words as written; the architecture guide names the code's own concepts
FOR_THE_CODE = {ROOT / "docs" / "results.md", ROOT / "docs" / "architecture.md"}


def prose(text: str) -> str:
    """Markdown without its code: fenced blocks and `inline code` (a class or field may keep its name)."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


def test_texts_people_read_use_the_fields_words() -> None:
    import json

    from playground.__main__ import build_parser

    found = [f"{page.relative_to(ROOT)}: {m.group(0)}" for page in PAGES if page not in FOR_THE_CODE
             for m in PRIVATE.finditer(prose(page.read_text()))]
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(notebook.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                found += [f"{notebook.name}: {m.group(0)}" for m in PRIVATE.finditer(prose("".join(cell["source"])))]
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices  # every subcommand's --help
    for name, command in commands.items():
        found += [f"--help of {name}: {m.group(0)}" for m in PRIVATE.finditer(command.format_help())]
    assert not found, found


def sentences(page: Path) -> list[str]:
    """A page's prose sentences: no tables, headings, images or fenced code; inline code one word each; a bullet or a
    paragraph split at the end of each sentence."""
    text = re.sub(r"^---.*?---\n", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "code", re.sub(r"```.*?```", "", text, flags=re.S))
    blocks, block = [], []
    for line in text.splitlines():
        item = re.match(r"\s*(- |\d+\. )", line)
        if not line.strip() or line.startswith(("|", "#", "![")) or item:
            blocks.append(" ".join(block))
            block = [line[item.end():]] if item else []
        else:
            block.append(line.strip())
    blocks.append(" ".join(block))
    return [s for b in blocks for s in re.split(r"(?<=[.!?;])\s+(?=[A-Za-z*\[(])", b) if s]


def test_sentences_people_read_are_short() -> None:
    """Under 40 words each, in the README and every doc a user reads (the dated log and the architecture guide for
    the code aside)."""
    long = [f"{page.relative_to(ROOT)}: {s[:80]}" for page in PAGES if page not in FOR_THE_CODE
            for s in sentences(page) if len(s.split()) >= 40]
    assert not long, long


def test_every_text_the_app_and_the_cli_build_uses_the_fields_words_in_short_sentences() -> None:
    """`scripts/app_texts.py` collects every string the app's and the CLI's modules build (docstrings aside): none
    uses a private word, and no sentence of one runs to 40 words."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("app_texts", ROOT / "scripts" / "app_texts.py")
    assert spec is not None and spec.loader is not None
    app_texts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app_texts)
    collected = [(path, line, text) for path in app_texts.SOURCES for line, text in app_texts.texts(path)]
    assert len(collected) > 200  # the collector still reads the sources
    private = [f"{p.name}:{line}: {m.group(0)}" for p, line, text in collected for m in PRIVATE.finditer(text)]
    long = [f"{p.name}:{line}: {s[:60]}" for p, line, text in collected for s in app_texts.sentences(text)
            if len(s.split()) >= 40]
    assert not private and not long, (private, long)


def test_the_architecture_guide_lists_every_module_once() -> None:
    """Its "Every module" list holds each of the package's modules (package `__init__` files aside) exactly once, and
    nothing that is not a module."""
    guide = (ROOT / "docs" / "architecture.md").read_text()
    listed = re.findall(r"`(playground/[\w/]+\.py)`", guide.split("## Every module", 1)[1].split("\n## ", 1)[0])
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "playground").rglob("*.py") if p.name != "__init__.py")
    assert sorted(listed) == modules, (sorted(set(modules) - set(listed)), sorted(set(listed) - set(modules)))
