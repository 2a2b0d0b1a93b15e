"""Lookahead decoding (Fu et al. 2024): Jacobi iteration makes n-grams, one forward both makes and checks them.

Each step is one target forward over three branches, kept apart by the attention mask:
- the last committed token x (not yet in the cache);
- the lookahead branch: a window of N - 1 rows by W columns of guessed tokens. Token (row l, column i) sits at
  position P + 1 + i + l and sees x, row 0 up to column i and rows 1..l of column i: a consecutive text. The
  target's argmax after the last row gives a new row; each column read top to bottom plus its new token is an
  n-gram for the pool, and the window slides up one row;
- the verification branch: up to G n-grams from the pool that start with x, each seeing x and itself. Besides
  the window's n-grams, the pool holds the prompt's (`prompt_pool`) and those of the text committed so far
  (`output_pool`): an answer repeats its own phrases and its prompt's more often than a small model's Jacobi
  window guesses them. Those two take n-grams of `text_ngram` M tokens (default N), so a guess from the text
  may run longer than the window's. Before them the pool is seeded (`corpus_pool`) with the most frequent
  M-grams of the target's own answers to other prompts: its habitual phrases, a static pool in the spirit of
  retrieval-based drafting (REST, He et al. 2023), which no text so far may hold yet. The text's n-grams are
  also kept keyed by their first 2..K tokens (`context`), and the candidates following the longest run of x and
  the tokens before it come first (`TextPools`).
Accept: greedy keeps the candidate with the longest prefix equal to the target's argmaxes; sampling verifies
the most recent candidate with the lossless rule (one-hot q). Commit: the cache keeps x and the accepted tokens
of that candidate, moved into place; the window and the other candidates are dropped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..config import GenerationParams, LookaheadParams, SamplingParams
from ..models import LoadedModel
from ..sampling import argmax_rows
from ..trace import DraftEvent, LookaheadEvent, VerifyEvent
from .base import Decoder, EventStream, Stopper, commit_event, forward_tree, new_cache
from .chain import ChainOutcome, accept_chain, longest_match, one_hot
from .planning import ProposalGate
from .pools import TextPools, seed_pools, start_pools
from .proposer import Cost, Outcome, Proposal, Proposer, RequestView, SideRows, candidates


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where each token of one lookahead forward sits. Order: window rows 0..N-3, then x, the last window row and
    the candidates, so that every token whose logits are read is among the last `num_logits`."""

    tokens: list[int]
    positions: list[int]  # offsets from x's position
    mask: torch.Tensor  # (T, T) bool: who sees whom among the new tokens
    x_index: int
    last_row: list[int]  # index of each column of the last window row
    candidate_rows: list[list[int]]  # index of each candidate token
    num_logits: int


def jacobi_block(window: list[list[int]]) -> tuple[list[int], list[int], torch.Tensor]:
    """The Jacobi window's tokens (rows l = 0..N-2 of W columns, row by row), their positions as offsets from the
    last committed token x, and who sees whom among them, (T, T) bool: token (l, i) sits at 1 + i + l and sees row 0
    up to column i and rows 1..l of column i, a consecutive text after x (which every one of them also sees)."""
    rows, width = len(window), len(window[0])
    tokens = [token for row in window for token in row]
    positions = [1 + i + l for l in range(rows) for i in range(width)]
    mask = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)  # (T, T)
    for l in range(rows):
        for i in range(width):
            me = l * width + i
            mask[me, : i + 1] = True  # row 0 up to this column
            mask[me, [r * width + i for r in range(1, l + 1)]] = True  # rows 1..l of this column, itself included
    return tokens, positions, mask


def step_layout(x: int, window: list[list[int]], candidates: list[tuple[int, ...]]) -> StepLayout:
    """Tokens, positions and mask of one lookahead forward (window rows l = 0..N-2 of W tokens)."""
    rows, width = len(window), len(window[0])
    block, block_positions, block_mask = jacobi_block(window)
    split = (rows - 1) * width  # rows 0..N-3 go before x, the last row after it
    tokens = block[:split] + [x] + block[split:]
    positions = block_positions[:split] + [0] + block_positions[split:]
    x_index = split
    window_index = list(range(split)) + list(range(split + 1, len(tokens)))  # each window token's index
    candidate_rows = []
    for c in candidates:
        candidate_rows.append(list(range(len(tokens), len(tokens) + len(c))))
        tokens += c
        positions += range(1, len(c) + 1)

    mask = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)  # (T, T)
    mask[x_index, x_index] = True
    mask[window_index, x_index] = True
    mask[torch.tensor(window_index)[:, None], torch.tensor(window_index)] = block_mask
    for row in candidate_rows:
        for j, me in enumerate(row):
            mask[me, x_index] = True
            mask[me, row[: j + 1]] = True
    return StepLayout(tokens, positions, mask, x_index, window_index[split:], candidate_rows, len(tokens) - x_index)


