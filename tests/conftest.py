"""Shared fixtures: the embedded model (converted once per machine, then loaded in well under a second)."""

from __future__ import annotations

import pytest

from playground.config import ModelSpec
from playground.models import LoadedModel, load_model


@pytest.fixture(scope="session")
def target() -> LoadedModel:
    return load_model(ModelSpec(device="cpu", dtype="float32"))
