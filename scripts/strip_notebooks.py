"""Clear the outputs, execution counts and saved widget state of notebooks, so that diffs show only the source.

Usage: python scripts/strip_notebooks.py [--check] [NOTEBOOK ...]   (default: every notebooks/*.ipynb)
--check changes nothing and exits 1 when any notebook still carries outputs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def strip(notebook: dict) -> bool:
    """Strip one notebook in place; True when anything was removed."""
    changed = notebook.get("metadata", {}).pop("widgets", None) is not None
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs") or cell.get("execution_count") is not None:
            changed = True
        cell["outputs"] = []
        cell["execution_count"] = None
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report notebooks with outputs; change nothing")
    parser.add_argument("paths", nargs="*", type=Path)
    args = parser.parse_args(argv)
    dirty = []
    for path in args.paths or sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        if strip(notebook):
            dirty.append(path)
            if not args.check:
                path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for path in dirty:
        print(f"{path}: {'has outputs' if args.check else 'stripped'}")
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())
