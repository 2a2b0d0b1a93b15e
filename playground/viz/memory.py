"""The paged KV pool drawn from the engine's memory events: a block map (each block coloured by the request that
holds it, shared prefix blocks hatched, free blocks empty) and memory over engine time, paged versus what a
contiguous cache reserving prompt + max_new_tokens per request would hold, with preemptions marked."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping

import plotly.graph_objects as go

from ..trace import Event, MemoryEvent, PreemptEvent
from .charts import LAYOUT

# Request colours: a qualitative set kept apart from the decision palette's meanings (requests are identities,
# not decisions); the request number is written in every block, so colour is never the only cue.
REQUEST_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f",
                   "#e15759", "#8cd17d", "#86bcb6", "#d4a6c8", "#a0cbe8", "#ffbe7d", "#bab0ac", "#79706e")
STATUS_MARK = {"running": "▶", "waiting": "…", "finished": "✓", "aborted": "✗"}


def request_colour(request_id: int) -> str:
    return REQUEST_COLOURS[request_id % len(REQUEST_COLOURS)]


def memory_css() -> str:
    return (".pg-blocks{display:flex;flex-wrap:wrap;gap:2px;}"
            ".pg-block{width:1.35rem;height:1.35rem;border-radius:3px;font:600 0.6rem/1.35rem ui-monospace,monospace;"
            "text-align:center;color:#fff;}"
            ".pg-block-free{background:transparent;outline:1px solid #c9ccd1;outline-offset:-1px;}"
            ".pg-block-shared{background-image:repeating-linear-gradient(45deg,rgba(255,255,255,.55) 0 2px,"
            "transparent 2px 5px);outline:2px solid #1f2328;outline-offset:-2px;}"
            ".pg-requests{display:flex;flex-wrap:wrap;gap:0.3rem 0.8rem;font-size:0.85rem;margin-top:0.4rem;}"
            ".pg-swatch{display:inline-block;width:0.8rem;height:0.8rem;border-radius:2px;margin-right:0.25rem;"
            "vertical-align:-0.1rem;}")


def statuses_at(event: MemoryEvent, request_ids: list[int]) -> dict[int, str]:
    """Every request's status after a step: all are queued at the start, so one neither running nor waiting
    has finished."""
    running, waiting = set(event.running), set(event.waiting)
    return {rid: "running" if rid in running else "waiting" if rid in waiting else "finished"
            for rid in request_ids}


def render_block_map(event: MemoryEvent | None, statuses: Mapping[int, str] | None = None) -> str:
    """The pool after one step: a cell per physical block; below, each request's colour and status."""
    if event is None:
        return f"<style>{memory_css()}</style><div class='pg-blocks'></div>"
    shared = set(event.shared)
    cells = []
    for block, owner in enumerate(event.owners):
        if owner < 0:
            cells.append(f'<div class="pg-block pg-block-free" title="block {block}: free"></div>')
            continue
        note = ", shared by several requests (prefix cache)" if block in shared else ""
        classes = "pg-block pg-block-shared" if block in shared else "pg-block"
        cells.append(f'<div class="{classes}" style="background-color:{request_colour(owner)}" '
                     f'title="block {block}: request {owner}{note}">{owner}</div>')
    chips = "".join(f'<span><span class="pg-swatch" style="background:{request_colour(rid)}"></span>'
                    f'request {rid} {STATUS_MARK.get(status, "")} {html.escape(status)}</span>'
                    for rid, status in sorted((statuses or {}).items()))
    used = event.blocks_used
    head = (f"<div class='pg-blocks-head'>step {event.step}: {used} of {event.blocks_total} blocks in use "
            f"({event.block_size} tokens each), {len(shared)} shared; hatched = shared prefix block, "
            f"empty = free</div>")
    return (f"<style>{memory_css()}</style>{head}<div class='pg-blocks'>{''.join(cells)}</div>"
            f"<div class='pg-requests'>{chips}</div>")


def memory_figure(events: Iterable[Event]) -> go.Figure:
    """KV bytes over engine time: tokens stored, blocks reserved by the pool, and the contiguous reservation."""
    events = list(events)
    memory = [e for e in events if isinstance(e, MemoryEvent)]
    preempts = [e for e in events if isinstance(e, PreemptEvent)]
    times = [e.t for e in memory]
    fig = go.Figure()
    for name, values, style in (
            ("contiguous reservation", [e.contiguous_bytes for e in memory], {"color": "#b34700", "dash": "dash"}),
            ("paged: blocks reserved", [e.bytes_reserved for e in memory], {"color": "#0072B2"}),
            ("paged: tokens stored", [e.bytes_used for e in memory], {"color": "#009E73"})):
        # a point is the pool a step's forward held, at the step's end: it held that over the step, hence "vh"
        fig.add_scatter(x=times, y=[v / 2**20 for v in values], mode="lines", line_shape="vh", name=name,
                        line=style)
    if preempts:
        fig.add_scatter(x=[e.t for e in preempts], y=[0] * len(preempts), mode="markers", name="preemption",
                        marker={"symbol": "x", "size": 11, "color": "#1f2328"},
                        text=[f"request {e.seq} preempted" for e in preempts], hoverinfo="text+x")
    fig.update_layout(title="KV memory over engine time", xaxis_title="seconds (engine time)", yaxis_title="MiB",
                      **LAYOUT)
    return fig
