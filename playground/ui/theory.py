"""The Theory tab: expected tokens per step and expected speedup of speculative decoding against draft length,
from sliders for acceptance a, draft length g and cost ratio c, with this session's measured runs overlaid; and
what a wider forward costs on this machine, measured for each format the weights can be read in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr

from ..config import MAX_GAMMA, ConfigError
from ..decoding.costs import OneRequest, forward_costs
from ..engine import one_request_costs
from ..metrics import expected_tokens_per_step
from ..models import ModelLoadError
from ..viz.charts import MeasuredPoint, expected_speedup, theory_figure, width_cost_figure
from .models import get_model, target_spec
from .stops import RUN_QUEUE


def measured_points(history: list[dict[str, Any]] | None) -> list[MeasuredPoint]:
    """This session's runs that drafted, every algorithm's (trees marked: the chain's formula does not describe
    them), each with its speedup over the plain decoding measured beside it (its Decode rounds, its Race)."""
    return [MeasuredPoint(f"run {i + 1} ({run['algo']})", (run.get("mean_nodes") or run["mean_draft"])
                          if run.get("tree") else run["mean_draft"], run["acceptance_rate"], run["mean_accepted"],
                          run.get("speedup"), bool(run.get("tree")))
            for i, run in enumerate(run for run in history or []
                                    if run["mean_draft"] and run["acceptance_rate"] is not None)]


CEILING_G = 16  # the draft lengths the chart draws


def machine_curve(costs: Callable[[int], float], provenance: str) -> dict[str, Any]:
    """What the Theory tab keeps of this machine's forward-cost curve: a forward's cost over 1..CEILING_G + 1 tokens
    in one-token forwards, and where the figures come from."""
    return {"cost": [costs(w) for w in range(1, CEILING_G + 2)], "from": provenance}


def curve_v(relative: Callable[[int], float]) -> float:
    """The v of the linear model (1 + g v) that a curve's 5-token forward implies (`relative`: a forward's cost by
    width in one-token forwards)."""
    return (relative(5) - 1) / 4


def update(acceptance: Any, gamma: Any, cost_ratio: Any, verify_cost: Any, history: list[dict[str, Any]] | None,
           machine: dict[str, Any] | None = None):
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
    ceiling = None
    if machine is not None:
        cost = machine["cost"]
        ceiling = [(k + 1) / cost[k] for k in range(1, CEILING_G + 1)]  # g drafted + the bonus, in a (g + 1) forward
        summary += (f" On this machine's curve no proposer of {g} tokens can pass **{ceiling[g - 1]:.2f}x** (every "
                    f"token kept, drafting free: {g + 1} tokens for a forward costing {cost[g]:.2f}). The curve: "
                    f"{machine['from']}.")
    return theory_figure(a, g, c, measured_points(history), v, ceiling), summary + ceiling_line(history)


def ceiling_line(history: list[dict[str, Any]] | None) -> str:
    """The latest Decode run that drafted against what this machine allows (`decode.ceiling`), as a paragraph."""
    latest = next((run for run in reversed(history or []) if run.get("ceiling")), None)
    if latest is None:
        return ""
    c = latest["ceiling"]
    return (f"\n\nThe latest Decode run ({latest['algo']}) against this machine: measured **{c['measured']:.2f}x** "
            f"plain decoding; its own steps (the widths it verified, its proposer's forwards) come to "
            f"{c['predicted']:.2f}x on the forward-cost curve, so it reached "
            f"{c['measured'] / c['predicted']:.0%} of that; a perfect proposer, every proposed token kept, would "
            f"reach {c['perfect']:.2f}x on the decode steps verifying {c['perfect_width']} tokens a forward (a "
            f"projection from the curve, not a run). The curve: {c['costs_from']}.")


def from_run(history: list[dict[str, Any]] | None):
    """The sliders a and g set from this session's latest run that drafted (Decode or Race), with a line on what
    was taken: a is the share of the tokens the target judged that it kept (the formula's a: each judged token kept
    with probability a), not of all drafted tokens (a chain's tokens after a rejection are never judged)."""
    drafted = [run for run in history or [] if run["acceptance_rate"] is not None and run["mean_draft"]]
    if not drafted:
        raise gr.Error("set from a run: run Decode or Race with an algorithm that drafts first")
    run = drafted[-1]
    g = min(max(round(run["mean_draft"]), 1), MAX_GAMMA)
    note = (f"Set from the latest run that drafted ({run['algo']}): a = {run['acceptance_rate']:.2f}, the target "
            f"kept {run.get('accepted', 0)} of the {run.get('judged', 0)} drafted tokens it judged")
    if run.get("kept_of_drafted") is not None:
        note += (f" ({run['kept_of_drafted']:.0%} of all drafted tokens: those after a rejection are never judged, "
                 "and the formula's a is about judged ones)")
    note += f"; g = {g}, its mean draft length."
    if run.get("tree"):
        note += " It proposed trees, which a chain's formula describes only roughly."
    return gr.update(value=round(run["acceptance_rate"], 2)), gr.update(value=g), note


# what the Theory tab measures, and its words for each
WEIGHT_LABELS = {"gguf-int8": "GGUF blocks, 8-bit activations", "gguf": "GGUF blocks, float32 activations",
                 "float32": "float32"}


def width_costs(source: str, device: str, dtype: str, progress: gr.Progress = gr.Progress()):
    """The panel's model read three ways (its GGUF blocks against 8-bit and against float32 activations where it has
    blocks, and float32 weights): each one's forward cost by width on this machine (measured once, a few seconds
    each, then cached), and the v each implies; the slider v set from the first (what the panel's model reads by
    default where it has blocks)."""
    curves: dict[str, Any] = {}
    lines: list[str] = []
    first_v: float | None = None
    try:
        for weights, label in WEIGHT_LABELS.items():
            spec = target_spec(source, device, dtype, weights)
            progress(len(curves) / len(WEIGHT_LABELS), desc=f"{label}: loading, then timing forwards of 1-64 tokens")
            try:
                model = get_model(spec)
            except ModelLoadError as exc:
                if weights != "float32":
                    lines.append(f"- {label}: not measured ({exc})")
                    continue
                raise
            live = forward_costs(model.model, forwards=model.forwards)
            costs = live.measured()  # the curve as measured, as every report quotes it (`OneRequest`)
            curves[label] = live
            v = curve_v(OneRequest(live))
            first_v = v if first_v is None else first_v
            lines.append(f"- {label}: one token {1e3 * costs.time(1):.1f} ms, 5 tokens "
                         f"{costs.time(5) / costs.time(1):.2f} one-token forwards (v = {v:.3f} per extra token), "
                         f"12 tokens {costs.time(12) / costs.time(1):.2f}; {live.provenance()}")
    except (ConfigError, ModelLoadError) as exc:
        raise gr.Error(str(exc)) from exc
    assert first_v is not None  # float32 was measured, or the panel's model raised
    first = next(iter(curves.values()))
    machine = machine_curve(OneRequest(first), first.provenance())
    if len(curves) == 2:
        (steep, high), (flat, low) = sorted(((label, OneRequest(c)(8)) for label, c in curves.items()),
                                            key=lambda item: -item[1])
        lines.append(f"Here an 8-token forward costs {high:.2f} one-token forwards on the {steep} and {low:.2f} on "
                     f"the {flat}: the steeper a curve, the less a wide verify forward is worth.")
    lines.append(f"The slider v is set to {first_v:.3f}, this machine's.")
    figure = width_cost_figure({label: c.measured() for label, c in curves.items()})
    return figure, "\n".join(lines), gr.update(value=round(min(first_v, 1.0), 3)), machine


def machine_defaults(source: str, device: str, dtype: str, weights: str):
    """On opening the page: this machine's curve for the panel's model as the engine plans on it (measured once, a
    few seconds, then cached), and the slider v from it."""
    try:
        target = get_model(target_spec(source, device, dtype, weights))
    except (ConfigError, ModelLoadError) as exc:
        raise gr.Error(str(exc)) from exc
    costs = one_request_costs(target)
    machine = machine_curve(costs, costs.provenance())
    return machine, gr.update(value=round(min(curve_v(costs), 1.0), 3))


def build_tab(app: gr.Blocks, history: gr.State, model: tuple[gr.Component, ...],
              on_gpu: Callable[[Callable], Callable]) -> None:
    gr.Markdown("What speculation should buy. If each of g drafted tokens is accepted with probability a, a target "
                "forward adds (1 - a^(g+1)) / (1 - a) tokens. The price: g draft forwards costing c each, and one "
                "wider verify forward. Move the sliders. Diamonds (chains) and squares (trees) are this session's "
                "runs that drafted; the dash-dot line is the best this machine's forward costs allow.")
    with gr.Accordion("The model in full", open=False):
        gr.Markdown("Acceptances are independent, the bonus token included; a is the share of the tokens the target "
                    "judged that it kept. The classic model prices the verify forward over g + 1 tokens like a "
                    "one-token one (v = 0): true where reading the weights bounds a step, as for a large model on a "
                    "GPU. On a CPU it costs about 1 + g v one-token forwards: v starts at this machine's, from the "
                    "forward-cost curve the engine plans on (below). A point's x is a run's mean draft length (a "
                    "tree's: the nodes a step verified); its speedup is the one measured beside it against plain "
                    "decoding.")
    with gr.Row():
        acceptance = gr.Slider(0, 1, value=0.7, step=0.01, label="acceptance a")
        gamma = gr.Slider(1, MAX_GAMMA, value=4, step=1, label="draft length g")
        cost_ratio = gr.Slider(0, 1, value=0.15, step=0.01, label="cost ratio c (draft / target forward)")
        verify_cost = gr.Slider(0, 1, value=0, step=0.005, label="verify cost v (per drafted token)")
    set_from_run = gr.Button("Set a and g from the latest run that drafted", size="sm", scale=0)
    taken = gr.Markdown(elem_id="pg-theory-taken")
    summary = gr.Markdown(elem_id="pg-theory-summary")
    plot = gr.Plot(elem_id="pg-theory-plot", show_label=False)
    machine = gr.State(None)  # this machine's forward-cost curve (`machine_curve`), once read
    inputs = [acceptance, gamma, cost_ratio, verify_cost, history, machine]
    for control in (acceptance, gamma, cost_ratio, verify_cost):
        control.change(update, inputs, [plot, summary], api_visibility="private", show_progress="hidden")
    history.change(update, inputs, [plot, summary], api_visibility="private", show_progress="hidden")
    source, _, device, dtype, weights = model
    app.load(update, inputs, [plot, summary], api_name="theory")
    # then this machine's curve and the v it implies (the model loads, the curve is read or measured once)
    app.load(on_gpu(machine_defaults), [source, device, dtype, weights], [machine, verify_cost],
             api_visibility="private", show_progress="hidden", concurrency_id=RUN_QUEUE)
    machine.change(update, inputs, [plot, summary], api_visibility="private", show_progress="hidden")
    set_from_run.click(from_run, [history], [acceptance, gamma, taken], api_visibility="private")
    gr.Markdown("### What a wider forward costs here\nThe v above, measured for each way the weights can be read: "
                "GGUF blocks (a fifth of float32's bytes) against 8-bit or float32 activations, or float32. Where "
                "reading the weights sets a forward's time, a few more tokens come almost free and the curve stays "
                "flat. Where arithmetic sets it, each extra token costs more and the curve climbs. The engine "
                "plans every step's width from the curve of the format it reads.")
    measure = gr.Button("Measure on this machine (and set v above from it)", scale=0)
    costs_plot = gr.Plot(elem_id="pg-width-costs", show_label=False)
    costs_summary = gr.Markdown(elem_id="pg-width-costs-summary")
    measure.click(on_gpu(width_costs), [source, device, dtype], [costs_plot, costs_summary, verify_cost, machine],
                  api_name="width_costs", concurrency_id=RUN_QUEUE)
