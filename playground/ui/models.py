"""Models for the web app, loaded once per spec and shared by every session (weights are read-only)."""

from __future__ import annotations

import threading

from ..config import ModelSpec
from ..models import LoadedModel, load_model

_models: dict[ModelSpec, LoadedModel] = {}
_lock = threading.Lock()


def get_model(spec: ModelSpec) -> LoadedModel:
    """The loaded model for a spec; the first call loads (converting a GGUF once), later calls are free."""
    with _lock:
        if spec not in _models:
            _models[spec] = load_model(spec)
        return _models[spec]
