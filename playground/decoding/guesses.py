"""Proposers whose candidates are ranked guesses per depth (Medusa heads, a draft model) and the tree built from them.

A `Guesser` gives, for each request, its top guesses at each of the next D places with their log-probabilities,
(D, k) lists; `guess_tree` turns them into the dynamic tree of the most likely nodes (`tree.best_first`, ranked by
calibrated probability), with a copy of earlier text grafted on where there is one (`grafted.Grafted` pairs a
guesser with prompt lookup's copies): the copy's nodes run through the guesser's where they hold the same tokens
and on as a chain of their own, each worth at least the request's running acceptance of copies.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar, NamedTuple, cast

import torch

from ..sampling import Lossless
from .copies import Lookup
from .planning import OwnCost, RunningAcceptance, guess_depth, widest_paying
from .proposer import Cost, Drafted, Note, Outcome, Proposal, Proposer, RequestView
from .tree import COPY_PRIOR, best_first

if TYPE_CHECKING:
    from ..models import LoadedModel


class Guesses(NamedTuple):
    """A request's guesses: log-probabilities and tokens, (D, k) each, best first; for a chain sampled from the
    guesser's distributions (k = 1), those distributions q (D, V), judged by the lossless rule."""

    logp: list[list[float]]
    tokens: list[list[int]]
    q: torch.Tensor | None = None


class GuessCalibration:
    """How often a guesser's guesses are right against what their probabilities say, per depth, and how often a node
    with guesses below it has one of them kept, per depth (`expected_tokens`). A guess is judged when the token it
    follows was kept; at each depth, the probabilities of the judged guesses are summed against how many were kept,
    and a guess's rate is p x (kept + 1) / (probabilities + 1) (no data: p itself), at most 1: small heads' top
    guesses run overconfident, and uncalibrated they look worth a wider forward where they are not."""

    def __init__(self, depth: int) -> None:
        self.kept = [0.0] * depth
        self.predicted = [0.0] * depth
        self.judged = [0] * depth

    def scale(self, depth: int) -> float:
        return (self.kept[depth] + 1.0) / (self.predicted[depth] + 1.0)

    def log_rates(self, logp: list[list[float]]) -> list[list[float]]:
        """Calibrated log-rates for the (D, k) log-probabilities."""
        return [[min(0.0, lp + math.log(self.scale(d))) for lp in row] for d, row in enumerate(logp)]

    def bound(self, depth: int) -> list[float]:
        """The most tokens a step could commit with guesses k = 0..depth deep: 1 + the chance of reaching each
        depth, were every guess as sure as a calibrated guess gets (probability 1)."""
        gains, reach = [1.0], 1.0
        for d in range(depth):
            reach *= min(1.0, self.scale(d))
            gains.append(gains[-1] + reach)
        return gains

    def expected_tokens(self, depth: int) -> list[float]:
        """The tokens a step is expected to commit with guesses k = 0..depth deep: 1 + the chance of reaching each
        depth, from how often a reached node had one of its guesses kept at each (with `RunningAcceptance`'s
        optimistic prior, so that guessing is tried first)."""
        accepted, judged = RunningAcceptance.PRIOR_ACCEPTED, RunningAcceptance.PRIOR_JUDGED
        gains, reach = [1.0], 1.0
        for d in range(depth):
            reach *= (self.kept[d] + accepted) / (self.judged[d] + judged)
            gains.append(gains[-1] + reach)
        return gains

    def record(self, proposal: Proposal, path: list[int], label: str) -> None:
        """A verified tree and the rows of the tokens kept. Only the guesser's own nodes (source `label`) count,
        even where another proposer's node holds a guessed token: a copied token is likelier than its guess says."""
        reached, kept = {0, *path}, set(path)
        judged = set()  # (depth, parent) of every reached node with guesses below it
        for i, (parent, p, depth) in enumerate(zip(proposal.parents, proposal.probs, proposal.depths()[1:])):
            if parent in reached and proposal.sources[i] == label and p is not None:
                self.predicted[depth - 1] += p
                self.kept[depth - 1] += float(i + 1 in kept)
                judged.add((depth, parent))
        for depth, _ in judged:
            self.judged[depth - 1] += 1


class _Node(NamedTuple):
    """A node while a tree is built: log of its chance of being reached, the key of the node it follows, its token,
    the guesser's probability of it (None for the copy's own) and its source label."""

    worth: float
    parent: object
    token: int
    prob: float | None
    source: str


