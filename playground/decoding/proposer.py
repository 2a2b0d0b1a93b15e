"""The proposer interface: what an accelerated algorithm is to the engine.

Every step the engine asks its proposer for each decoding request's candidates (`propose`), verifies them all in
one forward, draws what plain decoding draws along them and tells the proposer what was kept (`observe`). A
proposer keeps its per-request state itself, keyed by request id, from `start` to `end`; `pause` says a request's
KV was dropped (preempted: it will be recomputed), so anything tied to it (a draft's cache, a hidden state) goes.

Candidates are a token tree (`Proposal`): node i follows the node in row parents[i] (row 0: the request's last
token, row i + 1: node i), each parent before its children, so that any leading part is a tree too and the engine
can cut a proposal to the width it pays for. Each node carries the chance it is reached (`reach`, from the
proposer's running acceptance or calibrated probabilities): the expected tokens a step commits with the first k
nodes are 1 + their sum, which is what the engine's width planning reads.
"""

from __future__ import annotations

import copy
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..sampling import PLAIN_DRAWS, Rule
from .planning import DraftPrice, OwnCost, Payoff

if TYPE_CHECKING:
    from ..kv import KVCache


@dataclass(frozen=True, slots=True)
class SideRows:
    """Rows run beside a proposal in the same forward and never verified, whose logits go back to the proposer
    (lookahead's Jacobi window). offsets: each row's position after the last token; mask (S, S): who sees whom
    among them (each also sees the last token, and nothing of the proposal); read: the last `read` rows' logits
    are handed back."""

    tokens: list[int]
    offsets: list[int]
    mask: torch.Tensor
    read: int


class Note(ABC):
    """What a proposer tells the trace about a proposal beyond its tokens: further fields of its draft event
    (`events.DraftEvent`). The engine passes it on unread."""

    @abstractmethod
    def fields(self) -> dict[str, Any]:
        """The draft event's fields this note fills."""

    def first(self, n: int) -> Note:
        """The note of the proposal's first n nodes (`Proposal.first`)."""
        return self


@dataclass(frozen=True, slots=True)
class Drafted(Note):
    """A proposal drafted by `forwards` forwards of a model of the proposer's own (a draft model, a head)."""

    forwards: int

    def fields(self) -> dict[str, Any]:
        return {"draft_forwards": self.forwards}


@dataclass(frozen=True, slots=True)
class Proposal:
    """Tokens to verify after a request's last token, as a tree in best-first order. sources[i]: the label of the
    proposer whose node i is (the trace and the engine's counts read it); reach[i]: the chance node i is kept;
    probs[i]: the proposer's own probability of token i (None where it has none, as a copy's). rule: how the tokens
    are judged where a request samples (`sampling.Rule`: plain decoding's draws for one-hot proposals, the lossless
    rule for a chain sampled from distributions q, Medusa's typical acceptance). side: rows run beside it and never
    verified (lookahead's window). note: what the proposer tells the trace about it (the draft event's further
    fields), opaque to the engine."""

    tokens: list[int]
    parents: list[int]
    sources: list[str]
    reach: list[float]
    probs: list[float | None] = field(default_factory=list)
    side: SideRows | None = None
    rule: Rule = PLAIN_DRAWS
    note: Note | None = None

    @classmethod
    def chain(cls, tokens: list[int], source: str, rate: float) -> Proposal:
        """A chain whose every token is kept with probability `rate` once the one before it was."""
        return cls(tokens, list(range(len(tokens))), [source] * len(tokens),
                   [rate ** (i + 1) for i in range(len(tokens))], [None] * len(tokens))

    def first(self, n: int) -> Proposal:
        return replace(self, tokens=self.tokens[:n], parents=self.parents[:n], sources=self.sources[:n],
                       reach=self.reach[:n], probs=self.probs[:n], rule=self.rule.first(n),
                       note=self.note.first(n) if self.note is not None else None)

    def trace_fields(self) -> dict[str, Any]:
        """The draft event's fields its note fills (without one: no forwards of the proposer's own)."""
        return {"draft_forwards": 0, **(self.note.fields() if self.note is not None else {})}

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
        """The tokens a step is expected to commit with the first k nodes verified, k = 0..n: 1 + their reach."""
        return list(itertools.accumulate(self.reach, initial=1.0))


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
    trace shows them), whether the request finished, the final hidden states (R, E) of its verified rows (with the
    proposer's tapped layers' inputs after them) and the argmax of each of its side rows read."""

    new: list[int]
    walk: list[int]
    probs: list[float]
    done: bool
    hidden: torch.Tensor
    side: list[int] | None

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
    nothing, so every plan verifies all its settings ask for; `one_s` still times the proposer's forwards."""

    relative: Callable[[int], float]
    one_s: float
    as_set: bool = False

    def __call__(self, width: int) -> float:
        return self.relative(width)

    def price(self, own: OwnCost) -> DraftPrice:
        """What a proposer's own drafting costs a step by depth, in one-token target forwards: `own`'s price, or
        nothing as set."""
        return FREE if self.as_set else own()


class Proposer(ABC):
    """Candidates for every decoding request of a step, and what to learn from what the verifier kept."""

    label: str  # its proposals' source label (the trace's and the engine's counts)
    # target layers whose inputs it reads beside the final hidden states: each row of the hidden states it is given
    # (`prefilled`, `Outcome.hidden`) is then ((1 + len(taps)) E) wide, the final state first (`Transformer.forward`)
    taps: tuple[int, ...] = ()
    own: OwnCost | None = None  # the price of its own drafting forwards, where it runs any
    _payoff: Payoff | None = None

    @property
    def payoff(self) -> Payoff:
        """Whether its drafting pays, judged from the steps as they run (`planning.Payoff`), by engines on this
        machine's live costs under the measured plan. Kept from one engine to the next, as what it learned of its
        acceptance and its own price is: a new run (the app's, the bench's next prompt) rests where the last ones
        found that drafting did not pay, rather than paying to find it out again."""
        if self._payoff is None:
            self._payoff = Payoff()
        return self._payoff

    def bind(self, settings: Any, cache: KVCache) -> None:
        """A new engine (its `EngineParams` and its target's KV cache) takes this proposer: per-engine resources are
        made afresh and every request's state is dropped."""

    @contextmanager
    def warming_up(self) -> Iterator[None]:
        """Runs inside warm the machine up (first calls allocate buffers and read weights never read before), so
        their timings teach nothing: its own forwards' price (`own`) and drafting's payoff come out as they went
        in. What it learns of acceptance stays, as from any run."""
        payoff = copy.deepcopy(self._payoff)
        try:
            with self.own.unrecorded() if self.own is not None else nullcontext():
                yield
        finally:
            self._payoff = payoff

    def forget(self) -> None:
        """What it learned of its proposals' acceptance goes back to its prior, so that a generation does not depend
        on those before it. A new engine calls it after `bind`, except where it plans on this machine's live costs
        under the measured plan: there what was learned prices the first steps of the next run too (and the plan
        depends on the host's timing anyway)."""

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

    def trace_events(self, request: RequestView, step: int, t: float) -> list[Any]:
        """Trace events of its own for the request's step `step` (engine time t), recorded before its draft: what
        a viewer needs to see how the proposal was made (none by default)."""
        return []

    def own_cost(self) -> DraftPrice | None:
        """What its own drafting (a draft model's or a head's forwards) costs a step by depth in one-token target
        forwards, as its plans price it now (`OwnCost.value`); None: it runs no forwards of its own."""
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
