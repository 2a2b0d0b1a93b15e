"""Draft-model speculative decoding: greedy exactness, lossless sampling, seeds, traces, compatibility."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import save_file

from playground.bench_suite import PASSAGE_LIBRARY
from playground.config import ConfigError, GenerationParams, ModelSpec, SamplingParams, SpeculativeParams
from playground.decoding import AutoregressiveDecoder, SpeculativeDecoder, encode_prompt, generate
from playground.decoding.base import forward_tokens, new_cache
from playground.decoding.copies import find_continuation
from playground.metrics import compute, drafted_count
from playground.models import LoadedModel, ModelLoadError, load_model
from playground.models.vocab import PROPOSAL_VOCAB, VOCAB_IDS

from .prompts import NEW_TOKENS, PROMPTS, assert_greedy_exact
from .stats import assert_follows_target

SAMPLED_PROMPT = "The best thing about summer is"


@pytest.mark.parametrize("gamma, adaptive, copy_ngram, siblings",
                         [(1, False, 0, 0), (3, False, 0, 1), (5, False, 0, 0), (8, False, 0, 2), (2, True, 0, 1),
                          (4, False, 3, 0), (4, False, 3, 1), (2, True, 1, 3)])
def test_greedy_equals_plain_decoding(target, noisy_draft, plain_outputs, gamma, adaptive, copy_ngram,
                                      siblings) -> None:
    decoder = SpeculativeDecoder(target, noisy_draft, SamplingParams(), GenerationParams(max_new_tokens=NEW_TOKENS),
                                 SpeculativeParams(gamma=gamma, adaptive=adaptive, copy_ngram=copy_ngram,
                                                   siblings=siblings))
    accepted, drafted = assert_greedy_exact(decoder, plain_outputs)
    assert 0.1 < accepted / drafted < 0.95  # the runs really mixed acceptances and rejections


@pytest.mark.parametrize("gamma, adaptive, copy_ngram, siblings",
                         [(4, False, 0, 0), (8, False, 0, 1), (3, True, 0, 2), (4, False, 3, 1)])
def test_greedy_with_a_confidence_stop_equals_plain_decoding(target, noisy_draft, plain_outputs, gamma, adaptive,
                                                             copy_ngram, siblings) -> None:
    decoder = SpeculativeDecoder(target, noisy_draft, SamplingParams(), GenerationParams(max_new_tokens=NEW_TOKENS),
                                 SpeculativeParams(gamma=gamma, adaptive=adaptive, copy_ngram=copy_ngram,
                                                   confidence=0.6, siblings=siblings))
    accepted, drafted = assert_greedy_exact(decoder, plain_outputs)
    assert 0.1 < accepted / drafted < 0.95


def test_drafting_stops_right_after_the_first_unlikely_token(target, noisy_draft) -> None:
    """Every drafted chain runs to gamma (or the token budget) unless its last token, and only its last, has a
    draft probability below the threshold; each drafted token cost one draft forward; stopping saved some."""
    prompt = "Explain how a bicycle gear works, in three short paragraphs."
    generation = GenerationParams(max_new_tokens=64)
    lengths, outputs = {}, {}
    for confidence in (0.0, 0.6):
        # the chain alone: a sibling's draft probability plays no part in the stop
        decoder = SpeculativeDecoder(target, noisy_draft, SamplingParams(), generation,
                                     SpeculativeParams(gamma=5, confidence=confidence, siblings=0))
        output, trace = generate(decoder, prompt)
        drafts = [e for e in trace.events if e.KIND == "draft"]
        for draft in drafts:
            qs = [token.q for token in draft.tokens]
            assert draft.draft_forwards == len(qs) and all(q >= confidence for q in qs[:-1])
            budget = min(5, generation.max_new_tokens - (draft.tokens[0].position - len(trace.prompt_ids)))
            assert len(qs) == budget or qs[-1] < confidence
        lengths[confidence] = [len(draft.tokens) for draft in drafts]
        outputs[confidence] = output.token_ids
    assert outputs[0.0] == outputs[0.6]
    assert all(length == 5 for length in lengths[0.0][:-1])
    assert sum(lengths[0.6]) < sum(lengths[0.0]) and max(lengths[0.6]) > 1


def steps_by_source(trace) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(accepted, proposed) per step, for the steps that copied and for those that drafted."""
    accepted: dict[int, int] = {}
    for event in trace.events:
        if event.KIND == "accept":
            accepted[event.step] = accepted.get(event.step, 0) + 1
    copied, drafted = [], []
    for event in trace.events:
        if event.KIND == "draft":
            (copied if event.source else drafted).append((accepted.get(event.step, 0), drafted_count(event)))
    return copied, drafted