def guess_tree(rated: list[list[float]], logp: list[list[float]], tokens: list[list[int]], nodes: int,
               eos_ids: frozenset[int], label: str, chained: bool, copy: Lookup | None = None,
               copy_rate: float = COPY_PRIOR, copy_label: str = "",
               shape: tuple[tuple[int, ...], ...] | None = None) -> Proposal:
    """The dynamic tree of at most `nodes` tokens from (D, k) guesses ranked by their calibrated log-rates `rated`
    (`logp`: the guesser's own), with a copy grafted on (`best_first`; a copied token worth at least `copy_rate`),
    or, with `shape`, a fixed tree of paths of ranks (those the guesses reach), a copy running through it and on
    as nodes of its own. `chained`: the guesses are a draft's, only its top path has guesses below it. No token
    follows an end-of-sequence token: nothing after one can be committed. Rows come best first, by the chance of
    reaching them."""
    copied = copy.tokens if copy else []
    prior = math.log(copy_rate) if copy else 0.0
    if shape is None:
        paths, chain = best_first(rated, tokens, copied, nodes, copy_rate, chained=chained)
    else:
        paths = tuple(p for p in shape if len(p) <= len(tokens) and all(r < len(tokens[d]) for d, r in enumerate(p)))
        chain = len(copied)
    # The copy runs through the guessed nodes whose token it is, then on as `chain` nodes of its own.
    chosen, walk = set(paths), cast(tuple[int, ...], ())
    for depth, token in enumerate(copied[: len(tokens)]):
        if token not in tokens[depth] or walk + (tokens[depth].index(token),) not in chosen:
            break
        walk += (tokens[depth].index(token),)
    on_copy = {walk[:i] for i in range(1, len(walk) + 1)}
    # keyed by a guess path, or ("copy", j) for the copy's own j-th node; the root is ()
    tree: dict[object, _Node] = {(): _Node(0.0, None, -1, None, "")}

    def add(key: object, parent: object, lp: float, token: int, prob: float | None, source: str) -> bool:
        if parent not in tree or tree[parent].token in eos_ids:
            return False  # below a dropped node or an end of sequence
        tree[key] = _Node(tree[parent].worth + lp, parent, token, prob, source)
        return True
    for path in paths:
        depth, rank = len(path) - 1, path[-1]
        lp = max(rated[depth][rank], prior) if path in on_copy else rated[depth][rank]
        add(path, path[:-1], lp, tokens[depth][rank], math.exp(logp[depth][rank]),
            copy_label if path in on_copy else label)
    parent: object = walk
    for j, token in enumerate(copied[len(walk) : len(walk) + chain]):
        if not add(("copy", j), parent, prior, token, None, copy_label):
            break
        parent = ("copy", j)
    # Best first again, now with the copy's own nodes: a worth never grows down a path and the sort is stable,
    # so parents stay before their children.
    order = sorted((key for key in tree if key != ()), key=lambda key: -tree[key].worth)
    rows = {(): 0, **{key: i + 1 for i, key in enumerate(order)}}
    chosen_nodes = [tree[key] for key in order]
    return Proposal([n.token for n in chosen_nodes], [rows[n.parent] for n in chosen_nodes],
                    [n.source for n in chosen_nodes], [math.exp(n.worth) for n in chosen_nodes],
                    [n.prob for n in chosen_nodes])


