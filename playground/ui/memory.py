"""The Memory tab: the paged engine serving several requests at once, its block map redrawn live after engine
steps, memory over time against a contiguous reservation, preemptions marked; block and pool sizes adjustable."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import gradio as gr

from ..bench.suite import workload
from ..config import ConfigError, EngineParams, SamplingParams, check_choice
from ..decoding import registry
from ..engine import Engine
from ..metrics import memory_summary
from ..models import ModelLoadError
from ..trace import MemoryEvent
from ..viz.memory import memory_figure, render_block_map, statuses_at
from .form import Entrant, as_int, entrants, in_labels, make_proposer, source_names
from .models import get_model, target_spec
from .quota import QUOTA
from .stops import STOP, STOPS, stoppable

# Redraws while serving: the block map at most four times a second, the chart (heavier for the browser, which
# shares the processor with the engine on a small machine) once a second; the engine's clock is stopped meanwhile.
FRAME_S = 0.25
CHART_S = 1.0
MAX_REQUESTS = 16
NOT_SERVED = "stopped before its first step: nothing was served"
TABLE_HEADERS = ["request", "status", "prompt tokens", "generated", "preempted", "output"]
# in pixels, as the Race's: on a phone the table scrolls sideways instead of giving each column one letter
COLUMN_WIDTHS: list[str | int] = ["80px", "90px", "80px", "90px", "90px", "360px"]


def _table(engine: Engine) -> list[list[Any]]:
    tokenizer = engine.target.tokenizer
    return [[rid, r.status.value, len(r.prompt_ids), len(r.stopper.tokens), r.preemptions,
             tokenizer.decode(r.stopper.tokens, skip_special_tokens=True)] for rid, r in engine.requests.items()]


def _summary(engine: Engine) -> str:
    s = memory_summary(engine.events)
    tokens = sum(len(r.stopper.tokens) for r in engine.requests.values())
    preemptions = sum(r.preemptions for r in engine.requests.values())
    return (f"**{tokens} tokens** for {len(engine.requests)} requests in {engine.step_count} steps, "
            f"{engine.busy_s:.2f} s engine time = **{tokens / engine.busy_s:.1f} tok/s**; {preemptions} "
            f"preemption(s). Peak KV: paged {s['peak_kv_bytes'] / 2**20:.2f} MiB vs contiguous reservation "
            f"{s['peak_contiguous_bytes'] / 2**20:.2f} MiB. Waste over the run: paged "
            f"**{100 * s['kv_waste_fraction']:.1f}%** (partly filled last blocks) vs contiguous "
            f"**{100 * s['contiguous_waste_fraction']:.0f}%** (slots reserved for tokens not yet or never "
            f"generated).{_proposals(engine)}")


NONE = "none (plain decoding)"


def proposals() -> dict[str, Entrant]:
    """What every step of the batch may propose: nothing, or any registered algorithm (with prompt lookup's copies
    grafted where it takes them)."""
    return {NONE: Entrant(registry.PLAIN), **entrants("prompt lookup")}


def _proposals(engine: Engine) -> str:
    parts = []
    for source, counts in engine.counts.items():
        who, what = source_names().get(source, (source, "proposed"))
        parts.append(f"{who}: **{counts.accepted} of {counts.proposed}** {what} tokens accepted, in "
                     f"{counts.steps} of {engine.step_count} steps.")
    if not parts:
        return ""
    return " " + " ".join(parts) + " The tokens are those of plain decoding."


def run_memory(num_requests: Any, max_new_tokens: Any, block_size: Any, num_blocks: Any, max_running: Any,
               prefix_caching: bool, proposal: str, model_source: str, draft_source: str, device: str, dtype: str,
               weights: str, run: int | None = None, request: gr.Request | None = None,
               progress: gr.Progress = gr.Progress()):
    """Yields (block map HTML, memory chart, status, request table, memory events, step slider) as the engine
    runs, then the summary; the events and the slider (to replay the block map of any step) come at the end.
    run: its number in `STOPS`; once stopped, the requests still unfinished are aborted after the current step."""
    try:
        requests = as_int("requests", num_requests)
        if not 1 <= requests <= MAX_REQUESTS:
            raise ConfigError(f"requests must be in [1, {MAX_REQUESTS}], got {requests}")
        params = EngineParams(num_blocks=as_int("pool blocks", num_blocks), block_size=as_int("block size", block_size),
                              max_running=as_int("max running", max_running), prefix_caching=bool(prefix_caching))
        offered = proposals()
        check_choice("proposals", proposal, tuple(offered))
        chosen = offered[proposal]
        work = workload(requests, as_int("max new tokens", max_new_tokens))
        if STOPS.stopped(run):  # while it waited in the queue
            yield gr.update(), gr.update(), NOT_SERVED, gr.update(), gr.update(), gr.update()
            return
        QUOTA.take(request, sum(generation.max_new_tokens for _, generation in work), "max new tokens")
        spec = target_spec(model_source, device, dtype, weights)
        progress(0.0, desc=f"loading model {spec.source!r}")
        target = get_model(spec)
        # the app's loaded draft (the panel's, else the shipped one), not a fresh load on every run
        proposer = make_proposer(target, chosen.algo, None, chosen.copies, draft_source)
        engine = Engine(target, params, proposer=proposer)
        for prompt, generation in work:
            engine.add_request(prompt, SamplingParams(), generation)
    except (ConfigError, ModelLoadError, ValueError) as exc:
        raise gr.Error(in_labels(str(exc)), duration=None) from exc
    ids = list(engine.requests)
    try:
        last_frame = last_chart = 0.0
        while engine.has_unfinished():
            if STOPS.stopped(run):
                for rid in [r.id for r in (*engine.running, *engine.waiting)]:
                    engine.abort(rid)
                break
            engine.step()
            now = time.perf_counter()
            if now - last_frame >= FRAME_S:
                last_frame = now
                chart = gr.update()
                if now - last_chart >= CHART_S:
                    last_chart, chart = now, memory_figure(engine.events)
                latest = next(e for e in reversed(engine.events) if isinstance(e, MemoryEvent))
                yield (render_block_map(latest, statuses_at(latest, ids)), chart,
                       f"step {engine.step_count}, engine time {engine.busy_s:.2f} s", _table(engine), gr.update(),
                       gr.update())
    finally:
        engine.close()  # its static forwards (GPU graphs) may serve the next run
    memory = [e for e in engine.events if isinstance(e, MemoryEvent)]
    if not memory:  # stopped before its first step
        yield gr.update(), gr.update(), NOT_SERVED, _table(engine), gr.update(), gr.update()
        return
    stopped = f"**Stopped after step {engine.step_count}**: the unfinished requests were aborted. " if \
        STOPS.stopped(run) else ""
    # The step to show first: the fullest pool (where preemption looms), preferring shared blocks, then the latest.
    busiest = max(memory, key=lambda e: (e.blocks_used, len(e.shared), e.step))
    yield (render_block_map(busiest, statuses_at(busiest, ids)), memory_figure(engine.events),
           stopped + _summary(engine), _table(engine), {"events": memory, "ids": ids},
           gr.update(minimum=1, maximum=max(memory[-1].step, 2), value=busiest.step, interactive=True))


def replay_step(state: dict[str, Any] | None, step: Any) -> str:
    """The block map as any step of the last run held it."""
    if not state:
        raise gr.Error("step: serve the requests first")
    wanted = as_int("step", step)
    event = next((e for e in state["events"] if e.step == wanted), None)
    if event is None:
        raise gr.Error(f"step must be in [1, {state['events'][-1].step}], got {wanted}")
    return render_block_map(event, statuses_at(event, state["ids"]))


def build_tab(model: tuple[gr.Component, ...], on_gpu: Callable[[Callable], Callable]) -> None:
    gr.Markdown("Several requests at once on the **paged KV cache**. Each holds blocks of a shared pool. Requests "
                "with the same prompt prefix share its blocks. When the pool runs out, the newest request is "
                "**preempted** and recomputed later. The chart sets the pool against a contiguous cache that "
                "reserves prompt + max new tokens per request. Greedy; engine time only; any proposals in the batch "
                "leave the tokens unchanged. The same engine serves HTTP: `python -m playground serve`.")
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=300):
            num_requests = gr.Number(8, label=f"requests (1..{MAX_REQUESTS})", step=1)
            max_new_tokens = gr.Number(48, label="max new tokens (1..4096; output limits cycle below it)", step=1)
            with gr.Row():
                block_size = gr.Number(8, label="block size (tokens, 1..256)", step=1)
                num_blocks = gr.Number(40, label="pool blocks (a request must fit)", step=1)
            with gr.Row():
                max_running = gr.Number(8, label="max running (1..256)", step=1)
                prefix_caching = gr.Checkbox(True, label="prefix caching")
            proposal = gr.Dropdown(list(proposals()), value=NONE, label="proposals in the batch")
            with gr.Row():
                run = gr.Button("Serve", variant="primary", scale=3)
                stop = gr.Button(STOP, variant="stop", scale=1)
            status = gr.Markdown(elem_id="pg-memory-status")
        with gr.Column(scale=3, min_width=300):
            block_map = gr.HTML(render_block_map(None), label="KV block pool", show_label=True, container=True,
                                elem_id="pg-block-map")
            step = gr.Slider(1, 2, value=1, step=1, label="Block map after step", interactive=False)
            chart = gr.Plot(elem_id="pg-memory-plot", show_label=False)
    table = gr.Dataframe(headers=TABLE_HEADERS, interactive=False, wrap=True, column_widths=COLUMN_WIDTHS,
                         elem_id="pg-memory-table")
    state = gr.State(None)
    source, draft_source, device, dtype, weights = model
    stoppable(run, stop, on_gpu(run_memory), [num_requests, max_new_tokens, block_size, num_blocks, max_running,
                                              prefix_caching, proposal, source, draft_source, device, dtype, weights],
              [block_map, chart, status, table, state, step], show="pg-memory-status", api_name="memory")
    step.release(replay_step, [state, step], [block_map], api_name="memory_step")
