"""Lookahead decoding: the n-gram pools, the window's mask and positions, greedy exactness, sampling."""

from __future__ import annotations

import pytest

from playground.config import ConfigError, GenerationParams, SamplingParams
from playground.decoding.costs import ForwardCosts
from playground.decoding.lookahead import LookaheadParams, LookaheadProposer, jacobi_tree
from playground.decoding.pools import NGramPool, TextPools, frequent_ngrams
from playground.decoding.proposer import Proposal, merge_chains
from playground.decoding.tree import ancestor_mask
from playground.engine import generate
from playground.models import ModelLoadError
from playground.models.answers import EMBEDDED_ANSWERS, save_answers

from .prompts import assert_greedy_exact
from .stats import assert_follows_target

FREE = ForwardCosts((1, 2), (1.0, 1.0))  # a wider forward costs what a one-token one does


def test_pool_keys_lru_and_bound() -> None:
    pool = NGramPool(guesses=2)
    pool.add((1, 2, 3))
    pool.add((1, 4, 5))
    pool.add((7, 8, 9))
    assert pool.candidates([1]) == [(4, 5), (2, 3)]  # most recent first
    assert pool.candidates([7]) == [(8, 9)] and pool.candidates([2]) == []
    pool.add((1, 2, 3))  # seen again: refreshed, not duplicated
    assert pool.candidates([1]) == [(2, 3), (4, 5)]
    pool.add((1, 6, 6))  # a third continuation of 1 evicts the least recently used, (4, 5)
    assert pool.candidates([1]) == [(6, 6), (2, 3)]
    assert len(pool) == 3


def test_pool_keeps_the_longer_of_two_continuations_where_one_starts_the_other() -> None:
    pool = NGramPool(guesses=2)
    pool.add((1, 2, 3, 4, 5))  # a text n-gram (M = 5)
    pool.add((1, 6, 7))
    pool.add((1, 2, 3))  # a window n-gram the text one already guesses: refreshes it, takes no slot
    assert pool.candidates([1]) == [(2, 3, 4, 5), (6, 7)]
    pool.add((1, 6, 7, 8, 9))  # guesses more than (6, 7): replaces it
    assert pool.candidates([1]) == [(6, 7, 8, 9), (2, 3, 4, 5)] and len(pool) == 2
    pool.add((1, 2, 3, 9))  # shares a prefix only: a new guess, evicting the least recently used
    assert pool.candidates([1]) == [(2, 3, 9), (6, 7, 8, 9)]


def test_pool_takes_every_ngram_a_text_gained() -> None:
    whole = NGramPool(guesses=4)
    whole.add_text([1, 2, 3, 1, 2, 4], 3)  # (1, 2, 3), (2, 3, 1), (3, 1, 2), (1, 2, 4)
    assert whole.candidates([1]) == [(2, 4), (2, 3)] and whole.candidates([2]) == [(3, 1)]
    assert whole.candidates([3]) == [(1, 2)] and len(whole) == 4
    grown = NGramPool(guesses=4)
    grown.add_text([1, 2, 3], 3)
    grown.add_text([1, 2, 3, 1, 2, 4], 3, start=3)  # only the n-grams ending in the three new tokens
    assert {t: grown.candidates([t]) for t in (1, 2, 3)} == {t: whole.candidates([t]) for t in (1, 2, 3)}
    short = NGramPool(guesses=4)
    short.add_text([5, 6], 3)
    assert len(short) == 0


def test_frequent_ngrams_keep_the_most_common_per_first_token_least_frequent_first() -> None:
    answers = [[1, 2, 3, 1, 2, 3, 1, 2, 4], [1, 2, 4, 1, 2, 4, 5, 6, 7]]
    # 3-grams: (1,2,4) x3; (1,2,3), (2,3,1), (3,1,2) x2 each, in order of first appearance; the rest once
    assert frequent_ngrams(answers, 3, per_key=1) == [(3, 1, 2), (2, 3, 1), (1, 2, 4)]
    assert frequent_ngrams(answers, 3, per_key=2) == [(3, 1, 2), (2, 3, 1), (1, 2, 3), (1, 2, 4)]
    pool = NGramPool(guesses=2)
    for ngram in frequent_ngrams(answers, 3, per_key=2):
        pool.add(ngram)
    assert pool.candidates([1]) == [(2, 4), (2, 3)]  # the most frequent is the most recently used


