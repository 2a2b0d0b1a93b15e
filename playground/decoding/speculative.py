"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023) in the engine.

For each decoding request the draft model proposes a chain of its greedy tokens and the runner-up at the chain's
first place (a tree of gamma + 1 nodes), batched over the requests on the draft's own cache; the target verifies
it in the step's one forward and every token is drawn from the target's row as plain decoding draws it. With
`SpeculativeParams.sample` a sampling request's chain is drawn from the draft's distributions q instead and judged
by the lossless rule for q: the output follows the target's distribution, though a seed no longer gives plain
decoding's text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import MAX_GAMMA, ConfigError, check_finite, check_int
from ..kv import ContiguousKVCache, KVCache, PagedKVCache
from ..models import LoadedModel
from ..models.forwards import Forwards, make_forwards
from ..models.loader import default_draft, load_draft
from ..models.vocab import proposal_rows
from ..sampling import probabilities, sample
from ..waits import to_device
from .base import engine_cache
from .copies import agreement
from .guesses import ChainDrafter, Guesses, read_places
from .planning import OwnCost, forward_reads, weights_estimate
from .proposer import Outcome, Proposal, RequestView
from .spec import Algorithm, Setting


@dataclass(frozen=True, slots=True)
class SpeculativeParams:
    """A draft model in the serving engine: after each decoding request's last token, the draft's greedy chain of
    up to `gamma` tokens and its runner-up at the first place (one batched draft forward per drafted token, over
    every request that drafts, on the draft's own paged cache), verified in the batch's decode forward. draft: a
    model spec with the target's tokenizer (None: the draft shipped for the embedded target); draft_cost: one draft
    forward's cost as a fraction of the target's at the same batch, which a chain's drafted tokens must pay for
    besides the wider verifying forward (None: measured as it runs, `planning.OwnCost`; until then estimated from
    the weights each forward reads where the native CPU kernel runs, else from the layers, whose fixed work dominates
    on a GPU). The chain is the draft's argmax at every place, a one-hot proposal even when sampling, so
    each token is still drawn from the target's row exactly as plain decoding draws it (seeded outputs unchanged by
    batching or by the draft). sample: when a request samples, draw its chain from the draft's distributions q
    instead (no runner-up) and judge it by the lossless rule for q (Leviathan et al. 2023): more of it is accepted,
    and the output still follows the target's distribution, but a seed no longer gives plain decoding's text."""

    draft: str | None = None
    gamma: int = 4
    draft_cost: float | None = None
    sample: bool = False

    def __post_init__(self) -> None:
        if self.draft is not None and (not isinstance(self.draft, str) or not self.draft.strip()):
            raise ConfigError(f"draft must be a model spec or None, got {self.draft!r}")
        check_int("gamma", self.gamma, 1, MAX_GAMMA)
        if self.draft_cost is not None and not 0.0 <= check_finite("draft_cost", self.draft_cost) <= 1.0:
            raise ConfigError(f"draft_cost must be in [0, 1] or None, got {self.draft_cost:g}")
        if not isinstance(self.sample, bool):
            raise ConfigError(f"sample must be true or false, got {self.sample!r}")

