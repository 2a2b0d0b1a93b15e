"""REST (He et al. 2023): retrieval drafts from a datastore of text, no model forward of its own.

The datastore is a corpus of token ids with a suffix array over it (`Datastore`, numpy, memory-mapped, built once and
cached): every place of the corpus, sorted by the text that follows it, so that the places where any run of tokens
occurs are one range of it, found by binary search. Each step, for each decoding request: the longest suffix of its
text (up to `max_suffix` tokens) that occurs in the corpus; the tokens that followed its occurrences (up to
`SAMPLED` of them, spread over the range, `depth` deep) counted into a trie; the `nodes` most frequent continuations
proposed as a tree, verified in the step's one forward like any tree. A node's chance of being kept is its frequency
after its parent, calibrated per depth by how often retrieved nodes were kept (`GuessCalibration`).

The default corpus is the embedded target's own answers to the training prompts (`models.answers`, shipped); any
text or JSONL file names another (`python -m playground.train datastore` builds it with progress; the first use
builds it too).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..config import MAX_DYNAMIC_NODES, MAX_GAMMA, ConfigError, check_int
from ..models import LoadedModel, Transformer
from ..models.answers import default_answers, read_answers
from ..notes import NoteKind, Said, TokenText, ngram_html
from ..paths import default_cache_root
from .guesses import GuessCalibration
from .planning import widest_paying
from .proposer import Cost, Note, Outcome, Proposal, Proposer, RequestView
from .spec import Algorithm, Setting, Variant

MAX_SUFFIX = 16  # the longest suffix of the text looked up
SAMPLED = 256  # the most occurrences of a match whose continuations are counted
SEPARATOR = -1  # between documents in the corpus: no match or continuation runs across it
FORMAT = 1  # the datastore's layout on disk; a new one rebuilds
TEXT_CHUNK = 1 << 16  # characters of a text file tokenised in one piece (cut after a newline)
Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RestParams:
    """REST. corpus: a text file (.txt, .md, ...; tokenised whole) or a JSONL file (one document per row: its "text",
    else its string fields in order), tokenised with the target's tokenizer (None: the embedded target's shipped
    answers to the training prompts); max_suffix: the longest suffix of the text looked up in the datastore (then
    shorter, down to 1); nodes: the most continuations' tokens proposed per step, as a trie; depth: the most tokens a
    continuation runs ahead. How many nodes a step verifies is the engine's to plan from this machine's measured
    forward costs."""

    corpus: str | None = None
    max_suffix: int = 8
    nodes: int = 8
    depth: int = 6

    def __post_init__(self) -> None:
        if self.corpus is not None and (not isinstance(self.corpus, str) or not self.corpus.strip()):
            raise ConfigError(f"corpus must be a text or JSONL file or None, got {self.corpus!r}")
        check_int("max_suffix", self.max_suffix, 1, MAX_SUFFIX)
        check_int("nodes", self.nodes, 1, MAX_DYNAMIC_NODES)
        check_int("depth", self.depth, 1, MAX_GAMMA)


# -- the datastore ---------------------------------------------------------------------------------------------


def suffix_array(tokens: np.ndarray, progress: Progress | None = None) -> np.ndarray:
    """The places of `tokens` (N,) sorted by the text from each place on (N,) int32, by prefix doubling: after round
    r every place is ranked by its first 2^r tokens, the rank pairs (rank at i, rank at i + 2^r) sorted give the
    ranks by 2^(r+1), until every rank differs. A text's end sorts before any token."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    _, rank = np.unique(tokens, return_inverse=True)  # (N,) dense ranks by the first token
    rank = rank.astype(np.int64)
    span = 1
    while True:
        after = np.zeros(n, dtype=np.int64)  # rank + 1 of the place `span` on; 0 past the end
        after[: n - span] = rank[span:] + 1
        key = rank * (n + 1) + after  # (N,) < N (N + 1): fits int64 for any corpus int32 indexes
        order = np.argsort(key, kind="stable")
        ordered = key[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.concatenate(([0], np.cumsum(ordered[1:] != ordered[:-1])))
        rank = new
        if progress is not None:
            progress(f"sorted by the first {2 * span} tokens: {int(rank.max()) + 1:,} of {n:,} places apart")
        if rank.max() == n - 1 or span >= n:
            return order.astype(np.int32)
        span *= 2


class Datastore:
    """A corpus of token ids (documents joined by SEPARATOR) and its suffix array, memory-mapped from a folder."""

    TOKENS, SUFFIXES, META = "tokens.npy", "suffixes.npy", "meta.json"

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, meta: dict[str, Any]) -> None:
        self.tokens, self.suffixes, self.meta = tokens, suffixes, meta  # (N,) int32 each

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def build(cls, documents: Sequence[Sequence[int]], meta: dict[str, Any],
              progress: Progress | None = None) -> Datastore:
        joined: list[int] = []
        for document in documents:
            if document:
                joined.extend(document)
                joined.append(SEPARATOR)
        tokens = np.asarray(joined, dtype=np.int32)
        return cls(tokens, suffix_array(tokens, progress), {**meta, "format": FORMAT, "tokens": len(tokens)})

    def save(self, folder: Path) -> None:
        """Written to a folder beside `folder` and renamed into place: a reader never sees half a datastore."""
        part = folder.with_name(f"{folder.name}.{os.getpid()}.part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        np.save(part / self.TOKENS, self.tokens)
        np.save(part / self.SUFFIXES, self.suffixes)
        (part / self.META).write_text(json.dumps(self.meta, indent=2), encoding="utf-8")
        try:
            part.rename(folder)
        except OSError:  # another process wrote it first
            shutil.rmtree(part, ignore_errors=True)

    @classmethod
    def open(cls, folder: Path) -> Datastore | None:
        """The datastore in `folder` (memory-mapped; never unpickled), None where there is none of this format."""
        try:
            meta = json.loads((folder / cls.META).read_text(encoding="utf-8"))
            if meta.get("format") != FORMAT:
                return None
            tokens = np.load(folder / cls.TOKENS, mmap_mode="r", allow_pickle=False)
            suffixes = np.load(folder / cls.SUFFIXES, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):
            return None
        if tokens.shape != suffixes.shape or tokens.ndim != 1:
            return None
        return cls(tokens, suffixes, meta)

    def _bound(self, query: list[int], upper: bool) -> int:
        """The first index of the suffix array whose text, cut to len(query) tokens, is past `query` (upper) or not
        before it (lower)."""
        tokens, suffixes, m = self.tokens, self.suffixes, len(query)
        lo, hi = 0, len(suffixes)
        while lo < hi:
            mid = (lo + hi) // 2
            at = int(suffixes[mid])
            text = tokens[at : at + m].tolist()
            if text < query or (upper and text == query):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def range(self, query: list[int]) -> tuple[int, int]:
        """[lo, hi): the suffix array's places where `query` occurs."""
        return self._bound(query, False), self._bound(query, True)

    def longest_match(self, text: list[int], max_suffix: int) -> tuple[int, int, int]:
        """The longest suffix of `text` of at most max_suffix tokens that occurs: (its length, lo, hi); (0, 0, 0)
        where not even the last token does. Every shorter suffix of an occurring one occurs, so the length is
        found by binary search over lengths."""
        best = (0, 0, 0)
        short, long = 1, min(max_suffix, len(text))
        while short <= long:
            m = (short + long) // 2
            lo, hi = self.range(text[len(text) - m :])
            if hi > lo:
                best, short = (m, lo, hi), m + 1
            else:
                long = m - 1
        return best

    def continuations(self, lo: int, hi: int, skip: int, depth: int) -> np.ndarray:
        """(S, depth) the tokens after `skip` tokens at up to SAMPLED places of the range [lo, hi), spread evenly
        over it (the range is sorted by what follows, so the sample keeps the continuations' frequencies), in the
        range's order; SEPARATOR past a document's end."""
        count = hi - lo
        picks = lo + (np.arange(count) if count <= SAMPLED else (np.arange(SAMPLED) * count) // SAMPLED)
        starts = self.suffixes[picks].astype(np.int64) + skip  # (S,)
        at = starts[:, None] + np.arange(depth)  # (S, depth)
        inside = at < len(self.tokens)
        out = np.full(at.shape, SEPARATOR, dtype=np.int64)
        out[inside] = self.tokens[at[inside]]
        ended = np.cumsum(out == SEPARATOR, axis=1) > 0  # nothing after a document's end
        out[ended] = SEPARATOR
        return out


def trie(continuations: np.ndarray, nodes: int, stop: frozenset[int]) -> tuple[list[int], list[int], list[int]]:
    """The `nodes` most frequent prefixes of the continuations (S, D) (sorted as the suffix array sorts them) as a
    tree: (tokens, parents, counts), node i following row parents[i] (0: the matched text, i + 1: node i), most
    frequent first, so that every parent comes before its children (a child is never more frequent; a tie goes to
    the shallower). No node follows a token of `stop` (an end of sequence) or a document's end."""
    rows, depth = continuations.shape
    found: list[tuple[int, int, int, int, int]] = []  # (-count, depth, run start, token, parent key)
    previous = np.zeros(1, dtype=np.int64)  # run starts at the depth before (the root: one run from 0)
    for d in range(depth):
        column = continuations[:, d]
        apart = np.zeros(rows, dtype=bool)
        apart[0] = True
        if d:
            apart[1:] |= np.any(continuations[1:, :d] != continuations[:-1, :d], axis=1)
        apart[1:] |= column[1:] != column[:-1]
        starts = np.flatnonzero(apart)
        counts = np.diff(np.append(starts, rows))
        parents = np.searchsorted(previous, starts, side="right") - 1  # the run at d - 1 each run lies in
        for start, count, parent in zip(starts.tolist(), counts.tolist(), parents.tolist()):
            token = int(column[start])
            if token != SEPARATOR:
                found.append((-count, d, start, token, int(previous[parent]) if d else -1))
        previous = starts
    keep: dict[tuple[int, int], int] = {(-1, -1): 0}  # (depth, run start) -> row
    tokens: list[int] = []
    parent_rows: list[int] = []
    counts_out: list[int] = []
    stopped: set[tuple[int, int]] = set()
    for negative, d, start, token, parent in sorted(found):
        key, up = (d, start), (d - 1, parent)
        if up not in keep or up in stopped:
            continue  # below a node not kept, or after an end of sequence
        if len(tokens) == nodes:
            break
        tokens.append(token)
        parent_rows.append(keep[up])
        counts_out.append(-negative)
        keep[key] = len(tokens)
        if token in stop:
            stopped.add(key)
    return tokens, parent_rows, counts_out


# -- corpora ---------------------------------------------------------------------------------------------------


def read_documents(path: Path) -> Iterator[str]:
    """The documents of a text file (one, in chunks of about TEXT_CHUNK characters cut after a newline) or a JSONL
    file (one per row: its "text", else its string fields joined by newlines)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() != ".jsonl":
        at = 0
        while at < len(text):
            cut = text.find("\n", at + TEXT_CHUNK)
            end = len(text) if cut < 0 else cut + 1
            yield text[at:end]
            at = end
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"corpus: {path} line {number} is not JSON ({exc})") from None
        strings = [row["text"]] if isinstance(row, dict) and isinstance(row.get("text"), str) else (
            [v for v in row.values() if isinstance(v, str)] if isinstance(row, dict) else [])
        if not strings:
            raise ConfigError(f"corpus: {path} line {number} must be an object with a \"text\" string (or string "
                              "fields)")
        yield "\n".join(strings)


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()[:20]


# Per loaded model, dropped with it: its tokenizer's vocabulary as the datastore's cache key reads it (serialising
# ~50k entries takes most of a proposer's making, which the app does every run)
_VOCABS: weakref.WeakKeyDictionary[Transformer, bytes] = weakref.WeakKeyDictionary()


def _vocab_digest(target: LoadedModel) -> bytes:
    if target.model not in _VOCABS:
        vocab = target.tokenizer.get_vocab()
        _VOCABS[target.model] = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=True).encode()).digest()
    return _VOCABS[target.model]


def datastore_for(target: LoadedModel, corpus: str | None, progress: Progress | None = None,
                  rebuild: bool = False) -> Datastore:
    """The datastore of `corpus` (None: the shipped answers of the target) for the target's tokenizer, from the
    cache (`$PLAYGROUND_CACHE/datastores`), built and cached where it is not there (or `rebuild`)."""
    source = corpus if corpus is not None else default_answers(target.spec.source)
    if source is None:
        raise ConfigError(f"corpus: no datastore ships for {target.spec.source!r}: name a text or JSONL file "
                          "(--rest-corpus FILE)")
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(f"corpus: no such file {source!r} (a text or JSONL file)")
    raw = path.read_bytes()
    vocab = target.model.config.vocab_size
    folder = default_cache_root() / "datastores" / _digest(raw, _vocab_digest(target), str(vocab).encode())
    store = None if rebuild else Datastore.open(folder)
    if store is not None:
        return store
    say = progress or (lambda message: None)
    start = time.perf_counter()
    if corpus is None:  # the shipped answers: token ids already
        documents, _ = read_answers(str(path))
    else:
        texts = list(read_documents(path))
        say(f"tokenising {len(raw) / 1e6:.1f} MB of {path.name} ({len(texts)} piece(s))")
        documents = []
        batch = 64
        for at in range(0, len(texts), batch):
            documents += target.tokenizer(texts[at : at + batch], add_special_tokens=False)["input_ids"]
            say(f"tokenised {min(at + batch, len(texts))} of {len(texts)} piece(s)")
        if path.suffix.lower() != ".jsonl":  # a text file's pieces are one document
            documents = [[token for piece in documents for token in piece]]
    if any(t < 0 or t >= vocab for document in documents for t in document):
        raise ConfigError(f"corpus: {path} holds token ids outside the target's vocabulary of {vocab}")
    say(f"indexing {sum(map(len, documents)):,} tokens")
    store = Datastore.build(documents, {"source": str(path), "vocab_size": vocab, "model": target.name}, say)
    store.save(folder)
    say(f"datastore of {len(store):,} tokens in {time.perf_counter() - start:.1f} s: {folder}")
    return Datastore.open(folder) or store


def print_progress(message: str) -> None:
    print(f"[datastore] {message}", file=sys.stderr, flush=True)


# -- the proposer ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Retrieved(Note, NoteKind):
    """What a retrieval proposal came from, for the trace (its own note): the trailing tokens matched in the
    datastore and how many times they occur there."""

    KIND: ClassVar[str] = "retrieved"
    suffix: list[int]
    hits: int

    def shown(self) -> Retrieved:
        return self

    def check(self) -> None:
        if not self.suffix:
            raise ValueError("suffix: the tokens matched, at least one")
        if self.hits < 1:
            raise ValueError(f"hits: a match found at least once, got {self.hits}")

    def say(self, draft: Any, text: TokenText) -> Said:
        hits = f"{self.hits} hit" + ("" if self.hits == 1 else "s")
        return Said(origin=f" retrieved after the last {len(self.suffix)} token(s) {ngram_html(self.suffix, text)} "
                           f"({hits} in the datastore)")

    def ids(self) -> list[int]:
        return list(self.suffix)


class RestProposer(Proposer):
    """REST in the engine: each decoding request's trie of the continuations of its longest suffix found in the
    datastore, each node's chance of being kept its frequency after its parent, calibrated per depth."""

    label = "rest"

    def __init__(self, target: LoadedModel, params: RestParams | None = None, datastore: Datastore | None = None
                 ) -> None:
        self.params = params or RestParams()
        self.datastore = datastore or datastore_for(target, self.params.corpus, print_progress)
        self.eos_ids = frozenset(target.eos_token_ids)
        self.calibration = GuessCalibration(self.params.depth)

    def forget(self) -> None:
        self.calibration = GuessCalibration(self.params.depth)

    def propose(self, requests: Sequence[RequestView], rooms: list[int], cost: Cost) -> dict[int, Proposal]:
        depth, nodes = self.params.depth, self.params.nodes
        sure = self.calibration.bound(depth)
        bounds = [[sure[min(k, room, depth)] for k in range(nodes + 1)] for room in rooms]
        if widest_paying(bounds, cost) == 1:  # no tree could pay for its rows: skip the search
            return {}
        proposals = {}
        for request, room in zip(requests, rooms):
            if room <= 0:
                continue
            text = request.tokens[: request.num_computed + 1]
            matched, lo, hi = self.datastore.longest_match(text, self.params.max_suffix)
            if not matched:
                continue
            tokens, parents, counts = trie(self.datastore.continuations(lo, hi, matched, min(depth, room)), nodes,
                                           self.eos_ids)
            if tokens:
                proposals[request.id] = self.tree(tokens, parents, counts, min(hi - lo, SAMPLED),
                                                  Retrieved(text[len(text) - matched :], hi - lo))
        return proposals

    def tree(self, tokens: list[int], parents: list[int], counts: list[int], sampled: int, note: Retrieved
             ) -> Proposal:
        """The trie as a proposal: node i's probability its count over its parent's, its reach the product of the
        calibrated probabilities down its path."""
        depths = Proposal(tokens, parents, [], []).depths()[1:]  # each node's, from 1
        probs: list[float | None] = []
        reach: list[float] = []
        for parent, count, depth in zip(parents, counts, depths):
            p = count / (sampled if parent == 0 else counts[parent - 1])
            probs.append(p)
            rate = min(1.0, p * self.calibration.scale(depth - 1))
            reach.append(rate * (1.0 if parent == 0 else reach[parent - 1]))
        return Proposal(tokens, parents, [self.label] * len(tokens), reach, probs, note=note)

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        if proposal is not None and proposal.tokens:
            self.calibration.record(proposal, outcome.path, self.label)

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "corpus": self.datastore.meta.get("source"), "tokens": len(self.datastore),
                "max_suffix": self.params.max_suffix, "nodes": self.params.nodes, "depth": self.params.depth}

    def loaded(self) -> dict[str, Any]:
        return {"datastore": self.datastore}


ALGORITHM = Algorithm(
    "rest", "REST (retrieval)", "retrieval drafts, REST (--algo rest)", RestParams, RestProposer,
    (Setting("corpus", "a text or JSONL file (rows with a \"text\" field) the datastore is built from, tokenised "
                       "with the target's tokenizer and cached (default: the embedded target's answers to the "
                       "training prompts)", flag="--rest-corpus", kind=str),
     Setting("max_suffix", f"longest suffix of the text looked up in the datastore, 1..{MAX_SUFFIX}",
             label=f"max suffix (1..{MAX_SUFFIX})"),
     Setting("nodes", f"most retrieved tokens proposed per step, as a trie of the likeliest continuations, "
                      f"1..{MAX_DYNAMIC_NODES}", flag="--rest-nodes", label=f"trie nodes (1..{MAX_DYNAMIC_NODES})"),
     Setting("depth", f"most tokens a retrieved continuation runs ahead, 1..{MAX_GAMMA}", flag="--rest-depth",
             label=f"trie depth (1..{MAX_GAMMA})")),
    sources={"rest": ("Retrieval (REST)", "retrieved")}, notes=(Retrieved,), colour="#56b4e9",
    example="Explain what photosynthesis is and why it matters.", ships=default_answers,
    variants=(Variant("wide", {"nodes": 24}, note="(a wider trie)"),), short="REST")
