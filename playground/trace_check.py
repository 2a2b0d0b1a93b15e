"""Validation of a parsed trace file: bounded, fast, and never a crash.

Each schema type is turned once into a check: a function from a parsed JSON value to the value the dataclass holds,
raising TraceError on the first problem with the path of the field. A dataclass's check calls its fields' checks
positionally, then the class's consistency rules (_RULES), so that a loaded trace is one the viewers can draw:
integers within 64 bits, finite floats, proposal trees whose parents come before their children, notes as their
kinds define them (`notes`), a block map with one owner per block, steps numbered within the trace's events. Paths are
put together only on failure.
"""

from __future__ import annotations

import dataclasses
import reprlib
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

from . import notes
from .config import MAX_NEW_TOKENS_LIMIT
from .events import (
    EVENT_TYPES,
    AcceptEvent,
    BonusEvent,
    CommitEvent,
    CorrectEvent,
    DraftEvent,
    Event,
    FinishEvent,
    JSONObject,
    JSONScalar,
    MemoryEvent,
    PrefillEvent,
    RejectEvent,
    TokenInfo,
    TraceError,
    VerifyEvent,
)

_Check = Callable[[Any], Any]


class _Bad(Exception):
    """A problem found, and the path down to it (filled in as the exception rises)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason, self.path = reason, ""

    def at(self, part: str) -> _Bad:
        self.path = part + ("" if not self.path or self.path.startswith("[") else ".") + self.path
        return self

    def message(self) -> str:
        return f"{self.path or 'trace'}: {self.reason}"


_REPR = reprlib.Repr()  # Python 3.11's takes no arguments
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 2, 4, 2, 30, 30, 30


def _shown(value: Any) -> str:
    """A short, bounded repr for a message (a value may be huge or deeply nested)."""
    return _REPR.repr(value)


def _int(value: Any) -> int:
    if type(value) is int and -MAX_INT <= value <= MAX_INT:
        return value
    raise _Bad(f"expected an integer in [-2^63, 2^63], got {_shown(value)}")


def _float(value: Any) -> float:
    if type(value) is float and value - value == 0.0:  # inf - inf and nan - nan are nan
        return value
    if type(value) is int and -MAX_INT <= value <= MAX_INT:
        return float(value)
    raise _Bad(f"expected a finite number, got {_shown(value)}")


def _str(value: Any) -> str:
    if type(value) is str:
        return value
    raise _Bad(f"expected a string, got {_shown(value)}")


def _scalar(value: Any) -> Any:
    if value is None or type(value) in (str, bool):
        return value
    return _int(value) if type(value) is int else _float(value)


def _list(check: _Check) -> _Check:
    def items(value: Any) -> list[Any]:
        if type(value) is not list:
            raise _Bad(f"expected a list, got {_shown(value)}")
        try:
            return [check(v) for v in value]
        except _Bad:
            for i, v in enumerate(value):  # again, one at a time, to name the bad item
                _field(check, v, f"[{i}]")
            raise

    def ints(value: Any) -> list[int]:  # most lists (token ids, blocks), checked at C speed when they are fine
        if type(value) is list and all(type(v) is int for v in value) and (
                not value or (-MAX_INT <= min(value) and max(value) <= MAX_INT)):
            return value
        return items(value)  # to name the bad item
    return ints if check is _int else items


def _compile(annotation: Any) -> _Check:
    simple = {int: _int, float: _float, str: _str}
    if annotation in simple:
        return simple[annotation]
    if annotation is JSONScalar:
        return _scalar
    if annotation == JSONObject:
        return _note
    if dataclasses.is_dataclass(annotation):
        return _dataclass(typing.cast(type, annotation))
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list:
        return _list(_compile(args[0]))
    raise TypeError(f"no check for schema type {annotation!r}")


def _field(check: _Check, value: Any, name: str) -> Any:
    try:
        return check(value)
    except _Bad as bad:
        raise bad.at(name) from None


def _dataclass(cls: type, skip: frozenset[str] = frozenset()) -> _Check:
    """The check of a dataclass from a JSON object with exactly its fields (and the keys in `skip`); an optional
    field left out reads as null."""
    hints = typing.get_type_hints(cls)
    spec = []  # (name, check of a value that is not null, whether null is allowed)
    for f in fields(cls):
        if f.default not in (MISSING, None):
            raise TypeError(f"{cls.__name__}.{f.name}: a schema field's default must be None")
        options = typing.get_args(hints[f.name])
        nullable = type(None) in options
        spec.append((f.name, _compile(next(a for a in options if a is not type(None)) if nullable
                                      else hints[f.name]), nullable))
    allowed = frozenset(f.name for f in fields(cls)) | skip
    required = frozenset(f.name for f in fields(cls) if f.default is MISSING)
    rules = _RULES.get(cls, ())

    def check(value: Any) -> Any:
        if type(value) is not dict:
            raise _Bad(f"expected an object, got {_shown(value)}")
        if not required <= value.keys() <= allowed:
            raise _keys(value.keys(), required, allowed)
        args = []
        for name, field_check, nullable in spec:
            item = value.get(name)
            args.append(None if nullable and item is None else _field(field_check, item, name))
        made = cls(*args)
        for rule in rules:
            rule(made)
        return made
    return check


def _keys(keys: Any, required: frozenset[str], allowed: frozenset[str]) -> _Bad:
    missing, extra = sorted(required - keys), sorted(map(str, keys - allowed))
    return _Bad(f"missing field(s) {', '.join(missing)}" if missing else
                f"unknown field(s) {', '.join(k[:40] for k in extra[:5])}")


def _within(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise _Bad(f"must be in [{lo}, {hi}], got {value}").at(name)


def _check_token(token: TokenInfo) -> None:
    if token.id < 0:
        raise _Bad(f"a token id is at least 0, got {token.id}").at("id")
    if token.position < 0:
        raise _Bad(f"a position is at least 0, got {token.position}").at("position")
    for name in ("p", "q"):
        value = getattr(token, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise _Bad(f"a probability is in [0, 1], got {value}").at(name)


_SECONDS = ("t", "wall_s", "draft_s", "verify_s", "overhead_s")
_COUNTS = ("num_tokens", "draft_forwards", "target_forwards", "bytes_used", "bytes_reserved", "kv_bytes")


def _check_event(event: Any) -> None:
    """Times within [0, MAX_SECONDS], counts not negative, a uniform draw within [0, 1]."""
    for name in _SECONDS:
        value = getattr(event, name, None)
        if value is not None and not 0.0 <= value <= MAX_SECONDS:
            raise _Bad(f"engine seconds are in [0, {MAX_SECONDS:g}], got {value}").at(name)
    for name in _COUNTS:
        value = getattr(event, name, None)
        if value is not None and value < 0:
            raise _Bad(f"a count is at least 0, got {value}").at(name)
    u = getattr(event, "u", None)
    if u is not None and not 0.0 <= u <= 1.0:
        raise _Bad(f"a uniform draw is in [0, 1], got {u}").at("u")


def _check_draft(event: DraftEvent) -> None:
    _within("tokens", len(event.tokens), 0, MAX_NODES)
    for i, token in enumerate(event.tokens):  # node i + 1 follows node 0 (the last token) or a node before it
        if token.parent is not None and not 0 <= token.parent <= i:
            raise _Bad(f"must be a node in [0, {i}] or null, got {token.parent}").at("parent").at(f"[{i}]").at("tokens")


def _json(value: Any, depth: int) -> None:
    """A note's value: scalars, and lists of them nested at most `depth` deep, each of at most MAX_NODES items."""
    if type(value) is list and depth > 0:
        _within("items", len(value), 0, MAX_NODES)
        for i, item in enumerate(value):
            _field(lambda v: _json(v, depth - 1), item, f"[{i}]")
    else:
        _scalar(value)


