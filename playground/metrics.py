"""Measured metrics, computed from a trace alone (so replayed traces give the same numbers)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from .trace import (AcceptEvent, BonusEvent, CommitEvent, CorrectEvent, DraftEvent, Event, KVAllocEvent, KVFreeEvent,
                    MemoryEvent, PrefillEvent, RejectEvent, Trace, TraceError, VerifyEvent)

PLAIN_ALGOS = ("ar",)  # algorithms that propose nothing: acceptance metrics do not apply


@dataclass(frozen=True, slots=True)
class Metrics:
    """tokens_per_s: generated tokens / engine wall time, prefill included, model loading excluded.
    ttft_s: engine time until the first generated token was known.
    mean_accepted_tokens: tokens committed per verifying target forward, bonus/corrected token included;
    drafted, accepted, rejected: tokens proposed, how many proposals the target accepted, and how many it
    rejected (a speculative step's sibling, another guess beside a drafted token, is not another drafted token);
    acceptance_rate: accepted / drafted (proposals after a rejection count as drafted, never judged);
    token_acceptance: accepted / (accepted + rejected), the probability that a proposal the target judged was
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
    acceptance_rate: float | None
    token_acceptance: float | None
    kv_bytes: int | None

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def compute(trace: Trace) -> Metrics:
    finish = trace.finish()
    if finish is None:
        raise TraceError("events: the trace has no finish event (the run did not complete)")
    tokens = len(finish.token_ids)
    first_token = next((e.t for e in trace.events if isinstance(e, (AcceptEvent, CorrectEvent, BonusEvent))), None)
    prefills = sum(1 for e in trace.events if isinstance(e, PrefillEvent))
    verify_forwards = sum(e.target_forwards for e in trace.events if isinstance(e, VerifyEvent))
    drafted = sum(drafted_count(e) for e in trace.events if isinstance(e, DraftEvent))
    accepted = sum(1 for e in trace.events if isinstance(e, AcceptEvent))
    rejected = sum(1 for e in trace.events if isinstance(e, RejectEvent))
    kv_bytes = next((e.kv_bytes if isinstance(e, CommitEvent) else e.bytes_used for e in reversed(trace.events)
                     if isinstance(e, (CommitEvent, KVAllocEvent, KVFreeEvent))), None)
    proposes = trace.algo not in PLAIN_ALGOS
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
        acceptance_rate=accepted / drafted if drafted else None,
        token_acceptance=accepted / (accepted + rejected) if accepted + rejected else None,
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


def drafted_count(event: DraftEvent) -> int:
    """How many tokens a step drafted: its tokens less the siblings beside them (`DraftEvent.is_sibling`), so a
    speculative step counts its chain. A Medusa step's judged nodes (no parents given) each count, nodes of one depth
    judged in turn included."""
    return sum(not event.is_sibling(i) for i in range(len(event.tokens)))


def mean_draft_length(trace: Trace) -> float | None:
    drafts = [drafted_count(e) for e in trace.events if isinstance(e, DraftEvent)]
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