def test_frequent_ngrams_by_a_longer_key() -> None:
    answers = [[1, 2, 3, 1, 2, 3, 1, 2, 4], [1, 2, 4, 1, 2, 4, 5, 6, 7]]
    # key (1, 2): (1,2,4) x3 beats (1,2,3) x2; key (2, 3) and (3, 1): one n-gram each, seen twice
    assert frequent_ngrams(answers, 3, per_key=1, key=2) == [(3, 1, 2), (2, 3, 1), (1, 2, 4)]
    pool = NGramPool(guesses=2, key=2)
    pool.add_text([9, 1, 2, 3, 1, 2, 4], 3)
    assert pool.candidates([7, 1, 2]) == [(4,), (3,)]  # the continuations of the last two tokens
    assert pool.candidates([2]) == [] and pool.candidates([5, 2]) == [] and len(pool) == 5


def test_text_pools_back_off_from_the_longest_key() -> None:
    """Text 1 2 3 5 2 4 9 (M 3): after "1 2" came "3 5", after "5 2" came "4 9"; after "2" alone, both."""
    text = [1, 2, 3, 5, 2, 4, 9]
    one = TextPools(guesses=1, text_ngram=3, context=2)
    one.add_text(text)
    assert one.candidates([1, 2]) == ([(3, 5)], [2])  # the key-1 pool would guess its latest, (4, 9)
    assert one.candidates([5, 2]) == ([(4, 9)], [2])
    assert one.candidates([7, 2]) == ([(4, 9)], [1])  # no "7 2" seen: backs off to the last token
    assert one.candidates([8]) == ([], [])
    two = TextPools(guesses=2, text_ngram=3, context=2)
    two.add_text(text)
    assert two.candidates([1, 2]) == ([(3, 5), (4, 9)], [2, 1])  # (3, 5) from the key-1 pool is not repeated
    paper = TextPools(guesses=1, text_ngram=3, context=1)
    paper.add_text(text)
    assert paper.candidates([1, 2]) == ([(4, 9)], [1]) and len(paper) == 4 and len(one) == 4 + 4


def test_a_pool_started_from_a_base_copies_a_key_only_when_it_changes() -> None:
    base = NGramPool(guesses=2)
    base.add_text([1, 2, 3, 1, 4, 5], 3)  # key 1: (4, 5), (2, 3); keys 2, 3: one each
    run = NGramPool(guesses=2, base=base)
    assert run.candidates([1]) == [(4, 5), (2, 3)] and len(run) == 4
    run.add((1, 6, 7))  # evicts (2, 3) in this run's copy only
    run.add((8, 9, 9))
    assert run.candidates([1]) == [(6, 7), (4, 5)] and run.candidates([2]) == [(3, 1)] and len(run) == 5
    assert base.candidates([1]) == [(4, 5), (2, 3)] and base.candidates([8]) == [] and len(base) == 4
    with pytest.raises(ValueError, match="same guesses and key"):
        NGramPool(guesses=3, base=base)
    seeded = TextPools.seeded(guesses=1, text_ngram=3, context=2, answers=[[1, 2, 3, 5]] * 2)
    pools = TextPools(guesses=1, text_ngram=3, context=2, base=seeded)
    assert pools.candidates([1, 2]) == ([(3, 5)], [2]) and len(pools) == len(seeded) == 2 + 1


def test_text_pools_let_a_longer_guess_replace_one_it_starts() -> None:
    pools = TextPools(guesses=2, text_ngram=2, context=2)  # text continuations of one token
    pools.add_window((2, 3, 5))  # the window's 3-grams go to the key-1 pool only
    pools.add_text([1, 2, 3])
    assert pools.pools[1].candidates([1, 2]) == [(3,)] and pools.pools[0].candidates([2]) == [(3, 5)]
    assert pools.candidates([1, 2]) == ([(3, 5)], [1])  # guesses all that (3,) does, and more


def test_jacobi_block_and_candidate_tree_on_small_cases() -> None:
    """The engine's pieces of a lookahead row, checked by hand: the window of N = 3, W = 2 row by row, and three
    candidates of which two start alike."""
    tokens, parents = jacobi_tree([[10, 11], [20, 21]], 1)  # the window right after the last token, row 1 on
    window = Proposal(tokens, parents, ["lookahead"] * 4, [0.0] * 4, [None] * 4, probes=4)
    assert tokens == [10, 11, 20, 21] and window.depths()[1:] == [1, 2, 2, 3]  # positions after the last token
    mask = ancestor_mask([-1, *parents])
    sees = {i: [j for j in range(4) if mask[i + 1, j + 1]] for i in range(4)}
    # row 0 up to the column, then the column's rows below row 0 (x, the last token, is seen by all)
    assert sees == {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3]} and mask[1:, 0].all()
    # after two candidates, the window's rows start at row 3; cut to one candidate, they move up a row
    behind = Proposal([5, 6, *tokens], [0, 1, *jacobi_tree([[10, 11], [20, 21]], 3)[1]], ["lookahead"] * 6,
                      [0.5, 0.25, 0.0, 0.0, 0.0, 0.0], [None] * 6, probes=4)
    assert behind.parents[2:] == [0, 3, 3, 4] and behind.expected() == [1.0, 1.5, 1.75]
    cut = behind.first(1)
    assert cut.tokens == [5, *tokens] and cut.parents == [0, 0, 2, 2, 3] and cut.probes == 4
    assert cut.verified().tokens == [5] and behind.verified().parents == [0, 1]
    tokens, parents, source = merge_chains([(5, 6, 7), (5, 8), (9,)])
    # rows: 1 = 5, 2 = 6, 3 = 7 (candidate 0); 4 = 8 under 5 (candidate 1 shares 5); 5 = 9 under the last token
    assert tokens == [5, 6, 7, 8, 9] and parents == [0, 1, 2, 1, 0] and source == [0, 0, 0, 1, 2]
    assert merge_chains([]) == ([], [], [])


