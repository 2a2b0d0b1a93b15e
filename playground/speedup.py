"""Speedups that can be trusted: plain decoding and every contender run interleaved, round after round; each
speedup is the median of its per-round ratios, says where a step's time went, and carries a flag whenever the
measurement cannot explain itself (a busy machine, a slowed baseline). The Race, the Decode tab's headline, the
bench and the notebooks all measure through here."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from .decoding.costs import BUSY_CORES
from .metrics import compute
from .trace import CommitEvent, Trace

T = TypeVar("T")  # what an entrant's run returns: a trace, or a peer's run

ROUNDS = 3
SPREAD_LIMIT = 0.20  # a speed varying more than this across rounds was measured on a busy machine
EXPLAIN_LIMIT = 0.25  # how far a speedup may stray from what its steps and prefill explain before it is flagged
CHEAPEST_STEP = 0.85  # a step verifies at least one token, so it cannot cost much less than a plain step


def order(names: list[str], rounds: int = ROUNDS) -> Iterator[tuple[int, str]]:
    """(round, name): every entrant once per round, the order rotated each round so none always runs first or after
    the same one."""
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            yield round_, name


def measure(runs: Mapping[str, Callable[[], T]], rounds: int = ROUNDS) -> dict[str, list[T]]:
    """Run the entrants in `order`: each entrant's runs (traces) in round order."""
    traces: dict[str, list[T]] = {name: [] for name in runs}
    for _, name in order(list(runs), rounds):
        traces[name].append(runs[name]())
    return traces


@dataclass(frozen=True, slots=True)
class StepCost:
    """The mean engine time of a decode step (prefill excluded), split as the trace splits it."""

    draft_s: float
    verify_s: float
    other_s: float

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.other_s

    @classmethod
    def of(cls, trace: Trace) -> StepCost:
        steps = [e for e in trace.events if isinstance(e, CommitEvent) and e.step > 0]
        n = max(len(steps), 1)
        return cls(sum(e.draft_s for e in steps) / n, sum(e.verify_s for e in steps) / n,
                   sum(e.overhead_s for e in steps) / n)


def prefill_share(trace: Trace) -> float:
    """The share of a run's engine time its prefill took (step 0: the prompt's forward and the first token)."""
    first = next((e for e in trace.events if isinstance(e, CommitEvent) and e.step == 0), None)
    wall = compute(trace).wall_s
    return first.t / wall if first is not None and wall > 0 else 0.0


def spread(values: list[float]) -> float:
    """(max - min) / median: 0 for a single value."""
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else 0.0


