"""The Decode tab: one algorithm measured against plain decoding (interleaved rounds, engine time only), then its
median run replayed with tokens coloured by decision, a player and a step scrubber; the trace can be downloaded,
and an uploaded trace is replayed with no model loaded."""

from __future__ import annotations

import bisect
import html
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import gradio as gr

from .. import notes
from ..config import ConfigError, GenerationParams, SamplingParams
from ..decoding import registry
from ..decoding.costs import LiveCosts, OneRequest
from ..decoding.planning import DraftPrice, OwnCost
from ..engine import one_request_costs, stream_generate, warm_up
from ..metrics import (
    FLAT_CURVE,
    Metrics,
    branched,
    compute,
    depth_profile,
    drafting_note,
    mean_draft_length,
    perfect,
    priced,
    projected_speedup,
)
from ..models import ModelLoadError
from ..notes import TokenText
from ..speedup import ROUNDS, Speedup, compare, median_run, shown_round
from ..timeline import save_timeline
from ..trace import DraftEvent, Event, TokenInfo, Trace, TraceError
from ..viz import render_legend, render_prompt, render_tokens
from ..viz.charts import steps_figure, tokens_time_figure
from ..viz.steps import STEP_HEADERS, render_step_detail, step_rows
from .form import (
    PLAIN_LABEL,
    Entrant,
    Filled,
    Form,
    as_float,
    as_int,
    in_labels,
    labels,
    line,
    make_proposer,
    named,
    taking,
)
from .measure import measured, status_frame
from .models import get_model, target_spec
from .quota import QUOTA
from .stops import STOP, STOPPED, STOPS, stoppable

PLAIN = registry.PLAIN
VIEWS = ["annotated", "+ refused guesses", "clean text"]  # the Generated panel's views (`render_tokens`)
AS_SET = "as-set"
PLANS = {AS_SET: "as-set", "measured": "measured"}  # the Plan control's choices -> `config.PLANS`, the CLI's words
PLAIN_EXAMPLE = "Explain in two sentences why the sky is blue."


def examples() -> list[list[str]]:
    """A prompt per registered algorithm that shows it at its best, then one for plain decoding."""
    return [*([spec.example, spec.label] for spec in registry.ALGORITHMS.values() if spec.example),
            [PLAIN_EXAMPLE, PLAIN_LABEL]]


REPLAY_QUEUE, REPLAYS = "replay", 4  # replays and uploads drawn at once, beside the one run measured at a time
FRAME_S = 0.08  # at most ~12 redraws a second while replaying: enough to animate, cheap to render
PROPOSAL_S = 0.3  # how long a replayed step's proposal shows before its verdict (the replay's clock waits)
# replay pace, as a share of the measured one
SPEEDS = {"1x (as measured)": 1.0, "1/2x": 0.5, "1/4x": 0.25, "1/10x": 0.1, "1/30x": 1 / 30}


def as_seed(value: Any) -> int | None:
    """The seed field: -1 draws a fresh seed every run (as does an empty value from the API). The browser shows an
    empty number field as 0 and sends 0, so emptiness cannot be the form's way to ask for a random seed."""
    if value is None or value == "":
        return None
    seed = as_int("seed", value)
    return None if seed == -1 else seed


def as_plan(choice: Any) -> str:
    """The Plan control's choice ("as-set", "measured") as `config.PLANS` names it; any other is an error."""
    if choice not in PLANS:
        raise ConfigError(f"plan must be one of {', '.join(PLANS)}, got {choice!r}")
    return PLANS[choice]


def _source_span(events: list[Event], upto_step: int | None) -> tuple[int, int] | None:
    """The earlier text the latest proposal up to a step came from, as its note says (a copy's source); none when
    that proposal came from a model alone."""
    proposals = [e for e in events if isinstance(e, DraftEvent) and e.tokens and (upto_step is None or
                                                                                 e.step <= upto_step)]
    note = notes.read(proposals[-1].note) if proposals and proposals[-1].note else None
    return note.span() if note is not None else None


