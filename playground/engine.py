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
With `EngineParams.medusa` (Medusa heads in the batch) a request may instead have a tree of the heads' guesses
(Medusa's dynamic tree, `tree.best_first`, from the final hidden state of the row that predicted its last token),
run with its own tree mask among the batch's rows; with both, a request's copy is grafted onto its tree (worth
its running acceptance beside the heads' calibrated probabilities). With `EngineParams.draft` (a draft model in the
batch) a request's proposal is the draft's greedy chain instead (its runner-up at the first place a leaf beside it),
built as the heads' trees are: the draft runs batched over the requests on a paged cache of its own, first
reading what it has not seen of each request's tokens (the last token; the whole prompt the first time), then one
forward per drafted token. With `EngineParams.lookahead` (lookahead decoding in the batch, alone) each request keeps
a Jacobi window and n-gram pools of its own: its proposal is the pools' candidates merged into a tree, and its
window's rows run beside them in the same decode row under their own mask, their argmaxes its next window row.
Postprocess then draws each row's token as plain decoding would (argmax, or a sample from the request's own
stream) and moves on to the row of the proposed token equal to the draw, if any (`sampling.draws_along`, the
lossless rule for one-hot proposals, which copies, the heads' guesses and the draft's argmax chains all are), so
greedy and seeded outputs are those of plain decoding, token for token, whatever the batch. The kept path's KV
moves next to the last token (`keep`); the rest of the tree and the padding are dropped.

Every step leaves a `MemoryEvent` (block map, bytes, fragmentation, contiguous counterfactual) and
preemptions leave `PreemptEvent`s in `events`, which the UI's memory tab and the serving benchmark read.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import NamedTuple

import torch

from .config import LOOKUP_OVERHEAD, ConfigError, EngineParams, GenerationParams, SamplingParams, dynamic_nodes
from .decoding.base import DecodeOutput, Stopper, encode_prompt, paged_cache
from .decoding.lookahead import (TextPools, candidate_tree, first_window, jacobi_block, seed_pools, slide,
                                 start_pools)
from .decoding.copies import Lookup, agreement, find_continuations
from .decoding.planning import ProposalGate, RunningAcceptance, at, batch_step_cost, plan_width, widest_paying
from .decoding.speculative import check_compatible
from .decoding.tree import COPY_PRIOR, ancestor_mask, best_first
from .kv import blocks_for
from .models import LoadedModel
from .models.loader import load_draft
from .models.medusa import LoadedHeads, load_heads
from .models.transformer import Transformer
from .models.vocab import proposal_rows
from .sampling import argmax_rows, draws_along, make_generator
from .trace import Event, KVAllocEvent, KVFreeEvent, MemoryEvent, PreemptEvent


# A draft reads up to this many unseen tokens per request in one padded batched forward; more (a prompt) alone.
CATCH_UP = 4


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
    copy_acceptance: ProposalGate | None = None  # per matched n-gram length, how well its copies do (prompt lookup)
    hidden: torch.Tensor | None = None  # (E,) final hidden state of the row that predicted the last token (Medusa)
    drafted: list[int] = field(default_factory=list)  # tokens the draft read after the last token this step
    pools: TextPools | None = None  # lookahead: n-grams of the corpus, the prompt, the window and the output
    window: list[list[int]] | None = None  # lookahead: the Jacobi window, N - 1 rows of W guessed tokens
    pooled: int = 0  # lookahead: leading tokens whose n-grams are in the pools

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.stopper.tokens

    @property
    def max_len(self) -> int:
        return len(self.prompt_ids) + self.generation.max_new_tokens


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: its new tokens (none for an unfinished prefill; more than one when a
    copy was accepted) and, once finished, the final output, or the error that ended it alone."""

    id: int
    new_token_ids: list[int]
    finished: bool
    output: DecodeOutput | None = None
    error: str | None = None


@dataclass
class ProposalCounts:
    """Proposals of one kind (copies, or the guesses of the heads or the draft) verified in the batch so far: decode
    forwards that verified any, proposed tokens verified, accepted."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0


