"""REST: the suffix-array datastore, the trie of retrieved continuations, a datastore from a user's file end to end,
greedy exactness on the exactness prompts on either cache, and the trace and step detail of a retrieval."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from playground.config import ConfigError, GenerationParams
from playground.decoding import rest
from playground.decoding.registry import build_proposer
from playground.decoding.rest import SEPARATOR, Datastore, RestParams, suffix_array, trie
from playground.engine import generate
from playground.metrics import compute
from playground.paths import CACHE_ENV
from playground.trace import DraftEvent, Trace
from playground.train.__main__ import main as train_main
from playground.viz.steps import render_step_detail

from .prompts import assert_greedy_exact


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-1, 4), max_size=60))
def test_the_suffix_array_sorts_every_place_by_the_text_after_it(tokens) -> None:
    array = np.asarray(tokens, dtype=np.int32)
    assert suffix_array(array).tolist() == sorted(range(len(tokens)), key=lambda i: tokens[i:])


def test_the_longest_match_and_its_continuations_make_a_trie_by_frequency() -> None:
    store = Datastore.build([[1, 2, 3, 4, 6], [1, 2, 3, 5], [1, 2, 3, 4, 7], [9, 1, 2]], {})
    assert store.longest_match([8, 1, 2, 3], 8) == (3, *store.range([1, 2, 3]))
    assert store.longest_match([8, 1, 2], 8)[0] == 2 and store.longest_match([8, 8], 8) == (0, 0, 0)
    lo, hi = store.range([1, 2, 3])
    assert hi - lo == 3
    found = store.continuations(lo, hi, 3, 3)  # (3 places, 3 deep), in the suffix array's order
    assert found.tolist() == [[4, 6, SEPARATOR], [4, 7, SEPARATOR], [5, SEPARATOR, SEPARATOR]]
    tokens, parents, counts = trie(found, 8, frozenset())
    assert (tokens, parents, counts) == ([4, 5, 6, 7], [0, 0, 1, 1], [2, 1, 1, 1])
    assert trie(found, 2, frozenset()) == ([4, 5], [0, 0], [2, 1])
    assert trie(found, 8, frozenset({4})) == ([4, 5], [0, 0], [2, 1])  # nothing follows an end of sequence


def test_bad_settings_and_corpora_are_refused(target, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=re.escape("max_suffix must be an integer in [1, 16], got 0")):
        RestParams(max_suffix=0)
    with pytest.raises(ConfigError, match=re.escape("nodes must be an integer in [1, 64], got 65")):
        RestParams(nodes=65)
    with pytest.raises(ConfigError, match="corpus: no such file"):
        build_proposer(target, "rest", RestParams(corpus=str(tmp_path / "missing.txt")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(ConfigError, match="bad.jsonl line 2 must be an object"):
        build_proposer(target, "rest", RestParams(corpus=str(bad)))


def test_a_datastore_from_a_users_file_drafts_its_phrases(target, tmp_path, monkeypatch, capsys) -> None:
    """A JSONL file of the user's docs: built with progress by `python -m playground.train datastore`, cached (the
    proposer's first use reads it, builds nothing), and its phrases drafted, kept and shown, output exact."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    sentence = "The warehouse robot lifts the blue crate onto the third shelf every morning at seven."
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Note {i}: {sentence}"}) + "\n" for i in range(5)))
    assert train_main(["datastore", "--corpus", str(docs)]) == 0
    logged = capsys.readouterr().err
    assert "tokenising" in logged and "sorted by the first" in logged and "ready:" in logged
    assert len(list((tmp_path / "cache" / "datastores").iterdir())) == 1

    def never(*args, **kwargs):
        raise AssertionError("the cached datastore was built again")
    monkeypatch.setattr(rest, "suffix_array", never)
    proposer = build_proposer(target, "rest", RestParams(corpus=str(docs)))
    assert proposer.describe()["corpus"] == str(docs) and proposer.describe()["tokens"] > 5 * 15
    prompt = f"Repeat this sentence exactly: {sentence}"
    generation = GenerationParams(max_new_tokens=24)
    plain, _ = generate(target, prompt, None, None, generation)
    output, trace = generate(target, prompt, proposer, None, generation, algo="rest")
    assert output.token_ids == plain.token_ids
    drafts = [e for e in Trace.from_json(trace.to_json()).events if isinstance(e, DraftEvent) and e.tokens]
    assert drafts and all(e.noted("retrieved")["suffix"] and e.note["hits"] for e in drafts)
    assert compute(trace).accepted >= 8  # the sentence is in the datastore: most of it is drafted and kept
    html = render_step_detail(trace.events, drafts[-1].step)
    hits = drafts[-1].note["hits"]
    assert "retrieved after the last" in html and f"({hits} hit" in html and "in the datastore" in html


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_retrieval_keeps_every_exactness_prompt_greedy_exact(target, plain_outputs, kv) -> None:
    """The default datastore (the target's answers to the training prompts): plain decoding's tokens on each of the
    exactness prompts, with retrieved tokens accepted along the way."""
    proposer = build_proposer(target, "rest")
    accepted, drafted = assert_greedy_exact(target, proposer, plain_outputs,
                                            GenerationParams(max_new_tokens=24, kv=kv))
    assert 0 < accepted < drafted
