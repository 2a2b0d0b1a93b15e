"""The plan choice: "as-set" verifies all an algorithm's settings ask for, whatever this machine's forward costs say;
"measured" what pays. Both keep every algorithm greedy-exact; the reports say why a run drafted little."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from functools import partial

import pytest

from playground.__main__ import summary_line
from playground.config import EngineParams, GenerationParams
from playground.decoding.costs import ForwardCosts, LiveCosts, OneRequest
from playground.decoding.planning import DraftPrice, Payoff
from playground.decoding.proposer import Proposal, Proposer
from playground.decoding.registry import build_proposer
from playground.decoding.speculative import SpeculativeParams
from playground.engine import Engine, generate
from playground.engine.planner import KEPT, Planner, StepRecord, kept
from playground.metrics import FLAT_TOKEN_COST, compute, drafting, drafting_note, perfect, priced, projected_speedup
from playground.speedup import Speedup, winner
from playground.trace import DraftEvent, Trace, VerifyEvent

from .prompts import NEW_TOKENS, PROMPTS

ALGOS = ("speculative", "prompt-lookup", "lookahead", "medusa", "eagle")
# a host where every token of a forward costs as much as a one-token forward: drafting never pays
STEEP = ForwardCosts((1, 2, 64), (1.0, 2.0, 64.0))
STEEP_COST = partial(STEEP.step_cost, 1)  # a one-request forward's cost by width on it


@pytest.fixture(scope="module")
def proposers(target):
    return {algo: build_proposer(target, algo) for algo in ALGOS}


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_as_set_keeps_every_algorithm_plain_decoding(target, plain_outputs, proposers, kv) -> None:
    generation = GenerationParams(max_new_tokens=NEW_TOKENS, kv=kv, block_size=4, plan="as-set")
    for algo, proposer in proposers.items():
        for prompt in PROMPTS[:4]:
            output, trace = generate(target, prompt, proposer, None, generation, costs=STEEP)
            assert output.token_ids == plain_outputs[prompt], (algo, kv, prompt)
            assert trace.params["plan"] == "as-set"


@pytest.mark.parametrize("plan", ["as-set", "measured"])
def test_a_batch_under_either_plan_gives_every_request_its_solo_output(target, plain_outputs, proposers,
                                                                      plan) -> None:
    for algo in ("medusa", "eagle", "speculative"):
        engine = Engine(target, EngineParams(max_running=4, block_size=4, plan=plan), proposer=proposers[algo])
        ids = {engine.add_request(p, None, GenerationParams(max_new_tokens=NEW_TOKENS)): p for p in PROMPTS[4:8]}
        outputs = engine.run_all()
        engine.close()
        assert {ids[i]: out.token_ids for i, out in outputs.items()} == {p: plain_outputs[p] for p in PROMPTS[4:8]}, (
            algo, plan)


def test_as_set_drafts_what_the_settings_say_where_measured_drafts_nothing(target, proposers) -> None:
    """On a host where no drafting pays, the measured plan verifies no proposal and says why, with no acceptance;
    as set, the trees, chains and windows are verified in most steps (lookahead's where its pools hold a guess)."""
    prompt = PROMPTS[3]
    for algo in ("medusa", "eagle", "speculative", "lookahead"):
        measured = generate(target, prompt, proposers[algo], None, GenerationParams(max_new_tokens=NEW_TOKENS),
                            costs=STEEP)[1]
        assert drafting(measured).drafting_steps == 0 and compute(measured).drafted == 0, algo
        note = drafting_note(measured, lambda w: STEEP.step_cost(1, w))
        assert note.startswith("nothing drafted: under the measured plan no step was expected to save time") and (
            "a forward over 5 tokens costs 5.0 one-token forwards" in note), note
        line = summary_line(algo, compute(measured), measured, "length", OneRequest(STEEP))
        assert note in line and "acceptance" not in line.replace("there is no acceptance rate", "")
        assert line.endswith("(forward costs not measured here (a fixed curve))")  # where its figures come from
        as_set = generate(target, prompt, proposers[algo], None,
                          GenerationParams(max_new_tokens=NEW_TOKENS, plan="as-set"), costs=STEEP)[1]
        seen = drafting(as_set)
        assert seen.drafting_steps >= 0.6 * seen.steps and drafting_note(as_set, None) is None, (algo, seen)
    gamma = 3
    chains = build_proposer(target, "speculative", SpeculativeParams(gamma=gamma))
    trace = generate(target, PROMPTS[0], chains, None, GenerationParams(max_new_tokens=NEW_TOKENS, plan="as-set"),
                     costs=STEEP)[1]
    widths = [e.num_tokens for e in trace.events if isinstance(e, VerifyEvent)]
    # the chain of gamma and the runner-up in every step but the last few, which narrow to the tokens left
    assert widths.count(1 + gamma + 1) >= len(widths) - 3 and widths == sorted(widths, reverse=True)


def speedup(name: str, tokens_per_s: float, spread: float) -> Speedup:
    return Speedup(name, 3, tokens_per_s, (tokens_per_s / 100,) * 3, spread, 1.0, 0.0, 1.0, 0.0, None, 0.0, ())


def test_the_race_names_its_winner_and_whether_the_margin_beats_the_spread() -> None:
    lanes = {"plain": speedup("plain", 100, 0.02), "medusa": speedup("medusa", 130, 0.05),
             "eagle": speedup("eagle", 120, 0.03)}
    assert winner(lanes) == "Fastest: medusa, 1.08x the next (eagle), above the rounds' spread (5%)"
    lanes["eagle"] = speedup("eagle", 128, 0.04)
    assert winner(lanes) == ("Fastest: medusa, 1.02x the next (eagle), within the rounds' spread (5%): a tie on this "
                             "machine")


def test_the_projection_prices_the_runs_own_steps_on_a_flat_curve(target, proposers) -> None:
    plain = generate(target, PROMPTS[2], None, None, GenerationParams(max_new_tokens=NEW_TOKENS))[1]
    assert projected_speedup(plain, None) == 1.0  # one token a one-token forward
    trace = generate(target, PROMPTS[2], proposers["medusa"], None,
                     GenerationParams(max_new_tokens=NEW_TOKENS, plan="as-set"), costs=STEEP)[1]
    per_forward = (len(trace.finish().token_ids) - 1) / sum(isinstance(e, VerifyEvent) for e in trace.events)
    widest = max(e.num_tokens for e in trace.events if isinstance(e, VerifyEvent))
    free = projected_speedup(trace, DraftPrice(0.0, None))
    assert per_forward / (1 + FLAT_TOKEN_COST * (widest - 1)) <= free <= per_forward
    assert projected_speedup(trace, DraftPrice(0.5, None)) < free  # the proposer's own forwards are paid for
    # the same steps on a curve: each step at its width's cost, the proposer's forwards at their price
    steep = priced(trace, STEEP_COST, DraftPrice(0.25, None))
    widths = [e.num_tokens for e in trace.events if isinstance(e, VerifyEvent)]
    assert steep.steps == len(widths) and steep.verify == pytest.approx(sum(widths) / len(widths))
    assert steep.tokens == len(trace.finish().token_ids) - 1  # all but the prefill's token
    proposing = {e.step for e in trace.events if isinstance(e, DraftEvent)} & {
        e.step for e in trace.events if isinstance(e, VerifyEvent)}
    assert steep.draft == pytest.approx(0.25 * len(proposing) / steep.steps)  # the heads: one forward a step
    assert steep.diluted(0.0) == pytest.approx(steep.speedup) and steep.diluted(1.0) == pytest.approx(1.0)
    assert priced(plain, STEEP_COST, None).speedup == pytest.approx(1.0)


def test_a_perfect_proposer_takes_the_best_width_of_the_curve() -> None:
    assert perfect(STEEP_COST) == (1, 1.0)  # every token as dear as a forward: no width pays
    assert perfect(lambda width: 1 + 0.5 * (width - 1)) == (64, 64 / 32.5)  # dearer, never dear enough
    assert perfect(lambda width: 1 if width <= 6 else width) == (6, 6.0)  # the widest that costs one forward


def test_the_measured_plan_prices_forwards_as_they_run(target, plain_outputs, proposers) -> None:
    """Under the measured plan, a width whose forwards ran dear stops being verified, whatever the curve taken at
    start says: the engine's decode forwards correct it (`LiveCosts`). Here the curve says a wide forward costs a
    one-token one, and three width-2..64 forwards earlier took a thousand times what the one-token ones do: a copy
    that pays on the curve is never verified, and the output is plain decoding's."""
    prompt = PROMPTS[3]
    generation = GenerationParams(max_new_tokens=NEW_TOKENS)
    free = ForwardCosts((1, 64), (1.0, 1.0))
    on_curve = generate(target, prompt, proposers["prompt-lookup"], None, generation, costs=free)[1]
    assert max(e.num_tokens for e in on_curve.events if isinstance(e, VerifyEvent)) > 1
    live = LiveCosts(free)
    for _ in range(LiveCosts.MEASURED):
        live.record(1, 1e-3)
        for width in (2, 64):
            live.record(width, 1.0)
    output, trace = generate(target, prompt, proposers["prompt-lookup"], None, generation, costs=live)
    assert output.token_ids == plain_outputs[prompt]
    assert {e.num_tokens for e in trace.events if isinstance(e, VerifyEvent)} == {1}
    assert len(live.samples[1]) == LiveCosts.WINDOW  # its plain steps were recorded


def test_payoff_rests_drafting_that_commits_fewer_tokens_a_second() -> None:
    """Drafting is judged by what its steps commit a second against plain steps: where it commits fewer it rests,
    twice as long after each rest that did not pay off; where it pays, the next rest is short again. A run that
    drafts from its first step first rests to time plain steps."""
    payoff = Payoff()
    for _ in range(Payoff.JUDGED):
        payoff.record(True, 2, 1.0)  # 2 tokens a second
    assert [payoff.resting() for _ in range(Payoff.JUDGED + 1)] == [True] * Payoff.JUDGED + [False]
    for _ in range(Payoff.JUDGED):
        payoff.record(False, 1, 0.4)  # plain: 2.5 tokens a second
    payoff.record(True, 2, 1.0)
    assert payoff.rests == 1 and sum(payoff.resting() for _ in range(2 * Payoff.REST)) == Payoff.REST
    for _ in range(Payoff.JUDGED):
        payoff.record(True, 2, 1.0)
    assert payoff.rests == 2 and sum(payoff.resting() for _ in range(4 * Payoff.REST)) == 2 * Payoff.REST
    for _ in range(Payoff.JUDGED):
        payoff.record(True, 3, 1.0)  # now 3 a second: it pays, and a later rest starts short
    assert payoff.rests == 2 and not payoff.resting() and payoff.rest == Payoff.REST


def test_a_proposer_that_keeps_declining_is_asked_less_often(target, proposers) -> None:
    """After DECLINED steps in a row that proposed nothing, the proposer is left idle for as many steps (up to
    IDLE), which are no rests; a proposal resets the count. In an engine on live costs under the measured plan, a
    proposer whose forwards are priced out is asked in few of the steps, and the output is plain decoding's."""
    payoff = Payoff()
    for _ in range(Payoff.DECLINED - 1):
        payoff.declined(False)
    assert not payoff.resting()
    payoff.declined(False)
    idle = [payoff.resting() for _ in range(Payoff.DECLINED + 1)]
    assert idle == [True] * Payoff.DECLINED + [False] and payoff.rested == 0 and payoff.rests == 0
    for _ in range(3 * Payoff.IDLE):
        payoff.declined(False)
    assert payoff.idle == Payoff.IDLE
    payoff.idle = 0
    payoff.declined(True)
    assert payoff.declines == 0 and not payoff.resting()

    medusa, generation = proposers["medusa"], GenerationParams(max_new_tokens=NEW_TOKENS)
    asked = []
    live = LiveCosts(ForwardCosts((1, 64), (1.0, 1.0)))
    try:
        with pytest.MonkeyPatch.context() as patch:  # its plan prices its forwards out every step
            patch.setattr(medusa, "propose", lambda requests, rooms, cost: asked.append(1) or {})
            output, trace = generate(target, PROMPTS[1], medusa, None, generation, costs=live)
    finally:
        KEPT.pop(medusa, None)  # the next test's engines judge it afresh
    steps = sum(isinstance(e, VerifyEvent) for e in trace.events)
    assert output.token_ids == generate(target, PROMPTS[1], None, None, generation)[0].token_ids
    assert Payoff.DECLINED <= len(asked) < steps // 2


class Slow(Proposer):
    """Proposes a chain of three tokens the target never keeps, sure of them, and takes 30 ms doing it: a proposer
    no price sees (it runs no forward the engine times)."""

    label = "slow"

    def propose(self, requests, rooms, cost):
        time.sleep(0.03)
        return {r.id: Proposal.chain([0, 0, 0][: room], self.label, 0.99) for r, room in zip(requests, rooms) if room}


def paused_note(trace) -> str:
    """The run's drafting note in lower case: whether the run drafted in a few steps before it paused ("... Drafting
    was paused in N steps") or in none ("nothing drafted: drafting was paused in N of M steps") depends on timing."""
    note = drafting_note(trace, STEEP_COST)
    assert note is not None
    return note.lower()


def test_the_measured_plan_stops_drafting_that_does_not_pay(target) -> None:
    """On this machine's live costs, a proposer whose steps commit fewer tokens a second than plain steps rests: most
    of the run's steps are plain, the output is plain decoding's, and the run's note says drafting rested. Under the
    as-set plan it drafts every step. The judgement is the proposer's: a new engine with it goes on resting where the
    last one left off, and its note says so."""
    prompt, new = PROMPTS[0], 64
    generation = GenerationParams(max_new_tokens=new)
    live = LiveCosts(ForwardCosts((1, 64), (1.0, 1.0)))
    slow = Slow()
    engine = Engine(target, EngineParams(max_running=1), proposer=slow, costs=live)
    engine.add_request(prompt, None, generation)
    outputs = engine.run_all()
    assert outputs[0].token_ids == generate(target, prompt, None, None, generation)[0].token_ids
    assert engine.planner.payoff.rests >= 1 and engine.counts["slow"].steps < new // 2
    rest_left = kept(slow).left
    assert rest_left > 0  # the run ended in a rest
    output, trace = generate(target, prompt, slow, None, generation, costs=live)
    assert output.token_ids == outputs[0].token_ids
    steps = [e for e in trace.events if isinstance(e, VerifyEvent)]
    resting = min(rest_left, len(steps))
    assert trace.params["rested_steps"] >= resting and all(e.num_tokens == 1 for e in steps[:resting])
    assert "drafting was paused in" in paused_note(trace)
    engine = Engine(target, EngineParams(max_running=1, plan="as-set"), proposer=Slow(), costs=live)
    engine.add_request(prompt, None, generation)
    engine.run_all()
    assert engine.planner.payoff is None and engine.counts["slow"].steps >= new - 3
    trace = generate(target, prompt, Slow(), None, generation, costs=live)[1]
    assert trace.params["rests"] >= 1 and "drafting was paused in" in paused_note(trace)
    assert Trace.from_json(trace.to_json()).params["rests"] == trace.params["rests"]


def test_guessers_carry_what_they_learned_only_on_live_measured_costs(target, proposers) -> None:
    """On this machine's live costs under the measured plan, a guesser's calibration (how often its guesses were
    kept) carries into the next engine; on a curve given, or as set, each engine starts from the prior."""
    medusa, generation = proposers["medusa"], GenerationParams(max_new_tokens=NEW_TOKENS)
    live = LiveCosts(ForwardCosts((1, 64), (1.0, 1.0)))
    generate(target, PROMPTS[1], medusa, None, generation, costs=live)
    learned = medusa.calibration
    judged = sum(learned.judged)
    assert judged > 0
    generate(target, PROMPTS[2], medusa, None, generation, costs=live)
    assert medusa.calibration is learned and sum(learned.judged) >= judged
    generate(target, PROMPTS[2], medusa, None, replace(generation, plan="as-set"), costs=live)
    assert medusa.calibration is not learned
    learned = medusa.calibration
    generate(target, PROMPTS[2], medusa, None, generation, costs=STEEP)
    assert medusa.calibration is not learned


@pytest.mark.parametrize("algo", ["speculative", "prompt-lookup", "eagle"])
def test_the_cli_predicts_what_the_theory_tab_predicts_for_the_same_run(target, proposers, algo) -> None:
    """One a (accepted / judged), one g, one formula: the CLI's summary line and the Theory tab set from the same
    run give the same tokens per forward; a run that drafted trees gets no chain prediction from the CLI."""
    import re

    from playground.ui import theory
    from playground.ui.decode import history_entry

    generation = GenerationParams(max_new_tokens=NEW_TOKENS, plan="as-set")
    _, trace = generate(target, PROMPTS[6], proposers[algo], generation=generation)
    line = summary_line(algo, compute(trace), trace, "length")
    a, g, _ = theory.from_run([history_entry(trace, compute(trace))])
    judged = re.search(r"acceptance rate a = (\d\.\d\d) \(", line)
    assert judged is not None and float(judged.group(1)) == a["value"], line
    said = re.search(r"against (\d+\.\d\d) predicted by \(1 - a\^\(g\+1\)\) / \(1 - a\) at g = (\d+)", line)
    if algo == "eagle":  # EAGLE drafts trees
        assert said is None and "it drafted trees: the formula for one chain does not apply" in line, line
        return
    assert said is not None and int(said.group(2)) == g["value"], line
    _, summary = theory.update(a["value"], g["value"], 0.0, 0.0, None)
    assert f"**{said.group(1)} tokens per target forward**" in summary, (line, summary)


def test_the_planner_reads_each_step_after_it_and_keeps_only_what_it_documents(target, proposers) -> None:
    """The planner starts from a documented state and learns from the steps' records alone: on live costs under the
    measured plan a decode forward corrects the costs at its width and the step is judged (the judgement kept per
    proposer, for its next engine); as set, or on a curve given, nothing is judged, the proposer's acceptance goes
    back to its prior and its own forwards are priced at their estimate, whatever it measured."""
    medusa = proposers["medusa"]
    KEPT.pop(medusa, None)  # what earlier tests' engines judged of it
    live = LiveCosts(ForwardCosts((1, 64), (1.0, 1.0)))
    planner = Planner(live, False, medusa)
    assert planner.payoff is kept(medusa) and planner.asks() and planner.rests() == (0, 0)
    for _ in range(LiveCosts.MEASURED):
        planner.observe(StepRecord(True, True, True, 3, 1, forward_s=2.0, step_s=2.5, committed=2))
    assert live.time(3) == pytest.approx(2.0) and len(kept(medusa).drafting) == LiveCosts.MEASURED
    planner.observe(StepRecord(True, True, False, 40, 1, forward_s=9.0, step_s=9.0, committed=1))  # a prefill in it
    assert live.time(3) == pytest.approx(2.0) and len(kept(medusa).drafting) == LiveCosts.MEASURED
    assert Planner(live, False, medusa).payoff is kept(medusa)  # the next engine's planner: the same judgement
    medusa.own.firsts.clear()
    medusa.own.firsts.extend([50.0] * 3)  # a busy host made its forwards look dear
    cost = Planner(live, False, medusa).cost(1, math.inf)
    assert cost.measured and cost.price(medusa.own).first == 50.0
    KEPT.pop(medusa)
    for costs, as_set in ((live, True), (ForwardCosts((1, 64), (1.0, 1.0)), False)):
        calibration = medusa.calibration
        planner = Planner(costs, as_set, medusa)
        assert planner.payoff is None and planner.rests() is None and medusa.calibration is not calibration
        assert medusa not in KEPT and planner.asks()
        cost = planner.cost(1, 8)
        assert cost(9) == math.inf and cost.price(medusa.own) == (DraftPrice(0.0, 0.0) if as_set else
                                                                   medusa.own.estimated())
    medusa.own.firsts.clear()