def _stats(m: Metrics, against: Speedup | None, same: bool | None,
           own: tuple[OwnCost, float, bool] | None = None,
           note: str | None = None, projected: float | None = None, kept_at: list[float] | None = None,
           this_round: Speedup | None = None, costs_from: str | None = None) -> str:
    """The run's headline (its speedup over plain decoding, measured in interleaved rounds; where the run shown
    drafted nothing, that instead of a ratio) and its numbers, all of the round shown: this_round is its Speedup
    against plain decoding's run of the same round (`speedup.shown_round`), whose line says where a step's time
    went; costs_from: where the forward-cost figures come from (`OneRequest.provenance`), shown with them; own:
    the proposer's `OwnCost`, whose price its plans use (in target forwards, as measured once it has drafted a few
    steps, on this machine's live costs; its estimate on a curve given: `planning.DraftPrice`), what the bytes a
    further depth's forward reads predict at the rows it runs (`OwnCost.estimate`), and whether the costs were
    live; note: why the run drafted little (`metrics.drafting_note`), if it did; projected:
    `metrics.projected_speedup`, shown as the projection it is; kept_at: the share of proposing steps that kept at
    least 1, 2, ... drafted tokens (`metrics.depth_profile`), as serving engines report acceptance by position."""
    parts = [f"**{m.tokens} tokens** in {m.wall_s:.2f} s = **{m.tokens_per_s:.1f} tok/s** (engine time of the "
             f"median round)", f"target forwards {m.target_forwards}"]
    if m.mean_accepted_tokens is not None:
        parts.append(f"tokens per target forward {m.mean_accepted_tokens:.2f} (correction/bonus included)")
    if note is not None:
        parts.append(markdown_text(note, 400))
    if m.acceptance_rate is not None:
        judged = (m.accepted or 0) + (m.rejected or 0)
        parts.append(f"acceptance rate a = {m.acceptance_rate:.2f}: the target accepted {m.accepted} of the {judged} "
                     f"drafted tokens it judged ({m.drafted} drafted)")
    if kept_at:
        parts.append("steps that kept at least 1, 2, ... drafted tokens: "
                     + ", ".join(f"{share:.0%}" for share in kept_at[:8]))
    if own is not None:
        cost, estimate, live = own
        price = cost.value() if live else cost.estimated()
        timed = cost.fixed is not None or (live and cost.measured() is not None)  # fixed: as set
        if price.further is None:
            parts.append(f"the proposer's forward costs {price.first:.2f} target forwards, once a step (its bytes "
                         f"alone would say {estimate:.2f})")
        else:
            further = (f"{price.further:.2f} for each further token" if timed else
                       f"{price.further:.2f} for each further token, an estimate from its bytes until one is timed")
            width = f" at its {cost.rows} rows on this machine's curve" if cost.rows > 1 else ""
            parts.append(f"drafting costs {price.first:.2f} target forwards for a step's first token (with reading "
                         f"the tokens just kept) and {further}; the bytes a further token's forward reads would say "
                         f"{estimate:.2f}{width}")
    if same is not None:
        parts.append("same tokens as plain decoding: " + ("yes" if same else "**NO**"))
    if projected is not None:
        parts.append(f"*projection, not measured:* {projected:.2f}x plain decoding's steps {FLAT_CURVE}")
    if costs_from is not None and (note is not None or own is not None or projected is not None):
        parts.append(f"forward costs {costs_from}")
    head = ""
    if against is not None and not m.drafted:
        head = (f"### Nothing drafted: every step was a plain decoding step\nSo it ran at plain decoding's speed "
                f"({against.speedup:.2f}x over {against.rounds} rounds: the same work, any gap is the machine's "
                "noise).\n\n")
    elif against is not None:
        why = (this_round or against).why()
        head = (f"### {markdown_text(against.headline(), 600)}\nThe round shown: {markdown_text(why, 300)}\n\n")
    return head + " · ".join(parts)


def _steps(trace: Trace) -> int:
    return max((e.step for e in trace.events), default=0)


