"""Prompt-lookup decoding (Saxena 2023): proposals copied from earlier text, no draft model.

Each step: propose -> the longest suffix of the text so far (up to max_ngram tokens, then shorter) that occurs
earlier; copy the num_draft tokens that followed its latest earlier occurrence (cut after an end-of-sequence
token) -> verify them with one target forward -> accept (greedy match, or the lossless rule with one-hot q) ->
commit: keep the accepted tokens in the cache. With no match the step is a plain decoding step. Under greedy
acceptance `branches` > 1 also copies from further occurrences whose continuations differ; the copies are merged
into one tree (a shared prefix is verified once), one forward scores them all and the longest match is kept.

A verification forward over several tokens is not free (on the 2-core CPU with the native kernel 1.06-1.16x a
one-token step for 5 to 9 tokens, 1.3-1.8x with PyTorch's kernels; 1.5x for 5 tokens on an H100 at batch 1),
so a wrong proposal costs time. `ProposalGate` keeps, per matched n-gram length, a running estimate of how often
a copied token is accepted, and lets a match through only when the expected tokens it commits pay for the
forward's overhead; otherwise the step is a plain step. It changes which steps propose, never which tokens come
out (greedy stays exact, sampling stays lossless), and it depends only on the tokens, so the same seed gives the
same output.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..config import GenerationParams, PromptLookupParams, SamplingParams
from ..models import LoadedModel
from ..trace import DraftEvent, VerifyEvent
from .base import Decoder, EventStream, commit_event, new_cache
from .chain import accept_chain, one_hot, verify_candidates
from .copies import Lookup, find_continuations
from .planning import ProposalGate, plan_width, widest_paying
from .proposer import Cost, Outcome, Proposal, Proposer, RequestView, candidates


class PromptLookupDecoder(Decoder):
    algo = "prompt-lookup"

    def __init__(self, target: LoadedModel, sampling: SamplingParams, generation: GenerationParams,
                 params: PromptLookupParams | None = None) -> None:
        super().__init__(target, sampling, generation)
        self.lookup = (params or PromptLookupParams()).resolve(target.model.rows_per_pass)  # K and B set

    def params(self) -> dict[str, Any]:
        return {**super().params(), "max_ngram": self.lookup.max_ngram, "num_draft": self.lookup.num_draft,
                "branches": self.lookup.branches, "verify_overhead": self.lookup.verify_overhead}

    def run(self, prompt_ids: list[int]) -> EventStream:
        target = self.target.model
        clock, generator, stopper = self.start()
        eos_ids = frozenset(self.target.eos_token_ids)
        widest = self.lookup.branches * self.lookup.num_draft + 1
        cache = new_cache(target, len(prompt_ids) + self.generation.max_new_tokens + widest, self.generation)
        vocab = target.config.vocab_size
        gate = ProposalGate(self.lookup.verify_overhead, self.lookup.max_ngram)

        last, done = yield from self.prefill(cache, prompt_ids, clock, generator, stopper)
        sequence = list(prompt_ids) + [last]  # prompt + generated: what the lookup searches
        # Several copies only under greedy acceptance: sampling verifies one chain with the lossless rule.
        branches = self.lookup.branches if self.sampling.greedy else 1
        step = 0
        while not done:
            step += 1
            step_start = clock.now()
            base = cache.length(0)  # position of `last`
            # Never propose past max_new_tokens: those tokens could only be thrown away.
            budget = min(self.lookup.num_draft, self.generation.max_new_tokens - len(stopper.tokens))
            found = find_continuations(sequence, self.lookup.max_ngram, budget, eos_ids, branches)
            gate.decay()
            if found and not gate.worth(found[0].ngram, len(found[0].tokens)):
                found = []
            draft_end = clock.now()

            verify_start = clock.now()
            verified = verify_candidates(target, cache, last, [f.tokens for f in found])
            target_logits, chosen, paths = verified.logits, verified.chosen, verified.paths  # logits (K+1, V)
            verify_end = clock.now()
            yield from clock.emit(VerifyEvent(step=step, t=verify_end, num_tokens=verified.width,
                                              wall_s=verify_end - verify_start, target_forwards=1))

            lookup = found[chosen] if found else None
            proposals = lookup.tokens if lookup else []
            # q is one-hot: a copied token was proposed with certainty (shown only when sampling, where it is used)
            q_shown = None if self.sampling.greedy else [1.0] * len(proposals)
            if lookup:  # the copy verified and judged, known once the forward has scored every candidate
                infos = [self.token_info(x, base + 1 + i, q=None if q_shown is None else 1.0)
                         for i, x in enumerate(proposals)]
                yield from clock.emit(DraftEvent(step=step, t=clock.now(), tokens=infos,
                                                 wall_s=draft_end - step_start, draft_forwards=0,
                                                 source=[lookup.start, lookup.start + len(proposals)],
                                                 ngram=lookup.ngram))
            q = None if self.sampling.greedy else one_hot(proposals, vocab, target.device)
            outcome = accept_chain(self, step, clock.now(), base, target_logits, proposals, q, q_shown, generator,
                                   stopper)
            done = outcome.done
            if lookup:
                gate.record(lookup.ngram, outcome.accepted, outcome.judged)
            # commit: keep `last` and the accepted tokens of the chosen copy (node i of the forward sits in slot
            # base + i); the new `last` is not fed yet.
            cache.keep(0, base, [0, *(paths[chosen][: outcome.accepted] if paths else [])])
            sequence += proposals[: outcome.accepted] + [outcome.token]
            last = outcome.token
            yield from clock.emit(*outcome.events, commit_event(
                step, step_start, clock.now(), draft_end - step_start, verify_end - verify_start, outcome.kept,
                cache.memory().bytes_used))
        event, output = self.finish(stopper, clock, step)
        yield from clock.emit(event)
        return output


class CopyProposer(Proposer):
    """Prompt lookup in the engine: each decoding request's copies of earlier text (up to `branches`, merged into a
    tree where they start alike), proposed when their n-gram lengths' running acceptance says the wider forward
    pays. Also the copy `Grafted` puts onto a guesser's trees."""

    label = "copy"

    def __init__(self, target: LoadedModel, params: PromptLookupParams) -> None:
        self.lookup = params.resolve(target.model.rows_per_pass)
        self.eos_ids = frozenset(target.eos_token_ids)
        self.gates: dict[int, ProposalGate] = {}  # request id -> acceptance per matched n-gram length
        self.ngrams: dict[int, list[int | None]] = {}  # request id -> per node proposed, its copy's n-gram length

    def bind(self, settings: Any) -> None:
        self.gates, self.ngrams = {}, {}

    def start(self, request: RequestView) -> None:
        self.gates[request.id] = ProposalGate(0.0, self.lookup.max_ngram)

    def end(self, request: RequestView) -> None:
        self.gates.pop(request.id, None)
        self.ngrams.pop(request.id, None)

    def decay(self, requests: Sequence[RequestView]) -> None:
        for request in requests:
            self.gates[request.id].decay()

    def bound(self, request: RequestView, room: int) -> list[float]:
        """The most a copy could commit with k = 0.. tokens, at the request's best acceptance of any n-gram length."""
        gate = self.gates[request.id]
        return [gate.best_expected_tokens(k) for k in range(min(self.lookup.num_draft, room) + 1)]

    def find(self, request: RequestView, room: int, limit: int = 1) -> list[Lookup]:
        """Up to `limit` copies of at most `room` tokens each for the request, best first."""
        if room <= 0:
            return []
        return find_continuations(request.tokens, self.lookup.max_ngram, min(self.lookup.num_draft, room),
                                  self.eos_ids, limit)

    def rate(self, request: RequestView, copy: Lookup) -> float:
        return self.gates[request.id].acceptance(copy.ngram)

    def remember(self, request: RequestView, proposal: Proposal, ngram: list[int | None]) -> Proposal:
        """Note the n-gram length behind each of the proposal's nodes (None: not a copy's), for `observe`."""
        self.ngrams[request.id] = ngram
        return proposal

    def propose(self, requests: Sequence[RequestView], rooms: list[int], cost: Cost) -> dict[int, Proposal]:
        self.decay(requests)
        bounds = [self.bound(r, room) for r, room in zip(requests, rooms)]
        if plan_width(bounds, cost) == 1:  # the search scans each whole text: skip it when no copy could pay
            return {}
        longest = widest_paying(bounds, cost) - 1
        proposals = {}
        for request, room in zip(requests, rooms):
            found = self.find(request, min(longest, room), self.lookup.branches)
            if not found:
                continue
            proposal, source = candidates([copy.tokens for copy in found],
                                          [self.rate(request, copy) for copy in found], self.label)
            first = found[0]
            proposal = replace(proposal, span=[first.start, first.start + len(first.tokens)], ngram=first.ngram)
            proposals[request.id] = self.remember(request, proposal, [found[c].ngram for c in source])
        return proposals

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        """The copy the kept path follows (where none was kept, the first) was judged up to its first refusal."""
        ngrams = self.ngrams.pop(request.id, None)
        rows = [] if proposal is None else [i + 1 for i, s in enumerate(proposal.sources) if s == self.label]
        if not rows or ngrams is None:
            return
        path = list(itertools.takewhile(lambda row: proposal.sources[row - 1] == self.label, outcome.path))
        end = path[-1] if path else 0
        refused = any(proposal.parents[row - 1] == end for row in rows)
        self.gates[request.id].record(ngrams[(path[0] if path else rows[0]) - 1], len(path), len(path) + refused)

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "max_ngram": self.lookup.max_ngram, "num_draft": self.lookup.num_draft,
                "branches": self.lookup.branches}
