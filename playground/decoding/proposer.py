"""The proposer interface: what an accelerated algorithm is to the engine.

Every step the engine asks its proposer for each decoding request's candidates (`propose`), verifies them all in
one forward, draws what plain decoding draws along them and tells the proposer what was kept (`observe`). A
proposer keeps its per-request state itself, keyed by request id, from `start` to `end`; `pause` says a request's
KV was dropped (preempted: it will be recomputed), so anything tied to it (a draft's cache, a hidden state) goes.

Candidates are a token tree (`Proposal`): node i follows the node in row parents[i] (row 0: the request's last
token, row i + 1: node i), each parent before its children, so that any leading part is a tree too and the engine
can cut a proposal to the width it pays for. Each node carries the chance it is reached (`reach`, from the
proposer's running acceptance or calibrated probabilities): the expected tokens a step commits with the first k
nodes are 1 + their sum, which is what the engine's width planning reads. A proposal may end with probes: nodes run
in the same forward for the target's greedy token after them alone, never kept (lookahead's Jacobi window).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..notes import NoteKind
from ..sampling import PLAIN_DRAWS, Rule
from .planning import DraftPrice, OwnCost

if TYPE_CHECKING:
    from ..kv import KVCache


class Note(ABC):
    """What a proposer tells the trace about a proposal beyond its tokens: the forwards of a model of its own it took
    and its note (`notes.NoteKind`), the draft event's `draft_forwards` and `note`. The engine passes it on unread."""

    def drafted(self) -> int:
        """Forwards of a model of the proposer's own (a draft model, a head) the proposal took."""
        return 0

    @abstractmethod
    def shown(self) -> NoteKind | None:
        """The draft event's note (None: none)."""

    def first(self, n: int) -> Note:
        """The note of the proposal's first n nodes (`Proposal.first`)."""
        return self


@dataclass(frozen=True, slots=True)
class Drafted(Note):
    """A proposal drafted by `forwards` forwards of a model of the proposer's own (a draft model, a head)."""

    forwards: int

    def drafted(self) -> int:
        return self.forwards

    def shown(self) -> NoteKind | None:
        return None


@dataclass(frozen=True, slots=True)
class Proposal:
    """Tokens to verify after a request's last token, as a tree in best-first order. sources[i]: the label of the
    proposer whose node i is (the trace and the engine's counts read it); reach[i]: the chance node i is kept;
    probs[i]: the proposer's own probability of token i (None where it has none, as a copy's). rule: how the tokens
    are judged where a request samples (`sampling.Rule`: plain decoding's draws for one-hot proposals, the lossless
    rule for a chain sampled from distributions q, Medusa's typical acceptance). probes: the last `probes` nodes are
    run for the target's greedy token after each (`Outcome.probed`) and nothing else: never kept, never counted as
    proposed, their parents the last token or other probes (lookahead's Jacobi window). note: what the proposer tells
    the trace about it (the draft event's further fields), opaque to the engine."""

    tokens: list[int]
    parents: list[int]
    sources: list[str]
    reach: list[float]
    probs: list[float | None] = field(default_factory=list)
    probes: int = 0
    rule: Rule = PLAIN_DRAWS
    note: Note | None = None

    @classmethod
    def chain(cls, tokens: list[int], source: str, rate: float) -> Proposal:
        """A chain whose every token is kept with probability `rate` once the one before it was."""
        return cls(tokens, list(range(len(tokens))), [source] * len(tokens),
                   [rate ** (i + 1) for i in range(len(tokens))], [None] * len(tokens))

    @property
    def candidates(self) -> int:
        """Its nodes that may be kept: all but the probes."""
        return len(self.tokens) - self.probes

    def first(self, n: int) -> Proposal:
        """Its first n candidates (the probes kept whole, their rows renumbered)."""
        note = self.note.first(n) if self.note is not None else None
        if not self.probes:
            return replace(self, tokens=self.tokens[:n], parents=self.parents[:n], sources=self.sources[:n],
                           reach=self.reach[:n], probs=self.probs[:n], rule=self.rule.first(n), note=note)
        k = self.candidates
        n = min(n, k)
        keep = [*range(n), *range(k, len(self.tokens))]
        parents = self.parents[:n] + [p - (k - n) if p > k else p for p in self.parents[k:]]
        return replace(self, tokens=[self.tokens[i] for i in keep], parents=parents,
                       sources=[self.sources[i] for i in keep], reach=[self.reach[i] for i in keep],
                       probs=[self.probs[i] for i in keep], rule=self.rule.first(n), note=note)

    def verified(self) -> Proposal:
        """The candidates alone: what the walk may keep, the trace shows and the engine counts."""
        if not self.probes:
            return self
        k = self.candidates
        return replace(self, tokens=self.tokens[:k], parents=self.parents[:k], sources=self.sources[:k],
                       reach=self.reach[:k], probs=self.probs[:k], probes=0)

    def trace_fields(self) -> dict[str, Any]:
        """The draft event's fields its note fills (without one: no forwards of the proposer's own, no note)."""
        shown = self.note.shown() if self.note is not None else None
        return {"draft_forwards": self.note.drafted() if self.note is not None else 0,
                "note": shown.to_json() if shown is not None else None}

    def children(self) -> list[list[int]]:
        """Each row's children rows, best first."""
        children: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, parent in enumerate(self.parents):
            children[parent].append(i + 1)
        return children

    def is_chain(self) -> bool:
        return self.parents == list(range(len(self.tokens)))

    def depths(self) -> list[int]:
        """Each row's depth below the last token (row 0): its position's offset."""
        depths = [0]
        for parent in self.parents:
            depths.append(depths[parent] + 1)
        return depths

    def expected(self) -> list[float]:
        """The tokens a step is expected to commit with its first k candidates verified, k = 0..n: 1 + their
        reach."""
        return list(itertools.accumulate(self.reach[: self.candidates], initial=1.0))