def render(events: list[Event], prompt_tokens: list[str], token_text: TokenText, upto_step: int | None = None,
           tokenized: bool = True, proposing: bool = False) -> tuple[str, str, str]:
    """(prompt HTML with the lookup source highlighted, generated tokens HTML, step detail HTML) as of a step; with
    `proposing`, between its proposal and its verdict (a tree is drawn at the text's end, where the eye already is).
    An untokenized prompt (a replayed trace, no tokenizer) has no token positions to highlight."""
    source = _source_span(events, upto_step) if tokenized else None
    return (render_prompt(prompt_tokens, source), render_tokens(events, upto_step, proposing),
            render_step_detail(events, upto_step, token_text, proposing))


def known_texts(trace: Trace, prompt_tokens: list[str], tokenized: bool,
                extra: dict[str, str] | None = None) -> TokenText:
    """Token text with no tokenizer (replays): the texts the trace, the tokenized prompt and `extra` (a run's
    texts of ids the trace holds without text: lookahead's window and candidates) carry; others show as #id."""
    texts = {int(i): text for i, text in (extra or {}).items()}
    texts.update(zip(trace.prompt_ids, prompt_tokens) if tokenized else {})
    for event in trace.events:
        for info in getattr(event, "tokens", None) or [getattr(event, "token", None)]:
            if isinstance(info, TokenInfo):  # events without one give None
                texts[info.id] = info.text
    return lambda token_id: texts.get(token_id, f"#{token_id}")


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def markdown_text(text: str, limit: int = 80) -> str:
    """Text from a file as literal Markdown: at most `limit` characters, HTML escaped and Markdown's punctuation
    backslashed (Gradio's sanitizer keeps tags such as <img src=x>, which a browser would fetch)."""
    shown = text if len(text) <= limit else text[: limit - 1] + "…"
    return re.sub(r"([\\`*_{}\[\]()#+\-.!|~>])", r"\\\1", html.escape(shown, quote=False))


def _save(trace: Trace) -> list[str]:
    """The trace and its timeline (Chrome's Trace Event JSON, for Perfetto), as files to download."""
    folder = Path(tempfile.mkdtemp(prefix="pg-trace-"))
    path = folder / f"trace-{trace.algo}.json"  # a run's algo is a registry name
    trace.save(path)
    timeline = folder / f"timeline-{trace.algo}.json"
    save_timeline([trace], timeline)
    return [str(path), str(timeline)]


