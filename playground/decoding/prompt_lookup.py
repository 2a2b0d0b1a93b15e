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

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..config import GenerationParams, PromptLookupParams, SamplingParams
from ..models import LoadedModel
from ..trace import DraftEvent, VerifyEvent
from .base import Decoder, EventStream, commit_event, new_cache
from .chain import accept_chain, one_hot, verify_candidates


@dataclass(frozen=True, slots=True)
class Lookup:
    tokens: list[int]  # the proposal
    start: int  # position of its first token's source in the searched sequence
    ngram: int  # length of the matched suffix


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


class RunningAcceptance:
    """How often proposed tokens are accepted: accepted / judged proposals, starting from an optimistic prior
    of 2 / 3 (so that proposing is tried on every new text) and decaying towards it every step, so the estimate
    follows the text and a source that fell out of favour is tried again after a while."""

    PRIOR_ACCEPTED, PRIOR_JUDGED = 2 / 3, 1.0
    DECAY = 0.95

    def __init__(self) -> None:
        self.accepted, self.judged = self.PRIOR_ACCEPTED, self.PRIOR_JUDGED

    def rate(self) -> float:
        return self.accepted / self.judged

    def expected_tokens(self, length: int) -> float:
        """1 + a + ... + a^length: the tokens a step commits, bonus included, when each of `length` proposals is
        accepted with probability a given the previous one was."""
        a = self.rate()
        return sum(a**i for i in range(length + 1))

    def record(self, accepted: int, judged: int) -> None:
        self.accepted += accepted
        self.judged += judged

    def decay(self) -> None:
        d = self.DECAY
        self.accepted = self.PRIOR_ACCEPTED + d * (self.accepted - self.PRIOR_ACCEPTED)
        self.judged = self.PRIOR_JUDGED + d * (self.judged - self.PRIOR_JUDGED)


class ProposalGate:
    """Proposes a match only when the expected tokens a step commits with its K copied tokens
    (`RunningAcceptance.expected_tokens`, estimated per matched n-gram length) exceed the step's cost,
    1 + overhead one-token steps."""

    def __init__(self, overhead: float, max_ngram: int) -> None:
        self.overhead = overhead
        self.by_ngram = [RunningAcceptance() for _ in range(max_ngram + 1)]  # indexed by matched n-gram length

    def acceptance(self, ngram: int) -> float:
        return self.by_ngram[ngram].rate()

    def expected_tokens(self, ngram: int, length: int) -> float:
        return self.by_ngram[ngram].expected_tokens(length)

    def best_expected_tokens(self, length: int) -> float:
        """The most `expected_tokens` any matched n-gram length gives a copy of `length` tokens: a bound for a copy
        not looked up yet."""
        return max(estimate.expected_tokens(length) for estimate in self.by_ngram[1:])

    def worth(self, ngram: int, length: int) -> bool:
        return self.expected_tokens(ngram, length) > 1.0 + self.overhead

    def record(self, ngram: int, accepted: int, judged: int) -> None:
        self.by_ngram[ngram].record(accepted, judged)

    def decay(self) -> None:
        for estimate in self.by_ngram:
            estimate.decay()


# A batched decode forward's cost in passes of the CPU kernel over the weights: fixed work, then one unit per pass,
# then a little per token (attention, norms). Fitted on a 2-core Zen 3 EPYC (AVX2, 6 rows per pass, 250 tokens of
# context, the embedded model): 5.7 ms fixed, 9.3 ms a pass, 0.13 ms a token over batches of 1..16 rows of 1..8
# tokens; the fit is within 0.98-1.46x of the measured ratios (README, Paged KV cache).
PASS_FIXED, PASS_PER_TOKEN = 0.6, 0.014


def batch_step_cost(rows_per_pass: int | None, batch: int, width: int, overhead: float) -> float:
    """What a decode forward over `batch` sequences of `width` tokens each costs, relative to the same batch's
    one-token forward: from the passes of the CPU kernel it takes (`Transformer.rows_per_pass`), or, where there
    is no such pass (a GPU, PyTorch's kernels), 1 + `overhead` for any width over 1, as at batch 1."""
    if width == 1:
        return 1.0
    if rows_per_pass is None:
        return 1.0 + overhead

    def cost(tokens: int) -> float:
        return PASS_FIXED + math.ceil(tokens / rows_per_pass) + PASS_PER_TOKEN * tokens
    return cost(batch * width) / cost(batch)


def at(gains: list[float], k: int) -> float:
    """gains[k], or the last entry for k past the end (a proposal cannot grow longer)."""
    return gains[min(k, len(gains) - 1)]


def widest_paying(bounds: list[list[float]], cost: Callable[[int], float]) -> int:
    """The widest decode forward at which a batch could commit more tokens per unit of cost than a plain one, were
    every sequence to commit its bound (bounds[r][k]: the most sequence r could commit with k proposed tokens); 1
    when none could. Where `plan_width` picks the best width for expected tokens, this bounds the work worth doing
    before any expectation is known."""
    longest = max(len(b) for b in bounds)
    return max((w for w in range(2, longest + 1) if sum(at(b, w - 1) for b in bounds) > len(bounds) * cost(w)),
               default=1)


def plan_width(gains: list[list[float]], cost: Callable[[int], float]) -> int:
    """The width (tokens per sequence: the last token and up to width - 1 copied ones) of a batch's decode forward
    that commits the most tokens per unit of cost. gains[r][k]: the tokens sequence r is expected to commit with the
    first k tokens of its copy verified (gains[r][0] = 1, a plain step); cost(width): the forward's cost relative to
    a one-token forward (cost(1) = 1). The narrowest width wins ties, so a batch with nothing to gain runs plain."""
    best, best_rate = 1, float(len(gains))
    for width in range(2, 1 + max((len(g) for g in gains), default=1)):
        committed = sum(at(g, width - 1) for g in gains)
        if committed / cost(width) > best_rate:
            best, best_rate = width, committed / cost(width)
    return best


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
