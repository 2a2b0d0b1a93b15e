"""Per-step views of a trace: the decision counts of every step (the bar chart and the step table share them),
the step table, and the detail of one step: what was proposed, what its algorithm's note says of it (a copied
span, a datastore's match, a Jacobi window: `playground.notes`), and a proposal tree."""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import replace

from ..metrics import branched
from ..notes import TokenText, ngram_html, said
from ..trace import (
    AcceptEvent,
    BonusEvent,
    CommitEvent,
    CorrectEvent,
    DraftEvent,
    Event,
    RejectEvent,
    VerifyEvent,
)
from .palette import token_css
from .tokens import decision_of, judged_nodes, tree_parents

STEP_HEADERS = ["step", "proposed", "accepted", "rejected", "corrected", "bonus", "generated", "committed",
                "target tokens", "draft ms", "verify ms"]


def step_counts(events: Iterable[Event]) -> dict[int, dict[str, int]]:
    """For every step after the prefill: tokens per decision state (palette names) and proposals ("proposed")."""
    counts: dict[int, dict[str, int]] = {}
    proposed: set[int] = set()
    for event in events:
        if event.step == 0:
            continue
        if isinstance(event, DraftEvent) and event.tokens:
            proposed.add(event.step)
            step = counts.setdefault(event.step, {})
            step["proposed"] = step.get("proposed", 0) + len(event.tokens)
        elif isinstance(event, (AcceptEvent, RejectEvent, CorrectEvent, BonusEvent)):
            kind = decision_of(event, proposed)
            step = counts.setdefault(event.step, {})
            step[kind] = step.get(kind, 0) + 1
    return counts


def step_rows(events: Iterable[Event]) -> list[list[int | float]]:
    """One row per step (STEP_HEADERS): decisions, tokens committed, tokens through the target, times in ms."""
    events = list(events)
    counts = step_counts(events)
    verified = {e.step: e.num_tokens for e in events if isinstance(e, VerifyEvent)}
    rows = []
    for commit in (e for e in events if isinstance(e, CommitEvent) and e.step > 0):
        c = counts.get(commit.step, {})
        rows.append([commit.step, *(c.get(k, 0) for k in STEP_HEADERS[1:7]), commit.num_tokens,
                     verified.get(commit.step, 0), round(1000 * commit.draft_s, 2), round(1000 * commit.verify_s, 2)])
    return rows


def detail_css() -> str:
    return (".pg-detail{font-size:0.85rem;}.pg-detail table{border-collapse:collapse;margin:0.3rem 0;}"
            ".pg-detail td,.pg-detail th{padding:1px 4px;border:1px solid var(--border-color-primary,#d0d7de);"
            "font-family:ui-monospace,monospace;white-space:pre;}"
            ".pg-cell{font-family:ui-monospace,monospace;white-space:pre;padding:0 2px;}"
            ".pg-ngram{display:inline-block;border:1px solid #c9ccd1;border-radius:4px;margin:1px 3px;}"
            ".pg-ngram.pg-verified{border:2px solid #009E73;}"
            ".pg-tree,.pg-tree ul{list-style:none;margin:0;padding-left:1.1rem;border-left:1px dotted #c9ccd1;}"
            ".pg-tree{padding-left:0.3rem;}.pg-tree li{margin:1px 0;white-space:nowrap;}"
            ".pg-tree .pg-meta{color:#6e6e6e;font-size:0.75rem;margin-left:0.3rem;}")


def texts_of(draft: DraftEvent) -> TokenText:
    """Token id -> text as the draft event recorded it (an id it does not hold shows as #id)."""
    texts = {t.id: t.text for t in draft.tokens}
    return lambda token: texts.get(token, f"#{token}")


def draft_paths(draft: DraftEvent) -> list[list[int]]:
    """Every path a draft verifies, from the last committed token to each of its tokens, as token ids: a chain's
    prefixes, or a tree's root-to-node paths."""
    paths: list[list[int]] = [[]]
    for token, parent in zip(draft.tokens, tree_parents(draft)):
        paths.append(paths[parent] + [token.id])
    return paths[1:]


