"""Draft-model speculative decoding: greedy exactness, sampling that follows the target, seeds, traces,
copies grafted on, proposal vocabularies, compatibility."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import save_file

from playground.bench.suite import PASSAGE_LIBRARY
from playground.config import ConfigError, GenerationParams, ModelSpec, SamplingParams
from playground.decoding import encode_prompt
from playground.decoding.base import forward_tokens, new_cache
from playground.decoding.prompt_lookup import PromptLookupParams
from playground.decoding.registry import build_proposer
from playground.decoding.speculative import DraftGuesser, SpeculativeParams
from playground.engine import generate
from playground.metrics import compute
from playground.models import LoadedModel, ModelLoadError, load_model
from playground.models.vocab import PROPOSAL_VOCAB, VOCAB_IDS

from .prompts import NEW_TOKENS, PROMPTS, assert_greedy_exact
from .stats import assert_follows_target

SAMPLED_PROMPT = "The best thing about summer is"
COPIES = PromptLookupParams(max_ngram=3, num_draft=6, branches=1)


def drafting(target: LoadedModel, draft: LoadedModel, copies: PromptLookupParams | None = None,
             **settings) -> DraftGuesser:
    """The draft model's proposer over `draft` with `settings` (SpeculativeParams fields), copies grafted on. The
    test drafts are as large as the target: their forwards are priced at nothing unless `draft_cost` says, so that
    chains are drafted wherever they may be accepted."""
    settings.setdefault("draft_cost", 0.0)
    return build_proposer(target, "speculative", SpeculativeParams(**settings), copies, draft=draft)


@pytest.mark.parametrize("gamma, copies", [(4, None), (2, COPIES), (6, COPIES)], ids=["g4", "g2-copies", "g6-copies"])
def test_greedy_equals_plain_decoding(target, noisy_draft, plain_outputs, gamma, copies) -> None:
    accepted, drafted = assert_greedy_exact(target, drafting(target, noisy_draft, copies, gamma=gamma),
                                            plain_outputs)
    assert 0 < accepted < drafted


@pytest.mark.parametrize("draft_name, gamma", [("weak", 5), ("self", 8)])
def test_greedy_exact_with_always_rejecting_and_always_accepting_drafts(
        request, target, plain_outputs, draft_name, gamma) -> None:
    draft = request.getfixturevalue("weak_draft") if draft_name == "weak" else target
    proposer = drafting(target, draft, gamma=gamma)
    generation = GenerationParams(max_new_tokens=NEW_TOKENS)
    for prompt in PROMPTS[:5]:
        output, trace = generate(target, prompt, proposer, SamplingParams(), generation)
        assert output.token_ids == plain_outputs[prompt]
        if draft_name == "self":  # every drafted token accepted: the draft must catch up on its last token each step
            metrics = compute(trace)
            assert metrics.accepted > 0 and metrics.rejected == 0


def test_copies_grafted_on_make_proposals_where_the_draft_is_wrong(target, weak_draft) -> None:
    """A draft that is never right and a passage to repeat: the copies grafted onto its chains are what is
    accepted."""
    proposer = drafting(target, weak_draft, PromptLookupParams(max_ngram=3, num_draft=8, branches=1), gamma=4)
    output, trace = generate(target, "Summarise the library rules below as a bulleted list.\n\n" + PASSAGE_LIBRARY,
                             proposer, SamplingParams(), GenerationParams(max_new_tokens=48))
    copied = [e for e in trace.events if e.KIND == "draft" and e.noted("copied")]
    assert len(copied) > 5 and compute(trace).mean_accepted_tokens > 1.5
    sequence = trace.prompt_ids + list(output.token_ids)
    for event in copied:  # the copy's span starts among the tree's nodes (the node budget may cut its end)
        assert sequence[event.note["source"][0]] in {t.id for t in event.tokens}


def test_trace_records_every_decision(target, noisy_draft) -> None:
    proposer = drafting(target, noisy_draft, gamma=4)
    output, trace = generate(target, "Tell me about the moon.", proposer, SamplingParams(temperature=0.9, seed=4),
                             GenerationParams(max_new_tokens=30))
    kinds = [e.KIND for e in trace.events]
    assert {"draft", "verify", "accept", "reject", "correct", "commit", "finish"} <= set(kinds)
    for event in trace.events:
        if event.KIND == "draft":
            assert all(t.q is not None and 0 < t.q <= 1 for t in event.tokens) and event.draft_forwards > 0
        if event.KIND in ("accept", "reject"):
            assert event.token.p is not None and event.token.q is not None
        if event.KIND == "commit" and event.step > 0:
            assert event.verify_s > 0 and event.overhead_s >= 0
    assert sum(e.num_tokens for e in trace.events if e.KIND == "commit") == len(output.token_ids)
    metrics = compute(trace)
    assert metrics.target_forwards == 1 + kinds.count("verify")
    assert metrics.mean_accepted_tokens == pytest.approx((len(output.token_ids) - 1) / kinds.count("verify"))


@pytest.mark.parametrize("sample", [False, True], ids=["greedy-chain", "sampled-chain"])
def test_same_seed_same_output_different_seed_different(target, noisy_draft, sample) -> None:
    proposer = drafting(target, noisy_draft, COPIES, gamma=3, sample=sample)

    def run(seed: int, prompt: str) -> tuple[int, ...]:
        return generate(target, prompt, proposer, SamplingParams(temperature=1.0, seed=seed),
                        GenerationParams(max_new_tokens=20))[0].token_ids

    for prompt in ("Invent a name for a bakery.", "Say 'la la la' ten times."):
        assert run(5, prompt) == run(5, prompt)
        assert run(5, prompt) != run(6, prompt)


@pytest.mark.parametrize("sample, copies", [(False, None), (True, None), (True, COPIES)],
                         ids=["greedy-chain", "sampled-chain", "sampled-chain-copies"])
def test_sampling_matches_the_target_distribution(target, noisy_draft, sample, copies) -> None:
    """The first two tokens of the real model, sampled 300 times (the second a verified proposal), follow the
    analytic joint, whether the chain is the draft's argmax (one-hot) or drawn from q and judged by the lossless
    rule."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=3, raw=True)
    proposer = drafting(target, noisy_draft, copies, gamma=2, sample=sample)
    assert assert_follows_target(target, proposer, SAMPLED_PROMPT, sampling, generation) > 150


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
    proposer = drafting(target, narrow_draft, gamma=3)
    allowed = set(proposer.rows.ids.tolist())
    assert 100 < len(allowed) < 2000
    assert any(t not in allowed for output in plain_outputs.values() for t in output)  # the restriction bites
    assert_greedy_exact(target, proposer, plain_outputs)
    _, trace = generate(target, PROMPTS[1], proposer, SamplingParams(), GenerationParams(max_new_tokens=NEW_TOKENS))
    drafted = [t.id for e in trace.events if e.KIND == "draft" for t in e.tokens]
    assert drafted and set(drafted) <= allowed


