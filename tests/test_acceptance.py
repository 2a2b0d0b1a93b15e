"""The shared acceptance rules: greedy prefix matching, and lossless rejection sampling tested statistically."""

from __future__ import annotations

import pytest
import torch

from playground.sampling import make_generator, sample, verify_lossless

V = 6
P0 = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
P1 = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])
CHI2_999 = 20.5  # 99.9th percentile of chi-square with V - 1 = 5 degrees of freedom


def chi_square(tokens: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    want = expected.double() * len(tokens)
    return ((counts - want) ** 2 / want).sum().item()


def one_hot(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), V).float()


Q_CASES = {
    "different": torch.tensor([0.10, 0.10, 0.30, 0.30, 0.10, 0.10]),
    "one-hot likely": one_hot(0),
    "one-hot unlikely": one_hot(5),
    "equal": P0.clone(),
}


@pytest.mark.parametrize("case", sorted(Q_CASES))
def test_lossless_first_and_second_tokens_follow_p(case: str) -> None:
    """Proposals x_i ~ q_i; the emitted tokens must follow p whatever q is (p rows are context-free here)."""
    q0 = Q_CASES[case]
    q1 = P1.clone() if case == "equal" else Q_CASES[case].roll(2)
    p = torch.stack([P0, P1, P0])  # (K+1, V) with K = 2
    q = torch.stack([q0, q1])  # (K, V)
    generator = make_generator(1234)
    first, second = [], []
    for _ in range(12_000):
        proposals = [int(sample(q[0], generator)), int(sample(q[1], generator))]
        verdict = verify_lossless(p, q, proposals, generator)
        emitted = proposals[: verdict.num_accepted] + [verdict.token]
        first.append(emitted[0])
        if verdict.num_accepted >= 1:  # x0 accepted: the second token, independent of that event, follows p1
            second.append(emitted[1])
        assert len(verdict.uniforms) == min(verdict.num_accepted + 1, 2)
    assert chi_square(first, P0) < CHI2_999
    assert chi_square(second, P1) < CHI2_999


def test_equal_distributions_always_accept_and_zero_residual_is_guarded() -> None:
    p = torch.stack([P0, P0])
    generator = make_generator(0)
    for _ in range(200):
        x = int(sample(P0, generator))
        assert verify_lossless(p, P0.unsqueeze(0), [x], generator).num_accepted == 1
    # q slightly above p everywhere it matters: a rejection can leave an all-zero residual; p is used instead.
    q = (P0 * (1 + 1e-7)).unsqueeze(0)
    rejected = [verify_lossless(torch.stack([P0, P0]), q, [0], make_generator(s)) for s in range(50)]
    assert all(0 <= v.token < V for v in rejected)


def test_one_hot_rejection_never_re_emits_the_rejected_token() -> None:
    p = torch.stack([P0, P1])
    for seed in range(300):
        verdict = verify_lossless(p, one_hot(5).unsqueeze(0), [5], make_generator(seed))
        if verdict.corrected:
            assert verdict.token != 5


def test_same_seed_same_verdict() -> None:
    p, q = torch.stack([P0, P1]), Q_CASES["different"].unsqueeze(0)
    assert verify_lossless(p, q, [3], make_generator(9)) == verify_lossless(p, q, [3], make_generator(9))