# The engine's draft reads up to this many unseen tokens per request in one padded batched forward; more alone.
CATCH_UP = 4


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Draft and target must share one vocabulary, or proposals would be verified as other tokens."""
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        raise ConfigError(f"draft: its tokenizer differs from the target's ({len(draft_vocab)} vs "
                          f"{len(target_vocab)} tokens, or the same size with other ids); speculative decoding "
                          "needs a draft with the target's tokenizer")
    t_size, d_size = target.model.config.vocab_size, draft.model.config.vocab_size
    if t_size != d_size:
        raise ConfigError(f"draft: output vocabulary of {d_size} rows, the target has {t_size}; they must be equal")


class DraftGuesser(ChainDrafter):
    """A draft model in the engine: each decoding request's greedy chain of up to gamma tokens and the runner-up at
    its first place, batched over the requests on the draft's own cache (one forward per drafted token), as deep as
    the chain's acceptance so far says pays for the draft's forwards and the wider verification. With
    `SpeculativeParams.sample`, a sampling request's chain is drawn from the draft's distributions instead, and
    judged by the lossless rule for them."""

    label = "draft"

    def __init__(self, target: LoadedModel, params: SpeculativeParams | None = None,
                 draft: LoadedModel | None = None) -> None:
        params = params or SpeculativeParams()
        self.target, self.sample = target, params.sample
        self.draft = draft or load_draft(params.draft, target)
        check_compatible(target, self.draft)
        super().__init__(frozenset(target.eos_token_ids), params.gamma, params.gamma + 1)  # chain + runner-up
        self.rows = proposal_rows(self.draft)  # the tokens the draft may propose; None: all of them
        self.own = OwnCost(params.draft_cost, self.estimate_cost())  # a draft forward's cost, measured as it runs
        self.cache: PagedKVCache | ContiguousKVCache | None = None  # made by `bind`, as the engine's cache
        self.forwards: Forwards | None = None  # the draft's decode forwards over that cache, made by `bind`
        self.prefix_caching = True
        self.drafted: dict[int, list[int]] = {}  # request id -> the tokens the draft read after its last token


    def estimate_cost(self) -> float:
        """A draft forward's cost over the target's before any is measured: its layers and the output rows it
        scores."""
        draft = self.draft.model
        return weights_estimate(self.target.model, forward_reads(draft, self.rows), draft.config.num_layers)

    def bind(self, settings: Any, cache: KVCache) -> None:
        # As large as the target's cache, of its kind: a request's draft never holds more tokens than its target side.
        if self.forwards is not None:
            self.forwards.release()  # before the new cache is made, which may take what it built
        self.cache = engine_cache(self.draft.model, settings)
        self.forwards = make_forwards(self.draft.model, self.cache, self.draft.forwards, settings.max_running)
        self.prefix_caching = settings.prefix_caching
        self.drafted = {}

    def pause(self, request: RequestView) -> None:
        if self.cache is not None and self.cache.blocks.has_sequence(request.id):
            self.cache.blocks.free(request.id)
        self.drafted.pop(request.id, None)

    @torch.inference_mode()
    def chains(self, requests: Sequence[RequestView], depth: int) -> dict[int, Guesses]:
        """The draft's greedy chain of `depth` tokens after each request's last token, and its runner-up at the first
        place, with each token's log-probability under the draft's softmax, as (D, k) guesses (k = 2 at the first
        place, else 1). The draft first reads what of the request's tokens it has not seen, always the last one:
        one padded forward for the requests with at most CATCH_UP of them, one forward each for the others (a whole
        prompt the first time, or the tokens of steps it did not draft). A request whose draft KV would not fit
        the draft's free blocks is left out."""
        if not depth:
            return {}
        model, cache, forwards = self.draft.model, self.cache, self.forwards
        assert cache is not None and forwards is not None  # made by `bind`
        for r in requests:  # all added before any is sized: a prompt sharing another's blocks makes both copy them
            if not cache.blocks.has_sequence(r.id):
                cache.blocks.add_sequence(r.id, r.tokens[: r.num_computed + 1] if self.prefix_caching else [])
        free = cache.blocks.num_free
        todo: dict[int, tuple[RequestView, list[int]]] = {}
        for r in requests:
            unseen = r.tokens[cache.length(r.id) : r.num_computed + 1]
            need = cache.blocks.blocks_needed(r.id, max(len(unseen), CATCH_UP) + depth - 1)
            if need <= free:
                free -= need
                todo[r.id] = (r, unseen)
        if not todo:
            return {}
        short = [(r, unseen) for r, unseen in todo.values() if len(unseen) <= CATCH_UP]
        groups = ([short] if short else []) + [[(r, unseen)] for r, unseen in todo.values() if len(unseen) > CATCH_UP]
        last: dict[int, torch.Tensor] = {}  # request id -> (E,) the draft's final hidden state at the last token
        self.unpriced_s = 0.0  # long catch-ups (more than CATCH_UP tokens): a prompt's or a rest's
        for group in groups:  # the short group as a decode forward, a long catch-up as a prefill
            width = max(len(unseen) for _, unseen in group)
            starts = [cache.length(r.id) for r, _ in group]
            ids = [u + u[-1:] * (width - len(u)) for _, u in group]  # (B, T)
            positions = [[s + j for j in range(width)] for s in starts]  # (B, T)
            seq_ids = [r.id for r, _ in group]
            if width <= CATCH_UP:
                states = forwards(seq_ids, ids, positions)  # (B, T, E)
            else:
                read = time.perf_counter()
                _, states = model(to_device(ids, model.device), to_device(positions, model.device),
                                  cache, seq_ids, num_logits=0)
                self.unpriced_s += time.perf_counter() - read
            for i, ((r, unseen), start) in enumerate(zip(group, starts)):
                last[r.id] = states[i, len(unseen) - 1]
                cache.truncate(r.id, start + len(unseen))  # the padding after a shorter row
        drafting = [r for r, _ in todo.values()]
        hidden = torch.stack([last[r.id] for r in drafting])  # (B, E)
        sampled = [i for i, r in enumerate(drafting) if self.sample and not r.sampling.greedy]
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i in sampled}  # request index -> (V,) per place
        vocab = self.target.model.config.vocab_size
        # The greedy chain stays on the device, each place's top guess fed to the next forward as it is: one wait
        # for the device, when the places come back together after the chain (a sampled request draws its token at
        # each place, which waits).
        places: list[tuple[torch.Tensor, torch.Tensor]] = []  # per place: log-probabilities, ids (B, k)
        drawn: dict[tuple[int, int], tuple[float, int]] = {}  # (place, request index) -> its sampled (log q, x)
        for d in range(depth):
            # (B, V') over the draft's proposal vocabulary, or (B, V)
            logits = self.rows.logits(hidden) if self.rows is not None else model.project(hidden)
            # At the first place the runner-up too: where the target refuses the draft's first choice it often
            # takes its second, a leaf beside the chain.
            best = logits.log_softmax(-1).topk(2 if d == 0 else 1, dim=-1)  # values, indices: (B, k)
            ranked = best.indices if self.rows is None else self.rows.ids[best.indices]  # (B, k)
            places.append((best.values, ranked))
            fed = ranked[:, :1].clone() if sampled else ranked[:, :1]  # (B, 1); the sampled rows take their draws
            for i in sampled:  # x ~ q, q kept for the lossless rule (zero outside a proposal vocabulary)
                r = drafting[i]
                full = logits[i] if self.rows is None else self.rows.full_logits(hidden[i], vocab)  # (V,)
                q_rows[i].append(probabilities(full, r.sampling))
                x = int(sample(q_rows[i][-1], r.generator))
                drawn[(d, i)] = (math.log(float(q_rows[i][-1][x])), x)
                fed[i, 0] = x
            if d == 0:
                self.first_done = time.perf_counter()
            if d == depth - 1:
                self.last_done = time.perf_counter()
                break  # the last drafted token is not read: the target's verdict on it comes first
            states = forwards([r.id for r in drafting], fed, [[cache.length(r.id)] for r in drafting])
            hidden = states[:, 0]  # (B, E)
        logp, chains = read_places(places, drawn)
        out = {}
        for i, r in enumerate(drafting):
            self.drafted[r.id] = [place[i][0] for place in chains[:-1]]  # the chain: the top guess at each place
            q = torch.stack(q_rows[i]) if i in q_rows else None  # (D, V)
            out[r.id] = Guesses([lp[i] for lp in logp], [place[i] for place in chains], q)
        return out

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        super().observe(request, proposal, outcome)
        drafted = self.drafted.pop(request.id, [])
        if drafted:
            # The draft keeps what it read of the tokens committed, never the new last token: its next chain
            # starts from its hidden state there.
            kept = request.num_computed + min(agreement(drafted, outcome.new), len(outcome.path))
            cache = self.cache
            assert cache is not None  # made by `bind`
            if cache.length(request.id) > kept:
                cache.truncate(request.id, kept)

    def loaded(self) -> dict[str, Any]:
        return {"draft": self.draft}

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "draft": self.draft.name, "gamma": self.depth}


