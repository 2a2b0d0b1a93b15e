"""The Race tab: plain decoding and 1 to 4 other algorithms on the same prompt. Each run is measured alone on the
engine, one after another, then all are replayed side by side at the pace each was measured (their engine
timestamps), so they never compete for the processor; a table and a tokens-vs-time chart summarise the race."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import gradio as gr

from ..config import ConfigError, GenerationParams, SamplingParams
from ..engine import generate
from ..metrics import Metrics, compute
from ..models import ModelLoadError
from ..trace import Trace
from ..viz.charts import tokens_time_figure
from ..viz.race import Lane, render_race
from .decode import FRAME_S, LOOKAHEAD, as_float, as_int, as_seed, build_proposer, history_entry
from .models import get_model, target_spec

# name -> (algorithm, KV cache, build_proposer's parameters that differ from DEFAULTS)
DEFAULTS: dict[str, Any] = {"gamma": 4, "max_ngram": 3, "num_draft": 0,
                            "window": LOOKAHEAD.window, "ngram": LOOKAHEAD.ngram, "guesses": LOOKAHEAD.guesses}
PLAIN = "plain"
RACERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "speculative (gamma 4)": ("speculative", "contiguous", {}),
    "speculative + prompt copies": ("speculative", "contiguous", {"copy_ngram": 3}),
    "prompt lookup": ("prompt-lookup", "contiguous", {}),
    "lookahead": ("lookahead", "contiguous", {}),
    "Medusa (dynamic tree)": ("medusa", "contiguous", {}),
    "Medusa + prompt copies": ("medusa", "contiguous", {"copy_ngram": 3}),
    "plain, paged KV": ("ar", "paged", {}),
}
ENTRANTS = {PLAIN: ("ar", "contiguous", {}), **RACERS}
MAX_RIVALS = 4  # plain plus four lanes fit a laptop screen and keep a race under a minute
MAX_REPLAY_S = 12.0  # longer races replay faster than measured, by a factor the tab states
TABLE_HEADERS = ["algorithm", "tokens", "engine s", "tokens/s", "speedup vs plain", "tokens per target forward",
                 "target forwards", "acceptance rate", "same tokens as plain"]
WARMUP_TOKENS = 2  # a short unmeasured run per entrant, so the first one measured pays no first-call costs
PROMPT = ("Summarise in one sentence: The library will close for renovation from June to August. During the "
          "closure, books can be returned at the town hall.")


def _row(name: str, trace: Trace, m: Metrics, plain: Trace, base: Metrics, greedy: bool) -> list[Any]:
    same = trace.finish().token_ids == plain.finish().token_ids
    return [name, m.tokens, round(m.wall_s, 3), round(m.tokens_per_s, 1),
            round(m.tokens_per_s / base.tokens_per_s, 2) if base.tokens_per_s else None,
            None if m.mean_accepted_tokens is None else round(m.mean_accepted_tokens, 2), m.target_forwards,
            None if m.acceptance_rate is None else round(m.acceptance_rate, 2),
            ("yes" if same else "NO") if greedy else "n/a (sampling)"]


def run_race(prompt: str, racers: list[str] | None, max_new_tokens: Any, temperature: Any, seed: Any,
             model_source: str, draft_source: str, device: str, dtype: str, quant: str,
             history: list[dict[str, Any]] | None,
             progress: gr.Progress = gr.Progress()):
    """Yields (lanes HTML, status, table, chart, history): first while measuring, then the synchronised replay."""
    try:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError("prompt must be a non-empty string")
        chosen = list(racers or [])
        unknown = [r for r in chosen if r not in RACERS]
        if unknown or not 1 <= len(chosen) <= MAX_RIVALS:
            raise ConfigError(f"algorithms: choose 1 to {MAX_RIVALS} of {', '.join(RACERS)} to race "
                              f"against plain decoding" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        sampling = SamplingParams(temperature=as_float("temperature", temperature), seed=as_seed(seed))
        tokens = as_int("max_new_tokens", max_new_tokens)
        GenerationParams(max_new_tokens=tokens)  # refuses a bad length before any model loads
        spec = target_spec(model_source, device, dtype, quant)
        progress(0.0, desc=f"loading model {spec.source!r}")
        target = get_model(spec)
        names = [PLAIN, *chosen]
        runs = []  # (name, algorithm, proposer, cache kind) per entrant
        for name in names:
            algo, kv, overrides = ENTRANTS[name]
            runs.append((name, algo, build_proposer(algo, target, draft_source, **{**DEFAULTS, **overrides}), kv))
        yield gr.update(), "warming up (first calls allocate buffers; not measured)", *[gr.update()] * 3
        for _, algo, proposer, kv in runs:
            generate(target, prompt, proposer, sampling, GenerationParams(max_new_tokens=WARMUP_TOKENS, kv=kv), algo)
        traces: dict[str, Trace] = {}
        for i, (name, algo, proposer, kv) in enumerate(runs):
            status = f"measuring **{name}** ({i + 1} of {len(names)}); runs go one at a time so none slows another"
            progress(i / len(names), desc=f"measuring {name}")
            yield gr.update(), status, gr.update(), gr.update(), gr.update()
            generation = GenerationParams(max_new_tokens=tokens, kv=kv)
            traces[name] = generate(target, prompt, proposer, sampling, generation, algo)[1]
    except (ConfigError, ModelLoadError, ValueError) as exc:
        raise gr.Error(str(exc), duration=None) from exc
    lanes = [Lane(name, trace.events) for name, trace in traces.items()]
    end = max(lane.wall_s for lane in lanes)
    speed = max(1.0, end / MAX_REPLAY_S)
    pace = "at the measured pace" if speed == 1 else f"{speed:.1f}x faster than measured"
    start = time.perf_counter()
    while (t := (time.perf_counter() - start) * speed) < end:
        yield render_race(lanes, t), f"replaying {pace}: engine time {t:.2f} s", gr.update(), gr.update(), gr.update()
        time.sleep(FRAME_S)
    greedy = sampling.greedy
    metrics = {name: compute(trace) for name, trace in traces.items()}
    rows = [_row(name, trace, metrics[name], traces[PLAIN], metrics[PLAIN], greedy) for name, trace in traces.items()]
    done = f"replayed {pace}. Engine time only; page drawing is never counted."
    yield (render_race(lanes), done, rows, tokens_time_figure({n: tr.events for n, tr in traces.items()}),
           [*(history or []), *(history_entry(traces[n], metrics[n]) for n in traces)])


def build_tab(model: tuple[gr.Component, ...], on_gpu: Callable[[Callable], Callable], history: gr.State) -> None:
    gr.Markdown("Plain decoding against up to four others on one prompt. Each run is **measured alone**, one after "
                "another, then all are **replayed together** from their own timestamps, so they never compete for "
                "the processor and the animation shows each at the pace it was measured. At temperature 0 every "
                "algorithm must produce the same tokens as plain decoding; the table checks it.")
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=300):
            prompt = gr.Textbox(PROMPT, label="Prompt", lines=3, max_lines=10)
            racers = gr.CheckboxGroup(list(RACERS), value=["speculative (gamma 4)", "prompt lookup", "lookahead",
                                                               "Medusa (dynamic tree)"],
                                      label="Race against plain decoding (1 to 4)")
            with gr.Row():
                max_new_tokens = gr.Number(48, label="max new tokens (1..4096)", step=1)
                temperature = gr.Number(0.0, label="temperature (0 or below 1e-5 = greedy)")
                seed = gr.Number(0, label="seed (-1 = random)", step=1)
            run = gr.Button("Race", variant="primary")
        with gr.Column(scale=3, min_width=300):
            status = gr.Markdown(elem_id="pg-race-status")
            lanes = gr.HTML(elem_id="pg-race")
    table = gr.Dataframe(headers=TABLE_HEADERS, interactive=False, elem_id="pg-race-table", wrap=True,
                         column_widths=["19%", "8%", "9%", "9%", "10%", "12%", "10%", "10%", "13%"])
    chart = gr.Plot(elem_id="pg-race-plot", show_label=False)
    run.click(on_gpu(run_race), [prompt, racers, max_new_tokens, temperature, seed, *model, history],
              [lanes, status, table, chart, history], api_name="race")