def render_draft_tree(draft: DraftEvent, decisions: list[Event], proposing: bool = False) -> str:
    """A proposal tree as its draft event carries it (token i + 1 follows token `parent`, 0 the last committed
    token; None: the token before it), with the texts the trace recorded: the path the target kept in the accepted
    style, the node it refused there struck through, every other node not judged; q the proposal's probability,
    p the target's where it judged the node. proposing: before the verdict, every node in the drafted style."""
    undecided = "pending" if proposing else "discarded"
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree_parents(draft), start=1):
        children.setdefault(parent, []).append(node)
    states: dict[int, str] = {}
    judged: dict[int, float | None] = {}
    for at, event in judged_nodes(draft, decisions):  # the kept path from the root, then the refusal at its end
        if at is not None:
            states[at] = "accepted" if isinstance(event, AcceptEvent) else "rejected"
            judged[at] = event.token.p

    def branch(parent: int) -> str:
        items = []
        for node in children.get(parent, []):
            token = draft.tokens[node - 1]
            meta = [f"q {token.q:.2f}"] if token.q is not None else []
            meta += [f"p {judged[node]:.2f}"] if judged.get(node) is not None else []
            items.append(f'<li><span class="pg-tok pg-{states.get(node, undecided)}">'
                         f'{html.escape(repr(token.text)[1:-1])}</span><span class="pg-meta">{" · ".join(meta)}</span>'
                         f'{branch(node)}</li>')
        return f"<ul>{''.join(items)}</ul>" if items else ""
    kept = sum(state == "accepted" for state in states.values())
    outcome = "being verified" if proposing else f"{kept} accepted"
    return (f"<div>Proposal tree ({len(draft.tokens)} nodes, {outcome}; q: proposal probability, p: target "
            f"probability):</div><div class='pg-tree'><span class='pg-tok'>last token</span>{branch(0)}</div>")


def render_step_detail(events: Iterable[Event], step: int | None = None, token_text: TokenText | None = None,
                       proposing: bool = False) -> str:
    """What one step (the last when None) proposed, what its algorithm's note says of it (`notes.said`) and how it
    went. Token ids are shown as text when a tokenizer's `token_text` is given (a replayed trace without a model
    shows ids). proposing: the step before its verdict (what it proposed, being verified)."""
    events = list(events)
    if step is None:
        step = max((e.step for e in events), default=0)
    mine = [e for e in events if e.step == step and (not proposing or isinstance(e, DraftEvent))]
    parts = [f"<style>{token_css()}{detail_css()}</style><div class='pg-detail'><b>step {step}</b>: "]
    draft = next((e for e in mine if isinstance(e, DraftEvent)), None)
    commit = next((e for e in mine if isinstance(e, CommitEvent)), None)
    verdicts = sum(isinstance(e, AcceptEvent) for e in mine), sum(isinstance(e, RejectEvent) for e in mine)
    note = None
    if draft is None or not draft.tokens:
        parts.append("nothing proposed")
    if draft is not None:
        if token_text is None:  # a trace carries each proposed token's text: show it rather than ids
            token_text = texts_of(draft)
        note = said(draft, token_text)
        if not note.origin and draft.draft_forwards:
            note = replace(note, origin=f" by {draft.draft_forwards} draft forward(s)")
    if draft is not None and draft.tokens:
        assert note is not None and token_text is not None
        verdict = "being verified..." if proposing else f"{verdicts[0]} accepted, {verdicts[1]} rejected"
        if branched(draft):
            parts.append(f"proposed a tree of {len(draft.tokens)} tokens{note.origin}; {verdict}")
        else:
            chain = [t.id for i, t in enumerate(draft.tokens) if not draft.is_sibling(i)]
            siblings = [t.id for i, t in enumerate(draft.tokens) if draft.is_sibling(i)]
            if note.beside is not None:  # the note names them (prompt lookup's further copies)
                label = note.beside[0] if len(siblings) == 1 else note.beside[1].format(n=len(siblings))
            else:  # a draft model's runner-up, or the heads' other guesses for that place
                label = ("the draft's " if draft.draft_forwards else "") + (
                    "runner-up" if len(siblings) == 1 else "runners-up")
            beside = f"; beside its first token {label} {ngram_html(siblings, token_text)}" if siblings else ""
            parts.append(f"proposed {ngram_html(chain, token_text)}{note.origin}{beside}; {verdict}")
    if commit is not None:
        parts.append(f"; {commit.num_tokens} token(s) committed (draft {1000 * commit.draft_s:.1f} ms, "
                     f"verify {1000 * commit.verify_s:.1f} ms)")
    if note is not None:
        parts.append(note.block)
    if draft is not None and branched(draft):
        parts.append(render_draft_tree(draft, mine, proposing))
    parts.append("</div>")
    return "".join(parts)