def _assisted(proposer: DraftGuesser) -> tuple[str, dict[str, Any]]:
    """transformers' assisted generation with the same most draft tokens on its fixed schedule (the bench adds the
    draft as its assistant model)."""
    return "assisted generation (constant)", {"num_assistant_tokens": proposer.depth,
                                              "num_assistant_tokens_schedule": "constant"}


ALGORITHM = Algorithm(
    "speculative", "speculative (draft model)", "speculative decoding (--algo speculative)", SpeculativeParams,
    DraftGuesser,
    (Setting("draft", "draft model spec (same tokenizer as the target); default for the embedded model: the draft "
                      "trained by `python -m playground.train draft`", kind=str),
     Setting("gamma", f"most draft tokens per step, 1..{MAX_GAMMA}; under the measured plan a step may draft fewer",
             label="gamma (most draft tokens, 1..16)"),
     Setting("sample", "when sampling, draw the chain from the draft's distributions and judge it by the lossless "
                       "rule for them: more accepted, same distribution, but a seed no longer gives plain decoding's "
                       "text (default: the draft's greedy chain, seeded outputs unchanged)", flag="--sample-draft",
             kind=bool, switch=True)),
    sources={"draft": ("Draft model", "drafted")}, colour="#0072b2",
    example="Write a Python function that returns the n-th Fibonacci number.", loads_draft=True, ships=default_draft,
    grafts=True, peer=_assisted, short="draft")