@dataclass(frozen=True, slots=True)
class Proposal:
    """Tokens to verify after a request's last token, as a tree in best-first order: token i sits in row i + 1 of
    the request's decode rows and follows the token of row parents[i] (0: the last token), every parent before
    its children, so that any leading part is a tree too. copied[i]: token i is a copy's (prompt lookup; ngram is
    the length of the copy's matched suffix), else a guess of the Medusa heads or the draft; probs[i]: the
    guesser's probability of token i (None for a token only the copy proposes; empty for a copy alone); keys[i]:
    lookahead's candidates (copied) only, the length of the key the candidate that proposed token i was found by."""

    tokens: list[int]
    parents: list[int]
    copied: list[bool]
    ngram: int | None = None
    probs: list[float | None] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)

    @classmethod
    def chain(cls, tokens: list[int], ngram: int) -> "Proposal":
        return cls(tokens, list(range(len(tokens))), [True] * len(tokens), ngram)

    def first(self, n: int) -> "Proposal":
        return replace(self, tokens=self.tokens[:n], parents=self.parents[:n], copied=self.copied[:n],
                       probs=self.probs[:n], keys=self.keys[:n])

    def is_chain(self) -> bool:
        return self.parents == list(range(len(self.tokens)))

    def depths(self) -> list[int]:
        """Each row's depth below the last token (row 0): its position's offset."""
        depths = [0]
        for parent in self.parents:
            depths.append(depths[parent] + 1)
        return depths


class TreeNode(NamedTuple):
    """A token of a request's proposal while its tree is built: log of its chance of being reached (`worth`), the
    key of the node it follows, its token, the heads' probability of it (None for the copy's own) and whether it is
    the copy's."""

    worth: float
    parent: object
    token: int
    prob: float | None
    copied: bool


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)  # one token each (and its proposal), run as one batch
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    width: int = 1  # tokens per decode row: the last token, then proposals (and windows) padded to one length
    proposals: dict[int, Proposal] = field(default_factory=dict)  # request id -> at most width - 1 tokens
    windows: dict[int, list[list[int]]] = field(default_factory=dict)  # request id -> its Jacobi window (lookahead)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) * self.width + sum(n for _, n in self.prefill)


