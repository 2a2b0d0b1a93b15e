"""Measured metrics, computed from a trace alone (so replayed traces give the same numbers)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .config import MAX_GAMMA
from .trace import (
    PLAIN,
    AcceptEvent,
    BonusEvent,
    CommitEvent,
    CorrectEvent,
    DraftEvent,
    Event,
    KVAllocEvent,
    KVFreeEvent,
    MemoryEvent,
    PrefillEvent,
    RejectEvent,
    Trace,
    VerifyEvent,
)


@dataclass(frozen=True, slots=True)
class Metrics:
    """tokens_per_s: generated tokens / engine wall time, prefill included, model loading excluded.
    ttft_s: engine time until the first generated token was known.
    mean_accepted_tokens: tokens committed per verifying target forward, bonus/corrected token included;
    drafted, accepted, rejected: tokens proposed, how many proposals the target accepted, and how many it
    rejected (a speculative step's sibling, another guess beside a drafted token, is not another drafted token);
    kept_of_drafted: accepted / drafted (proposals after a rejection count as drafted, never judged);
    acceptance_rate: accepted / (accepted + rejected), the probability that a proposal the target judged was
    accepted: the a of the theory formula (1 - a^(g+1)) / (1 - a).
    These six are None for algorithms that propose nothing."""

    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_s: float | None
    target_forwards: int
    mean_accepted_tokens: float | None
    drafted: int | None
    accepted: int | None
    rejected: int | None
    kept_of_drafted: float | None
    acceptance_rate: float | None
    kv_bytes: int | None

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def compute(trace: Trace) -> Metrics:
    finish = trace.finished()
    tokens = len(finish.token_ids)
    first_token = next((e.t for e in trace.events if isinstance(e, (AcceptEvent, CorrectEvent, BonusEvent))), None)
    prefills = sum(1 for e in trace.events if isinstance(e, PrefillEvent))
    verify_forwards = sum(e.target_forwards for e in trace.events if isinstance(e, VerifyEvent))
    drafted = sum(drafted_count(e) for e in trace.events if isinstance(e, DraftEvent))
    accepted = sum(1 for e in trace.events if isinstance(e, AcceptEvent))
    rejected = sum(1 for e in trace.events if isinstance(e, RejectEvent))
    kv_bytes = next((e.kv_bytes if isinstance(e, CommitEvent) else e.bytes_used for e in reversed(trace.events)
                     if isinstance(e, (CommitEvent, KVAllocEvent, KVFreeEvent))), None)
    proposes = trace.algo != PLAIN
    # The first token of a run comes from the prefill forward; every later one from a verifying forward.
    mean_accepted = (tokens - 1) / verify_forwards if proposes and verify_forwards else None
    return Metrics(
        tokens=tokens,
        wall_s=finish.wall_s,
        tokens_per_s=tokens / finish.wall_s if finish.wall_s > 0 else 0.0,
        ttft_s=first_token,
        target_forwards=prefills + verify_forwards,
        mean_accepted_tokens=mean_accepted,
        drafted=drafted if proposes else None,
        accepted=accepted if proposes else None,
        rejected=rejected if proposes else None,
        kept_of_drafted=accepted / drafted if drafted else None,
        acceptance_rate=accepted / (accepted + rejected) if accepted + rejected else None,
        kv_bytes=kv_bytes,
    )


def expected_tokens_per_step(acceptance: float, gamma: float) -> float:
    """Expected tokens per target forward, bonus included, when each of gamma drafts is accepted independently
    with probability a (Leviathan et al. 2023): (1 - a^(gamma+1)) / (1 - a)."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if acceptance == 1:
        return gamma + 1
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def branched(draft: DraftEvent) -> bool:
    """Whether a draft is a tree beyond one chain with runners-up beside its first token (which `is_sibling` tells):
    a drafted token with two followers, or two first tokens that both have followers. Parents are node numbers (0:
    the last committed token, i: tokens[i - 1]; None: the token before), in the draft's best-first order, so a
    runner-up may sit between a chain's tokens."""
    parents = [i if t.parent is None else t.parent for i, t in enumerate(draft.tokens)]
    followed = Counter(parents)
    firsts = [i + 1 for i, p in enumerate(parents) if p == 0]
    return any(n > 1 for node, n in followed.items() if node > 0) or sum(followed[f] > 0 for f in firsts) > 1


@dataclass(frozen=True, slots=True)
class ChainPrediction:
    """What the chain formula predicts for a run, with the figures it takes, as the CLI, the bench and the Theory
    tab all show it: a, the share of judged drafted tokens the target accepted (to two decimals, as shown); g, the
    mean number of tokens a drafting step drafted (rounded to a whole number, as the formula's g is); tokens, the
    tokens per target forward, bonus included, (1 - a^(g+1)) / (1 - a) at those two."""

    a: float
    g: int
    tokens: float


def chain_prediction(trace: Trace) -> ChainPrediction | None:
    """The chain formula's prediction for a run (`ChainPrediction`); None where the target judged no drafted token,
    or where a step proposed a tree, which the formula for one chain does not describe."""
    metrics, drafts = compute(trace), [e for e in trace.events if isinstance(e, DraftEvent) and e.tokens]
    if metrics.acceptance_rate is None or not drafts or any(branched(e) for e in drafts):
        return None
    a = round(metrics.acceptance_rate, 2)
    g = min(max(round(mean_draft_length(trace) or 1), 1), MAX_GAMMA)
    return ChainPrediction(a, g, expected_tokens_per_step(a, g))


def drafted_count(event: DraftEvent) -> int:
    """How many tokens a step drafted: its tokens less the siblings beside them (`DraftEvent.is_sibling`), so a
    speculative step counts its chain. A Medusa step's judged nodes (no parents given) each count, nodes of one depth
    judged in turn included."""
    return sum(not event.is_sibling(i) for i in range(len(event.tokens)))


def mean_draft_length(trace: Trace) -> float | None:
    drafts = [drafted_count(e) for e in trace.events if isinstance(e, DraftEvent) and e.tokens]
    return sum(drafts) / len(drafts) if drafts else None


def kept_by_step(trace: Trace) -> dict[int, int]:
    """Proposed tokens the verifier kept, by step (steps that kept none are absent)."""
    kept: dict[int, int] = {}
    for event in trace.events:
        if isinstance(event, AcceptEvent):
            kept[event.step] = kept.get(event.step, 0) + 1
    return kept


def depth_profile(trace: Trace) -> dict[str, float | list[float]]:
    """How large and deep the verified proposals were and how much of them was kept, over the steps that proposed:
    the share of those steps that kept at least d drafted tokens (d = 1 .. the deepest proposal), the mean nodes
    verified (an oracle knowing the text would commit 1 + that many as a chain), and the tokens per such forward
    an oracle would commit with the same trees (their deepest path always right: 1 + its depth). Empty when nothing
    was proposed."""
    deepest: dict[int, int] = {}
    nodes: list[int] = []
    for event in trace.events:
        if isinstance(event, DraftEvent) and event.tokens:
            depths = [0]  # node 0: the last committed token; node i: tokens[i - 1]
            for i, token in enumerate(event.tokens):
                depths.append(depths[i if token.parent is None else token.parent] + 1)
            deepest[event.step] = max(depths)
            nodes.append(len(event.tokens))
    kept = kept_by_step(trace)
    if not deepest:
        return {}
    return {"kept_at_least": [sum(kept.get(s, 0) >= d for s in deepest) / len(deepest)
                              for d in range(1, max(deepest.values()) + 1)],
            "mean_nodes_verified": statistics.mean(nodes),
            "oracle_tokens_per_forward": 1 + statistics.mean(deepest.values())}


def memory_summary(events: list[Event]) -> dict[str, float]:
    """KV memory of a served workload from the engine's memory events (steps holding any KV)."""
    memory = [e for e in events if isinstance(e, MemoryEvent) and e.bytes_used]
    if not memory:
        raise ValueError("events: no step held any KV memory")
    used = sum(e.bytes_used for e in memory)
    logical = sum(e.logical_bytes for e in memory)
    return {
        "mean_running": statistics.mean(len(e.running) for e in memory),
        "peak_kv_bytes": max(e.bytes_reserved for e in memory),
        "peak_contiguous_bytes": max(e.contiguous_bytes for e in memory),
        # Summed over steps: time-weighted by step, not by second.
        "kv_waste_fraction": sum(e.bytes_reserved - e.bytes_used for e in memory) / used,
        "contiguous_waste_fraction": sum(e.contiguous_bytes - e.logical_bytes for e in memory) / logical,
    }


def chain_acceptance(agrees: list[bool], gamma: int) -> tuple[int, int, int]:
    """(accepted, drafted, judged) of greedy speculative steps of `gamma` drafts over a text where `agrees[i]` says
    whether the draft's greedy token at position i equals the text's: each step drafts gamma tokens (fewer at the
    end), keeps the agreeing run, is judged up to the first disagreement and moves past the run and one token."""
    accepted = drafted = judged = 0
    i = 0
    while i < len(agrees):
        chain = agrees[i : i + gamma]
        run = next((k for k, agree in enumerate(chain) if not agree), len(chain))
        accepted, drafted, judged = accepted + run, drafted + len(chain), judged + min(run + 1, len(chain))
        i += run + 1
    return accepted, drafted, judged


@dataclass(frozen=True, slots=True)
class Drafting:
    """How much of a run drafted: decode steps (verifying forwards after the prefill), those that verified proposed
    tokens, the median width of their forwards (None when none did) and the tokens such a step committed on
    average, correction or bonus included."""

    steps: int
    drafting_steps: int
    width: int | None
    kept: float | None


def drafting(trace: Trace) -> Drafting:
    widths = {e.step: e.num_tokens for e in trace.events if isinstance(e, VerifyEvent)}
    wide = {step for step, width in widths.items() if width > 1}
    committed: dict[int, int] = {}
    for event in trace.events:
        if isinstance(event, (AcceptEvent, CorrectEvent, BonusEvent)) and event.step in wide:
            committed[event.step] = committed.get(event.step, 0) + 1
    return Drafting(len(widths), len(wide), int(statistics.median(widths[s] for s in wide)) if wide else None,
                    statistics.mean(committed.get(s, 0) for s in wide) if wide else None)


# below this share of decode steps with a proposal verified, a measured run's drafting is "mostly off"
MOSTLY_OFF = 0.5
NOMINAL_WIDTH = 5  # the width a reason quotes where the run verified no proposal: the last token and four proposed


def drafting_note(trace: Trace, relative_cost: Callable[[int], float] | None) -> str | None:
    """One sentence on why a run drafted little, with this machine's figures, for a run of an algorithm that
    proposes: where its measured plan verified proposals in fewer than half its decode steps, what a forward as
    wide as it verified costs here (`relative_cost(width)`, in one-token forwards) against what its drafting steps
    kept; where nothing was drafted, that no acceptance applies. None where the run drafted in most steps."""
    if trace.algo == PLAIN:
        return None
    seen = drafting(trace)
    if seen.steps == 0 or seen.drafting_steps >= MOSTLY_OFF * seen.steps:
        return None
    measured = trace.params.get("plan", "measured") == "measured"
    width = seen.width or NOMINAL_WIDTH
    price = (f"here a forward over {width} tokens costs {relative_cost(width):.1f} one-token forwards, so a step "
             f"must keep {relative_cost(width):.1f} tokens to break even" if relative_cost is not None else "")
    rested_steps = trace.params.get("rested_steps")
    rested_steps = rested_steps if isinstance(rested_steps, int) else 0
    if seen.drafting_steps == 0:
        if not measured:
            return "nothing drafted: the algorithm found no guess in any step, so there is no acceptance rate"
        if rested_steps:
            return (f"nothing drafted: drafting was paused in {rested_steps} of {seen.steps} steps. The drafting "
                    "steps before (an earlier run's too) added fewer tokens a second than plain steps, the "
                    f"proposer's own forwards counted{'; ' + price if price else ''}. So there is no acceptance "
                    "rate. --plan as-set drafts in every step")
        return (f"nothing drafted: under the measured plan no step was expected to save time on this machine"
                f"{' (' + price + ')' if price else ''}. So there is no acceptance rate. --plan as-set drafts in "
                "every step")
    if not measured:
        return (f"drafting in {seen.drafting_steps} of {seen.steps} steps: the algorithm found a proposal only "
                "there")
    kept = f"This run's drafting steps kept {seen.kept:.1f}."
    rested = (f" Drafting was paused in {rested_steps} steps, because drafting steps added fewer tokens a second "
              "than plain steps (the proposer's own forwards counted)." if rested_steps else "")
    here = price[:1].upper() + price[1:] + ". " if price else ""
    return (f"drafting in only {seen.drafting_steps} of {seen.steps} steps. Under the measured plan a step verifies "
            f"guesses only where they should save time on this machine. {here}{kept}{rested} --plan as-set drafts in "
            "every step")


# a forward over a few tokens at about one token's cost (where verifying is nearly free): each further token adds this
FLAT_TOKEN_COST = 0.005
# what a projection on that curve is, in the words every report that shows one uses
FLAT_CURVE = (f"where a forward over a few tokens costs about one (a flat curve: each further token {FLAT_TOKEN_COST} "
              "of a forward)")


@dataclass(frozen=True, slots=True)
class Priced:
    """A run's decode steps priced on a cost curve, in one-token forwards: the tokens they committed, how many there
    were, and per step what its verifying forward costs at the width it verified (`verify`) and what its proposer's
    forwards cost (`draft`). The prefill both a run and plain decoding pay is left out."""

    tokens: int
    steps: int
    verify: float
    draft: float

    @property
    def speedup(self) -> float:
        """Over plain decoding, which commits one token a one-token forward."""
        return self.tokens / (self.steps * (self.verify + self.draft))

    def diluted(self, prefill: float) -> float:
        """The speedup where a share `prefill` of plain decoding's time is a prefill both pay alike, as a measured
        speedup over a whole run is."""
        return 1 / (prefill + (1 - prefill) / self.speedup)


def priced(trace: Trace, relative_cost: Callable[[int], float],
           own_price: Callable[[int], float] | None) -> Priced | None:
    """The run's decode steps (their verified widths, their proposer's forwards) priced where a forward over W
    tokens costs relative_cost(W) one-token forwards and a step's g forwards of the proposer's own own_price(g) of
    one (a `planning.DraftPrice`; None: nothing; at least one forward a step that proposed, as the Medusa heads run
    once a step). None for a run with no decode step."""
    widths = {e.step: e.num_tokens for e in trace.events if isinstance(e, VerifyEvent)}
    forwards = {e.step: max(e.draft_forwards, 1) for e in trace.events if isinstance(e, DraftEvent) and e.tokens}
    committed = sum(e.num_tokens for e in trace.events if isinstance(e, CommitEvent) and e.step in widths)
    if not widths or not committed:
        return None
    return Priced(committed, len(widths), statistics.mean(relative_cost(w) for w in widths.values()),
                  sum(own_price(forwards.get(s, 0)) for s in widths) / len(widths) if own_price is not None else 0.0)


def flat_cost(width: int) -> float:
    """A forward over a few tokens at about one token's cost: where verifying is nearly free (a GPU)."""
    return 1 + FLAT_TOKEN_COST * (width - 1)


def projected_speedup(trace: Trace, own_price: Callable[[int], float] | None) -> float | None:
    """A projection, not a measurement: the run's decode steps `priced` on a flat curve (`flat_cost`) with its
    proposer's forwards at `own_price` (its price as measured here), against plain decoding's one forward per
    token. None for a run with no decode step."""
    steps = priced(trace, flat_cost, own_price)
    return None if steps is None else steps.speedup


def perfect(relative_cost: Callable[[int], float], widest: int = 64) -> tuple[int, float]:
    """The best a proposer could do on a curve: every token it proposes kept, at the width W (up to `widest`) where
    W tokens a forward over its cost, W / relative_cost(W), is highest; (W, that speedup)."""
    return max(((w, w / relative_cost(w)) for w in range(1, widest + 1)), key=lambda best: best[1])