def run_decode(prompt: str, algo_label: str, max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any,
               seed: Any, kv: str, plan: str, settings: Filled, model_source: str, draft_source: str, device: str,
               dtype: str, weights: str, history: list[dict[str, Any]] | None, run: int | None = None,
               request: gr.Request | None = None):
    """Measure first, then show: the algorithm and plain decoding run on the engine alone, interleaved over
    ROUNDS rounds (nothing is drawn meanwhile, so the browser never competes with the clock); yields (prompt HTML,
    tokens HTML, step detail, stats, trace state, trace file, step slider, session history, per-step chart,
    tokens-vs-time chart, step table): a cleared page with progress in the stats line, then the median round.
    settings: the algorithm fields' values (`form.taking` passes them); run: its number in `STOPS`; once stopped it
    ends between two engine steps, showing nothing measured."""
    status = partial(status_frame, 11, 3)
    try:
        algo = named(algo_label)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError("prompt must be a non-empty string")
        sampling = SamplingParams(temperature=as_float("temperature", temperature), top_k=as_int("top_k", top_k),
                                  top_p=as_float("top_p", top_p), seed=as_seed(seed))
        generation = GenerationParams(max_new_tokens=as_int("max_new_tokens", max_new_tokens), kv=kv,
                                      plan=as_plan(plan))
        params, copies = settings.settings(algo)  # checked before any model loads
        names = [algo] if algo == PLAIN else [algo, PLAIN]
        # the first frame clears what the previous run left (its tokens, trace, slider, charts and table)
        cleared: list[Any] = ["", "", "", None, None, gr.update(minimum=0, maximum=1, value=0, interactive=False),
                              gr.update(), None, None, []]
        if STOPS.stopped(run):  # while it waited in the queue
            yield *cleared[:3], STOPPED, *cleared[3:]
            return
        QUOTA.take(request, generation.max_new_tokens * len(names) * ROUNDS)
        spec = target_spec(model_source, device, dtype, weights)
        yield *cleared[:3], f"loading model {spec.source!r} (the first load converts it; later ones are instant)", \
            *cleared[3:]
        target = get_model(spec)
        proposers = {algo: make_proposer(target, algo, params, copies, draft_source), PLAIN: None}
        yield status("warming up (first calls allocate buffers; not measured)")
        for name in names:
            warm_up(target, prompt, proposers[name], sampling, replace(generation, max_new_tokens=2), name)
        streams = {name: partial(stream_generate, target, prompt, proposers[name], sampling, generation, name)
                   for name in names}
        traces = yield from measured(streams, lambda name: "plain decoding" if name == PLAIN else algo_label, status,
                                     partial(STOPS.stopped, run))
    except (ConfigError, ModelLoadError, ValueError) as exc:
        message = in_labels(str(exc), labels().get(algo_label))
        yield status(f"not run: {markdown_text(message, 300)}")  # not "loading model ..." left standing
        raise gr.Error(message, duration=None) from exc
    if traces is None:
        yield status(STOPPED)
        return
    trace, this_round = shown_round(traces, PLAIN, algo) if algo != PLAIN else (median_run(traces[algo]), None)
    against = compare(traces, PLAIN)[algo] if algo != PLAIN else None
    same = (trace.finished().token_ids == median_run(traces[PLAIN]).finished().token_ids if against and sampling.greedy
            else None)
    token_text = partial(_token_text, target.tokenizer)
    prompt_tokens = [token_text(i) for i in trace.prompt_ids]
    steps = _steps(trace)
    metrics = compute(trace)
    # ids a step detail shows beside its proposals, as their notes say: lookahead's window and hits, a retrieval's
    # matched suffix
    bare = notes.shown_ids([e.note for e in trace.events if isinstance(e, DraftEvent) and e.note])
    state = {"trace": trace, "prompt_tokens": prompt_tokens, "tokenized": True,
             "texts": {str(i): token_text(i) for i in bare}}
    proposer = proposers[algo]
    costs = one_request_costs(target)
    mine = proposer.own if proposer is not None else None
    live = isinstance(costs.costs, LiveCosts)  # on a curve given its plans priced its own forwards at their estimate
    own_cost = (mine.value() if live else mine.estimated()) if mine is not None else None
    own = (mine, mine.estimate(costs), live) if mine is not None else None
    note = drafting_note(trace, costs) if proposers[algo] is not None else None
    projected = projected_speedup(trace, own_cost) if metrics.drafted else None
    kept_at = cast(list[float] | None, depth_profile(trace).get("kept_at_least")) if metrics.drafted else None
    yield (*render(trace.events, prompt_tokens, token_text),
           _stats(metrics, against, same, own, note, projected, kept_at, this_round, costs.provenance()), state,
           _save(trace), gr.update(minimum=0, maximum=max(steps, 1), value=steps, interactive=True),
           [*(history or []), history_entry(trace, metrics, against.speedup if against else None,
                                            ceiling(trace, against, costs, own_cost))],
           steps_figure(trace.events),
           tokens_time_figure({trace.algo: trace.events}, {trace.algo: line(Entrant(algo))}), step_rows(trace.events))


