"""Sampling: filters match their definitions and seeded draws follow the analytic distribution."""

from __future__ import annotations

import pytest
import torch

from playground.config import ConfigError, SamplingParams
from playground.models import native
from playground.sampling import (
    Drawn,
    accept,
    argmax_rows,
    draws_ahead,
    draws_along,
    greedy_rows,
    make_generator,
    next_token,
    probabilities,
    sample,
    softmax_at,
)

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_is_one_hot_argmax_and_reports_model_probability() -> None:
    probs = probabilities(LOGITS, SamplingParams())
    assert probs.tolist() == [1.0, 0, 0, 0, 0, 0]
    token, p = next_token(LOGITS, SamplingParams(), make_generator(0))
    assert int(token) == 0
    assert float(p) == pytest.approx(float(LOGITS.softmax(-1)[0]))


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "pytorch"])
def test_greedy_rows_and_softmax_at_match_softmax(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Natively where the kernel serves, through PyTorch otherwise (switched off, or logits it does not take)."""
    if not native_on:
        monkeypatch.setattr(native, "kernel", lambda: None)
    torch.manual_seed(3)
    logits = torch.randn(5, 1000) * 3
    logits[2, 10] = logits[2, 20] = 40.0  # a tie: the first
    argmax, normaliser = greedy_rows(logits)
    assert argmax == logits.argmax(-1).tolist() == argmax_rows(logits)
    torch.testing.assert_close(normaliser, torch.logsumexp(logits, -1))
    cells = [(4, 3), (0, 999), (4, argmax[4]), (2, 10)]
    want = [float(logits.softmax(-1)[row, token]) for row, token in cells]
    assert softmax_at(logits, cells) == pytest.approx(want, rel=1e-5)
    inner = [(3, 5), (1, 7), (3, 0)]  # rows neither first nor consecutive: normalised over the span they name
    assert softmax_at(logits, inner) == pytest.approx([float(logits.softmax(-1)[r, x]) for r, x in inner], rel=1e-5)
    assert softmax_at(logits, []) == []
    assert argmax_rows(logits.double()) == argmax  # float64: PyTorch's


def test_greedy_next_token_keeps_batch_shape() -> None:
    logits = torch.randn(2, 3, 50)
    token, p = next_token(logits, SamplingParams(), make_generator(0))
    assert token.shape == p.shape == (2, 3)
    assert torch.equal(token, logits.argmax(-1))
    torch.testing.assert_close(p, logits.softmax(-1).max(-1).values)


def test_temperature_top_k_top_p() -> None:
    t = probabilities(LOGITS, SamplingParams(temperature=2.0))
    assert torch.allclose(t, (LOGITS / 2).softmax(-1))
    k = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(k, torch.cat([LOGITS[:2].softmax(-1), torch.zeros(4)]))
    full = LOGITS.softmax(-1)
    # top_p keeps the fewest most likely tokens whose mass reaches p: here the first two (0.57 + 0.21 >= 0.7).
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.cat([full[:2] / full[:2].sum(), torch.zeros(4)]))
    for top_p in (1e-6, 1e-46, 1e-300):  # below float32's smallest number too (it rounds to 0 there)
        tiny = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
        assert tiny.tolist() == [1.0, 0, 0, 0, 0, 0], top_p


def test_seeded_draws_follow_the_distribution() -> None:
    """Chi-square goodness of fit of 20,000 seeded draws against the analytic softmax (df = 5)."""
    params = SamplingParams(temperature=1.3, seed=7)
    probs = probabilities(LOGITS, params)
    draws = sample(probs.expand(20_000, -1), make_generator(params.seed))
    counts = torch.bincount(draws, minlength=6).double()
    expected = probs.double() * 20_000
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5  # 99.9th percentile of chi-square with 5 degrees of freedom


def test_same_seed_same_samples_different_seed_different() -> None:
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0)).expand(50, -1)
    a = sample(probs, make_generator(1))
    assert torch.equal(a, sample(probs, make_generator(1)))
    assert not torch.equal(a, sample(probs, make_generator(2)))


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"seed": -5}, "seed"),
])
def test_bad_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kwargs)


def test_draws_along_draws_what_plain_decoding_draws_and_stops_at_the_first_refusal() -> None:
    """The one-hot rule of the batching engine: row by row the same draws as `next_token` on the same stream, kept
    while they equal the proposals; greedy, the argmaxes as long as they equal the proposals and the one after."""
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 2  # (K+1, V) for K = 3 proposals
    greedy = SamplingParams()
    for proposals in ([int(logits[0].argmax()), int(logits[1].argmax()), 5], [1, 2, 3],
                      [int(r.argmax()) for r in logits[:3]]):
        rows, drawn, _ = zip(*draws_along(logits, proposals, greedy, make_generator(0)))
        argmax = logits.argmax(-1).tolist()  # (K+1,)
        matched = next((i for i, (a, x) in enumerate(zip(argmax, proposals)) if a != x), len(proposals))
        assert list(drawn) == proposals[:matched] + [argmax[matched]]
        assert rows == tuple(range(len(drawn)))
    params = SamplingParams(temperature=1.5, top_k=8)
    kept = set()
    for seed in range(300):
        proposals = [int(logits[0].argmax()), int(logits[1].argmax()), int(logits[2].argmax())]
        drawn = [token for _, token, _ in draws_along(logits, proposals, params, make_generator(seed))]
        stream = make_generator(seed)
        plain = [int(next_token(row, params, stream)[0]) for row in logits[: len(drawn)]]
        assert drawn == plain
        # every draw but the last confirmed its proposal; the last refused it or is the bonus
        assert drawn[:-1] == proposals[: len(drawn) - 1]
        assert len(drawn) == 4 or drawn[-1] != proposals[len(drawn) - 1]
        kept.add(len(drawn) - 1)
    assert kept == {0, 1, 2, 3}  # refusals at every position and whole copies kept


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=6, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_draws_made_beforehand_give_the_same_walk_and_leave_the_stream_where_it_would_be(params) -> None:
    """Off the CPU the engine draws every row of a step at once (`draws_ahead`): greedy, the argmax (the first of
    equal maxima); sampled, each row with the uniform of its depth, the generator then rewound to where drawing row
    by row would have left it. The walk over those draws is the walk that draws row by row."""
    torch.manual_seed(2)
    parents, depths = [0, 0, 1, 1, 2, 3], [0, 1, 1, 2, 2, 2, 3]
    for seed in range(60):
        logits = (torch.randn(7, 9) * 2).round()  # (1 + 6, V): rounded, so that equal maxima come up
        # each first child the likeliest token after its parent, so that walks go deep
        proposals = [int(logits[parent].argmax()) if i in (0, 2, 4, 5) else int(torch.randint(0, 9, ()))
                     for i, parent in enumerate(parents)]
        ahead, by_row = make_generator(seed), make_generator(seed)
        token, p, _, states = draws_ahead(logits, params, ahead, depths)
        drawn = Drawn(token.tolist(), p.tolist(), states)
        ours = list(accept(logits, proposals, parents, params, ahead, drawn=drawn))
        drawn.rewind(ahead, len(ours))
        theirs = list(draws_along(logits, proposals, params, by_row, parents))
        assert [(row, t) for row, t, _ in ours] == [(row, t) for row, t, _ in theirs]
        assert [p for *_, p in ours] == pytest.approx([p for *_, p in theirs])
        assert torch.equal(ahead.get_state(), by_row.get_state())
        assert torch.rand(1, generator=ahead) == torch.rand(1, generator=by_row)


def test_draws_along_a_tree_follows_the_child_equal_to_each_draw() -> None:
    """A tree of one-hot proposals: the walk goes down to the child whose token is the draw, so the tokens are plain
    decoding's draws row by row along the path, which is every node's chance of being kept p(x) on its path."""
    torch.manual_seed(1)
    logits = torch.randn(6, 5) * 0.5  # (1 + 5, V): rows of the root and of nodes 1..5
    # root -> nodes 1 (token 0), 2 (token 1); node 1 -> 3 (token 2), 4 (token 3); node 2 -> 5 (token 4)
    proposals, parents = [0, 1, 2, 3, 4], [0, 0, 1, 1, 2]
    params = SamplingParams(temperature=1.0)
    seen = set()
    for seed in range(400):
        walk = [(row, token) for row, token, _ in draws_along(logits, proposals, params, make_generator(seed), parents)]
        stream = make_generator(seed)
        assert [token for _, token in walk] == [int(next_token(logits[row], params, stream)[0]) for row, _ in walk]
        for (row, token), (next_row, _) in zip(walk, walk[1:]):
            assert parents[next_row - 1] == row and proposals[next_row - 1] == token
        seen.add(tuple(row for row, _ in walk))
    assert {(0,), (0, 1), (0, 2), (0, 1, 3), (0, 1, 4), (0, 2, 5)} <= seen
    greedy = [int(r.argmax()) for r in logits]
    walk = [(row, token) for row, token, _ in draws_along(logits, proposals, SamplingParams(), make_generator(0),
                                                          parents)]
    assert all(token == greedy[row] for row, token in walk)
