"""Trace schema v2: exact JSON round trip, malformed files refused with the offending field named, and version 1 files
read as version 2."""

from __future__ import annotations

import copy
import functools
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from playground.config import GenerationParams, SamplingParams
from playground.engine import generate
from playground.metrics import compute, drafted_count
from playground.trace import SCHEMA_VERSION, AcceptEvent, DraftEvent, FinishEvent, TokenInfo, Trace, TraceError
from playground.viz.steps import render_step_detail


@pytest.fixture(scope="module")
def real_trace(target) -> Trace:
    return generate(target, "Name a colour.", None, SamplingParams(temperature=0.8, top_p=0.9, seed=3),
                    GenerationParams(max_new_tokens=12))[1]


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
    ('{"schema_version": 1, "t": NaN}', "not valid JSON"),
])
def test_malformed_traces_are_rejected(text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        Trace.from_json(text)


def test_load_rejects_missing_and_binary_files(tmp_path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        Trace.load(tmp_path / "missing.json")
    binary = tmp_path / "pickle.pkl"
    binary.write_bytes(b"\x80\x04\x95\xff\xfe")
    with pytest.raises(TraceError, match="not valid JSON"):
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


def upload(tmp_path, text: str | bytes):
    path = tmp_path / "upload.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return path


@pytest.mark.parametrize("text, message", [
    # each of these once escaped the validator as an IndexError, RecursionError, ValueError or OverflowError
    (mutate("events.0.note", {"kind": "copied", "source": [4], "ngram": 1}),
     r"events\[0\]\.note\.source: \[start, end\) with 0 <= start <= end, got \[4\]"),
    ('{"schema_version": 1, "events": ' + "[" * 200_000 + "]" * 200_000 + "}", "not valid JSON"),
    (mutate("prompt_ids", [1, 0]).replace("[1, 0]", "[1, " + "9" * 5001 + "]"), "not valid JSON"),
    (mutate("events.0.wall_s", 10**400), r"events\[0\]\.wall_s: expected a finite number, got 1000"),
    (mutate("events.0.step", 2**70), r"events\[0\]\.step: expected an integer in \[-2\^63, 2\^63\]"),
    (mutate("events.2.wall_s", 1e400).replace("Infinity", "1e400"), r"events\[2\]\.wall_s: expected a finite"),
    (mutate("events.0.tokens.1.parent", 2), r"events\[0\]\.tokens\[1\]\.parent: must be a node in \[0, 1\]"),
    # the app's replay sized a list by the last step: a MemoryError, an OverflowError, an IndexError
    (mutate("events.1.step", 10**9),
     r"events\[1\]\.step: must be in \[0, \d+\] \(a trace of \d+ events\), got 1000000000"),
    (mutate("events.1.step", 2**63), r"events\[1\]\.step: must be in \[0, \d+\]"),
    (mutate("events.1.step", -2**63), r"events\[1\]\.step: must be in \[0, \d+\]"),
    # figures no run could leave: they once passed and drew impossible numbers
    (mutate("events.0.tokens.0.p", 5.0), r"events\[0\]\.tokens\[0\]\.p: a probability is in \[0, 1\], got 5.0"),
    (mutate("events.1.token.id", -3), r"events\[1\]\.token\.id: a token id is at least 0, got -3"),
    (mutate("events.2.t", 1e308), r"events\[2\]\.t: engine seconds are in \[0, 86400\], got 1e\+308"),
    (mutate("events.1.u", 1.5), r"events\[1\]\.u: a uniform draw is in \[0, 1\]"),
    (mutate("events.0.draft_forwards", -1), r"events\[0\]\.draft_forwards: a count is at least 0"),
])
def test_hostile_traces_are_refused_in_one_line(text: str, message: str, tmp_path) -> None:
    with pytest.raises(TraceError, match=message) as refused:
        Trace.load(upload(tmp_path, text))
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 300


def test_repeated_or_shuffled_events_are_refused(real_trace: Trace) -> None:
    """A valid trace's events repeated (which drew "tokens per target forward 0.27") or run backwards are not a run."""
    data = json.loads(real_trace.to_json())
    repeated = {**data, "events": data["events"] * 5}
    with pytest.raises(TraceError, match=r"events\[\d+\]\.step: steps run in order: step 0 after step \d+"):
        Trace.from_dict(repeated)
    doubled = {**data, "events": [data["events"][0], *data["events"]]}
    with pytest.raises(TraceError, match=r"events\[1\]\.kind: a second prefill event in step 0"):
        Trace.from_dict(doubled)
    last = data["events"][-1]
    with pytest.raises(TraceError, match="a second finish event"):
        Trace.from_dict({**data, "events": [*data["events"], last]})


@pytest.fixture(scope="module")
def real_traces(target) -> list[dict]:
    """Small real traces of every kind of step (chains with runners-up, trees with copies, lookahead windows)."""
    from playground.decoding.prompt_lookup import PromptLookupParams
    from playground.decoding.registry import build_proposer

    generation = GenerationParams(max_new_tokens=10)
    copies = PromptLookupParams(max_ngram=2)
    proposers = [build_proposer(target, "speculative", None, copies), build_proposer(target, "medusa", None, copies),
                 build_proposer(target, "lookahead")]
    return [json.loads(generate(target, "List the days of the week: Monday, Tuesday,", p, SamplingParams(),
                                generation)[1].to_json()) for p in proposers]


def paths_in(node, prefix=()):
    yield prefix
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield from paths_in(child, (*prefix, key))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=2),
                    max_leaves=6)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 300)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_traces_load_and_replay_or_are_refused_in_one_line(real_traces, data) -> None:
    """A trace that passes validation is one the app can replay (every view, every step); anything else is one
    TraceError line, never another exception."""
    import gradio as gr

    from playground.ui import decode

    trace = copy.deepcopy(data.draw(st.sampled_from(real_traces)))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(paths_in(trace))[1:]))
        parent = functools.reduce(lambda node, key: node[key], path[:-1], trace)
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(JSON | st.integers(-3, 40))
    text = json.dumps(trace, allow_nan=True)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.json"
        path.write_text(text)
        try:
            loaded = Trace.load(path)
        except TraceError as exc:
            assert "\n" not in str(exc)
            return
        try:
            outputs = decode.load_trace(str(path))
        except gr.Error as exc:  # valid, but not a whole run (no finish event): the app's one-line refusal
            assert "\n" not in exc.message
            return
    at = next(i for i, out in enumerate(outputs) if isinstance(out, dict) and "trace" in out)
    state, slider = outputs[at], outputs[at + 1]
    # every step the trace has, and the slider's end (a fuzzed step number may be huge: not range(maximum))
    for step in sorted({0, slider["maximum"], *(e.step for e in loaded.events)}):
        decode.replay_step(state, step)
    compute(loaded)


DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("algo, kind", [("lookahead", "jacobi"), ("prompt-lookup", "copied"), ("rest", "retrieved"),
                                        ("self-speculative", "layers")])
def test_a_version_1_trace_still_replays(algo: str, kind: str) -> None:
    """Traces written before notes (schema 1, each kept as the engine wrote it then): their algorithm's fields and
    lookahead's own events become notes of the draft events (a window without candidates, a draft of no tokens),
    every decision and metric as it was, and they are written again as version 2."""
    data = json.loads((DATA / f"trace-v1-{algo}.json").read_text())
    assert data["schema_version"] == 1
    trace = Trace.from_dict(data)
    drafts = [e for e in trace.events if isinstance(e, DraftEvent)]
    windows = sum(e["kind"] == "lookahead" for e in data["events"])
    assert len(drafts) == max(windows, sum(e["kind"] == "draft" for e in data["events"]))
    assert all(e.noted(kind) for e in drafts) and any(e.tokens for e in drafts)
    assert [e.KIND for e in trace.events if e.KIND != "draft"] == [
        e["kind"] for e in data["events"] if e["kind"] not in ("draft", "lookahead")]
    assert compute(trace).tokens == len(data["events"][-1]["token_ids"])
    shown = {"jacobi": "Jacobi window", "copied": "copied from positions", "retrieved": "retrieved after the last",
             "layers": "of the target's own layers"}[kind]
    assert shown in render_step_detail(trace.events, next(e.step for e in drafts if e.tokens))
    again = json.loads(trace.to_json())
    assert again["schema_version"] == SCHEMA_VERSION == 2 and Trace.from_dict(again) == trace
    if algo == "lookahead":
        assert any(not e.tokens for e in drafts)  # a step whose window found no candidate


def test_a_notes_lists_are_bounded_whatever_its_kind() -> None:
    """A note's lists hold at most 1,024 items, a registered kind's as any other's (lookahead's window and hits were
    bounded so before their fields became a note)."""
    for kind in ("jacobi", "a plug-in's"):
        note = {"kind": kind, "window": [[1]], "pool_size": 3, "candidates": [[5]] * 1025}
        with pytest.raises(TraceError, match=r"events\[0\]\.note\.candidates\.items: must be in \[0, 1024\], got 1025"):
            Trace.from_json(mutate("events.0.note", note))
