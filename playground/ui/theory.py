"""The Theory tab: expected tokens per step and expected speedup of speculative decoding against draft length,
from sliders for acceptance a, draft length g and cost ratio c, with this session's measured runs overlaid."""

from __future__ import annotations

from typing import Any

import gradio as gr

from ..config import MAX_GAMMA, ConfigError
from ..metrics import expected_tokens_per_step
from ..viz.charts import MeasuredPoint, expected_speedup, theory_figure


def measured_points(history: list[dict[str, Any]] | None) -> list[MeasuredPoint]:
    """Speculative runs of this session; speedup against the latest plain run of the same prompt, if any."""
    points, plain = [], {}
    for run in history or []:
        if run["algo"] == "ar":
            plain[run["prompt"]] = run["tokens_per_s"]
        elif run["algo"] == "speculative" and run["mean_draft"] and run["token_acceptance"] is not None:
            base = plain.get(run["prompt"])
            points.append(MeasuredPoint(f"run {len(points) + 1}", run["mean_draft"], run["token_acceptance"],
                                        run["mean_accepted"], run["tokens_per_s"] / base if base else None))
    return points


def update(acceptance: Any, gamma: Any, cost_ratio: Any, history: list[dict[str, Any]] | None):
    try:
        a, c = float(acceptance), float(cost_ratio)
        if not 0 <= a <= 1:
            raise ConfigError(f"acceptance a must be in [0, 1], got {acceptance}")
        if not 0 <= c <= 2:
            raise ConfigError(f"cost ratio c must be in [0, 2], got {cost_ratio}")
        g = int(gamma)
        if g != float(gamma) or not 1 <= g <= MAX_GAMMA:
            raise ConfigError(f"draft length g must be a whole number in [1, {MAX_GAMMA}], got {gamma}")
    except (TypeError, ValueError) as exc:
        raise gr.Error(str(exc)) from exc
    summary = (f"With a = {a:.2f}, g = {g}, c = {c:.2f}: **{expected_tokens_per_step(a, g):.2f} tokens per target "
               f"forward**, expected speedup **{expected_speedup(a, g, c):.2f}x** (tokens per step / (g c + 1)).")
    return theory_figure(a, g, c, measured_points(history)), summary


def build_tab(app: gr.Blocks, history: gr.State) -> None:
    gr.Markdown("Each of g drafted tokens is accepted with probability a, independently: a step yields "
                "(1 - a^(g+1)) / (1 - a) tokens (bonus included) for the cost of g draft forwards (each c of a "
                "target forward) and one target forward. Diamonds are this session's speculative runs from the "
                "Decode tab (x: mean draft length; speedup needs a plain run of the same prompt).")
    with gr.Row():
        acceptance = gr.Slider(0, 1, value=0.7, step=0.01, label="acceptance a")
        gamma = gr.Slider(1, MAX_GAMMA, value=4, step=1, label="draft length g")
        cost_ratio = gr.Slider(0, 1, value=0.15, step=0.01, label="cost ratio c (draft / target forward)")
    summary = gr.Markdown(elem_id="pg-theory-summary")
    plot = gr.Plot(elem_id="pg-theory-plot")
    inputs = [acceptance, gamma, cost_ratio, history]
    for control in (acceptance, gamma, cost_ratio):
        control.change(update, inputs, [plot, summary], api_name=False, show_progress="hidden")
    history.change(update, inputs, [plot, summary], api_name=False, show_progress="hidden")
    app.load(update, inputs, [plot, summary], api_name="theory")
