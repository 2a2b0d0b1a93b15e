"""Self-speculative decoding (Draft & Verify, Zhang et al. 2024; SWIFT, Xia et al. 2025; LayerSkip, Elhoushi et al.
2024): the target drafts with a subset of its own layers, the full target verifies. No second model.

For each decoding request the target, run through its drafting layers only (the others pass the residual stream
by), proposes a chain of its greedy tokens and the runner-up at the chain's first place, one batched forward per
drafted token. It drafts on the target's own cache: the drafting layers read the K/V the full forwards stored for
the committed text and write theirs for the drafted tokens, which are dropped after the chain (the verifying forward
writes every layer's K/V for the tokens it verifies). The chain is one-hot, so each token is drawn from the target's
row as plain decoding draws it. Which layers draft: a count of leading layers (an early exit), a list, or the
choice `python -m playground.train layerskip` made for the target (shipped for the embedded one).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..config import MAX_GAMMA, ConfigError, check_finite, check_int
from ..kv import KVCache
from ..models import LoadedModel
from ..models.linear import product_bytes, weights_read
from ..models.transformer import Transformer
from ..models.vocab import PROPOSAL_VOCAB, OutputRows, vocabulary_rows
from ..notes import NoteKind, Said, TokenText
from ..waits import to_device
from .guesses import ChainDrafter, Guesses, read_places
from .planning import OwnCost, weights_estimate
from .proposer import Drafted, RequestView
from .spec import Algorithm, Setting

LAYERS = "layers.json"
# The drafting layers the search chose for the embedded target.
EMBEDDED_LAYERS = Path(__file__).resolve().parents[2] / "assets" / "layerskip-smollm2-135m" / LAYERS
_LAYERS = re.compile(r"^\s*\d+\s*(-\s*\d+\s*)?(,\s*\d+\s*(-\s*\d+\s*)?)*$")


def parse_layers(text: str) -> tuple[int, ...]:
    """Layers as the command line names them: "12" (the first 12), or layers and ranges, "0-9,12,15" (sorted,
    each once)."""
    if not isinstance(text, str) or not _LAYERS.match(text):
        raise ConfigError(f"layers must be a count of leading layers (e.g. 12) or layers and ranges (e.g. 0-9,12,15), "
                          f"got {text!r}")
    if "," not in text and "-" not in text:
        return tuple(range(int(text)))
    chosen: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ConfigError(f"layers: range {part.strip()!r} runs backwards")
        chosen.update(range(lo, hi + 1))
    return tuple(sorted(chosen))


def format_layers(layers: Sequence[int]) -> str:
    """Sorted layers as `parse_layers` reads them, runs as ranges: (0, 1, 2, 5) -> "0-2,5"."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def shipped(target_source: str) -> Path | None:
    """The folder of the search's choice for a target spec (`python -m playground.train layerskip`), where the
    project ships one."""
    return EMBEDDED_LAYERS.parent if target_source == "embedded" and EMBEDDED_LAYERS.is_file() else None


def default_layers(target_source: str) -> str | None:
    """The drafting layers the search chose for a target spec, as `parse_layers` reads them, where one ships."""
    folder = shipped(target_source)
    return None if folder is None else str(json.loads((folder / LAYERS).read_text(encoding="utf-8"))["layers"])


def shipped_rows(target: LoadedModel) -> OutputRows | None:
    """The output rows of the proposal vocabulary shipped beside the search's choice (None: none ships; a drafting
    forward scores every token), read once per loaded target."""
    folder = shipped(target.spec.source)
    return None if folder is None else vocabulary_rows(target.model, folder / PROPOSAL_VOCAB, "self-speculative")


def drafting_cost(model: Transformer, layers: Sequence[int], rows: OutputRows | None) -> float:
    """A forward of the drafting `layers` over the full one before any is measured, by the weights each reads: the
    layers and the output rows (`rows`, or all of them)."""
    output = product_bytes(model.output_weight, model.packed_output) if rows is None else rows.nbytes
    return weights_estimate(model, sum(weights_read(model.layers[i]) for i in layers) + output, len(layers))


@dataclass(frozen=True, slots=True)
class SelfSpeculativeParams:
    """The target drafting with some of its layers. layers: which draft, a count of leading layers ("12": an early
    exit after them) or layers and ranges ("0-9,12,15") (None: the search's choice shipped for the target, else its
    first half); gamma: the most drafted tokens per step (each step drafts as deep as the chain's acceptance so far
    pays for); draft_cost: a drafting forward's cost as a fraction of the full forward's (None: measured as it runs,
    estimated from the weights it reads until then)."""

    layers: str | None = None
    gamma: int = 4
    draft_cost: float | None = None

    def __post_init__(self) -> None:
        if self.layers is not None:
            parse_layers(self.layers)
        check_int("gamma", self.gamma, 1, MAX_GAMMA)
        if self.draft_cost is not None and not 0.0 <= check_finite("draft_cost", self.draft_cost) <= 1.0:
            raise ConfigError(f"draft_cost must be in [0, 1] or None, got {self.draft_cost:g}")


