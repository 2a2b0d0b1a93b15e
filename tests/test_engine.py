"""The continuous-batching engine: every request gets exactly its solo output, whatever the batch, the token
budget, the pool size (preemption), the scheduling policy, prefix sharing or aborts around it."""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from playground.config import ConfigError, EngineParams, GenerationParams, ModelSpec, SamplingParams
from playground.decoding import costs as costs_module
from playground.decoding import encode_prompt, prompt_lookup
from playground.decoding.base import forward_tokens, new_cache
from playground.decoding.copies import Lookup
from playground.decoding.costs import ForwardCosts
from playground.decoding.eagle import EagleParams
from playground.decoding.grafted import Grafted
from playground.decoding.guesses import GuessCalibration, guess_tree
from playground.decoding.lookahead import LookaheadParams
from playground.decoding.medusa import MedusaParams
from playground.decoding.planning import DraftPrice, OwnCost, widest_paying
from playground.decoding.prompt_lookup import PromptLookupParams
from playground.decoding.proposer import Cost, Proposal
from playground.decoding.registry import build_proposer
from playground.decoding.self_speculative import SelfSpeculativeParams
from playground.decoding.speculative import DraftGuesser, SpeculativeParams
from playground.engine import Engine, ProposalCounts, Status, generate, warm_up
from playground.engine.planner import kept
from playground.models import LoadedModel
from playground.models.loader import ModelLoadError, build_model
from playground.models.medusa import FusedBlocks, LoadedHeads, MedusaHeads
from playground.models.vocab import output_rows
from playground.trace import MemoryEvent, PreemptEvent

from .conftest import TEST_COSTS
from .prompts import PROMPTS

LENGTHS = (24, 7, 16, 3, 20)  # max_new_tokens per request, cycled: outputs of mixed lengths


def solo(target: LoadedModel, prompt_ids: list[int], sampling: SamplingParams, generation: GenerationParams):
    """The token ids plain decoding gives for one prompt on its own."""
    return generate(target, prompt_ids, None, sampling, generation)[0].token_ids


def drafter(engine: Engine) -> DraftGuesser | None:
    """The engine's draft model proposer, alone or with copies grafted on."""
    proposer = engine.proposer.inner if isinstance(engine.proposer, Grafted) else engine.proposer
    return proposer if isinstance(proposer, DraftGuesser) else None


def counts(engine: Engine, source: str) -> ProposalCounts:
    """The engine's counts of the nodes a source proposed (zero when it proposed none)."""
    return engine.counts.get(source, ProposalCounts())


def check_no_leak(engine: Engine) -> None:
    assert not engine.has_unfinished()
    draft = drafter(engine)
    for cache in (engine.cache, *([draft.cache] if draft is not None else [])):
        assert cache.blocks.num_free == engine.params.num_blocks
        assert not any(cache.blocks.allocator.refs)


def memory_events(engine: Engine) -> list[MemoryEvent]:
    return [e for e in engine.events if isinstance(e, MemoryEvent)]


def test_a_batch_of_mixed_lengths_gives_every_request_its_solo_output(target, plain_outputs) -> None:
    engine = Engine(target)
    ids = {engine.add_request(p, generation=GenerationParams(max_new_tokens=LENGTHS[i % len(LENGTHS)])): p
           for i, p in enumerate(PROMPTS)}
    outputs = engine.run_all()
    for rid, prompt in ids.items():
        # Greedy output under a smaller token limit is a prefix of the longer one.
        expected = plain_outputs[prompt][: LENGTHS[rid % len(LENGTHS)]]
        assert outputs[rid].token_ids == expected, prompt
    per_token = engine.cache.memory().bytes_per_token
    events = memory_events(engine)
    assert max(len(e.running) for e in events) == 16  # the running limit, not the pool, bounded the batch
    for event in events:
        assert event.blocks_used == sum(1 for owner in event.owners if owner >= 0)
        assert event.bytes_reserved == event.blocks_used * event.block_size * per_token
        assert event.bytes_used <= event.bytes_reserved and event.logical_bytes <= event.contiguous_bytes
        # the pool as each step's forward held it: never empty while the step ran requests (the Memory chart once
        # dropped to 0 MiB where a step finished every running request with others still waiting)
        assert event.bytes_used > 0 and event.running
    check_no_leak(engine)


def test_a_pool_too_small_preempts_and_still_completes_every_request(target, plain_outputs) -> None:
    # 14 blocks of 8 slots: two or three of these requests fit at once; the budget also chunks the prefills.
    engine = Engine(target, EngineParams(num_blocks=14, block_size=8, max_batch_tokens=24))
    prompts = PROMPTS[:6]
    ids = {engine.add_request(p, generation=GenerationParams(max_new_tokens=24)): p for p in prompts}
    outputs = engine.run_all()
    assert any(isinstance(e, PreemptEvent) for e in engine.events)
    assert sum(r.preemptions for r in engine.requests.values()) > 0
    for rid, prompt in ids.items():
        assert outputs[rid].token_ids == plain_outputs[prompt], prompt
    check_no_leak(engine)


