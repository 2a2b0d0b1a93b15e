"""Prompt lookup: the matcher, the estimate, greedy exactness, lossless sampling with one-hot proposals, traces."""

from __future__ import annotations

import pytest

from playground.config import ConfigError, GenerationParams, SamplingParams
from playground.decoding.copies import best_copy, copy_bound, find_continuation, find_continuations
from playground.decoding.costs import ForwardCosts
from playground.decoding.planning import NgramAcceptance, guess_depth, plan_width
from playground.decoding.prompt_lookup import CopyProposer, PromptLookupParams
from playground.decoding.proposer import Proposal, merge_chains
from playground.decoding.tree import ancestor_mask
from playground.engine import generate
from playground.metrics import compute

from .prompts import PROMPTS, assert_greedy_exact
from .stats import assert_follows_target


def test_longest_suffix_wins_and_the_latest_occurrence_of_it() -> None:
    #           0  1  2  3  4  5  6  7  8  9
    sequence = [7, 1, 2, 3, 9, 1, 2, 4, 5, 2]
    # suffix [5, 2] never occurred before, suffix [2] did (at 2 and 6): the latest one (6) wins
    found = find_continuation(sequence, max_ngram=3, num_draft=2)
    assert (found.tokens, found.start, found.ngram) == ([4, 5], 7, 1)
    # a longer match beats a more recent shorter one
    found = find_continuation([1, 2, 3, 8, 3, 9, 1, 2, 3], max_ngram=3, num_draft=4)
    assert (found.tokens, found.start, found.ngram) == ([8, 3, 9, 1], 3, 3)


def test_lookup_limits() -> None:
    assert find_continuation([1, 2, 3, 4], max_ngram=3, num_draft=3) is None  # nothing repeats
    assert find_continuation([5], max_ngram=3, num_draft=3) is None
    # the copy stops after an end-of-sequence token and at the end of the text
    found = find_continuation([1, 2, 0, 6, 6, 1], max_ngram=2, num_draft=5, eos_ids=frozenset({0}))
    assert found.tokens == [2, 0]
    assert find_continuation([4, 4], max_ngram=2, num_draft=5).tokens == [4]


def test_several_distinct_copies_best_first() -> None:
    #           0  1  2  3  4  5  6
    sequence = [1, 2, 8, 1, 2, 9, 1]
    found = find_continuations(sequence, max_ngram=2, num_draft=3, limit=3)  # only two occurrences of [1]
    assert [(f.tokens, f.start, f.ngram) for f in found] == [([2, 9, 1], 4, 1), ([2, 8, 1], 1, 1)]
    assert find_continuations(sequence, max_ngram=2, num_draft=3) == found[:1]  # one by default
    # [2, 1] occurred once before (copy [2, 1]); [1] twice, and its latest copy repeats the first: skipped
    found = find_continuations([1, 2, 1, 2, 1], max_ngram=2, num_draft=3, limit=2)
    assert [(f.tokens, f.start, f.ngram) for f in found] == [([2, 1], 3, 2), ([2, 1, 2], 1, 1)]
    assert find_continuations([1, 2, 3], max_ngram=2, num_draft=3, limit=2) == []


def test_copies_merge_into_a_tree_sharing_prefixes() -> None:
    tokens, parents, source = merge_chains([[5, 6, 7], [5, 8], [9]])
    assert tokens == [5, 6, 7, 8, 9] and parents == [0, 1, 2, 1, 0] and source == [0, 0, 0, 1, 2]
    assert list(Proposal(tokens, parents, ["copy"] * 5, [1.0] * 5).depths()) == [0, 1, 2, 3, 2, 1]
    mask = ancestor_mask([-1, *parents])  # (6, 6): row 0 the last token, row i + 1 node i
    sees = {i: [j for j in range(6) if mask[i, j]] for i in range(6)}
    assert sees == {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 4], 5: [0, 5]}
    assert merge_chains([]) == ([], [], [])


