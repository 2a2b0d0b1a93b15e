"""Lookahead decoding (Fu et al. 2024): Jacobi iteration makes n-grams, one forward both makes and checks them.

Each step's forward holds, for each request, three branches kept apart by the attention mask:
- the last committed token x;
- the lookahead branch: a window of N - 1 rows by W columns of guessed tokens, the proposal's probes (never kept:
  `Proposal.probes`). Token (row l, column i) sits at position P + 1 + i + l and sees x, row 0 up to column i and
  rows 1..l of column i: a consecutive text, so the window is a tree (`jacobi_tree`).
  The target's argmax after the last row gives a new row; each column read top to bottom plus its new token is an
  n-gram for the pool, and the window slides up one row;
- the verification branch: up to G n-grams from the pools that start with x, merged into a tree. Besides the
  window's n-grams, the pools hold the prompt's (`prompt_pool`) and those of the text committed so far
  (`output_pool`), of `text_ngram` M tokens (default N). Before them the pool is seeded (`corpus_pool`) with the
  most frequent M-grams of the target's own answers to other prompts: its habitual phrases, in the spirit of
  retrieval-based drafting (REST, He et al. 2023). The text's n-grams are also kept keyed by their first 2..K
  tokens (`context`), and the candidates following the longest run of x and the tokens before it come first
  (`TextPools`).
The engine accepts along the tree as for any proposal and keeps the accepted path; the window's rows are dropped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from ..config import ConfigError, check_int
from ..kv import KVCache
from ..models import LoadedModel
from ..notes import NoteKind, Said, TokenText, ngram_html, token_html
from ..viz.steps import draft_paths
from .planning import NgramAcceptance
from .pools import TextPools, seed_pools, start_pools
from .proposer import Cost, Note, Outcome, Proposal, Proposer, RequestView, candidates
from .spec import Algorithm, Setting


@dataclass(frozen=True, slots=True)
class LookaheadParams:
    """Lookahead decoding. window: W columns of the Jacobi window; ngram: N, the size of the n-grams the window
    yields (it keeps N - 1 rows); guesses: G, the most n-grams kept per first token and verified per step (how many
    of them a step verifies is the engine's to plan from this machine's measured forward costs); prompt_pool: seed
    the pool with the prompt's own n-grams; output_pool: add every n-gram of the committed text; text_ngram: M,
    the size of the n-grams those two and the corpus pool take from text (None: N); a longer M verifies longer
    copies, since text repeats in longer runs than the window guesses, in wider forwards.
    corpus_pool: before the prompt's, seed the pool with the G most frequent M-grams per first token of the
    target's own answers in `corpus` (a file `python -m playground.train ngrams` writes; None: the one shipped
    for the embedded target, and no seeding for a target without one). context: K, the longest run of trailing
    tokens candidates are looked up by: the text's n-grams are also kept keyed by their first 2..K tokens, and a
    step takes the continuations of the longest matching key first (1: the paper's pool, keyed by the last token
    only); it changes which G n-grams are verified, not how many.
    """

    window: int = 1
    ngram: int = 3
    guesses: int = 2
    prompt_pool: bool = True
    output_pool: bool = True
    text_ngram: int | None = None
    corpus_pool: bool = True
    corpus: str | None = None
    context: int = 3

    def __post_init__(self) -> None:
        check_int("window", self.window, 1, 16)
        check_int("ngram", self.ngram, 2, 8)
        check_int("guesses", self.guesses, 1, 16)
        if self.text_ngram is not None:
            check_int("text_ngram", self.text_ngram, 2, 16)
        check_int("context", self.context, 1, 8)
        if self.corpus is not None and (not isinstance(self.corpus, str) or not self.corpus.strip()):
            raise ConfigError(f"corpus must be a file path or None, got {self.corpus!r}")
        for name in ("prompt_pool", "output_pool", "corpus_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def text_n(self) -> int:
        """M, the size of the n-grams the prompt, output and corpus pools take."""
        return self.ngram if self.text_ngram is None else self.text_ngram


def jacobi_tree(window: list[list[int]], first: int) -> tuple[list[int], list[int]]:
    """The Jacobi window as a tree of probes after the last committed token x: its tokens (rows l = 0..N-2 of W
    columns, row by row) and each one's parent row, the window's first token at row `first`. Row 0 is a chain from x
    and each column hangs below its row-0 token, so token (l, i) sits at depth 1 + i + l and sees x, row 0 up to
    column i and rows 1..l of column i: a consecutive text after x, as lookahead's mask has it."""
    width = len(window[0])
    tokens = [token for row in window for token in row]
    parents = [(0 if i == 0 else first + i - 1) if r == 0 else first + (r - 1) * width + i
               for r in range(len(window)) for i in range(width)]
    return tokens, parents


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