def first_window(prompt_ids: list[int], params: LookaheadParams, seed: int | None) -> list[list[int]]:
    """A Jacobi window (N - 1 rows of W tokens, resolved settings) to start from: prompt tokens drawn with a fixed
    seed. Any guess is correct; good ones are faster."""
    chooser = random.Random(0 if seed is None else seed)
    return [[chooser.choice(prompt_ids) for _ in range(params.window)] for _ in range(params.ngram - 1)]


def slide(window: list[list[int]], new_row: list[int], pools: TextPools) -> list[list[int]]:
    """The Jacobi step: `new_row`, the target's argmax after each token of the window's last row, is the next row;
    each column read top to bottom, then its new token, is an n-gram for the pools. The window moved up a row."""
    for i, token in enumerate(new_row):
        pools.add_window(tuple(row[i] for row in window) + (token,))
    return window[1:] + [new_row]


class LookaheadDecoder(Decoder):
    algo = "lookahead"

    def __init__(self, target: LoadedModel, sampling: SamplingParams, generation: GenerationParams,
                 params: LookaheadParams | None = None) -> None:
        super().__init__(target, sampling, generation)
        la = self.lookahead = (params or LookaheadParams()).resolve(target.model.rows_per_pass)
        self.corpus, self.seeds = seed_pools(target, la)  # every run starts its pools as copies of the seeds

    def params(self) -> dict[str, Any]:
        la = self.lookahead
        return {**super().params(), "window": la.window, "ngram": la.ngram, "guesses": la.guesses,
                "prompt_pool": la.prompt_pool, "output_pool": la.output_pool, "text_ngram": la.text_n,
                "context": la.context, "corpus": self.corpus}

    def run(self, prompt_ids: list[int]) -> EventStream:
        target = self.target.model
        la = self.lookahead
        clock, generator, stopper = self.start()
        widest = la.width(la.guesses, la.text_n)
        cache = new_cache(target, len(prompt_ids) + self.generation.max_new_tokens + widest, self.generation)
        pool = start_pools(self.seeds, la, prompt_ids)
        text = list(prompt_ids)  # prompt + committed tokens: the context candidates are keyed by
        window = first_window(prompt_ids, la, self.sampling.seed)

        last, done = yield from self.prefill(cache, prompt_ids, clock, generator, stopper)
        step = 0
        while not done:
            step += 1
            step_start = clock.now()
            base = cache.length(0)  # position of `last`
            # Never propose past max_new_tokens: those tokens could only be thrown away.
            budget = self.generation.max_new_tokens - len(stopper.tokens)
            found, keys = pool.candidates([*text[-la.context :], last])
            candidates = [c[:budget] for c in found]
            if not self.sampling.greedy:  # one chain keeps the lossless rule simple
                candidates, keys = candidates[:1], keys[:1]
            layout = step_layout(last, window, candidates)
            draft_end = clock.now()
            yield from clock.emit(LookaheadEvent(step=step, t=draft_end, window=[list(r) for r in window],
                                                 pool_size=len(pool), candidates=[list(c) for c in candidates],
                                                 keys=keys))

            verify_start = clock.now()
            # one forward over every branch: logits (num_logits, V) of the last num_logits tokens
            logits, _ = forward_tree(target, cache, layout.tokens, layout.positions, layout.mask, layout.num_logits)
            verify_end = clock.now()
            yield from clock.emit(VerifyEvent(step=step, t=verify_end, num_tokens=len(layout.tokens),
                                              wall_s=verify_end - verify_start, target_forwards=1))

            first = len(layout.tokens) - layout.num_logits  # token index of logits row 0
            argmax = argmax_rows(logits)  # (num_logits,) the target's next token after each
            new_row = [argmax[i - first] for i in layout.last_row]  # (W,)
            window = slide(window, new_row, pool)

            draft_s, verify_s = draft_end - step_start, verify_end - verify_start
            chosen, outcome = self.accept(step, clock.now(), draft_s, base, logits, argmax, first, layout,
                                          candidates, generator, stopper)
            done = outcome.done
            accepted = layout.candidate_rows[chosen][: outcome.accepted] if chosen is not None else []
            # commit: token index i of this forward sits in slot base + i; x and the accepted tokens move to
            # slots base, base + 1, ..., everything else is dropped
            cache.keep(0, base, [layout.x_index] + accepted)
            grown = len(text)
            text += [last] + [layout.tokens[i] for i in accepted]
            if la.output_pool:  # the answer's own phrases are likely to come back
                pool.add_text(text, grown)
            last = outcome.token
            yield from clock.emit(*outcome.events, commit_event(step, step_start, clock.now(), draft_s, verify_s,
                                                                outcome.kept, cache.memory().bytes_used))
        event, output = self.finish(stopper, clock, step)
        yield from clock.emit(event)
        return output

    def accept(self, step: int, t: float, draft_s: float, base: int, logits: torch.Tensor, argmax: list[int],
               first: int, layout: StepLayout, candidates: list[tuple[int, ...]], generator: torch.Generator,
               stopper: Stopper) -> tuple[int | None, ChainOutcome]:
        """Judge the candidates; returns the index of the one kept (None when there were none) and the outcome.
        A DraftEvent for that candidate precedes the accept/reject events: it is the chain that was verified.
        logits (num_logits, V) and their argmax: row i belongs to token index first + i of the forward."""
        x_row = layout.x_index - first
        if not candidates:
            return None, accept_chain(self, step, t, base, logits[x_row : x_row + 1], [], None, None, generator,
                                      stopper)
        rows = [[x_row] + [i - first for i in row] for row in layout.candidate_rows]  # each candidate's K+1 rows
        # under sampling the one candidate verified; under greedy the longest match, earliest on ties
        chosen = longest_match(argmax, rows, [list(c) for c in candidates]) if self.sampling.greedy else 0
        proposals = list(candidates[chosen])
        q = None if self.sampling.greedy else one_hot(proposals, logits.shape[-1], logits.device)
        q_shown = None if self.sampling.greedy else [1.0] * len(proposals)
        outcome = accept_chain(self, step, t, base, logits[rows[chosen]], proposals, q, q_shown, generator, stopper)
        infos = [self.token_info(x, base + 1 + i, q=None if q_shown is None else 1.0) for i, x in enumerate(proposals)]
        draft = DraftEvent(step=step, t=t, tokens=infos, wall_s=draft_s, draft_forwards=0)
        return chosen, replace(outcome, events=[draft, *outcome.events])


