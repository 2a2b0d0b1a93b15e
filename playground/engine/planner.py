"""Planning beside the step: how much each decode step verifies, decided from what the steps before it taught.

The engine's step schedules, proposes, verifies, accepts and commits. Before proposing it asks its planner whether
to ask the proposer at all (`asks`: not while drafting rests) and what a forward of each width costs (`cost`); after
the step the planner reads the step's record (`observe`): the forward's seconds correct this process's live costs,
and the step's tokens per unit of time judge whether drafting pays (`planning.Payoff`). The step itself keeps
nothing of it.

Where a planner starts, and what it keeps:
- as set (`EngineParams.plan == "as-set"`), or on a curve given (a `ForwardCosts`: a test's, a notebook's, or
  `$PLAYGROUND_FORWARD_COSTS`, `costs.forward_costs`): every step plans alike whatever ran before. The proposer's
  acceptance estimates go back to their priors (`Proposer.forget`) and its own forwards are priced at their
  estimates (`planning.OwnCost.value` before any sample), never at what a busy host made them take.
- measured on this machine's live costs (the default): what the runs so far taught carries over to the next engine.
  The live costs are the process's (`costs.forward_costs`), the proposer keeps its acceptance estimates and its
  measured price, and whether its drafting pays is kept here per proposer (`KEPT`): the app's next run and the
  bench's next prompt rest where the last ones found that drafting did not pay, rather than paying to find it out
  again. `kept` gives a proposer's.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from ..decoding.costs import ForwardCosts, LiveCosts
from ..decoding.planning import Payoff, plan_width
from ..decoding.proposer import Cost, Proposer

KEPT: weakref.WeakKeyDictionary[Proposer, Payoff] = weakref.WeakKeyDictionary()


def kept(proposer: Proposer) -> Payoff:
    """Whether the proposer's drafting pays, as the engines on live costs that ran it so far judged it."""
    payoff = KEPT.get(proposer)
    if payoff is None:
        payoff = KEPT[proposer] = Payoff()
    return payoff


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What the planner reads of a step once it has run. asked: the proposer was asked for proposals; proposed: it
    proposed something (whatever of it the width kept); alone: a decode forward alone (no prefill in it); tokens:
    the tokens its forward ran; batch: its decoding requests; forward_s: its forward's seconds, draws included;
    step_s: the whole step's; committed: the tokens its decoding requests committed."""

    asked: bool
    proposed: bool
    alone: bool
    tokens: int
    batch: int
    forward_s: float
    step_s: float
    committed: int


class Planner:
    """An engine's planning: `costs` (what a forward costs by width), `as_set` (every width costs one forward and a
    proposer's own forwards nothing), and `payoff` (whether drafting pays: on live costs under the measured plan, the
    proposer's kept one; else None, never judged)."""

    def __init__(self, costs: ForwardCosts | LiveCosts, as_set: bool, proposer: Proposer | None) -> None:
        self.costs, self.as_set = costs, as_set
        self.live = isinstance(costs, LiveCosts) and not as_set
        self.payoff = kept(proposer) if self.live and proposer is not None else None
        self.owns = proposer is not None and proposer.own is not None  # it has forwards of its own to price
        self._from = (self.payoff.rests, self.payoff.rested) if self.payoff is not None else (0, 0)
        if proposer is not None and not self.live:
            proposer.forget()

    def asks(self) -> bool:
        """Whether this step asks the proposer for proposals: not while drafting rests (counted: once a step)."""
        return self.payoff is None or not self.payoff.resting()

    def cost(self, batch: int, widest: float) -> Cost:
        """What the step's decode forward costs by width for `batch` requests, relative to its one-token forward; a
        width over `widest` (the forwards keep a token's bits no wider) never pays."""
        costs, as_set = self.costs, self.as_set

        def relative(width: int) -> float:
            if width > widest:
                return math.inf
            return 1.0 if as_set else costs.step_cost(batch, width)
        return Cost(relative, costs.time(batch), as_set, measured=self.live)

    @staticmethod
    def width(gains: list[list[float]], extra: int, cost: Callable[[int], float]) -> int:
        """The decode rows' width (the last token and its candidates) that commits the most expected tokens per unit
        of cost, each request's `gains` its expected tokens by candidates verified, `extra` probes run besides."""
        return plan_width(gains, lambda w: cost(w + extra) if w > 1 else 1.0)

    def observe(self, step: StepRecord) -> None:
        """A step ran: a decode forward alone corrects the live costs at its width, and, where drafting is judged,
        the step counts per request in its batch's one-token forwards, so that steps of any batch compare."""
        if isinstance(self.costs, LiveCosts) and step.alone:
            self.costs.record(step.tokens, step.forward_s)
        if self.payoff is None:
            return
        if step.asked and self.owns:  # nothing proposed: its forwards priced out
            self.payoff.declined(step.proposed)
        if step.alone:
            self.payoff.record(step.proposed, step.committed / step.batch, step.step_s / self.costs.time(step.batch))

    def rests(self) -> tuple[int, int] | None:
        """Under the measured plan on live costs, how often drafting rested since this planner began, its steps
        committing fewer tokens a second than plain ones, and how many steps it rested (a rest begun before
        included); None where drafting is not judged so."""
        if self.payoff is None:
            return None
        return self.payoff.rests - self._from[0], self.payoff.rested - self._from[1]