@dataclass(frozen=True, slots=True)
class Jacobi(Note, NoteKind):
    """A lookahead step as the trace shows it (its own note): the Jacobi window it ran (N - 1 rows of W token ids,
    oldest row first), the number of n-grams in the pools, and the pools' candidates for the last tokens (its hits),
    each found after its last `keys` tokens."""

    KIND: ClassVar[str] = "jacobi"
    window: list[list[int]]
    pool_size: int
    candidates: list[list[int]]
    keys: list[int] | None = None  # per candidate, how many trailing tokens it was keyed by (None: 1 each)

    def shown(self) -> Jacobi:
        return self

    def check(self) -> None:
        if self.keys is not None and len(self.keys) != len(self.candidates):
            raise ValueError(f"keys: one entry per candidate ({len(self.candidates)}), got {len(self.keys)}")
        if self.pool_size < 0:
            raise ValueError(f"pool_size: a count is at least 0, got {self.pool_size}")

    def say(self, draft: Any, text: TokenText) -> Said:
        """The window (oldest row first) and the pool's candidates for the last token, the verified ones outlined."""
        rows = "".join(f"<tr><th>row {r + 1}</th>{''.join(f'<td>{token_html(i, text)}</td>' for i in row)}</tr>"
                       for r, row in enumerate(self.window))
        verified = draft_paths(draft)  # as set, every hit; measured, those that pay
        outlined = ("" if not self.candidates else " (the verified ones outlined)" if verified else
                    " (none verified this step: the plan did not pay for a wider forward)")
        keys = self.keys or [1] * len(self.candidates)
        hits = "".join(f"{ngram_html(c, text, 'pg-verified' if c in verified else '')}<sub>after {k}</sub>"
                       for c, k in zip(self.candidates, keys))
        return Said(block=f"<div>Jacobi window (oldest row first; each column's tokens plus the newest guess make an "
                          f"n-gram for the pool):</div><table>{rows}</table>"
                          f"<div>pool: {self.pool_size} n-grams; {len(self.candidates)} hit(s), each found after "
                          f"the last k tokens{outlined}: {hits or '-'}</div>")

    def ids(self) -> list[int]:
        return [i for row in (*self.window, *self.candidates) for i in row]


@dataclass
class _Sequence:
    """A request's lookahead state: its pools, Jacobi window, acceptance per key length and the key each node of
    its last proposal was found by."""

    pools: TextPools
    window: list[list[int]]
    pooled: int  # leading tokens whose n-grams are in the pools
    accepted: NgramAcceptance
    keys: list[int] = field(default_factory=list)


