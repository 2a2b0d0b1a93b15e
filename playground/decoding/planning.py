"""How much to propose: running acceptance estimates, what a proposer's own forwards cost as measured while it runs,
and the width of a batch's decode forward that commits the most tokens per unit of cost (priced by this machine's
measured `costs.ForwardCosts`)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..models.linear import product_bytes, weights_read

if TYPE_CHECKING:
    from ..models import Transformer
    from ..models.vocab import OutputRows


class RunningAcceptance:
    """How often proposed tokens are accepted: accepted / judged proposals, starting from an optimistic prior
    of 2 / 3 (so that proposing is tried on every new text) and decaying towards it every step, so the estimate
    follows the text and a source that fell out of favour is tried again after a while."""

    PRIOR_ACCEPTED, PRIOR_JUDGED = 2 / 3, 1.0
    DECAY = 0.95

    def __init__(self) -> None:
        self.accepted, self.judged = self.PRIOR_ACCEPTED, self.PRIOR_JUDGED

    def rate(self) -> float:
        return self.accepted / self.judged

    def expected_tokens(self, length: int) -> float:
        """1 + a + ... + a^length: the tokens a step commits, bonus included, when each of `length` proposals is
        accepted with probability a given the previous one was."""
        a = self.rate()
        return sum(a**i for i in range(length + 1))

    def record(self, accepted: int, judged: int) -> None:
        self.accepted += accepted
        self.judged += judged

    def decay(self) -> None:
        d = self.DECAY
        self.accepted = self.PRIOR_ACCEPTED + d * (self.accepted - self.PRIOR_ACCEPTED)
        self.judged = self.PRIOR_JUDGED + d * (self.judged - self.PRIOR_JUDGED)


class NgramAcceptance:
    """`RunningAcceptance` per matched n-gram length: how often copies found by matching that many tokens were
    accepted."""

    def __init__(self, max_ngram: int) -> None:
        self.by_ngram = [RunningAcceptance() for _ in range(max_ngram + 1)]  # indexed by matched n-gram length

    def acceptance(self, ngram: int) -> float:
        return self.by_ngram[ngram].rate()

    def expected_tokens(self, ngram: int, length: int) -> float:
        return self.by_ngram[ngram].expected_tokens(length)

    def best_expected_tokens(self, length: int) -> float:
        """The most `expected_tokens` any matched n-gram length gives a copy of `length` tokens: a bound for a copy
        not looked up yet."""
        return max(estimate.expected_tokens(length) for estimate in self.by_ngram[1:])

    def record(self, ngram: int, accepted: int, judged: int) -> None:
        self.by_ngram[ngram].record(accepted, judged)

    def decay(self) -> None:
        for estimate in self.by_ngram:
            estimate.decay()


@dataclass(frozen=True, slots=True)
class DraftPrice:
    """What drafting g deep costs a step, in the batch's one-token target forwards: `first` for its first depth (the
    proposer's catch-up on what it has not read, and the step's fixed work around its forwards, included) and
    `further` for each depth after it (None where one forward drafts every depth, as the Medusa heads' does)."""

    first: float
    further: float | None

    def __call__(self, depth: int) -> float:
        return 0.0 if depth <= 0 else self.first + (depth - 1) * (self.further or 0.0)


class OwnCost:
    """What a proposer's own drafting (a draft model's forwards, the EAGLE head's, the Medusa heads' one a step) costs
    a step (`DraftPrice`): `fixed` per depth where set, else measured as the proposer runs: the medians, over its last
    WINDOW drafting steps, of the first depth's seconds and of each further depth's over the batch's one-token forward
    (the engine's measured curve); `prior` (an estimate from the weights a one-row forward reads) for either until
    MEASURED steps measured it. The prior is a floor, not a forecast, where a further depth's forward runs more rows
    a request (`rows`, EAGLE's top_k; `estimate` prices them on the target's curve): more rows never cost less, and a
    price that starts high is never corrected, since a depth the plan does not draft is never timed. `per_depth`
    False: one forward drafts every depth (further depths cost nothing). Where a step's depths are not timed apart
    (a device that runs asynchronously), its seconds per depth price both. A median, because a step that captured a
    CUDA graph or met a busy host is far slower than the rest. A long catch-up (a prompt's, the tokens of many steps
    drafting rested) is the proposer's to leave out: it is paid once (`Payoff` sees it). A price that stopped the
    drafting gets no new samples: after STALE plans priced without one the samples are dropped, so a long-lived
    engine tries the estimate again (a price measured while the host was busy does not silence a proposer for
    good)."""

    WINDOW, MEASURED, STALE = 16, 3, 256

    def __init__(self, fixed: float | None, prior: float, per_depth: bool = True, rows: int = 1) -> None:
        self.fixed, self.prior, self.per_depth, self.rows = fixed, prior, per_depth, rows
        self.firsts: deque[float] = deque(maxlen=self.WINDOW)  # a step's first depth, in one-token forwards
        self.furthers: deque[float] = deque(maxlen=self.WINDOW)  # each further depth
        self.unmeasured = 0  # plans priced since the last sample

    def __call__(self) -> DraftPrice:
        """The price for a plan (counted towards STALE)."""
        self.unmeasured += 1
        if self.unmeasured > self.STALE:
            self.firsts.clear()
            self.furthers.clear()
        return self.value()

    def estimated(self) -> DraftPrice:
        """The price before any measurement: `fixed` where set, else the prior for every depth."""
        if self.fixed is not None:
            return DraftPrice(self.fixed, self.fixed if self.per_depth else None)
        return DraftPrice(self.prior, self.prior if self.per_depth else None)

    def value(self) -> DraftPrice:
        """The price now, for a report (not counted)."""
        if self.fixed is not None:
            return DraftPrice(self.fixed, self.fixed if self.per_depth else None)
        first, further = _median(self.firsts), _median(self.furthers)
        return DraftPrice(self.prior if first is None else first,
                          None if not self.per_depth else self.prior if further is None else further)

    def estimate(self, relative: Callable[[int], float]) -> float:
        """What a further depth's forward should cost by the weights it reads, for comparing with what it measured:
        `prior` (a one-row forward's) times what `rows` rows cost over one on the target's curve `relative` (cost(1)
        = 1). Where the kernel's products wait on arithmetic more than on reading the weights, a forward of several
        rows costs more than a one-row forward of the same bytes, by as much as the target's does."""
        return self.prior * relative(self.rows)

    @contextmanager
    def unrecorded(self) -> Iterator[None]:
        """What steps inside record (a warm-up's: first calls allocate buffers and read weights never read before)
        is dropped after: the samples and the count of plans come out as they went in."""
        firsts, furthers, unmeasured = list(self.firsts), list(self.furthers), self.unmeasured
        try:
            yield
        finally:
            self.firsts = deque(firsts, maxlen=self.WINDOW)
            self.furthers = deque(furthers, maxlen=self.WINDOW)
            self.unmeasured = unmeasured

    def measured(self) -> float | None:
        """A drafting forward's price as its last steps measured it (whatever `fixed` says): a further depth's, or
        where one forward drafts every depth that one's; None until MEASURED steps measured it."""
        return _median(self.furthers if self.per_depth else self.firsts)

    def measured_first(self) -> float | None:
        """A step's first depth's price as measured (its catch-up and fixed work included); None before."""
        return _median(self.firsts)

    def record(self, seconds: float, depth: int, one_s: float, further: float | None = None) -> None:
        """A drafting step `depth` deep took `seconds`, `further` of them drafting its depths after the first (None:
        not timed apart; the rest is the first depth's, with the step's fixed work before and after its forwards);
        the batch's one-token target forward takes `one_s`."""
        if depth <= 0 or one_s <= 0:
            return
        later: float | None = None
        if not self.per_depth:
            first = seconds
        elif further is None or depth == 1:
            first = seconds / depth
            later = first if depth > 1 else None
        else:
            first, later = seconds - further, further / (depth - 1)
        self.firsts.append(first / one_s)
        if later is not None:
            self.furthers.append(later / one_s)
        self.unmeasured = 0


def _median(samples: deque[float]) -> float | None:
    return statistics.median(samples) if len(samples) >= OwnCost.MEASURED else None


def weights_estimate(target: Transformer, reads: int, layers: float) -> float:
    """A proposer's own forward over the target's one-token forward before any is measured (`OwnCost.prior`): where
    the native CPU kernel runs the products, forwards are bound by reading the weights, so `reads` (the bytes the
    proposer's forward reads, see `linear.weights_read`) over what the target's layers and output rows read (its
    GGUF blocks, where it kept them); elsewhere (a GPU, PyTorch's kernels) by each layer's fixed work, so its
    `layers` over the target's."""
    if target.rows_per_pass is None:
        return layers / target.config.num_layers
    return reads / forward_reads(target)


def forward_reads(model: Transformer, rows: OutputRows | None = None) -> int:
    """Bytes a forward of `model` reads: its layers, and `rows` of its output projection (None: all of it)."""
    output = product_bytes(model.output_weight, model.packed_output) if rows is None else rows.nbytes
    return weights_read(model.layers) + output


def at(gains: list[float], k: int) -> float:
    """gains[k], or the last entry for k past the end (a proposal cannot grow longer)."""
    return gains[min(k, len(gains) - 1)]


def widest_paying(bounds: list[list[float]], cost: Callable[[int], float]) -> int:
    """The widest decode forward at which a batch could commit more tokens per unit of cost than a plain one, were
    every sequence to commit its bound (bounds[r][k]: the most sequence r could commit with k proposed tokens); 1
    when none could. Where `plan_width` picks the best width for expected tokens, this bounds the work worth doing
    before any expectation is known."""
    longest = max(len(b) for b in bounds)
    return max((w for w in range(2, longest + 1) if sum(at(b, w - 1) for b in bounds) > len(bounds) * cost(w)),
               default=1)


def plan_width(gains: list[list[float]], cost: Callable[[int], float]) -> int:
    """The width (tokens per sequence: the last token and up to width - 1 copied ones) of a batch's decode forward
    that commits the most tokens per unit of cost. gains[r][k]: the tokens sequence r is expected to commit with the
    first k tokens of its copy verified (gains[r][0] = 1, a plain step); cost(width): the forward's cost relative to
    a one-token forward (cost(1) = 1). The narrowest width wins ties, so a batch with nothing to gain runs plain."""
    best, best_rate = 1, float(len(gains))
    for width in range(2, 1 + max((len(g) for g in gains), default=1)):
        committed = sum(at(g, width - 1) for g in gains)
        if committed / cost(width) > best_rate:
            best, best_rate = width, committed / cost(width)
    return best


def guess_depth(expected: list[float], rooms: list[int], cost: Callable[[int], float],
                price: Callable[[int], float]) -> int:
    """How deep a guesser should guess for a batch: the depth g whose step commits the most tokens per unit of
    cost(1 + g) + price(g) (price: the guesser's own forwards for g places), 0 when a plain step commits as many.
    expected[k]: the tokens a step commits with guesses k deep; rooms[r]: how many places request r has left."""
    depth = len(expected) - 1
    return plan_width([expected[: min(room, depth) + 1] for room in rooms],
                      lambda width: cost(width) + price(width - 1)) - 1


class Payoff:
    """Whether drafting pays as it runs: the tokens the recent decode steps that proposed committed per unit of their
    time against those of the steps that did not, everything a step paid included (the proposer's forwards and
    catch-ups, proposals made and then not verified, wider forwards as they ran, host work), which no price sees
    whole. Each step counts per request, in its batch's one-token forwards, so steps of any batch compare. Judged
    after each drafting step once JUDGED drafting and JUDGED plain steps are in (a run that drafts from its first
    step first rests JUDGED steps to time plain ones): where drafting commits fewer tokens a unit of time, it rests
    for REST steps (the engine asks for no proposal), twice as long after each rest that did not pay off, up to
    LONGEST, and is judged afresh after. Asking costs a step too (the plan's arithmetic): a proposer with forwards of
    its own that priced them out DECLINED steps in a row is not asked for the next steps, as many as it has declined
    in a row, up to IDLE (`declined`; copies grafted onto it wait as long), since its price and its estimates move
    little from one step to the next. A proposer keeps its own across engines (`Proposer.payoff`)."""

    WINDOW, JUDGED, REST, LONGEST = 32, 4, 32, 1024
    DECLINED, IDLE = 4, 16

    def __init__(self) -> None:
        self.drafting: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)  # (tokens, time) per step
        self.plain: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)
        self.rest, self.left = self.REST, 0  # the next rest's length; steps left of this one
        self.rests = 0  # rests taken
        self.rested = 0  # steps rested
        self.declines = 0  # steps in a row it was asked and proposed nothing
        self.idle = 0  # steps left without asking after those

    def resting(self) -> bool:
        """Whether this step asks for no proposal: drafting rests, or the proposer is left idle after declining
        (counted: call once a step)."""
        if self.left:
            self.left -= 1
            self.rested += 1
            return True
        if self.idle:
            self.idle -= 1
            return True
        return False

    def declined(self, proposed: bool) -> None:
        """The proposer was asked and proposed something, or nothing (its plan found no depth that pays)."""
        self.declines = 0 if proposed else self.declines + 1
        if self.declines >= self.DECLINED:
            self.idle = min(self.declines, self.IDLE)

    def record(self, drafted: bool, tokens: float, took: float) -> None:
        """A decode step (no prefill in it) committed `tokens` in `took`; `drafted`: its proposer proposed."""
        (self.drafting if drafted else self.plain).append((tokens, took))
        if not drafted or len(self.drafting) < self.JUDGED:
            return
        if len(self.plain) < self.JUDGED:
            self.left = self.JUDGED  # plain steps to compare with
        elif _rate(self.drafting) < _rate(self.plain):
            self.left, self.rest = self.rest, min(2 * self.rest, self.LONGEST)
            self.rests += 1
            self.drafting.clear()
        else:
            self.rest = self.REST


def _rate(steps: deque[tuple[float, float]]) -> float:
    return sum(tokens for tokens, _ in steps) / max(sum(took for _, took in steps), 1e-12)
