"""Logits to probabilities and tokens (temperature, top-k, top-p, seeded draws), and the acceptance rules
every speculative algorithm shares. Small pure functions.

Greedy (temperature 0) is the argmax, represented as a one-hot distribution so that every acceptance rule
can treat greedy and sampled decoding alike.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .config import SamplingParams
from .models import native
from .waits import to_device


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private random stream: the same seed gives the same samples, whatever else uses torch's global RNG."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution decoding draws from: logits (..., V) -> probabilities (..., V) float32.

    Order: temperature, then top-k, then top-p (the smallest set of most likely tokens whose mass reaches p;
    the most likely token always stays). Temperature 0 gives the one-hot argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Drop a token when the mass of strictly more likely tokens already reaches top_p; the most likely stays
        # even where top_p is below float32's smallest number (the comparison would then drop every token).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # (..., V)
        dropped = mass_before >= params.top_p
        dropped[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _row_kernel(logits: torch.Tensor) -> native.Kernel | None:
    """The native kernel where it serves these logits (N, V): float32 on the CPU."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or not logits.shape[1]:
        return None
    return native.kernel()


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of logits (N, V): the first of equal maxima (the first NaN, if any), as torch.argmax
    gives it; natively on the CPU, where one pass is several times faster than torch.argmax."""
    kernel = _row_kernel(logits)
    return logits.argmax(-1).tolist() if kernel is None else native.row_top(kernel, logits, False)[0]


def greedy_rows(logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """`argmax_rows` and each row's log-normaliser logsumexp (N,): token x of row i has the softmax probability
    exp(logits[i, x] - normaliser[i])."""
    kernel = _row_kernel(logits)
    if kernel is None:
        return logits.argmax(-1).tolist(), torch.logsumexp(logits.float(), -1)
    argmax, top, total = native.row_top(kernel, logits, True)
    assert total is not None  # asked for
    return argmax, top + total.log()


def softmax_at(logits: torch.Tensor, cells: list[tuple[int, int]]) -> list[float]:
    """softmax(logits[r])[x] for each (row r, token x) of `cells`, logits (N, V): the probabilities a greedy trace
    shows, from one normaliser per row named instead of the softmax of whole rows."""
    if not cells:
        return []
    first = min(row for row, _ in cells)
    # the span of rows named is a view: normalising its few unnamed rows costs less than gathering the named ones
    normaliser = greedy_rows(logits[first : max(row for row, _ in cells) + 1])[1].tolist()
    rows, tokens = to_device([list(cell) for cell in zip(*cells)], logits.device)  # (C,) each
    return [math.exp(value - normaliser[row - first])
            for (row, _), value in zip(cells, logits[rows, tokens].tolist())]


def shown_probabilities(logits: torch.Tensor, p: torch.Tensor | None, cells: list[tuple[int, int]]) -> list[float]:
    """The probability a trace shows for each (row, token) of `cells`: under the sampling distribution p (N, V)
    when sampling, and under greedy (p None) the target's softmax at temperature 1 of logits (N, V), as plain
    decoding shows it."""
    return softmax_at(logits, cells) if p is None else [float(p[row, token]) for row, token in cells]


def sample(probs: torch.Tensor, generator: torch.Generator | None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of probs (..., V) -> (...) int64, by inverting each row's cumulative distribution at a
    uniform draw (float64, so no token's share is lost to rounding; a zero-probability token is never drawn). u:
    (N, 1) float64, the rows' uniforms drawn beforehand (None: drawn here from `generator`, one call for all rows)."""
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    cdf = flat.double().cumsum(-1)  # (N, V)
    total = cdf[:, -1:]  # (N, 1)
    if u is None:
        u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device)  # (N, 1)
    # u * total < total, except by rounding: the largest value below total still lands on the last possible token
    point = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))  # (N, 1)
    return torch.searchsorted(cdf, point, right=True).view(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token from logits (..., V); returns (token (...), its probability (...)).

    The probability is under the sampling distribution; when greedy, under the model's own softmax at
    temperature 1 (a one-hot 1.0 would tell the viewer nothing about the model's confidence).
    """
    if params.greedy:
        flat = logits.float().reshape(-1, logits.shape[-1])  # (N, V)
        argmax, normaliser = greedy_rows(flat)
        token = to_device(argmax, logits.device)  # (N,)
        p = (flat.gather(1, token.unsqueeze(1)).squeeze(1) - normaliser.to(logits.device)).exp()  # (N,)
        return token.view(logits.shape[:-1]), p.view(logits.shape[:-1])
    probs = probabilities(logits, params)
    token = sample(probs, generator)
    return token, probs.gather(-1, token.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True, slots=True)
class Drawn:
    """A request's draws of one step made before its walk, one per row, as `next_token` would draw each when the walk
    reaches it: the tokens and their probabilities, and for a sampled request the generator's state before the
    draw of each depth (the walk draws once per depth) and after the last."""

    tokens: list[int]
    probs: list[float]
    states: tuple[torch.Tensor, ...] = ()
    nodes: Sequence[float] = ()  # the probability of each proposed node under its parent's row, as a trace shows it
    probed: Sequence[int] = ()  # the greedy token after each probe (`Proposal.probes`)

    def rewind(self, generator: torch.Generator, draws: int) -> None:
        """Leave the generator where a walk that drew `draws` rows one by one would have left it."""
        if self.states:
            generator.set_state(self.states[draws])


def draws_ahead(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                depths: list[int] | None = None, cells: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Every row's draw of logits (N, V) without waiting for the device: tokens (N,) and their probabilities (N,) on
    the device, as `next_token` gives them, the probability (C,) of each (row, token) of `cells` (2, C) as a trace
    shows it (`shown_probabilities`; empty without cells), and the generator's states for `Drawn`. Greedy: the
    argmax and its softmax probability. Sampled: row i drawn with the uniform of its depth depths[i] (the walk's draw
    number), drawn from the generator one depth at a time as the walk would draw them."""
    flat = logits.float()  # (N, V)
    if params.greedy:
        token = flat.argmax(-1)  # (N,)
        normaliser = torch.logsumexp(flat, -1)  # (N,)
        prob = (flat.gather(1, token.unsqueeze(1)).squeeze(1) - normaliser).exp()  # (N,)
        at = flat.new_zeros(0) if cells is None else (flat[cells[0], cells[1]] - normaliser[cells[0]]).exp()  # (C,)
        return token, prob, at, ()
    if generator is None or depths is None:
        raise ValueError("sampled draws ahead need the request's generator and each row's depth")
    states, uniforms = [], []
    for _ in range(max(depths) + 1):
        states.append(generator.get_state())
        uniforms.append(torch.rand(1, 1, generator=generator, dtype=torch.float64, device=logits.device))
    states.append(generator.get_state())
    probs = probabilities(flat, params)  # (N, V)
    token = sample(probs, None, torch.cat(uniforms)[to_device(depths, logits.device)])  # (N,)
    at = flat.new_zeros(0) if cells is None else probs[cells[0], cells[1]]  # (C,)
    return token, probs.gather(1, token.unsqueeze(1)).squeeze(1), at, tuple(states)


@dataclass(frozen=True, slots=True)
class ChainVerdict:
    """Outcome of verifying K proposed tokens with one target forward.

    num_accepted: how many leading proposals are kept. token: the one token emitted after them, a correction
    (`corrected`, a proposal was rejected) or a bonus (all K accepted). uniforms: the draw u_i compared for each
    examined proposal (empty under greedy acceptance).
    """

    num_accepted: int
    token: int
    corrected: bool
    uniforms: tuple[float, ...]


def verify_lossless(p: torch.Tensor, q: torch.Tensor, proposals: list[int],
                    generator: torch.Generator) -> ChainVerdict:
    """Speculative sampling (Leviathan et al. 2023): the emitted tokens are distributed exactly as under p.

    p: (K+1, V) target distributions, row K for the bonus position; q: (K, V) the distributions the proposals
    were really drawn from (one-hot rows for n-gram or lookahead guesses).
    """
    k = len(proposals)
    index = to_device(proposals, p.device).unsqueeze(1)  # (K, 1)
    p_x = p[:k].gather(1, index).squeeze(1)  # (K,)
    q_x = q.gather(1, index).squeeze(1)  # (K,)
    u = torch.rand(k, generator=generator, device=p.device)  # (K,)
    # accept x_i with probability min(1, p(x_i) / q(x_i)), written without dividing by q
    keep = (u * q_x <= p_x).tolist()
    accepted = keep.index(False) if False in keep else k
    uniforms = tuple(u[: min(accepted + 1, k)].tolist())
    if accepted == k:
        return ChainVerdict(k, int(sample(p[k], generator)), False, uniforms)
    # on rejection draw from norm(max(0, p - q))
    residual = (p[accepted] - q[accepted]).clamp_min(0.0)  # (V,)
    mass = residual.sum()
    if mass <= 1e-12:
        # p == q up to rounding: rejection had probability 0 in exact arithmetic; drawing from p keeps the
        # output distributed as p instead of dividing by zero.
        residual, mass = p[accepted], p[accepted].sum()
    return ChainVerdict(accepted, int(sample(residual / mass, generator)), True, uniforms)


def draws_along(logits: torch.Tensor, proposals: list[int], params: SamplingParams, generator: torch.Generator,
                parents: list[int] | None = None,
                drawn: Drawn | None = None) -> Iterator[tuple[int, int, float]]:
    """The lossless rule for one-hot proposals in the form that draws what plain decoding draws. Row 0 of logits
    (1 + K, V) scores the position after the last committed token, row i + 1 the position after proposals[i];
    parents[i] is the row of the proposal proposals[i] follows (0: the last committed token), each parent's row
    before its children's; None is a chain (parents[i] = i). From row 0, each row's token is drawn exactly as
    `next_token` draws it, and the walk goes on at the row of the proposal below it that equals the draw, if any
    (that row was computed after it). A proposal x is so kept with probability p(x), and on refusal the draw is p
    conditioned on no proposal there, norm(max(0, p - q)) for q one-hot on each sibling in turn: the rule of
    `verify_lossless` for one-hot q, consuming the random stream as plain decoding does (greedy: the argmax, as
    `verify_greedy`). drawn: every row's draw made beforehand (`draws_ahead`; the caller rewinds the generator).
    Yields (row, token drawn there, its probability as `next_token` gives it); the last token is the correction or
    the bonus."""
    parents = list(range(len(proposals))) if parents is None else parents
    row: int | None = 0
    while row is not None:
        if drawn is not None:
            token, p = drawn.tokens[row], drawn.probs[row]
        else:
            draw, chance = next_token(logits[row], params, generator)
            token, p = int(draw), float(chance)
        yield row, token, p
        row = next((i + 1 for i, (x, parent) in enumerate(zip(proposals, parents)) if parent == row and x == token),
                   None)


@dataclass(frozen=True, slots=True)
class TreeVerdict:
    """Outcome of verifying a candidate tree with one target forward.

    path: the accepted nodes in depth order (root excluded). judged: (node, accepted, uniform draw or None) for
    every node the rule examined, in order. token: the token emitted after the path, a correction (`corrected`:
    the last path node had children and none was accepted) or a bonus (it was a leaf)."""

    path: tuple[int, ...]
    judged: tuple[tuple[int, bool, float | None], ...]
    token: int
    corrected: bool


def verify_tree_typical(p: torch.Tensor, retrieve: tuple[tuple[int, ...], ...], tokens: list[int], epsilon: float,
                        alpha: float, generator: torch.Generator,
                        children: tuple[tuple[int, ...], ...]) -> TreeVerdict:
    """Typical acceptance (lossy): node x after node n is accepted if p_n(x) > min(epsilon, alpha * exp(-H(p_n))).
    The root-to-leaf path with the longest accepted prefix wins (the earliest on ties); the next token is drawn
    from p at its last accepted node. p (n+1, V)."""
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (n+1,)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), alpha * torch.exp(-entropy)).tolist()
    best: list[int] = []
    failed: int | None = None  # the first node of the best path that failed the test, if any
    for chain in retrieve:
        kept, miss = [], None
        for parent, node in zip(chain, chain[1:]):
            if float(p[parent, tokens[node]]) <= threshold[parent]:
                miss = node
                break
            kept.append(node)
        if len(kept) > len(best) or failed is None and not best and miss is not None:
            best, failed = kept, miss
    last = best[-1] if best else 0
    judged = [(n, True, None) for n in best] + ([(failed, False, None)] if failed is not None else [])
    return TreeVerdict(tuple(best), tuple(judged), int(sample(p[last], generator)), bool(children[last]))


