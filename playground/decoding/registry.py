"""From settings to a proposer: the one place that knows every algorithm's proposer by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import ConfigError, PromptLookupParams
from ..models import LoadedModel
from ..models.eagle import LoadedEagle
from ..models.medusa import LoadedHeads
from .eagle import EagleProposer
from .grafted import Grafted, GraftedTree
from .guesses import Guesser
from .lookahead import LookaheadProposer
from .medusa import MedusaGuesser
from .prompt_lookup import CopyProposer
from .proposer import Proposer
from .speculative import DraftGuesser

# algorithm name -> (target, its parameters or None for the defaults) -> proposer; a new algorithm is one module and
# one line here
PROPOSERS: dict[str, Callable[..., Proposer]] = {
    "prompt-lookup": CopyProposer,
    "lookahead": LookaheadProposer,
    "medusa": MedusaGuesser,
    "speculative": DraftGuesser,
    "eagle": EagleProposer,
}
PLAIN = "ar"  # plain decoding: no proposer


def algorithms() -> list[str]:
    """Every algorithm's name, plain decoding first."""
    return [PLAIN, *PROPOSERS]


def build_proposer(target: LoadedModel, algo: str, params: Any = None, copies: PromptLookupParams | None = None,
                   heads: LoadedHeads | None = None, draft: LoadedModel | None = None,
                   head: LoadedEagle | None = None) -> Proposer | None:
    """The proposer of algorithm `algo` with its parameters (None: its defaults; plain decoding has none), with
    prompt lookup's copies grafted onto its trees where `copies` is set (for the algorithms that guess a tree: Medusa,
    the draft model and EAGLE). `heads`, `draft`, `head`: ones already loaded for Medusa, the draft model, EAGLE."""
    if algo not in algorithms():
        raise ConfigError(f"algo must be one of {', '.join(algorithms())}, got {algo!r}")
    if algo == PLAIN:
        if params is not None or copies is not None:
            raise ConfigError("plain decoding (ar) takes no proposer settings and no copies")
        return None
    loaded = {name: value for name, value in (("heads", heads), ("draft", draft), ("head", head)) if value is not None}
    proposer = PROPOSERS[algo](target, params, **loaded)
    if copies is None:
        return proposer
    if isinstance(proposer, Guesser):
        return Grafted(proposer, CopyProposer(target, copies))
    if isinstance(proposer, EagleProposer):
        return GraftedTree(proposer, CopyProposer(target, copies), proposer.nodes)
    raise ConfigError(f"copies: prompt lookup's copies graft onto Medusa's, the draft's or EAGLE's trees, not onto "
                      f"{algo}")

