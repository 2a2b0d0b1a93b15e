"""A trace: everything one generation left behind (its events, in `playground.events`), with an exact JSON round
trip. A loaded trace is validated field by field (`playground.trace_check`), never unpickled, so the UI can replay
an exported file with no model loaded and a malformed file is refused with the path of the bad field. Times are
engine seconds since generation start, excluding time the consumer spent between events.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pydantic_core import from_json

from .events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    AcceptEvent,
    BonusEvent,
    CommitEvent,
    CorrectEvent,
    DraftEvent,
    Event,
    FinishEvent,
    JSONScalar,
    KVAllocEvent,
    KVFreeEvent,
    MemoryEvent,
    PreemptEvent,
    PrefillEvent,
    RejectEvent,
    TokenInfo,
    TraceError,
    VerifyEvent,
)
from .trace_check import trace_fields

MAX_TRACE_BYTES = 8 * 1024 * 1024  # 4x the longest run's (4,096 tokens of lookahead), drawn in about a second
PLAIN = "ar"  # the algorithm name of plain decoding, which proposes nothing
__all__ = ["EVENT_TYPES", "PLAIN", "SCHEMA_VERSION", "AcceptEvent", "BonusEvent", "CommitEvent", "CorrectEvent",
           "DraftEvent", "Event", "FinishEvent", "KVAllocEvent", "KVFreeEvent", "MemoryEvent",
           "PrefillEvent", "PreemptEvent", "RejectEvent", "TokenInfo", "Trace", "TraceError", "VerifyEvent"]


@dataclass(slots=True)
class Trace:
    """Everything one generation left behind. params holds the algorithm's and sampling settings as JSON scalars."""

    algo: str  # a registered algorithm's name, or PLAIN
    model: str
    prompt: str
    prompt_ids: list[int]
    params: dict[str, JSONScalar]
    events: list[Event] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def finish(self) -> FinishEvent | None:
        return next((e for e in reversed(self.events) if isinstance(e, FinishEvent)), None)

    def finished(self) -> FinishEvent:
        """The finish event of a whole run; a trace without one is refused."""
        finish = self.finish()
        if finish is None:
            raise TraceError("events: the trace has no finish event (the run did not complete)")
        return finish

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "algo": self.algo,
            "model": self.model,
            "prompt": self.prompt,
            "prompt_ids": list(self.prompt_ids),
            "params": dict(self.params),
            "events": [_event_to_dict(e) for e in self.events],
        }

    def to_json(self, indent: int | None = None) -> str:
        try:
            return json.dumps(self.to_dict(), indent=indent, allow_nan=False, ensure_ascii=False)
        except ValueError as exc:
            raise TraceError(f"trace holds a value JSON cannot carry exactly: {exc}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        """A trace from parsed JSON, validated field by field; TraceError naming the first bad field."""
        if not isinstance(data, dict):
            raise TraceError(f"trace: expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version == 1:
            data = _from_v1(data)
        elif version != SCHEMA_VERSION:
            raise TraceError(f"schema_version: this build reads versions 1 and {SCHEMA_VERSION}, the file has "
                             f"{version!r}")
        return cls(**trace_fields(data))

    @classmethod
    def from_json(cls, text: str | bytes) -> Trace:
        # Hundreds of thousands of acyclic objects are made here: the cyclic collector, which would walk them again
        # and again as they are made, is paused meanwhile (loading runs twice as fast); reference counting still
        # frees them.
        collecting = gc.isenabled()
        gc.disable()
        try:
            try:  # pydantic's parser: faster than Python's, nesting bounded, NaN and Infinity refused
                data = from_json(text, allow_inf_nan=False, cache_strings="keys")
            except ValueError as exc:  # not JSON, not UTF-8, nested over 200 deep, an integer over 4,300 digits
                raise TraceError(f"trace: not valid JSON ({exc})") from None
            return cls.from_dict(data)
        finally:
            if collecting:
                gc.enable()

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        path = Path(path)
        if not path.is_file():
            raise TraceError(f"trace: no such file {path}")
        if path.stat().st_size > MAX_TRACE_BYTES:
            raise TraceError(f"trace: {path} is larger than {MAX_TRACE_BYTES // 2**20} MiB")
        return cls.from_json(path.read_bytes())


_V1_NOTES = {"source": ("copied", {"source": "source", "ngram": "ngram"}),
             "suffix": ("retrieved", {"suffix": "suffix", "hits": "hits"}),
             "draft_layers": ("layers", {"draft_layers": "layers"})}


def _from_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A version 1 trace as version 2 holds it (checked afterwards like any): a draft event's prompt lookup, REST
    and self-speculation fields become its note, and a lookahead event becomes the note of its step's draft event
    (one with no tokens where the step proposed none)."""
    events: list[Any] = []
    window: dict[str, Any] | None = None  # the last lookahead event, until its step's draft takes it
    given = data.get("events")
    for event in given if isinstance(given, list) else []:
        if not isinstance(event, dict):
            events.append(event)
            continue
        if window is not None and (event.get("kind") != "draft" or event.get("step") != window["step"]):
            events.append(_window_draft(window))
            window = None
        if event.get("kind") == "lookahead":
            note = {"kind": "jacobi", **{k: v for k, v in event.items() if k not in ("kind", "step", "t")}}
            window = {"step": event.get("step"), "t": event.get("t"), "note": note}
            continue
        if event.get("kind") == "draft":
            event = dict(event)
            for key, (kind, names) in _V1_NOTES.items():
                if event.get(key) is not None:
                    event["note"] = {"kind": kind, **{new: event.get(old) for old, new in names.items()}}
            for old in ("source", "ngram", "suffix", "hits", "draft_layers"):
                event.pop(old, None)
            if window is not None:
                event["note"], window = window["note"], None
        events.append(event)
    if window is not None:
        events.append(_window_draft(window))
    return {**data, "schema_version": SCHEMA_VERSION, "events": events}


def _window_draft(window: dict[str, Any]) -> dict[str, Any]:
    """A version 1 lookahead event of a step that proposed no candidates, as its version 2 draft event."""
    return {"kind": "draft", "step": window["step"], "t": window["t"], "tokens": [], "wall_s": 0.0,
            "draft_forwards": 0, "note": window["note"]}


def _event_to_dict(event: Event) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": event.KIND}
    for f in fields(event):
        value = getattr(event, f.name)
        if isinstance(value, TokenInfo):
            value = _token_to_dict(value)
        elif isinstance(value, list):
            value = [_token_to_dict(v) if isinstance(v, TokenInfo) else v for v in value]
        out[f.name] = value
    return out


_TOKEN_FIELDS = tuple(f.name for f in fields(TokenInfo))


def _token_to_dict(token: TokenInfo) -> dict[str, Any]:
    return {name: getattr(token, name) for name in _TOKEN_FIELDS}
