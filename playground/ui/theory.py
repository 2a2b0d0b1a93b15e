"""The Theory tab: expected tokens per step and expected speedup of speculative decoding against draft length,
from sliders for acceptance a, draft length g and cost ratio c, with this session's measured runs overlaid; and
what a wider forward costs on this machine, measured for each format the weights can be read in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr

from ..config import MAX_GAMMA, ConfigError
from ..decoding import registry
from ..decoding.costs import forward_costs
from ..metrics import expected_tokens_per_step
from ..models import ModelLoadError
from ..viz.charts import MeasuredPoint, expected_speedup, theory_figure, width_cost_figure
from .models import get_model, target_spec


def measured_points(history: list[dict[str, Any]] | None) -> list[MeasuredPoint]:
    """This session's runs of algorithms that draft chains with a draft model (the theory's case); speedup against
    the latest plain run of the same prompt, if any."""
    points: list[MeasuredPoint] = []
    plain: dict[str, float] = {}
    for run in history or []:
        spec = registry.find(run["algo"])
        chains = spec is not None and spec.loads_draft
        if run["algo"] == registry.PLAIN:
            plain[run["prompt"]] = run["tokens_per_s"]
        elif chains and run["mean_draft"] and run["token_acceptance"] is not None:
            base = plain.get(run["prompt"])
            points.append(MeasuredPoint(f"run {len(points) + 1}", run["mean_draft"], run["token_acceptance"],
                                        run["mean_accepted"], run["tokens_per_s"] / base if base else None))
    return points


def update(acceptance: Any, gamma: Any, cost_ratio: Any, verify_cost: Any, history: list[dict[str, Any]] | None):
    try:
        a, c, v = float(acceptance), float(cost_ratio), float(verify_cost)
        if not 0 <= a <= 1:
            raise ConfigError(f"acceptance a must be in [0, 1], got {acceptance}")
        if not 0 <= c <= 2:
            raise ConfigError(f"cost ratio c must be in [0, 2], got {cost_ratio}")
        if not 0 <= v <= 1:
            raise ConfigError(f"verify cost v must be in [0, 1], got {verify_cost}")
        g = int(gamma)
        if g != float(gamma) or not 1 <= g <= MAX_GAMMA:
            raise ConfigError(f"draft length g must be a whole number in [1, {MAX_GAMMA}], got {gamma}")
    except (TypeError, ValueError) as exc:
        raise gr.Error(str(exc)) from exc
    summary = (f"With a = {a:.2f}, g = {g}, c = {c:.2f}, v = {v:.2f}: **{expected_tokens_per_step(a, g):.2f} tokens "
               f"per target forward**, expected speedup **{expected_speedup(a, g, c, v):.2f}x** (tokens per step / "
               "(g c + 1 + g v)).")
    return theory_figure(a, g, c, measured_points(history), v), summary + ceiling_line(history)


def ceiling_line(history: list[dict[str, Any]] | None) -> str:
    """The latest Decode run that drafted against what this machine allows (`decode.ceiling`), as a paragraph."""
    latest = next((run for run in reversed(history or []) if run.get("ceiling")), None)
    if latest is None:
        return ""
    c = latest["ceiling"]
    return (f"\n\nThe latest Decode run ({latest['algo']}) against this machine: measured **{c['measured']:.2f}x** "
            f"plain decoding; its own steps (the widths it verified, its proposer's forwards) come to "
            f"{c['predicted']:.2f}x on the measured forward-cost curve, so it reached "
            f"{c['measured'] / c['predicted']:.0%} of that; a perfect proposer, every proposed token kept, would "
            f"reach {c['perfect']:.2f}x on the decode steps verifying {c['perfect_width']} tokens a forward (a "
            "projection from the curve, not a run).")


def from_run(history: list[dict[str, Any]] | None):
    """The sliders a and g set from this session's latest run that drafted (Decode or Race): its acceptance of the
    tokens the target judged and its mean draft length."""
    drafted = [run for run in history or [] if run["token_acceptance"] is not None and run["mean_draft"]]
    if not drafted:
        raise gr.Error("set from a run: run Decode or Race with an algorithm that drafts first")
    run = drafted[-1]
    return gr.update(value=round(run["token_acceptance"], 2)), gr.update(value=min(max(round(run["mean_draft"]), 1),
                                                                                   MAX_GAMMA))


def width_costs(source: str, device: str, dtype: str, progress: gr.Progress = gr.Progress()):
    """The panel's model read both ways (its GGUF blocks where it has them, and float32): each format's forward cost
    by width on this machine (measured once, a few seconds each, then cached), and the v each implies; the slider v
    set from the first (the format the panel's model reads by default where it has blocks)."""
    curves: dict[str, Any] = {}
    lines: list[str] = []
    first_v: float | None = None
    try:
        for weights in ("gguf", "float32"):
            spec = target_spec(source, device, dtype, weights)
            progress(len(curves) / 2, desc=f"{weights}: loading, then timing forwards of 1-64 tokens")
            try:
                model = get_model(spec)
            except ModelLoadError as exc:
                if weights == "gguf":
                    lines.append(f"- GGUF blocks: not measured ({exc})")
                    continue
                raise
            costs = forward_costs(model.model, forwards=model.forwards)
            label = "GGUF blocks" if weights == "gguf" else "float32"
            curves[label] = costs
            v = (costs.time(5) / costs.time(1) - 1) / 4
            first_v = v if first_v is None else first_v
            lines.append(f"- {label}: one token {1e3 * costs.time(1):.1f} ms, 5 tokens "
                         f"{costs.time(5) / costs.time(1):.2f} one-token forwards (v = {v:.3f} per extra token), "
                         f"12 tokens {costs.time(12) / costs.time(1):.2f}")
    except (ConfigError, ModelLoadError) as exc:
        raise gr.Error(str(exc)) from exc
    assert first_v is not None  # float32 was measured, or the panel's model raised
    lines.append(f"The slider v is set to {first_v:.3f}, this machine's.")
    return width_cost_figure(curves), "\n".join(lines), gr.update(value=round(min(first_v, 1.0), 3))


def build_tab(app: gr.Blocks, history: gr.State, model: tuple[gr.Component, ...],
              on_gpu: Callable[[Callable], Callable]) -> None:
    gr.Markdown("What speculation should buy: g drafted tokens, each accepted with probability a, yield "
                "(1 - a^(g+1)) / (1 - a) tokens per target forward, for g draft forwards costing c each and one "
                "wider verify forward. Move the sliders; diamonds are this session's speculative runs.")
    with gr.Accordion("The model in full", open=False):
        gr.Markdown("Acceptances are independent, the bonus token included. The classic model prices the verify "
                    "forward over g + 1 tokens like a one-token one (v = 0): true where reading the weights bounds a "
                    "step, as for a large model on a GPU. On this project's 2-core CPUs it costs 1 + g v one-token "
                    "forwards with v = 0.01-0.04 (the benchmark's verify cost ratio). Diamonds: x is a run's mean "
                    "draft length; its speedup needs a plain run of the same prompt.")
    with gr.Row():
        acceptance = gr.Slider(0, 1, value=0.7, step=0.01, label="acceptance a")
        gamma = gr.Slider(1, MAX_GAMMA, value=4, step=1, label="draft length g")
        cost_ratio = gr.Slider(0, 1, value=0.15, step=0.01, label="cost ratio c (draft / target forward)")
        verify_cost = gr.Slider(0, 1, value=0, step=0.005, label="verify cost v (per drafted token)")
    set_from_run = gr.Button("Set a and g from the latest run that drafted", size="sm", scale=0)
    summary = gr.Markdown(elem_id="pg-theory-summary")
    plot = gr.Plot(elem_id="pg-theory-plot", show_label=False)
    inputs = [acceptance, gamma, cost_ratio, verify_cost, history]
    for control in (acceptance, gamma, cost_ratio, verify_cost):
        control.change(update, inputs, [plot, summary], api_visibility="private", show_progress="hidden")
    history.change(update, inputs, [plot, summary], api_visibility="private", show_progress="hidden")
    app.load(update, inputs, [plot, summary], api_name="theory")
    set_from_run.click(from_run, [history], [acceptance, gamma], api_visibility="private")
    gr.Markdown("### What a wider forward costs here\nThe v above, measured: read as float32, the weights make a "
                "one-token forward wait on memory, so a few more tokens ride along almost free. Read as GGUF blocks "
                "(a fifth of the bytes), the same forward is bound by arithmetic instead: it is faster, and each "
                "extra token costs more of it. The engine plans every step's width from these curves.")
    measure = gr.Button("Measure on this machine (and set v above from it)", scale=0)
    costs_plot = gr.Plot(elem_id="pg-width-costs", show_label=False)
    costs_summary = gr.Markdown(elem_id="pg-width-costs-summary")
    source, _, device, dtype, _ = model
    measure.click(on_gpu(width_costs), [source, device, dtype], [costs_plot, costs_summary, verify_cost],
                  api_name="width_costs")