class CopyWheneverAMatchIs(SpeculativeDecoder):
    """Copies at every match, however the draft fares: a perfect draft would otherwise win every step."""

    def copy_proposal(self, sequence, budget, gamma, copies, drafted):
        return find_continuation(sequence, self.spec.copy_ngram, min(self.spec.copy_tokens, budget))


def test_copy_steps_keep_the_draft_cache_in_step(target) -> None:
    """The target drafting for itself accepts every drafted token, also after copy steps that the draft did not
    see (it reads their tokens with its next proposal): a draft cache out of step would break that."""
    decoder = CopyWheneverAMatchIs(target, target, SamplingParams(), GenerationParams(max_new_tokens=40),
                                   SpeculativeParams(gamma=3, copy_ngram=3, copy_tokens=6))
    prompts = list(PROMPTS[:4]) + ["Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox"]
    copied_total = 0
    for prompt in prompts:
        output, trace = generate(decoder, prompt)
        assert output.token_ids == generate(AutoregressiveDecoder(target, SamplingParams(),
                                                                  decoder.generation), prompt)[0].token_ids
        copied, drafted = steps_by_source(trace)
        # the last step may stop at an end-of-sequence token before judging the rest
        assert drafted and all(a == n for a, n in drafted[:-1]), prompt
        assert all(n <= 6 for _, n in copied)
        copied_total += len(copied)
        sequence = trace.prompt_ids + list(output.token_ids)
        for event in trace.events:
            if event.KIND == "draft" and event.source:
                start, end = event.source  # a copy of that span, proposed with certainty, no draft forward
                assert [t.id for t in event.tokens] == sequence[start:end] and event.draft_forwards == 0
                assert all(t.q == 1.0 for t in event.tokens)
    assert copied_total >= 10


def test_copies_are_proposed_where_they_are_accepted_better_than_drafts(target, weak_draft) -> None:
    """A draft that is never right loses the comparison: on a passage to repeat, copies make most proposals. (Its
    chain alone: the weak draft's runner-up is right often enough to make a sibling worth a comparison of its own.)"""
    decoder = SpeculativeDecoder(target, weak_draft, SamplingParams(), GenerationParams(max_new_tokens=48),
                                 SpeculativeParams(gamma=4, copy_ngram=3, copy_tokens=8, siblings=0))
    _, trace = generate(decoder, "Summarise the library rules below as a bulleted list.\n\n" + PASSAGE_LIBRARY)
    copied, drafted = steps_by_source(trace)
    assert len(copied) > len(drafted) and sum(a for a, _ in copied) > 10
    assert compute(trace).mean_accepted_tokens > 1.5


@pytest.mark.parametrize("draft_name, gamma", [("weak", 5), ("self", 8)])
def test_greedy_exact_with_always_rejecting_and_always_accepting_drafts(
        request, target, plain_outputs, draft_name, gamma) -> None:
    draft = request.getfixturevalue("weak_draft") if draft_name == "weak" else target
    decoder = SpeculativeDecoder(target, draft, SamplingParams(), GenerationParams(max_new_tokens=NEW_TOKENS),
                                 SpeculativeParams(gamma=gamma))
    for prompt in PROMPTS[:5]:
        output, trace = generate(decoder, prompt)
        assert output.token_ids == plain_outputs[prompt]
        if draft_name == "self":  # every draft accepted: the draft must catch up on its last token each step
            assert compute(trace).acceptance_rate == 1.0


def draft_choices(draft: LoadedModel, sequence: list[int]) -> tuple[list[int], list[int]]:
    """The draft's first and second choices after every prefix of `sequence` (index i: after sequence[: i + 1]),
    from one forward over it: what an in-step draft cache proposes on that text."""
    cache = new_cache(draft.model, len(sequence), GenerationParams())
    top = forward_tokens(draft.model, cache, sequence, num_logits=len(sequence)).topk(2).indices  # (T, 2)
    return top[:, 0].tolist(), top[:, 1].tolist()


