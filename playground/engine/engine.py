"""A continuous-batching engine over a paged (or, one request at a time, contiguous) KV cache; every accelerated
algorithm is its proposer.

`add_request` queues a prompt with its own sampling settings; every `step()` reads schedule (`scheduler.py`) ->
propose (the proposer's token trees, trimmed to the one width that commits the most expected tokens per unit of this
machine's measured forward cost, as the planner prices it) -> verify (`runner.py`, one forward) -> accept
(`sampling.accept`: each token drawn as plain decoding draws it, so greedy and seeded outputs are plain decoding's
whatever the batch and the proposer) -> commit (the kept path's KV stays, the rest is dropped). The planner
(`planner.py`) reads each step's record after it. Every step leaves a `MemoryEvent` in `events`; with `trace`, each
request also records its own trace (`tracing.py`). docs/architecture.md has the whole picture.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..config import ConfigError, EngineParams, GenerationParams, SamplingParams
from ..decoding.base import DecodeOutput, Stopper, encode_prompt, engine_cache
from ..decoding.costs import ForwardCosts, LiveCosts, OneRequest, forward_costs
from ..decoding.proposer import Outcome, Proposal, Proposer
from ..kv import blocks_for
from ..models import LoadedModel
from ..models.forwards import make_forwards
from ..sampling import PLAIN_DRAWS, Drawn, accept, argmax_rows, draws_ahead, make_generator
from ..threads import share
from ..trace import Event, MemoryEvent
from ..waits import to_device
from .planner import Planner, StepRecord
from .runner import Runner
from .scheduler import Request, Scheduler, Status, StepPlan
from .tracing import StepTimes, Tracer


def one_request_costs(target: LoadedModel) -> OneRequest:
    """What a one-request engine's decode forward costs by width on this machine, in one-token forwards (the curve
    the engine plans on, with its provenance): what reports quote when they say why a run drafted little."""
    return OneRequest(forward_costs(target.model, forwards=target.forwards))


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: its new tokens (none for an unfinished prefill; more than one when
    proposed tokens were kept) and, once finished, the final output, or the error that ended it alone."""

    id: int
    new_token_ids: list[int]
    finished: bool
    output: DecodeOutput | None = None
    error: str | None = None


