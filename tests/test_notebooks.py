"""The teaching notebooks: committed without outputs, and built the same way (a parameter cell holding the token
budget, the engine imported rather than re-implemented, a visible check, the shared renderers, exercises).
Executing them is nbmake's job: pytest collects notebooks/*.ipynb (see pyproject.toml)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

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
    assert "assert " in code and "✓" in code, "a check the reader sees pass"
    assert "class " not in code, "notebooks use the engine; they do not re-implement it"
    markdown = "".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    assert markdown.lstrip().startswith("# ") and "## Exercises" in markdown
