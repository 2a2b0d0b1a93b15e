"""Trace schema v1: the step events every decoder yields, with an exact JSON round trip.

A loaded trace is validated field by field against these dataclasses (never unpickled), so the UI can replay
an exported file with no model loaded and a malformed file is refused with the path of the bad field.
Times are engine seconds since generation start, excluding time the consumer spent between events.
"""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Union

SCHEMA_VERSION = 1
MAX_TRACE_BYTES = 256 * 1024 * 1024


class TraceError(ValueError):
    """A trace file or object does not follow the schema; the message names the offending field."""


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One token as the UI shows it. p: target probability (under the model's softmax at temperature 1 when
    decoding greedily); q: proposal probability (None where nothing was proposed); parent: the node this proposal
    follows in the step's draft tree, node 0 being the last committed token and node i the event's i-th token
    (None in a plain chain, where each proposal follows the one before)."""

    id: int
    text: str
    position: int
    p: float | None = None
    q: float | None = None
    parent: int | None = None


@dataclass(frozen=True, slots=True)
class PrefillEvent:
    KIND: ClassVar[str] = "prefill"
    step: int
    t: float
    num_tokens: int
    wall_s: float


@dataclass(frozen=True, slots=True)
class DraftEvent:
    """Proposed tokens. For proposals copied from earlier text (prompt lookup): source is the [start, end)
    positions, in prompt + generated tokens, of the copied tokens, and ngram the length of the match that
    ends at `start` (the last `ngram` tokens so far equal the `ngram` tokens before `start`)."""

    KIND: ClassVar[str] = "draft"
    step: int
    t: float
    tokens: list[TokenInfo]
    wall_s: float
    draft_forwards: int
    source: list[int] | None = None
    ngram: int | None = None

    def is_sibling(self, index: int) -> bool:
        """Whether tokens[index] is a second guess beside an earlier token for the same position (a speculative
        step's runner-up of the draft's first token: parent 0 at index > 0) rather than the next token of the
        chain (parent None, or node `index`: the token before it). The one rule for metrics, text and detail."""
        parent = self.tokens[index].parent
        return parent is not None and parent != index


@dataclass(frozen=True, slots=True)
class LookaheadEvent:
    """A lookahead step before its forward: the Jacobi window (N - 1 rows of W token ids, oldest row first),
    the number of n-grams in the pools, and the pools' candidates for the last tokens (its hits)."""

    KIND: ClassVar[str] = "lookahead"
    step: int
    t: float
    window: list[list[int]]
    pool_size: int
    candidates: list[list[int]]
    keys: list[int] | None = None  # per candidate, how many trailing tokens it was keyed by (None: 1 each)


@dataclass(frozen=True, slots=True)
class TreeEvent:
    """A Medusa step's whole candidate tree, after verification. Node i has the top-k path paths[i] (head
    len(path) - 1 proposed it at rank path[-1]; its parent is the node whose path is path[:-1], or the last
    committed token for a path of length 1), token tokens[i] with head probability probs[i] and target
    probability target_probs[i]. accepted: the nodes kept, in depth order. A step that grafted a copy of earlier
    text has more tokens than paths: the nodes past the paths form a chain below node copy_parent (0: the last
    committed token), their probs 1 (a copy is a one-hot proposal); copy_source is the [start, end) positions of
    those tokens in prompt + generated tokens and copy_ngram the length of the match that ends at start."""

    KIND: ClassVar[str] = "tree"
    step: int
    t: float
    paths: list[list[int]]
    tokens: list[int]
    probs: list[float]
    target_probs: list[float]
    accepted: list[int]
    copy_parent: int | None = None
    copy_source: list[int] | None = None
    copy_ngram: int | None = None


@dataclass(frozen=True, slots=True)
class VerifyEvent:
    """One target forward over `num_tokens` new positions (the last committed token plus any proposals)."""

    KIND: ClassVar[str] = "verify"
    step: int
    t: float
    num_tokens: int
    wall_s: float
    target_forwards: int


@dataclass(frozen=True, slots=True)
class _TokenEvent:
    step: int
    t: float
    token: TokenInfo


@dataclass(frozen=True, slots=True)
class _Decision(_TokenEvent):
    u: float | None = None  # the uniform draw compared with p/q (None under greedy acceptance)


@dataclass(frozen=True, slots=True)
class AcceptEvent(_Decision):
    KIND: ClassVar[str] = "accept"


@dataclass(frozen=True, slots=True)
class RejectEvent(_Decision):
    KIND: ClassVar[str] = "reject"