def test_best_copy_looks_at_every_occurrence() -> None:
    #           0  1  2  3  4  5  6
    sequence = [1, 2, 8, 1, 2, 9, 1]
    # the latest occurrence of [1] is followed by 2, 9, 1: the proposer copies that and one token agrees ...
    assert find_continuation(sequence, max_ngram=2, num_draft=3).tokens == [2, 9, 1]
    # ... while the earlier one, followed by 2, 8, 1, agrees on three
    assert best_copy(sequence, [2, 8, 1, 5], max_ngram=2, num_draft=3) == 3
    assert best_copy(sequence, [2, 8, 1, 5], max_ngram=2, num_draft=2) == 2  # at most num_draft tokens
    assert best_copy(sequence, [7], max_ngram=2, num_draft=3) == 0
    assert best_copy([4], [4], max_ngram=2, num_draft=3) == 0  # nothing before the suffix


def test_copy_bound_on_a_hand_checked_output() -> None:
    prompt, output = [1, 2, 3, 4], [9, 1, 2, 3, 4, 7]
    # step 1 sees [..., 9]: 9 never occurred before, one token; step 2 sees [..., 9, 1]: the prompt's 1 is
    # followed by 2, 3, 4, which agree, plus the target's own token: 5 tokens in 2 forwards
    free = copy_bound(prompt, output, max_ngram=1, num_draft=8, verify_cost=1.5)
    assert free.tokens_per_forward == pytest.approx(5 / 2)
    assert free.speedup == pytest.approx(5 / (1 + 1.5))  # step 1 is a plain step, step 2 a verification
    # when verifying costs 5 steps no copy here pays: every step is plain
    assert copy_bound(prompt, output, max_ngram=1, num_draft=8, verify_cost=5.0).speedup == pytest.approx(1.0)
    assert copy_bound(prompt, [9], max_ngram=1, num_draft=8, verify_cost=1.5).tokens_per_forward == 1.0
    with pytest.raises(ValueError, match="output_ids"):
        copy_bound(prompt, [], max_ngram=1, num_draft=8, verify_cost=1.5)


def test_acceptance_is_estimated_per_matched_ngram_length() -> None:
    estimate = NgramAcceptance(max_ngram=3)
    assert estimate.expected_tokens(1, 8) > 1.4  # the optimistic prior (a = 2/3) tries copying on a new text
    for _ in range(6):
        estimate.record(1, accepted=0, judged=1)  # single-token matches keep being refused
        estimate.record(3, accepted=4, judged=4)  # three-token matches keep being copied whole
    assert estimate.acceptance(1) == pytest.approx((2 / 3) / 7)
    assert estimate.acceptance(3) == pytest.approx((24 + 2 / 3) / 25)
    assert estimate.expected_tokens(1, 8) < 1.11  # 1 + a + a^2 + ... for a = 0.095
    assert estimate.expected_tokens(3, 8) > 7
    for _ in range(150):
        estimate.decay()  # nothing observed for a while: estimates return to the prior, single-token matches retry
    assert estimate.acceptance(1) == pytest.approx(2 / 3, abs=0.01)
    # the bound for a copy not looked up yet: the best estimate over matched lengths (here 3 tokens)
    assert estimate.best_expected_tokens(2) == pytest.approx(max(estimate.expected_tokens(n, 2) for n in (1, 2, 3)))
    estimate.record(1, accepted=50, judged=50)
    assert estimate.best_expected_tokens(2) == estimate.expected_tokens(1, 2) > estimate.expected_tokens(2, 2)


