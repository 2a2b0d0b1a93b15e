"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Each step: propose gamma tokens with the draft model -> verify them with one target forward over
[last token, drafts] -> accept a prefix (greedy match or lossless rejection sampling, both in `sampling`) ->
commit: roll both KV caches back to the kept tokens. Greedy output equals plain decoding token for token;
sampled output follows the target's distribution exactly.

Under greedy acceptance the draft's runners-up at the first drafted position (`siblings`) are verified in the same
forward as leaves beside the chain: where the target refuses the draft's first choice it often takes its second,
and then the step keeps that token and the target's next one instead of a correction alone.

With `copy_ngram` a step may propose a span copied from earlier text instead (prompt lookup's proposal, one-hot
q), which the small draft rarely predicts: it does not learn to copy. Verification is the same either way, so
exactness and losslessness hold; which source proposes is chosen from the tokens alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import MAX_GAMMA, ConfigError, EngineDraftParams, GenerationParams, SamplingParams, SpeculativeParams
from ..kv import ContiguousKVCache, KVCache, PagedKVCache
from ..models import LoadedModel, Transformer
from ..models.loader import load_draft
from ..models.vocab import proposal_rows
from ..sampling import argmax_rows, next_token, probabilities, sample, shown_probabilities
from ..trace import DraftEvent, RejectEvent, VerifyEvent
from .base import Decoder, EventStream, commit_event, engine_cache, forward_tokens, new_cache
from .chain import accept_chain, one_hot, verify_candidates
from .copies import Lookup, agreement, find_continuation
from .guesses import Guesser, Guesses
from .planning import ProposalGate, RunningAcceptance, plan_width
from .proposer import Cost, Outcome, Proposal, RequestView

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


@dataclass(frozen=True, slots=True)
class Drafted:
    tokens: list[int]  # the chain the draft proposes
    q: torch.Tensor | None  # (K, V): the distributions the chain was drawn from; None under greedy
    shown: list[float]  # each chain token's draft probability, for the trace
    siblings: list[int]  # the draft's runners-up at the first position, best first
    sibling_q: list[float]  # their draft probabilities


def runners_up(logits: torch.Tensor, chosen: int, chosen_p: float, count: int) -> tuple[list[int], list[float]]:
    """The `count` rows of logits (V,) ranked highest after row `chosen`, best first, and their softmax
    probabilities, found from `chosen`'s probability chosen_p (p_s = chosen_p * exp(l_s - l_chosen)) rather than
    a second normaliser. One native argmax per pick over a copy with the picks masked: on the 2-core CPU topk over
    the vocabulary and its logsumexp cost 0.2-0.3 ms a step, a tenth of the sibling's gain."""
    rest = logits.float().clone()  # (V,)
    top = float(rest[chosen])
    rest[chosen] = -math.inf
    rows: list[int] = []
    probs: list[float] = []
    for _ in range(count):
        row = argmax_rows(rest.unsqueeze(0))[0]
        rows.append(row)
        probs.append(chosen_p * math.exp(float(rest[row]) - top))
        rest[row] = -math.inf
    return rows, probs