@dataclass(frozen=True, slots=True)
class CorrectEvent(_TokenEvent):
    """The token drawn from the residual norm(max(0, p - q)) (or the argmax) after a rejection."""

    KIND: ClassVar[str] = "correct"


@dataclass(frozen=True, slots=True)
class BonusEvent(_TokenEvent):
    """A token drawn from the target's own distribution with nothing left to verify: every token of plain
    decoding, and the extra token after a fully accepted draft."""

    KIND: ClassVar[str] = "bonus"


@dataclass(frozen=True, slots=True)
class _KVChange:
    step: int
    t: float
    seq: int
    num_tokens: int  # tokens allocated or freed by this change
    bytes_used: int  # cache totals after the change
    bytes_reserved: int


@dataclass(frozen=True, slots=True)
class KVAllocEvent(_KVChange):
    KIND: ClassVar[str] = "kv-alloc"


@dataclass(frozen=True, slots=True)
class KVFreeEvent(_KVChange):
    KIND: ClassVar[str] = "kv-free"


@dataclass(frozen=True, slots=True)
class PreemptEvent:
    KIND: ClassVar[str] = "preempt"
    step: int
    t: float
    seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class MemoryEvent:
    """The paged KV pool after one serving-engine step that ran `num_tokens` tokens in `wall_s` seconds.

    owners: for each physical block, the request holding it (the lowest id when shared), -1 when free;
    shared: the blocks more than one request holds (a shared prompt prefix). bytes_used: slots holding tokens,
    each stored once; logical_bytes: the same tokens counted per request (shared ones several times);
    bytes_reserved - bytes_used is the pool's internal fragmentation; contiguous_bytes is what a contiguous cache
    reserving prompt + max_new_tokens slots for every running request would hold instead."""

    KIND: ClassVar[str] = "kv-memory"
    step: int
    t: float
    num_tokens: int
    wall_s: float
    block_size: int
    blocks_total: int
    blocks_used: int
    bytes_used: int
    bytes_reserved: int
    logical_bytes: int
    contiguous_bytes: int
    owners: list[int]
    shared: list[int]
    running: list[int]
    waiting: list[int]


@dataclass(frozen=True, slots=True)
class CommitEvent:
    """End of a step: tokens kept, the cache rolled back to them, and where the step's time went."""

    KIND: ClassVar[str] = "commit"
    step: int
    t: float
    num_tokens: int
    draft_s: float
    verify_s: float
    overhead_s: float
    kv_bytes: int


@dataclass(frozen=True, slots=True)
class FinishEvent:
    KIND: ClassVar[str] = "finish"
    step: int
    t: float
    reason: str  # "eos" | "length" | "stop"
    token_ids: list[int]
    text: str
    wall_s: float


Event = Union[PrefillEvent, DraftEvent, LookaheadEvent, TreeEvent, VerifyEvent, AcceptEvent, RejectEvent,
              CorrectEvent, BonusEvent, KVAllocEvent, KVFreeEvent, PreemptEvent, MemoryEvent, CommitEvent, FinishEvent]
EVENT_TYPES: dict[str, type] = {cls.KIND: cls for cls in typing.get_args(Event)}
JSONScalar = Union[str, int, float, bool, None]