def test_plan_width_commits_the_most_tokens_per_cost() -> None:
    flat = lambda width: 1.0 if width == 1 else 1.1  # noqa: E731
    assert plan_width([[1.0], [1.0]], flat) == 1  # nothing copied: plain
    assert plan_width([], flat) == 1
    # one of two requests expects 1.6 tokens from a copy of one token: 2.6 / 1.1 > 2
    assert plan_width([[1.0, 1.6], [1.0]], flat) == 2
    assert plan_width([[1.0, 1.05], [1.0]], flat) == 1  # 2.05 / 1.1 < 2: not worth the wider forward
    # longer copies pay as long as each width's gain outgrows its cost
    gains = [[1.0, 1.5, 1.8, 1.9, 1.95]]
    assert plan_width(gains, lambda w: 1 + 0.05 * (w - 1)) == 4  # 1.9 / 1.15 beats 1.95 / 1.2 and 1.8 / 1.1
    assert plan_width(gains, lambda w: 1 + 0.6 * (w - 1)) == 1
    # a tie keeps the narrower width
    assert plan_width([[1.0, 2.0, 2.0]], lambda w: float(w)) == 1




def test_guess_depth_prices_the_guessers_own_forwards() -> None:
    linear = lambda w: 1.0 + 0.1 * (w - 1)  # noqa: E731
    expected = [1.0, 1.6, 2.0, 2.2]  # depths 1, 2 and 3 reached at 0.6, 0.4 and 0.2
    assert guess_depth(expected, [3], linear, lambda places: 0.3) == 3  # one price for any depth: 2.2 / 1.6
    assert guess_depth(expected, [3], linear, lambda places: 0.3 * places) == 1  # per place: 1.6 / 1.4
    # beside a request with room for one place, a third place pays no more: (2.0 + 1.6) / 1.5 beats 3.8 / 1.6
    assert guess_depth(expected, [3, 1], linear, lambda places: 0.3) == 2
    assert guess_depth(expected, [0], linear, lambda places: 0.0) == 0  # no room: nothing to guess
    assert guess_depth(expected, [3], linear, lambda places: 5.0) == 0  # a price no step repays


FREE = ForwardCosts((1, 2), (1.0, 1.0))  # a wider forward costs what a one-token one does
DEAR = ForwardCosts((1, 2), (1.0, 1.4))  # each more token costs 0.4 of a one-token forward


def test_gate_skips_matches_on_free_text(target) -> None:
    """On open-ended text most matches are short and wrong: where wider forwards cost more, the estimate turns most of
    them into plain steps; on a passage to repeat it lets most of them through."""
    generation = GenerationParams(max_new_tokens=48)
    open_prompt, copy_prompt = PROMPTS[1], "Repeat exactly: " + "the quick brown fox jumps over the lazy dog. " * 2

    def proposing_steps(prompt: str, costs: ForwardCosts) -> int:
        _, trace = generate(target, prompt, CopyProposer(target), SamplingParams(), generation, costs=costs)
        return sum(e.KIND == "draft" for e in trace.events)

    assert proposing_steps(open_prompt, DEAR) < 0.7 * proposing_steps(open_prompt, FREE)
    assert proposing_steps(copy_prompt, DEAR) >= 0.75 * proposing_steps(copy_prompt, FREE)


SETTINGS = [PromptLookupParams(), PromptLookupParams(max_ngram=1, num_draft=2),
            PromptLookupParams(max_ngram=5, num_draft=16), PromptLookupParams(max_ngram=2, num_draft=4),
            PromptLookupParams(num_draft=5, branches=2), PromptLookupParams(branches=4)]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"n{p.max_ngram}-k{p.num_draft}-b{p.branches}")
def test_greedy_equals_plain_decoding(target, plain_outputs, params) -> None:
    accepted, drafted = assert_greedy_exact(target, CopyProposer(target, params), plain_outputs)
    assert 0 < accepted < drafted  # proposals were made, some kept and some refused


def test_trace_points_at_the_copied_span(target) -> None:
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."
    output, trace = generate(target, prompt, CopyProposer(target, PromptLookupParams(branches=1)), SamplingParams(),
                             GenerationParams(max_new_tokens=20))
    sequence = trace.prompt_ids + list(output.token_ids)
    drafts = [e for e in trace.events if e.KIND == "draft"]
    assert drafts and any(e.note["source"][0] < len(trace.prompt_ids) for e in drafts)
    for event in drafts:
        (start, end), ngram = event.noted("copied")["source"], event.note["ngram"]
        assert [t.id for t in event.tokens] == sequence[start:end]  # the proposal is a copy of that span
        here = event.tokens[0].position  # the proposal continues text that ends with the matched n-gram
        assert sequence[here - ngram : here] == sequence[start - ngram : start]
    metrics = compute(trace)
    assert metrics.mean_accepted_tokens > 1.5  # copying a repeated sentence is what prompt lookup is for