def _note(value: Any) -> dict[str, Any]:
    """A proposal's note: an object with a kind and JSON values, bounded; a registered kind's fields then as its
    dataclass says, and its own check."""
    if type(value) is not dict:
        raise _Bad(f"expected an object, got {_shown(value)}")
    kind = value.get("kind")
    if type(kind) is not str:
        raise _Bad(f"a note names its kind, a string; got {_shown(kind)}").at("kind")
    _within("fields", len(value), 1, MAX_NOTE_FIELDS)
    for name, item in value.items():
        _field(lambda v: _json(v, 2), item, str(name)[:40])
    registered = notes.known(kind)
    if registered is None:
        return value
    check = _NOTES.get(registered)
    if check is None:
        check = _NOTES[registered] = _dataclass(registered, skip=frozenset({"kind"}))
    made = check(value)
    try:
        made.check()
    except ValueError as exc:
        field, _, reason = str(exc).partition(": ")
        raise _Bad(reason).at(field) from None
    return value


def _check_memory(event: MemoryEvent) -> None:
    _within("blocks_total", event.blocks_total, 0, MAX_BLOCKS)
    _within("blocks_used", event.blocks_used, 0, event.blocks_total)
    if len(event.owners) != event.blocks_total:
        raise _Bad(f"one entry per block ({event.blocks_total}), got {len(event.owners)}").at("owners")
    if any(not 0 <= b < event.blocks_total for b in event.shared):
        raise _Bad(f"blocks must be in [0, {event.blocks_total - 1}]").at("shared")