def test_a_sibling_the_target_takes_keeps_two_tokens_and_the_draft_cache_in_step(target, noisy_draft,
                                                                                   plain_outputs) -> None:
    """With one sibling, a step whose first drafted token the target refuses for the draft's runner-up shows the
    refusal, the runner-up accepted at the same position and the target's next token as a bonus. Every step's
    runner-up and chain (as far as it follows the output) are the draft's choices for the text so far: the draft
    cache was rolled back to before its chain, and the runner-up fed, after each such step."""
    decoder = SpeculativeDecoder(target, noisy_draft, SamplingParams(), GenerationParams(max_new_tokens=NEW_TOKENS),
                                 SpeculativeParams(gamma=4, siblings=1))
    assert decoder.params()["siblings"] == 1
    wins = 0
    for prompt in PROMPTS[:5]:
        output, trace = generate(decoder, prompt)
        assert output.token_ids == plain_outputs[prompt], prompt
        sequence = trace.prompt_ids + list(output.token_ids)
        first, second = draft_choices(noisy_draft, sequence)
        known = len(trace.prompt_ids) + 1  # the prefill gave the first token
        for step in range(1, max(e.step for e in trace.events) + 1):
            events = [e for e in trace.events if e.step == step]
            draft = next(e for e in events if e.KIND == "draft")
            chain = [t for i, t in enumerate(draft.tokens) if t.parent == i]
            siblings = [t for i, t in enumerate(draft.tokens) if i > 0 and t.parent == 0]
            assert len(siblings) == 1 and len(draft.tokens) == len(chain) + 1
            assert siblings[0].position == chain[0].position == known
            assert (chain[0].id, siblings[0].id) == (first[known - 1], second[known - 1]), (prompt, step)
            for j in range(1, len(chain)):
                if chain[j - 1].id != sequence[known + j - 1]:
                    break  # past the output, the draft read its own tokens
                assert chain[j].id == first[known + j - 1], (prompt, step, j)
            decisions = [(e.KIND, e.token.id, e.token.position) for e in events
                         if e.KIND in ("accept", "reject", "correct", "bonus")]
            if ("accept", siblings[0].id, known) in decisions:
                assert decisions[:2] == [("reject", chain[0].id, known), ("accept", siblings[0].id, known)]
                assert len(decisions) == 2 or decisions[2][::2] == ("bonus", known + 1)
                wins += 1
            known += next(e for e in events if e.KIND == "commit").num_tokens
    assert wins >= 3
    # drafted counts positions: a sibling is another guess at its chain's first position
    assert compute(trace).drafted == sum(len(e.tokens) - 1 for e in trace.events if e.KIND == "draft")


def test_trace_records_every_decision(target, noisy_draft) -> None:
    decoder = SpeculativeDecoder(target, noisy_draft, SamplingParams(temperature=0.9, seed=4),
                                 GenerationParams(max_new_tokens=30), SpeculativeParams(gamma=4))
    output, trace = generate(decoder, "Tell me about the moon.")
    kinds = [e.KIND for e in trace.events]
    assert {"draft", "verify", "accept", "reject", "correct", "commit", "finish"} <= set(kinds)
    for event in trace.events:
        if event.KIND == "draft":
            assert all(t.q is not None and 0 < t.q <= 1 for t in event.tokens)
        if event.KIND in ("accept", "reject"):
            assert event.token.p is not None and event.token.q is not None and 0 <= event.u < 1
            # accept x with prob min(1, p/q): the recorded draw must agree with the decision
            assert (event.u * event.token.q <= event.token.p) == (event.KIND == "accept")
        if event.KIND == "commit" and event.step > 0:
            assert event.draft_s > 0 and event.verify_s > 0 and event.overhead_s >= 0
    assert sum(e.num_tokens for e in trace.events if e.KIND == "commit") == len(output.token_ids)
    metrics = compute(trace)
    assert metrics.target_forwards == 1 + kinds.count("verify")
    assert metrics.mean_accepted_tokens == pytest.approx((len(output.token_ids) - 1) / kinds.count("verify"))


