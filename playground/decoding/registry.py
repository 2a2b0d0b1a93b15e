"""From settings to a proposer: the one place that lists every algorithm (`spec.Algorithm`, each defined in its own
module). Every surface (the command line, the app, the bench, the serving suite) reads this list when it is built,
so an algorithm registered here, or by `register` before a surface is built, appears in all of them."""

from __future__ import annotations

from typing import Any, cast

from ..config import ConfigError
from ..models import LoadedModel
from ..notes import register as register_notes
from ..notes import unregister as unregister_notes
from ..trace import PLAIN
from . import eagle, lookahead, medusa, prompt_lookup, rest, self_speculative, speculative
from .grafted import Grafted, GraftedTree
from .guesses import Guesser
from .prompt_lookup import CopyProposer, PromptLookupParams
from .proposer import Proposer
from .spec import Algorithm

# name -> algorithm; a new algorithm is one module and one line here
ALGORITHMS: dict[str, Algorithm] = {spec.name: spec for spec in (
    prompt_lookup.ALGORITHM,
    lookahead.ALGORITHM,
    medusa.ALGORITHM,
    speculative.ALGORITHM,
    eagle.ALGORITHM,
    rest.ALGORITHM,
    self_speculative.ALGORITHM,
)}
for _spec in ALGORITHMS.values():
    register_notes(*_spec.notes)


def register(spec: Algorithm) -> None:
    """Add an algorithm defined elsewhere (a plug-in, a test) to every surface built after this call."""
    if spec.name == PLAIN or spec.name in ALGORITHMS:
        raise ConfigError(f"algorithm {spec.name!r} is already registered")
    ALGORITHMS[spec.name] = spec
    register_notes(*spec.notes)


def unregister(name: str) -> None:
    """Remove an algorithm `register` added."""
    unregister_notes(*ALGORITHMS.pop(name).notes)


def algorithms() -> list[str]:
    """Every algorithm's name, plain decoding first."""
    return [PLAIN, *ALGORITHMS]


def find(name: str) -> Algorithm | None:
    """The registered algorithm of that name; None for plain decoding (or a name not registered)."""
    return ALGORITHMS.get(name)


def algorithm(name: str) -> Algorithm:
    """The registered algorithm of that name; plain decoding has none."""
    if name not in ALGORITHMS:
        raise ConfigError(f"algo must be one of {', '.join(algorithms())}, got {name!r}")
    return ALGORITHMS[name]


def build_proposer(target: LoadedModel, algo: str, params: Any = None, copies: PromptLookupParams | None = None,
                   **loaded: Any) -> Proposer | None:
    """The proposer of algorithm `algo` with its parameters (None: its defaults; plain decoding has none), with
    prompt lookup's copies grafted onto its trees where `copies` is set (for the algorithms whose spec `grafts`).
    `loaded`: weights already loaded, as a proposer's `loaded()` names them (`heads`, `draft`, `head`)."""
    if algo == PLAIN:
        if params is not None or copies is not None:
            raise ConfigError("plain decoding (ar) takes no proposer settings and no copies")
        return None
    spec = algorithm(algo)
    proposer = spec.proposer(target, params, **{key: value for key, value in loaded.items() if value is not None})
    if copies is None:
        return proposer
    if not spec.grafts:
        grafting = [name for name, other in ALGORITHMS.items() if other.grafts]
        raise ConfigError(f"copies: prompt lookup's copies graft onto the trees of {', '.join(grafting)}, not onto "
                          f"{algo}")
    copier = CopyProposer(target, copies)
    if isinstance(proposer, Guesser):
        return Grafted(proposer, copier)
    return GraftedTree(proposer, copier, cast(Any, proposer).nodes)  # a tree proposer states its most nodes
