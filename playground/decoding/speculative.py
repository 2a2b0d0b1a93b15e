"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Each step: propose gamma tokens with the draft model -> verify them with one target forward over
[last token, drafts] -> accept a prefix (greedy match or lossless rejection sampling, both in `sampling`) ->
commit: roll both KV caches back to the kept tokens. Greedy output equals plain decoding token for token;
sampled output follows the target's distribution exactly.

With `copy_ngram` a step may propose a span copied from earlier text instead (prompt lookup's proposal, one-hot
q), which the small draft rarely predicts: it does not learn to copy. Verification is the same either way, so
exactness and losslessness hold; which source proposes is chosen from the tokens alone.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import MAX_GAMMA, ConfigError, GenerationParams, SamplingParams, SpeculativeParams
from ..kv import KVCache
from ..models import LoadedModel
from ..models.vocab import proposal_rows
from ..sampling import next_token, probabilities, sample
from ..trace import DraftEvent, VerifyEvent
from .base import Decoder, EventStream, commit_event, forward_tokens, new_cache
from .chain import accept_chain, one_hot
from .prompt_lookup import Lookup, ProposalGate, RunningAcceptance, find_continuation


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


class SpeculativeDecoder(Decoder):
    algo = "speculative"

    def __init__(self, target: LoadedModel, draft: LoadedModel, sampling: SamplingParams,
                 generation: GenerationParams, params: SpeculativeParams | None = None) -> None:
        super().__init__(target, sampling, generation)
        check_compatible(target, draft)
        self.draft = draft
        self.spec = params or SpeculativeParams()
        self.proposal = proposal_rows(draft)  # the tokens the draft may propose; None: all of them
        self.proposal_ids = None if self.proposal is None else self.proposal.ids.tolist()  # row -> token id
        self.eos_ids = frozenset(target.eos_token_ids)  # a copy stops after one

    def params(self) -> dict[str, Any]:
        vocab = self.draft.model.config.vocab_size if self.proposal is None else len(self.proposal)
        return {**super().params(), "draft": self.draft.name, "gamma": self.spec.gamma,
                "adaptive_gamma": self.spec.adaptive, "draft_vocab": vocab, "copy_ngram": self.spec.copy_ngram,
                "copy_tokens": self.spec.copy_tokens, "confidence": self.spec.confidence}

    def propose(self, cache: KVCache, pending: list[int], gamma: int,
                generator: torch.Generator) -> tuple[list[int], torch.Tensor | None, list[float]]:
        """Draft up to gamma tokens after feeding `pending` (tokens the draft has not seen yet): fewer when one's
        draft probability falls below `confidence`, since the tokens after an unlikely one are rarely accepted and
        each costs a draft forward.

        Returns the K tokens, q (K, V) the distributions they were drawn from (None under greedy, where only
        the argmax matters), and each token's draft probability for the trace. The last drafted token is not
        fed to the draft (saves a forward). With a proposal vocabulary the draft scores only its rows: q is zero
        elsewhere, which the lossless rule allows (the target's residual covers those tokens). Stopping looks
        at the draft's own draws only, never at the target, so every proposed position is still verified
        against p as it would be at a fixed length.
        """
        model = self.draft.model
        # Greedy drafting needs only the argmax and its probability, both found among the scored rows: spreading
        # them over the whole vocabulary (-inf elsewhere) and reducing that cost a draft step more than scoring.
        compact = self.proposal_ids is not None and self.sampling.greedy
        logits = forward_tokens(model, cache, pending, rows=self.proposal, scored_only=compact)[-1]  # (V,) or (V',)
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        shown: list[float] = []
        for i in range(gamma):
            if self.sampling.greedy:
                token, q_x = next_token(logits, self.sampling, generator)
                if compact:
                    token = self.proposal_ids[int(token)]
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
        return tokens, torch.stack(q_rows) if q_rows else None, shown  # q: (K, V)

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
            if found:
                # q is one-hot: a copied token was proposed with certainty
                proposals, q_shown = found.tokens, [1.0] * len(found.tokens)
                q = None if self.sampling.greedy else one_hot(proposals, vocab, target.device)
                forwards, source, ngram = 0, [found.start, found.start + len(proposals)], found.ngram
            else:
                proposals, q, q_shown = self.propose(draft_cache, draft_pending, gamma, generator)
                forwards, source, ngram = len(proposals), None, None
            draft_end = clock.now()
            infos = [self.token_info(x, base + 1 + i, q=q_shown[i]) for i, x in enumerate(proposals)]
            yield from clock.emit(DraftEvent(step=step, t=draft_end, tokens=infos, wall_s=draft_end - step_start,
                                             draft_forwards=forwards, source=source, ngram=ngram))

            verify_start = clock.now()
            count = len(proposals)
            target_logits = forward_tokens(target, target_cache, [last] + proposals, num_logits=count + 1)  # (K+1, V)
            verify_end = clock.now()
            yield from clock.emit(VerifyEvent(step=step, t=verify_end, num_tokens=count + 1,
                                              wall_s=verify_end - verify_start, target_forwards=1))

            outcome = accept_chain(self, step, clock.now(), base, target_logits, proposals, q, q_shown, generator,
                                   stopper)
            done = outcome.done
            accepted = outcome.accepted
            # commit: keep `last` and the accepted proposals in the target cache; the new `last` is not fed yet.
            target_cache.truncate(0, base + 1 + accepted)
            if found:
                copies.record(found.ngram, accepted, outcome.judged)
                # the draft saw none of this step's tokens: it reads them with its next proposal
                draft_pending = draft_pending + proposals[:accepted] + [outcome.token]
            else:
                drafted.record(accepted, outcome.judged)
                # The draft cache holds draft_pending and drafts[:-1]; keep the accepted ones it has seen.
                draft_cache.truncate(0, draft_base + len(draft_pending) + min(accepted, count - 1))
                draft_pending = ([proposals[-1]] if accepted == count else []) + [outcome.token]
                # the schedule grows only when a draft of the full gamma was accepted (as transformers' does)
                if self.spec.adaptive:
                    gamma = min(MAX_GAMMA, gamma + 2) if accepted == gamma else max(1, gamma - 1)
            sequence += proposals[:accepted] + [outcome.token]
            last = outcome.token
            kv_bytes = target_cache.memory().bytes_used + draft_cache.memory().bytes_used
            yield from clock.emit(*outcome.events, commit_event(
                step, step_start, clock.now(), draft_end - step_start, verify_end - verify_start, outcome.kept,
                kv_bytes))
        event, output = self.finish(stopper, clock, step)
        yield from clock.emit(event)
        return output