class RequestView(Protocol):
    """What a proposer reads of a request (the engine's `Request`)."""

    id: int
    prompt_ids: list[int]
    sampling: Any  # SamplingParams
    generator: torch.Generator  # its own random stream
    num_computed: int  # leading tokens whose KV is in the cache

    @property
    def tokens(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the verifier kept of one request's step: the tokens drawn (`new`, the last a correction or bonus), the
    rows they were drawn from (`walk`: row 0, then the kept nodes' rows) and their probabilities (`probs`, as the
    trace shows them), whether the request finished, the final hidden states (R, E) of its rows (with the proposer's
    tapped layers' inputs after them) and the target's greedy token after each of its probes (`Proposal.probes`)."""

    new: list[int]
    walk: list[int]
    probs: list[float]
    done: bool
    hidden: torch.Tensor
    probed: list[int] = field(default_factory=list)

    @property
    def path(self) -> list[int]:
        """The rows of the proposed tokens kept."""
        return self.walk[1:]


FREE = DraftPrice(0.0, 0.0)  # drafting priced as nothing: the "as-set" plan


@dataclass(frozen=True, slots=True)
class Cost:
    """What the step's decode forward costs by width, relative to the same batch's one-token forward (cost(1) = 1),
    and that one-token forward's seconds on this machine (`one_s`), against which a proposer prices its own work.
    Under the "as-set" plan (`as_set`) every width a forward can take costs one and a proposer's own forwards
    nothing, so every plan verifies all its settings ask for; `one_s` still times the proposer's forwards. measured:
    a proposer's own forwards are priced as they were measured (on this machine's live costs), else at their
    estimates (on a curve given, which plans alike whatever the host does)."""

    relative: Callable[[int], float]
    one_s: float
    as_set: bool = False
    measured: bool = True

    def __call__(self, width: int) -> float:
        return self.relative(width)

    def price(self, own: OwnCost) -> DraftPrice:
        """What a proposer's own drafting costs a step by depth, in one-token target forwards: `own`'s price (as
        measured, or its estimate), or nothing as set."""
        return FREE if self.as_set else own() if self.measured else own.estimated()


class Proposer(ABC):
    """Candidates for every decoding request of a step, and what to learn from what the verifier kept."""

    label: str  # its proposals' source label (the trace's and the engine's counts)
    # target layers whose inputs it reads beside the final hidden states: each row of the hidden states it is given
    # (`prefilled`, `Outcome.hidden`) is then ((1 + len(taps)) E) wide, the final state first (`Transformer.forward`)
    taps: tuple[int, ...] = ()
    own: OwnCost | None = None  # the price of its own drafting forwards, where it runs any

    def bind(self, settings: Any, cache: KVCache) -> None:
        """A new engine (its `EngineParams` and its target's KV cache) takes this proposer: per-engine resources are
        made afresh and every request's state is dropped."""

    @contextmanager
    def warming_up(self) -> Iterator[None]:
        """Runs inside warm the machine up (first calls allocate buffers and read weights never read before), so
        their timings teach nothing: its own forwards' price (`own`) comes out as it went in. What it learns of
        acceptance stays, as from any run."""
        with self.own.unrecorded() if self.own is not None else nullcontext():
            yield

    def forget(self) -> None:
        """What it learned of its proposals' acceptance goes back to its prior, so that a generation does not depend
        on those before it. A new engine's planner calls it, except where it plans on this machine's live costs
        under the measured plan: there what was learned prices the first steps of the next run too (and the plan
        depends on the host's timing anyway; `engine.planner`)."""

    def start(self, request: RequestView) -> None:
        """A request was added."""

    def pause(self, request: RequestView) -> None:
        """The request's KV was dropped: preempted (it is recomputed before it decodes again), or released at its
        end. Called again by `end`: it must be safe to repeat."""

    def end(self, request: RequestView) -> None:
        """The request finished, failed or was aborted."""
        self.pause(request)

    def prefilled(self, request: RequestView, hidden: torch.Tensor) -> None:
        """A prefill chunk ran: the target's final hidden states (n, E) of its tokens (and its tapped layers'
        inputs), the last at position `request.num_computed - 1` (EAGLE's head reads them)."""

    @abstractmethod
    def propose(self, requests: Sequence[RequestView], rooms: list[int], cost: Cost) -> dict[int, Proposal]:
        """Candidates for the decoding requests (request id -> proposal; none for a request left plain). rooms[i]:
        how deep request i's proposal may go; cost: what a forward of a width costs, for deciding how much
        proposing pays."""

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        """What the verifier kept of the request's step (proposal None: it ran plain, or this was its prefill)."""

    def own_cost(self) -> DraftPrice | None:
        """What its own drafting (a draft model's or a head's forwards) costs a step by depth in one-token target
        forwards, as measured so far (`OwnCost.value`: what its plans price it at on this machine's live costs; on a
        curve given they price its estimate, `Cost.price`); None: it runs no forwards of its own."""
        return None if self.own is None else self.own.value()

    def own_estimate(self, relative: Callable[[int], float]) -> float | None:
        """What a further depth's forward should cost by the weights it reads (`OwnCost.estimate`: its bytes over
        the target's, where the native kernel runs the products, at the rows it runs on the curve `relative`);
        None: it runs no forwards of its own."""
        return None if self.own is None else self.own.estimate(relative)

    def describe(self) -> dict[str, Any]:
        """The settings a trace header or a server's state shows."""
        return {"proposer": self.label}

    def loaded(self) -> dict[str, Any]:
        """The weights it loaded, as the keywords that give another proposer of its algorithm the same ones
        (`registry.build_proposer`) rather than a second load (none by default)."""
        return {}


def merge_chains(chains: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[int]]:
    """Chains of candidate tokens merged into one tree where they start alike: (tokens, parents, source), node i
    following row parents[i] (0: the last token, row i + 1: node i) and first proposed by chains[source[i]]; each
    chain's nodes in order, so every parent comes before its children and any leading part is a tree."""
    tokens: list[int] = []
    parents: list[int] = []
    source: list[int] = []
    rows: dict[tuple[int, ...], int] = {(): 0}
    for c, chain in enumerate(map(tuple, chains)):
        for depth in range(1, len(chain) + 1):
            if chain[:depth] not in rows:
                tokens.append(chain[depth - 1])
                parents.append(rows[chain[: depth - 1]])
                source.append(c)
                rows[chain[:depth]] = len(tokens)
    return tokens, parents, source


def candidates(chains: Sequence[Sequence[int]], rates: Sequence[float], label: str) -> tuple[Proposal, list[int]]:
    """Candidate chains, best first, as one proposal (`merge_chains`), and for each node the chain that first
    proposed it. A node of chain c at depth d is reached with about a_c^d (rates[c] = a_c: how often that kind of
    candidate is accepted), one of a later chain only where the first was refused."""
    tokens, parents, source = merge_chains(chains)
    depths = Proposal(tokens, parents, [], []).depths()[1:]
    reach = [rates[c] ** d * (1.0 if c == 0 else 1.0 - rates[0]) for c, d in zip(source, depths)]
    return Proposal(tokens, parents, [label] * len(tokens), reach, [None] * len(tokens)), source