MAX_INT = 2**63
MAX_NOTE_FIELDS = 16  # fields of a proposal's note, its kind included
MAX_NODES = 1024  # tokens one step may propose (the widest proposal a proposer makes is a few hundred)
MAX_SECONDS = 86_400.0  # engine seconds a run's times may reach: a day
MAX_STEPS = MAX_NEW_TOKENS_LIMIT + 1  # steps of a run: the prefill's, then at least one token each
ONCE = (PrefillEvent, DraftEvent, VerifyEvent, CommitEvent)  # event kinds a step has at most one of
MAX_BLOCKS = 1 << 20
_RULES: dict[type, tuple[Callable[[Any], None], ...]] = {
    **{cls: (_check_event,) for cls in EVENT_TYPES.values()}, TokenInfo: (_check_token,),
    DraftEvent: (_check_event, _check_draft),
    MemoryEvent: (_check_event, _check_memory)}
_EVENTS = {kind: _dataclass(cls, skip=frozenset({"kind"})) for kind, cls in EVENT_TYPES.items()}
_NOTES: dict[type, _Check] = {}  # each registered kind of note's check, made when first met


def _event(value: Any) -> Event:
    if type(value) is not dict:
        raise _Bad(f"expected an object, got {_shown(value)}")
    kind = value.get("kind")
    check = _EVENTS.get(kind) if type(kind) is str else None
    if check is None:
        raise _Bad(f"must be one of {', '.join(EVENT_TYPES)}; got {_shown(kind)}").at("kind")
    return check(value)


def _params(value: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _Bad(f"expected an object, got {_shown(value)}")
    for key, item in value.items():
        try:
            _scalar(item)
        except _Bad as bad:
            raise bad.at(str(key)[:40]) from None
    return value


def _trace_check() -> Callable[[dict[str, Any]], dict[str, Any]]:
    checks = {"algo": _str, "model": _str, "prompt": _str, "prompt_ids": _list(_int), "params": _params,
              "events": _list(_event), "schema_version": _int}

    def check(value: dict[str, Any]) -> dict[str, Any]:
        if value.keys() != checks.keys():
            raise _keys(value.keys(), frozenset(checks), frozenset(checks))
        out = {}
        for name, field_check in checks.items():
            try:
                out[name] = field_check(value[name])
            except _Bad as bad:
                raise bad.at(name) from None
        # a step numbers the engine steps a run took, each of which left at least one event: the viewers size a
        # replay by the last step, so a number beyond the events is refused, not allocated
        last = len(out["events"])
        for i, event in enumerate(out["events"]):
            if not 0 <= event.step <= last:
                raise _Bad(f"must be in [0, {last}] (a trace of {last} events), got {event.step}").at(
                    "step").at(f"[{i}]").at("events")
        _check_steps(out["events"])
        return out
    return check


def _check_steps(events: list[Event]) -> None:
    """The shape of a run, so that a trace's figures are ones a run could leave: steps in order, at most MAX_STEPS of
    them, each with at most one event of each kind in ONCE, no more accepts than its draft has nodes, at most one
    reject and one correction or bonus; one finish. Events repeated or shuffled fail here."""
    step, steps, finished = -1, 0, False
    seen: set[type] = set()
    nodes = accepts = rejects = drawn = 0
    for i, event in enumerate(events):
        try:
            if event.step < step:
                raise _Bad(f"steps run in order: step {event.step} after step {step}").at("step")
            if event.step != step:
                step, steps, seen = event.step, steps + 1, set()
                nodes = accepts = rejects = drawn = 0
                if steps > MAX_STEPS:
                    raise _Bad(f"a run has at most {MAX_STEPS} steps").at("step")
            kind = type(event)
            if kind in ONCE:
                if kind in seen:
                    raise _Bad(f"a second {event.KIND} event in step {step}: a step has at most one").at("kind")
                seen.add(kind)
            if isinstance(event, DraftEvent):
                nodes = len(event.tokens)
            elif isinstance(event, AcceptEvent):
                accepts += 1
                if accepts > nodes:
                    raise _Bad(f"step {step} accepts more tokens than its draft's {nodes}").at("kind")
            elif isinstance(event, RejectEvent):
                rejects += 1
                if rejects > 1:
                    raise _Bad(f"a second reject in step {step}: a step refuses at most one node").at("kind")
            elif isinstance(event, (CorrectEvent, BonusEvent)):
                drawn += 1
                if drawn > 1:
                    raise _Bad(f"a second correction or bonus in step {step}: a step draws one").at("kind")
            elif isinstance(event, FinishEvent):
                if finished:
                    raise _Bad("a second finish event: a run finishes once").at("kind")
                finished = True
        except _Bad as bad:
            raise bad.at(f"[{i}]").at("events") from None


_TRACE = _trace_check()


def trace_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The fields of a `Trace` from a parsed trace file (a dict); TraceError naming the first bad field."""
    try:
        return _TRACE(data)
    except _Bad as bad:
        raise TraceError(bad.message()) from None