class _Ahead(NamedTuple):
    """One group's draws made ahead on the device, before the step's one transfer: the requests (all the greedy ones,
    or one sampled one), their rows' tokens (N,) and probabilities (N,), their nodes' probabilities (C,), the probes'
    argmax (S,), and the generator's states (`Drawn`)."""

    requests: list[Request]
    tokens: torch.Tensor
    probs: torch.Tensor
    nodes: torch.Tensor
    probed: torch.Tensor
    states: tuple[torch.Tensor, ...]

    def pieces(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.probs, self.nodes, self.probed


@dataclass
class Drafts:
    """Every proposal verified so far, whoever made it, as vLLM's speculative-decoding counters count them: proposals
    (a request's step that verified any node), nodes verified, nodes kept, and how many were kept at each depth of
    the kept path (`accepted_at[j]`: steps that kept a node at depth j + 1)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at)


@dataclass
class ProposalCounts:
    """Nodes of one source verified so far: decode forwards that verified any, nodes verified, nodes kept."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0


class Engine:
    def __init__(self, target: LoadedModel, params: EngineParams | None = None, record_blocks: bool = True,
                 proposer: Proposer | None = None, trace: bool = False,
                 costs: ForwardCosts | LiveCosts | None = None) -> None:
        """`proposer`: what each step proposes (None: plain decoding; `decoding.registry.build_proposer` makes one);
        it is bound to this engine, dropping any state it held for another. `trace`: every request records its
        trace events (`Request.trace`), as `generate` does. `costs`: what forwards cost by width, which only a
        proposer's steps read (None: this machine's, measured once per machine and cached, corrected by the decode
        forwards every engine of the process runs: `LiveCosts`; a `ForwardCosts` given is kept as it is). Its
        planner (`planner.Planner`) decides how much each step verifies and reads each step's record after it."""
        self.target = target
        self.params = params or EngineParams()
        self.proposer = proposer
        self.cache = engine_cache(target.model, self.params)
        if self.proposer is not None:
            self.proposer.bind(self.params, self.cache)
        self.record_blocks = record_blocks
        self.requests: dict[int, Request] = {}
        self.events: list[Event] = []
        self.scheduler = Scheduler(self.params, self.cache.blocks, self.cache.memory, self.now, self._paused,
                                   self.events)
        forwards = make_forwards(target.model, self.cache, target.forwards, self.params.max_running,
                                 self.proposer.taps if self.proposer is not None else ())
        self.runner = Runner(target.model, self.cache, forwards)
        self.busy_s = 0.0  # seconds spent inside step(): the engine's clock
        self._step_started: float | None = None
        self._next_id = 0
        self.counts: dict[str, ProposalCounts] = {}  # source label -> its nodes verified so far
        self.drafts = Drafts()
        self.tracer = Tracer(target.tokenizer) if trace else None
        # draw every request's rows of a step at once (`_draws`): off the CPU, where each wait for the device costs
        self.draws_ahead = target.model.device.type != "cpu"
        if costs is None and self.proposer is not None:
            costs = forward_costs(target.model, forwards=target.forwards, requests=self.params.max_running)
        self.costs: ForwardCosts | LiveCosts | None = costs
        self.planner = Planner(costs, self.params.plan == "as-set", proposer) if costs is not None else None

    def rests(self) -> tuple[int, int] | None:
        """How often drafting rested in this engine and for how many steps (`Planner.rests`); None where it is not
        judged."""
        return self.planner.rests() if self.planner is not None else None

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Request]:
        return list(self.scheduler.waiting)

    @property
    def step_count(self) -> int:
        return self.scheduler.step

    # -- requests ----------------------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                    generation: GenerationParams | None = None) -> int:
        """Queue a prompt (text, wrapped in the chat template unless generation.raw, or token ids); its id."""
        sampling = sampling or SamplingParams()
        generation = generation or GenerationParams()
        vocab = self.target.model.config.vocab_size
        if isinstance(prompt, str):
            prompt_ids = encode_prompt(self.target, prompt, generation)
        else:
            prompt_ids = list(prompt)
            if not prompt_ids or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
                raise ConfigError(f"prompt ids must be a non-empty list of token ids in [0, {vocab - 1}]")
        need = blocks_for(len(prompt_ids) + generation.max_new_tokens, self.params.block_size)
        if need > self.params.num_blocks:
            raise ConfigError(f"num_blocks must be >= {need} for a request of {len(prompt_ids)} prompt tokens and "
                              f"max_new_tokens {generation.max_new_tokens} (block_size "
                              f"{self.params.block_size}); the pool has {self.params.num_blocks}")
        request = Request(self._next_id, prompt_ids, sampling, generation,
                          make_generator(sampling.seed, self.target.model.device),
                          Stopper(self.target.tokenizer, self.target.eos_token_ids, generation), arrival_t=self.now(),
                          trace=[] if self.tracer is not None else None)
        self._next_id += 1
        if self.proposer is not None:
            self.proposer.start(request)
        self.requests[request.id] = request
        self.scheduler.add(request)
        return request.id

    def abort(self, request_id: int) -> None:
        """Stop a request now, waiting or running, and free its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no request {request_id}")
        if request.status is Status.WAITING:
            self.scheduler.waiting.remove(request)
        elif request.status is Status.RUNNING:
            self.scheduler.release(request)
        else:
            return
        self._end(request, Status.ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def forget(self, request_id: int) -> None:
        """Drop a finished or aborted request's record, so that a long-running server does not keep them all."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no request {request_id}")
        if request.status in (Status.WAITING, Status.RUNNING):
            raise ValueError(f"request {request_id} is {request.status.value}: abort it first")
        del self.requests[request_id]

    def close(self) -> None:
        """Done with this engine: what its static forwards built (storage, CUDA graphs) may serve the next engine on
        the model (`models.forwards`). Also done when the engine is collected."""
        self.runner.forwards.release()

    def take_events(self) -> list[Event]:
        """The events recorded since the last call, handed over and no longer kept."""
        events = list(self.events)
        self.events.clear()
        return events

    # -- the engine step ---------------------------------------------------------------------------------------

    def now(self) -> float:
        """Engine time: seconds spent inside `step()`, never the caller's time between steps. It never waits for
        the device: a step's times are read where its work has come back (a proposer reads its guesses, the step
        its draws), so that a step waits for the device once."""
        if self._step_started is None:
            return self.busy_s
        return self.busy_s + time.perf_counter() - self._step_started

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, propose, verify, accept and commit one step; the outputs of every request that advanced."""
        if self.target.model.device.type == "cpu":
            share()  # one thread while other processes keep the processors busy (see `threads`)
        start = self.now()
        self._step_started = time.perf_counter()
        self.scheduler.step += 1
        try:
            plan = self.scheduler.schedule()  # schedule
            asked, drafted = self._propose(plan)  # propose
            proposed = self.now()
            logits, hidden = self.runner.run(plan)  # verify: one forward for every request
            pool = self._pool()  # as the forward held it, before the step's finished requests release theirs
            drawn = self._draws(plan, logits)  # off the CPU, the step's wait for the device
            verified = self.now()
            times = StepTimes(start, proposed, verified)
            outputs = self._accept(plan, logits, hidden, drawn, times)  # accept, then commit, request by request
            self._record(plan, asked, drafted, times, outputs, pool)  # what the planner and the memory view read
        finally:
            self.busy_s = self.now()
            self._step_started = None
        return outputs

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding outputs as they come."""
        while self.has_unfinished():
            yield from self.step()

    def run_all(self) -> dict[int, DecodeOutput]:
        """Step to the end; the final output of every request (RuntimeError when one of them failed)."""
        outputs = {}
        for out in self.stream():
            if out.error is not None:
                raise RuntimeError(f"request {out.id} failed: {out.error}")
            if out.finished:
                assert out.output is not None  # a finished request's output is whole
                outputs[out.id] = out.output
        return outputs

    def _record(self, plan: StepPlan, asked: bool, drafted: bool, times: StepTimes, outputs: list[RequestOutput],
                pool: dict[str, Any]) -> None:
        """After the step: its record to the planner (what it teaches the next steps' plans) and its memory event."""
        if self.planner is not None:
            self.planner.observe(StepRecord(
                asked, drafted, bool(plan.decode) and not plan.prefill, plan.num_tokens, len(plan.decode),
                times.verified - times.proposed, self.now() - times.start,
                sum(len(out.new_token_ids) for out in outputs)))
        self._record_memory(plan.num_tokens, times.start, pool)

    def _propose(self, plan: StepPlan) -> tuple[bool, bool]:
        """The proposer's candidates for each decoding request, and the decode rows' width that pays most (as its
        planner prices forwards); whether the proposer was asked, and whether it proposed anything (whatever of it
        the width keeps: a proposal made was paid for)."""
        planner = self.planner
        if self.proposer is None or not plan.decode or planner is None or not planner.asks():
            return False, False
        cost = planner.cost(len(plan.decode), self.runner.forwards.max_width or math.inf)
        plan.proposals = self.proposer.propose(plan.decode, [r.room() for r in plan.decode], cost)
        extra = max((p.probes for p in plan.proposals.values()), default=0)  # run whatever the width
        gains = [plan.proposals[r.id].expected() if r.id in plan.proposals else [1.0] for r in plan.decode]
        proposed = any(p.tokens for p in plan.proposals.values())
        # probes run with no candidate too where they cost nothing more (as set): lookahead's window moves on
        self.scheduler.fit(plan, planner.width(gains, extra, cost), extra, probes_alone=cost(1 + extra) <= 1.0)
        sources = {s for p in plan.proposals.values() for s in p.sources[: p.candidates]}
        for source in sources:
            self.counts.setdefault(source, ProposalCounts()).steps += 1
        return True, proposed

    def _accept(self, plan: StepPlan, logits: dict[int, torch.Tensor], hidden: dict[int, torch.Tensor],
                drawn: dict[int, Drawn], times: StepTimes) -> list[RequestOutput]:
        outputs = []
        prefilled = {r.id for r, _ in plan.prefill}
        for request, n in [(r, 1) for r in plan.decode] + plan.prefill:
            request.num_computed += n
            states = hidden[request.id]
            if request.id in prefilled:  # every row's state goes to the proposer, the last one's on
                if self.proposer is not None:
                    self.proposer.prefilled(request, states)
                states = states[-1:]
            if request.num_computed < len(request.tokens):
                continue  # a prefill chunk that has not reached the end of the known tokens
            try:
                outputs.append(self._advance(request, plan.proposals.get(request.id), logits[request.id], states,
                                             times, drawn.get(request.id)))
            except Exception as exc:  # this request's sampling or detokenizing failed: it ends, the others go on
                if request in self.running:
                    self.scheduler.release(request)
                self._end(request, Status.FAILED)
                outputs.append(RequestOutput(request.id, [], True, error=f"{type(exc).__name__}: {exc}"))
        return outputs

    def _draws(self, plan: StepPlan, logits: dict[int, torch.Tensor]) -> dict[int, Drawn]:
        """Where `draws_ahead`, every draw of this step's walks (its decoding requests' and those of prefills that
        reach their end) made at once (`sampling.draws_ahead`) and read back in one transfer: greedy rows of every
        request together, each sampled request's rows with its own generator (their walks rewind it). Sampled
        requests whose proposals carry distributions (a draft's q, typical acceptance) draw as their rules go. This
        is the step's one wait for the device, and the end of its verifying time (`Engine.now` never waits); with
        nothing to draw ahead it waits for the forward all the same. On the CPU each row is drawn when the walk
        reaches it: the native row maxima are quick, and drawing the rows off the kept path would cost more than it
        saves."""
        if not self.draws_ahead:
            return {}
        requests = plan.decode + [r for r, n in plan.prefill if r.num_computed + n >= len(r.tokens)]
        proposals = plan.proposals
        greedy = [r for r in requests if r.sampling.greedy]
        parts: list[_Ahead] = []
        if greedy:
            token, prob, nodes, _ = draws_ahead(torch.cat([logits[r.id] for r in greedy]), greedy[0].sampling, None,
                                                cells=self._cells(greedy, proposals, logits))
            parts.append(_Ahead(greedy, token, prob, nodes, token[:0], ()))
        for r in requests:
            proposal = proposals.get(r.id)
            if r.sampling.greedy or proposal is not None and not proposal.rule.plain:  # drawn as its rule goes
                continue
            depths = [0]
            for parent in proposal.verified().parents if proposal is not None else []:  # node i + 1: row parents[i]
                depths.append(depths[parent] + 1)
            rows = logits[r.id]
            token, prob, nodes, states = draws_ahead(rows[: len(depths)], r.sampling, r.generator, depths,
                                                     self._cells([r], proposals, logits))
            probed = rows[len(depths) :].argmax(-1) if len(rows) > len(depths) else token[:0]  # (S,)
            parts.append(_Ahead([r], token, prob, nodes, probed, states))
        if not parts:
            if self.target.model.device.type == "cuda":
                torch.cuda.synchronize()
            return {}
        # one transfer, the step's one wait for the device (float64 holds the tokens and probabilities exactly)
        values = torch.cat([piece.double() for part in parts for piece in part.pieces() if len(piece)]).tolist()
        drawn, at = {}, 0
        for part in parts:
            split = []  # tokens, probabilities, nodes' probabilities, probes' argmax, read back
            for piece in part.pieces():
                split.append(values[at : at + len(piece)])
                at += len(piece)
            got_tokens, got_probs, got_nodes, got_probed = split
            row = node = 0
            for r in part.requests:
                proposal = proposals.get(r.id)
                k = proposal.candidates if proposal is not None else 0
                count = len(logits[r.id]) if r.sampling.greedy else len(got_tokens)
                mine = [int(t) for t in got_tokens[row : row + count]]
                drawn[r.id] = Drawn(mine, got_probs[row : row + count], part.states, got_nodes[node : node + k],
                                    mine[1 + k :] if r.sampling.greedy else [int(t) for t in got_probed])
                row, node = row + count, node + k
        return drawn

    def _cells(self, group: list[Request], proposals: dict[int, Proposal],
               logits: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """Each proposed node's (row, token) among the rows of `group`'s logits stacked (2, C): the probabilities the
        trace shows for refused nodes, drawn with the rest (None: no node)."""
        rows, tokens, offset = [], [], 0
        for r in group:
            proposal = proposals.get(r.id)
            if proposal is not None:
                verified = proposal.verified()
                rows += [offset + parent for parent in verified.parents]
                tokens += verified.tokens
            offset += len(logits[r.id])
        return to_device([rows, tokens], self.target.model.device) if rows else None

    def _advance(self, request: Request, proposal: Proposal | None, logits: torch.Tensor, hidden: torch.Tensor,
                 times: StepTimes, drawn: Drawn | None = None) -> RequestOutput:
        """One request's end of the step, in its phases: accept (its new tokens drawn along the proposal), the
        proposer told what was kept, commit (the kept path's KV), then its trace and output."""
        verified = proposal.verified() if proposal is not None else None  # its candidates, without its probes
        outcome, read = self._judge(request, verified, proposal.probes if proposal else 0, logits, hidden, drawn)
        if verified is not None:
            self._count(verified, outcome.path)
        if self.proposer is not None:
            self.proposer.observe(request, proposal, outcome)
        self._commit(request, verified, outcome)
        width = 1 + len(proposal.tokens) if proposal is not None else 1
        return self._report(request, verified, width, outcome, read, times, drawn)

    def _judge(self, request: Request, proposal: Proposal | None, probes: int, logits: torch.Tensor,
               hidden: torch.Tensor, drawn: Drawn | None) -> tuple[Outcome, torch.Tensor]:
        """Accept: the request's new tokens drawn from its rows of the step's logits as the proposal's rule judges
        them (or read from the draws made beforehand: `drawn`), up to a stop; `proposal` its candidates, the
        `probes` rows after them read for their greedy tokens; the outcome and the rows read."""
        tokens, parents = (proposal.tokens, proposal.parents) if proposal is not None else ([], [])
        read = logits[: 1 + len(tokens)]
        new, walk, probs, done = [], [], [], False
        rule = proposal.rule if proposal else PLAIN_DRAWS
        for row, token, p in accept(read, tokens, parents, request.sampling, request.generator, rule, drawn):
            new.append(token)
            walk.append(row)
            probs.append(p)
            done = request.stopper.push(token)
            if done:
                break
        if drawn is not None:
            drawn.rewind(request.generator, len(new))
        probed = []
        if probes:  # the greedy token after each probe
            probed = list(drawn.probed) if drawn is not None else argmax_rows(logits[1 + len(tokens) :])
        return Outcome(new, walk, probs, done, hidden, probed), read

    def _commit(self, request: Request, proposal: Proposal | None, outcome: Outcome) -> None:
        """Commit: the kept path's keys and values move next to the last token, the rest of the step's rows go (a
        finished request's all go when it is released)."""
        if outcome.done:
            return
        if proposal is not None:
            self.cache.keep(request.id, request.num_computed - 1, [0, *outcome.path])
        if self.cache.length(request.id) > request.num_computed + len(outcome.path):
            self.cache.truncate(request.id, request.num_computed + len(outcome.path))  # a row's padding

    def _report(self, request: Request, proposal: Proposal | None, width: int, outcome: Outcome,
                read: torch.Tensor, times: StepTimes, drawn: Drawn | None) -> RequestOutput:
        """The step's trace events (its proposal's candidates, its forward `width` rows, probes included) and output
        of a request; a finished one is released, another moves on."""
        now = self.now()
        if request.trace is not None and self.tracer is not None:
            request.trace += self.tracer.step(request, proposal, width, outcome, read, times, now,
                                              self.cache.memory(), drawn)
        if request.first_token_t is None:
            request.first_token_t = now
        else:
            request.decode_steps += 1
        if outcome.done:
            self.scheduler.release(request)
            self._end(request, Status.FINISHED)
            if request.trace is not None and self.tracer is not None:
                request.trace.append(self.tracer.finish(request, now))
            return RequestOutput(request.id, outcome.new, True, request.stopper.output(now - request.arrival_t))
        request.num_computed += len(outcome.path)
        return RequestOutput(request.id, outcome.new, False)

    def _count(self, proposal: Proposal, path: list[int]) -> None:
        """The counts of a proposal's candidates verified and kept."""
        for source in proposal.sources:
            self.counts[source].proposed += 1
        for row in path:
            self.counts[proposal.sources[row - 1]].accepted += 1
        if proposal.tokens:
            drafts = self.drafts
            drafts.drafts += 1
            drafts.draft_tokens += len(proposal.tokens)
            drafts.accepted_at.extend([0] * (len(path) - len(drafts.accepted_at)))
            for depth in range(len(path)):
                drafts.accepted_at[depth] += 1

    def _paused(self, request: Request) -> None:
        if self.proposer is not None:
            self.proposer.pause(request)

    def _end(self, request: Request, status: Status) -> None:
        request.status, request.finish_t = status, self.now()
        if self.proposer is not None:
            self.proposer.end(request)

    # -- memory ------------------------------------------------------------------------------------------------

    def _pool(self) -> dict[str, Any]:
        """The paged pool's figures as `MemoryEvent` carries them, now."""
        memory = self.cache.memory()
        per_token = memory.bytes_per_token
        owners, shared = (self.cache.blocks.block_map() if self.record_blocks else None) or ([], [])
        return dict(blocks_total=memory.blocks_total, blocks_used=memory.blocks_used, bytes_used=memory.bytes_used,
                    bytes_reserved=memory.bytes_reserved,
                    logical_bytes=sum(self.cache.length(r.id) for r in self.running) * per_token,
                    contiguous_bytes=sum(r.max_len for r in self.running) * per_token,
                    owners=owners, shared=shared, running=[r.id for r in self.running],
                    waiting=[r.id for r in self.scheduler.waiting])

    def _record_memory(self, num_tokens: int, start: float, pool: dict[str, Any]) -> None:
        """A step's memory event: the pool as its forward held it (`_pool`), so that a step whose requests all
        finished still shows what it ran on, not the empty pool it left for the next one."""
        now = self.now()
        self.events.append(MemoryEvent(step=self.step_count, t=now, num_tokens=num_tokens, wall_s=now - start,
                                       block_size=self.params.block_size, **pool))