def drafting_layers(target: LoadedModel, layers: str | None) -> tuple[int, ...]:
    """The target's drafting layers for a setting (None: the shipped choice, else the first half), checked against
    its depth."""
    count = target.model.config.num_layers
    chosen = parse_layers(layers or default_layers(target.spec.source) or str(max(1, count // 2)))
    if not chosen or chosen[-1] >= count:
        raise ConfigError(f"layers: the target has layers 0..{count - 1}, got {layers!r}")
    if len(chosen) == count:
        raise ConfigError(f"layers: drafting with all {count} layers is the target itself; leave some out")
    return chosen


@dataclass(frozen=True, slots=True)
class Layers(NoteKind):
    """The trace's note of a draft by the target's own layers: how many of them each drafting forward ran."""

    KIND: ClassVar[str] = "layers"
    layers: int

    def check(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers: at least 1 drafting layer, got {self.layers}")

    def say(self, draft: Any, text: TokenText) -> Said:
        return Said(origin=f" by {draft.draft_forwards} draft forward(s) of {self.layers} of the target's own layers")


@dataclass(frozen=True, slots=True)
class SkipDrafted(Drafted):
    """A proposal drafted by `forwards` forwards of `layers` of the target's layers."""

    layers: int = 0

    def shown(self) -> Layers:
        return Layers(self.layers)


class LayerSkipGuesser(ChainDrafter):
    """The target's drafting layers in the engine: each decoding request's greedy chain of up to gamma tokens and the
    runner-up at its first place, batched over the requests on the target's cache (one forward of the drafting
    layers per drafted token), as deep as the chain's acceptance so far says pays for those forwards and the wider
    verification."""

    label = "self"

    def __init__(self, target: LoadedModel, params: SelfSpeculativeParams | None = None) -> None:
        params = params or SelfSpeculativeParams()
        self.target = target
        self.layers = drafting_layers(target, params.layers)
        self.skip = frozenset(range(target.model.config.num_layers)) - set(self.layers)
        super().__init__(frozenset(target.eos_token_ids), params.gamma, params.gamma + 1)  # chain + runner-up
        self.rows = shipped_rows(target)  # the tokens a drafting forward scores; None: every token
        self.own = OwnCost(params.draft_cost, drafting_cost(target.model, self.layers, self.rows))
        self.cache: KVCache | None = None  # the engine's, given by `bind`

    def bind(self, settings: Any, cache: KVCache) -> None:
        self.cache = cache

    def note(self, forwards: int) -> SkipDrafted:
        return SkipDrafted(forwards, len(self.layers))

    @torch.inference_mode()
    def chains(self, requests: Sequence[RequestView], depth: int) -> dict[int, Guesses]:
        """The drafting layers' greedy chain of `depth` tokens after each request's last token and their runner-up at
        the first place, with each token's log-probability, as (D, k) guesses (k = 2 at the first place, else 1).
        The K/V the drafting layers write for the request's last token and its drafted tokens is dropped after. A
        request whose drafted tokens would not fit the cache's free blocks is left out."""
        cache = self.cache
        assert cache is not None  # given by `bind`
        if not depth:
            return {}
        free = cache.blocks.num_free
        drafting = []
        for r in requests:
            need = cache.blocks.blocks_needed(r.id, depth)
            if cache.length(r.id) == r.num_computed and need <= free:
                free -= need
                drafting.append(r)
        if not drafting:
            return {}
        model, ids = self.target.model, [r.id for r in drafting]
        fed = to_device([[r.tokens[r.num_computed]] for r in drafting], model.device)  # (B, 1)
        places: list[tuple[torch.Tensor, torch.Tensor]] = []  # per place: log-probabilities, ids (B, k)
        try:
            for d in range(depth):
                positions = to_device([[r.num_computed + d] for r in drafting], model.device)  # (B, 1)
                _, hidden = model(fed, positions, cache, ids, num_logits=0, skip=self.skip)  # (B, 1, E)
                # (B, V') over the proposal vocabulary, or (B, V)
                logits = model.project(hidden[:, -1]) if self.rows is None else self.rows.logits(hidden[:, -1])
                best = logits.log_softmax(-1).topk(2 if d == 0 else 1, dim=-1)  # values, indices: (B, k)
                ranked = best.indices if self.rows is None else self.rows.ids[best.indices]  # (B, k)
                places.append((best.values, ranked))
                if d == 0:
                    self.first_done = time.perf_counter()
                fed = ranked[:, :1]  # (B, 1)
            self.last_done = time.perf_counter()
        finally:
            for r in drafting:
                cache.truncate(r.id, r.num_computed)
        logp, chains = read_places(places, {})
        return {r.id: Guesses([lp[i] for lp in logp], [place[i] for place in chains])
                for i, r in enumerate(drafting)}

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "layers": format_layers(self.layers), "of": self.target.model.config.num_layers,
                "gamma": self.depth}


ALGORITHM = Algorithm(
    "self-speculative", "self-speculative (layer skip)", "self-speculative decoding (--algo self-speculative)",
    SelfSpeculativeParams, LayerSkipGuesser,
    (Setting("layers", "the target's layers that draft: a count of leading layers (an early exit, e.g. 12) or layers "
                       "and ranges (e.g. 0-9,12,15); default: the choice of `python -m playground.train layerskip` "
                       "shipped for the embedded model, else the first half", flag="--draft-layers",
             label="drafting layers (empty = the shipped choice)", kind=str, auto=True,
             note="a count of leading layers (12: an early exit) or layers and ranges (0-9,14)"),
     Setting("gamma", f"most drafted tokens per step, 1..{MAX_GAMMA}; under the measured plan a step may draft "
                      "fewer", flag="--self-gamma", label="gamma (most drafted tokens, 1..16)")),
    sources={"self": ("Target's own layers", "drafted")}, notes=(Layers,), colour="#882255",
    example="Write a Python function that returns the n-th Fibonacci number.", short="self-spec")