def test_sampling_with_a_proposal_vocabulary_matches_the_target_distribution(target, narrow_draft) -> None:
    """q is zero outside the draft's vocabulary, which lacks the target's likeliest first token: that token can
    come from the residual alone, and the joint still matches."""
    proposer = drafting(target, narrow_draft, gamma=2, sample=True)
    assert int(first_logits(target, SAMPLED_PROMPT).argmax()) not in set(proposer.rows.ids.tolist())
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=3, raw=True)
    assert assert_follows_target(target, proposer, SAMPLED_PROMPT, sampling, generation) > 0


def test_a_malformed_proposal_vocabulary_is_refused(target, noisy_draft, tmp_path) -> None:
    folder = tmp_path / "draft"
    shutil.copytree(noisy_draft.folder, folder)
    save_file({VOCAB_IDS: torch.tensor([5, 3])}, str(folder / PROPOSAL_VOCAB))  # not ascending
    draft = load_model(ModelSpec(source=str(folder), device="cpu"))
    with pytest.raises(ModelLoadError, match="draft: .*proposal_vocab.safetensors holds a malformed 'vocab_ids'"):
        drafting(target, draft)
    save_file({"ids": torch.tensor([3, 5])}, str(folder / PROPOSAL_VOCAB))
    with pytest.raises(ModelLoadError, match="has no 'vocab_ids' tensor"):
        drafting(target, draft)


class OtherTokenizer:
    def __init__(self, tokenizer) -> None:
        self.vocab = dict(tokenizer.get_vocab())
        self.vocab["<extra>"] = len(self.vocab)

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_incompatible_draft_is_refused_before_decoding(target) -> None:
    other = dataclasses.replace(target, tokenizer=OtherTokenizer(target.tokenizer))
    with pytest.raises(ConfigError, match="draft: its tokenizer differs"):
        drafting(target, other)


@pytest.mark.parametrize("field, value, message", [("gamma", 0, r"gamma must be an integer in \[1, 16\]"),
                                                   ("gamma", 17, r"gamma must be an integer in \[1, 16\]"),
                                                   ("draft_cost", 1.5, r"draft_cost must be in \[0, 1\] or None"),
                                                   ("sample", "yes", "sample must be true or false")])
def test_parameter_ranges(field, value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeParams(**{field: value})
