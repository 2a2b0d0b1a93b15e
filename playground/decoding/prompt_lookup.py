"""Prompt lookup (Saxena 2023): proposals copied from earlier text, no draft model.

For each decoding request: the longest suffix of its text so far (up to max_ngram tokens, then shorter) that occurs
earlier; the num_draft tokens that followed its latest earlier occurrences (cut after an end-of-sequence token),
up to `branches` copies merged into one tree. A wider forward is not free, so `NgramAcceptance` keeps, per matched
n-gram length, a running estimate of how often a copied token is accepted, and a copy is proposed only when the
tokens it is expected to commit pay for its rows at this machine's measured forward costs. It changes which steps
propose, never which tokens come out.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from ..config import MAX_GAMMA, MAX_NGRAM, check_int
from ..kv import KVCache
from ..models import LoadedModel
from .copies import Copied, CopiedNote, Lookup, find_continuations
from .planning import NgramAcceptance, plan_width, widest_paying
from .proposer import Cost, Outcome, Proposal, Proposer, RequestView, candidates
from .spec import Algorithm, Setting

MAX_BRANCHES = 8  # distinct copies prompt lookup verifies in one forward
# prompt lookup's copies: LOOKUP_BRANCHES of LOOKUP_BRANCH_TOKENS each by default, LOOKUP_TOKENS for a copy alone
LOOKUP_BRANCHES, LOOKUP_BRANCH_TOKENS, LOOKUP_TOKENS = 2, 5, 8


@dataclass(frozen=True, slots=True)
class PromptLookupParams:
    """Prompt lookup (Saxena 2023). max_ngram: the longest suffix of the text so far that is looked up (then
    shorter ones, down to 1); num_draft: the most tokens proposed after a match (None: LOOKUP_BRANCH_TOKENS with
    more than one branch, else LOOKUP_TOKENS, `resolve`); branches: how many distinct copies (of different earlier
    occurrences) one forward verifies, merged into a tree. How many of them a step verifies is the engine's to plan
    from this machine's measured forward costs."""

    max_ngram: int = 3
    num_draft: int | None = None
    branches: int = LOOKUP_BRANCHES

    def __post_init__(self) -> None:
        check_int("max_ngram", self.max_ngram, 1, MAX_NGRAM)
        if self.num_draft is not None:
            check_int("num_draft", self.num_draft, 1, MAX_GAMMA)
        check_int("branches", self.branches, 1, MAX_BRANCHES)

    def resolve(self) -> PromptLookupParams:
        """These settings with num_draft fixed (docs/defaults.md says why shorter copies go with more of them)."""
        tokens = LOOKUP_BRANCH_TOKENS if self.branches > 1 else LOOKUP_TOKENS
        return self if self.num_draft is not None else replace(self, num_draft=tokens)


class CopyProposer(Proposer):
    """Prompt lookup in the engine: each decoding request's copies of earlier text (up to `branches`, merged into a
    tree where they start alike), proposed when their n-gram lengths' running acceptance says the wider forward
    pays. Also the copy `grafted` puts onto the trees of a guesser or of EAGLE."""

    label = "copy"

    def __init__(self, target: LoadedModel, params: PromptLookupParams | None = None) -> None:
        params = params or PromptLookupParams()
        self.lookup = params.resolve()
        self.most = cast(int, self.lookup.num_draft)  # the most tokens a copy proposes, as `resolve` fixed it
        self.eos_ids = frozenset(target.eos_token_ids)
        self.accepted: dict[int, NgramAcceptance] = {}  # request id -> acceptance per matched n-gram length
        self.ngrams: dict[int, list[int | None]] = {}  # request id -> per node proposed, its copy's n-gram length

    def bind(self, settings: Any, cache: KVCache) -> None:
        self.accepted, self.ngrams = {}, {}

    def start(self, request: RequestView) -> None:
        self.accepted[request.id] = NgramAcceptance(self.lookup.max_ngram)

    def end(self, request: RequestView) -> None:
        self.accepted.pop(request.id, None)
        self.ngrams.pop(request.id, None)

    def decay(self, requests: Sequence[RequestView]) -> None:
        for request in requests:
            self.accepted[request.id].decay()

    def bound(self, request: RequestView, room: int) -> list[float]:
        """The most a copy could commit with k = 0.. tokens, at the request's best acceptance of any n-gram length."""
        accepted = self.accepted[request.id]
        return [accepted.best_expected_tokens(k) for k in range(min(self.most, room) + 1)]

    def find(self, request: RequestView, room: int, limit: int = 1) -> list[Lookup]:
        """Up to `limit` copies of at most `room` tokens each for the request, best first."""
        if room <= 0:
            return []
        return find_continuations(request.tokens, self.lookup.max_ngram, min(self.most, room),
                                  self.eos_ids, limit)

    def rate(self, request: RequestView, copy: Lookup) -> float:
        return self.accepted[request.id].acceptance(copy.ngram)

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
            note = Copied(first.start, first.start + len(first.tokens), first.ngram, chain=proposal.is_chain())
            proposal = replace(proposal, note=note)
            proposals[request.id] = self.remember(request, proposal, [found[c].ngram for c in source])
        return proposals

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        """The copy the kept path follows (where none was kept, the first) was judged up to its first refusal."""
        ngrams = self.ngrams.pop(request.id, None)
        if proposal is None or ngrams is None:
            return
        sources = proposal.sources
        rows = [i + 1 for i, s in enumerate(sources) if s == self.label]
        if not rows:
            return
        path = list(itertools.takewhile(lambda row: sources[row - 1] == self.label, outcome.path))
        end = path[-1] if path else 0
        refused = any(proposal.parents[row - 1] == end for row in rows)
        ngram = ngrams[(path[0] if path else rows[0]) - 1]
        assert ngram is not None  # a copied node's match
        self.accepted[request.id].record(ngram, len(path), len(path) + refused)

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "max_ngram": self.lookup.max_ngram, "num_draft": self.lookup.num_draft,
                "branches": self.lookup.branches}


def _lookup_peer(proposer: CopyProposer) -> tuple[str, dict[str, Any]]:
    """transformers' prompt lookup with the same most copied tokens and longest match."""
    return "prompt lookup", {"prompt_lookup_num_tokens": proposer.lookup.num_draft,
                             "max_matching_ngram_size": proposer.lookup.max_ngram}


ALGORITHM = Algorithm(
    "prompt-lookup", "prompt lookup", "prompt-lookup decoding (--algo prompt-lookup)", PromptLookupParams,
    CopyProposer,
    (Setting("max_ngram", f"longest suffix looked up in the prompt and the text so far, 1..{MAX_NGRAM}",
             label="max n-gram (1..8)"),
     Setting("num_draft", f"most tokens copied after a match, 1..{MAX_GAMMA} (default {LOOKUP_BRANCH_TOKENS} with "
                          f"more than one branch, else {LOOKUP_TOKENS})",
             label="most tokens per proposal (0 = auto, 1..16)", auto=True),
     Setting("branches", "distinct copies (of different earlier occurrences) verified together in one forward, "
                         f"merged into a tree, 1..{MAX_BRANCHES}")),
    sources={"copy": ("Prompt lookup", "copied")}, notes=(CopiedNote,), colour="#e69f00",
    example="Summarise in one sentence: The city council voted on Tuesday to extend the bike lane on Main Street "
            "by two miles. The council said the extension will be finished next spring.", peer=_lookup_peer)
