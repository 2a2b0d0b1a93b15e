"""Self-speculative decoding: naming the drafting layers, a forward that skips layers, greedy exactness on the
exactness prompts on either cache, the step detail, and the layer search's run and output."""

from __future__ import annotations

import json
import re

import pytest
import torch

from playground.config import ConfigError, GenerationParams
from playground.decoding.base import contiguous_cache
from playground.decoding.costs import ForwardCosts
from playground.decoding.registry import build_proposer
from playground.decoding.self_speculative import (
    LAYERS,
    SelfSpeculativeParams,
    default_layers,
    drafting_layers,
    format_layers,
    parse_layers,
)
from playground.engine import generate
from playground.models.vocab import PROPOSAL_VOCAB
from playground.trace import AcceptEvent, DraftEvent
from playground.train.__main__ import main as train_main
from playground.viz.steps import render_step_detail

from .prompts import PROMPTS

FLAT = ForwardCosts((1, 2), (1.0, 1.0))


def test_layers_are_named_as_counts_lists_and_ranges(target) -> None:
    assert parse_layers("3") == (0, 1, 2) and parse_layers("0-2, 5,9-10") == (0, 1, 2, 5, 9, 10)
    assert format_layers((0, 1, 2, 5, 9, 10)) == "0-2,5,9-10" and parse_layers(format_layers((4, 7))) == (4, 7)
    for bad in ("", "a", "1,", "3-1"):
        with pytest.raises(ConfigError, match="layers"):
            SelfSpeculativeParams(layers=bad)
    with pytest.raises(ConfigError, match=re.escape("layers: the target has layers 0..29, got '0-30'")):
        drafting_layers(target, "0-30")
    with pytest.raises(ConfigError, match="drafting with all 30 layers is the target itself"):
        drafting_layers(target, "30")
    with pytest.raises(ConfigError, match=re.escape("gamma must be an integer in [1, 16], got 0")):
        SelfSpeculativeParams(gamma=0)
    assert drafting_layers(target, None) == parse_layers(default_layers("embedded") or "15")


@torch.inference_mode()
def test_a_forward_that_skips_layers_is_the_target_without_them(target) -> None:
    """Skipping the last layers is an early exit (the final norm of the stream entering the first skipped layer);
    skipping a layer in the middle gives what the Python loop over the other layers gives."""
    model = target.model
    ids = torch.tensor([target.tokenizer.encode("The quick brown fox jumps over the lazy dog")])  # (1, T)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)  # (1, T)

    def run(**how):
        cache = contiguous_cache(model, ids.shape[1])
        return model(ids, positions, cache, (0,), num_logits=0, **how)[1]  # (1, T, ...)
    count = model.config.num_layers
    tapped = run(taps=(20,))[..., model.config.hidden_size :]  # the stream entering layer 20
    exited = run(skip=frozenset(range(20, count)))
    torch.testing.assert_close(exited, model.norm(tapped), rtol=1e-5, atol=1e-5)
    stack = model.native_stack
    skipped = run(skip=frozenset({3, 11, 12}))
    try:
        model.native_stack = None  # every layer through the Python loop
        looped = run(skip=frozenset({3, 11, 12}))
    finally:
        model.native_stack = stack
    torch.testing.assert_close(skipped, looped, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(skipped, run())


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("layers", [None, "18", "0-11,20-29"])
def test_self_speculation_keeps_every_exactness_prompt_greedy_exact(target, plain_outputs, kv, layers) -> None:
    """The shipped choice, an early exit and a skip set, drafting free and verified at every width: plain decoding's
    tokens on each exactness prompt, on either cache, with drafted tokens accepted and refused."""
    proposer = build_proposer(target, "self-speculative", SelfSpeculativeParams(layers=layers, draft_cost=0.0))
    accepted, drafted = 0, 0
    for prompt in PROMPTS:
        output, trace = generate(target, prompt, proposer, generation=GenerationParams(max_new_tokens=24, kv=kv),
                                 costs=FLAT)
        assert output.token_ids == plain_outputs[prompt], (layers, kv, prompt)
        drafts = [e for e in trace.events if isinstance(e, DraftEvent) and e.tokens]
        accepted += sum(1 for e in trace.events if isinstance(e, AcceptEvent))
        drafted += sum(len(e.tokens) for e in drafts)
    assert 0 < accepted < drafted
    assert all(e.noted("layers")["layers"] == len(proposer.layers) for e in drafts)


def test_the_step_detail_names_the_drafting_layers(target) -> None:
    proposer = build_proposer(target, "self-speculative", SelfSpeculativeParams(draft_cost=0.0))
    _, trace = generate(target, PROMPTS[0], proposer, generation=GenerationParams(max_new_tokens=12), costs=FLAT)
    step = next(e.step for e in trace.events if isinstance(e, DraftEvent) and e.tokens)
    assert f"of {len(proposer.layers)} of the target's own layers" in render_step_detail(trace.events, step)


def test_the_layer_search_writes_its_choice_and_vocabulary(tmp_path) -> None:
    """A tiny search (two prompts, the last two layers' removal): its layers.json names a drafting set the proposer
    reads, every finalist's figures, and the proposal vocabulary beside it."""
    assert train_main(["layerskip", "--prompts", "2", "--search-prompts", "1", "--answer-tokens", "8",
                       "--min-layers", "28", "--finalists", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / LAYERS).read_text())
    assert len(parse_layers(report["layers"])) >= 28 and report["chosen"]["layers"] == report["layers"]
    assert len(report["finalists"]) == 2 and all(0 <= f["alpha"] <= 1 and 0 < f["draft_cost"] < 1
                                                 for f in report["finalists"])
    assert (tmp_path / PROPOSAL_VOCAB).is_file()
