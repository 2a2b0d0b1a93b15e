"""The shared acceptance rules: greedy prefix matching, and lossless rejection sampling tested statistically."""

from __future__ import annotations

import pytest
import torch

from playground.sampling import make_generator, sample, verify_greedy, verify_lossless

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


def test_greedy_accepts_the_matching_prefix() -> None:
    logits = torch.full((4, V), -1.0)
    for row, best in enumerate([2, 5, 1, 3]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, [2, 5, 0]) == verify_greedy(logits, [2, 5, 4])
    verdict = verify_greedy(logits, [2, 5, 0])
    assert (verdict.num_accepted, verdict.token, verdict.corrected) == (2, 1, True)
    full = verify_greedy(logits, [2, 5, 1])
    assert (full.num_accepted, full.token, full.corrected) == (3, 3, False)
    assert verify_greedy(logits[:1], []).token == 2  # nothing proposed: plain decoding


def test_the_longest_greedy_match_among_candidates_wins_the_earliest_on_ties() -> None:
    """Candidates read their rows of one forward's argmaxes: the one the target keeps longest is chosen."""
    from playground.decoding.chain import longest_match
    from playground.sampling import greedy_matches

    argmax = [7, 3, 9, 4, 8, 1]  # the target's argmax per logits row; row 0 is the root
    assert greedy_matches([7, 3, 9], [7, 3]) == 2 and greedy_matches([7, 3], [5]) == 0
    assert greedy_matches([7], []) == 0
    rows = [[0, 1], [0, 2, 3], [0, 4, 5]]
    assert longest_match(argmax, rows, [[7, 3], [7, 9, 4], [7, 8]]) == 1  # 3 kept against 2 and 2
    assert longest_match(argmax, rows, [[7, 3], [7, 5, 4], [7, 8]]) == 0  # 2, 1, 2: the earliest of the longest
    assert longest_match(argmax, rows, [[1, 3], [2, 5, 4], [8, 8]]) == 0  # none matches


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
