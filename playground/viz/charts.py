"""Plotly figures shared by the web app and the notebooks: per-step acceptance, tokens over engine time, the
speculative-decoding theory curves with measured points overlaid, and a forward's cost by width per weight format.
Colours come from the decision palette."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..metrics import expected_tokens_per_step
from ..trace import CommitEvent, Event
from .palette import STATES
from .steps import step_counts

LAYOUT = {"template": "plotly_white", "margin": {"l": 50, "r": 20, "t": 40, "b": 45}, "height": 320,
          "legend": {"orientation": "h", "y": -0.25}}


def steps_figure(events: Iterable[Event]) -> go.Figure:
    """Stacked bars per step: tokens accepted, the correction or bonus token (or the plain token of a step that
    proposed nothing), and rejections below zero."""
    counts = step_counts(events)
    steps = sorted(counts)
    fig = go.Figure()
    for kind in ("accepted", "corrected", "bonus", "generated", "rejected"):
        sign = -1 if kind == "rejected" else 1
        fig.add_bar(x=steps, y=[sign * counts[s].get(kind, 0) for s in steps], name=STATES[kind].label,
                    marker_color="#8c8c8c" if kind == "generated" else STATES[kind].colour,
                    marker_pattern_shape="/" if kind == "rejected" else "")
    fig.update_layout(barmode="relative", title="Tokens per step (rejections below zero)",
                      xaxis_title="step", yaxis_title="tokens", **LAYOUT)
    return fig


def tokens_time_series(events: Iterable[Event]) -> tuple[list[float], list[int]]:
    """(engine seconds, tokens committed so far) after each step."""
    times, totals, total = [0.0], [0], 0
    for event in events:
        if isinstance(event, CommitEvent):
            total += event.num_tokens
            times.append(event.t)
            totals.append(total)
    return times, totals


def tokens_time_figure(runs: dict[str, Iterable[Event]], lines: dict[str, dict[str, str]] | None = None,
                       remote: dict[str, tuple[list[float], list[float]]] | None = None) -> go.Figure:
    """Tokens committed against engine time, one line per run (a race draws several); `lines`: a run's line style
    (plotly's `color`, `dash`), where given; `remote`: (wall-clock seconds, tokens) of remote lanes, dotted."""
    fig = go.Figure()
    for name, events in runs.items():
        times, totals = tokens_time_series(events)
        fig.add_scatter(x=times, y=totals, mode="lines", line_shape="hv", name=name, line=(lines or {}).get(name))
    for name, (seconds, counts) in (remote or {}).items():
        fig.add_scatter(x=seconds, y=counts, mode="lines", line_shape="hv", name=name, line={"dash": "dot"})
    fig.update_layout(title="Tokens vs engine time", yaxis_title="tokens", **LAYOUT,
                      xaxis_title="seconds (engine time; dotted: a remote lane's wall clock)" if remote
                      else "seconds (engine time)")
    return fig


@dataclass(frozen=True, slots=True)
class MeasuredPoint:
    """One run that drafted: its mean draft length (a tree's: the nodes a step verified), measured acceptance a (of
    the tokens the target judged), tokens per target forward and speedup over plain decoding measured beside it
    (None where it was not). tree: whether it proposed trees, which the chain's formula does not describe."""

    label: str
    gamma: float
    acceptance: float
    tokens_per_forward: float
    speedup: float | None = None
    tree: bool = False


def expected_speedup(acceptance: float, gamma: int, cost_ratio: float, verify_cost: float = 0.0) -> float:
    """Leviathan et al. 2023: expected tokens per step over the step's cost in target forwards, gamma * c + 1.

    verify_cost v adds what each drafted token adds to the verifying forward (gamma * v): Leviathan et al. take a
    forward over gamma + 1 tokens to cost one over a single token, true where a step is bound by reading weights
    (a large model on a GPU); on a CPU, or where launches dominate, it is not (the benchmark's verify cost ratio
    measures it: 1 + gamma * v)."""
    return expected_tokens_per_step(acceptance, gamma) / (gamma * (cost_ratio + verify_cost) + 1)


def theory_figure(acceptance: float, gamma: int, cost_ratio: float,
                  measured: Iterable[MeasuredPoint] = (), verify_cost: float = 0.0,
                  ceiling: Sequence[float] | None = None) -> go.Figure:
    """Expected tokens per step and expected speedup against draft length, for the chosen a, c and v (and for
    a = 0.5, 0.8 as guides); the chosen g is marked, measured runs are overlaid (chains as diamonds, trees as
    squares). ceiling[g - 1]: the most any proposer of g tokens could reach on this machine's forward-cost curve,
    every token kept and drafting free, (g + 1) / cost(g + 1)."""
    gammas = list(range(1, 17))
    # each panel named by its y axis, not a title above it: two titles side by side overlap on a phone
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.14)
    for a, dash in ((acceptance, "solid"), (0.5, "dot"), (0.8, "dash")):
        if dash != "solid" and abs(a - acceptance) < 1e-9:
            continue
        name = f"a = {a:.2f}" + (" (chosen)" if dash == "solid" else "")
        fig.add_scatter(x=gammas, y=[expected_tokens_per_step(a, g) for g in gammas], name=name,
                        line={"dash": dash, "color": STATES["accepted"].colour if dash == "solid" else "#8c8c8c"},
                        legendgroup=name, row=1, col=1)
        fig.add_scatter(x=gammas, y=[expected_speedup(a, g, cost_ratio, verify_cost) for g in gammas], name=name,
                        line={"dash": dash, "color": STATES["bonus"].colour if dash == "solid" else "#8c8c8c"},
                        legendgroup=name, showlegend=False, row=1, col=2)
    fig.add_scatter(x=[gamma], y=[expected_tokens_per_step(acceptance, gamma)], mode="markers", name="chosen g",
                    marker={"size": 12, "symbol": "circle-open", "color": "#1f2328"}, row=1, col=1)
    fig.add_scatter(x=[gamma], y=[expected_speedup(acceptance, gamma, cost_ratio, verify_cost)], mode="markers",
                    marker={"size": 12, "symbol": "circle-open", "color": "#1f2328"}, showlegend=False,
                    row=1, col=2)
    if ceiling is not None:
        fig.add_scatter(x=gammas, y=list(ceiling[: len(gammas)]), name="ceiling on this machine's curve", mode="lines",
                        line={"dash": "dashdot", "color": "#1f2328"}, row=1, col=2,
                        hovertemplate="g = %{x}: at most %{y:.2f}x (every token kept, drafting free)<extra></extra>")
    for tree, symbol, name in ((False, "diamond", "measured chains"), (True, "square", "measured trees")):
        points = [p for p in measured if p.tree == tree]
        if not points:
            continue
        marker = {"size": 10, "symbol": symbol, "color": STATES["corrected"].colour}
        fig.add_scatter(x=[p.gamma for p in points], y=[p.tokens_per_forward for p in points], mode="markers",
                        name=name + " (this session)", marker=marker, legendgroup=name,
                        text=[f"{p.label}: a = {p.acceptance:.2f}" for p in points], row=1, col=1)
        timed = [p for p in points if p.speedup is not None]
        fig.add_scatter(x=[p.gamma for p in timed], y=[p.speedup for p in timed], mode="markers", marker=marker,
                        legendgroup=name, text=[p.label for p in timed], showlegend=False, row=1, col=2)
    fig.add_hline(y=1, line={"dash": "dot", "color": "#8c8c8c"}, row=1, col=2)
    fig.update_xaxes(title_text="draft length g")
    fig.update_yaxes(title_text="tokens per forward", row=1, col=1)
    fig.update_yaxes(title_text="speedup vs plain", row=1, col=2)
    fig.update_layout(**{**LAYOUT, "height": 360, "title": "Expected, in theory"})
    return fig


def width_cost_figure(curves: dict[str, Any]) -> go.Figure:
    """What a forward over T new tokens costs in one-token forwards, one line per weight format: `curves` maps a
    label to this machine's measured curve (decoding/costs.py: `ForwardCosts`), read at the widths measured."""
    fig = go.Figure()
    for (label, costs), colour in zip(curves.items(), (STATES["accepted"].colour, STATES["bonus"].colour,
                                                       STATES["corrected"].colour)):
        seconds = [costs.time(t) for t in costs.tokens]
        fig.add_scatter(x=list(costs.tokens), y=[s / seconds[0] for s in seconds], name=label, mode="lines+markers",
                        line={"color": colour}, text=[f"{1e3 * s:.1f} ms" for s in seconds],
                        hovertemplate="%{x} tokens: %{y:.2f} one-token forwards (%{text})<extra>" + label + "</extra>")
    fig.add_hline(y=1, line={"dash": "dot", "color": "#8c8c8c"})
    fig.update_xaxes(title_text="new tokens in the forward (T)")
    fig.update_yaxes(title_text="cost (one-token forwards)")
    fig.update_layout(**{**LAYOUT, "title": "What a wider forward costs, by the weights it reads"})
    return fig
