"""What an algorithm is to every surface: its name and label, its parameters and how each is set, what it loads,
how it shows in the app, and how the benchmark runs it. Each algorithm's module defines its `Algorithm`; the
registry lists them; the command line's options, the app's fields, lists and factory, the Race's lanes, the Memory
tab's choices, the benchmark's contenders and the serving suite's modes are all read from these specs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

from ..notes import NoteKind
from .proposer import Proposer


@dataclass(frozen=True)
class Setting:
    """One field of an algorithm's parameters class as the command line and the app set it.

    help: what it does, with its range (the option's help, and the form field's note unless `note` is given); flag:
    the command-line option (default: --field with dashes); label: the form field's label (empty: the app does not
    show it, as a folder of weights); note: the form field's note where the help says what only the command line
    takes; switch: for a true/false field, the value its option stores (an option `--no-x` stores False); auto:
    the form's 0 (empty text for a text field) stands for None (the parameters class then chooses); choices: the
    values the form offers (the command line takes any the parameters class accepts)."""

    field: str
    help: str
    flag: str = ""
    label: str = ""
    note: str = ""
    kind: type = int
    switch: bool | None = None
    auto: bool = False
    choices: tuple[Any, ...] = ()  # values, or (label, value) pairs

    @property
    def option(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")


@dataclass(frozen=True)
class Variant:
    """A benchmark row of an algorithm besides its defaults: `suffix` names it (`<name>-<suffix>`), `changes` are
    its parameters that differ, `sampled` runs it at the bench's sampling temperature, `note` is added to its
    settings in the report."""

    suffix: str
    changes: dict[str, Any]
    sampled: bool = False
    note: str = ""


@dataclass(frozen=True)
class Algorithm:
    """An algorithm as every surface knows it.

    name: as --algo, traces and the registry name it; label: as the app lists it; title: its group of options;
    params: its frozen parameters class, whose __post_init__ checks every field (None: it takes none); proposer:
    (target, params or None, **loaded) -> its proposer; settings: its parameters as they are set; loads_draft: it
    runs a draft model the surfaces load (the app's draft panel, --draft with the target's device and dtype); ships:
    (target source) -> where its weights ship, None where none do (None: it needs none); grafts: prompt lookup's
    copies graft onto its trees; sources: the trace source labels of its proposals -> (who proposes, what its
    tokens are called); colour: its line in charts; example: a prompt that shows it at its best; peer: (its
    proposer) -> (the transformers feature doing the same, its generate() arguments), None where none does;
    variants: more benchmark rows; short: how the serving suite's modes name it; notes: the kinds of note its
    proposals carry in the trace (`playground.notes`), which the registry registers."""

    name: str
    label: str
    title: str
    params: type | None
    proposer: Callable[..., Proposer]
    settings: tuple[Setting, ...] = ()
    sources: dict[str, tuple[str, str]] | None = None
    colour: str = "#555555"
    example: str = ""
    loads_draft: bool = False
    ships: Callable[[str], str | None] | None = None
    grafts: bool = False
    peer: Callable[[Any], tuple[str, dict[str, Any]]] | None = None
    notes: tuple[type[NoteKind], ...] = ()
    variants: tuple[Variant, ...] = ()
    short: str = ""

    def default(self, setting: Setting) -> Any:
        """The parameters class's default of a setting's field."""
        assert self.params is not None
        found = next(f for f in fields(self.params) if f.name == setting.field)
        return None if found.default is MISSING else found.default

    def make(self, values: dict[str, Any]) -> Any:
        """The parameters from the fields given (the others at their defaults), checked by the class."""
        if self.params is None:
            return None
        return self.params(**values)

    @property
    def mode(self) -> str:
        return self.short or self.label
