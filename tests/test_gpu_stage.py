"""scripts/gpu_stage.py: the model carried to a GPU machine in parts, one call each, and put back together there."""

import json
import os
import shutil

import pytest

from scripts import gpu_stage


def test_parts_arrive_call_by_call_and_assemble(tmp_path):
    data = os.urandom(1000)
    here = tmp_path / "here"
    here.mkdir()
    (here / "wheels").mkdir()
    parts = gpu_stage.split(data, 300, here)
    assert parts == ["part-01", "part-02", "part-03", "part-04"]
    kept, site = tmp_path / "kept", tmp_path / "site"
    for i, name in enumerate(parts):  # each call's tree holds the manifest and its own part (the first: the wheels)
        there = tmp_path / f"call-{i}"
        there.mkdir()
        for carried in [gpu_stage.MANIFEST, name] + (["wheels"] if i == 0 else []):
            (shutil.copytree if (here / carried).is_dir() else shutil.copyfile)(here / carried, there / carried)
        ready = gpu_stage.assemble(there, kept, site)
        assert ready == (i == len(parts) - 1)
    model = site / gpu_stage.PACKAGE
    assert (model / gpu_stage.GGUF).read_bytes() == data
    assert (model / "__init__.py").is_file()
    assert not list(model.glob("*.partial"))


def test_a_damaged_part_is_refused(tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    (here / "wheels").mkdir()
    gpu_stage.split(b"x" * 500, 200, here)
    (here / "part-02").write_bytes(b"y" * 200)
    with pytest.raises(SystemExit, match="sha256"):
        gpu_stage.assemble(here, tmp_path / "kept", tmp_path / "site")
    assert json.loads((here / gpu_stage.MANIFEST).read_text())["parts"] == ["part-01", "part-02", "part-03"]
