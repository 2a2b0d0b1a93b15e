"""A request's trace events from the engine's steps: what the Decode tab, the CLI, the bench and the notebooks read.

Step 0 is the prefill and the first token; each decode step after it is a draft of the request's proposal (if any),
one verifying forward, the decisions along the path the draws took (accept for each kept node; at the end, the
first refused node and the correction, or a bonus where nothing was proposed below), and a commit that splits the
step's engine time into proposing, verifying and the rest. Times are the engine's clock; in a batch, the proposing
and verifying time of a step is the whole batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..decoding.proposer import Outcome, Proposal
from ..kv import KVMemory
from ..sampling import Drawn, probabilities, shown_probabilities
from ..trace import (
    AcceptEvent,
    BonusEvent,
    CommitEvent,
    CorrectEvent,
    DraftEvent,
    Event,
    FinishEvent,
    KVAllocEvent,
    PrefillEvent,
    RejectEvent,
    TokenInfo,
    VerifyEvent,
)
from .scheduler import Request


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Engine times of one step: its start, the end of proposing and the end of the forwards."""

    start: float
    proposed: float
    verified: float


class Tracer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}  # token id -> its text alone, decoded once

    def info(self, token: int, position: int, p: float | None = None, q: float | None = None,
             parent: int | None = None) -> TokenInfo:
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.tokenizer.decode([token])
        return TokenInfo(id=token, text=text, position=position, p=p, q=q, parent=parent)

    def step(self, request: Request, proposal: Proposal | None, width: int, outcome: Outcome, logits: torch.Tensor,
             times: StepTimes, now: float, memory: KVMemory, drawn: Drawn | None = None) -> list[Event]:
        """The events of the step that drew `outcome` from logits (1 + n, V) at the last token and the n candidates
        of its `proposal` (its forward ran `width` rows, probes included); `memory`: the cache's after the step;
        `drawn`: the step's draws made beforehand, if they were."""
        base = request.num_computed - 1  # the last token's position
        prefill = request.first_token_t is None
        step = 0 if prefill else request.decode_steps + 1
        proposal = proposal or Proposal([], [], [], [])
        depths, children = proposal.depths(), proposal.children()
        # the probabilities shown: each draw's, then the first node refused at the end, if any
        shown = list(outcome.probs)
        end = outcome.walk[-1]
        if children[end] and self._kept(proposal, children, outcome, -1) is None:
            refused = children[end][0] - 1
            if drawn is not None:
                shown.append(drawn.nodes[refused])
            else:
                refusing = logits[end : end + 1]  # (1, V)
                p_row = None if request.sampling.greedy else probabilities(refusing, request.sampling)
                shown += shown_probabilities(refusing, p_row, [(0, proposal.tokens[refused])])
        events: list[Event] = []
        if prefill:
            events += [PrefillEvent(step=0, t=times.verified, num_tokens=len(request.prompt_ids),
                                    wall_s=times.verified - times.proposed),
                       KVAllocEvent(step=0, t=times.verified, seq=request.id, num_tokens=len(request.prompt_ids),
                                    bytes_used=memory.bytes_used, bytes_reserved=memory.bytes_reserved)]
        else:
            drafted = proposal.trace_fields()
            if proposal.tokens or drafted["note"] is not None:  # a note alone: what the step ran without tokens
                chain = proposal.is_chain()
                events.append(DraftEvent(
                    step=step, t=times.proposed, wall_s=times.proposed - times.start, **drafted,
                    tokens=[self.info(token, base + depths[i + 1], q=proposal.probs[i],
                                      parent=None if chain else proposal.parents[i])
                            for i, token in enumerate(proposal.tokens)]))
            events.append(VerifyEvent(step=step, t=times.verified, num_tokens=width,
                                      wall_s=times.verified - times.proposed, target_forwards=1))
        for i, (row, token) in enumerate(zip(outcome.walk, outcome.new)):
            position = base + depths[row] + 1
            kept = self._kept(proposal, children, outcome, i)
            if kept is not None:
                events.append(AcceptEvent(step=step, t=now, token=self.info(token, position, shown[i],
                                                                            proposal.probs[kept - 1])))
            elif children[row]:
                refused = children[row][0]
                events.append(RejectEvent(step=step, t=now, token=self.info(
                    proposal.tokens[refused - 1], position, shown[-1], proposal.probs[refused - 1])))
                events.append(CorrectEvent(step=step, t=now, token=self.info(token, position, shown[i])))
            else:
                events.append(BonusEvent(step=step, t=now, token=self.info(token, position, shown[i])))
        draft_s = times.proposed - times.start
        verify_s = times.verified - times.proposed
        events.append(CommitEvent(step=step, t=now, num_tokens=len(outcome.new), draft_s=0.0 if prefill else draft_s,
                                  verify_s=verify_s, overhead_s=now - times.verified + (draft_s if prefill else 0.0),
                                  kv_bytes=memory.bytes_used))
        return events

    @staticmethod
    def _kept(proposal: Proposal, children: list[list[int]], outcome: Outcome, i: int) -> int | None:
        """The node the i-th draw kept (the child of its row holding the drawn token), if any."""
        row, token = outcome.walk[i], outcome.new[i]
        return next((c for c in children[row] if proposal.tokens[c - 1] == token), None)

    @staticmethod
    def finish(request: Request, now: float) -> FinishEvent:
        output = request.stopper.output(now - request.arrival_t)
        return FinishEvent(step=request.decode_steps, t=now, reason=output.finish_reason,
                           token_ids=list(output.token_ids), text=output.text, wall_s=output.wall_s)