class Engine:
    def __init__(self, target: LoadedModel, params: EngineParams | None = None, record_blocks: bool = True,
                 heads: LoadedHeads | None = None, draft: LoadedModel | None = None) -> None:
        """`heads`: Medusa heads already loaded for `params.medusa` (else loaded from `params.medusa.heads`);
        `draft`: a draft model already loaded for `params.draft` (else loaded from `params.draft.draft`)."""
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
        medusa = self.params.medusa
        self.heads = None if medusa is None else heads or load_heads(medusa.heads, target)
        self.depth = self.nodes = 0
        if self.heads is not None:
            self.depth = medusa.depth or self.heads.heads.num_heads
            if self.depth > self.heads.heads.num_heads:
                raise ConfigError(f"medusa.depth must be in [1, {self.heads.heads.num_heads}] (the heads' number), "
                                  f"got {self.depth}")
            self.nodes = medusa.nodes or dynamic_nodes(target.model.rows_per_pass,
                                                       target.model.device.type == "cuda")
        spec = self.params.draft
        self.draft = None if spec is None else draft or load_draft(spec.draft, target)
        if self.draft is not None:
            check_compatible(target, self.draft)
            self.draft_rows = proposal_rows(self.draft)  # the tokens the draft may propose; None: all of them
            # As large as the target's pool: a request's draft never holds more tokens than its target side.
            self.draft_cache = paged_cache(self.draft.model, self.params.num_blocks, self.params.block_size)
            self.depth, self.nodes = spec.gamma, spec.gamma + 1  # the chain and a runner-up at its first place
            self.draft_cost = spec.draft_cost if spec.draft_cost is not None else self._draft_cost()
        lookahead = self.params.lookahead
        self.lookahead = None if lookahead is None else lookahead.resolve(target.model.rows_per_pass)
        if self.lookahead is not None:
            _, self.pool_seeds = seed_pools(target, self.lookahead)  # every request's pools start as copies of these
        # what a wider forward costs where no kernel pass sizes it: the most cautious of the proposers' settings
        # (lookahead's, as prompt lookup's: its candidates are copies of earlier n-grams too)
        self.verify_overhead = max([p.verify_overhead for p in (self.lookup, medusa, spec) if p is not None]
                                   + [LOOKUP_OVERHEAD] * (lookahead is not None), default=0.0)
        self.copied = ProposalCounts()
        self.guessed = ProposalCounts()
        self.calibration = GuessCalibration(self.depth)

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
        la = self.lookahead
        if la is not None:
            # lookahead's acceptance per key length its candidates are found by
            request.copy_acceptance = ProposalGate(0.0, la.context)
            request.pools = start_pools(self.pool_seeds, la, prompt_ids)
            request.pooled = len(prompt_ids)
            request.window = first_window(prompt_ids, la, sampling.seed)
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
            if self.lookup is not None or self.depth or self.lookahead is not None:
                self._propose(plan)
            logits, hidden = self._run(plan)
            outputs = self._postprocess(plan, logits, hidden)
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
        """Step to the end; the final output of every request (RuntimeError when one of them failed)."""
        outputs = {}
        for out in self.stream():
            if out.error is not None:
                raise RuntimeError(f"request {out.id} failed: {out.error}")
            if out.finished:
                outputs[out.id] = out.output
        return outputs

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
        """A copy of earlier text, a tree of the heads' guesses or the draft's chain (with the copy grafted on), or
        lookahead's candidates and window, for each decoding request, and the decode rows' width, within the token
        budget and the blocks the step leaves free."""
        lookup, batch = self.lookup, len(plan.decode)
        if not batch:
            return
        if lookup is not None or self.lookahead is not None:
            for request in plan.decode:
                request.copy_acceptance.decay()
        rows_per_pass = self.target.model.rows_per_pass

        def cost(width: int) -> float:
            return batch_step_cost(rows_per_pass, batch, width, self.verify_overhead)
        if self.lookahead is not None:
            self._propose_lookahead(plan, cost)
            return
        # Bounds before any work: a copy at each request's best acceptance so far, a tree whose every depth is
        # reached as surely as the heads' calibrated guesses can be. The search scans each request's whole text:
        # skip it when no copy could pay (on a CPU, at batches of 16 or so); the heads guess only as many tokens
        # as could pay.
        rooms = [self._room(r) for r in plan.decode]
        copy_bounds = [[r.copy_acceptance.best_expected_tokens(k) for k in range(min(lookup.num_draft, room) + 1)]
                       if lookup is not None else [1.0] for r, room in zip(plan.decode, rooms)]
        sure = self.calibration.bound(self.depth)
        tree_bounds = [[sure[min(k, room, self.depth)] for k in range(self.nodes + 1)] if self._can_guess(r)
                       else [1.0] for r, room in zip(plan.decode, rooms)]
        search = plan_width(copy_bounds, cost) > 1
        longest = widest_paying([[max(at(c, k), at(t, k)) for k in range(max(len(c), len(t)))]
                                 for c, t in zip(copy_bounds, tree_bounds)], cost) - 1
        if not longest:
            return
        if self.heads is not None:
            guesses = self._guesses(plan.decode, min(longest, self.depth), min(longest, self.heads.vocab_size))
        elif self.draft is not None:
            # Drafted tokens cost draft forwards besides the wider verification: draft only as deep as the drafted
            # tokens' acceptance so far says pays for both.
            expected = self.calibration.expected_tokens(self.depth)
            depth = plan_width([expected[: min(room, self.depth) + 1] for room in rooms],
                               lambda width: cost(width) + (width - 1) * self.draft_cost) - 1
            guesses = self._draft_chains([r for r, room in zip(plan.decode, rooms) if room > 0], min(longest, depth))
        else:
            guesses = {}
        eos_ids = frozenset(self.target.eos_token_ids)
        gains = []
        for request, room in zip(plan.decode, rooms):
            n = min(longest, room)  # a longer copy could only be thrown away
            found = find_continuations(request.tokens, lookup.max_ngram, min(lookup.num_draft, n), eos_ids) \
                if search and n > 0 else []
            copy = found[0] if found else None
            # expected: the tokens the step is expected to commit with the proposal's first k tokens, k = 0..
            if request.id in guesses and room > 0:
                logp, tokens = guesses[request.id]
                rate = request.copy_acceptance.acceptance(copy.ngram) if copy else None
                proposal, expected = self._head_tree(logp[:room], tokens[:room], longest, eos_ids, copy, rate)
            elif copy:
                proposal = Proposal.chain(copy.tokens, copy.ngram)
                expected = [request.copy_acceptance.expected_tokens(copy.ngram, k) for k in range(len(copy.tokens) + 1)]
            else:
                gains.append([1.0])
                continue
            plan.proposals[request.id] = proposal
            gains.append(expected)
        self._fit(plan, plan_width(gains, cost))

    def _propose_lookahead(self, plan: StepPlan, cost: Callable[[int], float]) -> None:
        """Lookahead in the batch: each decoding request's candidates from its pools, merged into a tree, and its
        Jacobi window beside them, in a step whose expected tokens pay for the wider forward (the window's rows are
        paid for as they come: they feed the pools, not this step)."""
        la = self.lookahead
        extra = (la.ngram - 1) * la.window
        gains = []
        for request in plan.decode:
            room = self._room(request)
            if not room:
                gains.append([1.0])
                continue
            if la.output_pool:  # the answer's own phrases are likely to come back
                request.pools.add_text(request.tokens[: request.num_computed], request.pooled)
                request.pooled = request.num_computed
            plan.windows[request.id] = request.window
            found, keys = request.pools.candidates(request.tokens)
            tokens, parents, source = candidate_tree([c[:room] for c in found])
            if not tokens:
                gains.append([1.0])
                continue
            proposal = Proposal(tokens, parents, [True] * len(tokens), keys=[keys[c] for c in source])
            # A node of candidate c at depth d is reached with about a_c^d (a_c: the acceptance of candidates found
            # by c's key length); one of a later candidate only where the first was refused.
            rates = [request.copy_acceptance.acceptance(key) for key in keys]
            expected = [1.0]
            for c, depth in zip(source, proposal.depths()[1:]):
                expected.append(expected[-1] + rates[c] ** depth * (1.0 if c == 0 else 1.0 - rates[0]))
            plan.proposals[request.id] = proposal
            gains.append(expected)
        self._fit(plan, plan_width(gains, lambda width: cost(width + extra) if width > 1 else 1.0), extra)

    def _fit(self, plan: StepPlan, width: int, extra: int = 0) -> None:
        """Narrows the decode rows (the last token and width - 1 proposed tokens, then `extra` tokens of the rows'
        windows: none at width 1) to the token budget and the blocks the step leaves free, and trims the proposals
        to them."""
        batch = len(plan.decode)
        budget = self.params.max_batch_tokens - plan.num_tokens
        decode_blocks = sum(self.cache.blocks_needed(r.id, 1) for r in plan.decode)
        free = self.cache.num_free_blocks - decode_blocks - sum(self.cache.blocks_needed(r.id, n)
                                                                for r, n in plan.prefill)
        while width > 1 and (batch * (width - 1 + extra) > budget or sum(
                self.cache.blocks_needed(r.id, width + extra) for r in plan.decode) - decode_blocks > free):
            width -= 1
        plan.width = width + extra if width > 1 else 1
        plan.proposals = {i: proposal.first(width - 1) for i, proposal in plan.proposals.items() if width > 1}
        if width == 1:
            plan.windows = {}

    def _draft_cost(self) -> float:
        """A draft forward's cost over the target's, estimated: where the native CPU kernel runs the forwards they
        are bound by reading the weights (the layers' and the output rows scored), elsewhere (a GPU, PyTorch's
        kernels) by each layer's fixed work. The shipped draft: 0.025 and 4 / 30; measured on the 2-core EPYC,
        0.03 of the target's forward at batch 1 to 0.09 at batch 16."""
        draft, target = self.draft.model, self.target.model
        if target.rows_per_pass is None:
            return draft.config.num_layers / target.config.num_layers

        def weights(model: Transformer, output_rows: int) -> int:
            return sum(p.numel() for p in model.layers.parameters()) + output_rows * model.config.hidden_size
        rows = len(self.draft_rows) if self.draft_rows is not None else draft.config.vocab_size
        return weights(draft, rows) / weights(target, target.config.vocab_size)

    def _can_guess(self, request: Request) -> bool:
        """Whether the heads or the draft can propose for this request: the heads need the hidden state of a
        forward run since it was last admitted, the draft nothing."""
        return self.draft is not None or (self.heads is not None and request.hidden is not None)

    @staticmethod
    def _room(request: Request) -> int:
        """How deep a proposal may go: the step commits its accepted tokens and one more. None in a one-token chunk
        of a prompt that goes on (a token budget of one): its row predicts no new token."""
        if request.num_computed + 1 < len(request.tokens):
            return 0
        return max(0, request.generation.max_new_tokens - len(request.stopper.tokens) - 1)

    def _guesses(self, requests: list[Request], depth: int,
                 k: int) -> dict[int, tuple[list[list[float]], list[list[int]]]]:
        """The heads' top k guesses for each of the next `depth` tokens after each request's last token, best
        first, with their log-probabilities under each head's softmax: (D, k) lists for every request with a
        hidden state (one that has run a forward since it was last admitted)."""
        ready = [r for r in requests if r.hidden is not None]
        if not ready:
            return {}
        model = self.target.model
        hidden = torch.stack([r.hidden for r in ready])  # (B, E)
        last = torch.tensor([r.tokens[r.num_computed] for r in ready], device=model.device)  # (B,)
        logits = self.heads.logits(hidden, model.embed_tokens.weight[last], depth)  # (D, B, V')
        top = logits.log_softmax(-1).topk(k, dim=-1)  # values, indices: (D, B, k)
        logp = top.values.transpose(0, 1).tolist()  # (B, D, k)
        tokens = self.heads.vocab_ids[top.indices].transpose(0, 1).tolist()  # (B, D, k)
        return {r.id: (lp, t) for r, lp, t in zip(ready, logp, tokens)}

    def _draft_chains(self, requests: list[Request],
                      depth: int) -> dict[int, tuple[list[list[float]], list[list[int]]]]:
        """The draft's greedy chain of `depth` tokens after each request's last token, and its runner-up at the first
        place, with each token's log-probability under the draft's softmax, as (D, k) lists (k = 2 at the first
        place, else 1): the heads' guesses, so that `_head_tree` builds the chain (`best_first` with `chained`, the
        runner-up a leaf; a copy grafted on) as it builds their trees. The draft first reads what of the request's
        tokens it has not seen, always the last one: one padded forward for the requests with at most CATCH_UP of
        them, one forward each for the others (a whole prompt the first time, or the tokens of steps it did not
        draft). A request whose draft KV would not fit the draft's free blocks is left out."""
        if not depth:
            return {}
        model, cache = self.draft.model, self.draft_cache
        for r in requests:  # all added before any is sized: a prompt sharing another's blocks makes both copy them
            if not cache.has_sequence(r.id):
                cache.add_sequence(r.id, r.tokens[: r.num_computed + 1] if self.params.prefix_caching else [])
        free = cache.num_free_blocks
        todo: dict[int, tuple[Request, list[int]]] = {}
        for r in requests:
            unseen = r.tokens[cache.length(r.id) : r.num_computed + 1]
            need = cache.blocks_needed(r.id, max(len(unseen), CATCH_UP) + depth - 1)
            if need <= free:
                free -= need
                todo[r.id] = (r, unseen)
        if not todo:
            return {}
        short = [(r, unseen) for r, unseen in todo.values() if len(unseen) <= CATCH_UP]
        groups = ([short] if short else []) + [[(r, unseen)] for r, unseen in todo.values() if len(unseen) > CATCH_UP]
        last: dict[int, torch.Tensor] = {}  # request id -> (E,) the draft's final hidden state at the last token
        for group in groups:
            width = max(len(unseen) for _, unseen in group)
            starts = [cache.length(r.id) for r, _ in group]
            ids = torch.tensor([u + u[-1:] * (width - len(u)) for _, u in group], device=model.device)  # (B, T)
            positions = torch.tensor([[s + j for j in range(width)] for s in starts], device=model.device)  # (B, T)
            _, states = model(ids, positions, cache, [r.id for r, _ in group], num_logits=0)  # (B, T, E)
            for i, ((r, unseen), start) in enumerate(zip(group, starts)):
                last[r.id] = states[i, len(unseen) - 1]
                cache.truncate(r.id, start + len(unseen))  # the padding after a shorter row
        drafting = [r for r, _ in todo.values()]
        hidden = torch.stack([last[r.id] for r in drafting])  # (B, E)
        logp: list[list[list[float]]] = []  # (D, B, k)
        chains: list[list[list[int]]] = []  # (D, B, k)
        for d in range(depth):
            # (B, V') over the draft's proposal vocabulary, or (B, V)
            logits = self.draft_rows.logits(hidden) if self.draft_rows is not None else model.project(hidden)
            # At the first place the runner-up too: where the target refuses the draft's first choice it often
            # takes its second (as speculative decoding's siblings), a leaf beside the chain.
            best = logits.log_softmax(-1).topk(2 if d == 0 else 1, dim=-1)  # values, indices: (B, k)
            ranked = best.indices if self.draft_rows is None else self.draft_rows.ids[best.indices]  # (B, k)
            logp.append(best.values.tolist())
            chains.append(ranked.tolist())
            if d == depth - 1:
                break  # the last drafted token is not read: the target's verdict on it comes first
            positions = torch.tensor([[cache.length(r.id)] for r in drafting], device=model.device)  # (B, 1)
            _, states = model(ranked[:, :1], positions, cache, [r.id for r in drafting], num_logits=0)
            hidden = states[:, 0]  # (B, E)
        out = {}
        for i, r in enumerate(drafting):
            r.drafted = [place[i][0] for place in chains[:-1]]  # the chain: the top guess at each place
            out[r.id] = ([lp[i] for lp in logp], [place[i] for place in chains])
        return out

    def _head_tree(self, logp: list[list[float]], tokens: list[list[int]], nodes: int, eos_ids: frozenset[int],
                   copy: Lookup | None, copy_rate: float | None) -> tuple[Proposal, list[float]]:
        """The dynamic tree of at most `nodes` tokens from the heads' (D, k) top guesses, ranked by calibrated
        probability, with a copy of earlier text grafted on as Medusa's `copy_ngram` does (`best_first`; a copied
        token is worth at least the request's acceptance of copies of its n-gram length), and the tokens it is
        expected to commit with its first k tokens, k = 0..: 1 + the chances of reaching each token (the product of
        the worths along its path). No token follows an end-of-sequence token: nothing after one can be
        committed."""
        rated = self.calibration.log_rates(logp)
        copied = copy.tokens if copy else []
        prior = math.log(copy_rate) if copy else 0.0
        paths, chain = best_first(rated, tokens, copied, nodes, copy_rate if copy else COPY_PRIOR,
                                  chained=self.draft is not None)
        # The copy runs through the heads' nodes whose token it is, then on as `chain` nodes of its own.
        chosen, walk = set(paths), ()
        for depth, token in enumerate(copied[: len(tokens)]):
            if token not in tokens[depth] or walk + (tokens[depth].index(token),) not in chosen:
                break
            walk += (tokens[depth].index(token),)
        on_copy = {walk[:i] for i in range(1, len(walk) + 1)}
        # keyed by a head path, or ("copy", j) for the copy's own j-th node; the root is ()
        tree: dict[object, TreeNode] = {(): TreeNode(0.0, None, -1, None, False)}

        def add(key: object, parent: object, lp: float, token: int, prob: float | None, is_copy: bool) -> bool:
            if parent not in tree or tree[parent].token in eos_ids:
                return False  # below a dropped node or an end of sequence
            tree[key] = TreeNode(tree[parent].worth + lp, parent, token, prob, is_copy)
            return True
        for path in paths:
            depth, rank = len(path) - 1, path[-1]
            lp = max(rated[depth][rank], prior) if path in on_copy else rated[depth][rank]
            add(path, path[:-1], lp, tokens[depth][rank], math.exp(logp[depth][rank]), path in on_copy)
        parent: object = walk
        for j, token in enumerate(copied[len(walk) : len(walk) + chain]):
            if not add(("copy", j), parent, prior, token, None, True):
                break
            parent = ("copy", j)
        # Best first again, now with the copy's own nodes: a worth never grows down a path and the sort is stable,
        # so parents stay before their children.
        order = sorted((key for key in tree if key != ()), key=lambda key: -tree[key].worth)
        rows = {(): 0, **{key: i + 1 for i, key in enumerate(order)}}
        chosen_nodes = [tree[key] for key in order]
        gains = [1.0]
        for node in chosen_nodes:
            gains.append(gains[-1] + math.exp(node.worth))
        proposal = Proposal([n.token for n in chosen_nodes], [rows[n.parent] for n in chosen_nodes],
                            [n.copied for n in chosen_nodes], copy.ngram if copy else None,
                            [n.prob for n in chosen_nodes])
        return proposal, gains

    def _run(self, plan: StepPlan) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """The forwards of a step; for every request that ran, logits (1 + n + w, V) at its last token, after each
        of the n tokens of its proposal (n = 0 without one) and at the w tokens of its window's last row (lookahead;
        w = 0 without a window), and the final hidden states (1 + n + w, E) of those rows."""
        model, device = self.target.model, self.target.model.device
        logits: dict[int, torch.Tensor] = {}
        hidden: dict[int, torch.Tensor] = {}
        if plan.decode and plan.width == 1:
            ids = torch.tensor([[r.tokens[r.num_computed]] for r in plan.decode], device=device)  # (B, 1)
            positions = torch.tensor([[r.num_computed] for r in plan.decode], device=device)  # (B, 1)
            out, states = model(ids, positions, self.cache, [r.id for r in plan.decode], num_logits=1)  # (B, 1, V)
            for i, r in enumerate(plan.decode):
                logits[r.id], hidden[r.id] = out[i], states[i]
        elif plan.decode:
            width, chains, offsets, masks, scored = plan.width, [], [], [], []
            empty = Proposal([], [], [])
            masked = plan.windows or any(not p.is_chain() for p in plan.proposals.values())
            for r in plan.decode:
                proposal = plan.proposals.get(r.id, empty)
                chain = [r.tokens[r.num_computed], *proposal.tokens]
                window = plan.windows.get(r.id)
                block, block_offsets, block_mask = jacobi_block(window) if window else ([], [], None)
                row = chain + block
                chains.append(row)
                # Padding after a request's rows is causal: its rows never see it, and its KV is dropped after the
                # step. A tree's rows see their ancestors only, at positions by depth; a window's rows see the last
                # token and the window as `jacobi_block` says, and nothing of the proposal (nor it them).
                offsets.append(proposal.depths() + block_offsets + list(range(len(row), width)))
                if masked:
                    mask = torch.ones(width, width, dtype=torch.bool).tril()  # (W, W)
                    mask[: len(chain), : len(chain)] = ancestor_mask([-1, *proposal.parents])
                    if window:
                        mask[len(chain) : len(row)] = False
                        mask[len(chain) : len(row), 0] = True
                        mask[len(chain) : len(row), len(chain) : len(row)] = block_mask
                    masks.append(mask)
                # the rows read: the last token's, the proposal's and the window's last row's (its next guesses)
                scored.append(list(range(len(chain))) + list(range(len(row) - len(window[-1]), len(row)))
                              if window else list(range(len(chain))))
            ids = torch.tensor([c + c[-1:] * (width - len(c)) for c in chains], device=device)  # (B, W)
            positions = torch.tensor([[r.num_computed + o for o in row] for r, row in zip(plan.decode, offsets)],
                                     device=device)  # (B, W)
            attn_mask = torch.stack(masks).to(device) if masked else None  # (B, W, W); None: causal
            _, states = model(ids, positions, self.cache, [r.id for r in plan.decode], attn_mask=attn_mask,
                              num_logits=0)  # (B, W, E)
            rows = torch.tensor([i * width + j for i, read in enumerate(scored) for j in read], device=device)
            kept = states.flatten(0, 1).index_select(0, rows)  # (N, E): the rows read only
            logits_read = model.project(kept)  # (N, V)
            offset = 0
            for r, read in zip(plan.decode, scored):
                logits[r.id] = logits_read[offset : offset + len(read)]
                hidden[r.id] = kept[offset : offset + len(read)]
                offset += len(read)
        for request, n in plan.prefill:
            start = request.num_computed
            ids = torch.tensor([request.tokens[start : start + n]], device=device)  # (1, n)
            positions = torch.arange(start, start + n, device=device).unsqueeze(0)  # (1, n)
            out, states = model(ids, positions, self.cache, [request.id], num_logits=1)  # (1, 1, V)
            logits[request.id], hidden[request.id] = out[0], states[0, -1:]
        return logits, hidden

    def _postprocess(self, plan: StepPlan, logits: dict[int, torch.Tensor],
                     hidden: dict[int, torch.Tensor]) -> list[RequestOutput]:
        outputs = []
        kinds = {c for proposal in plan.proposals.values() for c in proposal.copied}
        if True in kinds:
            self.copied.steps += 1
        if False in kinds:
            self.guessed.steps += 1
        for request, n in [(r, 1) for r in plan.decode] + plan.prefill:
            request.num_computed += n
            if request.num_computed < len(request.tokens):
                continue  # a prefill chunk that has not reached the end of the known tokens
            try:
                outputs.append(self._advance(request, plan, logits, hidden))
            except Exception as exc:  # this request's sampling or detokenizing failed: it ends, the others go on
                if request in self.running:
                    self._release(request)
                request.status, request.finish_t = Status.FAILED, self.now()
                outputs.append(RequestOutput(request.id, [], True, error=f"{type(exc).__name__}: {exc}"))
        return outputs

    def _advance(self, request: Request, plan: StepPlan, logits: dict[int, torch.Tensor],
                 hidden: dict[int, torch.Tensor]) -> RequestOutput:
        """Draw a request's new tokens from its rows of the step's logits and commit them to its cache."""
        proposal = plan.proposals.get(request.id)
        tokens, parents = (proposal.tokens, proposal.parents) if proposal else ([], [])
        read, window_logits = logits[request.id][: 1 + len(tokens)], logits[request.id][1 + len(tokens) :]
        new, walk, done = [], [], False
        for row, token in draws_along(read, tokens, request.sampling, request.generator, parents):
            new.append(token)
            walk.append(row)
            done = request.stopper.push(token)
            if done:
                break
        path = walk[1:]  # the proposed tokens kept: the rows each draw after the first was taken from
        if proposal is not None:
            self._record(request, proposal, path)
        if request.drafted:
            # The draft keeps what it read of the tokens committed, never the new last token: its next chain
            # starts from its hidden state there.
            kept = request.num_computed + min(agreement(request.drafted, new), len(path))
            if self.draft_cache.length(request.id) > kept:
                self.draft_cache.truncate(request.id, kept)
            request.drafted = []
        now = self.now()
        if request.first_token_t is None:
            request.first_token_t = now
        if not done:
            if proposal is not None:  # the kept path's KV moves next to the last token; the rest goes
                self.cache.keep(request.id, request.num_computed - 1, [0, *path])
            request.num_computed += len(path)
            if self.cache.length(request.id) > request.num_computed:
                self.cache.truncate(request.id, request.num_computed)  # the padding after a row on its own
            if self.heads is not None:  # the row that predicted the last new token: the heads read it next
                request.hidden = hidden[request.id][walk[-1]].clone()
            if request.id in plan.windows:
                request.window = slide(request.window, argmax_rows(window_logits), request.pools)
            return RequestOutput(request.id, new, False)
        self._release(request)
        request.status, request.finish_t = Status.FINISHED, now
        return RequestOutput(request.id, new, True, request.stopper.output(now - request.arrival_t))

    def _record(self, request: Request, proposal: Proposal, path: list[int]) -> None:
        """What a verified proposal tells: how the request's copies (or lookahead's candidates) and the guesses of the
        heads or the draft fared."""
        num_copied = sum(proposal.copied)
        kept_copies = sum(1 for _ in itertools.takewhile(lambda row: proposal.copied[row - 1], path))
        if proposal.keys:  # lookahead: the candidate the kept path follows (where none was kept, the first)
            end = path[-1] if path else 0
            request.copy_acceptance.record(proposal.keys[path[0] - 1 if path else 0], len(path),
                                           len(path) + (end in proposal.parents))
        elif num_copied:
            request.copy_acceptance.record(proposal.ngram, kept_copies, min(kept_copies + 1, num_copied))
        self.calibration.record(proposal, path)
        kept_copied = sum(proposal.copied[row - 1] for row in path)
        self.copied.proposed += num_copied
        self.copied.accepted += kept_copied
        self.guessed.proposed += len(proposal.tokens) - num_copied
        self.guessed.accepted += len(path) - kept_copied

    # -- memory ------------------------------------------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the queue, to be recomputed."""
        self._release(request)
        request.status, request.num_computed, request.hidden = Status.WAITING, 0, None
        request.preemptions += 1
        self.waiting.appendleft(request)
        self.events.append(PreemptEvent(step=self.step_count, t=self.now(), seq=request.id,
                                        reason="out of KV blocks: the newest running request is recomputed later"))

    def _release(self, request: Request) -> None:
        freed = self.cache.length(request.id)
        self.cache.free(request.id)
        if self.draft is not None and self.draft_cache.has_sequence(request.id):
            self.draft_cache.free(request.id)
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


