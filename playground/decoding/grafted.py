"""A copy of earlier text grafted onto another proposer's trees: prompt lookup's copies (`CopyProposer`) paired with
the heads', the draft's or EAGLE's guesses, since what a text repeats is what guessers predict worst.

`Grafted(guesser, copies)` builds a guesser's tree with the copy in it (`guess_tree`: the copy's tokens compete for
the node budget as guesses do). `GraftedTree(proposer, copies)` takes a proposer's finished trees (EAGLE's, grown
on the device) and grafts the copy on afterwards (`graft`). Either way the copy runs through the tree's nodes that
hold its tokens and on as a chain of its own nodes, each worth at least the request's running acceptance of copies;
a request the proposer has nothing for gets its copy alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..kv import KVCache
from .copies import Copied, Lookup
from .guesses import Guesser
from .planning import at, plan_width, widest_paying
from .prompt_lookup import CopyProposer
from .proposer import Cost, Outcome, Proposal, Proposer, RequestView
from .tree import COPY_PRIOR


def graft(tree: Proposal, copy: list[int], rate: float, label: str, nodes: int,
          eos_ids: frozenset[int]) -> Proposal:
    """`copy` grafted onto a finished tree: it runs through the tree's nodes holding its tokens (each then kept with
    at least `rate` once its parent is, its source the copy's `label`) and on as a chain of its own nodes, each kept
    with `rate` once the one before is (none below an end of sequence); the `nodes` likeliest of them all, best
    first. A chain its rule keeps a chain (a sampled one, judged by its own distributions) stays as it is."""
    if tree.rule.chain_only:
        return tree
    tokens, parents, sources = list(tree.tokens), list(tree.parents), list(tree.sources)
    probs = list(tree.probs) if tree.probs else [None] * len(tokens)
    # each node's chance of being kept once its parent is
    edge = [r / (tree.reach[p - 1] if p else 1.0) if (not p or tree.reach[p - 1] > 0) else 0.0
            for r, p in zip(tree.reach, parents)]
    children, row, depth = tree.children(), 0, 0
    for token in copy:
        match = next((c for c in children[row] if tokens[c - 1] == token), None)
        if match is None:
            break
        edge[match - 1], sources[match - 1] = max(edge[match - 1], rate), label
        row, depth = match, depth + 1
    for token in copy[depth:]:
        if row and tokens[row - 1] in eos_ids:
            break
        tokens.append(token)
        parents.append(row)
        sources.append(label)
        probs.append(None)
        edge.append(rate)
        row = len(tokens)
    reach: list[float] = []
    for p, e in zip(parents, edge):  # parents come before their children
        reach.append((reach[p - 1] if p else 1.0) * e)
    # best first; a child is never likelier than its parent and the sort is stable, so parents stay first
    order = sorted(range(len(tokens)), key=lambda i: -reach[i])[:nodes]
    rows = {0: 0, **{i + 1: r + 1 for r, i in enumerate(order)}}
    return replace(tree, tokens=[tokens[i] for i in order], parents=[rows[parents[i]] for i in order],
                   sources=[sources[i] for i in order], reach=[reach[i] for i in order],
                   probs=[probs[i] for i in order])


class _WithCopies(Proposer):
    """A proposer and prompt lookup's copies, each told of every request and every step."""

    def __init__(self, inner: Proposer, copies: CopyProposer) -> None:
        self.inner, self.copies = inner, copies
        self.label = f"{inner.label}+{copies.label}"
        self.taps, self.own = inner.taps, inner.own

    def bind(self, settings: Any, cache: KVCache) -> None:
        self.inner.bind(settings, cache)
        self.copies.bind(settings, cache)

    def forget(self) -> None:
        self.inner.forget()
        self.copies.forget()

    def start(self, request: RequestView) -> None:
        self.inner.start(request)
        self.copies.start(request)

    def pause(self, request: RequestView) -> None:
        self.inner.pause(request)
        self.copies.pause(request)

    def end(self, request: RequestView) -> None:
        self.inner.end(request)
        self.copies.end(request)

    def prefilled(self, request: RequestView, hidden: torch.Tensor) -> None:
        self.inner.prefilled(request, hidden)

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        self.inner.observe(request, proposal, outcome)
        self.copies.observe(request, proposal, outcome)

    def describe(self) -> dict[str, Any]:
        copies = {f"copy_{name}": value for name, value in self.copies.describe().items() if name != "proposer"}
        return {**self.inner.describe(), **copies}

    def _copied(self, request: RequestView, tree: Proposal, copy: Lookup | None) -> Proposal:
        """The tree with where its copied nodes come from, noted for `observe`: the copy's first tokens (the node
        budget may cut its tail)."""
        copied = tree.sources.count(self.copies.label)
        if copy and copied:
            tree = replace(tree, note=Copied(copy.start, copy.start + copied, copy.ngram, base=tree.note))
            self.copies.remember(request, tree, [copy.ngram] * len(tree.tokens))
        return tree


