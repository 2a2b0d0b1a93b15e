"""Timelines in Chrome's Trace Event format (what Perfetto and chrome://tracing open): the documented fields of
each event kind, one track per request, spans that add up to each step's commit, and the command line's and the
app's files."""

from __future__ import annotations

import json
from numbers import Number

import pytest

from playground.__main__ import main
from playground.config import GenerationParams
from playground.decoding.registry import build_proposer
from playground.engine import generate
from playground.timeline import chrome_trace
from playground.trace import CommitEvent, PrefillEvent
from playground.ui.decode import _save

from .prompts import PROMPTS


def check_format(data: dict) -> list[dict]:
    """The Trace Event format's fields, as its specification documents them for the kinds used here: complete
    events (ph X: name, ts, dur in microseconds, pid, tid), counters (ph C: name, ts, pid, args of numbers) and
    metadata (ph M: process_name or thread_name, args.name). Returns the events."""
    assert set(data) >= {"traceEvents"} and data.get("displayTimeUnit") in ("ms", "ns")
    events = data["traceEvents"]
    assert isinstance(events, list) and events
    for event in events:
        assert event["ph"] in ("X", "C", "M") and isinstance(event["name"], str)
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert isinstance(event["ts"], Number) and event["ts"] >= 0 and event["dur"] >= 0
        elif event["ph"] == "C":
            assert event["ts"] >= 0 and event["args"] and all(isinstance(v, Number) for v in event["args"].values())
        else:
            assert event["name"] in ("process_name", "thread_name") and isinstance(event["args"]["name"], str)
    return events


def test_a_timeline_has_a_track_per_request_and_spans_that_add_up(target) -> None:
    proposer = build_proposer(target, "prompt-lookup")
    traces = [generate(target, prompt, proposer, generation=GenerationParams(max_new_tokens=12),
                       algo="prompt-lookup")[1] for prompt in PROMPTS[:2]]
    events = check_format(json.loads(json.dumps(chrome_trace(traces))))
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names) == [1, 2] and all(f"request {i - 1} (prompt-lookup)" in names[i] for i in names)
    for tid, trace in zip((1, 2), traces):
        spans = sorted((e for e in events if e["ph"] == "X" and e["tid"] == tid), key=lambda e: e["ts"])
        for before, after in zip(spans, spans[1:]):  # one request's phases never overlap
            assert before["ts"] + before["dur"] <= after["ts"] + 1e-3
        commits = [e for e in trace.events if isinstance(e, CommitEvent)]
        steps = sum(e["dur"] for e in spans if e["cat"] == "step")
        assert steps == pytest.approx(1e6 * sum(c.draft_s + c.verify_s + c.overhead_s for c in commits), rel=1e-6)
        prefill = next(e for e in trace.events if isinstance(e, PrefillEvent))
        [forward] = [e for e in spans if e["name"] == "prefill"]
        assert forward["dur"] == pytest.approx(1e6 * prefill.wall_s) and forward["args"]["prompt tokens"] > 0
        assert {e["name"] for e in spans} >= {"prefill", "draft", "verify"}
        counters = [e["args"]["bytes"] for e in events if e["ph"] == "C" and e["tid"] == tid]
        assert counters == [c.kv_bytes for c in commits]
    first_end = max(e["ts"] + e["dur"] for e in events if e["ph"] == "X" and e["tid"] == 1)
    assert min(e["ts"] for e in events if e["ph"] == "X" and e["tid"] == 2) >= first_end - 1e-3  # end to end


def test_the_command_line_and_the_app_write_timelines(target, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "timeline.json"
    assert main(["generate", "--prompts-file", str(prompts), "--max-new-tokens", "6", "--algo", "prompt-lookup",
                 "--timeline-out", str(out)]) == 0
    events = check_format(json.loads(out.read_text()))
    assert {e["tid"] for e in events if e["name"] == "thread_name"} == {1, 2}
    trace, timeline = _save(generate(target, PROMPTS[0], None, generation=GenerationParams(max_new_tokens=4))[1])
    assert trace.endswith("trace-ar.json") and timeline.endswith("timeline-ar.json")
    check_format(json.loads(open(timeline).read()))
    assert main(["generate", "--prompt", "hi", "--timeline-out", str(tmp_path / "missing" / "t.json")]) == 2
