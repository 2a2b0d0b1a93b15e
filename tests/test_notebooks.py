"""The teaching notebooks: committed without outputs, and built the same way (a parameter cell holding the token
budget, the engine imported rather than re-implemented, a visible check, the shared renderers, exercises); each
runs top to bottom and its exported HTML page shows every figure (scripts/build_notebooks.py, run here)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import expect, sync_playwright

from scripts import build_notebooks as build

from .test_browser import CHROMIUM

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
STRIP = ROOT / "scripts" / "strip_notebooks.py"


def code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_six_notebooks_one_per_topic():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_", "06_"]


def test_committed_notebooks_carry_no_outputs():
    result = subprocess.run([sys.executable, str(STRIP), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_the_check_catches_outputs_and_strip_removes_them(tmp_path):
    notebook = json.loads(NOTEBOOKS[0].read_text())
    cell = next(c for c in notebook["cells"] if c["cell_type"] == "code")
    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["hi\n"]}]
    cell["execution_count"] = 3
    notebook["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {}}
    dirty = tmp_path / "dirty.ipynb"
    dirty.write_text(json.dumps(notebook))
    check = subprocess.run([sys.executable, str(STRIP), "--check", str(dirty)], capture_output=True, text=True)
    assert check.returncode == 1 and "has outputs" in check.stdout
    assert subprocess.run([sys.executable, str(STRIP), str(dirty)], capture_output=True).returncode == 0
    assert subprocess.run([sys.executable, str(STRIP), "--check", str(dirty)], capture_output=True).returncode == 0
    assert "widgets" not in json.loads(dirty.read_text())["metadata"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_structure(path):
    nbformat.validate(nbformat.read(path, as_version=4))
    notebook = json.loads(path.read_text())
    params = [c for c in notebook["cells"] if "parameters" in c["metadata"].get("tags", [])]
    assert len(params) == 1, "exactly one cell tagged 'parameters'"
    # The parameter cell holds plain assignments only, so a reader (or papermill) can override every value.
    tree = ast.parse("".join(params[0]["source"]))
    assert tree.body and all(isinstance(node, ast.Assign) for node in tree.body)
    names = {target.id for node in tree.body for target in ast.walk(node) if isinstance(target, ast.Name)}
    assert "MAX_NEW_TOKENS" in names, "the token budget is a parameter"
    code = "\n".join(code_cells(path))
    assert "from playground" in code
    assert "step_player(" in code and "playground.viz" in code, "a step-through widget on the shared renderers"
    assert ".show()" in code, "plotly charts"
    assert "offline_figures()" in code, "figures an exported page can show"
    assert "assert " in code and "✓" in code, "a check the reader sees pass"
    assert "class " not in code, "notebooks use the engine; they do not re-implement it"
    markdown = "".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    assert markdown.lstrip().startswith("# ") and "## Exercises" in markdown


@pytest.fixture(scope="module")
def offline_browser():
    """Chromium with every network request refused: a page must draw its figures from what it holds."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        context = browser.new_context()
        context.route("**/*", lambda route: route.abort() if route.request.url.startswith("http")
                      else route.continue_())
        yield context
        browser.close()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_its_page_shows_every_figure(path, offline_browser, tmp_path):
    notebook = build.execute(path)  # every assert in it passes, or this raises naming the cell
    assert build.unrenderable(notebook) == []
    html = tmp_path / f"{path.stem}.html"
    html.write_text(build.to_html(notebook), encoding="utf-8")
    shows = sum(cell.source.count(".show()") for cell in notebook.cells if cell.cell_type == "code")
    page = offline_browser.new_page()
    page.goto(html.as_uri())
    figures = page.locator(".plotly-graph-div")
    assert figures.count() >= shows
    for i in range(figures.count()):  # drawn: plotly.js came with the page
        expect(figures.nth(i).locator(".main-svg").first).to_be_attached(timeout=30_000)
    assert page.locator(".pg-tok, .pg-block").count() > 3  # a step player's frame, drawn statically
    assert "VBox(children" not in page.content()
    page.close()


def test_the_build_writes_a_page_and_fails_on_a_figure_cell_without_html(tmp_path, capsys):
    good, bad = tmp_path / "good.ipynb", tmp_path / "bad.ipynb"
    for path, code in ((good, "from IPython.display import HTML\nHTML('<b>drawn</b>')  # .show() equivalent"),
                       (bad, "figure = None  # figure.show() forgotten")):
        notebook = nbformat.v4.new_notebook()
        notebook.cells = [nbformat.v4.new_code_cell(code)]
        nbformat.write(notebook, path)
    assert build.main([str(good), "--out", str(tmp_path / "out")]) == 0
    assert "<b>drawn</b>" in (tmp_path / "out" / "good.html").read_text()
    assert build.main([str(bad), "--out", str(tmp_path / "out")]) == 1
    assert "no HTML output for a figure: cell 0" in capsys.readouterr().err