class Guesser(Proposer):
    """A proposer of ranked guesses per depth, `depth` deep, at most `nodes` per tree."""

    chained: ClassVar[bool] = False  # a draft's guesses: each depth's drawn after the top guess of the one before

    def __init__(self, eos_ids: frozenset[int], depth: int, nodes: int,
                 shape: tuple[tuple[int, ...], ...] | None = None) -> None:
        """shape: a fixed tree of paths of ranks (None: the dynamic tree)."""
        self.eos_ids, self.depth, self.nodes, self.shape = eos_ids, depth, nodes, shape
        self.calibration = GuessCalibration(depth)

    def forget(self) -> None:
        self.calibration = GuessCalibration(self.depth)

    def ready(self, request: RequestView) -> bool:
        """Whether it can guess for this request now."""
        return True

    @abstractmethod
    def guesses(self, requests: Sequence[RequestView], rooms: list[int], longest: int,
                cost: Cost) -> dict[int, Guesses]:
        """At most `longest` places of guesses for some of the requests (rooms[i]: request i's room)."""

    def bound(self, request: RequestView, room: int) -> list[float]:
        """The most tokens a step could commit with k = 0..nodes guessed nodes, before guessing."""
        if not self.ready(request):
            return [1.0]
        sure = self.calibration.bound(self.depth)
        return [sure[min(k, room, self.depth)] for k in range(self.nodes + 1)]

    def tree(self, guesses: Guesses, room: int, nodes: int, copy: Lookup | None = None, copy_rate: float = COPY_PRIOR,
             copy_label: str = "") -> Proposal:
        """The tree of the guesses (a sampled chain stays a chain: no copy is grafted onto it)."""
        logp, tokens = guesses.logp[:room], guesses.tokens[:room]
        if guesses.q is not None:
            copy = None
        tree = guess_tree(self.calibration.log_rates(logp), logp, tokens, nodes, self.eos_ids, self.label,
                          self.chained, copy, copy_rate, copy_label, self.shape)
        return tree if guesses.q is None else replace(tree, rule=Lossless(guesses.q[: len(tree.tokens)]))

    def propose(self, requests: Sequence[RequestView], rooms: list[int], cost: Cost) -> dict[int, Proposal]:
        longest = widest_paying([self.bound(r, room) for r, room in zip(requests, rooms)], cost) - 1
        if not longest:
            return {}
        guesses = self.guesses(requests, rooms, longest, cost)
        return {r.id: self.tree(guesses[r.id], room, longest) for r, room in zip(requests, rooms)
                if r.id in guesses and room > 0}

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        if proposal is not None:
            self.calibration.record(proposal, outcome.path, self.label)


class ChainDrafter(Guesser):
    """A guesser that drafts a chain with forwards of its own, one per place (a draft model, the target's drafting
    layers): each step as deep as the chain's acceptance so far says pays for those forwards, priced as measured
    (`own`), besides the wider verification."""

    chained = True
    own: OwnCost
    target: LoadedModel
    unpriced_s = 0.0  # seconds of the last `chains` that are no drafting forward's (a long catch-up, paid once)
    first_done = last_done = 0.0  # when the last `chains` had drafted its first place, and its last (`perf_counter`)

    @abstractmethod
    def chains(self, requests: Sequence[RequestView], depth: int) -> dict[int, Guesses]:
        """Each request's chain of `depth` places of guesses (those it drafts for)."""

    def note(self, forwards: int) -> Note:
        """What the trace says of a chain drafted by `forwards` forwards."""
        return Drafted(forwards)

    def guesses(self, requests: Sequence[RequestView], rooms: list[int], longest: int,
                cost: Cost) -> dict[int, Guesses]:
        price = cost.price(self.own)
        depth = min(longest, guess_depth(self.calibration.expected_tokens(self.depth), rooms, cost, price))
        start = time.perf_counter()
        chains = self.chains([r for r, room in zip(requests, rooms) if room > 0], depth)
        if chains:
            # on a CPU each forward has run when its call returns, so the further depths are timed apart
            further = self.last_done - self.first_done if self.target.model.device.type == "cpu" else None
            self.own.record(time.perf_counter() - start - self.unpriced_s, depth, cost.one_s, further)
        return chains

    def tree(self, guesses: Guesses, room: int, nodes: int, copy: Lookup | None = None, copy_rate: float = COPY_PRIOR,
             copy_label: str = "") -> Proposal:
        proposal = super().tree(guesses, room, nodes, copy, copy_rate, copy_label)
        return replace(proposal, note=self.note(len(guesses.logp)))  # one forward per place drafted


def read_places(places: list[tuple[torch.Tensor, torch.Tensor]], drawn: dict[tuple[int, int], tuple[float, int]]
                ) -> tuple[list[list[list[float]]], list[list[list[int]]]]:
    """A chain's places, (log-probabilities, ids) (B, k) per place, back on the host in one transfer (float64 holds
    both exactly): (D, B, k) lists, with the draws of `drawn` ((place, request index) -> (log q, token)) in place of
    their ranked guesses."""
    widths = [ids.shape[1] for _, ids in places]
    both = torch.stack([torch.cat([v.double() for v, _ in places], dim=1),
                        torch.cat([ids.double() for _, ids in places], dim=1)]).tolist()  # (2, B, sum of k)
    values, tokens = both[0], [[int(t) for t in row] for row in both[1]]
    logp: list[list[list[float]]] = []
    chains: list[list[list[int]]] = []
    at = 0
    for d, k in enumerate(widths):
        logp.append([row[at : at + k] for row in values])
        chains.append([row[at : at + k] for row in tokens])
        at += k
    for (d, i), (log_q, x) in drawn.items():
        logp[d][i], chains[d][i] = [log_q], [x]
    return logp, chains