@dataclass(slots=True)
class Trace:
    """Everything one generation left behind. params holds the algorithm's and sampling settings as JSON scalars."""

    algo: str
    model: str
    prompt: str
    prompt_ids: list[int]
    params: dict[str, JSONScalar]
    events: list[Event] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def finish(self) -> FinishEvent | None:
        return next((e for e in reversed(self.events) if isinstance(e, FinishEvent)), None)

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
        if not isinstance(data, dict):
            raise TraceError(f"trace: expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TraceError(f"schema_version: this build reads version {SCHEMA_VERSION}, the file has {version!r}")
        expected = {"schema_version", "algo", "model", "prompt", "prompt_ids", "params", "events"}
        _check_keys(data, expected, "trace")
        params = data["params"]
        if not isinstance(params, dict):
            raise TraceError("params: expected an object")
        for key, value in params.items():
            _coerce(value, JSONScalar, f"params.{key}")
        events = data["events"]
        if not isinstance(events, list):
            raise TraceError("events: expected a list")
        return cls(
            algo=_coerce(data["algo"], str, "algo"),
            model=_coerce(data["model"], str, "model"),
            prompt=_coerce(data["prompt"], str, "prompt"),
            prompt_ids=_coerce(data["prompt_ids"], list[int], "prompt_ids"),
            params=dict(params),
            events=[_event_from_dict(e, f"events[{i}]") for i, e in enumerate(events)],
        )

    @classmethod
    def from_json(cls, text: str) -> Trace:
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            raise TraceError(f"trace: not valid JSON ({exc})") from exc
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        path = Path(path)
        if not path.is_file():
            raise TraceError(f"trace: no such file {path}")
        if path.stat().st_size > MAX_TRACE_BYTES:
            raise TraceError(f"trace: {path} is larger than {MAX_TRACE_BYTES // 2**20} MiB")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(f"trace: {path} is not UTF-8 text") from exc
        return cls.from_json(text)


def _reject_constant(name: str) -> None:
    raise TraceError(f"trace: {name} is not allowed in a trace")


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


def _token_to_dict(token: TokenInfo) -> dict[str, Any]:
    return {f.name: getattr(token, f.name) for f in fields(token)}


def _check_keys(data: dict[str, Any], expected: set[str], path: str, optional: set[str] = frozenset()) -> None:
    missing = expected - optional - data.keys()
    if missing:
        raise TraceError(f"{path}: missing field(s) {', '.join(sorted(missing))}")
    extra = data.keys() - expected
    if extra:
        raise TraceError(f"{path}: unknown field(s) {', '.join(sorted(extra))}")


def _from_fields(cls: type, data: Any, path: str, skip: set[str] = frozenset()) -> Any:
    if not isinstance(data, dict):
        raise TraceError(f"{path}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    optional = {f.name for f in fields(cls) if f.default is not MISSING}
    _check_keys({k: v for k, v in data.items() if k not in skip}, names, path, optional)
    kwargs = {name: _coerce(data[name], hints[name], f"{path}.{name}") for name in names if name in data}
    return cls(**kwargs)


def _event_from_dict(data: Any, path: str) -> Event:
    if not isinstance(data, dict):
        raise TraceError(f"{path}: expected an object, got {type(data).__name__}")
    kind = data.get("kind")
    if kind not in EVENT_TYPES:
        raise TraceError(f"{path}.kind: must be one of {', '.join(EVENT_TYPES)}; got {kind!r}")
    event = _from_fields(EVENT_TYPES[kind], data, path, skip={"kind"})
    if isinstance(event, TreeEvent):
        _check_tree(event, path)
    return event


def _check_tree(event: TreeEvent, path: str) -> None:
    """A tree event's lists must describe one tree, or the UI could not draw it."""
    heads, nodes = len(event.paths), len(event.tokens)
    if len(event.probs) != nodes or len(event.target_probs) != nodes:
        raise TraceError(f"{path}: tokens, probs and target_probs must have one entry per node ({nodes})")
    if nodes < heads:
        raise TraceError(f"{path}.tokens: {nodes} tokens for {heads} paths; every path needs its token")
    if not all(1 <= node <= nodes for node in event.accepted):
        raise TraceError(f"{path}.accepted: nodes must be in [1, {nodes}]")
    copied = nodes - heads
    if not copied:
        if (event.copy_parent, event.copy_source, event.copy_ngram) != (None, None, None):
            raise TraceError(f"{path}.copy_parent: copy_parent, copy_source and copy_ngram are set only when tokens "
                             "has more entries than paths (a grafted copy)")
        return
    if event.copy_parent is None or not 0 <= event.copy_parent <= heads:
        raise TraceError(f"{path}.copy_parent: the node in [0, {heads}] the {copied} copied nodes hang below, got "
                         f"{event.copy_parent!r}")
    source = event.copy_source
    if source is None or len(source) != 2 or source[0] < 0 or source[1] - source[0] != copied:
        raise TraceError(f"{path}.copy_source: [start, end) with end - start = {copied} copied nodes, got {source!r}")
    if event.copy_ngram is None or event.copy_ngram < 1:
        raise TraceError(f"{path}.copy_ngram: the matched n-gram length (>= 1), got {event.copy_ngram!r}")


def _coerce(value: Any, annotation: Any, path: str) -> Any:
    """Check a JSON value against a field annotation and return it as the dataclass expects."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _coerce(value, option, path)
            except TraceError:
                continue
        raise TraceError(f"{path}: {value!r} matches none of the allowed types")
    if annotation is type(None):
        if value is not None:
            raise TraceError(f"{path}: expected null, got {type(value).__name__}")
        return None
    if origin is list:
        if not isinstance(value, list):
            raise TraceError(f"{path}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(annotation)
        return [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if annotation is TokenInfo:
        return _from_fields(TokenInfo, value, path)
    if annotation is bool:
        if not isinstance(value, bool):
            raise TraceError(f"{path}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TraceError(f"{path}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TraceError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise TraceError(f"{path}: expected a string, got {type(value).__name__}")
        return value
    raise TraceError(f"{path}: unsupported schema type {annotation!r}")