# the first two: the automatic N, G and M where 7 tokens cost one pass of the CPU kernel, and where they do not
# (AVX2); the third what N 3 gets with AVX2
SETTINGS = [LookaheadParams(ngram=3, guesses=2),
            LookaheadParams(ngram=2, guesses=2, text_ngram=3),
            LookaheadParams(ngram=3, guesses=1, text_ngram=4),
            LookaheadParams(window=2, ngram=2, guesses=1, prompt_pool=False, output_pool=False),
            LookaheadParams(window=6, ngram=5, guesses=6),
            LookaheadParams(text_ngram=6),
            LookaheadParams(context=1),
            LookaheadParams(window=2, ngram=4, context=5, corpus_pool=False)]


@pytest.mark.parametrize("params", SETTINGS,
                         ids=lambda p: f"W{p.window}-N{p.ngram}-G{p.guesses}-M{p.text_n}-K{p.context}")
def test_greedy_equals_plain_decoding(target, plain_outputs, params) -> None:
    accepted, drafted = assert_greedy_exact(target, LookaheadProposer(target, params), plain_outputs)
    assert 0 < accepted < drafted  # the pool produced guesses, some right and some wrong


def test_trace_shows_window_pool_and_the_verified_candidate(target) -> None:
    params = LookaheadParams(window=3, ngram=3, guesses=2)
    output, trace = generate(target, "Count from one to twenty, separated by commas.",
                             LookaheadProposer(target, params), SamplingParams(), GenerationParams(max_new_tokens=30))
    drafts = [e for e in trace.events if e.KIND == "draft"]
    steps = [e.noted("jacobi") for e in drafts]
    assert steps and all(len(e["window"]) == 2 and all(len(r) == 3 for r in e["window"]) for e in steps)
    assert all(len(e["candidates"]) <= 2 for e in steps) and steps[-1]["pool_size"] > steps[0]["pool_size"]
    assert all(len(e["keys"]) == len(e["candidates"]) and all(1 <= k <= params.context for k in e["keys"])
               for e in steps)
    assert any(k > 1 for e in steps for k in e["keys"])  # the counting repeats its own longer phrases
    for event, hit in zip(drafts, steps):  # the verified tree is made of the step's hits
        assert {t.id for t in event.tokens} <= {token for c in hit["candidates"] for token in c}
    assert sum(e.num_tokens for e in trace.events if e.KIND == "commit") == len(output.token_ids)


def test_output_pool_supplies_the_answers_own_phrases(target) -> None:
    """Without the prompt's n-grams, the answer's own n-grams raise the guesses accepted on a repeating text."""
    generation = GenerationParams(max_new_tokens=40, raw=True)
    prompt = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday,"
    accepted = {}
    for output_pool in (False, True):
        params = LookaheadParams(window=1, ngram=4, guesses=2, prompt_pool=False, output_pool=output_pool)
        output, trace = generate(target, prompt, LookaheadProposer(target, params), SamplingParams(), generation)
        assert output.text.startswith(" Tuesday, Wednesday, Thursday")
        accepted[output_pool] = sum(1 for e in trace.events if e.KIND == "accept")
    assert accepted[True] >= accepted[False] + 5  # measured 25 against 18


def test_text_ngrams_longer_than_the_windows_verify_longer_copies(target) -> None:
    generation = GenerationParams(max_new_tokens=40, raw=True)
    prompt = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday,"
    longest = {}
    for text_ngram in (None, 6):
        params = LookaheadParams(window=1, ngram=3, guesses=2, text_ngram=text_ngram)
        output, trace = generate(target, prompt, LookaheadProposer(target, params), SamplingParams(), generation)
        assert output.text.startswith(" Tuesday, Wednesday, Thursday") and trace.params["text_ngram"] == params.text_n
        # each step's deepest guess: the verified tree's depth
        runs = [1 + max(t.position for t in e.tokens) - min(t.position for t in e.tokens)
                for e in trace.events if e.KIND == "draft"]
        assert all(n <= params.text_n - 1 for n in runs)
        longest[text_ngram] = max(runs)
    assert longest[None] == 2 and longest[6] == 5  # copies of the day names, M - 1 tokens at a time


