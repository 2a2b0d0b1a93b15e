"""Which requests run this step, and how many of their tokens: queues, the token budget, KV blocks and preemption.
It books the cache's blocks through their plain-Python book (`KVCache.blocks`), never a tensor.

First-come first-served: running requests first, then waiting ones while the token budget, the running limit and
the free blocks allow; a waiting request whose prompt blocks a running request is computing right now waits until
they are written and shares them. When a running request needs a block and none is free, the newest running request
is preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed (prompt and
generated tokens, one prefill) when there is room again. A "static" policy admits a new batch only when the whole
previous one has finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from ..config import EngineParams, GenerationParams, SamplingParams
from ..decoding.base import Stopper
from ..decoding.proposer import Proposal
from ..kv import Blocks, KVMemory
from ..trace import Event, KVAllocEvent, KVFreeEvent, PreemptEvent

if TYPE_CHECKING:
    import torch


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(eq=False)
class Request:
    id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    generation: GenerationParams
    generator: torch.Generator
    stopper: Stopper
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose KV is in the cache
    preemptions: int = 0
    arrival_t: float = 0.0
    first_token_t: float | None = None
    finish_t: float | None = None
    decode_steps: int = 0  # steps that drew a token after the first
    trace: list[Event] | None = None  # its trace events, where the engine records them

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.stopper.tokens

    @property
    def max_len(self) -> int:
        return len(self.prompt_ids) + self.generation.max_new_tokens

    def room(self) -> int:
        """How deep a proposal may go: the step commits its accepted tokens and one more. None in a one-token chunk
        of a prompt that goes on (a token budget of one): its row predicts no new token."""
        if self.num_computed + 1 < len(self.tokens):
            return 0
        return max(0, self.generation.max_new_tokens - len(self.stopper.tokens) - 1)


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)  # one token each (and its proposal), run as one batch
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    width: int = 1  # tokens per decode row: the last token, then proposals (their probes last) padded to one length
    proposals: dict[int, Proposal] = field(default_factory=dict)  # request id -> at most width - 1 tokens

    @property
    def num_tokens(self) -> int:
        return len(self.decode) * self.width + sum(n for _, n in self.prefill)


class Scheduler:
    def __init__(self, params: EngineParams, blocks: Blocks, memory: Callable[[], KVMemory],
                 clock: Callable[[], float], paused: Callable[[Request], None], events: list[Event]) -> None:
        """blocks: the cache's book, which the scheduler keeps; memory: the cache's memory now, for its events; clock:
        the engine's time; paused: told when a request's KV is dropped (preempted or released); events: where its KV
        events go."""
        self.params, self.blocks, self.memory = params, blocks, memory
        self.clock, self.paused, self.events = clock, paused, events
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.step = 0  # the step being scheduled, as the events name it

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.params.max_batch_tokens
        reserved = 0  # free blocks the planned forwards will take
        for request in list(self.running):
            if request.status is not Status.RUNNING or budget == 0:
                continue
            n = min(len(request.tokens) - request.num_computed, budget)
            need = self.blocks.blocks_needed(request.id, n)
            while need > self.blocks.num_free - reserved:
                victim = self.running[-1]  # the newest: never one already planned, those are older
                self.preempt(victim)
                if victim is request:
                    break
            if request.status is Status.RUNNING:
                self._plan(plan, request, n)
                budget -= n
                reserved += need
        static = self.params.policy == "static"
        if static and self.running:
            return plan  # a static batch admits nobody until all of it has finished
        # A static batch is formed whole at once; its prefills then share the token budget over the next steps.
        while self.waiting and (budget > 0 or static) and len(self.running) < self.params.max_running:
            request = self.waiting[0]
            prompt = request.tokens if self.params.prefix_caching else []
            cached_blocks, promised_blocks = self.blocks.prefix_blocks(prompt)
            if promised_blocks > cached_blocks and not static:
                # A running request is computing blocks of this prompt right now (requests arriving together share
                # a system prompt): admit it once they are written and share them instead of computing them twice.
                # A static batch is formed whole instead: waiting would shrink it.
                break
            cached = self.blocks.add_sequence(request.id, prompt)
            n = min(len(request.tokens) - cached, budget)
            need = self.blocks.blocks_needed(request.id, n)
            # Leave a block per running request so they can all grow next step without preempting this one.
            if need + len(self.running) > self.blocks.num_free - reserved:
                self.blocks.free(request.id)
                break
            reserved += need
            self.waiting.popleft()
            request.status, request.num_computed = Status.RUNNING, cached
            self.running.append(request)
            self.events.append(KVAllocEvent(step=self.step, t=self.clock(), seq=request.id,
                                            num_tokens=len(request.tokens), **self._bytes()))
            if n:
                self._plan(plan, request, n)
                budget -= n
        return plan

    @staticmethod
    def _plan(plan: StepPlan, request: Request, n: int) -> None:
        if n == 1:
            plan.decode.append(request)
        else:
            plan.prefill.append((request, n))

    def fit(self, plan: StepPlan, width: int, extra: int, probes_alone: bool = False) -> None:
        """Narrows the decode rows (the last token and width - 1 proposed candidates, then `extra` probes: none at
        width 1 unless `probes_alone`, where they cost nothing more) to the token budget and the blocks the step
        leaves free, and trims the proposals to them."""
        batch = len(plan.decode)
        budget = self.params.max_batch_tokens - plan.num_tokens
        decode_blocks = sum(self.blocks.blocks_needed(r.id, 1) for r in plan.decode)
        free = self.blocks.num_free - decode_blocks - sum(self.blocks.blocks_needed(r.id, n)
                                                          for r, n in plan.prefill)

        def fits(rows: int) -> bool:  # each decode row `rows` tokens wide
            return batch * (rows - 1) <= budget and sum(
                self.blocks.blocks_needed(r.id, rows) for r in plan.decode) - decode_blocks <= free
        while width > 1 and not fits(width + extra):
            width -= 1
        runs = width > 1 or (probes_alone and extra > 0 and fits(1 + extra))
        plan.width = width + extra if runs else 1
        plan.proposals = {i: proposal.first(width - 1) for i, proposal in plan.proposals.items() if runs}

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the queue, to be recomputed."""
        self.release(request)
        request.status, request.num_computed = Status.WAITING, 0
        request.preemptions += 1
        self.waiting.appendleft(request)
        self.events.append(PreemptEvent(step=self.step, t=self.clock(), seq=request.id,
                                        reason="out of KV blocks: the newest running request is recomputed later"))

    def release(self, request: Request) -> None:
        """Free a running request's blocks; it no longer runs."""
        freed = self.blocks.length(request.id)
        self.blocks.free(request.id)
        self.paused(request)
        self.running.remove(request)
        self.events.append(KVFreeEvent(step=self.step, t=self.clock(), seq=request.id,
                                       num_tokens=freed, **self._bytes()))

    def _bytes(self) -> dict[str, int]:
        memory = self.memory()
        return {"bytes_used": memory.bytes_used, "bytes_reserved": memory.bytes_reserved}