def median_run(traces: list[Trace]) -> Trace:
    """The round whose speed is the median: the one to replay."""
    ordered = sorted(traces, key=lambda trace: compute(trace).tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


@dataclass(frozen=True, slots=True)
class Speedup:
    """One entrant against plain decoding. ratios: its tokens/s over plain decoding's in the same round, per round in
    round order (speedup: their median); tokens_per_step: tokens each decode step kept;
    step_cost: its mean step time in plain decoding steps (draft, verify, other); kept: accepted / drafted tokens
    (None: it drafts nothing); prefill: the share of plain decoding's time its prefill took, paid alike by every
    entrant, which pulls every speedup towards 1. explained: the speedup those imply,
    1 / (prefill + (1 - prefill) * step_cost / tokens_per_step)."""

    name: str
    rounds: int
    tokens_per_s: float
    ratios: tuple[float, ...]
    spread: float
    tokens_per_step: float
    draft: float
    verify: float
    other: float
    kept: float | None
    prefill: float
    flags: tuple[str, ...]

    @property
    def speedup(self) -> float:
        return statistics.median(self.ratios)

    @property
    def step_cost(self) -> float:
        return self.draft + self.verify + self.other

    @property
    def explained(self) -> float:
        return 1 / (self.prefill + (1 - self.prefill) * self.step_cost / self.tokens_per_step)

    def why(self) -> str:
        """Where the time went, in one line: what a step keeps against what it costs."""
        parts = [f"a step keeps {self.tokens_per_step:.2f} tokens and costs {self.step_cost:.2f} plain steps "
                 f"(draft {self.draft:.2f}, verify {self.verify:.2f}, other {self.other:.2f})"]
        if self.kept is not None:
            over = f" (over its {self.rounds} rounds)" if self.rounds > 1 else ""
            parts.append(f"{self.kept:.0%} of drafted tokens kept{over}")
        if self.prefill >= 0.1:
            parts.append(f"the prompt's prefill, {self.prefill:.0%} of plain decoding's time, costs both alike")
        return "; ".join(parts)

    def headline(self) -> str:
        """'1.42x plain decoding (median of 3 rounds)', with its flags when there are any."""
        text = f"{self.speedup:.2f}x plain decoding (median of {self.rounds} round{'s' * (self.rounds > 1)})"
        return text + (" — CHECK: " + "; ".join(self.flags) if self.flags else "")


def median_interval(ratios: list[tuple[float, ...]], level: float = 0.9, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """How far the median over prompts of each prompt's median per-round ratio (the bench's summary speedup) moves
    with the noise of the prompts drawn and the rounds run: the central `level` of its values over `resamples`
    bootstrap draws, each drawing the prompts with replacement and, within each, its rounds with replacement."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(statistics.median(rng.choices(rounds, k=len(rounds)))
                                       for rounds in rng.choices(ratios, k=len(ratios)))
                     for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1))]


def winner(speedups: dict[str, Speedup]) -> str:
    """One line naming the fastest entrant by measured tokens/s (plain decoding's row included), its margin over
    the next, and whether that margin is above the rounds' spread (the larger of the two entrants'), so a race
    decided by noise says so."""
    ranked = sorted(speedups.values(), key=lambda s: s.tokens_per_s, reverse=True)
    best = ranked[0]
    if len(ranked) < 2 or ranked[1].tokens_per_s <= 0:
        return f"Fastest: {best.name}"
    runner_up = ranked[1]
    margin = best.tokens_per_s / runner_up.tokens_per_s
    noise = max(best.spread, runner_up.spread)
    verdict = (f"above the rounds' spread ({noise:.0%})" if margin - 1 > noise else
               f"within the rounds' spread ({noise:.0%}): a tie on this machine")
    return f"Fastest: {best.name}, {margin:.2f}x the next ({runner_up.name}), {verdict}"


def shown_round(traces: dict[str, list[Trace]], plain: str, name: str) -> tuple[Trace, Speedup]:
    """The run of `name` a view replays (its median round) and its Speedup against plain decoding's run of that same
    round: what a screen showing that run says beside it, so that none of its figures mixes rounds."""
    runs = traces[name]
    shown = median_run(runs)
    i = next(k for k, run in enumerate(runs) if run is shown)
    return shown, compare({name: [shown], plain: [traces[plain][i]]}, plain)[name]


def compare(traces: dict[str, list[Trace]], plain: str, others: float | None = None) -> dict[str, Speedup]:
    """Every entrant's Speedup against `plain`'s traces from the same rounds (plain's own row included); `others`:
    the processors other processes kept busy meanwhile, where known (`LoadMeter`), which a flag quotes."""
    base = traces[plain]
    base_speeds = [compute(trace).tokens_per_s for trace in base]
    base_step = statistics.median(StepCost.of(trace).total_s for trace in base)
    prefill = statistics.median(prefill_share(trace) for trace in base)
    out = {}
    for name, runs in traces.items():
        metrics = [compute(trace) for trace in runs]
        speeds = [m.tokens_per_s for m in metrics]
        costs = [StepCost.of(trace) for trace in runs]
        ratios = tuple(s / b for s, b in zip(speeds, base_speeds) if b)
        per_step = statistics.median(1.0 if m.mean_accepted_tokens is None else m.mean_accepted_tokens
                                     for m in metrics)
        unit = base_step or 1.0
        draft, verify, other = (statistics.median(getattr(c, field) for c in costs) / unit
                                for field in ("draft_s", "verify_s", "other_s"))
        drafted, accepted = sum(x.drafted or 0 for x in metrics), sum(x.accepted or 0 for x in metrics)
        flags = []
        why = ("" if others is None else
               f" (other processes kept {others:.1f} processors busy meanwhile)")
        if len(base) > 1 and spread(base_speeds) > SPREAD_LIMIT:
            flags.append(f"plain decoding's speed varied {spread(base_speeds):.0%} across rounds "
                         f"(limit {SPREAD_LIMIT:.0%}): the machine was busy{why}, rerun")
        elif name == plain and others is not None and others > BUSY_CORES:
            flags.append(f"other processes kept {others:.1f} processors busy while it ran: rerun on a quiet machine")
        if name != plain and len(runs) > 1 and spread(speeds) > SPREAD_LIMIT:
            flags.append(f"its speed varied {spread(speeds):.0%} across rounds (limit {SPREAD_LIMIT:.0%})")
        cost = draft + verify + other
        judged = base_step > 0 and all(c.total_s > 0 for c in costs)  # a run of one token has no step to judge
        if judged and cost < CHEAPEST_STEP:
            flags.append(f"its steps cost {cost:.2f} of plain decoding's though each verifies at least one token: "
                         f"the baseline was slowed, rerun")
        result = Speedup(name=name, rounds=len(runs), tokens_per_s=statistics.median(speeds), ratios=ratios,
                         spread=spread(speeds), tokens_per_step=per_step, draft=draft, verify=verify, other=other,
                         kept=accepted / drafted if drafted else None, prefill=prefill, flags=())
        if judged and cost >= CHEAPEST_STEP and abs(result.speedup / result.explained - 1) > EXPLAIN_LIMIT:
            flags.append(f"{result.speedup:.2f}x is not what {per_step:.2f} tokens per step at {cost:.2f} plain steps "
                         f"each (prefill {prefill:.0%} of the time) explains: {result.explained:.2f}x")
        out[name] = replace(result, flags=tuple(flags))
    return out
