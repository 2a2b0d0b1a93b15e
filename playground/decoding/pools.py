"""The n-gram pools lookahead decoding verifies its candidates from: the Jacobi window's n-grams and the text's,
keyed by the last one to K tokens of context, seeded from the target's own answers to other prompts."""

from __future__ import annotations

from collections import Counter, OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from ..models import LoadedModel
from ..models.answers import default_answers, load_answers

if TYPE_CHECKING:
    from .lookahead import LookaheadParams


class NGramPool:
    """n-grams keyed by their first `key` tokens; at most `guesses` continuations per key, least recently used
    evicted. The paper's pool has key 1; longer keys hold the text's n-grams by more context (see `TextPools`)."""

    def __init__(self, guesses: int, key: int = 1, base: NGramPool | None = None) -> None:
        """`base`: a pool this one starts as a copy of, copied one key at a time when that key is first written
        (seeding tens of thousands of n-grams afresh cost ~0.1 s per run); the base must not change afterwards."""
        if base is not None and (base.guesses, base.key) != (guesses, key):
            raise ValueError("base: a pool with the same guesses and key is required")
        self.guesses: int = guesses
        self.key: int = key
        self._by_key: dict[tuple[int, ...], OrderedDict[tuple[int, ...], None]] = {}
        self._base: dict[tuple[int, ...], OrderedDict[tuple[int, ...], None]] = {} if base is None else base._by_key
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
        if entries is None:
            entries = self._base.get(key, OrderedDict())
        return list(reversed(entries))

    def __len__(self) -> int:
        return self._size


class TextPools:
    """The verification branch's source: pools keyed by the last 1..`context` tokens (K), looked up longest key
    first, as an n-gram language model backs off.

    The key-1 pool is the paper's: the window's n-grams and the text's M-grams. Pool k > 1 holds the text's
    (k + M - 1)-grams keyed by their first k tokens, so its continuations have the same M - 1 tokens but follow a
    longer match: after "the" many phrases go on, after "of the" fewer. A step takes up to G continuations from
    the longest key that has any, then shorter ones, skipping a guess that starts one already taken and letting
    a longer guess replace one it starts; the forward stays as wide as with one pool (docs/results.md has what
    each K measured)."""

    def __init__(self, guesses: int, text_ngram: int, context: int, base: TextPools | None = None) -> None:
        """`base`: pools of the same settings this one starts as a copy of (see `NGramPool`)."""
        self.guesses, self.text_ngram = guesses, text_ngram
        starts: list[NGramPool | None] = [None] * context if base is None else list(base.pools)
        self.pools: list[NGramPool] = [NGramPool(guesses, key, start)
                                       for key, start in zip(range(1, context + 1), starts, strict=True)]

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


def seed_pools(target: LoadedModel, params: LookaheadParams) -> tuple[str | None, TextPools]:
    """For resolved settings: the answers file the pools are seeded from (None: no corpus pool) and the seeded
    pools every run starts as a copy of."""
    corpus = (params.corpus or default_answers(target.spec.source)) if params.corpus_pool else None
    seeds = corpus_pools(corpus, target.model.config.vocab_size, params) if corpus else \
        TextPools(params.guesses, params.text_n, params.context)
    return corpus, seeds


def start_pools(seeds: TextPools, params: LookaheadParams, prompt_ids: list[int]) -> TextPools:
    """A sequence's own pools: a copy of the seeds, with the prompt's n-grams where `params.prompt_pool` says."""
    pools = TextPools(params.guesses, params.text_n, params.context, base=seeds)
    if params.prompt_pool:
        pools.add_text(prompt_ids)
    return pools