def test_same_seed_same_output_different_seed_different(target, noisy_draft) -> None:
    def run(seed: int) -> tuple[int, ...]:
        decoder = SpeculativeDecoder(target, noisy_draft, SamplingParams(temperature=1.0, seed=seed),
                                     GenerationParams(max_new_tokens=20), SpeculativeParams(gamma=3))
        return generate(decoder, "Invent a name for a bakery.")[0].token_ids

    assert run(5) == run(5)
    assert run(5) != run(6)

    def run_copying(seed: int) -> tuple[int, ...]:
        decoder = SpeculativeDecoder(target, noisy_draft, SamplingParams(temperature=1.0, seed=seed),
                                     GenerationParams(max_new_tokens=20), SpeculativeParams(gamma=3, copy_ngram=2))
        return generate(decoder, "Say 'la la la' ten times.")[0].token_ids

    assert run_copying(1) == run_copying(1)
    assert run_copying(1) != run_copying(2)


def test_speculative_sampling_matches_the_target_distribution(target, noisy_draft) -> None:
    """The first two tokens of the real model, sampled 300 times each way, follow the analytic joint."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=2, raw=True)
    prompt = SAMPLED_PROMPT
    assert_follows_target(target, lambda s: AutoregressiveDecoder(target, s, generation), prompt, sampling)
    assert_follows_target(target, lambda s: SpeculativeDecoder(target, noisy_draft, s, generation,
                                                               SpeculativeParams(gamma=2)), prompt, sampling)


def test_sampling_with_a_confidence_stop_matches_the_target_distribution(target, noisy_draft) -> None:
    """Whether the second drafted token is drafted depends on the first's draft probability; the first two
    generated tokens (the second a verified proposal in every run) still follow the analytic joint."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=3, raw=True)
    made: list[SpeculativeDecoder] = []

    def make(s: SamplingParams) -> SpeculativeDecoder:
        made.append(SpeculativeDecoder(target, noisy_draft, s, generation, SpeculativeParams(gamma=2, confidence=0.5)))
        return made[-1]

    assert_follows_target(target, make, SAMPLED_PROMPT, sampling)
    first_drafts = set()
    for decoder in made[1:41]:  # the runs are seeded: which of them stopped early is reproducible
        trace = generate(decoder, SAMPLED_PROMPT)[1]
        first_drafts.add(len(next(e for e in trace.events if e.KIND == "draft").tokens))
    assert first_drafts == {1, 2}  # with two tokens to go, some runs stopped after one drafted token, some drafted two


def test_sampling_with_copies_matches_the_target_distribution(target, noisy_draft) -> None:
    """On a repetitive prompt the second token is usually a copied, one-hot proposal; the joint still matches."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=2, raw=True)
    prompt = "red green blue red green blue red green"

    def make(s: SamplingParams) -> SpeculativeDecoder:
        return SpeculativeDecoder(target, noisy_draft, s, generation, SpeculativeParams(gamma=2, copy_ngram=3))

    assert_follows_target(target, make, prompt, sampling)
    copied = sum(bool(steps_by_source(generate(make(dataclasses.replace(sampling, seed=seed)), prompt)[1])[0])
                 for seed in range(40))
    assert copied > 20


@pytest.fixture(scope="module")
def narrow_draft(target, noisy_draft, plain_outputs, tmp_path_factory) -> LoadedModel:
    """The noisy draft proposing from a few hundred tokens only: the 100 lowest ids and what plain decoding writes
    for every other exactness prompt, but never the target's likeliest first token for the sampling test's
    prompt, so that some tokens the target writes can come only from its own correction or bonus."""
    folder = tmp_path_factory.mktemp("draft") / "narrow"
    shutil.copytree(noisy_draft.folder, folder)
    kept = set(range(100)) | {t for prompt in PROMPTS[::2] for t in plain_outputs[prompt]}
    kept.discard(int(first_logits(target, SAMPLED_PROMPT).argmax()))
    save_file({VOCAB_IDS: torch.tensor(sorted(kept))}, str(folder / PROPOSAL_VOCAB))
    return load_model(ModelSpec(source=str(folder), device="cpu", dtype="float32"))


def first_logits(target, prompt: str) -> torch.Tensor:
    """The target's logits (V,) for the first token after a raw prompt."""
    ids = encode_prompt(target, prompt, GenerationParams(raw=True))
    cache = new_cache(target.model, len(ids), GenerationParams())
    return forward_tokens(target.model, cache, ids)[-1]