class GuessCalibration:
    """How often the guesses of the heads (or the draft) are right against what their probabilities say, per depth,
    and how often a node with guesses below it has one of them kept, per depth (`expected_tokens`, which decides
    how deep the draft drafts). A guess is judged when the token it follows was kept; at each depth, the
    probabilities of the judged guesses are summed against how many were kept, and a guess's rate is
    p x (kept + 1) / (probabilities + 1) (no data: p itself), at most 1.
    Why: the shipped heads' top guesses run high; on the exactness prompts the first head's top guesses at
    probability 0.4-0.5 were right 20% of the time, at 0.8-0.9 54%, so uncalibrated guesses looked worth a wider
    forward at batch sizes where they were not."""

    def __init__(self, depth: int) -> None:
        self.kept = [0.0] * depth
        self.predicted = [0.0] * depth
        self.judged = [0] * depth

    def scale(self, depth: int) -> float:
        return (self.kept[depth] + 1.0) / (self.predicted[depth] + 1.0)

    def log_rates(self, logp: list[list[float]]) -> list[list[float]]:
        """Calibrated log-rates for the heads' (D, k) log-probabilities."""
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
        depth, from how often a reached node had one of its guesses kept at each (an optimistic prior of 2 / 3, as
        prompt lookup's running acceptance has, so that guessing is tried first)."""
        accepted, judged = RunningAcceptance.PRIOR_ACCEPTED, RunningAcceptance.PRIOR_JUDGED
        gains, reach = [1.0], 1.0
        for d in range(depth):
            reach *= (self.kept[d] + accepted) / (self.judged[d] + judged)
            gains.append(gains[-1] + reach)
        return gains

    def record(self, proposal: Proposal, path: list[int]) -> None:
        """A verified tree and the rows of the tokens kept. A copied token is left out even where a head guessed it
        too: it is in the tree because the copy proposes it, which makes it likelier than the head's probability
        says."""
        reached, kept = {0, *path}, set(path)
        judged = set()  # (depth, parent) of every reached node with guesses below it
        for i, (parent, p, depth) in enumerate(zip(proposal.parents, proposal.probs, proposal.depths()[1:])):
            if parent in reached and not proposal.copied[i]:  # a guess of the heads or the draft, not the copy's
                self.predicted[depth - 1] += p
                self.kept[depth - 1] += float(i + 1 in kept)
                judged.add((depth, parent))
        for depth, _ in judged:
            self.judged[depth - 1] += 1