class SpeculativeDecoder(Decoder):
    algo = "speculative"

    def __init__(self, target: LoadedModel, draft: LoadedModel, sampling: SamplingParams,
                 generation: GenerationParams, params: SpeculativeParams | None = None) -> None:
        super().__init__(target, sampling, generation)
        check_compatible(target, draft)
        self.draft = draft
        self.spec = (params or SpeculativeParams()).resolve(target.model.rows_per_pass, sampling.greedy)
        self.proposal = proposal_rows(draft)  # the tokens the draft may propose; None: all of them
        self.proposal_ids = None if self.proposal is None else self.proposal.ids.tolist()  # row -> token id
        self.eos_ids = frozenset(target.eos_token_ids)  # a copy stops after one

    def params(self) -> dict[str, Any]:
        vocab = self.draft.model.config.vocab_size if self.proposal is None else len(self.proposal)
        return {**super().params(), "draft": self.draft.name, "gamma": self.spec.gamma,
                "adaptive_gamma": self.spec.adaptive, "draft_vocab": vocab, "copy_ngram": self.spec.copy_ngram,
                "copy_tokens": self.spec.copy_tokens, "confidence": self.spec.confidence,
                "siblings": self.spec.siblings}

    def propose(self, cache: KVCache, pending: list[int], gamma: int, generator: torch.Generator,
                siblings: int = 0) -> Drafted:
        """Draft up to gamma tokens after feeding `pending` (tokens the draft has not seen yet): fewer when one's
        draft probability falls below `confidence`, since the tokens after an unlikely one are rarely accepted and
        each costs a draft forward; under greedy, also the draft's `siblings` runners-up at the first position
        (from the same forward's logits).

        The last drafted token is not fed to the draft (saves a forward). With a proposal vocabulary the draft
        scores only its rows: q is zero elsewhere, which the lossless rule allows (the target's residual covers
        those tokens). Stopping looks at the draft's own draws only, never at the target, so every proposed
        position is still verified against p as it would be at a fixed length.
        """
        model = self.draft.model
        # Greedy drafting needs only the argmax and its probability, both found among the scored rows: spreading
        # them over the whole vocabulary (-inf elsewhere) and reducing that cost a draft step more than scoring.
        compact = self.proposal_ids is not None and self.sampling.greedy
        logits = forward_tokens(model, cache, pending, rows=self.proposal, scored_only=compact)[-1]  # (V,) or (V',)
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        shown: list[float] = []
        others: list[int] = []
        others_q: list[float] = []
        for i in range(gamma):
            if self.sampling.greedy:
                row, q_x = next_token(logits, self.sampling, generator)
                if i == 0 and siblings:
                    others, others_q = runners_up(logits, int(row), float(q_x), siblings)
                token = self.proposal_ids[int(row)] if compact else int(row)
            else:
                # x ~ q, keeping q itself for the acceptance test (computed once, not again for the trace)
                q_rows.append(probabilities(logits, self.sampling))  # (V,)
                token = sample(q_rows[-1], generator)
                q_x = q_rows[-1][token]
            tokens.append(int(token))
            shown.append(float(q_x))
            if i == gamma - 1 or shown[-1] < self.spec.confidence:
                break
            logits = forward_tokens(model, cache, [tokens[-1]], rows=self.proposal, scored_only=compact)[-1]
        if compact:
            others = [self.proposal_ids[row] for row in others]
        return Drafted(tokens, torch.stack(q_rows) if q_rows else None, shown, others, others_q)  # q: (K, V)

    def copy_proposal(self, sequence: list[int], budget: int, gamma: int, copies: ProposalGate,
                      drafted: RunningAcceptance) -> Lookup | None:
        """The copy to propose this step instead of drafting, if any: the prompt-lookup match for the text so
        far, when copies of its n-gram length are expected to commit at least as many tokens as gamma drafts
        (a copy step also saves the draft's forwards). Depends only on the tokens, so seeds stay reproducible."""
        if not self.spec.copy_ngram:
            return None
        copies.decay()
        drafted.decay()
        found = find_continuation(sequence, self.spec.copy_ngram, min(self.spec.copy_tokens, budget), self.eos_ids)
        if found and copies.expected_tokens(found.ngram, len(found.tokens)) >= drafted.expected_tokens(gamma):
            return found
        return None

    def run(self, prompt_ids: list[int]) -> EventStream:
        target, draft = self.target.model, self.draft.model
        clock, generator, stopper = self.start()
        capacity = len(prompt_ids) + self.generation.max_new_tokens + MAX_GAMMA + 1  # copy_tokens <= MAX_GAMMA
        target_cache = new_cache(target, capacity, self.generation)
        draft_cache = new_cache(draft, capacity, self.generation)
        vocab = target.config.vocab_size
        copies, drafted = ProposalGate(0.0, self.spec.copy_ngram), RunningAcceptance()

        last, done = yield from self.prefill(target_cache, prompt_ids, clock, generator, stopper)
        # The draft sees the prompt now and the first token with its first proposal.
        draft_pending = list(prompt_ids) + [last]
        sequence = list(prompt_ids) + [last]  # prompt + generated: what a copy is looked up in
        gamma, step = self.spec.gamma, 0
        while not done:
            step += 1
            step_start = clock.now()
            # Never propose past max_new_tokens: those tokens could only be thrown away.
            budget = self.generation.max_new_tokens - len(stopper.tokens)
            gamma = min(gamma, budget)
            base = target_cache.length(0)  # position of `last`
            draft_base = draft_cache.length(0)
            found = self.copy_proposal(sequence, budget, gamma, copies, drafted)
            siblings: list[int] = []  # the draft's runners-up at the first position
            sibling_q: list[float] = []
            if found:
                # q is one-hot: a copied token was proposed with certainty
                proposals, q_shown = found.tokens, [1.0] * len(found.tokens)
                q = None if self.sampling.greedy else one_hot(proposals, vocab, target.device)
                forwards, source, ngram = 0, [found.start, found.start + len(proposals)], found.ngram
            else:
                chain = self.propose(draft_cache, draft_pending, gamma, generator, self.spec.siblings)
                proposals, q, q_shown = chain.tokens, chain.q, chain.shown
                siblings, sibling_q = chain.siblings, chain.sibling_q
                forwards, source, ngram = len(proposals), None, None
            draft_end = clock.now()
            # with siblings the proposals form a tree: node 0 is `last`, chain token i node i + 1, siblings after
            infos = [self.token_info(x, base + 1 + i, q=q_shown[i], parent=i if siblings else None)
                     for i, x in enumerate(proposals)]
            infos += [self.token_info(x, base + 1, q=q_x, parent=0) for x, q_x in zip(siblings, sibling_q)]
            yield from clock.emit(DraftEvent(step=step, t=draft_end, tokens=infos, wall_s=draft_end - step_start,
                                             draft_forwards=forwards, source=source, ngram=ngram))

            verify_start = clock.now()
            count = len(proposals)
            verified = verify_candidates(target, target_cache, last, [proposals, *([x] for x in siblings)])
            verify_end = clock.now()
            yield from clock.emit(VerifyEvent(step=step, t=verify_end, num_tokens=verified.width,
                                              wall_s=verify_end - verify_start, target_forwards=1))

            # verified.logits (K+1, V) or, when a sibling won, (2, V): the root's row and the sibling's
            sibling = verified.chosen - 1  # index of the sibling the target took; -1: the chain won
            if sibling < 0:
                outcome = accept_chain(self, step, clock.now(), base, verified.logits, proposals, q, q_shown,
                                       generator, stopper)
                refused = []
            else:
                # The target refused the draft's first choice (its argmax is the sibling): show that refusal, then
                # judge the sibling as a one-token chain, whose row gives the bonus token.
                refused = [RejectEvent(step=step, t=clock.now(), token=self.token_info(
                    proposals[0], base + 1, p=shown_probabilities(verified.logits, None, [(0, proposals[0])])[0],
                    q=q_shown[0]), u=None)]
                outcome = accept_chain(self, step, clock.now(), base, verified.logits, [siblings[sibling]], None,
                                       [sibling_q[sibling]], generator, stopper)
            done = outcome.done
            accepted = outcome.accepted
            kept = (proposals if sibling < 0 else [siblings[sibling]])[:accepted]  # proposals committed
            # commit: keep `last` and the accepted nodes in the target cache; the new `last` is not fed yet.
            target_cache.keep(0, base, [0, *verified.paths[verified.chosen][:accepted]])
            if found:
                copies.record(found.ngram, accepted, outcome.judged)
                # the draft saw none of this step's tokens: it reads them with its next proposal
                draft_pending = draft_pending + kept + [outcome.token]
            else:
                chain_accepted = accepted if sibling < 0 else 0
                drafted.record(accepted, outcome.judged + len(refused))
                # The draft cache holds draft_pending and drafts[:-1]; keep the accepted ones it has seen.
                draft_cache.truncate(0, draft_base + len(draft_pending) + min(chain_accepted, count - 1))
                # nor has it seen a sibling, or the chain's last token: they are pending when kept
                unseen = kept[-1:] if sibling >= 0 or accepted == count else []
                draft_pending = unseen + [outcome.token]
                # the schedule grows only when a draft of the full gamma was accepted (as transformers' does)
                if self.spec.adaptive:
                    gamma = min(MAX_GAMMA, gamma + 2) if chain_accepted == gamma else max(1, gamma - 1)
            sequence += kept + [outcome.token]
            last = outcome.token
            kv_bytes = target_cache.memory().bytes_used + draft_cache.memory().bytes_used
            yield from clock.emit(*refused, *outcome.events, commit_event(
                step, step_start, clock.now(), draft_end - step_start, verify_end - verify_start, outcome.kept,
                kv_bytes))
        event, output = self.finish(stopper, clock, step)
        yield from clock.emit(event)
        return output


