"""Statistics for sampling tests: the analytic distribution of the first generated tokens and a chi-square
goodness-of-fit test against it."""

from __future__ import annotations

import dataclasses
from typing import Any

from playground.config import GenerationParams, SamplingParams
from playground.decoding import encode_prompt
from playground.decoding.base import forward_tokens, new_cache
from playground.engine import generate
from playground.sampling import make_generator, next_token, probabilities

# 99.9th percentiles of chi-square by degrees of freedom: a correct sampler fails 1 run in 1,000 (seeds are fixed).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
            10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def joint_first_two(target, prompt_ids: list[int], sampling: SamplingParams) -> dict[tuple[int, int], float]:
    """The analytic distribution of the first two generated tokens under the target and `sampling`."""
    cache = new_cache(target.model, len(prompt_ids) + 2, GenerationParams())
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


def first_two_tokens(target: Any, proposer: Any, prompt: str, sampling: SamplingParams,
                     generation: GenerationParams, runs: int = 300) -> tuple[list[tuple[int, int]], int]:
    """The first two generated tokens of `runs` generations with `proposer` (None: plain decoding) seeded
    0..runs-1, and how many runs proposed anything (had a draft event)."""
    samples, proposed = [], 0
    for seed in range(runs):
        output, trace = generate(target, prompt, proposer, dataclasses.replace(sampling, seed=seed), generation)
        samples.append(output.token_ids[:2])
        proposed += any(e.KIND == "draft" for e in trace.events)
    return samples, proposed


def assert_follows_target(target: Any, proposer: Any, prompt: str, sampling: SamplingParams,
                          generation: GenerationParams) -> int:
    """Chi-square test of the first two tokens against the analytic joint; returns the runs that proposed."""
    joint = joint_first_two(target, encode_prompt(target, prompt, generation), sampling)
    samples, proposed = first_two_tokens(target, proposer, prompt, sampling, generation)
    stat, df = chi_square_vs(samples, joint)
    assert stat < CHI2_999[df], (stat, df)
    return proposed


def reference_tokens(target: Any, prompt: str, sampling: SamplingParams, generation: GenerationParams) -> list[int]:
    """Plain decoding written out as a loop of one-token forwards, independent of the engine: each token drawn by
    `next_token` from a generator seeded as the engine seeds a request's, until an end-of-sequence id or the
    length limit."""
    prompt_ids = encode_prompt(target, prompt, generation)
    cache = new_cache(target.model, len(prompt_ids) + generation.max_new_tokens, generation)
    generator = make_generator(sampling.seed, target.model.device)
    logits, tokens = forward_tokens(target.model, cache, prompt_ids)[-1], []
    while True:
        tokens.append(int(next_token(logits, sampling, generator)[0]))
        if tokens[-1] in target.eos_token_ids or len(tokens) == generation.max_new_tokens:
            return tokens
        logits = forward_tokens(target.model, cache, tokens[-1:])[-1]