def test_a_draft_with_a_proposal_vocabulary_proposes_only_from_it_and_stays_exact(target, narrow_draft,
                                                                                  plain_outputs) -> None:
    decoder = SpeculativeDecoder(target, narrow_draft, SamplingParams(), GenerationParams(max_new_tokens=NEW_TOKENS),
                                 SpeculativeParams(gamma=3))
    allowed = set(decoder.proposal.ids.tolist())
    assert 100 < len(allowed) < 2000 and decoder.params()["draft_vocab"] == len(allowed)
    # read and packed once per loaded draft, shared by every decoder over it
    assert SpeculativeDecoder(target, narrow_draft, SamplingParams(), GenerationParams()).proposal is decoder.proposal
    assert any(t not in allowed for output in plain_outputs.values() for t in output)  # the restriction bites
    assert_greedy_exact(decoder, plain_outputs)
    output, trace = generate(decoder, PROMPTS[1])
    drafted = [t.id for e in trace.events if e.KIND == "draft" for t in e.tokens]
    assert drafted and set(drafted) <= allowed


def test_greedy_drafting_over_the_proposal_rows_picks_what_the_whole_vocabulary_would(target, narrow_draft) -> None:
    """Greedy drafting scores the proposal rows alone and maps the argmax back to its token id: the same tokens,
    with the same draft probabilities, as spreading the rows over the whole vocabulary (-inf elsewhere)."""
    generation = GenerationParams(max_new_tokens=NEW_TOKENS)
    compact = SpeculativeDecoder(target, narrow_draft, SamplingParams(), generation, SpeculativeParams(gamma=6))
    spread = SpeculativeDecoder(target, narrow_draft, SamplingParams(), generation, SpeculativeParams(gamma=6))
    spread.proposal_ids = None  # the whole-vocabulary path
    for prompt in PROMPTS[:4]:
        ids = encode_prompt(target, prompt, generation)
        drafted = []
        for decoder in (compact, spread):
            cache = new_cache(narrow_draft.model, len(ids) + 8, generation)
            drafted.append(decoder.propose(cache, ids, 6, torch.Generator(), siblings=2))
        compact_drafted, spread_drafted = drafted
        assert compact_drafted.tokens == spread_drafted.tokens and len(compact_drafted.tokens) == 6
        assert compact_drafted.shown == pytest.approx(spread_drafted.shown, rel=1e-5)
        assert compact_drafted.siblings == spread_drafted.siblings and len(compact_drafted.siblings) == 2
        assert compact_drafted.tokens[0] not in compact_drafted.siblings
        assert compact_drafted.sibling_q == pytest.approx(spread_drafted.sibling_q, rel=1e-5)
        assert compact_drafted.shown[0] >= compact_drafted.sibling_q[0] >= compact_drafted.sibling_q[1]


def test_sampling_with_a_proposal_vocabulary_matches_the_target_distribution(target, narrow_draft) -> None:
    """q is zero outside the draft's vocabulary, which lacks the target's likeliest first token: that token can
    come from the residual alone, and the joint still matches."""
    likeliest = int(first_logits(target, SAMPLED_PROMPT).argmax())
    assert likeliest not in set(SpeculativeDecoder(target, narrow_draft, SamplingParams(), GenerationParams())
                                .proposal.ids.tolist())
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=2, raw=True)
    proposed = assert_follows_target(target, lambda s: SpeculativeDecoder(target, narrow_draft, s, generation,
                                                                          SpeculativeParams(gamma=2)),
                                     SAMPLED_PROMPT, sampling)
    assert proposed > 0


def test_a_malformed_proposal_vocabulary_is_refused(target, noisy_draft, tmp_path) -> None:
    folder = tmp_path / "draft"
    shutil.copytree(noisy_draft.folder, folder)
    save_file({VOCAB_IDS: torch.tensor([5, 3])}, str(folder / PROPOSAL_VOCAB))  # not ascending
    draft = load_model(ModelSpec(source=str(folder), device="cpu"))
    with pytest.raises(ModelLoadError, match="draft: .*proposal_vocab.safetensors holds a malformed 'vocab_ids'"):
        SpeculativeDecoder(target, draft, SamplingParams(), GenerationParams())
    save_file({"ids": torch.tensor([3, 5])}, str(folder / PROPOSAL_VOCAB))
    with pytest.raises(ModelLoadError, match="has no 'vocab_ids' tensor"):
        SpeculativeDecoder(target, draft, SamplingParams(), GenerationParams())


