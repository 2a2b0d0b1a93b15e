"""Where a step would make the host wait for a GPU, counted on the CPU (`playground.waits`): with the step's draws made
ahead as off the CPU, a decode step waits once (its draws), and once more where a model-based proposer reads its
guesses back; copies, lookahead's window and the trace's shown probabilities add no wait. The outputs and the
probabilities a trace shows are those of the CPU's row-by-row walk."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter

import pytest
import torch

from playground.config import GenerationParams, SamplingParams
from playground.events import AcceptEvent, BonusEvent, CorrectEvent, DraftEvent, RejectEvent
from playground.waits import Waits, to_device
from scripts.count_waits import step_waits

from .prompts import PROMPTS

# a step's waits beyond its draws: the proposers that read their guesses back, once a step for every request
READS_GUESSES = {"speculative": 1, "medusa": 1, "eagle": 1, "self-speculative": 1}


@pytest.fixture(scope="module")
def static(target):
    return dataclasses.replace(target, forwards="static")


def most_waits(steps: list[Counter]) -> int:
    return max(sum(step.values()) for step in steps)


def test_reads_and_blocking_transfers_are_counted_by_site_and_nothing_else() -> None:
    t = torch.arange(4)
    with Waits() as waits:
        t.tolist(), t[0].item(), bool(t[1]), int(t[2]), t[t > 1]
        torch.tensor([1, 2], device="cpu")
        torch.tensor([1, 2]), to_device([1, 2], t.device), t + 1, t.argmax(), t[1:], t[torch.tensor([0, 2])]
    assert waits.total == 6
    assert {file for file, _ in waits.sites} == {__file__}
    assert torch.equal(to_device([[1, 2]], t.device), torch.tensor([[1, 2]]))


def drafts(events) -> list[list[int]]:
    return [[token.id for token in e.tokens] for e in events if isinstance(e, DraftEvent)]


def shown(events) -> list[tuple[str, int, float]]:
    return [(e.KIND, e.token.id, e.token.p) for e in events
            if isinstance(e, (AcceptEvent, RejectEvent, CorrectEvent, BonusEvent))]


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("algo", ["ar", "prompt-lookup", "lookahead", "speculative", "medusa", "eagle"])
def test_a_decode_step_waits_once_and_once_more_where_guesses_are_read(static, algo, kv) -> None:
    generation = GenerationParams(max_new_tokens=24, kv=kv)
    prompt = PROMPTS[16] if algo in ("prompt-lookup", "lookahead") else PROMPTS[0]
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=3)):
        (steps, (ours,)), (_, (theirs,)) = (step_waits(static, algo, [(prompt, sampling)], generation, ahead=ahead)
                                            for ahead in (True, False))
        assert most_waits(steps) <= 1 + READS_GUESSES.get(algo, 0), steps
        assert ours.tokens == theirs.tokens
        if algo != "ar":
            assert any(isinstance(e, DraftEvent) for e in ours.trace)
            assert any(isinstance(e, RejectEvent) for e in ours.trace)  # a refused node's probability shown
        # the same proposals (lookahead's from its window, slid by the side rows' argmax) and decisions
        assert drafts(ours.trace) == drafts(theirs.trace)
        assert [e[:2] for e in shown(ours.trace)] == [e[:2] for e in shown(theirs.trace)]
        assert [e[2] for e in shown(ours.trace)] == pytest.approx([e[2] for e in shown(theirs.trace)], rel=1e-4)


@pytest.mark.parametrize("algo", ["ar", "prompt-lookup", "lookahead", "speculative", "medusa", "eagle", "rest",
                                  "self-speculative"])
def test_a_batch_step_waits_as_a_single_request_does(static, algo) -> None:
    """Three requests decoded together, one greedy and two sampled: each step waits as one request's does, and every
    request gets the tokens the CPU's row-by-row walk gives it."""
    generation = GenerationParams(max_new_tokens=16, kv="paged")
    requests = [(prompt, SamplingParams(temperature=0.8, seed=i) if i else None)
                for i, prompt in enumerate((PROMPTS[0], PROMPTS[16], PROMPTS[3]))]
    (steps, ours), (_, theirs) = (step_waits(static, algo, requests, generation, ahead=ahead)
                                  for ahead in (True, False))
    assert most_waits(steps) <= 1 + READS_GUESSES.get(algo, 0), steps
    assert [r.tokens for r in ours] == [r.tokens for r in theirs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_values_reach_a_gpu_unchanged() -> None:
    device = torch.device("cuda")
    busy = torch.randn(2048, 2048, device=device)
    for _ in range(8):
        busy = busy @ busy / 2048  # queued work the copies need not wait for
    mask = torch.ones(3, 3, dtype=torch.bool).tril().unsqueeze(0).expand(2, 3, 3)  # a view, as attention masks are
    moved = [to_device([[1, 2], [3, 4]], device), to_device(mask, device)]
    assert moved[0].tolist() == [[1, 2], [3, 4]] and torch.equal(moved[1].cpu(), mask)


def test_the_script_counts_every_algorithms_waits_by_site() -> None:
    out = subprocess.run([sys.executable, "scripts/count_waits.py", "--new-tokens", "6", "--kv", "paged"],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert set(rows) == {"ar", "prompt-lookup", "lookahead", "speculative", "medusa", "eagle", "rest",
                         "self-speculative"}
    assert all(int(row[3]) <= 1 + READS_GUESSES.get(algo, 0) for algo, row in rows.items())
    assert "engine.py:" in rows["ar"][4]
