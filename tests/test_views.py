"""What the views draw is what the model wrote: the Decode replay's and the Race lanes' committed tokens equal the
trace's output (so plain decoding's, greedily) at every step, for generated trees judged by the real acceptance
walk and recorded by the real tracer, and for every registered algorithm's real traces."""

from __future__ import annotations

import html
import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from playground.bench.suite import SUITE
from playground.config import GenerationParams, SamplingParams
from playground.decoding.proposer import Outcome, Proposal
from playground.engine import generate
from playground.engine.tracing import StepTimes, Tracer
from playground.kv import KVMemory
from playground.sampling import accept, make_generator
from playground.trace import Event, FinishEvent
from playground.ui.form import entrants, make_proposer
from playground.viz import render_tokens, token_views
from playground.viz.race import events_until
from playground.viz.tokens import COMMITTED

REAL_TOKENS = 48  # generated per prompt by the real algorithms
VOCAB = 6  # few token ids, so that branches often propose the same token at one depth


class Texts:
    """A tokenizer whose every token decodes to a text of its own."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def committed(events: list[Event]) -> list[int]:
    return [view.token.id for view in token_views(events) if view.state in COMMITTED]


def assert_views_follow(events: list[Event], output: list[int]) -> None:
    """At every step of the replay, and at every moment of a race lane, the committed tokens drawn are the output's
    first ones, in order; at the end, all of them, and the clean text is theirs."""
    last = max(e.step for e in events)
    for step in range(last + 1):
        shown = [v.token.id for v in token_views(events, step) if v.state in COMMITTED]
        assert shown == output[: len(shown)], f"step {step}: {shown} is not a prefix of {output}"
        proposing = [v.token.id for v in token_views(events, step, proposing=True) if v.state in COMMITTED]
        assert proposing == output[: len(proposing)], f"step {step} proposing"
    for t in sorted({e.t for e in events}):
        seen = committed(events_until(events, t))
        assert seen == output[: len(seen)], f"race lane at t={t}: {seen} is not a prefix of {output}"
    assert committed(events) == output
    views = token_views(events)
    clean = re.search(r'<div class="pg-clean">(.*?)</div>', render_tokens(events), re.S)
    assert clean is not None
    assert clean.group(1) == html.escape("".join(v.token.text for v in views if v.state in COMMITTED))


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[list[int], list[int], list[int], float]]:
    """Decode steps: each a proposal tree (tokens, parents, best-first: a parent before its children), the argmax
    the target takes at each row (mostly a child's token, so that walks go deep), and a temperature."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(0, 12))
        parents = [draw(st.integers(0, i)) for i in range(n)]
        tokens = [draw(st.integers(0, VOCAB - 1)) for _ in range(n)]
        children = [[tokens[c] for c in range(n) if parents[c] == row] for row in range(n + 1)]
        argmax = [draw(st.sampled_from(kids)) if kids and draw(st.booleans()) else draw(st.integers(0, VOCAB - 1))
                  for kids in children]
        out.append((tokens, parents, argmax, draw(st.sampled_from([0.0, 0.0, 0.7]))))
    return out


@settings(max_examples=200, deadline=None)
@given(steps())
def test_the_views_draw_what_the_walk_kept_for_any_tree(plan) -> None:
    """Trees with duplicate tokens at a depth, chains, runners-up, nothing proposed; greedy and sampled walks: the
    real `sampling.accept` judges each, the real tracer records it, and the views draw the kept tokens in order."""
    tracer = Tracer(Texts())
    memory = KVMemory(bytes_used=0, bytes_reserved=0, tokens=0, bytes_per_token=0)
    request = SimpleNamespace(num_computed=4, first_token_t=0.0, decode_steps=0, sampling=SamplingParams())
    events: list[Event] = []
    output: list[int] = []
    generator = make_generator(0)
    clock = 0.0
    for tokens, parents, argmax, temperature in plan:
        request.sampling = SamplingParams(temperature=temperature, seed=0)
        logits = torch.full((1 + len(tokens), VOCAB), -4.0)  # (1 + n, V)
        logits[range(1 + len(tokens)), argmax] = 4.0
        walk, new, probs = [], [], []
        for row, token, p in accept(logits, tokens, parents, request.sampling, generator):
            walk.append(row)
            new.append(token)
            probs.append(p)
        proposal = Proposal(tokens, parents, ["test"] * len(tokens), [0.5] * len(tokens), [None] * len(tokens))
        outcome = Outcome(new, walk, probs, False, torch.zeros(1, 1))
        times = StepTimes(clock, clock + 0.1, clock + 0.2)
        events += tracer.step(request, proposal, 1 + len(tokens), outcome, logits, times, clock + 0.3, memory)
        clock += 1.0
        output += new
        request.num_computed += len(walk)
        request.decode_steps += 1
    events.append(FinishEvent(step=request.decode_steps, t=clock, reason="length", token_ids=output, text="",
                              wall_s=clock))
    assert_views_follow(events, output)


ENTRANTS = entrants("copies")  # every registered algorithm at its defaults, and with copies grafted where it takes them


@pytest.fixture(scope="module")
def bench_plain(target) -> dict[str, tuple[int, ...]]:
    """Plain greedy decoding of the bench's prompts."""
    generation = GenerationParams(max_new_tokens=REAL_TOKENS)
    return {prompt: generate(target, prompt, None, SamplingParams(), generation)[0].token_ids for _, prompt in SUITE}


@pytest.mark.parametrize("plan", ["as-set", "measured"])
@pytest.mark.parametrize("label", list(ENTRANTS))
def test_every_algorithms_views_draw_plain_decodings_tokens_on_the_bench_prompts(target, bench_plain, label,
                                                                                 plan) -> None:
    """The bench's 14 prompts, greedy: the replay and the race lanes of each algorithm's real trace draw exactly the
    tokens of plain decoding, at every step."""
    entrant = ENTRANTS[label]
    proposer = make_proposer(target, entrant.algo, None, entrant.copies)
    generation = GenerationParams(max_new_tokens=REAL_TOKENS, plan=plan)
    for _, prompt in SUITE:
        output, trace = generate(target, prompt, proposer, SamplingParams(), generation, entrant.algo)
        assert output.token_ids == bench_plain[prompt], prompt
        assert_views_follow(trace.events, list(bench_plain[prompt]))
