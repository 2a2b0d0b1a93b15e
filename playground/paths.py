"""Where the project keeps what it makes on a machine: converted weights and the native kernel's build."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PLAYGROUND_CACHE"


def default_cache_root() -> Path:
    """$PLAYGROUND_CACHE, else ~/.cache/decoding-playground (a `ModelSpec.cache_dir` overrides it for weights)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "decoding-playground")