def history_entry(trace: Trace, m: Metrics, speedup: float | None = None,
                  ceiling: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the Theory tab overlays from a run: its figures, its speedup over plain decoding measured beside it (None
    for plain decoding), and for a Decode run that drafted its `ceiling`. tree: whether it proposed trees (a chain's
    formula does not describe them; their x is the nodes a step verified)."""
    tree = any(branched(e) for e in trace.events if isinstance(e, DraftEvent))
    return {"algo": trace.algo, "prompt": trace.prompt, "tokens_per_s": m.tokens_per_s,
            "acceptance_rate": m.acceptance_rate, "accepted": m.accepted,
            "judged": (m.accepted or 0) + (m.rejected or 0),
            "kept_of_drafted": m.kept_of_drafted, "mean_accepted": m.mean_accepted_tokens,
            "mean_draft": mean_draft_length(trace), "mean_nodes": depth_profile(trace).get("mean_nodes_verified"),
            "tree": tree, "speedup": speedup, "ceiling": ceiling}


def ceiling(trace: Trace, against: Speedup | None, costs: OneRequest,
            own_cost: DraftPrice | None) -> dict[str, Any] | None:
    """A measured run against what this machine allows: its speedup, what its own steps predict on the forward-cost
    curve (`metrics.priced`, diluted by the prefill as the measurement is), and a perfect proposer's best (width,
    speedup) on that curve. None for plain decoding or a run with no decode step."""
    steps = priced(trace, costs, own_cost) if against is not None and trace.algo != PLAIN else None
    if steps is None or against is None:
        return None
    width, best = perfect(costs)
    return {"measured": against.speedup, "predicted": steps.diluted(against.prefill), "perfect_width": width,
            "perfect": best, "costs_from": costs.provenance()}


def play_measured(state: dict | None, step: Any, speed: str):
    """`play` after a run: nothing after a stopped one, which leaves no trace."""
    if state:
        yield from play(state, step, speed)


def _replayed(state: dict | None) -> tuple[Trace, list[str], bool, TokenText]:
    if not state:
        raise gr.Error("step: run a decode or upload a trace first")
    trace: Trace = state["trace"]  # the run's, or an upload validated as it loaded: never read again
    tokens, tokenized = state["prompt_tokens"], state["tokenized"]
    return trace, tokens, tokenized, known_texts(trace, tokens, tokenized, state.get("texts"))


def replay_step(state: dict | None, step: Any) -> tuple[str, str, str]:
    trace, tokens, tokenized, text = _replayed(state)
    return render(trace.events, tokens, text, as_int("step", step), tokenized)


def nudge(state: dict | None, step: Any, delta: int) -> tuple[str, str, str, dict[str, Any]]:
    """One step back or forward from the slider's step (staying within the run)."""
    trace, tokens, tokenized, text = _replayed(state)
    shown = min(max(as_int("step", step) + delta, 0), _steps(trace))
    return *render(trace.events, tokens, text, shown, tokenized), gr.update(value=shown)


def play(state: dict | None, step: Any, speed: str):
    """Replay from the slider's step (from the start when it stands at the end) at `speed` times the pace the run
    was measured at, one frame per step reached; a step that proposed shows in two beats, its proposal (held
    PROPOSAL_S, the replay's clock waiting meanwhile) and then its verdict. Yields (prompt HTML, tokens HTML, step
    detail, slider)."""
    if speed not in SPEEDS:
        raise gr.Error(f"replay speed must be one of {', '.join(SPEEDS)}, got {speed!r}")
    trace, tokens, tokenized, text = _replayed(state)
    ends = [0.0] * (_steps(trace) + 1)  # engine time at which each step ended
    for event in trace.events:
        ends[event.step] = max(ends[event.step], event.t)
    proposed = {e.step for e in trace.events if isinstance(e, DraftEvent) and e.tokens}
    first = as_int("step", step)
    first = 0 if first >= len(ends) - 1 else first
    start, shown = time.perf_counter(), -1
    while shown < len(ends) - 1:
        t = ends[first] + (time.perf_counter() - start) * SPEEDS[speed]
        now = max(first, bisect.bisect_right(ends, t) - 1)
        if now != shown:
            shown = now
            if now in proposed and now != first:
                yield *render(trace.events, tokens, text, now, tokenized, proposing=True), gr.update(value=now)
                time.sleep(PROPOSAL_S)
                start += PROPOSAL_S
            yield *render(trace.events, tokens, text, shown, tokenized), gr.update(value=shown)
        time.sleep(FRAME_S)