class OtherTokenizer:
    def __init__(self, tokenizer) -> None:
        self.vocab = dict(tokenizer.get_vocab())
        self.vocab["<extra>"] = len(self.vocab)

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_incompatible_draft_is_refused_before_decoding(target) -> None:
    other = dataclasses.replace(target, tokenizer=OtherTokenizer(target.tokenizer))
    with pytest.raises(ConfigError, match="draft: its tokenizer differs"):
        SpeculativeDecoder(target, other, SamplingParams(), GenerationParams())


@pytest.mark.parametrize("gamma", [0, 17])
def test_gamma_range(gamma) -> None:
    with pytest.raises(ConfigError, match=r"gamma must be an integer in \[1, 16\]"):
        SpeculativeParams(gamma=gamma)


@pytest.mark.parametrize("value, message", [(-0.1, r"confidence must be in \[0, 1\)"),
                                            (1.0, r"confidence must be in \[0, 1\)"),
                                            (float("nan"), "confidence must be a finite number")])
def test_confidence_range(value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeParams(confidence=value)


def test_siblings_range_and_default() -> None:
    with pytest.raises(ConfigError, match=r"siblings must be an integer in \[0, 4\]"):
        SpeculativeParams(siblings=5)
    with pytest.raises(ConfigError, match="siblings: only greedy decoding"):
        SpeculativeParams(siblings=1).resolve(12, greedy=False)
    with pytest.raises(ConfigError, match="siblings: only greedy decoding"):
        SpeculativeParams(siblings=1).check_acceptance(greedy=False)
    SpeculativeParams(siblings=1).check_acceptance(greedy=True)
    SpeculativeParams().check_acceptance(greedy=False)  # left None: resolved to 0 when sampling
    assert SpeculativeParams().resolve(12, greedy=False).siblings == 0
    assert SpeculativeParams(gamma=4).resolve(12, greedy=True).siblings == 1  # 6 rows in one pass
    assert SpeculativeParams(gamma=11).resolve(12, greedy=True).siblings == 0  # 13 rows: a second pass
    assert SpeculativeParams().resolve(None, greedy=True).siblings == 0  # no CPU kernel (a GPU)
    assert SpeculativeParams(siblings=2).resolve(None, greedy=True).siblings == 2


@pytest.mark.parametrize("params, rows_per_pass, expected", [
    (SpeculativeParams(copy_ngram=3), None, 8),  # no CPU kernel (a GPU)
    (SpeculativeParams(copy_ngram=3), 12, 8),  # AVX-512: a copy of 8 and the last token fit one pass
    (SpeculativeParams(copy_ngram=3), 9, 8),
    (SpeculativeParams(copy_ngram=3), 8, 5),
    (SpeculativeParams(copy_ngram=3), 6, 5),  # AVX2: a copy of 8 would cost a second pass, one of 5 fits
    (SpeculativeParams(copy_ngram=3), 5, 8),  # not even 5 fits: the longer copy
    (SpeculativeParams(copy_ngram=3, copy_tokens=8), 6, 8),  # a chosen length stays
    (SpeculativeParams(copy_ngram=3, copy_tokens=3), None, 3),
])
def test_copy_length_fits_one_pass_unless_given(params, rows_per_pass, expected) -> None:
    for greedy in (True, False):
        resolved = params.resolve(rows_per_pass, greedy)
        assert resolved.copy_tokens == expected
        assert resolved.resolve(rows_per_pass, greedy) == resolved


@pytest.mark.parametrize("field, value, message", [("copy_ngram", -1, r"copy_ngram must be an integer in \[0, 8\]"),
                                                   ("copy_ngram", 9, r"copy_ngram must be an integer in \[0, 8\]"),
                                                   ("copy_tokens", 0, r"copy_tokens must be an integer in \[1, 16\]"),
                                                   ("copy_ngram", 2.0, "copy_ngram must be an integer, got 2.0")])
def test_copy_parameter_ranges(field, value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeParams(**{field: value})