def test_shared_prompt_prefixes_are_cached_and_give_identical_outputs(target) -> None:
    passage = ("The lighthouse keeper climbed the ninety steps every evening at dusk, lit the lamp, wound the "
               "clockwork that turned the lens, and wrote the weather in a leather log book. ")
    questions = ["How many steps did the keeper climb?", "What did the keeper write in the log book?",
                 "When did the keeper light the lamp?"]
    generation = GenerationParams(max_new_tokens=12)
    results = {}
    for caching, together in ((True, False), (True, True), (False, True)):
        engine = Engine(target, EngineParams(block_size=8, prefix_caching=caching))
        ids = [engine.add_request(passage + questions[0], generation=generation)]
        if not together:
            engine.step()  # the first prompt's prefill writes the passage's blocks; later prompts can share them
        ids += [engine.add_request(passage + q, generation=generation) for q in questions[1:]]
        outputs = engine.run_all()
        results[caching, together] = [outputs[i].token_ids for i in ids]
        # Arriving together, the later requests wait for the first one's prefill and then share its blocks.
        assert (max(len(e.shared) for e in memory_events(engine)) > 0) == caching
        computed = sum(e.num_tokens for e in memory_events(engine))
        results["computed", caching, together] = computed
        check_no_leak(engine)
    assert results[True, False] == results[True, True] == results[False, True]
    # Each later prompt skips exactly the full blocks it has in common with the first one.
    prompts = [encode_prompt(target, passage + q, generation) for q in questions]
    common = [next(i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:]]
    saved = results["computed", False, True] - results["computed", True, True]
    assert saved == sum(8 * (n // 8) for n in common) > 0
    for question, got in zip(questions, results[True, True]):
        prompt_ids = encode_prompt(target, passage + question, generation)
        assert solo(target, prompt_ids, SamplingParams(), generation) == got


def test_per_request_sampling_aborts_and_static_batches(target, plain_outputs) -> None:
    sampled = SamplingParams(temperature=0.8, top_k=50, seed=7)
    generation = GenerationParams(max_new_tokens=10)
    for policy in ("continuous", "static"):
        engine = Engine(target, EngineParams(policy=policy, max_running=3))
        greedy_id = engine.add_request(PROMPTS[0], generation=generation)
        sampled_id = engine.add_request(PROMPTS[1], sampled, generation)
        doomed = engine.add_request(PROMPTS[2], generation=generation)
        late = engine.add_request(PROMPTS[3], generation=generation)
        engine.step()
        engine.step()
        engine.abort(doomed)
        outputs = engine.run_all()
        assert engine.requests[doomed].status is Status.ABORTED and doomed not in outputs
        assert outputs[greedy_id].token_ids == plain_outputs[PROMPTS[0]][:10]
        assert outputs[late].token_ids == plain_outputs[PROMPTS[3]][:10]
        prompt_ids = encode_prompt(target, PROMPTS[1], generation)
        assert outputs[sampled_id].token_ids == solo(target, prompt_ids, sampled, generation)
        running = [set(e.running) for e in memory_events(engine)]
        late_admitted = next(i for i, r in enumerate(running) if late in r)
        if policy == "static":  # the fourth request waits for the whole first batch of three
            assert all(not (r & {greedy_id, sampled_id}) for r in running[late_admitted:])
        else:  # it takes the aborted request's place at once
            assert running[late_admitted] & {greedy_id, sampled_id}
        check_no_leak(engine)


def test_bad_requests_and_settings_are_refused(target) -> None:
    engine = Engine(target, EngineParams(num_blocks=4, block_size=8))
    with pytest.raises(ConfigError, match="num_blocks must be >= 11"):
        engine.add_request(PROMPTS[0], generation=GenerationParams(max_new_tokens=40))
    with pytest.raises(ConfigError, match="prompt ids"):
        engine.add_request([])
    with pytest.raises(ConfigError, match="policy"):
        EngineParams(policy="fastest")
    with pytest.raises(ConfigError, match=r"max_batch_tokens must be an integer in \[1, 65536\]"):
        EngineParams(max_batch_tokens=0)
    with pytest.raises(KeyError):
        engine.abort(99)
    with pytest.raises(ConfigError, match=r"depth must be an integer in \[1, 16\]"):
        MedusaParams(depth=0)
    with pytest.raises(ConfigError, match="heads must be a folder of Medusa heads or None"):
        MedusaParams(heads=" ")
    with pytest.raises(ConfigError, match=r"medusa.depth must be in \[1, 4\] \(the heads' number\), got 5"):
        build_proposer(target, "medusa", MedusaParams(depth=5))
    with pytest.raises(ModelLoadError, match="medusa heads: made for hidden size 576"):
        build_proposer(TINY, "medusa")  # the shipped heads are the embedded model's
    with pytest.raises(ConfigError, match=r"gamma must be an integer in \[1, 16\]"):
        SpeculativeParams(gamma=17)
    with pytest.raises(ConfigError, match="draft must be a model spec or None"):
        SpeculativeParams(draft="")
    with pytest.raises(ConfigError, match=r"draft_cost must be in \[0, 1\] or None, got 2"):
        SpeculativeParams(draft_cost=2.0)
    with pytest.raises(ConfigError, match="draft: its tokenizer differs from the target's"):
        build_proposer(target, "speculative", draft=TINY)
    with pytest.raises(ModelLoadError, match="draft: none ships for this target"):
        build_proposer(replace(TINY, spec=ModelSpec(source="some/other-model")), "speculative")
    with pytest.raises(ConfigError, match="copies: prompt lookup's copies graft onto the trees of medusa, "
                                          "speculative, eagle, not onto lookahead"):
        build_proposer(target, "lookahead", copies=PromptLookupParams())
    with pytest.raises(ConfigError, match=r"window must be an integer in \[1, 16\]"):
        LookaheadParams(window=0)
    with pytest.raises(ModelLoadError, match="corpus: .* written for a vocabulary of 49152 tokens, the target has 48"):
        build_proposer(TINY, "lookahead")  # the shipped corpus is the embedded model's


GROUNDED = ("Repeat this sentence twice, word for word: the quick brown fox jumps over the lazy dog.",
            "Copy this list exactly: red, green, blue, red, green, blue, red, green, blue.")


@pytest.fixture(scope="module")
def grounded_outputs(target, plain_outputs) -> dict[str, tuple[int, ...]]:
    """Plain greedy decoding of the exactness prompts and the copying ones, 24 tokens each: what every proposer in
    the batch must reproduce (decoded once for the module)."""
    generation = GenerationParams(max_new_tokens=24)
    expected = dict(plain_outputs)
    for prompt in GROUNDED:
        expected[prompt] = solo(target, encode_prompt(target, prompt, generation), SamplingParams(), generation)
    return expected


def test_prompt_lookup_in_the_batch_gives_plain_outputs(target, grounded_outputs) -> None:
    """Copies verified in the batch's decode forward change how many tokens a step commits, never which: at batch
    sizes 1, 4 and 20 every request gets plain decoding's greedy tokens, and copies were accepted along the way."""
    generation = GenerationParams(max_new_tokens=24)
    prompts = list(grounded_outputs)
    for max_running in (1, 4, 20):
        engine = Engine(target, EngineParams(max_running=max_running), proposer=build_proposer(target, "prompt-lookup"))
        ids = {engine.add_request(p, generation=generation): p for p in prompts}
        outputs = engine.run_all()
        for rid, prompt in ids.items():
            assert outputs[rid].token_ids == grounded_outputs[prompt], (max_running, prompt)
        copied = counts(engine, "copy")
        assert copied.steps > 0 and 0 < copied.accepted < copied.proposed, max_running
        # a step over a copy ran wider rows than the batch: the memory events count them
        assert any(e.num_tokens > len(e.running) for e in memory_events(engine) if e.running)
        check_no_leak(engine)


@pytest.mark.parametrize("proposer", ["lookup", "medusa", "draft", "lookahead", "rest", "self"])
def test_proposals_sample_what_plain_decoding_samples_seed_for_seed(target, proposer) -> None:
    """Under sampling a copied or guessed token is kept only when the request's own draw at its row is that token,
    which is the lossless rule for one-hot proposals and draws exactly what plain decoding draws: same seeds, same
    tokens. With Medusa and the draft the engine draws each step's rows at once, as it does off the CPU
    (`draws_ahead`: the draft's sampled chains carry q and draw as they go), with a greedy request in the batch."""
    generation = GenerationParams(max_new_tokens=20)
    prompts = [*GROUNDED, PROMPTS[6], PROMPTS[16]]
    # a draft or heads that cost nothing keep guessing through the refusals sampling brings, so that some are kept
    algo, on = {"lookup": ("prompt-lookup", None), "medusa": ("medusa", None),
                "draft": ("speculative", SpeculativeParams(draft_cost=0.0)), "lookahead": ("lookahead", None),
                "rest": ("rest", None), "self": ("self-speculative", SelfSpeculativeParams(draft_cost=0.0))}[proposer]
    # lookahead's window makes every row wider, which pays at batch 1 on this CPU, not at 3
    batch = 1 if proposer == "lookahead" else 3
    results, kept = [], []
    free = build_proposer(target, algo, on)
    if proposer == "medusa":
        free.own.fixed = 0.0
    for proposing in (None, free):
        # prompts prefilled in chunks of up to 24 tokens: a chunk short of the prompt's end draws nothing
        engine = Engine(target, EngineParams(max_running=batch, max_batch_tokens=24), proposer=proposing)
        engine.draws_ahead = proposing is not None and proposer in ("medusa", "draft")
        ids = [engine.add_request(p, SamplingParams(temperature=0.8, top_k=50, seed=i) if i else None, generation)
               for i, p in enumerate(prompts)]
        outputs = engine.run_all()
        results.append([outputs[i].token_ids for i in ids])
        kept.append(counts(engine, {"lookup": "copy"}.get(proposer, proposer)))
    assert results[0] == results[1]
    assert kept[1].accepted > 0 and kept[0].proposed == 0


def runner_up_kept(monkeypatch) -> list[bool]:
    """Spy on the engine's verified trees of guesses: for each, whether a guess kept had a better-ranked sibling
    (a runner-up that only a tree, not a chain of top guesses, could have proposed)."""
    seen = []
    real = GuessCalibration.record

    def record(self, proposal, path, label):
        seen.append(any(proposal.parents[row - 1] in proposal.parents[: row - 1] for row in path))
        real(self, proposal, path, label)
    monkeypatch.setattr(GuessCalibration, "record", record)
    return seen


@pytest.mark.parametrize("guesser", ["medusa", "draft"])
def test_guesses_in_the_batch_give_plain_outputs(target, grounded_outputs, monkeypatch, guesser) -> None:
    """Trees of the heads' guesses or the draft's chains, alone or beside copies, change how many tokens a step
    commits, never which: at batch sizes 1, 4 and 20 every request gets plain decoding's greedy tokens, with guesses
    accepted and refused along the way (the heads' runners-up among them), and every pool empty at the end."""
    runner_up = runner_up_kept(monkeypatch)
    generation = GenerationParams(max_new_tokens=24)
    prompts = list(grounded_outputs)
    algo = {"medusa": "medusa", "draft": "speculative"}[guesser]
    draft = None
    for max_running, lookup in ((1, None), (4, None), (20, None), (4, PromptLookupParams())):
        proposer = build_proposer(target, algo, copies=lookup, draft=draft)
        # priced cheaply, so that the guesser runs wherever its guesses could pay (the price never changes the tokens)
        (proposer.inner if isinstance(proposer, Grafted) else proposer).own.fixed = 0.05
        engine = Engine(target, EngineParams(max_running=max_running), proposer=proposer)
        draft = drafter(engine).draft if guesser == "draft" else None  # the shipped draft, loaded once
        ids = {engine.add_request(p, generation=generation): p for p in prompts}
        outputs = engine.run_all()
        for rid, prompt in ids.items():
            assert outputs[rid].token_ids == grounded_outputs[prompt], (max_running, lookup, prompt)
        guessed = counts(engine, guesser)
        assert guessed.steps > 0 and 0 < guessed.accepted < guessed.proposed, max_running
        assert any(runner_up) or guesser == "draft", max_running
        runner_up.clear()
        assert (counts(engine, "copy").accepted > 0) == (lookup is not None)
        assert any(e.num_tokens > len(e.running) for e in memory_events(engine) if e.running)
        check_no_leak(engine)


# A forward costs one step however wide: every proposal and window the budget and the blocks allow runs.
FLAT = ForwardCosts((1, 2), (1.0, 1.0))


@pytest.mark.parametrize("algo", ["rest", "self-speculative"])
def test_retrieval_and_own_layers_in_the_batch_give_plain_outputs(target, grounded_outputs, algo) -> None:
    """Tries of retrieved continuations, and chains the target drafts with its own layers on its own paged cache
    (their K/V written for the drafted tokens and dropped), change how many tokens a step commits, never which: at
    batch sizes 1, 4 and 20 every request gets plain decoding's greedy tokens, with proposals accepted and refused,
    and every KV block free at the end (the contiguous cache runs one request: tests/test_rest.py and
    tests/test_self_speculative.py)."""
    generation = GenerationParams(max_new_tokens=24)
    prompts = list(grounded_outputs)
    label = {"rest": "rest", "self-speculative": "self"}[algo]
    for max_running in (1, 4, 20):
        proposer = build_proposer(target, algo)
        if proposer.own is not None:
            proposer.own.fixed = 0.0  # drafting priced free, so that it drafts wherever a chain could pay
        engine = Engine(target, EngineParams(max_running=max_running), proposer=proposer, costs=FLAT)
        ids = {engine.add_request(p, generation=generation): p for p in prompts}
        outputs = engine.run_all()
        for rid, prompt in ids.items():
            assert outputs[rid].token_ids == grounded_outputs[prompt], (algo, max_running, prompt)
        made = counts(engine, label)
        assert made.steps > 0 and 0 < made.accepted < made.proposed, (algo, max_running)
        check_no_leak(engine)


def test_lookahead_in_the_batch_gives_plain_outputs(target, grounded_outputs) -> None:
    """Each request's Jacobi window and pool candidates (merged into a tree) beside its next token change how many
    tokens a step commits, never which: at batch 1 as planned, and at batch 4 and 20 with every window and
    candidate run (a wider forward costs nothing here), every request gets plain decoding's greedy tokens, with
    candidates accepted and refused, every window moved on, and every KV block free at the end."""
    generation = GenerationParams(max_new_tokens=24)
    prompts = list(grounded_outputs)
    for max_running in (1, 4, 20):
        engine = Engine(target, EngineParams(max_running=max_running), proposer=build_proposer(target, "lookahead"),
                        costs=FLAT if max_running > 1 else None)
        ids = {engine.add_request(p, generation=generation): p for p in prompts}
        states = dict(engine.proposer.states)  # ended requests' states are dropped: keep them to look at
        first_windows = {rid: states[rid].window for rid in ids}
        outputs = engine.run_all()
        for rid, prompt in ids.items():
            assert outputs[rid].token_ids == grounded_outputs[prompt], (max_running, prompt)
        ahead = counts(engine, "lookahead")
        assert ahead.steps > 0 and 0 < ahead.accepted < ahead.proposed, max_running
        assert all(states[rid].window != first_windows[rid] for rid in ids)
        # the windows' rows: a step's forward is wider than its candidates alone
        assert any(e.num_tokens > len(e.running) for e in memory_events(engine) if e.running)
        check_no_leak(engine)


def test_proposals_calibration_and_the_widest_paying_forward() -> None:
    # the heads' guesses: rows 1 and 2 under the last token, 3 under 1, 4 under 3; row 5, a copy's own, under 4
    tree = Proposal([5, 6, 7, 8, 9], [0, 0, 1, 3, 4], ["medusa"] * 4 + ["copy"], [0.5, 0.25, 0.25, 0.125, 0.1],
                    [0.5, 0.25, 0.5, 0.5, None])
    chain = Proposal.chain([4, 4], "copy", 0.5)
    assert tree.depths() == [0, 1, 1, 2, 3, 4] and not tree.is_chain() and chain.is_chain()
    assert tree.first(2) == Proposal([5, 6], [0, 0], ["medusa"] * 2, [0.5, 0.25], [0.5, 0.25])
    assert tree.expected() == pytest.approx([1.0, 1.5, 1.75, 2.0, 2.125, 2.225])  # 1 + the reach of the first k
    assert chain.reach == [0.5, 0.25] and chain.expected() == [1.0, 1.5, 1.75]
    calibration = GuessCalibration(3)
    assert calibration.log_rates([[math.log(0.5)]]) == [[pytest.approx(math.log(0.5))]]  # no data: p itself
    assert calibration.bound(2) == [1.0, 2.0, 3.0]
    assert calibration.expected_tokens(2) == pytest.approx([1.0, 5 / 3, 5 / 3 + 4 / 9])  # the prior: 2 / 3 a depth
    for _ in range(40):  # rows 1 then 3 kept: depth 1 judged 0.75 for 1 kept, depth 2 0.5 for 1, depth 3 0.5 for 0
        # (row 5 is the copy's: nothing of the heads')
        calibration.record(tree, [1, 3], "medusa")
    assert calibration.scale(0) == pytest.approx(41 / 31) and calibration.scale(1) == pytest.approx(41 / 21)
    assert calibration.scale(2) == pytest.approx(1 / 21)
    assert calibration.log_rates([[math.log(0.9), math.log(0.1)]]) == [[0.0, pytest.approx(math.log(0.1 * 41 / 31))]]
    assert calibration.bound(3) == pytest.approx([1.0, 2.0, 3.0, 3.0 + 1 / 21])  # a rate never exceeds 1
    # row 2 kept: its sibling row 1 judged and refused, nothing below row 1 judged
    calibration.record(tree, [2], "medusa")
    assert calibration.kept[0] == 41 and calibration.predicted[0] == pytest.approx(30.75)
    assert calibration.predicted[1] == pytest.approx(20.0)
    copied = Proposal([5, 6], [0, 0], ["copy", "medusa"], [0.5, 0.25], [0.5, 0.25])  # a head guessed 5 too
    calibration.record(copied, [1], "medusa")  # only row 2, the heads' own guess, is judged: refused
    assert calibration.kept[0] == 41 and calibration.predicted[0] == pytest.approx(31.0)
    assert calibration.judged == [42, 40, 40]  # depth 1: the last token, its guesses judged 42 times (41 kept)
    reach = [(41 + 2 / 3) / 43, (40 + 2 / 3) / 41, (0 + 2 / 3) / 41]
    assert calibration.expected_tokens(3) == pytest.approx(
        [1.0, 1 + reach[0], 1 + reach[0] + reach[0] * reach[1], 1 + reach[0] + reach[0] * reach[1] + math.prod(reach)])

    def cost(width: int) -> float:  # plain, then a jump at 4 tokens
        return 1.0 if width == 1 else 1.2 if width < 4 else 3.0
    assert widest_paying([[1.0, 2.0, 2.5, 2.8, 3.0]], cost) == 3  # 3.0 / 3.0 does not beat 1
    assert widest_paying([[1.0, 1.1], [1.0, 1.2]], cost) == 1  # 2.3 < 2.4
    assert widest_paying([[1.0, 2.0], [1.0]], cost) == 2  # a shorter bound stays at its last value


def test_a_proposers_own_forwards_are_priced_as_measured(target, monkeypatch) -> None:
    """Fixed per depth where set; else the estimate until MEASURED drafting steps are in, then the medians of the
    recent ones (a step's first depth, catch-up included, and each further depth, in the batch's one-token
    forwards), which a step that captured a graph cannot move, dropped after STALE plans without a new one; the
    engine's steps record them, and its plans read them."""
    own = OwnCost(0.2, 0.05)
    own.record(1.0, 2, 0.01, 0.4)
    assert own() == DraftPrice(0.2, 0.2) and own()(3) == pytest.approx(0.6)  # fixed, per depth
    own = OwnCost(None, 0.05)
    for seconds, further in ((0.004, 0.001), (0.5, 0.3), (0.006, 0.002)):  # the second step captured a graph
        assert own() == DraftPrice(0.05, 0.05)  # the estimate, until three steps are in
        own.record(seconds, 3, 0.01, further)
    # first depths (0.003, 0.2, 0.004) / 0.01 = 0.3, 20, 0.4; further ones (0.001, 0.3, 0.002) / 2 / 0.01 = 0.05,
    # 15, 0.1
    assert own() == DraftPrice(pytest.approx(0.4), pytest.approx(0.1))
    assert own()(3) == pytest.approx(0.6) and own()(0) == 0.0
    own.record(0.1, 0, 0.01)  # nothing drafted: nothing measured
    assert len(own.firsts) == 3
    for _ in range(OwnCost.WINDOW):
        own.record(0.002, 1, 0.01, 0.0)  # a step one deep measures its first depth alone
    assert own() == DraftPrice(pytest.approx(0.2), pytest.approx(0.1)) and len(own.firsts) == OwnCost.WINDOW
    assert own.measured() == pytest.approx(0.1) and own.measured_first() == pytest.approx(0.2)
    # a price that stops the drafting gets no samples: STALE plans later the estimate is tried again
    for _ in range(OwnCost.STALE - 1):
        assert own().first == pytest.approx(0.2)
    assert own.value().first == pytest.approx(0.2)  # a report does not count as a plan
    assert own() == DraftPrice(0.05, 0.05) and not own.firsts and not own.furthers
    own.record(0.004, 2, 0.01)  # not timed apart: its seconds per depth price both
    assert own.unmeasured == 0 and list(own.firsts) == list(own.furthers) == [pytest.approx(0.2)]
    heads = OwnCost(None, 0.05, per_depth=False)  # one forward a step, whatever the depth
    for _ in range(3):
        heads.record(0.003, 4, 0.01)
    assert heads() == DraftPrice(pytest.approx(0.3), None) and heads()(4) == pytest.approx(0.3)
    # a further depth's forward over 4 rows a request is compared with its bytes at 4 rows of the target's curve;
    # the plan starts from the one-row floor, so that deeper drafting is tried and timed
    wide = OwnCost(None, 0.05, rows=4)
    curve = {1: 1.0, 3: 1.5, 4: 1.8}.__getitem__
    assert wide.estimate(curve) == pytest.approx(0.09) and wide() == DraftPrice(0.05, 0.05)
    for _ in range(3):
        wide.record(0.003, 2, 0.01, 0.001)
    assert wide() == DraftPrice(pytest.approx(0.2), pytest.approx(0.1))
    eagle = build_proposer(target, "eagle", EagleParams(top_k=3))
    assert eagle.own.rows == 3 and eagle.own_estimate(curve) == pytest.approx(1.5 * eagle.own.prior)
    assert Cost(curve, 0.01).price(eagle.own) == DraftPrice(eagle.own.prior, eagle.own.prior)
    assert Cost(curve, 0.01, as_set=True).price(eagle.own) == DraftPrice(0.0, 0.0)

    plans = wide.unmeasured
    with wide.unrecorded():  # a warm-up's samples are dropped after it
        wide.record(0.5, 2, 0.01, 0.4)
        wide()
        assert len(wide.furthers) == 4
    assert list(wide.furthers) == [pytest.approx(0.1)] * 3 and wide.unmeasured == plans

    proposer = build_proposer(target, "speculative", SpeculativeParams(gamma=3))
    estimate = proposer.own_cost()
    priced = []
    monkeypatch.setattr(proposer.own, "record", lambda seconds, depth, one_s, further: (
        priced.append((depth, one_s, further, seconds)), OwnCost.record(proposer.own, seconds, depth, one_s, further)))
    generate(target, PROMPTS[0], proposer, SamplingParams(), GenerationParams(max_new_tokens=16))
    assert len(priced) >= 3 and all(depth >= 1 and one_s == TEST_COSTS.time(1) for depth, one_s, _, _ in priced)
    assert all(0 <= further < seconds for _, _, further, seconds in priced)  # a CPU times the further depths apart
    assert any(depth > 1 and further > 0 for depth, _, further, _ in priced)
    assert proposer.own_cost().first == statistics.median(proposer.own.firsts) != estimate.first


@pytest.mark.parametrize("algo", ["speculative", "eagle"])
def test_a_warm_up_drafts_and_teaches_no_price(target, algo, monkeypatch) -> None:
    """`warm_up` runs the proposer as set, so its own forwards pay their first calls, and leaves its measured price
    and drafting's payoff as they were; a run after it times its forwards again."""
    proposer = build_proposer(target, algo)
    recorded: list[int] = []
    monkeypatch.setattr(proposer.own, "record", lambda seconds, depth, one_s, further=None: (
        recorded.append(depth), OwnCost.record(proposer.own, seconds, depth, one_s, further)))
    kept(proposer).record(False, 1.0, 1.0)  # what earlier runs taught the planner of its drafting
    warm_up(target, PROMPTS[1], proposer, SamplingParams(), GenerationParams(max_new_tokens=8, plan="measured"))
    assert recorded and max(recorded) > 1  # it drafted, deeper than one
    assert not proposer.own.firsts and not proposer.own.furthers and proposer.own.unmeasured == 0
    assert len(kept(proposer).plain) == 1 and not kept(proposer).drafting
    generate(target, PROMPTS[1], proposer, SamplingParams(), GenerationParams(max_new_tokens=8, plan="as-set"))
    assert proposer.own.firsts


def test_a_copy_is_grafted_onto_the_heads_tree_in_best_first_order() -> None:
    """With both proposers a request's copy runs through the heads' guesses equal to it, then on as nodes of its own
    (as Medusa's copy_ngram grafts it), each copied token worth at least the request's acceptance of such copies;
    the rows come best first, parents before children, and nothing follows an end-of-sequence token."""
    logp = [[math.log(0.6), math.log(0.3)], [math.log(0.5), math.log(0.4)], [math.log(0.9), math.log(0.05)]]
    tokens = [[10, 11], [20, 21], [30, 31]]
    copy = Lookup([11, 21, 40, 41], start=0, ngram=2)

    def tree(nodes, eos, copy=None):  # uncalibrated guesses: their log-rates are their log-probabilities
        return guess_tree(logp, logp, tokens, nodes, frozenset(eos), "medusa", False, copy, 0.9, "copy")
    proposal = tree(6, (), copy)
    # worths: 11 0.9 (the copy's, over the head's 0.3), 21 0.81, 30 0.729, 40 0.729, 41 0.656, 10 0.6
    assert proposal.tokens == [11, 21, 30, 40, 41, 10] and proposal.parents == [0, 1, 2, 2, 4, 0]
    assert proposal.sources == ["copy", "copy", "medusa", "copy", "copy", "medusa"]
    assert proposal.probs == pytest.approx([0.3, 0.4, 0.9, None, None, 0.6])
    worths = [0.9, 0.81, 0.729, 0.729, 0.6561, 0.6]
    assert proposal.expected() == pytest.approx([1.0 + sum(worths[:k]) for k in range(7)])
    ended = tree(6, {21}, copy)
    assert ended.tokens == [11, 21, 10] and ended.parents == [0, 1, 0]
    alone = tree(4, ())  # 0.6, 0.3 and 0.3 (a tie), 0.27
    assert alone.tokens[0] == 10 and sorted(alone.tokens[1:3]) == [11, 20] and alone.tokens[3] == 30
    assert alone.parents[alone.tokens.index(30)] == alone.tokens.index(20) + 1 and set(alone.sources) == {"medusa"}


def test_a_drafts_chain_keeps_its_runner_up_a_leaf() -> None:
    """A draft's guess at a depth was drawn after its top guess at the depth before, so its tree is the chain with
    the first place's runner-up as a leaf; a copy through the runner-up goes on as nodes of its own."""
    logp = [[math.log(0.6), math.log(0.35)], [math.log(0.9)], [math.log(0.9)]]
    tokens = [[10, 11], [20], [30]]

    def tree(nodes, copy=None):
        return guess_tree(logp, logp, tokens, nodes, frozenset(), "draft", True, copy, 0.8, "copy")
    chain = tree(5)
    # 10 0.6, 20 0.54, 30 0.486, 11 0.35; heads' trees would hang 20 below 11 as well (0.315)
    assert chain.tokens == [10, 20, 30, 11] and chain.parents == [0, 1, 2, 0] and set(chain.sources) == {"draft"}
    assert chain.expected() == pytest.approx([1.0, 1.6, 2.14, 2.626, 2.976])
    copied = tree(6, Lookup([11, 40, 41], start=0, ngram=1))
    # the copy through 11 (worth 0.8), then its own 40 (0.64), 41 (0.512); the chain beside it
    assert copied.tokens == [11, 40, 10, 20, 41, 30] and copied.parents == [0, 1, 0, 3, 2, 4]
    assert copied.sources == ["copy", "copy", "draft", "draft", "copy", "draft"]


def tiny_model(vocab: int = 48, noise: float = 0.0) -> LoadedModel:
    """A random two-layer Llama with a small vocabulary: fast enough to run hundreds of engine schedules. With
    `noise`, the same model with that much Gaussian noise on every weight: a draft that agrees with it often."""
    config = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    state = {}
    for name, shape in ((f"model.layers.{i}.{part}", size) for i in range(2) for part, size in (
            ("self_attn.q_proj.weight", (32, 32)), ("self_attn.k_proj.weight", (16, 32)),
            ("self_attn.v_proj.weight", (16, 32)), ("self_attn.o_proj.weight", (32, 32)),
            ("mlp.gate_proj.weight", (64, 32)), ("mlp.up_proj.weight", (64, 32)), ("mlp.down_proj.weight", (32, 64)),
            ("input_layernorm.weight", (32,)), ("post_attention_layernorm.weight", (32,)))):
        state[name] = torch.randn(shape) * (0.3 if len(shape) == 2 else 0.1) + (1.0 if len(shape) == 1 else 0.0)
    state["model.embed_tokens.weight"] = torch.randn(vocab, 32)
    state["model.norm.weight"] = torch.ones(32)
    torch.manual_seed(2)
    state = {name: weight + noise * torch.randn_like(weight) for name, weight in state.items()}
    model = build_model(config, state, torch.float32, torch.device("cpu"))
    return LoadedModel(model=model, tokenizer=TinyTokenizer(), name="tiny", folder=Path("."), eos_token_ids=(0,),
                       spec=ModelSpec())


class TinyTokenizer:
    """Just enough tokenizer for the stop rules: token ids as text."""

    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(48)}


def tiny_heads(model: LoadedModel, num_heads: int = 3) -> LoadedHeads:
    """Untrained heads for the tiny model: zero blocks make each head guess what the target's own row predicted
    (the last token again), with small random ones on top so the guesses differ between heads."""
    torch.manual_seed(1)
    heads = MedusaHeads(32, num_heads)
    for block in heads.blocks:
        torch.nn.init.normal_(block.weight, std=0.05)
    vocab = torch.arange(model.model.config.vocab_size)
    return LoadedHeads(heads.eval().requires_grad_(False), Path("."), "tiny", output_rows(model.model, vocab),
                       FusedBlocks.of(heads, model.model))


TINY = tiny_model()
TINY_HEADS = tiny_heads(TINY)
TINY_DRAFT = tiny_model(noise=0.05)
PREFIX = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5]
# (prompt, max_new_tokens, step at which the request arrives); prompts start with a slice of one common prefix.
REQUESTS = st.lists(st.tuples(st.tuples(st.integers(0, len(PREFIX)), st.lists(st.integers(1, 9), max_size=5)),
                              st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=7)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(REQUESTS, st.integers(1, 4), st.integers(1, 12), st.integers(1, 4), st.sampled_from(["continuous", "static"]),
       st.booleans(), st.sets(st.integers(0, 6)), st.integers(0, 6), st.integers(0, 5), st.integers(0, 3),
       st.sampled_from(["heads", "draft", "lookahead"]))
def test_random_loads_give_solo_outputs_and_leak_nothing(requests, block_size, budget, max_running, policy,
                                                          caching, aborted, spare, copy_tokens, guesses,
                                                          guesser) -> None:
    """Requests arrive over the first steps; the pool ranges from one request's worth (every admission can
    preempt) to a few blocks more; some requests are aborted at step 3; with copy_tokens > 0, prompt lookup
    proposes copies of up to that many tokens whenever it finds one, and with guesses > 0 untrained Medusa heads
    propose trees that many deep, or a draft (the tiny model with noise) chains that long (with copies too, copies
    grafted on; no verify overhead or draft cost on this model: every proposal is worth a wider forward), or
    lookahead runs windows that many columns wide (no copies then; every window runs), which the token budget and
    the free blocks trim (and the draft's own pool, as small as the target's)."""
    prompts = [PREFIX[:cut] + tail or [7] for (cut, tail), _, _ in requests]
    largest = max(-(-(len(p) + n) // block_size) for p, (_, n, _) in zip(prompts, requests))
    lookahead = LookaheadParams(window=guesses, ngram=2 + guesses // 3, guesses=2, text_ngram=2 + guesses // 2,
                                corpus_pool=False) if guesses and guesser == "lookahead" else None
    lookup = PromptLookupParams(num_draft=copy_tokens) if copy_tokens and not lookahead \
        else None
    medusa = MedusaParams(depth=guesses) if guesses and guesser == "heads" else None
    draft = SpeculativeParams(gamma=guesses, draft_cost=0.0) if guesses and guesser == "draft" \
        else None
    params = EngineParams(num_blocks=largest + spare, block_size=block_size, max_batch_tokens=budget,
                          max_running=max_running, policy=policy, prefix_caching=caching)
    if medusa:
        proposer = build_proposer(TINY, "medusa", medusa, lookup, heads=TINY_HEADS)
    elif draft:
        proposer = build_proposer(TINY, "speculative", draft, lookup, draft=TINY_DRAFT)
    else:
        proposer = build_proposer(TINY, "lookahead", lookahead) if lookahead else \
            build_proposer(TINY, "prompt-lookup", lookup) if lookup else None
    engine = Engine(TINY, params, proposer=proposer, costs=FLAT)
    ids: dict[int, int] = {}  # request index -> engine id
    outputs = {}
    run_load(engine, requests, prompts, aborted, ids, outputs, draft is not None)
    for i, rid in ids.items():
        if engine.requests[rid].status is Status.ABORTED:
            continue
        expected = solo(TINY, prompts[i], SamplingParams(), GenerationParams(max_new_tokens=requests[i][1]))
        assert outputs[rid].token_ids == expected
    check_no_leak(engine)


def run_load(engine: Engine, requests, prompts: list[list[int]], aborted: set[int], ids: dict[int, int],
             outputs: dict, drafting: bool) -> None:
    """Steps a random load to its end: requests arriving at their steps, the aborted ones aborted at step 3."""
    for step in range(10_000):
        for i, (_, n, arrival) in enumerate(requests):
            if arrival == step:
                ids[i] = engine.add_request(prompts[i], generation=GenerationParams(max_new_tokens=n))
        if step == 3:
            for i in aborted & set(ids):
                engine.abort(ids[i])
        if step > 6 and not engine.has_unfinished():
            break
        outputs.update((out.id, out.output) for out in engine.step() if out.finished)
        for request in engine.running:  # a refused copy, a window and the padding never stay in the cache
            assert engine.cache.length(request.id) == request.num_computed
            if drafting:
                assert drafter(engine).cache.length(request.id) <= request.num_computed


def test_no_copy_is_looked_up_when_none_could_pay(monkeypatch) -> None:
    """The search scans each request's whole text, so it is skipped when even the longest copy at each request's
    best acceptance so far could not pay for a wider forward (here each token of a forward costs 4 one-token
    forwards more)."""
    searched = []
    real = prompt_lookup.find_continuations
    monkeypatch.setattr(prompt_lookup, "find_continuations", lambda *a, **k: searched.append(1) or real(*a, **k))
    outputs = {}
    for name, costs in (("dear", ForwardCosts((1, 2), (1.0, 5.0))), ("free", FLAT)):
        engine = Engine(TINY, EngineParams(), proposer=build_proposer(TINY, "prompt-lookup",
                                                                      PromptLookupParams(num_draft=4)), costs=costs)
        ids = [engine.add_request(PREFIX * 3, generation=GenerationParams(max_new_tokens=12)) for _ in range(2)]
        done = engine.run_all()
        outputs[name] = [done[i].token_ids for i in ids]
        assert bool(searched) == (name == "free") and (counts(engine, "copy").steps > 0) == (name == "free")
    assert outputs["dear"] == outputs["free"]


def check_cache_holds(cache, model: LoadedModel, seq: int, tokens: list[int], block_size: int) -> None:
    """The paged KV of sequence `seq` equals what a recomputation of `tokens` from scratch gives."""
    length = len(tokens)
    assert cache.length(seq) == length
    table = cache.blocks.table(seq)
    slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(length)])  # (T,)
    fresh = new_cache(model.model, length, GenerationParams())
    forward_tokens(model.model, fresh, tokens)
    for pool, theirs in ((cache.k, fresh.k), (cache.v, fresh.v)):
        mine = pool.index_select(1, slots)  # (layers, T, Hkv, D)
        torch.testing.assert_close(mine, theirs[:, 0, :, :length].transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_untrained_heads_in_the_batch_are_refused_and_accepted_and_the_cache_stays_exact(monkeypatch) -> None:
    """On the tiny model the untrained heads' trees are sometimes right, runners-up too: after every step the
    cache holds exactly the KV of the committed tokens (as a recomputation from scratch gives it), and the outputs
    are the solo ones."""
    runner_up = runner_up_kept(monkeypatch)
    prompts = [PREFIX, PREFIX[:4] + [8, 8], [9] * 6, PREFIX[::-1]]
    generation = GenerationParams(max_new_tokens=16)
    engine = Engine(TINY, EngineParams(num_blocks=32, block_size=4),
                    proposer=build_proposer(TINY, "medusa", heads=TINY_HEADS), costs=FLAT)
    assert run_checking_the_cache(engine, prompts, generation) > 20
    guessed = counts(engine, "medusa")
    assert 0 < guessed.accepted < guessed.proposed and any(runner_up)


def run_checking_the_cache(engine: Engine, prompts: list[list[int]], generation: GenerationParams) -> int:
    """Serves the prompts on the tiny model to the end, checking after every step that each running request's KV
    is a recomputation of its committed tokens, then that every output is the solo one and no block leaked;
    returns how many checks ran."""
    ids = [engine.add_request(p, generation=generation) for p in prompts]
    outputs, checked = {}, 0
    while engine.has_unfinished():
        outputs.update((out.id, out.output) for out in engine.step() if out.finished)
        for request in engine.running:
            check_cache_holds(engine.cache, TINY, request.id, request.tokens[: request.num_computed], 4)
            checked += 1
    for rid, prompt in zip(ids, prompts):
        assert outputs[rid].token_ids == solo(TINY, prompt, SamplingParams(), generation)
    check_no_leak(engine)
    return checked


def test_a_tiny_draft_in_the_batch_keeps_both_caches_exact() -> None:
    """On the tiny model a noisy copy of it drafts chains that are partly right, partly wrong and sometimes wholly
    kept: after every step each running request's target KV holds exactly its committed tokens, and the draft's KV
    exactly the draft's recomputation of what it has read (never the last token, which it reads next), whatever
    the drafts, copies and padded catch-up forwards did; the outputs are the solo ones."""
    prompts = [PREFIX, PREFIX[:4] + [8, 8], [9] * 6, PREFIX[::-1], PREFIX * 2]
    generation = GenerationParams(max_new_tokens=16)
    lookup = PromptLookupParams(num_draft=3)
    drafts = SpeculativeParams(gamma=3, draft_cost=0.0)
    engine = Engine(TINY, EngineParams(num_blocks=64, block_size=4, max_running=3),
                    proposer=build_proposer(TINY, "speculative", drafts, lookup, draft=TINY_DRAFT), costs=FLAT)
    draft = drafter(engine)
    ids = [engine.add_request(p, generation=generation) for p in prompts]
    outputs, checked = {}, 0
    real = draft.chains

    def chains(requests, depth):
        out = real(requests, depth)
        for request in requests:  # the draft has read everything up to the last token, and its chain but the end
            if request.id in out:
                assert draft.cache.length(request.id) == request.num_computed + len(out[request.id][1])
        return out
    draft.chains = chains
    while engine.has_unfinished():
        outputs.update((out.id, out.output) for out in engine.step() if out.finished)
        for request in engine.running:
            check_cache_holds(engine.cache, TINY, request.id, request.tokens[: request.num_computed], 4)
            read = draft.cache.length(request.id)  # 0 until its first chain
            assert read <= request.num_computed
            if read:
                check_cache_holds(draft.cache, TINY_DRAFT, request.id, request.tokens[:read], 4)
                checked += 1
    assert checked > 20
    for rid, prompt in zip(ids, prompts):
        assert outputs[rid].token_ids == solo(TINY, prompt, SamplingParams(), generation)
    guessed = counts(engine, "draft")
    assert 0 < guessed.accepted < guessed.proposed and counts(engine, "copy").proposed > 0
    check_no_leak(engine)


def test_lookahead_in_the_batch_keeps_the_cache_exact() -> None:
    """On the tiny model, with windows of two rows of two columns and three candidates from the pools every step:
    after every step each running request's KV holds exactly its committed tokens (the window's rows and the
    refused candidates dropped), whatever a small pool preempted; the outputs are the solo ones."""
    prompts = [PREFIX, PREFIX[:4] + [8, 8], [9] * 6, PREFIX[::-1], PREFIX * 2]
    generation = GenerationParams(max_new_tokens=16)
    lookahead = LookaheadParams(window=2, ngram=3, guesses=3, corpus_pool=False)
    engine = Engine(TINY, EngineParams(num_blocks=12, block_size=4, max_running=4),
                    proposer=build_proposer(TINY, "lookahead", lookahead), costs=FLAT)
    assert run_checking_the_cache(engine, prompts, generation) > 20
    assert any(isinstance(e, PreemptEvent) for e in engine.events)
    ahead = counts(engine, "lookahead")
    assert 0 < ahead.accepted < ahead.proposed


def test_finished_requests_can_be_forgotten_and_events_handed_over() -> None:
    """What a long-running server needs: no record of finished requests, no history of events."""
    engine = Engine(tiny_model(), EngineParams(num_blocks=16, block_size=4))
    kept = engine.add_request([1, 2, 3], SamplingParams(), GenerationParams(max_new_tokens=3))
    done = engine.add_request([4, 5], SamplingParams(), GenerationParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=f"request {kept} is waiting: abort it first"):
        engine.forget(kept)
    engine.step()
    with pytest.raises(ValueError, match=f"request {kept} is running"):
        engine.forget(kept)
    handed = engine.take_events()
    assert any(isinstance(e, MemoryEvent) for e in handed) and engine.events == []
    engine.run_all()
    engine.forget(done)
    assert list(engine.requests) == [kept] and engine.take_events() and engine.events == []
    with pytest.raises(KeyError, match=f"no request {done}"):
        engine.forget(done)


def token_counts(target: LoadedModel, draft: LoadedModel | None, seeds: int, sample: bool) -> list[collections.Counter]:
    """How often each token came at generated positions 2 and 3 over `seeds` seeded runs of one prompt (temperature
    1), plain or with the draft's chains proposed (sampled from its distributions when `sample`)."""
    drafting = SpeculativeParams(gamma=3, draft_cost=0.0, sample=sample)
    proposer = build_proposer(target, "speculative", drafting, draft=draft) if draft is not None else None
    engine = Engine(target, EngineParams(num_blocks=seeds * 2, block_size=8, max_running=16), proposer=proposer,
                    costs=FLAT)
    ids = [engine.add_request(PREFIX, SamplingParams(temperature=1.0, seed=seed), GenerationParams(max_new_tokens=3))
           for seed in range(seeds)]
    outputs = engine.run_all()
    if draft is not None:
        assert 0 < counts(engine, "draft").accepted < counts(engine, "draft").proposed
    # -1: the run had ended (the tiny model's end-of-sequence token is 0), which the distribution includes
    return [collections.Counter(([*outputs[i].token_ids, -1, -1])[place] for i in ids) for place in (1, 2)]


def total_variation(a: collections.Counter, b: collections.Counter) -> float:
    n, m = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / n - b[k] / m) for k in set(a) | set(b))