def load_trace(file: Any):
    """An uploaded trace, validated field by field (never unpickled), replayed with no model; the form's prompt and
    algorithm set to the trace's."""
    if file is None:
        raise gr.Error("trace file: choose a .json trace exported by this app or the CLI")
    path = file if isinstance(file, str) else getattr(file, "name", str(file))
    try:
        trace = Trace.load(path)
        stats = _stats(compute(trace), None, None)
    except TraceError as exc:
        raise gr.Error(f"trace file is not a valid trace: {exc}", duration=None) from exc
    tokens = [trace.prompt]  # with no model loaded the prompt shows as one piece
    steps = _steps(trace)
    state = {"trace": trace, "prompt_tokens": tokens, "tokenized": False}
    # the form shows what the trace ran, so that Decode runs it again as it was (settings besides these aside)
    label = next((label for label, name in labels().items() if name == trace.algo), None)
    head = ("### A replayed trace: one run, so no speedup\nA speedup is measured against plain decoding in "
            "interleaved rounds: Decode runs them.\n\n")
    return (*render(trace.events, tokens, known_texts(trace, tokens, False), tokenized=False),
            head + f"replayed trace of **{markdown_text(trace.algo)}** on {markdown_text(trace.model)}: " + stats,
            state, gr.update(minimum=0, maximum=max(steps, 1), value=steps, interactive=True),
            steps_figure(trace.events), tokens_time_figure({trace.algo: trace.events}), step_rows(trace.events),
            gr.update(value=trace.prompt), gr.update(value=label) if label is not None else gr.update())