class LookaheadProposer(Proposer):
    """Lookahead in the engine: each decoding request's candidates from its own pools, merged into a tree, with its
    Jacobi window run after them as probes, the target's greedy tokens after whose last row are its next row."""

    label = "lookahead"

    def __init__(self, target: LoadedModel, params: LookaheadParams | None = None) -> None:
        params = params or LookaheadParams()
        self.lookahead = la = params
        self.corpus, self.seeds = seed_pools(target, la)  # every request's pools start as copies of these
        self.states: dict[int, _Sequence] = {}

    def bind(self, settings: Any, cache: KVCache) -> None:
        self.states = {}

    def start(self, request: RequestView) -> None:
        la = self.lookahead
        self.states[request.id] = _Sequence(start_pools(self.seeds, la, request.prompt_ids),
                                            first_window(request.prompt_ids, la, request.sampling.seed),
                                            len(request.prompt_ids), NgramAcceptance(la.context))

    def end(self, request: RequestView) -> None:
        self.states.pop(request.id, None)

    def propose(self, requests: Sequence[RequestView], rooms: list[int], cost: Cost) -> dict[int, Proposal]:
        """Candidates and window for each request with room; the window's rows are paid for as they come (they feed
        the pools, not this step), the candidates by their expected tokens."""
        proposals = {}
        for request, room in zip(requests, rooms):
            state = self.states[request.id]
            state.accepted.decay()
            if not room:
                continue
            if self.lookahead.output_pool:  # the answer's own phrases are likely to come back
                state.pools.add_text(request.tokens[: request.num_computed], state.pooled)
                state.pooled = request.num_computed
            found, keys = state.pools.candidates(request.tokens)
            shown = Jacobi([list(row) for row in state.window], len(state.pools), [list(c[:room]) for c in found],
                           list(keys))
            proposal, source = candidates([c[:room] for c in found], [state.accepted.acceptance(k) for k in keys],
                                          self.label)
            state.keys = [keys[c] for c in source]
            probes, parents = jacobi_tree(state.window, len(proposal.tokens) + 1)
            proposals[request.id] = replace(
                proposal, tokens=proposal.tokens + probes, parents=proposal.parents + parents,
                sources=proposal.sources + [self.label] * len(probes), reach=proposal.reach + [0.0] * len(probes),
                probs=proposal.probs + [None] * len(probes), probes=len(probes), note=shown)
        return proposals

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        state = self.states[request.id]
        if proposal is None:
            return
        path, candidates = outcome.path, proposal.verified()
        if candidates.tokens:  # the candidate the kept path follows (where none was kept, the first)
            end = path[-1] if path else 0
            key = state.keys[path[0] - 1 if path else 0]
            state.accepted.record(key, len(path), len(path) + (end in candidates.parents))
        state.window = slide(state.window, outcome.probed[-len(state.window[-1]) :], state.pools)  # its last row

    def describe(self) -> dict[str, Any]:
        la = self.lookahead
        return {"proposer": self.label, "window": la.window, "ngram": la.ngram, "guesses": la.guesses,
                "text_ngram": la.text_n, "context": la.context, "prompt_pool": la.prompt_pool,
                "output_pool": la.output_pool, "corpus": self.corpus and Path(self.corpus).name}


ALGORITHM = Algorithm(
    "lookahead", "lookahead", "lookahead decoding (--algo lookahead)", LookaheadParams, LookaheadProposer,
    (Setting("window", "Jacobi window width W, 1..16", label="window W (1..16)"),
     Setting("ngram", "n-gram size N (window of N - 1 rows), 2..8", label="n-gram N (2..8)"),
     Setting("guesses", "n-grams kept per first token and verified per step G, 1..16",
             label="guesses G (1..16)"),
     Setting("context", "look candidates up by the last K tokens first, then fewer, down to the last one, 1..8 (1: "
                        "keyed by the last token only, as in the paper)", label="context K (1..8)"),
     Setting("text_ngram", "size M of the n-grams the prompt, output and corpus pools take from text, 2..16 "
                           "(default: N; a longer M verifies longer copies in wider forwards)",
             label="text n-gram M (0 = N, 2..16)", auto=True),
     Setting("prompt_pool", "seed the n-gram pool from the prompt", flag="--no-prompt-pool",
             label="pool: the prompt's n-grams", kind=bool, switch=False),
     Setting("output_pool", "add the committed text's n-grams to the pool (else only the window's)",
             flag="--no-output-pool", label="pool: the text so far", kind=bool, switch=False),
     Setting("corpus_pool", "seed the pool from the target's answers to other prompts", flag="--no-corpus-pool",
             label="pool: the target's habitual phrases", kind=bool, switch=False),
     Setting("corpus", "answers file (`python -m playground.train ngrams`) whose most frequent n-grams seed the pool "
                       "(default: the one shipped for the embedded model)", kind=str)),
    sources={"lookahead": ("Lookahead", "candidate")}, notes=(Jacobi,), colour="#009e73",
    example="List the days of the week, one per line.")