def test_branches_verify_several_copies_and_keep_the_longest(target) -> None:
    """Two continuations of "the cat" in the prompt: with two branches one forward verifies both copies as a tree,
    and the tokens are those of plain decoding either way."""
    prompt = ("Repeat exactly: the cat sat on the mat. the cat ran to the door. the cat sat on the mat. "
              "the cat ran to the door.")
    generation = GenerationParams(max_new_tokens=32)
    runs = {}
    for branches in (1, 2):
        proposer = CopyProposer(target, PromptLookupParams(branches=branches))
        runs[branches] = generate(target, prompt, proposer, SamplingParams(), generation, costs=FREE)
    output, trace = runs[2]
    assert output.token_ids == runs[1][0].token_ids
    drafts = [e for e in trace.events if e.KIND == "draft"]
    assert any(any(t.parent not in (None, i) for i, t in enumerate(e.tokens)) for e in drafts)  # a tree of copies
    forwards = {b: sum(e.KIND == "verify" for e in run[1].events) for b, run in runs.items()}
    assert forwards[2] <= forwards[1]


def test_sampling_matches_the_target_distribution(target) -> None:
    """With one-hot proposals the first two tokens stay distributed as the target's (a third leaves the step that
    draws the second room to propose)."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=3, raw=True)
    prompt = "red green blue red green blue red green"
    assert_follows_target(target, None, prompt, sampling, generation)
    proposed = assert_follows_target(target, CopyProposer(target), prompt, sampling, generation)
    assert proposed > 150  # the second token was usually a verified proposal


def test_same_seed_same_output(target) -> None:
    def run(seed: int) -> tuple[int, ...]:
        return generate(target, "Say 'la la la' ten times.", CopyProposer(target),
                        SamplingParams(temperature=1.0, seed=seed), GenerationParams(max_new_tokens=16))[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize("field, value, message", [("max_ngram", 0, r"max_ngram must be an integer in \[1, 8\]"),
                                                   ("num_draft", 17, r"num_draft must be an integer in \[1, 16\]"),
                                                   ("branches", 0, r"branches must be an integer in \[1, 8\]")])
def test_parameter_ranges(field, value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        PromptLookupParams(**{field: value})


@pytest.mark.parametrize("params, expected", [
    (PromptLookupParams(), (5, 2)),  # two copies of 5
    (PromptLookupParams(branches=1), (8, 1)),  # one copy of 8
    (PromptLookupParams(num_draft=4), (4, 2)),  # a chosen K stays
    (PromptLookupParams(num_draft=16, branches=8), (16, 8)),
])
def test_copies_are_shorter_when_more_share_a_forward(params, expected) -> None:
    resolved = params.resolve()
    assert (resolved.num_draft, resolved.branches) == expected
    assert resolved.resolve() == resolved and resolved.max_ngram == params.max_ngram


def test_no_forward_is_wider_than_the_copies_allow(target) -> None:
    """The trace's parameters show the copies' K and B, and no forward is wider than they allow, even where a wider
    forward costs nothing."""
    prompt = "Repeat exactly: the cat sat on the mat. the cat ran to the dog. the cat sat on the mat. the cat"
    for params, expected in ((PromptLookupParams(branches=1), (8, 1)), (PromptLookupParams(), (5, 2))):
        _, trace = generate(target, prompt, CopyProposer(target, params), SamplingParams(),
                            GenerationParams(max_new_tokens=24), costs=FREE)
        assert (trace.params["num_draft"], trace.params["branches"]) == expected
        widest = max(e.num_tokens for e in trace.events if e.KIND == "verify")
        assert 1 < widest <= 1 + expected[0] * expected[1]