@dataclass
class _Sequence:
    """A request's lookahead state: its pools, Jacobi window, acceptance per key length and the key each node of
    its last proposal was found by."""

    pools: TextPools
    window: list[list[int]]
    pooled: int  # leading tokens whose n-grams are in the pools
    gate: ProposalGate
    keys: list[int] = field(default_factory=list)
    shown: LookaheadEvent | None = None  # its last proposal as the trace shows it (step and time filled in later)


class LookaheadProposer(Proposer):
    """Lookahead in the engine: each decoding request's candidates from its own pools, merged into a tree, with its
    Jacobi window run beside them as side rows whose argmaxes are its next window row."""

    label = "lookahead"

    def __init__(self, target: LoadedModel, params: LookaheadParams) -> None:
        self.lookahead = la = params.resolve(target.model.rows_per_pass)
        self.corpus, self.seeds = seed_pools(target, la)  # every request's pools start as copies of these
        self.states: dict[int, _Sequence] = {}

    def bind(self, settings: Any) -> None:
        self.states = {}

    def start(self, request: RequestView) -> None:
        la = self.lookahead
        self.states[request.id] = _Sequence(start_pools(self.seeds, la, request.prompt_ids),
                                            first_window(request.prompt_ids, la, request.sampling.seed),
                                            len(request.prompt_ids), ProposalGate(0.0, la.context))

    def end(self, request: RequestView) -> None:
        self.states.pop(request.id, None)

    def propose(self, requests: Sequence[RequestView], rooms: list[int], cost: Cost) -> dict[int, Proposal]:
        """Candidates and window for each request with room; the window's rows are paid for as they come (they feed
        the pools, not this step), the candidates by their expected tokens."""
        proposals = {}
        for request, room in zip(requests, rooms):
            state = self.states[request.id]
            state.gate.decay()
            if not room:
                continue
            if self.lookahead.output_pool:  # the answer's own phrases are likely to come back
                state.pools.add_text(request.tokens[: request.num_computed], state.pooled)
                state.pooled = request.num_computed
            block, offsets, mask = jacobi_block(state.window)
            found, keys = state.pools.candidates(request.tokens)
            state.shown = LookaheadEvent(step=0, t=0.0, window=[list(row) for row in state.window],
                                         pool_size=len(state.pools), candidates=[list(c[:room]) for c in found],
                                         keys=list(keys))
            proposal, source = candidates([c[:room] for c in found], [state.gate.acceptance(k) for k in keys],
                                          self.label)
            state.keys = [keys[c] for c in source]
            proposals[request.id] = replace(proposal, side=SideRows(block, offsets, mask, len(state.window[-1])))
        return proposals

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        state = self.states[request.id]
        if proposal is None:
            return
        path = outcome.path
        if proposal.tokens:  # the candidate the kept path follows (where none was kept, the first)
            end = path[-1] if path else 0
            state.gate.record(state.keys[path[0] - 1 if path else 0], len(path), len(path) + (end in proposal.parents))
        state.window = slide(state.window, argmax_rows(outcome.side_logits), state.pools)

    def trace_events(self, request: RequestView, step: int, t: float) -> list[LookaheadEvent]:
        """The window, the pools' size and the candidates the request's last proposal was made from."""
        shown, self.states[request.id].shown = self.states[request.id].shown, None
        return [] if shown is None else [replace(shown, step=step, t=t)]

    def describe(self) -> dict[str, Any]:
        la = self.lookahead
        return {"proposer": self.label, "window": la.window, "ngram": la.ngram, "guesses": la.guesses,
                "text_ngram": la.text_n}