def build_tab(model: tuple[gr.Component, ...], on_gpu: Callable[[Callable], Callable], history: gr.State) -> None:
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=300):
            picks = examples()
            prompt = gr.Textbox(label="Prompt", lines=4, max_lines=12, value=picks[0][0])
            algo = gr.Radio(list(labels()), value=picks[0][1], label="Algorithm")
            with gr.Accordion("Algorithm parameters", open=False):
                form = Form.build(algo.value)  # each algorithm's fields, shown while it is chosen
                kv = gr.Radio(["contiguous", "paged"], value="contiguous", label="KV cache")
            algo.change(form.visibility, [algo], list(form.groups.values()), api_visibility="private", queue=False)
            plan = gr.Radio(list(PLANS), value=AS_SET, label="Plan",
                            info="as-set: every step drafts and verifies all the settings ask for, so you see the "
                                 "algorithm work. measured: a step verifies only what should save time on this "
                                 "machine's measured costs, so drafting may stop.")
            with gr.Accordion("Sampling", open=False):
                max_new_tokens = gr.Number(64, label="max new tokens (1..4096)", step=1)
                temperature = gr.Number(0.0, label="temperature (0 or below 1e-5 = greedy, ..100)")
                top_k = gr.Number(0, label="top-k (0 = off)", step=1)
                top_p = gr.Number(1.0, label="top-p (0, 1]")
                seed = gr.Number(-1, label="seed (-1 = random)", step=1)
            with gr.Row():
                run = gr.Button("Decode", variant="primary", scale=3)
                stop = gr.Button(STOP, variant="stop", scale=1)
            # whether it then beats plain decoding on this machine, the run's headline says
            gr.Examples(picks, [prompt, algo], label="Examples: one per algorithm, on a prompt that suits it")
        with gr.Column(scale=3, min_width=300):
            with gr.Row(equal_height=True):
                gr.HTML(render_legend(), elem_id="pg-legend")
                # the text with each token's verdict; with the guesses earlier steps refused too; the text alone
                view = gr.Radio(VIEWS, value=VIEWS[0], show_label=False, min_width=330, elem_id="pg-view", scale=0)
            prompt_view = gr.HTML(label="Prompt (as the model sees it)", show_label=True, container=True,
                                  elem_id="pg-prompt")
            tokens_view = gr.HTML(label="Generated", show_label=True, container=True, elem_id="pg-generated")
            # in the browser only: the panel holds both views (`render_tokens`), the class picks one
            view.change(None, [view], None, api_visibility="private",
                        js="(v) => { const panel = document.querySelector('#pg-generated'); "
                        f"panel.classList.toggle('pg-show-clean', v === '{VIEWS[2]}'); "
                        f"panel.classList.toggle('pg-show-guesses', v === '{VIEWS[1]}'); }}")
            step = gr.Slider(0, 1, value=0, step=1, label="Replay step", interactive=False, elem_id="pg-step")
            with gr.Row(elem_id="pg-player"):
                play_button = gr.Button("▶ Play", size="sm", min_width=70)
                pause = gr.Button("Pause", size="sm", min_width=70)
                back = gr.Button("◀ Step", size="sm", min_width=70)
                forward = gr.Button("Step ▶", size="sm", min_width=70)
                speed = gr.Dropdown(list(SPEEDS), value="1/4x", label="replay speed", show_label=False,
                                    container=False, min_width=110, elem_id="pg-speed")
            stats = gr.Markdown(elem_id="pg-stats")
            detail = gr.HTML(label="Step detail", show_label=True, container=True, elem_id="pg-step-detail")
            with gr.Row():
                steps_plot = gr.Plot(elem_id="pg-steps-plot", show_label=False)
                time_plot = gr.Plot(elem_id="pg-time-plot", show_label=False)
            with gr.Row():
                download = gr.File(label="Download the trace (JSON) and its timeline (opens in ui.perfetto.dev)",
                                   file_count="multiple", interactive=False)
                upload = gr.File(label="Replay a trace (JSON)", file_types=[".json"], elem_id="pg-upload")
    with gr.Accordion("Per-step table", open=False):
        table = gr.Dataframe(headers=STEP_HEADERS, interactive=False, elem_id="pg-step-table")
    state = gr.State(None)
    inputs = [prompt, algo, max_new_tokens, temperature, top_k, top_p, seed, kv, plan, *form.fields, *model, history]
    shown = [prompt_view, tokens_view, detail]
    # Decode stays disabled while a run measures; the replay of what it measured follows on its own
    decoding = stoppable(run, stop, on_gpu(taking(run_decode, form)), inputs,
                         [*shown, stats, state, download, step, history, steps_plot, time_plot, table],
                         show="pg-legend", api_name="decode", show_progress_on=[stats])
    # replays and uploads draw a trace and run no model: their own queue, so they never wait behind a run or hold
    # one up (`REPLAYS` at a time; within `trace_check`'s bounds a trace draws in about a second at most)
    replay = decoding.success(play_measured, [state, step, speed], [*shown, step], api_visibility="private",
                              show_progress="hidden", concurrency_id=REPLAY_QUEUE, concurrency_limit=REPLAYS)
    playing = play_button.click(play, [state, step, speed], [*shown, step], api_name="play", show_progress="hidden",
                                concurrency_id=REPLAY_QUEUE, concurrency_limit=REPLAYS)
    stop.click(None, None, None, cancels=[replay, playing], api_visibility="private", queue=False)
    # a new run ends the replay of the previous one, which would otherwise paint its old trace over the new run
    run.click(None, None, None, cancels=[replay, playing], api_visibility="private", queue=False)
    pause.click(None, None, None, cancels=[replay, playing], api_visibility="private", queue=False)
    for button, delta in ((back, -1), (forward, 1)):
        button.click(partial(nudge, delta=delta), [state, step], [*shown, step], api_visibility="private",
                     show_progress="hidden", concurrency_id=REPLAY_QUEUE, concurrency_limit=REPLAYS)
    step.release(replay_step, [state, step], shown, api_name="replay_step", concurrency_id=REPLAY_QUEUE,
                 concurrency_limit=REPLAYS)
    upload.upload(load_trace, [upload],
                  [prompt_view, tokens_view, detail, stats, state, step, steps_plot, time_plot, table, prompt, algo],
                  api_name="load_trace", concurrency_id=REPLAY_QUEUE, concurrency_limit=REPLAYS)
