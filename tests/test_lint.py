"""The linter and the type checker as part of the suite: ruff (pycodestyle, pyflakes, import sorting) and mypy on
`playground/` (settings in pyproject.toml) find nothing, so the README's test command checks style and types as it
checks behaviour."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*command: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_ruff_finds_nothing() -> None:
    result = run("ruff", "check", "--no-cache", ".", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing(tmp_path) -> None:
    result = run("mypy", "--cache-dir", str(tmp_path), timeout=110)  # from scratch: about 30 s on 2 cores
    assert result.returncode == 0, result.stdout + result.stderr
