"""Every registered algorithm's settings as form fields (`spec.Setting`s with a label), the proposer a form's values
make, and the entrants the Race and the Memory tab offer: all read from the registry when a tab is built, so an
algorithm registered before the app is built appears in every tab with its fields."""

from __future__ import annotations

import inspect
import itertools
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gradio as gr

from ..config import MAX_GAMMA, MAX_NGRAM, ConfigError, check_int
from ..decoding import registry
from ..decoding.prompt_lookup import PromptLookupParams
from ..decoding.proposer import Proposer
from ..decoding.spec import Setting
from ..models import LoadedModel
from .models import get_draft

PLAIN_LABEL = "plain (autoregressive)"
COPIES = "copies"  # the group of the copy fields, shown for the algorithms that graft copies
COPY_SETTINGS = (
    Setting("copy_ngram", "add copies of earlier text matching the last 1..N tokens to the tree",
            label=f"copy n-gram (0 = off, 1..{MAX_NGRAM})"),
    Setting("copy_tokens", "most tokens a copy proposes (auto: as prompt lookup's)",
            label=f"copy tokens (0 = auto, 1..{MAX_GAMMA})", auto=True),
)


def labels() -> dict[str, str]:
    """The app's algorithm choices -> registry names, plain decoding first."""
    return {PLAIN_LABEL: registry.PLAIN, **{spec.label: name for name, spec in registry.ALGORITHMS.items()}}


# the Sampling fields' names in code -> what the form calls them
SAMPLING_LABELS = {"max_new_tokens": "max new tokens", "temperature": "temperature", "top_k": "top-k",
                   "top_p": "top-p", "seed": "seed"}


def in_labels(message: str, algo: str | None = None) -> str:
    """A settings error as a visitor reads it: the field it opens with (a parameters class names its field in code)
    called as the form labels it, for the Sampling fields, the copy fields and algorithm `algo`'s fields."""
    settings = [*(registry.ALGORITHMS[algo].settings if algo in registry.ALGORITHMS else ()), *COPY_SETTINGS]
    names = {**SAMPLING_LABELS, **{s.field: s.label.split(" (")[0] for s in settings if s.label}}
    field = re.match(r"(\w+)(?=[ :])", message)
    if field is None or field.group(1) not in names:
        return message
    return names[field.group(1)] + message[field.end():]


def as_int(name: str, value: Any) -> int:
    """Gradio numbers arrive as floats (or None): whole numbers pass, anything else is an error naming the field."""
    if value is None or value == "":  # the browser sends an empty field, or one it cannot read (Infinity), as null
        raise ConfigError(f"{name}: a whole number is required (the field is empty or holds no finite number)")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, got {value!r}") from None
    if number != int(number):
        raise ConfigError(f"{name} must be a whole number, got {value}")
    return int(number)


def as_float(name: str, value: Any) -> float:
    """A Gradio number as a float; an empty field is an error naming it (ranges are the dataclasses' to check)."""
    if value is None or value == "":  # the browser sends an empty field, or one it cannot read (Infinity), as null
        raise ConfigError(f"{name}: a number is required (the field is empty or holds no finite number)")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None


def _choices(setting: Setting) -> list[Any]:
    return [c[1] if isinstance(c, tuple) else c for c in setting.choices]


def read(setting: Setting, value: Any) -> Any:
    """A field's value as its parameters class takes it; an auto field's 0 (or empty text) is None (the class's
    default)."""
    name = setting.field
    if setting.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if setting.kind is int:
        number = as_int(name, value)
        return None if setting.auto and number == 0 else number
    if setting.kind is float:
        return as_float(name, value)
    if setting.choices and value not in _choices(setting):
        raise ConfigError(f"{name} must be one of {', '.join(map(str, _choices(setting)))}, got {value!r}")
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be text, got {value!r}")
    return None if setting.auto and not value.strip() else value


