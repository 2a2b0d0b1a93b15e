"""Honest speedups: interleaved rounds, medians of per-round ratios, where a step's time goes, and the flags raised
when a measurement cannot explain itself; then the same on the real engine."""

from __future__ import annotations

import pytest

from playground.config import GenerationParams
from playground.decoding import registry
from playground.decoding.prompt_lookup import PromptLookupParams
from playground.engine import generate
from playground.speedup import compare, measure, median_interval, median_run, order, shown_round, spread
from playground.trace import CommitEvent, FinishEvent, Trace, VerifyEvent


def fake(algo: str, tokens: int, steps: int, step_s: float, draft_s: float = 0.0) -> Trace:
    """A run of `steps` decode steps after a prefill, each costing step_s (draft_s of it drafting), that ends with
    `tokens` tokens; its wall time is the prefill (one plain step) plus its steps."""
    prefill = 0.01
    events: list = [CommitEvent(step=0, t=prefill, num_tokens=1, draft_s=0.0, verify_s=prefill, overhead_s=0.0,
                                kv_bytes=0)]
    per_step = (tokens - 1) / steps if steps else 0
    for step in range(1, steps + 1):
        t = prefill + step * step_s
        events += [VerifyEvent(step=step, t=t, num_tokens=2, wall_s=step_s - draft_s, target_forwards=1),
                   CommitEvent(step=step, t=t, num_tokens=round(per_step), draft_s=draft_s,
                               verify_s=step_s - draft_s - 0.001, overhead_s=0.001, kv_bytes=0)]
    wall = prefill + steps * step_s
    events.append(FinishEvent(step=steps, t=wall, reason="length", token_ids=list(range(tokens)), text="",
                              wall_s=wall))
    return Trace(algo=algo, model="m", prompt="p", prompt_ids=[1], params={}, events=events)


def test_interleave_rotates_the_order_every_round():
    assert list(order(list("abc"), rounds=3)) == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                                                   (2, "c"), (2, "a"), (2, "b")]


def test_a_consistent_speedup_is_explained_and_unflagged():
    traces = {"ar": [fake("ar", 41, 40, 0.010) for _ in range(3)],
              "spec": [fake("speculative", 41, 20, 0.013, draft_s=0.003) for _ in range(3)]}
    result = compare(traces, "ar")
    spec = result["spec"]
    assert spec.speedup == pytest.approx(0.41 / 0.27, rel=1e-6) and spec.tokens_per_step == 2.0
    assert spec.explained == pytest.approx(spec.speedup, rel=1e-6)  # the prefill (1/41 of plain's time) included
    assert spec.step_cost == pytest.approx(1.3) and spec.draft == pytest.approx(0.3) and not spec.flags
    assert "costs 1.30 plain steps (draft 0.30" in spec.why() and spec.headline().startswith("1.52x plain decoding")
    assert result["ar"].speedup == 1.0 and not result["ar"].flags


def test_a_speedup_its_tokens_per_step_cannot_explain_is_flagged():
    """The notebook-06 failure: plain decoding slowed by something else makes a 1.4-tokens-per-step algorithm
    read 3.8x. Its steps then cost a fraction of plain decoding's, which no verifying step can."""
    slowed = [fake("ar", 41, 40, 0.040) for _ in range(3)]
    traces = {"ar": slowed, "la": [fake("lookahead", 41, 29, 0.011) for _ in range(3)]}
    flags = compare(traces, "ar")["la"].flags
    assert any("the baseline was slowed" in flag for flag in flags)
    assert "CHECK:" in compare(traces, "ar")["la"].headline()


def test_a_busy_baseline_is_flagged_by_its_spread():
    traces = {"ar": [fake("ar", 41, 40, s) for s in (0.010, 0.0135, 0.010)],
              "spec": [fake("speculative", 41, 20, 0.013) for _ in range(3)]}
    assert spread([1.0, 1.35, 1.0]) == pytest.approx(0.35)
    assert any("plain decoding's speed varied" in f for f in compare(traces, "ar")["spec"].flags)
    # where the bench measured the other processes' load meanwhile, the flag says it
    assert any("the machine was busy (other processes kept 1.3 processors busy meanwhile)" in f
               for f in compare(traces, "ar", others=1.3)["spec"].flags)
    steady = {"ar": [fake("ar", 41, 40, 0.010) for _ in range(3)]}
    assert compare(steady, "ar", others=0.1)["ar"].flags == ()
    assert compare(steady, "ar", others=0.9)["ar"].flags == (
        "other processes kept 0.9 processors busy while it ran: rerun on a quiet machine",)


