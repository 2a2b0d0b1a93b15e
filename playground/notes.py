"""A proposal's note in the trace: what an algorithm says of a proposal beyond its tokens (where a copy came from, a
datastore's match, the layers a draft ran, a Jacobi window), as one JSON object {"kind": ..., ...} in its draft event
(`DraftEvent.note`).

Each algorithm's module defines its kind of note as a frozen dataclass subclassing `NoteKind`: its fields are the
object's (checked by type as a trace loads, then by its own `check`), and its `say` is what the step detail shows of
it. An algorithm's spec lists its kinds (`Algorithm.notes`) and the registry registers them here (`known` imports it
first, so that a trace is checked and shown alike wherever it is loaded). A note of a kind not registered (a trace
from a plug-in not loaded) still loads, and the step detail shows its fields as they are.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

TokenText = Callable[[int], str]  # a token id's text, as a tokenizer decodes it alone


@dataclass(frozen=True, slots=True)
class Said:
    """What the step detail shows of a note. origin: a phrase after the proposed tokens, where they came from;
    beside: what the tokens beside the first are called, (for one, for several with {n} their count); block: HTML
    shown below the step's line. Token text in either is escaped (`token_html`, `ngram_html`)."""

    origin: str = ""
    beside: tuple[str, str] | None = None
    block: str = ""


class NoteKind:
    """A kind of note: subclasses are frozen dataclasses whose fields are JSON values (ints, strings, lists of
    them) and whose KIND names them in the trace."""

    KIND: ClassVar[str]

    def check(self) -> None:
        """Ranges the field types do not say: a ValueError whose message starts with the field's name."""

    def say(self, draft: Any, text: TokenText) -> Said:
        """What the step detail shows of this note on `draft` (the step's `DraftEvent`): by default its fields."""
        shown = ", ".join(f"{html.escape(key)} {html.escape(str(value))}" for key, value in self.fields().items())
        return Said(origin=f" ({shown})")

    def ids(self) -> list[int]:
        """The token ids the step detail shows beside the proposal, which the app decodes for it."""
        return []

    def span(self) -> tuple[int, int] | None:
        """The [start, end) positions, in prompt and generated tokens, of earlier text the proposal came from: the
        app highlights them in the prompt."""
        return None

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]  # a dataclass

    def to_json(self) -> dict[str, Any]:
        """The note as the trace holds it."""
        return {"kind": self.KIND, **self.fields()}


KINDS: dict[str, type[NoteKind]] = {}


def register(*kinds: type[NoteKind]) -> None:
    for kind in kinds:
        KINDS[kind.KIND] = kind


def unregister(*kinds: type[NoteKind]) -> None:
    for kind in kinds:
        KINDS.pop(kind.KIND, None)


def known(kind: Any) -> type[NoteKind] | None:
    """The registered kind of that name: the built-in algorithms' (their registry is imported the first time) or
    one registered since; None for any other."""
    from .decoding import registry  # noqa: F401  (it registers the built-in algorithms' kinds)

    return KINDS.get(kind) if isinstance(kind, str) else None


def read(note: dict[str, Any]) -> NoteKind | None:
    """A trace's note as its registered kind (None where its kind is not registered). The note has been checked."""
    kind = known(note.get("kind"))
    return kind(**{key: value for key, value in note.items() if key != "kind"}) if kind is not None else None


def token_html(token: int, text: TokenText | None) -> str:
    """A token id as the step detail shows it: its text, escaped (#id without a tokenizer)."""
    return html.escape(repr(text(token))[1:-1] if text else f"#{token}")


def ngram_html(ids: Iterable[int], text: TokenText | None, cls: str = "") -> str:
    """Token ids as one boxed run of cells (`pg-ngram`; `pg-verified` outlines it)."""
    cells = "".join(f'<span class="pg-cell">{token_html(i, text)}</span>' for i in ids)
    return f'<span class="pg-ngram {cls}">{cells}</span>'


def said(draft: Any, text: TokenText) -> Said:
    """What the step detail shows of a draft event's note: its kind's `say`, or its fields as they are."""
    if not draft.note:
        return Said()
    note = read(draft.note)
    if note is not None:
        return note.say(draft, text)
    shown = ", ".join(f"{html.escape(str(key))} {html.escape(str(value))}" for key, value in draft.note.items()
                      if key != "kind")
    return Said(origin=f" (a note of kind {html.escape(str(draft.note.get('kind')))}: {shown})")


def shown_ids(notes: list[dict[str, Any]]) -> set[int]:
    """Every token id the step detail shows beside the proposals of these notes."""
    ids: set[int] = set()
    for note in notes:
        kind = read(note)
        if kind is not None:
            ids.update(kind.ids())
    return ids