def layout() -> list[tuple[str, Setting, Any]]:
    """Every field in the form's order: (its algorithm's name, or COPIES; its setting; its starting value, the
    parameters' default, an auto field's None as 0 or empty text); an algorithm's switches after its other fields."""
    fields = [(name, setting, spec.default(setting)) for name, spec in registry.ALGORITHMS.items()
              for setting in sorted(spec.settings, key=lambda setting: setting.kind is bool) if setting.label]
    fields += [(COPIES, setting, 0) for setting in COPY_SETTINGS]
    return [(owner, setting, _unset(setting) if value is None and setting.auto else value)
            for owner, setting, value in fields]


def _unset(setting: Setting) -> Any:
    """How an auto field shows None: 0, or empty text."""
    return "" if setting.kind is str else 0


def _field(setting: Setting, default: Any) -> gr.Component:
    """The form field of a setting, at its parameters' default (an auto field's None shows as 0)."""
    info = setting.note or setting.help
    if setting.kind is bool:
        return gr.Checkbox(bool(default), label=setting.label, info=info, min_width=140)
    if setting.choices:
        make = gr.Radio if len(setting.choices) <= 3 else gr.Dropdown
        return make(list(setting.choices), value=default, label=setting.label, info=info, min_width=200)
    if setting.kind in (int, float):
        return gr.Number(default, label=setting.label, info=info, step=1 if setting.kind is int else 0.01,
                         min_width=160)
    return gr.Textbox(default or "", label=setting.label, info=info, min_width=200)


@dataclass
class Form:
    """The algorithm settings of a tab: one group of fields per algorithm with shown settings (and one for the
    copies), each visible while its algorithm is chosen. `fields` are the components in the order a handler takes
    their values (`taking`)."""

    groups: dict[str, gr.Group]
    owners: list[tuple[str, Setting]]  # per field: its algorithm (or COPIES) and its setting
    fields: list[gr.Component]

    @classmethod
    def build(cls, chosen: str) -> Form:
        """The fields, inside the current Blocks context; `chosen` is the algorithm label shown first."""
        algo = labels().get(chosen)
        groups, owners, fields = {}, [], []
        for owner, shown in itertools.groupby(layout(), key=lambda field: field[0]):
            with gr.Group(visible=_shows(owner, algo)) as group:
                # numbers and choices in one row, switches in the next (a switch beside a number is cramped)
                for _, row in itertools.groupby(shown, key=lambda field: field[1].kind is bool):
                    with gr.Row():
                        for _, setting, value in row:
                            fields.append(_field(setting, value))
                            owners.append((owner, setting))
            groups[owner] = group
        return cls(groups, owners, fields)

    def visibility(self, chosen: str) -> list[dict[str, Any]]:
        """The groups' visibility for the chosen algorithm's label, in `groups` order."""
        algo = labels().get(chosen)
        return [gr.update(visible=_shows(owner, algo)) for owner in self.groups]

    def settings(self, algo: str, values: Sequence[Any]) -> tuple[Any, PromptLookupParams | None]:
        """The parameters (None for plain decoding) and grafted copies (None: none) the fields give for `algo`,
        each checked by its class; the other algorithms' fields are not read."""
        if len(values) != len(self.owners):
            raise ConfigError(f"settings: expected {len(self.owners)} field values, got {len(values)}")
        if algo == registry.PLAIN:
            return None, None
        spec = registry.algorithm(algo)
        given = {setting.field: read(setting, value) for (owner, setting), value in zip(self.owners, values)
                 if owner == algo}
        params = spec.make({key: value for key, value in given.items() if value is not None})
        copies = None
        if spec.grafts:
            copy = {setting.field: read(setting, value) for (owner, setting), value in zip(self.owners, values)
                    if owner == COPIES}
            check_int("copy_ngram", copy["copy_ngram"], 0, MAX_NGRAM)
            if copy["copy_tokens"] is not None:
                check_int("copy_tokens", copy["copy_tokens"], 0, MAX_GAMMA)
            if copy["copy_ngram"]:
                copies = PromptLookupParams(max_ngram=copy["copy_ngram"], num_draft=copy["copy_tokens"], branches=1)
        return params, copies