def test_sampled_draft_chains_are_judged_losslessly() -> None:
    """A chain drawn from a poor draft's own distributions and judged by the lossless rule leaves the target's
    distribution as it was: at the positions the chains propose, the tokens' frequencies over 3,000 seeds are
    plain decoding's (total variation under 0.05, about what two samples of one distribution differ by here),
    while the draft's own distribution is far from them (so the check can fail)."""
    poor = tiny_model(noise=0.5)
    seeds = 3000
    plain = token_counts(TINY, None, seeds, False)
    drafted = token_counts(TINY, poor, seeds, True)
    own = token_counts(poor, None, seeds, False)
    for place in range(2):
        assert total_variation(drafted[place], plain[place]) < 0.05, place
        assert total_variation(own[place], plain[place]) > 0.15, place


def test_forward_costs_are_measured_once_and_priced_by_tokens(tmp_path, monkeypatch, unpinned) -> None:
    """A forward's cost by width is measured on this machine once per model and read from the cache after (once
    per process), checked by a few forwards against this host (measured again where it drifted: another machine of
    the same kind shared the cache); a decode step of width W over a batch of B costs time(B W) / time(B),
    interpolated between the widths measured and extrapolated past the widest."""
    costs = ForwardCosts((1, 2, 4), (1.0, 1.0, 3.0))
    assert costs.time(3) == 2.0 and costs.time(6) == 5.0  # between 2 and 4; past 4 at the last slope
    assert costs.step_cost(1, 1) == 1.0 and costs.step_cost(1, 2) == 1.0 and costs.step_cost(2, 2) == 3.0
    calls, speed = [], [1.0]  # each measure's widths; seconds per token on the host now

    def measure(model, rounds=5, forwards="eager", requests=1, widths=costs_module.WIDTHS):
        calls.append("curve" if widths == costs_module.WIDTHS else "check")
        return ForwardCosts(widths, tuple(speed[0] * (1 + 0.1 * w) for w in widths))

    monkeypatch.setattr(costs_module, "measure", measure)

    def new_process():
        monkeypatch.setattr(costs_module, "_READ", {})
        calls.clear()
        return costs_module.forward_costs(TINY.model, tmp_path)

    first = new_process()
    saved = next((tmp_path / "forward-costs").iterdir())
    assert calls == ["curve"] and costs_module.forward_costs(TINY.model, tmp_path) is first  # once per process
    assert first.curve.tokens == costs_module.WIDTHS and first.time(4) == pytest.approx(1.4)
    assert new_process().curve == first.curve and calls == ["check"]  # read, and it holds
    speed[0] = 1.2  # a host 20% slower: within the drift allowed
    assert new_process().curve == first.curve and calls == ["check"]
    speed[0] = 0.4  # a faster machine reporting the same processor
    assert new_process().time(1) == pytest.approx(0.44) and calls == ["check", "curve"]
    assert new_process().time(1) == pytest.approx(0.44) and calls == ["check"]  # the file it rewrote is read next
    saved.write_text("not json")
    assert new_process().curve.tokens == costs_module.WIDTHS and calls == ["curve"]


