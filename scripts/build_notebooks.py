"""Execute the teaching notebooks and render each to one HTML page that shows its figures with no kernel and no
network: plotly figures carry plotly.js inline, step players their final frame (`playground.viz.widgets`).

Usage: python scripts/build_notebooks.py [--out DIR] [NOTEBOOK ...]   (default: every notebooks/*.ipynb into
bench_results/notebooks/). A figure cell (one that calls `.show()` or `step_player(`) whose output an HTML page
cannot show fails the build, naming the cell; the tests run the same check on every notebook.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import nbclient
import nbformat
from nbconvert import HTMLExporter
from traitlets.config import Config

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
OUT = ROOT / "bench_results" / "notebooks"
FIGURE = re.compile(r"\.show\(\)|step_player\(")
TIMEOUT_S = 900
# A saved notebook keeps no widget state, so a page shows a widget's static HTML instead of its empty view.
PRIORITY = ["text/html", "application/vnd.jupyter.widget-view+json", "application/javascript", "text/markdown",
            "image/svg+xml", "image/png", "image/jpeg", "text/latex", "text/plain"]


def execute(path: Path) -> nbformat.NotebookNode:
    """The notebook run top to bottom in a fresh kernel, from its own folder."""
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(notebook, timeout=TIMEOUT_S, resources={"metadata": {"path": str(path.parent)}}).execute()
    return notebook


def unrenderable(notebook: nbformat.NotebookNode) -> list[str]:
    """The figure cells without an HTML output, as 'cell N: first line'."""
    problems = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or not FIGURE.search(cell.source):
            continue
        if not any(str(output.get("data", {}).get("text/html", "")).strip() for output in cell.outputs):
            problems.append(f"cell {index}: {cell.source.strip().splitlines()[-1][:80]}")
    return problems


def to_html(notebook: nbformat.NotebookNode) -> str:
    exporter = HTMLExporter(config=Config({"NbConvertBase": {"display_data_priority": PRIORITY}}))
    return exporter.from_notebook_node(notebook)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, default=NOTEBOOKS)
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder for the pages (default {OUT})")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for path in args.notebooks:
        start = time.perf_counter()
        print(f"{path.name}: running...", flush=True)
        notebook = execute(path)
        page = args.out / f"{path.stem}.html"
        page.write_text(to_html(notebook), encoding="utf-8")
        problems = unrenderable(notebook)
        failed += bool(problems)
        for problem in problems:
            print(f"  no HTML output for a figure: {problem}", file=sys.stderr)
        print(f"{path.name}: {time.perf_counter() - start:.0f} s -> {page} "
              f"({page.stat().st_size / 1e6:.1f} MB)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
