"""Logits to probabilities and tokens: temperature, top-k, top-p, seeded draws. Small pure functions.

Greedy (temperature 0) is the argmax, represented as a one-hot distribution so that every acceptance rule
can treat greedy and sampled decoding alike.
"""

from __future__ import annotations

import torch

from .config import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private random stream: the same seed gives the same samples, whatever else uses torch's global RNG."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution decoding draws from: logits (..., V) -> probabilities (..., V) float32.

    Order: temperature, then top-k, then top-p (the smallest set of most likely tokens whose mass reaches p;
    the most likely token always stays). Temperature 0 gives the one-hot argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Drop a token when the mass of strictly more likely tokens already reaches top_p.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs (..., V) -> (...) int64."""
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token from logits (..., V); returns (token (...), its probability (...)).

    The probability is under the sampling distribution; when greedy, under the model's own softmax at
    temperature 1 (a one-hot 1.0 would tell the viewer nothing about the model's confidence).
    """
    if params.greedy:
        logits = logits.float()
        top, token = logits.max(-1)
        # softmax at the argmax = 1 / sum(exp(l - max))
        return token, 1.0 / (logits - top.unsqueeze(-1)).exp().sum(-1)
    probs = probabilities(logits, params)
    token = sample(probs, generator)
    return token, probs.gather(-1, token.unsqueeze(-1)).squeeze(-1)
