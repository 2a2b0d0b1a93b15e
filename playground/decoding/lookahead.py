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
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from ..config import GenerationParams, LookaheadParams, SamplingParams
from ..models import LoadedModel
from ..models.answers import default_answers, load_answers
from ..sampling import argmax_rows
from ..trace import DraftEvent, LookaheadEvent, VerifyEvent
from .base import Decoder, EventStream, Stopper, commit_event, forward_tree, new_cache
from .chain import ChainOutcome, accept_chain, longest_match, one_hot


class NGramPool:
    """n-grams keyed by their first `key` tokens; at most `guesses` continuations per key, least recently used
    evicted. The paper's pool has key 1; longer keys hold the text's n-grams by more context (see `TextPools`)."""

    def __init__(self, guesses: int, key: int = 1, base: NGramPool | None = None) -> None:
        """`base`: a pool this one starts as a copy of, copied one key at a time when that key is first written
        (seeding tens of thousands of n-grams afresh cost ~0.1 s per run); the base must not change afterwards."""
        if base is not None and (base.guesses, base.key) != (guesses, key):
            raise ValueError("base: a pool with the same guesses and key is required")
        self.guesses = guesses
        self.key = key
        self._by_key: dict[tuple[int, ...], OrderedDict[tuple[int, ...], None]] = {}
        self._base = {} if base is None else base._by_key
        self._size = 0 if base is None else len(base)  # kept as it changes: counting per step cost ~1 ms

    def _entries(self, key: tuple[int, ...]) -> OrderedDict[tuple[int, ...], None]:
        """The key's continuations, to change: this pool's own copy."""
        entries = self._by_key.get(key)
        if entries is None:
            entries = self._by_key[key] = OrderedDict(self._base.get(key, ()))
        return entries

    def add(self, ngram: tuple[int, ...]) -> None:
        """Insert (or refresh) an n-gram: its first `key` tokens are the key, the rest the continuation.

        Continuations of different lengths share a key (the window's n-grams and the longer ones taken from the
        text): one that starts another guesses nothing more, so the longer of the two stays, refreshed, and the
        G guesses of a key stay distinct."""
        entries = self._entries(ngram[: self.key])
        before = len(entries)
        continuation = ngram[self.key :]
        for known in list(entries):
            if known[: len(continuation)] == continuation:  # already guessed, maybe with more after it
                continuation = known
                break
            if continuation[: len(known)] == known:  # the new one guesses more: it replaces the shorter one
                del entries[known]
        entries[continuation] = None
        entries.move_to_end(continuation)
        if len(entries) > self.guesses:
            entries.popitem(last=False)
        self._size += len(entries) - before

    def add_text(self, text: list[int], n: int, start: int = 0) -> None:
        """Insert every n-gram of `text` that ends past index `start` (the n-grams a text gained when it grew from
        `start` tokens), in text order, so the latest occurrence is the most recently used."""
        for end in range(max(start + 1, n), len(text) + 1):
            self.add(tuple(text[end - n : end]))

    def candidates(self, text: list[int] | tuple[int, ...]) -> list[tuple[int, ...]]:
        """Continuations of the last `key` tokens of `text`, most recently used first."""
        if len(text) < self.key:
            return []
        key = tuple(text[-self.key :])
        entries = self._by_key.get(key)
        return list(reversed(self._base.get(key, {}) if entries is None else entries))

    def __len__(self) -> int:
        return self._size


class TextPools:
    """The verification branch's source: pools keyed by the last 1..`context` tokens (K), looked up longest key
    first, as an n-gram language model backs off.

    The key-1 pool is the paper's: the window's n-grams and the text's M-grams. Pool k > 1 holds the text's
    (k + M - 1)-grams keyed by their first k tokens, so its continuations have the same M - 1 tokens but follow a
    longer match: after "the" many phrases go on, after "of the" fewer. A step takes up to G continuations from
    the longest key that has any, then shorter ones, skipping a guess that starts one already taken and letting
    a longer guess replace one it starts; the forward stays as wide as with one pool. Measured on the benchmark
    suite (replayed, W 1 N 3 G 2, corpus pool on): 1.59 tokens per forward with K 1, 1.61 with K 2, 1.64 with K 3.
    """

    def __init__(self, guesses: int, text_ngram: int, context: int, base: TextPools | None = None) -> None:
        """`base`: pools of the same settings this one starts as a copy of (see `NGramPool`)."""
        self.guesses, self.text_ngram = guesses, text_ngram
        starts = [None] * context if base is None else base.pools
        self.pools = [NGramPool(guesses, key, start) for key, start in zip(range(1, context + 1), starts, strict=True)]

    @classmethod
    def seeded(cls, guesses: int, text_ngram: int, context: int, answers: list[list[int]]) -> TextPools:
        """Pools holding the G most frequent n-grams of `answers` per key of each length (see `frequent_ngrams`)."""
        pools = cls(guesses, text_ngram, context)
        for pool in pools.pools:
            for ngram in frequent_ngrams(answers, pool.key + text_ngram - 1, guesses, key=pool.key):
                pool.add(ngram)
        return pools

    def add_window(self, ngram: tuple[int, ...]) -> None:
        """A Jacobi column's n-gram: guessed tokens, not text, so only its first token is a key."""
        self.pools[0].add(ngram)

    def add_text(self, text: list[int], start: int = 0) -> None:
        """Every n-gram `text` gained past index `start`, into every pool."""
        for pool in self.pools:
            pool.add_text(text, pool.key + self.text_ngram - 1, start)

    def candidates(self, text: list[int]) -> tuple[list[tuple[int, ...]], list[int]]:
        """Up to G continuations of `text` (the committed text, its last token included) and, for each, the length
        of the key it was found by."""
        chosen: list[tuple[int, ...]] = []
        keys: list[int] = []
        for pool in reversed(self.pools):
            for guess in pool.candidates(text):
                related = next((i for i, c in enumerate(chosen)
                                if c[: len(guess)] == guess or guess[: len(c)] == c), None)
                if related is None and len(chosen) < self.guesses:
                    chosen.append(guess)
                    keys.append(pool.key)
                elif related is not None and len(guess) > len(chosen[related]):
                    chosen[related], keys[related] = guess, pool.key  # it guesses more than the one it starts
        return chosen, keys

    def __len__(self) -> int:
        return sum(len(pool) for pool in self.pools)