def _shows(owner: str, algo: str | None) -> bool:
    if owner == COPIES:
        spec = registry.find(algo) if algo is not None else None
        return spec is not None and spec.grafts
    return owner == algo


def make_proposer(target: LoadedModel, algo: str, params: Any = None, copies: PromptLookupParams | None = None,
                  draft_source: str = "") -> Proposer | None:
    """The proposer of `algo` (None: plain decoding), with the panel's draft (or the shipped one) where it runs
    one."""
    draft = None
    if algo != registry.PLAIN and registry.algorithm(algo).loads_draft:
        draft = get_draft(target, draft_source)
    return registry.build_proposer(target, algo, params, copies, draft=draft)


@dataclass(frozen=True)
class Entrant:
    """A Race lane or a Memory tab proposal: an algorithm at its defaults, maybe with copies grafted."""

    algo: str
    copies: PromptLookupParams | None = None
    kv: str = "contiguous"


RACE_COPIES = PromptLookupParams(max_ngram=3, branches=1)  # the copies a "+ prompt copies" entrant grafts


def entrants(plus: str) -> dict[str, Entrant]:
    """Every registered algorithm at its defaults by its label, and `<label> + <plus>` with copies grafted where it
    takes them."""
    found: dict[str, Entrant] = {}
    for name, spec in registry.ALGORITHMS.items():
        found[spec.label] = Entrant(name)
        if spec.grafts:
            found[f"{spec.label} + {plus}"] = Entrant(name, RACE_COPIES)
    return found


PLAIN_COLOUR = "#1f2328"


def line(entrant: Entrant) -> dict[str, str]:
    """An entrant's line in charts: its algorithm's colour (plain decoding's near black), dashed with copies."""
    spec = registry.find(entrant.algo)
    colour = PLAIN_COLOUR if spec is None else spec.colour
    return {"color": colour, "dash": "dash" if entrant.copies is not None or entrant.kv == "paged" else "solid"}


def source_names() -> dict[str, tuple[str, str]]:
    """Every trace source label -> (who proposes, what its tokens are called)."""
    return {source: named for spec in registry.ALGORITHMS.values() for source, named in (spec.sources or {}).items()}


@dataclass(frozen=True)
class Filled:
    """A form's field values as one run received them."""

    form: Form
    values: list[Any]

    def settings(self, algo: str) -> tuple[Any, PromptLookupParams | None]:
        """`Form.settings` of these values."""
        return self.form.settings(algo, self.values)


def taking(fn: Callable, form: Form) -> Callable:
    """`fn` as a Gradio handler that takes the form's field values, one input each, in place of its parameter
    `settings` (a `Filled`). Gradio passes inputs by position and finds `gr.Request` by a parameter's annotation, so the
    handler states a signature with one parameter per field; it keeps `fn`'s name (the app's GPU wrapper reads it)."""
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    at, count = [p.name for p in params].index("settings"), len(form.fields)
    named = [inspect.Parameter(f"field_{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD) for i in range(count)]

    def split(args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (*args[:at], Filled(form, list(args[at : at + count])), *args[at + count :])

    if inspect.isgeneratorfunction(fn):
        def handler(*args: Any, **kwargs: Any) -> Any:
            yield from fn(*split(args), **kwargs)
    else:
        def handler(*args: Any, **kwargs: Any) -> Any:
            return fn(*split(args), **kwargs)
    handler.__signature__ = signature.replace(parameters=[*params[:at], *named, *params[at + 1 :]])  # type: ignore
    handler.__annotations__ = {k: v for k, v in typing.get_type_hints(fn).items() if k != "settings"}
    handler.__name__ = handler.__qualname__ = fn.__name__
    handler.__doc__ = fn.__doc__
    return handler


def named(label: str) -> str:
    """The registry name of the algorithm a label names; an unknown label is an error naming it."""
    choices = labels()
    if label not in choices:
        raise ConfigError(f"algorithm must be one of {', '.join(choices)}, got {label!r}")
    return choices[label]
