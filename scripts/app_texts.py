"""Every sentence the app and the CLI can show, collected from their source: each string a module under
playground/ui, playground/viz, playground/metrics.py, playground/speedup.py or playground/__main__.py builds
(f-strings with their placeholders as {...}), docstrings and comments left out. For reading them all at once, as a
student would, and for the test that holds their words (tests/test_docs.py).

    python scripts/app_texts.py [--long N]   # --long: only texts with a sentence of N words or more
"""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [*sorted((ROOT / "playground" / "ui").glob("*.py")), *sorted((ROOT / "playground" / "viz").glob("*.py")),
           ROOT / "playground" / "metrics.py", ROOT / "playground" / "speedup.py", ROOT / "playground" / "__main__.py"]


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module and its functions and classes."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{...}" for v in node.values)
    return None


def texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every string of words a source file builds: adjacent literals joined, as Python joins
    them; identifiers, CSS, HTML tags alone and single words left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    inner: set[int] = set()  # the parts of an f-string, read with it
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inner.update(id(v) for v in node.values)
    for node in ast.walk(tree):
        if id(node) in skip or id(node) in inner:
            continue
        text = _text(node)
        if text is not None and len(re.findall(r"[A-Za-z]+", text)) >= 4 and " " in text.strip():
            yield node.lineno, text


def sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?;:])\s+", text) if s.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", type=int, default=0, help="only texts with a sentence of this many words or more")
    args = parser.parse_args()
    for path in SOURCES:
        for line, text in texts(path):
            if args.long and max(len(s.split()) for s in sentences(text)) < args.long:
                continue
            print(f"{path.relative_to(ROOT)}:{line}: {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
