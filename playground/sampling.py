"""Logits to probabilities and tokens (temperature, top-k, top-p, seeded draws), and the acceptance rules
every speculative algorithm shares. Small pure functions.

Greedy (temperature 0) is the argmax, represented as a one-hot distribution so that every acceptance rule
can treat greedy and sampled decoding alike.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class ChainVerdict:
    """Outcome of verifying K proposed tokens with one target forward.

    num_accepted: how many leading proposals are kept. token: the one token emitted after them, a correction
    (`corrected`, a proposal was rejected) or a bonus (all K accepted). uniforms: the draw u_i compared for each
    examined proposal (empty under greedy acceptance).
    """

    num_accepted: int
    token: int
    corrected: bool
    uniforms: tuple[float, ...]


def verify_greedy(target_logits: torch.Tensor, proposals: list[int]) -> ChainVerdict:
    """Accept while the target's argmax equals the proposal; then emit the target's argmax.

    target_logits: (K+1, V), row i scoring the position of proposal i, row K the position after them all.
    """
    argmax = target_logits.argmax(-1).tolist()  # (K+1,)
    accepted = 0
    while accepted < len(proposals) and argmax[accepted] == proposals[accepted]:
        accepted += 1
    return ChainVerdict(accepted, argmax[accepted], accepted < len(proposals), ())


def verify_lossless(p: torch.Tensor, q: torch.Tensor, proposals: list[int],
                    generator: torch.Generator) -> ChainVerdict:
    """Speculative sampling (Leviathan et al. 2023): the emitted tokens are distributed exactly as under p.

    p: (K+1, V) target distributions, row K for the bonus position; q: (K, V) the distributions the proposals
    were really drawn from (one-hot rows for n-gram or lookahead guesses).
    """
    k = len(proposals)
    index = torch.tensor(proposals, device=p.device).unsqueeze(1)  # (K, 1)
    p_x = p[:k].gather(1, index).squeeze(1)  # (K,)
    q_x = q.gather(1, index).squeeze(1)  # (K,)
    u = torch.rand(k, generator=generator, device=p.device)  # (K,)
    # accept x_i with probability min(1, p(x_i) / q(x_i)), written without dividing by q
    keep = (u * q_x <= p_x).tolist()
    accepted = keep.index(False) if False in keep else k
    uniforms = tuple(u[: min(accepted + 1, k)].tolist())
    if accepted == k:
        return ChainVerdict(k, int(sample(p[k], generator)), False, uniforms)
    # on rejection draw from norm(max(0, p - q))
    residual = (p[accepted] - q[accepted]).clamp_min(0.0)  # (V,)
    mass = residual.sum()
    if mass <= 1e-12:
        # p == q up to rounding: rejection had probability 0 in exact arithmetic; drawing from p keeps the
        # output distributed as p instead of dividing by zero.
        residual, mass = p[accepted], p[accepted].sum()
    return ChainVerdict(accepted, int(sample(residual / mass, generator)), True, uniforms)