def frequent_ngrams(answers: list[list[int]], n: int, per_key: int, key: int = 1) -> list[tuple[int, ...]]:
    """The `per_key` most frequent n-grams of the answers for each key (their first `key` tokens; n-grams seen
    once left out, as chance), least frequent first, so that adding them to a pool in this order leaves the most
    frequent the most recently used. Ties keep the order of first appearance."""
    counts = Counter(tuple(a[i : i + n]) for a in answers for i in range(len(a) - n + 1))
    kept: Counter[tuple[int, ...]] = Counter()
    chosen = []
    for ngram, count in counts.most_common():
        if count < 2:
            break
        if kept[ngram[:key]] < per_key:
            kept[ngram[:key]] += 1
            chosen.append(ngram)
    return chosen[::-1]


def corpus_pools(corpus: str, vocab: int, params: LookaheadParams) -> TextPools:
    """Pools seeded from an answers file, shared by every decoder with the same settings while the file stays
    unchanged: counting and adding the seeds takes ~0.4 s at K 3, and the app builds a decoder per run."""
    try:
        modified = Path(corpus).stat().st_mtime_ns
    except OSError:
        modified = -1  # load_answers names what is wrong
    return _corpus_pools(corpus, modified, vocab, params.guesses, params.text_n, params.context)


@lru_cache(maxsize=4)
def _corpus_pools(corpus: str, modified: int, vocab: int, guesses: int, text_n: int, context: int) -> TextPools:
    return TextPools.seeded(guesses, text_n, context, load_answers(corpus, vocab))


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


def candidate_tree(candidates: list[tuple[int, ...]]) -> tuple[list[int], list[int], list[int]]:
    """Candidates merged where they start alike: (tokens, parents, source), node i following the node parents[i] - 1
    (0: the last committed token, as `Proposal` numbers rows) and first proposed by candidates[source[i]]; each
    candidate's nodes in order, so every parent comes before its children and any leading part is a tree."""
    tokens: list[int] = []
    parents: list[int] = []
    source: list[int] = []
    rows: dict[tuple[int, ...], int] = {(): 0}
    for c, candidate in enumerate(candidates):
        for depth in range(1, len(candidate) + 1):
            if candidate[:depth] not in rows:
                tokens.append(candidate[depth - 1])
                parents.append(rows[candidate[: depth - 1]])
                source.append(c)
                rows[candidate[:depth]] = len(tokens)
    return tokens, parents, source


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


def start_pools(seeds: TextPools, params: LookaheadParams, prompt_ids: list[int]) -> TextPools:
    """A sequence's own pools: a copy of the seeds, with the prompt's n-grams where `params.prompt_pool` says."""
    pools = TextPools(params.guesses, params.text_n, params.context, base=seeds)
    if params.prompt_pool:
        pools.add_text(prompt_ids)
    return pools


def slide(window: list[list[int]], new_row: list[int], pools: TextPools) -> list[list[int]]:
    """The Jacobi step: `new_row`, the target's argmax after each token of the window's last row, is the next row;
    each column read top to bottom, then its new token, is an n-gram for the pools. The window moved up a row."""
    for i, token in enumerate(new_row):
        pools.add_window(tuple(row[i] for row in window) + (token,))
    return window[1:] + [new_row]


def seed_pools(target: LoadedModel, params: LookaheadParams) -> tuple[str | None, TextPools]:
    """For resolved settings: the answers file the pools are seeded from (None: no corpus pool) and the seeded
    pools every run starts as a copy of."""
    corpus = (params.corpus or default_answers(target.spec.source)) if params.corpus_pool else None
    seeds = corpus_pools(corpus, target.model.config.vocab_size, params) if corpus else \
        TextPools(params.guesses, params.text_n, params.context)
    return corpus, seeds


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