class DraftGuesser(Guesser):
    """A draft model in the engine: each decoding request's greedy chain of up to gamma tokens and the runner-up at
    its first place, batched over the requests on the draft's own cache (one forward per drafted token), as deep as
    the chain's acceptance so far says pays for the draft's forwards and the wider verification. With
    `EngineDraftParams.sample`, a sampling request's chain is drawn from the draft's distributions instead, and
    judged by the lossless rule for them."""

    label = "draft"
    chained = True

    def __init__(self, target: LoadedModel, params: EngineDraftParams, draft: LoadedModel | None = None) -> None:
        self.target, self.sample = target, params.sample
        self.draft = draft or load_draft(params.draft, target)
        check_compatible(target, self.draft)
        super().__init__(frozenset(target.eos_token_ids), params.gamma, params.gamma + 1)  # chain + runner-up
        self.rows = proposal_rows(self.draft)  # the tokens the draft may propose; None: all of them
        self.draft_cost = params.draft_cost if params.draft_cost is not None else self.estimate_cost()
        self.cache: PagedKVCache | ContiguousKVCache | None = None  # made by `bind`, as the engine's cache
        self.prefix_caching = True
        self.drafted: dict[int, list[int]] = {}  # request id -> the tokens the draft read after its last token

    def estimate_cost(self) -> float:
        """A draft forward's cost over the target's: where the native CPU kernel runs the forwards they are bound by
        reading the weights (the layers' and the output rows scored), elsewhere (a GPU, PyTorch's kernels) by each
        layer's fixed work."""
        draft, target = self.draft.model, self.target.model
        if target.rows_per_pass is None:
            return draft.config.num_layers / target.config.num_layers

        def weights(model: Transformer, output_rows: int) -> int:
            return sum(p.numel() for p in model.layers.parameters()) + output_rows * model.config.hidden_size
        rows = len(self.rows) if self.rows is not None else draft.config.vocab_size
        return weights(draft, rows) / weights(target, target.config.vocab_size)

    def bind(self, settings: Any) -> None:
        # As large as the target's cache, of its kind: a request's draft never holds more tokens than its target side.
        self.cache = engine_cache(self.draft.model, settings)
        self.prefix_caching = settings.prefix_caching
        self.drafted = {}

    def pause(self, request: RequestView) -> None:
        if self.cache is not None and self.cache.has_sequence(request.id):
            self.cache.free(request.id)
        self.drafted.pop(request.id, None)

    def guesses(self, requests: Sequence[RequestView], rooms: list[int], longest: int,
                cost: Cost) -> dict[int, Guesses]:
        # Drafted tokens cost draft forwards besides the wider verification: draft only as deep as the drafted
        # tokens' acceptance so far says pays for both.
        expected = self.calibration.expected_tokens(self.depth)
        depth = plan_width([expected[: min(room, self.depth) + 1] for room in rooms],
                           lambda width: cost(width) + (width - 1) * self.draft_cost) - 1
        return self.chains([r for r, room in zip(requests, rooms) if room > 0], min(longest, depth))

    def tree(self, guesses: Guesses, room: int, nodes: int, *copy: Any) -> Proposal:
        proposal = super().tree(guesses, room, nodes, *copy)
        return replace(proposal, forwards=len(guesses[0]))  # one draft forward per place drafted

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
        model, cache = self.draft.model, self.cache
        for r in requests:  # all added before any is sized: a prompt sharing another's blocks makes both copy them
            if not cache.has_sequence(r.id):
                cache.add_sequence(r.id, r.tokens[: r.num_computed + 1] if self.prefix_caching else [])
        free = cache.num_free_blocks
        todo: dict[int, tuple[RequestView, list[int]]] = {}
        for r in requests:
            unseen = r.tokens[cache.length(r.id) : r.num_computed + 1]
            need = cache.blocks_needed(r.id, max(len(unseen), CATCH_UP) + depth - 1)
            if need <= free:
                free -= need
                todo[r.id] = (r, unseen)
        if not todo:
            return {}
        short = [(r, unseen) for r, unseen in todo.values() if len(unseen) <= CATCH_UP]
        groups = ([short] if short else []) + [[(r, unseen)] for r, unseen in todo.values() if len(unseen) > CATCH_UP]
        last: dict[int, torch.Tensor] = {}  # request id -> (E,) the draft's final hidden state at the last token
        for group in groups:
            width = max(len(unseen) for _, unseen in group)
            starts = [cache.length(r.id) for r, _ in group]
            ids = torch.tensor([u + u[-1:] * (width - len(u)) for _, u in group], device=model.device)  # (B, T)
            positions = torch.tensor([[s + j for j in range(width)] for s in starts], device=model.device)  # (B, T)
            _, states = model(ids, positions, cache, [r.id for r, _ in group], num_logits=0)  # (B, T, E)
            for i, ((r, unseen), start) in enumerate(zip(group, starts)):
                last[r.id] = states[i, len(unseen) - 1]
                cache.truncate(r.id, start + len(unseen))  # the padding after a shorter row
        drafting = [r for r, _ in todo.values()]
        hidden = torch.stack([last[r.id] for r in drafting])  # (B, E)
        sampled = [i for i, r in enumerate(drafting) if self.sample and not r.sampling.greedy]
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i in sampled}  # request index -> (V,) per place
        vocab = self.target.model.config.vocab_size
        logp: list[list[list[float]]] = []  # (D, B, k)
        chains: list[list[list[int]]] = []  # (D, B, k)
        for d in range(depth):
            # (B, V') over the draft's proposal vocabulary, or (B, V)
            logits = self.rows.logits(hidden) if self.rows is not None else model.project(hidden)
            # At the first place the runner-up too: where the target refuses the draft's first choice it often
            # takes its second, a leaf beside the chain.
            best = logits.log_softmax(-1).topk(2 if d == 0 else 1, dim=-1)  # values, indices: (B, k)
            ranked = best.indices if self.rows is None else self.rows.ids[best.indices]  # (B, k)
            logp.append(best.values.tolist())
            chains.append(ranked.tolist())
            for i in sampled:  # x ~ q, q kept for the lossless rule (zero outside a proposal vocabulary)
                r = drafting[i]
                full = logits[i] if self.rows is None else self.rows.full_logits(hidden[i], vocab)  # (V,)
                q_rows[i].append(probabilities(full, r.sampling))
                x = int(sample(q_rows[i][-1], r.generator))
                logp[-1][i], chains[-1][i] = [math.log(float(q_rows[i][-1][x]))], [x]
            if d == depth - 1:
                break  # the last drafted token is not read: the target's verdict on it comes first
            fed = torch.tensor([[place[0]] for place in chains[-1]], device=model.device)  # (B, 1)
            positions = torch.tensor([[cache.length(r.id)] for r in drafting], device=model.device)  # (B, 1)
            _, states = model(fed, positions, cache, [r.id for r in drafting], num_logits=0)
            hidden = states[:, 0]  # (B, E)
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
            if self.cache.length(request.id) > kept:
                self.cache.truncate(request.id, kept)

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "draft": self.draft.name, "gamma": self.depth}