def tree_shape(parents: list[int]) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """For a tree whose node i + 1 follows row parents[i] (row 0: the root): each row's children in order, and
    every root-to-leaf path of rows, root first."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent].append(i + 1)

    def paths(row: int) -> list[tuple[int, ...]]:
        return [(row,)] if not children[row] else [(row, *rest) for c in children[row] for rest in paths(c)]
    return tuple(map(tuple, children)), tuple(paths(0))


class Rule(ABC):
    """How a proposal's tokens are judged where a request samples (greedy requests take the argmax along the tree
    whatever the rule): the object a proposal carries (`Proposal.rule`), so that neither the engine nor `accept`
    asks which algorithm made it. `plain`: its draws are plain decoding's, which the engine may make ahead of the
    walk (`draws_ahead`); `chain_only`: its proposals must stay chains (nothing may be grafted on)."""

    plain: ClassVar[bool] = False
    chain_only: ClassVar[bool] = False

    @abstractmethod
    def walk(self, logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
             generator: torch.Generator, drawn: Drawn | None) -> Iterator[tuple[int, int, float]]:
        """(row, token drawn there, its probability) along the kept path, as `accept` yields them."""

    def first(self, n: int) -> Rule:
        """The rule of the proposal's first n nodes."""
        return self


class PlainDraws(Rule):
    """One-hot proposals: each token drawn from the target's row as plain decoding draws it, the walk following
    the node equal to the draw (`draws_along`): exact, and a seed's output plain decoding's."""

    plain = True

    def walk(self, logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
             generator: torch.Generator, drawn: Drawn | None) -> Iterator[tuple[int, int, float]]:
        yield from draws_along(logits, tokens, params, generator, parents, drawn)