def test_corpus_pool_seeds_the_pool_with_the_targets_habitual_phrases(target, tmp_path) -> None:
    phrase = target.tokenizer(" Here are three ideas for a calm afternoon").input_ids
    corpus = tmp_path / "answers.safetensors"
    save_answers(corpus, [phrase, phrase, [5, 6]], target.model.config.vocab_size, "test")
    generation = GenerationParams(max_new_tokens=12)
    # M = N = 3 by default
    only_corpus = LookaheadParams(guesses=2, prompt_pool=False, output_pool=False, corpus=str(corpus))
    proposer = LookaheadProposer(target, only_corpus)
    # per key length k = 1, 2, 3: every (k + 2)-gram of the phrase, seen twice
    assert proposer.describe()["corpus"] == corpus.name  # a trace names no local folder
    assert [len(seeds) for seeds in proposer.seeds.pools] == [len(phrase) - 2, len(phrase) - 3, len(phrase) - 4]
    prompt = "Suggest a short plan for a relaxing Sunday afternoon at home."
    output, trace = generate(target, prompt, proposer, SamplingParams(), generation, costs=FREE)  # a window runs
    assert next(e for e in trace.events if e.KIND == "draft").noted("jacobi")["pool_size"] == 3 * len(phrase) - 9
    assert output.token_ids == generate(target, prompt, None, SamplingParams(), generation)[0].token_ids
    # by default the embedded target's shipped answers seed the pool; switched off, nothing does
    assert LookaheadProposer(target).corpus == str(EMBEDDED_ANSWERS)
    off = LookaheadProposer(target, LookaheadParams(corpus_pool=False))
    assert off.corpus is None and len(off.seeds) == 0 and off.describe()["corpus"] is None


def test_a_bad_corpus_names_the_field(target, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="corpus: .* is not a file"):
        LookaheadProposer(target, LookaheadParams(corpus=str(tmp_path / "none")))
    wrong_vocab = tmp_path / "other.safetensors"
    save_answers(wrong_vocab, [[1, 2, 3]], 1000, "another model")
    with pytest.raises(ModelLoadError, match="written for a vocabulary of 1000 tokens, the target has 49152"):
        LookaheadProposer(target, LookaheadParams(corpus=str(wrong_vocab)))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="is not an answers file"):
        LookaheadProposer(target, LookaheadParams(corpus=str(garbage)))
    with pytest.raises(ConfigError, match="corpus must be a file path or None"):
        LookaheadParams(corpus=" ")


def test_sampling_matches_the_target_distribution(target) -> None:
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=3, raw=True)  # the step that draws the second token may propose
    prompt = "one two one two one two one"
    assert_follows_target(target, None, prompt, sampling, generation)
    proposed = assert_follows_target(target, LookaheadProposer(target, LookaheadParams(ngram=2)), prompt, sampling,
                                     generation)
    assert proposed > 150  # the second token was usually a verified guess from the prompt's pool


@pytest.mark.parametrize("field, value, message", [("window", 0, r"window must be an integer in \[1, 16\]"),
                                                   ("ngram", 1, r"ngram must be an integer in \[2, 8\]"),
                                                   ("guesses", 17, r"guesses must be an integer in \[1, 16\]"),
                                                   ("text_ngram", 1, r"text_ngram must be an integer in \[2, 16\]"),
                                                   ("context", 9, r"context must be an integer in \[1, 8\]")])
def test_parameter_ranges(field, value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        LookaheadParams(**{field: value})


def test_no_forward_is_wider_than_the_window_and_guesses(target) -> None:
    """The trace's parameters show N, G and M, and no forward runs more than the last token, the window's N - 1
    rows and G guesses of M - 1 tokens, even where a wider forward costs nothing."""
    generation = GenerationParams(max_new_tokens=8)
    for params in (LookaheadParams(), LookaheadParams(ngram=2, guesses=3, text_ngram=4)):
        _, trace = generate(target, "Count to five.", LookaheadProposer(target, params), SamplingParams(), generation,
                            costs=FREE)
        assert (trace.params["ngram"], trace.params["guesses"], trace.params["text_ngram"]) == (
            params.ngram, params.guesses, params.text_n)
        widest = max(e.num_tokens for e in trace.events if e.KIND == "verify")
        assert widest <= 1 + (params.ngram - 1) + params.guesses * (params.text_n - 1)
        assert all(len(e.note["window"]) == params.ngram - 1 for e in trace.events if e.KIND == "draft")
