"""Shared fixtures: the embedded model (converted once per machine, then loaded in well under a second)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from playground.config import GenerationParams, ModelSpec, SamplingParams
from playground.decoding.costs import ForwardCosts, pinned
from playground.engine import generate
from playground.models import LoadedModel, load_model

from .prompts import NEW_TOKENS, PROMPTS

# a test over --max-test-seconds fails the run; pytester runs that plugin in tests/test_slow_guard.py
pytest_plugins = ["tests.slow_guard", "pytester"]


NOISE = 0.1
# what a forward over T new tokens costs, in one-token forwards: a typical 2-core CPU's curve, fixed so that the
# widths the engine plans (and so every test's proposals) do not depend on how busy the test machine is
TEST_COSTS = ForwardCosts((1, 2, 4, 8, 16, 32, 64), (1.0, 1.03, 1.1, 1.22, 1.6, 2.5, 4.8))


@pytest.fixture(scope="session", autouse=True)
def fixed_forward_costs() -> Iterator[None]:
    """For the whole session, so that engines made by module fixtures (the server's) plan on it too, their
    proposers' own forwards priced at their estimates (a curve given: `engine.planner`); a test of the measuring
    itself unpins it (`costs.pinned(None)`)."""
    with pinned(TEST_COSTS):
        yield


@pytest.fixture
def unpinned() -> Iterator[None]:
    """This machine's measured costs, for a test of the measuring itself."""
    with pinned(None):
        yield


@pytest.fixture(scope="session")
def target() -> LoadedModel:
    return load_model(ModelSpec(device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def plain_outputs(target) -> dict[str, tuple[int, ...]]:
    """Plain greedy decoding of every exactness prompt: the reference each algorithm must reproduce."""
    generation = GenerationParams(max_new_tokens=NEW_TOKENS)
    return {prompt: generate(target, prompt, None, SamplingParams(), generation)[0].token_ids for prompt in PROMPTS}


def write_draft_copy(source: Path, target: Path, num_layers: int, noise: float = 0.0) -> Path:
    """A stand-in draft made from a model: its first `num_layers` blocks, its norm, head and tokenizer, with
    Gaussian noise of `noise` times each block matrix's standard deviation added (seeded).

    It shares the tokenizer and agrees with the full model on many tokens but not all, which is what the
    speculative tests need from a draft without training one.
    """
    target.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    kept = {}
    for name, tensor in sorted(load_file(source / "model.safetensors").items()):
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= num_layers:
                continue
            if noise and tensor.dim() == 2:
                tensor = tensor + noise * tensor.std() * torch.randn(tensor.shape, generator=generator)
        kept[name] = tensor.contiguous()
    save_file(kept, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (target / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    return target


@pytest.fixture(scope="session")
def noisy_draft(target, tmp_path_factory) -> LoadedModel:
    """The target's 30 blocks with 10% weight noise: about 40% of greedy proposals are accepted."""
    folder = write_draft_copy(target.folder, tmp_path_factory.mktemp("draft") / "noisy", 30, noise=NOISE)
    return load_model(ModelSpec(source=str(folder), device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def weak_draft(target, tmp_path_factory) -> LoadedModel:
    """The target's first 6 blocks: almost every proposal is rejected."""
    folder = write_draft_copy(target.folder, tmp_path_factory.mktemp("draft") / "weak", 6)
    return load_model(ModelSpec(source=str(folder), device="cpu", dtype="float32"))
