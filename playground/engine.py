"""A continuous-batching serving engine over the paged KV cache.

`add_request` queues a prompt with its own sampling settings; every `step()` does three things:
schedule (first-come first-served: running requests first, then waiting ones while the token budget, the
running limit and the free blocks allow; a waiting request whose prompt blocks a running request is computing
right now waits until they are written and shares them), run (one batched forward over every request that has
one token to compute, and one forward per prefill chunk, so a step mixes prefills and decodes), and postprocess (each
request whose tokens are all computed draws its next token from its own random stream; finished requests
release their blocks). When a running request needs a block and none is free, the newest running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed (prompt and
generated tokens, one prefill) when there is room again.

With `EngineParams.lookup` (prompt lookup in the batch) each decoding request may also have a copy of earlier text
(`find_continuations`) verified in the same forward: the decode rows grow to one width (the last token, the copy,
padding after it), chosen for the most expected tokens per unit of forward cost (`plan_width`, `batch_step_cost`)
within the token budget and the free blocks left after scheduling, so copies never delay or preempt a request.
Postprocess then draws each row's token as plain decoding would (argmax, or a sample from the request's own stream)
and moves on to the next row only while the drawn token equals the copied one (`sampling.draws_along`, the lossless
rule for one-hot proposals), so greedy and seeded outputs are those of plain decoding, token for token, whatever
the batch.

Every step leaves a `MemoryEvent` (block map, bytes, fragmentation, contiguous counterfactual) and
preemptions leave `PreemptEvent`s in `events`, which the UI's memory tab and the serving benchmark read.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from .config import ConfigError, EngineParams, GenerationParams, SamplingParams
from .decoding.base import DecodeOutput, Stopper, encode_prompt, paged_cache
from .decoding.prompt_lookup import Lookup, ProposalGate, agreement, batch_step_cost, find_continuations, plan_width
from .kv import blocks_for
from .models import LoadedModel
from .sampling import draws_along, make_generator
from .trace import Event, KVAllocEvent, KVFreeEvent, MemoryEvent, PreemptEvent


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


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
    copy_acceptance: ProposalGate | None = None  # per matched n-gram length, how well its copies do (prompt lookup)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.stopper.tokens

    @property
    def max_len(self) -> int:
        return len(self.prompt_ids) + self.generation.max_new_tokens


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: its new tokens (none for an unfinished prefill; more than one when a
    copy was accepted) and, once finished, the final output."""

    id: int
    new_token_ids: list[int]
    finished: bool
    output: DecodeOutput | None = None


