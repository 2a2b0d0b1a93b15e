"""Trace schema v1: exact JSON round trip, and malformed files refused with the offending field named."""

from __future__ import annotations

import json

import pytest

from playground.config import GenerationParams, SamplingParams
from playground.decoding import AutoregressiveDecoder, generate
from playground.metrics import compute, drafted_count
from playground.trace import (SCHEMA_VERSION, AcceptEvent, DraftEvent, FinishEvent, TokenInfo, Trace,
                              TraceError, TreeEvent)


@pytest.fixture(scope="module")
def real_trace(target) -> Trace:
    decoder = AutoregressiveDecoder(target, SamplingParams(temperature=0.8, top_p=0.9, seed=3),
                                    GenerationParams(max_new_tokens=12))
    return generate(decoder, "Name a colour.")[1]


def synthetic_trace() -> Trace:
    tokens = [TokenInfo(7, "a", 3, p=0.25, q=0.5), TokenInfo(8, " b\u00e9", 4, p=1e-300, q=None, parent=0)]
    return Trace(algo="speculative", model="m", prompt="p \u2603", prompt_ids=[1, 2, 3],
                 params={"gamma": 2, "temperature": 0.7, "adaptive": True, "seed": None},
                 events=[DraftEvent(step=1, t=0.1, tokens=tokens, wall_s=0.01, draft_forwards=2),
                         AcceptEvent(step=1, t=0.2, token=tokens[0], u=0.123456789012345678),
                         FinishEvent(step=1, t=0.3, reason="length", token_ids=[7], text="a", wall_s=0.3)])


@pytest.mark.parametrize("make", ["synthetic", "real"])
def test_json_round_trip_is_exact(make: str, real_trace: Trace, tmp_path) -> None:
    trace = synthetic_trace() if make == "synthetic" else real_trace
    text = trace.to_json()
    loaded = Trace.from_json(text)
    assert loaded == trace
    assert loaded.to_json() == text
    trace.save(tmp_path / "t.json")
    assert Trace.load(tmp_path / "t.json") == trace


def test_real_trace_has_every_step(real_trace: Trace) -> None:
    kinds = [e.KIND for e in real_trace.events]
    assert kinds[0] == "prefill" and kinds[-1] == "finish"
    assert kinds.count("bonus") == len(real_trace.finish().token_ids)
    metrics = compute(real_trace)
    assert metrics.target_forwards == kinds.count("prefill") + kinds.count("verify")
    assert metrics.kv_bytes > 0 and metrics.ttft_s <= metrics.wall_s


def mutate(path: str, value) -> str:
    data = json.loads(synthetic_trace().to_json())
    node = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if key.isdigit() else node[key]
    last = keys[-1]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return json.dumps(data)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (mutate("schema_version", SCHEMA_VERSION + 1), "schema_version"),
    (mutate("events.0.kind", "explode"), r"events\[0\]\.kind"),
    (mutate("events.0.tokens.0.id", "7"), r"events\[0\]\.tokens\[0\]\.id"),
    (mutate("events.1.u", True), r"events\[1\]\.u"),
    (mutate("events.2.wall_s", KeyError), r"events\[2\]: missing field\(s\) wall_s"),
    (mutate("events.2.extra", 1), r"events\[2\]: unknown field\(s\) extra"),
    (mutate("prompt_ids", [1, "x"]), r"prompt_ids\[1\]"),
    (mutate("params.gamma", [1]), "params.gamma"),
    ('{"schema_version": 1, "t": NaN}', "NaN is not allowed"),
])
def test_malformed_traces_are_rejected(text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        Trace.from_json(text)


def tree_trace(**change) -> str:
    """A trace with one Medusa tree event: two head nodes and a copied node below node 1, with `change` applied."""
    tree = dict(step=1, t=0.1, paths=[[0], [1]], tokens=[5, 6, 7], probs=[0.5, 0.2, 1.0],
                target_probs=[0.4, 0.1, 0.9], accepted=[1, 3], copy_parent=1, copy_source=[0, 1], copy_ngram=2)
    trace = Trace(algo="medusa", model="m", prompt="p", prompt_ids=[7, 2], params={},
                  events=[TreeEvent(**{**tree, **change})])
    return trace.to_json()


@pytest.mark.parametrize("change, message", [
    ({"probs": [0.5, 0.2]}, "one entry per node"),
    ({"tokens": [5], "probs": [0.5], "target_probs": [0.4], "accepted": [], "copy_parent": None},
     "1 tokens for 2 paths"),
    ({"accepted": [4]}, r"events\[0\]\.accepted: nodes must be in \[1, 3\]"),
    ({"copy_parent": None}, r"events\[0\]\.copy_parent: the node in \[0, 2\] the 1 copied nodes hang below"),
    ({"copy_parent": 3}, r"copy_parent: the node in \[0, 2\].*got 3"),
    ({"copy_source": [0, 2]}, r"events\[0\]\.copy_source: \[start, end\) with end - start = 1 copied nodes"),
    ({"copy_source": None}, r"copy_source: .*got None"),
    ({"copy_ngram": 0}, r"events\[0\]\.copy_ngram: the matched n-gram length"),
    ({"tokens": [5, 6], "probs": [0.5, 0.2], "target_probs": [0.4, 0.1], "accepted": [1]},
     "set only when tokens has more entries than paths"),
])
def test_inconsistent_tree_events_are_rejected(change, message) -> None:
    assert Trace.from_json(tree_trace()).events[0].copy_parent == 1
    with pytest.raises(TraceError, match=message):
        Trace.from_json(tree_trace(**change))


def test_load_rejects_missing_and_binary_files(tmp_path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        Trace.load(tmp_path / "missing.json")
    binary = tmp_path / "pickle.pkl"
    binary.write_bytes(b"\x80\x04\x95\xff\xfe")
    with pytest.raises(TraceError, match="not UTF-8"):
        Trace.load(binary)


def test_siblings_are_told_apart_by_parent_alone() -> None:
    """One rule (`DraftEvent.is_sibling`) serves the metrics, the coloured text and the step detail."""
    def draft(*tokens: TokenInfo) -> DraftEvent:
        return DraftEvent(step=1, t=0.0, tokens=list(tokens), wall_s=0.0, draft_forwards=0)

    # a speculative step's chain of two with the draft's runner-up beside its first token
    speculative = draft(TokenInfo(5, "a", 4, parent=0), TokenInfo(6, "b", 5, parent=1), TokenInfo(7, "c", 4, parent=0))
    assert [speculative.is_sibling(i) for i in range(3)] == [False, False, True]
    assert drafted_count(speculative) == 2
    # a chain written without parents (prompt lookup, lookahead)
    assert drafted_count(draft(TokenInfo(5, "a", 4), TokenInfo(6, "b", 5))) == 2
    # a lossless Medusa step judges two one-hot proposals at one depth in turn: two proposals, each judged
    assert drafted_count(draft(TokenInfo(5, "a", 4), TokenInfo(7, "c", 4), TokenInfo(8, "d", 5))) == 3