@dataclass(frozen=True)
class Lossless(Rule):
    """A chain sampled from the proposer's distributions q (n, V), judged by Leviathan et al.'s rule
    (`verify_lossless`): the target's distribution, though not a seed's plain-decoding draws."""

    q: torch.Tensor
    chain_only: ClassVar[bool] = True

    def walk(self, logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
             generator: torch.Generator, drawn: Drawn | None) -> Iterator[tuple[int, int, float]]:
        if parents != list(range(len(tokens))):
            raise ValueError("a proposal with its own distributions q must be a chain")
        p = probabilities(logits, params)  # (1 + n, V)
        verdict = verify_lossless(p, self.q, tokens, generator)
        rows = list(range(verdict.num_accepted + 1))
        yield from _along(p, tokens, rows, verdict.token)

    def first(self, n: int) -> Lossless:
        return Lossless(self.q[:n])


@dataclass(frozen=True)
class Typical(Rule):
    """Medusa's typical acceptance (Cai et al.), lossy by design: node x after node n is kept where p_n(x) >
    min(epsilon, alpha * exp(-H(p_n))) (`verify_tree_typical`)."""

    epsilon: float
    alpha: float

    def walk(self, logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
             generator: torch.Generator, drawn: Drawn | None) -> Iterator[tuple[int, int, float]]:
        p = probabilities(logits, params)  # (1 + n, V)
        children, retrieve = tree_shape(parents)
        verdict = verify_tree_typical(p, retrieve, [-1, *tokens], self.epsilon, self.alpha, generator, children)
        yield from _along(p, tokens, [0, *verdict.path], verdict.token)


PLAIN_DRAWS = PlainDraws()


def _along(p: torch.Tensor, tokens: list[int], rows: list[int], last: int) -> Iterator[tuple[int, int, float]]:
    """A verdict as `accept` yields it: the kept rows' tokens, then the correction or bonus `last`."""
    for row, token in zip(rows, [tokens[row - 1] for row in rows[1:]] + [last]):
        yield row, token, float(p[row, token])


def accept(logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
           generator: torch.Generator, rule: Rule = PLAIN_DRAWS,
           drawn: Drawn | None = None) -> Iterator[tuple[int, int, float]]:
    """The one acceptance step over a proposal: row 0 of logits (1 + n, V) scores the position after the last
    committed token, row i + 1 the position after tokens[i], which follows row parents[i]. Yields (row, token drawn
    there, its probability), as `draws_along` does, the last token the correction or the bonus: greedy, or with
    nothing proposed, plain decoding's draws along the tree; else as the proposal's `rule` judges it. drawn: every
    row's draw made beforehand (`draws_ahead`), for plain decoding's draws."""
    if params.greedy or not tokens:
        yield from draws_along(logits, tokens, params, generator, parents, drawn)
        return
    yield from rule.walk(logits, tokens, parents, params, generator, drawn)
