"""Token-level HTML: every generated token coloured by the decision that produced it, hover text with its step,
p, q and the uniform draw, the legend, and the prompt with the prompt-lookup source span highlighted.

Renderers take trace events (a finished trace, or the events seen so far while a run streams), so live runs,
step replay and uploaded traces share one code path. Every piece of text is HTML-escaped.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass

from ..trace import AcceptEvent, BonusEvent, CommitEvent, CorrectEvent, DraftEvent, Event, RejectEvent, TokenInfo
from .palette import STATES, token_css


@dataclass(slots=True)
class TokenView:
    token: TokenInfo
    state: str  # a key of palette.STATES
    step: int
    u: float | None = None


def decision_of(event: AcceptEvent | RejectEvent | CorrectEvent | BonusEvent, proposed_steps: set[int]) -> str:
    """The palette state of a decided token. A bonus token in a step that proposed nothing is a plain target
    token ("generated"); only after a fully accepted proposal is it the extra "bonus" token."""
    if isinstance(event, BonusEvent):
        return "bonus" if event.step in proposed_steps else "generated"
    return {AcceptEvent: "accepted", RejectEvent: "rejected", CorrectEvent: "corrected"}[type(event)]


def token_views(events: Iterable[Event], upto_step: int | None = None, proposing: bool = False) -> list[TokenView]:
    """The tokens as they stood after `upto_step` (all steps when None): committed ones with their decision,
    plus the proposals of a step still being verified (pending) and the rejected ones (kept, struck through).
    proposing: as they stood between that step's proposal and its verdict (its proposal pending, "drafted").
    A proposal left undecided is shown as discarded where it stood behind a rejection (it hangs below the refused
    node); any other (a runner-up or a branch of a tree beside the kept path) lost to the token beside it and is
    dropped from the text; the step detail shows it."""
    views: list[TokenView] = []
    # (position, token id) -> proposal of the current step not yet judged
    pending: dict[tuple[int, int], TokenView] = {}
    nodes: list[tuple[TokenView, int]] = []  # the current step's proposal: node i + 1's view and its parent node
    proposed_steps: set[int] = set()
    for event in events:
        if upto_step is not None and event.step > upto_step:
            break
        if proposing and event.step == upto_step and not isinstance(event, DraftEvent):
            continue  # the step's verdict has not come yet
        if isinstance(event, DraftEvent):
            proposed_steps.add(event.step)
            for index, info in enumerate(event.tokens):
                view = TokenView(info, "pending", event.step)
                pending[info.position, info.id] = view
                views.append(view)
                nodes.append((view, index if info.parent is None else info.parent))
        elif isinstance(event, (AcceptEvent, RejectEvent)):
            decided = (event.token.position, event.token.id)
            judged = pending.pop(decided) if decided in pending else None
            if judged is None:  # a decision on a token the trace never proposed: show it rather than drop it
                judged = TokenView(event.token, "pending", event.step)
                views.append(judged)
            judged.state = decision_of(event, proposed_steps)
            judged.u = event.u
        elif isinstance(event, (CorrectEvent, BonusEvent)):
            views.append(TokenView(event.token, decision_of(event, proposed_steps), event.step))
        elif isinstance(event, CommitEvent):
            behind = {0: False}  # node -> whether it is a refused node or hangs below one
            for node, (view, parent) in enumerate(nodes, start=1):
                behind[node] = view.state == "rejected" or behind.get(parent, False)
                if view.state == "pending":
                    if behind[parent]:
                        view.state = "discarded"
                    else:
                        views.remove(view)
            pending.clear()
            nodes.clear()
    return views


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def hover_text(view: TokenView) -> str:
    info = view.token
    parts = [f"step {view.step}", STATES[view.state].label, f"token {info.id} {info.text!r}",
             f"p {_number(info.p)}"]
    if info.q is not None:
        parts.append(f"q {_number(info.q)}")
    if view.u is not None:
        parts.append(f"u {_number(view.u)}")
    return " · ".join(parts)


def _span(text: str, classes: str, title: str | None = None) -> str:
    shown = html.escape(text.replace("\n", "↵\n"), quote=True)
    title_attr = f' title="{html.escape(title, quote=True)}"' if title else ""
    return f'<span class="{classes}"{title_attr}>{shown}</span>'


COMMITTED = ("generated", "accepted", "corrected", "bonus")  # the states of tokens that are part of the text


def render_tokens(events: Iterable[Event], upto_step: int | None = None, proposing: bool = False) -> str:
    """The generated text as coloured token spans (HTML), and beside them, hidden unless a `pg-show-clean` class
    above shows it instead, the text alone: the committed tokens as the output has them. proposing: see
    `token_views`."""
    views = token_views(events, upto_step, proposing)
    spans = "".join(_span(v.token.text, f"pg-tok pg-{v.state}", hover_text(v)) for v in views)
    clean = html.escape("".join(v.token.text for v in views if v.state in COMMITTED))
    return (f'<style>{token_css()} .pg-clean {{ display: none; white-space: pre-wrap; }}</style>'
            f'<div class="pg-tokens">{spans}</div><div class="pg-clean">{clean}</div>')


def render_legend(states: Iterable[str] = tuple(STATES)) -> str:
    """The legend: each decision's token style beside its label, the meaning on hover."""
    items = "".join(f'<span>{_span(STATES[s].label, f"pg-tok pg-{s}", STATES[s].meaning)}</span>' for s in states)
    return f'<style>{token_css()}</style><div class="pg-legend">{items}</div>'


def render_prompt(prompt_tokens: list[str], source: tuple[int, int] | None = None) -> str:
    """The prompt token by token, with positions [start, end) highlighted as a prompt-lookup source span.

    Positions past the prompt (a source inside the generated text) highlight nothing here."""
    start, end = source if source else (-1, -1)
    spans = "".join(_span(text, "pg-tok pg-prompt pg-source" if start <= i < end else "pg-tok pg-prompt")
                    for i, text in enumerate(prompt_tokens))
    return f'<style>{token_css()}</style><div class="pg-tokens">{spans}</div>'
