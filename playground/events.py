"""The trace's events (schema v2): what every decoder and the engine record as they run, as frozen dataclasses.

`playground.trace` turns them into JSON and back; `playground.trace_check` validates a loaded file.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Union

SCHEMA_VERSION = 2
JSONObject = dict[str, Any]  # a JSON object; a note's own fields are checked by its kind (`playground.notes`)


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
    """Proposed tokens (none where a step ran only what its note says, as a lookahead window without candidates).
    note: what the algorithm says of them beyond their tokens, one JSON object {"kind": ..., ...} whose kind defines
    its fields and how the step detail shows it (`playground.notes`): where a copy came from, a datastore's match,
    the layers a draft ran, a Jacobi window."""

    KIND: ClassVar[str] = "draft"
    step: int
    t: float
    tokens: list[TokenInfo]
    wall_s: float
    draft_forwards: int  # forwards of a model of the proposer's own (a draft, a head) it took
    note: JSONObject | None = None

    def noted(self, kind: str) -> JSONObject | None:
        """Its note where the note is of that kind (a copy's "copied", REST's "retrieved", ...), else None."""
        return self.note if self.note is not None and self.note.get("kind") == kind else None

    def is_sibling(self, index: int) -> bool:
        """Whether tokens[index] is another guess for the first proposed position beside an earlier one (parent 0,
        the last committed token, at index > 0: a draft's runner-up, a tree's second branch) rather than a token
        proposed for a position of its own (parent None: the chain's next token; or a node that follows another).
        The one rule for metrics, text and detail."""
        return index > 0 and self.tokens[index].parent == 0


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
    """The paged KV pool as one serving-engine step's forward held it (its proposals' rows included, before the
    requests it finished released theirs); the step ran `num_tokens` tokens in `wall_s` seconds.

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


Event = Union[PrefillEvent, DraftEvent, VerifyEvent, AcceptEvent, RejectEvent,
              CorrectEvent, BonusEvent, KVAllocEvent, KVFreeEvent, PreemptEvent, MemoryEvent, CommitEvent, FinishEvent]
EVENT_TYPES: dict[str, type] = {cls.KIND: cls for cls in typing.get_args(Event)}
JSONScalar = Union[str, int, float, bool, None]
