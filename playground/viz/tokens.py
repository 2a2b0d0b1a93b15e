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


def tree_parents(draft: DraftEvent) -> list[int]:
    """Node i + 1's parent for each of a draft's tokens: its `parent`, or, where that is None (a chain), node i."""
    return [node if token.parent is None else token.parent for node, token in enumerate(draft.tokens)]


Verdict = AcceptEvent | RejectEvent


def judged_nodes(draft: DraftEvent | None, decisions: Iterable[Event]) -> list[tuple[int | None, Verdict]]:
    """The one reading of a step's verdicts: each accept or reject of the step, in order, with the draft node it
    judged (1-based; None where it judged no node the draft holds). The verifier walks from the last committed token
    (node 0) down the kept path, so a verdict judges a child of the last node kept: the first child holding its
    token, as the engine chose it. Matching by position and token alone would be ambiguous wherever two branches
    propose the same token at one depth."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree_parents(draft) if draft is not None else [], start=1):
        children.setdefault(parent, []).append(node)
    found: list[tuple[int | None, Verdict]] = []
    kept, lost = 0, False  # the last node kept; whether the walk has left the draft (a verdict matched no node)
    for event in decisions:
        if not isinstance(event, (AcceptEvent, RejectEvent)):
            continue
        child = None if lost or draft is None else next(
            (c for c in children.get(kept, []) if draft.tokens[c - 1].id == event.token.id), None)
        found.append((child, event))
        if child is None:
            lost = True
        elif isinstance(event, AcceptEvent):
            kept = child
    return found


def token_views(events: Iterable[Event], upto_step: int | None = None, proposing: bool = False) -> list[TokenView]:
    """The tokens as they stood after `upto_step` (all steps when None): committed ones with their decision,
    plus the proposals of a step still being verified (pending) and the rejected ones (kept, struck through).
    proposing: as they stood between that step's proposal and its verdict (its proposal pending, "drafted").
    A tree reads as text along its first children (its best guess at each place; a chain is all first children):
    before the verdict that line is shown drafted; after it, the kept path, the refused node and the first-child
    line below it (never judged, "discarded"). Every other node (a runner-up, a branch beside the kept path) is left
    out of the text; the step detail shows it. Linear in the events."""
    views: list[TokenView] = []
    proposed_steps: set[int] = set()
    step: list[Event] = []  # the current step's events, drawn when it ends

    def draw() -> None:
        draft = next((e for e in step if isinstance(e, DraftEvent)), None)
        nodes = [TokenView(info, "pending", draft.step) for info in draft.tokens] if draft is not None else []
        after: list[TokenView] = []  # tokens decided beyond the draft's nodes: corrections, bonuses, strays
        for node, event in judged_nodes(draft, step):
            if node is None:  # a verdict on a token the draft does not hold: show it rather than drop it
                after.append(TokenView(event.token, decision_of(event, proposed_steps), event.step, event.u))
            else:
                nodes[node - 1].state, nodes[node - 1].u = decision_of(event, proposed_steps), event.u
        after += [TokenView(e.token, decision_of(e, proposed_steps), e.step) for e in step
                  if isinstance(e, (CorrectEvent, BonusEvent))]
        if draft is not None:
            # a tree reads as text along first children: its best guess at each place (a chain is all of them)
            committed = any(isinstance(e, CommitEvent) for e in step)
            seen: set[int] = set()
            line = [True]  # node -> on the first-child line from the last token (before the verdict)
            behind = [False]  # node -> the refused node, or on the first-child line below it
            for node, (view, parent) in enumerate(zip(nodes, tree_parents(draft)), start=1):
                first = parent not in seen
                seen.add(parent)
                line.append(first and line[parent])
                behind.append(view.state == "rejected" or (first and behind[parent]))
                if view.state == "pending":  # not judged: in the text where it stood on its line, else left out
                    shown = behind[node] if committed else line[node]
                    view.state = ("discarded" if committed else "pending") if shown else ""
            nodes = [view for view in nodes if view.state]
        views.extend(nodes)
        views.extend(after)
        step.clear()

    for event in events:
        if upto_step is not None and event.step > upto_step:
            break
        if proposing and event.step == upto_step and not isinstance(event, DraftEvent):
            continue  # the step's verdict has not come yet
        if step and event.step != step[-1].step:
            draw()
        if isinstance(event, DraftEvent) and event.tokens:
            proposed_steps.add(event.step)
        step.append(event)
        if isinstance(event, CommitEvent):
            draw()
    if step:
        draw()
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


GUESSES = ("rejected", "discarded")  # guesses that are not part of the text


def branch_lines(draft: DraftEvent) -> list[tuple[list[int], list[int]]]:
    """A proposal tree as lines of text, one per leaf, best first: (the nodes it shares with the lines above, drawn
    as blank space so that it starts under its parent; its own nodes: where it branches off, then first children
    down to the leaf). A chain is one line."""
    parents = tree_parents(draft)
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents, start=1):
        children.setdefault(parent, []).append(node)
    lines = []
    for node, parent in enumerate(parents, start=1):
        if node > 1 and children[parent][0] == node:
            continue  # a first child continues its parent's line
        shared: list[int] = []
        while parent:
            shared.insert(0, parent)
            parent = parents[parent - 1]
        own = [node]
        while own[-1] in children:
            own.append(children[own[-1]][0])
        lines.append((shared, own))
    return lines


MAX_BRANCH_LINES = 6  # of a tree drawn in the text; the step detail below draws all of it


def render_branches(draft: DraftEvent) -> str:
    """A tree being verified, drawn where the text ends: its best line in the text, each other branch on a line
    below, starting under the token it branches from (a block that keeps its left edge at the text's end)."""
    def text(node: int) -> str:
        return draft.tokens[node - 1].text.replace("\n", "↵")

    def token(node: int) -> str:
        q = draft.tokens[node - 1].q
        return _span(text(node), "pg-tok pg-pending", None if q is None else f"drafted · q {q:.2f}")
    lines = branch_lines(draft)
    rows = [f'<span class="pg-branch">{"".join(_span(text(n), "pg-tok pg-blank") for n in shared)}'
            f'{"".join(token(n) for n in own)}</span>' for shared, own in lines[:MAX_BRANCH_LINES]]
    if len(lines) > MAX_BRANCH_LINES:
        more = len(lines) - MAX_BRANCH_LINES
        rows.append(f'<span class="pg-branch pg-more">+ {more} more branch{"es" if more > 1 else ""}: see the step '
                    f'detail</span>')
    return f'<span class="pg-branches">{"".join(rows)}</span>'


def render_tokens(events: Iterable[Event], upto_step: int | None = None, proposing: bool = False) -> str:
    """The generated text as coloured token spans (HTML), and beside them, hidden unless a `pg-show-clean` class
    above shows it instead, the text alone: the committed tokens as the output has them. The guesses earlier steps
    refused or never judged stay out of the line, so that it reads as text, unless a `pg-show-guesses` class above
    shows them; the latest step's stay in view. proposing: see `token_views`; a proposal with branches is drawn as
    they branch (`render_branches`). The panel stays scrolled to the text's end, where the latest step is."""
    events = list(events)
    views = token_views(events, upto_step, proposing)
    draft = next((e for e in events if isinstance(e, DraftEvent) and e.step == upto_step), None) if proposing else None
    tail = ""
    if draft is not None and len(branch_lines(draft)) > 1:
        views = [v for v in views if v.state != "pending"]
        tail = render_branches(draft)
    latest = max((v.step for v in views), default=0)
    spans = "".join(_span(v.token.text, f"pg-tok pg-{v.state}" + (" pg-past" if v.state in GUESSES and
                                                                     v.step < latest else ""), hover_text(v))
                    for v in views)
    clean = html.escape("".join(v.token.text for v in views if v.state in COMMITTED))
    return (f'<style>{token_css()} .pg-clean {{ display: none; white-space: pre-wrap; }} .pg-past {{ display: none; }}'
            f' .pg-show-guesses .pg-past {{ display: inline; }}</style>'
            f'<div class="pg-scroll"><div><div class="pg-tokens">{spans}{tail}</div>'
            f'<div class="pg-clean">{clean}</div></div></div>')


def render_legend(states: Iterable[str] = tuple(STATES)) -> str:
    """The legend: each decision's token style beside its label, the meaning on hover and, for a touch screen
    where nothing hovers, in a list that opens below it ("what they mean")."""
    states = list(states)
    items = "".join(f'<span>{_span(STATES[s].label, f"pg-tok pg-{s}", STATES[s].meaning)}</span>' for s in states)
    meanings = "".join(f'<li>{_span(STATES[s].label, f"pg-tok pg-{s}")}: {html.escape(STATES[s].meaning)}</li>'
                       for s in states)
    return (f'<style>{token_css()}</style><div class="pg-legend">{items}</div>'
            f'<details class="pg-legend-meanings"><summary>what they mean</summary><ul>{meanings}</ul></details>')


def render_prompt(prompt_tokens: list[str], source: tuple[int, int] | None = None) -> str:
    """The prompt token by token, with positions [start, end) highlighted as a prompt-lookup source span.

    Positions past the prompt (a source inside the generated text) highlight nothing here."""
    start, end = source if source else (-1, -1)
    spans = "".join(_span(text, "pg-tok pg-prompt pg-source" if start <= i < end else "pg-tok pg-prompt")
                    for i, text in enumerate(prompt_tokens))
    return f'<style>{token_css()}</style><div class="pg-tokens">{spans}</div>'