class Grafted(_WithCopies):
    """A guesser's trees built with each request's copy in them."""

    inner: Guesser

    def propose(self, requests: Sequence[RequestView], rooms: list[int], cost: Cost) -> dict[int, Proposal]:
        self.copies.decay(requests)
        # Bounds before any work: a copy at each request's best acceptance so far, a tree whose every depth is
        # reached as surely as calibrated guesses can be. The copy search scans each request's whole text: skip it
        # when no copy could pay; guess only as many tokens as could pay.
        copy_bounds = [self.copies.bound(r, room) for r, room in zip(requests, rooms)]
        tree_bounds = [self.inner.bound(r, room) for r, room in zip(requests, rooms)]
        search = plan_width(copy_bounds, cost) > 1
        longest = widest_paying([[max(at(c, k), at(t, k)) for k in range(max(len(c), len(t)))]
                                 for c, t in zip(copy_bounds, tree_bounds)], cost) - 1
        if not longest:
            return {}
        guesses = self.inner.guesses(requests, rooms, longest, cost)
        proposals = {}
        for request, room in zip(requests, rooms):
            found = self.copies.find(request, min(longest, room)) if search else []
            copy = found[0] if found else None
            if request.id in guesses and room > 0:
                rate = self.copies.rate(request, copy) if copy else COPY_PRIOR
                tree = self.inner.tree(guesses[request.id], room, longest, copy, rate, self.copies.label)
            elif copy:
                tree = Proposal.chain(copy.tokens, self.copies.label, self.copies.rate(request, copy))
            else:
                continue
            proposals[request.id] = self._copied(request, tree, copy)
        return proposals


class GraftedTree(_WithCopies):
    """A proposer's finished trees, at most `nodes` wide (EAGLE's), with each request's copy grafted on."""

    def __init__(self, inner: Proposer, copies: CopyProposer, nodes: int) -> None:
        super().__init__(inner, copies)
        self.nodes = nodes

    def propose(self, requests: Sequence[RequestView], rooms: list[int], cost: Cost) -> dict[int, Proposal]:
        self.copies.decay(requests)
        bounds = [self.copies.bound(r, room) for r, room in zip(requests, rooms)]
        longest = widest_paying(bounds, cost) - 1 if plan_width(bounds, cost) > 1 else 0  # no copy could pay: 0
        trees = self.inner.propose(requests, rooms, cost)
        proposals = {}
        for request, room in zip(requests, rooms):
            found = self.copies.find(request, min(longest, room)) if longest else []
            copy, tree = (found[0] if found else None), trees.get(request.id)
            if copy is not None:
                rate = self.copies.rate(request, copy)
                tree = graft(tree, copy.tokens, rate, self.copies.label, self.nodes, self.copies.eos_ids) if tree \
                    else Proposal.chain(copy.tokens, self.copies.label, rate)
            if tree is not None:
                proposals[request.id] = self._copied(request, tree, copy)
        return proposals
