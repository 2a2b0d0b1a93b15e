"""Draft-model speculative decoding: greedy exactness, lossless sampling, seeds, traces, compatibility."""

from __future__ import annotations

import dataclasses

import pytest

from playground.config import ConfigError, GenerationParams, SamplingParams, SpeculativeParams
from playground.decoding import AutoregressiveDecoder, SpeculativeDecoder, encode_prompt, generate
from playground.decoding.base import forward_tokens, new_cache
from playground.metrics import compute
from playground.sampling import probabilities

from .prompts import PROMPTS

NEW_TOKENS = 24
# 99.9th percentiles of chi-square by degrees of freedom: a correct sampler fails 1 run in 1,000 (seeds are fixed).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
            10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


@pytest.fixture(scope="module")
def plain_outputs(target) -> dict[str, tuple[int, ...]]:
    decoder = AutoregressiveDecoder(target, SamplingParams(), GenerationParams(max_new_tokens=NEW_TOKENS))
    return {prompt: generate(decoder, prompt)[0].token_ids for prompt in PROMPTS}


@pytest.mark.parametrize("gamma, adaptive", [(1, False), (3, False), (5, False), (8, False), (2, True)])
def test_greedy_equals_plain_decoding(target, noisy_draft, plain_outputs, gamma, adaptive) -> None:
    assert len(PROMPTS) >= 20
    decoder = SpeculativeDecoder(target, noisy_draft, SamplingParams(), GenerationParams(max_new_tokens=NEW_TOKENS),
                                 SpeculativeParams(gamma=gamma, adaptive=adaptive))
    accepted = drafted = 0
    for prompt in PROMPTS:
        output, trace = generate(decoder, prompt)
        assert output.token_ids == plain_outputs[prompt], prompt
        metrics = compute(trace)
        accepted += round(metrics.acceptance_rate * sum(len(e.tokens) for e in trace.events if e.KIND == "draft"))
        drafted += sum(len(e.tokens) for e in trace.events if e.KIND == "draft")
    assert 0.1 < accepted / drafted < 0.95  # the runs really mixed acceptances and rejections


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


def joint_first_two(target, prompt_ids: list[int], sampling: SamplingParams) -> dict[tuple[int, int], float]:
    """The analytic distribution of the first two generated tokens under the target and `sampling`."""
    cache = new_cache(target.model, len(prompt_ids) + 2)
    p1 = probabilities(forward_tokens(target.model, cache, prompt_ids)[-1], sampling)
    joint = {}
    for t1 in p1.nonzero().flatten().tolist():
        cache.truncate(0, len(prompt_ids))
        p2 = probabilities(forward_tokens(target.model, cache, [t1])[-1], sampling)
        for t2 in p2.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def chi_square_vs(samples: list[tuple[int, int]], expected: dict[tuple[int, int], float]) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom, pooling cells expected fewer than 5 times."""
    n = len(samples)
    counts = {cell: 0 for cell in expected}
    for s in samples:
        counts[s] += 1  # a sample outside the support raises KeyError: that alone would be a failure
    big = [c for c in expected if expected[c] * n >= 5]
    small = [c for c in expected if c not in big]
    cells = [([c], expected[c]) for c in big] + ([(small, sum(expected[c] for c in small))] if small else [])
    stat = sum((sum(counts[c] for c in group) - prob * n) ** 2 / (prob * n) for group, prob in cells)
    return stat, len(cells) - 1


def test_speculative_sampling_matches_the_target_distribution(target, noisy_draft) -> None:
    """The first two tokens of the real model, sampled 300 times each way, follow the analytic joint."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=2, raw=True)
    prompt = "The best thing about summer is"
    prompt_ids = encode_prompt(target, prompt, generation)
    joint = joint_first_two(target, prompt_ids, sampling)
    for make in ("plain", "speculative"):
        samples = []
        for seed in range(300):
            seeded = dataclasses.replace(sampling, seed=seed)
            decoder = (AutoregressiveDecoder(target, seeded, generation) if make == "plain" else
                       SpeculativeDecoder(target, noisy_draft, seeded, generation, SpeculativeParams(gamma=2)))
            ids = generate(decoder, prompt)[0].token_ids
            samples.append((ids[0], ids[1]))
        stat, df = chi_square_vs(samples, joint)
        assert stat < CHI2_999[df], (make, stat, df)


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