def test_the_summary_median_comes_with_its_noise():
    """The bootstrap interval of the median over prompts holds it, widens with the rounds' spread, is reproducible
    (a fixed seed), and is one point where every round of every prompt agrees."""
    centres = [1.0 + 0.01 * i for i in range(-7, 7)]  # 14 prompts, 0.93x to 1.06x: their median 0.995x
    steady = [(c, c + 0.01, c - 0.01) for c in centres]
    noisy = [(c - 0.1, c, c + 0.1) for c in centres]
    low, high = median_interval(steady)
    assert low <= 0.995 <= high and median_interval(steady) == (low, high)
    noisy_low, noisy_high = median_interval(noisy)
    assert noisy_high - noisy_low > high - low
    assert median_interval([(0.97,) * 3] * 5) == (0.97, 0.97)


def test_the_median_round_is_replayed():
    runs = [fake("ar", 41, 40, s) for s in (0.012, 0.010, 0.011)]
    assert median_run(runs) is runs[2]


def test_the_round_shown_is_judged_against_plain_decodings_run_of_that_round():
    """What a screen says beside the run it replays comes from that run's round alone, never a median over rounds:
    its speedup against plain decoding's run of the same round."""
    plain = [fake("ar", 41, 40, s) for s in (0.010, 0.020, 0.010)]
    spec = [fake("speculative", 41, 20, s) for s in (0.012, 0.013, 0.030)]
    shown, alone = shown_round({"ar": plain, "spec": spec}, "ar", "spec")
    assert shown is spec[1]  # the median round
    assert alone.rounds == 1 and alone.speedup == pytest.approx(0.81 / 0.27)  # that round: plain 0.81 s, it 0.27 s
    assert compare({"ar": plain, "spec": spec}, "ar")["spec"].speedup == pytest.approx(0.41 / 0.25)  # the median


def test_on_the_engine_every_round_is_measured_and_explained_or_flagged(target):
    """Timings depend on the machine, so this checks the bookkeeping, not a speed: three interleaved rounds each,
    tokens per step from the traces, the step split adding up, and a speedup that is either explained by them or
    flagged."""
    prompt = "Repeat exactly: one two three four five six, one two three four five six."
    generation = GenerationParams(max_new_tokens=24)
    proposer = registry.build_proposer(target, "prompt-lookup", PromptLookupParams())
    runs = {"ar": lambda: generate(target, prompt, None, None, generation, "ar")[1],
            "prompt-lookup": lambda: generate(target, prompt, proposer, None, generation, "prompt-lookup")[1]}
    traces = measure(runs)
    assert [len(t) for t in traces.values()] == [3, 3]
    result = compare(traces, "ar")["prompt-lookup"]
    assert result.tokens_per_step > 1.5 and result.kept is not None and 0 < result.prefill < 1
    assert min(result.draft, result.verify, result.other) >= 0 and result.step_cost > 0
    assert result.flags or result.speedup == pytest.approx(result.explained, rel=0.25)


def test_a_public_app_caps_each_visitors_tokens_an_hour(monkeypatch):
    from types import SimpleNamespace

    from playground.config import ConfigError
    from playground.ui import quota

    clock = [1000.0]
    monkeypatch.setattr(quota.time, "monotonic", lambda: clock[0])
    cap = quota.Quota(limit=100)
    alice = SimpleNamespace(headers={"x-forwarded-for": "1.2.3.4, 10.0.0.1"}, client=None)
    bob = SimpleNamespace(headers={}, client=SimpleNamespace(host="5.6.7.8"))
    cap.take(alice, 60)
    with pytest.raises(ConfigError, match=r"^max_new_tokens: .* at most 100 tokens .* needs 50 and 40 are left"):
        cap.take(alice, 50)
    cap.take(bob, 100)  # another visitor has a budget of their own
    clock[0] += quota.WINDOW_S + 1
    cap.take(alice, 100)  # an hour later the first run no longer counts
    quota.Quota(limit=None).take(alice, 10**9)  # a local app has no cap


def test_a_run_without_decode_steps_is_not_judged_by_its_steps():
    traces = {"ar": [fake("ar", 1, 0, 0.01)] * 3, "spec": [fake("speculative", 1, 0, 0.01)] * 3}
    assert compare(traces, "ar")["spec"].flags == ()
