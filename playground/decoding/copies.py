"""Copies of earlier text as proposals: where the text so far ends with an n-gram seen before, the tokens that
followed it (prompt lookup, and the copies speculative decoding, Medusa and the engine graft on), and how far a copy
can take a text at best."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ..notes import NoteKind, Said, TokenText
from .proposer import Note


@dataclass(frozen=True, slots=True)
class Lookup:
    tokens: list[int]  # the proposal
    start: int  # position of its first token's source in the searched sequence
    ngram: int  # length of the matched suffix


@dataclass(frozen=True, slots=True)
class CopiedNote(NoteKind):
    """The trace's note of a copy: the [start, end) positions, in prompt and generated tokens, of the tokens copied,
    and the length of the match that ends at start (the last `ngram` tokens so far equal the `ngram` before it)."""

    KIND: ClassVar[str] = "copied"
    source: list[int]
    ngram: int

    def check(self) -> None:
        if len(self.source) != 2 or not 0 <= self.source[0] <= self.source[1]:
            raise ValueError(f"source: [start, end) with 0 <= start <= end, got {self.source}")
        if self.ngram < 1:
            raise ValueError(f"ngram: a match of at least 1 token, got {self.ngram}")

    def say(self, draft: Any, text: TokenText) -> Said:
        start, end = self.source
        return Said(origin=f" copied from positions {start}..{end - 1} after a {self.ngram}-token match",
                    beside=("a second copy", "{n} more copies"))

    def span(self) -> tuple[int, int]:
        return self.source[0], self.source[1]


@dataclass(frozen=True, slots=True)
class Copied(Note):
    """Where a proposal's copied nodes come from, for the trace (`CopiedNote`): the [start, end) positions of their
    source in the text so far and the length of the match that ends at start. In a chain (`chain`) the nodes are
    the source's tokens in order, so the proposal's first n nodes come from its first n positions. base: the note
    of the tree the copy was grafted onto."""

    start: int
    end: int
    ngram: int
    chain: bool = False
    base: Note | None = None

    def drafted(self) -> int:
        return self.base.drafted() if self.base is not None else 0

    def shown(self) -> CopiedNote:
        return CopiedNote([self.start, self.end], self.ngram)

    def first(self, n: int) -> Copied:
        base = self.base.first(n) if self.base is not None else None
        return replace(self, end=min(self.end, self.start + n) if self.chain else self.end, base=base)


def occurrences(sequence: list[int], max_ngram: int) -> Iterator[tuple[int, int]]:
    """(n, end) for every earlier occurrence sequence[end - n : end] of the last n tokens, n = max_ngram, ..., 1,
    each n's occurrences from the most recent backwards; end < len(sequence), so a token follows each one."""
    length = len(sequence)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = sequence[length - n :]
        for end in range(length - 1, n - 1, -1):
            if sequence[end - n : end] == suffix:
                yield n, end


def find_continuations(sequence: list[int], max_ngram: int, num_draft: int,
                       eos_ids: frozenset[int] = frozenset(), limit: int = 1) -> list[Lookup]:
    """Up to `limit` distinct copies: the tokens that followed earlier occurrences of the longest matching suffix
    of `sequence`, best first.

    Suffix lengths max_ngram, ..., 1 are tried in turn; for each, occurrences are scanned from the most recent
    backwards (recent text is the likeliest to be repeated next), so the first copy is that of the latest
    occurrence of the longest match; an occurrence whose copy equals an earlier pick is skipped. A copy stops
    after an end-of-sequence token, which can only be followed by another turn.
    """
    found: list[Lookup] = []
    for n, end in occurrences(sequence, max_ngram):
        copied = sequence[end : end + num_draft]
        for i, token in enumerate(copied):
            if token in eos_ids:
                copied = copied[: i + 1]
                break
        if all(copied != other.tokens for other in found):
            found.append(Lookup(copied, end, n))
            if len(found) == limit:
                break
    return found


def find_continuation(sequence: list[int], max_ngram: int, num_draft: int,
                      eos_ids: frozenset[int] = frozenset()) -> Lookup | None:
    """The best copy `find_continuations` ranks first, if any."""
    found = find_continuations(sequence, max_ngram, num_draft, eos_ids)
    return found[0] if found else None


def agreement(proposal: list[int], future: list[int]) -> int:
    """How many of the proposal's first tokens equal the target's next tokens: what greedy acceptance keeps."""
    agreed = 0
    for proposed, wanted in zip(proposal, future):
        if proposed != wanted:
            break
        agreed += 1
    return agreed


def best_copy(sequence: list[int], future: list[int], max_ngram: int, num_draft: int) -> int:
    """How many of `future`'s first tokens the best single copy proposal could match: over every occurrence
    `find_continuation` considers, the longest agreement between the num_draft tokens that followed it and
    `future`. An oracle: `find_continuation` must commit to one occurrence without seeing `future`."""
    return max((agreement(sequence[end : end + num_draft], future) for _, end in occurrences(sequence, max_ngram)),
               default=0)


@dataclass(frozen=True, slots=True)
class CopyBound:
    tokens_per_forward: float  # proposing the best copy every step; bonus included, as metrics count it
    speedup: float  # over plain decoding, proposing only copies that pay for a forward costing verify_cost steps


def copy_bound(prompt_ids: list[int], output_ids: list[int], max_ngram: int, num_draft: int,
               verify_cost: float) -> CopyBound:
    """What any prompt-lookup proposer that copies one earlier span per step could reach on this output (plain
    decoding's tokens for this prompt), taking each step the best copy (`best_copy`).

    It bounds the tokens a step can commit, not how a proposer picks its span. The speedup proposes a copy only
    when its tokens plus the target's own exceed verify_cost one-token steps (else the step is plain), leaves
    prefill out and prices every verification alike: an estimate, shown next to the measured figures.
    """
    if not output_ids:
        raise ValueError("output_ids must hold at least one token")

    def walk(cost_per_verify: float) -> tuple[int, float]:
        known, forwards, cost = 1, 0, 0.0  # the first output token comes from the prefill
        while known < len(output_ids):
            agree = best_copy(list(prompt_ids) + list(output_ids[:known]), list(output_ids[known:]), max_ngram,
                              num_draft)
            committed = min(agree + 1, len(output_ids) - known)
            proposes = committed > cost_per_verify
            known += committed if proposes else 1
            cost += cost_per_verify if proposes else 1.0
            forwards += 1
        return forwards, cost

    generated = len(output_ids) - 1
    forwards, _ = walk(1.0)  # a copy that commits anything is worth proposing when verifying is free
    _, cost = walk(verify_cost)
    return CopyBound(generated / forwards if forwards else 1.0, generated / cost if cost else 1.0)
