"""A run's steps as a timeline in Chrome's Trace Event format (the JSON that Perfetto, chrome://tracing and
PyTorch's profiler exports use): one track per request, a span per phase of each step as its commit splits its
engine time (draft, verify, other; the first step's forward is the prompt's prefill) and a counter of the KV
cache's bytes after each step. Times are the engine's (seconds inside its steps, `Engine.now`), in microseconds;
requests generated one after another are laid end to end on one clock."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .events import CommitEvent, PrefillEvent
from .trace import Trace

PID = 1


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace(traces: Sequence[Trace]) -> dict[str, Any]:
    """The traces of one or more requests as one Trace Event JSON object; request i on track (tid) i + 1."""
    if not traces:
        raise ValueError("a timeline needs at least one trace")
    algos = sorted({t.algo for t in traces})
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": PID, "tid": 0,
                                     "args": {"name": f"decoding playground: {', '.join(algos)} on {traces[0].model}"}}]
    start = 0.0  # where this request's engine clock begins on the shared one
    for index, trace in enumerate(traces):
        tid = index + 1
        label = trace.prompt if len(trace.prompt) <= 48 else trace.prompt[:47] + "…"
        events.append({"ph": "M", "name": "thread_name", "pid": PID, "tid": tid,
                       "args": {"name": f"request {index} ({trace.algo}): {label}"}})
        end = start
        prefilled = {e.step: e.num_tokens for e in trace.events if isinstance(e, PrefillEvent)}
        for event in trace.events:
            if isinstance(event, CommitEvent):  # a prefill's step commits its first token: its forward is the prefill
                at = start + event.t - (event.draft_s + event.verify_s + event.overhead_s)
                forward = "prefill" if event.step in prefilled else "verify"
                args: dict[str, Any] = {"step": event.step, "tokens committed": event.num_tokens}
                if event.step in prefilled:
                    args["prompt tokens"] = prefilled[event.step]
                for phase, seconds in zip(("draft", forward, "other"), (event.draft_s, event.verify_s,
                                                                       event.overhead_s)):
                    if seconds > 0:
                        events.append({"ph": "X", "name": phase, "cat": "step", "pid": PID, "tid": tid,
                                       "ts": _us(at), "dur": _us(seconds), "args": args})
                    at += seconds
                events.append({"ph": "C", "name": f"KV cache bytes, request {index}", "pid": PID, "tid": tid,
                               "ts": _us(start + event.t), "args": {"bytes": event.kv_bytes}})
            end = max(end, start + event.t)
        start = end
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "decoding playground", "clock": "engine time (seconds inside its steps)"}}


def save_timeline(traces: Sequence[Trace], path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(traces)), encoding="utf-8")
