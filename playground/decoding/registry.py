"""From settings to the engine's proposer: the one place that knows every algorithm's proposer by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import EngineParams
from ..models import LoadedModel
from ..models.medusa import LoadedHeads
from .guesses import Grafted, Guesser
from .lookahead import LookaheadProposer
from .medusa import MedusaGuesser
from .prompt_lookup import CopyProposer
from .proposer import Proposer
from .speculative import DraftGuesser

# algorithm name -> (target, its parameters) -> proposer; a new algorithm is one module and one line here
PROPOSERS: dict[str, Callable[[LoadedModel, Any], Proposer]] = {
    "prompt-lookup": CopyProposer,
    "lookahead": LookaheadProposer,
    "medusa": MedusaGuesser,
    "speculative": DraftGuesser,
}


def engine_proposer(target: LoadedModel, params: EngineParams, heads: LoadedHeads | None = None,
                    draft: LoadedModel | None = None) -> Proposer | None:
    """The proposer `params` names (None: plain decoding): lookahead alone, or the Medusa heads' or the draft's
    guesses with the copies of prompt lookup grafted on where `params.lookup` is set too. `heads`, `draft`: ones
    already loaded for `params.medusa`, `params.draft`."""
    if params.lookahead is not None:
        return PROPOSERS["lookahead"](target, params.lookahead)
    guesser: Guesser | None = None
    if params.medusa is not None:
        guesser = MedusaGuesser(target, params.medusa, heads)
    elif params.draft is not None:
        guesser = DraftGuesser(target, params.draft, draft)
    copies = None if params.lookup is None else PROPOSERS["prompt-lookup"](target, params.lookup)
    if guesser is not None and copies is not None:
        return Grafted(guesser, copies)
    return guesser or copies