def test_live_costs_price_forwards_as_they_run() -> None:
    """The engines' decode forwards correct the measured curve: a width's price is the curve's times the median of
    its last forwards' seconds over the curve's, once three are in; between widths measured the correction is
    interpolated, past them the nearest one's holds; a width not run for STALE forwards goes back to its neighbours'
    correction."""
    live = costs_module.LiveCosts(ForwardCosts((1, 2, 8), (1.0, 1.1, 1.7)))
    assert live.step_cost(1, 4) == pytest.approx(1.3)  # the curve's until measured
    for seconds in (0.5, 0.5, 0.6):
        live.record(1, seconds)
    assert live.time(1) == 0.5 and live.step_cost(1, 4) == pytest.approx(1.3)  # every width corrected alike
    for seconds in (1.0, 9.0, 1.0):  # a width-4 forward runs at 2 one-token forwards (a busy moment aside)
        live.record(4, seconds)
    assert live.step_cost(1, 4) == pytest.approx(2.0)
    # width 2 between: correction 0.5 + (1 / 1.3 - 0.5) * (2 - 1) / 3; width 8 past the widest: width 4's
    assert live.time(2) == pytest.approx(1.1 * (0.5 + (1 / 1.3 - 0.5) / 3))
    assert live.time(8) == pytest.approx(1.7 / 1.3)
    for _ in range(live.STALE):
        live.record(1, 0.5)
    assert live.step_cost(1, 4) == pytest.approx(2.0)  # its last sample was STALE forwards ago: still held
    live.record(1, 0.5)
    assert live.step_cost(1, 4) == pytest.approx(1.3)  # dropped: tried again at the curve's shape