@dataclass
class CopyCounts:
    """Prompt lookup in the batch so far: decode forwards that verified copies, copied tokens verified, accepted."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)  # one token each (and its copy), run as one batch
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    width: int = 1  # tokens per decode row: the last token, then copies padded to one length
    copies: dict[int, Lookup] = field(default_factory=dict)  # request id -> its copy, at most width - 1 tokens

    @property
    def num_tokens(self) -> int:
        return len(self.decode) * self.width + sum(n for _, n in self.prefill)


class Engine:
    def __init__(self, target: LoadedModel, params: EngineParams | None = None, record_blocks: bool = True) -> None:
        self.target = target
        self.params = params or EngineParams()
        self.cache = paged_cache(target.model, self.params.num_blocks, self.params.block_size)
        self.record_blocks = record_blocks
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.events: list[Event] = []
        self.busy_s = 0.0  # seconds spent inside step(): the engine's clock
        self._step_started: float | None = None
        self.step_count = 0
        self._next_id = 0
        # One copy per request, as long as one fits a pass of the CPU kernel at batch 1; wider batches trim it.
        lookup = self.params.lookup
        self.lookup = None if lookup is None else replace(lookup, branches=1).resolve(target.model.rows_per_pass)
        self.copied = CopyCounts()

    # -- requests ----------------------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                    generation: GenerationParams | None = None) -> int:
        """Queue a prompt (text, wrapped in the chat template unless generation.raw, or token ids); its id."""
        sampling = sampling or SamplingParams()
        generation = generation or GenerationParams()
        if isinstance(prompt, str):
            prompt_ids = encode_prompt(self.target, prompt, generation)
        else:
            prompt_ids = list(prompt)
            if not prompt_ids or not all(isinstance(t, int) and 0 <= t < self.target.model.config.vocab_size
                                         for t in prompt_ids):
                raise ConfigError(f"prompt ids must be a non-empty list of token ids in "
                                  f"[0, {self.target.model.config.vocab_size - 1}]")
        need = blocks_for(len(prompt_ids) + generation.max_new_tokens, self.params.block_size)
        if need > self.params.num_blocks:
            raise ConfigError(f"num_blocks must be >= {need} for a request of {len(prompt_ids)} prompt tokens and "
                              f"max_new_tokens {generation.max_new_tokens} (block_size "
                              f"{self.params.block_size}); the pool has {self.params.num_blocks}")
        request = Request(self._next_id, prompt_ids, sampling, generation,
                          make_generator(sampling.seed, self.target.model.device),
                          Stopper(self.target.tokenizer, self.target.eos_token_ids, generation),
                          arrival_t=self.now(),
                          copy_acceptance=None if self.lookup is None else ProposalGate(0.0, self.lookup.max_ngram))
        self._next_id += 1
        self.requests[request.id] = request
        self.waiting.append(request)
        return request.id

    def abort(self, request_id: int) -> None:
        """Stop a request now, waiting or running, and free its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no request {request_id}")
        if request.status is Status.WAITING:
            self.waiting.remove(request)
        elif request.status is Status.RUNNING:
            self._release(request)
        else:
            return
        request.status = Status.ABORTED
        request.finish_t = self.now()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def forget(self, request_id: int) -> None:
        """Drop a finished or aborted request's record, so that a long-running server does not keep them all."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no request {request_id}")
        if request.status in (Status.WAITING, Status.RUNNING):
            raise ValueError(f"request {request_id} is {request.status.value}: abort it first")
        del self.requests[request_id]

    def take_events(self) -> list[Event]:
        """The events recorded since the last call, handed over and no longer kept."""
        events, self.events = self.events, []
        return events

    # -- the engine step ---------------------------------------------------------------------------------------

    def now(self) -> float:
        """Engine time: seconds spent inside `step()`, never the caller's time between steps."""
        if self._step_started is None:
            return self.busy_s
        if self.target.model.device.type == "cuda":
            torch.cuda.synchronize()  # GPU work is asynchronous: time it when it has really finished
        return self.busy_s + time.perf_counter() - self._step_started

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run and postprocess one step; the outputs of every request that advanced."""
        start = self.now()
        self._step_started = time.perf_counter()
        self.step_count += 1
        try:
            plan = self._schedule()
            if self.lookup is not None:
                self._propose(plan)
            logits = self._run(plan)
            outputs = self._postprocess(plan, logits)
            self._record_memory(plan.num_tokens, start)
        finally:
            self.busy_s = self.now()
            self._step_started = None
        return outputs

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding outputs as they come."""
        while self.has_unfinished():
            yield from self.step()

    def run_all(self) -> dict[int, DecodeOutput]:
        """Step to the end; the final output of every request that finished."""
        return {out.id: out.output for out in self.stream() if out.finished}

    def _schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.params.max_batch_tokens
        reserved = 0  # free blocks the planned forwards will take
        for request in list(self.running):
            if request.status is not Status.RUNNING or budget == 0:
                continue
            n = min(len(request.tokens) - request.num_computed, budget)
            need = self.cache.blocks_needed(request.id, n)
            while need > self.cache.num_free_blocks - reserved:
                victim = self.running[-1]  # the newest: never one already planned, those are older
                self._preempt(victim)
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
            cached_blocks, promised_blocks = self.cache.prefix_blocks(prompt)
            if promised_blocks > cached_blocks and not static:
                # A running request is computing blocks of this prompt right now (requests arriving together share
                # a system prompt): admit it once they are written and share them instead of computing them twice.
                # A static batch is formed whole instead: waiting would shrink it.
                break
            cached = self.cache.add_sequence(request.id, prompt)
            n = min(len(request.tokens) - cached, budget)
            need = self.cache.blocks_needed(request.id, n)
            # Leave a block per running request so they can all grow next step without preempting this one.
            if need + len(self.running) > self.cache.num_free_blocks - reserved:
                self.cache.free(request.id)
                break
            reserved += need
            self.waiting.popleft()
            request.status, request.num_computed = Status.RUNNING, cached
            self.running.append(request)
            self.events.append(KVAllocEvent(step=self.step_count, t=self.now(), seq=request.id,
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

    def _propose(self, plan: StepPlan) -> None:
        """Prompt lookup: a copy of earlier text for each decoding request, and the decode rows' width, within the
        token budget and the blocks the step leaves free."""
        lookup, batch = self.lookup, len(plan.decode)
        if not batch:
            return
        for request in plan.decode:
            request.copy_acceptance.decay()
        rows_per_pass = self.target.model.rows_per_pass

        def cost(width: int) -> float:
            return batch_step_cost(rows_per_pass, batch, width, lookup.verify_overhead)
        # The search scans each request's whole text: skip it when no copy could pay, not even one of the longest
        # length at each request's best acceptance so far (on a CPU, at batches of 16 or so).
        bound = [[r.copy_acceptance.best_expected_tokens(k) for k in range(lookup.num_draft + 1)] for r in plan.decode]
        if plan_width(bound, cost) == 1:
            return
        eos_ids = frozenset(self.target.eos_token_ids)
        gains = []
        for request in plan.decode:
            # The step commits the copy's accepted tokens and one more: a longer copy could only be thrown away.
            room = request.generation.max_new_tokens - len(request.stopper.tokens) - 1
            found = find_continuations(request.tokens, lookup.max_ngram, min(lookup.num_draft, room), eos_ids) \
                if room > 0 else []
            if not found:
                gains.append([1.0])
                continue
            copy = plan.copies[request.id] = found[0]
            gains.append([request.copy_acceptance.expected_tokens(copy.ngram, k) for k in range(len(copy.tokens) + 1)])
        width = plan_width(gains, cost)
        budget = self.params.max_batch_tokens - plan.num_tokens
        decode_blocks = sum(self.cache.blocks_needed(r.id, 1) for r in plan.decode)
        free = self.cache.num_free_blocks - decode_blocks - sum(self.cache.blocks_needed(r.id, n)
                                                                for r, n in plan.prefill)
        while width > 1 and (batch * (width - 1) > budget or sum(
                self.cache.blocks_needed(r.id, width) for r in plan.decode) - decode_blocks > free):
            width -= 1
        plan.width = width
        plan.copies = {i: replace(copy, tokens=copy.tokens[: width - 1])
                       for i, copy in plan.copies.items() if width > 1}

    def _run(self, plan: StepPlan) -> dict[int, torch.Tensor]:
        """The forwards of a step; for every request that ran, logits (1 + n, V) at its last token and after each
        of the n tokens of its copy (n = 0 without one)."""
        model, device = self.target.model, self.target.model.device
        logits: dict[int, torch.Tensor] = {}
        if plan.decode and plan.width == 1:
            ids = torch.tensor([[r.tokens[r.num_computed]] for r in plan.decode], device=device)  # (B, 1)
            positions = torch.tensor([[r.num_computed] for r in plan.decode], device=device)  # (B, 1)
            out, _ = model(ids, positions, self.cache, [r.id for r in plan.decode], num_logits=1)  # (B, 1, V)
            logits.update((r.id, out[i]) for i, r in enumerate(plan.decode))
        elif plan.decode:
            width, chains = plan.width, []
            for r in plan.decode:
                copy = plan.copies.get(r.id)
                chains.append([r.tokens[r.num_computed], *(copy.tokens if copy else ())])
            # Padding after a chain is causal: the chain never sees it, and its KV is dropped after the step.
            ids = torch.tensor([c + c[-1:] * (width - len(c)) for c in chains], device=device)  # (B, W)
            positions = torch.tensor([[r.num_computed + j for j in range(width)] for r in plan.decode],
                                     device=device)  # (B, W)
            _, hidden = model(ids, positions, self.cache, [r.id for r in plan.decode], num_logits=0)  # (B, W, E)
            rows = torch.tensor([i * width + j for i, c in enumerate(chains) for j in range(len(c))], device=device)
            scored = model.project(hidden.flatten(0, 1).index_select(0, rows))  # (N, V): the chains' rows only
            offset = 0
            for r, chain in zip(plan.decode, chains):
                logits[r.id] = scored[offset : offset + len(chain)]
                offset += len(chain)
        for request, n in plan.prefill:
            start = request.num_computed
            ids = torch.tensor([request.tokens[start : start + n]], device=device)  # (1, n)
            positions = torch.arange(start, start + n, device=device).unsqueeze(0)  # (1, n)
            out, _ = model(ids, positions, self.cache, [request.id], num_logits=1)  # (1, 1, V)
            logits[request.id] = out[0]
        return logits

    def _postprocess(self, plan: StepPlan, logits: dict[int, torch.Tensor]) -> list[RequestOutput]:
        outputs = []
        if plan.copies:
            self.copied.steps += 1
        for request, n in [(r, 1) for r in plan.decode] + plan.prefill:
            request.num_computed += n
            if request.num_computed < len(request.tokens):
                continue  # a prefill chunk that has not reached the end of the known tokens
            copy = plan.copies.get(request.id)
            proposed = copy.tokens if copy else []
            new, done = [], False
            for token in draws_along(logits[request.id], proposed, request.sampling, request.generator):
                new.append(token)
                done = request.stopper.push(token)
                if done:
                    break
            # the copied tokens kept: those the draws before the last one confirmed
            accepted = agreement(proposed, new[:-1])
            if copy:
                judged = min(accepted + 1, len(proposed))
                request.copy_acceptance.record(copy.ngram, accepted, judged)
                self.copied.proposed += len(proposed)
                self.copied.accepted += accepted
            now = self.now()
            if request.first_token_t is None:
                request.first_token_t = now
            if not done:
                request.num_computed += accepted
                if self.cache.length(request.id) > request.num_computed:
                    self.cache.truncate(request.id, request.num_computed)  # drop the refused copy and the padding
                outputs.append(RequestOutput(request.id, new, False))
                continue
            self._release(request)
            request.status, request.finish_t = Status.FINISHED, now
            outputs.append(RequestOutput(request.id, new, True, request.stopper.output(now - request.arrival_t)))
        return outputs

    # -- memory ------------------------------------------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the queue, to be recomputed."""
        self._release(request)
        request.status, request.num_computed = Status.WAITING, 0
        request.preemptions += 1
        self.waiting.appendleft(request)
        self.events.append(PreemptEvent(step=self.step_count, t=self.now(), seq=request.id,
                                        reason="out of KV blocks: the newest running request is recomputed later"))

    def _release(self, request: Request) -> None:
        freed = self.cache.length(request.id)
        self.cache.free(request.id)
        self.running.remove(request)
        self.events.append(KVFreeEvent(step=self.step_count, t=self.now(), seq=request.id,
                                       num_tokens=freed, **self._bytes()))

    def _bytes(self) -> dict[str, int]:
        memory = self.cache.memory()
        return {"bytes_used": memory.bytes_used, "bytes_reserved": memory.bytes_reserved}

    def _record_memory(self, num_tokens: int, start: float) -> None:
        memory = self.cache.memory()
        per_token = memory.bytes_per_token
        owners = self.cache.block_owners() if self.record_blocks else []
        shared = [b for b, refs in enumerate(self.cache.allocator.refs) if refs > 1] if self.record_blocks else []
        now = self.now()
        self.events.append(MemoryEvent(
            step=self.step_count, t=now, num_tokens=num_tokens, wall_s=now - start,
            block_size=self.params.block_size, blocks_total=memory.blocks_total, blocks_used=memory.blocks_used,
            bytes_used=memory.bytes_used, bytes_reserved=memory.bytes_reserved,
            logical_bytes=sum(self.cache.length(r.id) for r in self.running) * per_token,
            contiguous_bytes=sum(r.max_len for r in self.running) * per_token,
            owners=owners, shared=shared, running=[r.id for r in self.running], waiting=[r.id for r in self.waiting]))
