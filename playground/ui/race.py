"""The Race tab: plain decoding and 1 to 4 other algorithms on the same prompt. Each run is measured alone on the
engine, one after another, then all are replayed side by side at the pace each was measured (their engine
timestamps), so they never compete for the processor; a table and a tokens-vs-time chart summarise the race.
Outside a public app one lane may be an OpenAI-compatible endpoint (`playground.remote`), streamed in the same
rounds and replayed at the wall-clock times its text arrived, labelled as the remote measurement it is."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import gradio as gr

from ..config import ConfigError, GenerationParams, SamplingParams
from ..decoding import registry
from ..engine import one_request_costs, stream_generate, warm_up
from ..metrics import compute, drafting_note
from ..models import ModelLoadError
from ..remote import Remote, RemoteRun, endpoint_url, median_ratio, median_round
from ..speedup import ROUNDS, Speedup, compare, median_run, shown_round, winner
from ..trace import Trace
from ..viz.charts import tokens_time_figure
from ..viz.race import Lane, RemoteLane, render_race
from .decode import AS_SET, FRAME_S, PLANS, as_plan, as_seed, history_entry, markdown_text
from .form import Entrant, as_float, as_int, entrants, in_labels, line, make_proposer
from .measure import measured, status_frame
from .models import catalog, get_model, target_spec
from .quota import QUOTA
from .stops import STOP, STOPPED, STOPS, stoppable

PLAIN = "plain"
PAGED = "plain, paged KV"  # plain decoding on the paged cache: what gathering its blocks costs
REMOTE = "OpenAI endpoint"  # the remote lane (not in a public app, which reaches no other server)
REMOTE_NOTE = ("remote: wall clock over HTTP, from the request to the stream's end (network, the server's queue and "
               "its own chat template included); no steps, no exactness check")
FAVOURITES = ("speculative", "prompt-lookup", "medusa", "eagle")  # the lanes the form starts with, where registered


def racers() -> dict[str, Entrant]:
    """The lanes a race may run besides plain decoding: every registered algorithm, with copies where it grafts
    them, and plain decoding on the paged cache."""
    return {**entrants("prompt copies"), PAGED: Entrant(registry.PLAIN, kv="paged")}


MAX_RIVALS = 4  # plain plus four lanes fit a laptop screen
REPLAY_S = (6.0, 12.0)  # a replay lasts this long at least and at most: slowed or sped up by a factor it states
TABLE_HEADERS = ["algorithm", "tokens/s (median)", "speedup vs plain (median of rounds)", "tokens per step",
                 "step cost in plain steps: draft + verify + other", "drafted tokens kept", "same tokens as plain",
                 "check"]
WARMUP_TOKENS = 2  # a short unmeasured run per entrant, so the first one measured pays no first-call costs
PROMPT = ("Summarise in one sentence: The library will close for renovation from June to August. During the "
          "closure, books can be returned at the town hall.")


def _row(s: Speedup, same: bool | None, proposed: bool = True) -> list[Any]:
    """A lane's table row; a lane that proposed nothing shows no speedup (its ratio to plain decoding is noise).
    The check is one short line; what a flag says is in the checks below the table (`_checks`)."""
    flags = len(s.flags)
    return [s.name, round(s.tokens_per_s, 1), round(s.speedup, 2) if proposed else "proposed nothing",
            round(s.tokens_per_step, 2),
            f"{s.step_cost:.2f} = {s.draft:.2f} + {s.verify:.2f} + {s.other:.2f}",
            None if s.kept is None else f"{s.kept:.0%}",
            "n/a (sampling)" if same is None else ("yes" if same else "NO"),
            f"CHECK: {flags} flag{'s' * (flags > 1)}, see below" if flags else "ok"]


def _checks(speedups: dict[str, Speedup], whys: dict[str, str]) -> str:
    """The folded detail: per lane, where its time went and, when flagged, what the measurement cannot explain (all
    of it the app's own words and figures: no user text)."""
    lines = []
    for name, s in speedups.items():
        said = [text for text in (whys.get(name, ""), *(f"CHECK: {f}" for f in s.flags)) if text]
        lines.append(f"- **{name}**: " + ("; ".join(said) or "the baseline, nothing to explain"))
    return "\n".join(lines)


def remote_stream(remote: Remote, prompt: str, tokens: int, sampling: SamplingParams, stopped: Callable[[], bool]):
    """The remote lane as `measured` runs an entrant: no engine events; its run is the result."""
    run = remote.stream(prompt, tokens, sampling.temperature, sampling.seed, stopped)
    yield from ()
    return None, run


def remote_row(lane: str, runs: list[RemoteRun], plain: list[Trace]) -> list[Any]:
    """The remote lane's table row: its median round's tok/s and the median of its rounds' ratios to plain
    decoding's tok/s in the same round; the columns about steps do not apply."""
    ratio = median_ratio(runs, [compute(p).tokens_per_s for p in plain])
    return [lane, round(median_round(runs).tokens_per_s, 1), f"{ratio:.2f} (remote, wall clock)", "n/a (remote)",
            "n/a (no steps)", "n/a", "not checked (remote)", "remote"]


def replay_speed(end_s: float) -> float:
    """How much faster than measured a race of end_s engine seconds replays (below 1: slow motion)."""
    shortest, longest = REPLAY_S
    return min(max(end_s / longest, 1.0), end_s / shortest) if end_s > 0 else 1.0


def run_race(prompt: str, rivals: list[str] | None, max_new_tokens: Any, temperature: Any, seed: Any, plan: str,
             model_source: str, draft_source: str, device: str, dtype: str, weights: str,
             endpoint: str, endpoint_model: str, endpoint_key: str, history: list[dict[str, Any]] | None,
             run: int | None = None, request: gr.Request | None = None):
    """Yields (lanes HTML, status, table, checks, chart, history): first while measuring, then the synchronised replay.
    endpoint, endpoint_model, endpoint_key: the remote lane's server, where REMOTE is chosen.
    run: its number in `STOPS`; once stopped it ends between two engine steps, showing nothing measured."""
    status = partial(status_frame, 6, 1)
    remote: Remote | None = None
    try:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError("prompt must be a non-empty string")
        public = catalog.access.public
        chosen, lanes_offered = list(rivals or []), [*racers(), *([] if public else [REMOTE])]
        unknown = [r for r in chosen if r not in lanes_offered]
        if unknown or not 1 <= len(chosen) <= MAX_RIVALS:
            raise ConfigError(f"algorithms: choose 1 to {MAX_RIVALS} of {', '.join(lanes_offered)} to race "
                              f"against plain decoding" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        offered = {PLAIN: Entrant(registry.PLAIN), **racers()}
        sampling = SamplingParams(temperature=as_float("temperature", temperature), seed=as_seed(seed))
        tokens = as_int("max_new_tokens", max_new_tokens)
        chosen_plan = as_plan(plan)
        GenerationParams(max_new_tokens=tokens)  # refuses a bad length before any model loads
        names = [PLAIN, *(name for name in chosen if name != REMOTE)]
        # a malformed URL is refused before anything is asked of it
        url = endpoint_url(endpoint) if REMOTE in chosen else None
        if STOPS.stopped(run):  # while it waited in the queue
            yield status(STOPPED)
            return
        QUOTA.take(request, tokens * len(names) * ROUNDS)
        if url is not None:
            yield status(f"asking {markdown_text(url, 120)} for its model")
            remote = Remote(url, endpoint_model, endpoint_key)
        spec = target_spec(model_source, device, dtype, weights)
        yield status(f"loading model {spec.source!r}")
        target = get_model(spec)
        proposers = {name: make_proposer(target, offered[name].algo, None, offered[name].copies, draft_source)
                     for name in names}
        yield status("warming up (first calls allocate buffers; not measured)")
        for name in names:
            warm_up(target, prompt, proposers[name], sampling,
                    GenerationParams(max_new_tokens=WARMUP_TOKENS, kv=offered[name].kv), offered[name].algo)
        streams: dict[str, Any] = {
            name: partial(stream_generate, target, prompt, proposers[name], sampling,
                          GenerationParams(max_new_tokens=tokens, kv=offered[name].kv, plan=chosen_plan),
                          offered[name].algo)
            for name in names}
        if remote is not None:
            remote.stream(prompt, WARMUP_TOKENS, sampling.temperature, sampling.seed)
            streams[REMOTE] = partial(remote_stream, remote, prompt, tokens, sampling, partial(STOPS.stopped, run))
        traces = yield from measured(streams, lambda name: f"**{name}**", status, partial(STOPS.stopped, run))
    except (ConfigError, ModelLoadError, ValueError) as exc:
        message = in_labels(str(exc))
        yield status(f"not run: {markdown_text(message, 300)}")  # not "loading model ..." left standing
        raise gr.Error(message, duration=None) from exc
    if traces is None:
        yield status(STOPPED)
        return
    remote_runs: list[RemoteRun] = traces.pop(REMOTE, [])  # type: ignore[arg-type]
    remote_name = f"{REMOTE}: {remote.label}" if remote is not None else REMOTE
    speedups = compare(traces, PLAIN)
    # each lane replays its median round and says where that round's time went (`speedup.shown_round`)
    rounds = {name: shown_round(traces, PLAIN, name) for name in traces if name != PLAIN}
    shown = {name: rounds[name][0] if name in rounds else median_run(runs) for name, runs in traces.items()}
    # a proposing lane that drafted in no round (`Speedup.kept` None) says why instead of a speedup
    idle = {name for name in names[1:] if offered[name].algo != registry.PLAIN and speedups[name].kept is None}
    costs = one_request_costs(target)

    def why(name: str, trace: Trace) -> str:
        if name == PLAIN:
            return ""
        return (drafting_note(trace, costs) or "") if name in idle else "the round shown: " + rounds[name][1].why()
    whys = {name: why(name, trace) for name, trace in shown.items()}
    lanes: list[Lane | RemoteLane] = [Lane(name, trace.events, whys[name]) for name, trace in shown.items()]
    remote_lane = None
    if remote_runs:
        remote_lane = RemoteLane(remote_name, median_round(remote_runs), REMOTE_NOTE)
        lanes.append(remote_lane)
    end = max(lane.wall_s for lane in lanes)
    speed = replay_speed(end)
    pace = ("at the measured pace" if speed == 1 else f"{speed:.1f}x faster than measured" if speed > 1
            else f"in slow motion, {1 / speed:.1f}x slower than measured")
    start = time.perf_counter()
    while (t := (time.perf_counter() - start) * speed) < end and not STOPS.stopped(run):  # Stop: to the end
        yield (render_race(lanes, t), f"replaying {pace}: engine time {t:.2f} s", *[gr.update()] * 4)
        time.sleep(FRAME_S)
    plain = shown[PLAIN].finished().token_ids
    rows = [_row(speedups[name], trace.finished().token_ids == plain if sampling.greedy else None, name not in idle)
            for name, trace in shown.items()]
    checks = _checks(speedups, whys)
    if remote_lane is not None:
        rows.append(remote_row(remote_name, remote_runs, traces[PLAIN]))
        counted = "its server's usage count" if remote_lane.run.counted == "usage" else "its streamed chunks"
        checks += f"\n- **{markdown_text(remote_name, 120)}**: {REMOTE_NOTE}; tokens counted by {counted}"
    flagged = sum(bool(s.flags) for s in speedups.values())
    done = (f"**{winner(speedups)}.** Each lane replayed {pace} (its median round of {ROUNDS}; plan "
            f"{chosen_plan}). Engine time only; page drawing is never counted."
            + (" The remote lane is wall-clock time over HTTP: not an engine figure." if remote_lane else "")
            + (f" **{flagged} row(s) flagged: see the checks below the table.**" if flagged else ""))
    metrics = {name: compute(trace) for name, trace in shown.items()}
    yield (render_race(lanes), done, rows, checks,
           tokens_time_figure({n: tr.events for n, tr in shown.items()}, {n: line(offered[n]) for n in shown},
                              {remote_name: remote_lane.series()} if remote_lane else None),
           [*(history or []), *(history_entry(shown[n], metrics[n], speedups[n].speedup if n != PLAIN else None)
                                for n in shown)])


def build_tab(model: tuple[gr.Component, ...], on_gpu: Callable[[Callable], Callable], history: gr.State) -> None:
    gr.Markdown(f"Plain decoding against up to four others on one prompt. Every run is **measured alone**, "
                f"interleaved over {ROUNDS} rounds; each lane then **replays** its median round from its own "
                "timestamps, so none competes for the processor. Each speedup is the median of its rounds and says "
                "where a step's time went; a row the measurement cannot explain is flagged. At temperature 0 every "
                "algorithm must produce plain decoding's tokens; the table checks it.")
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=300):
            prompt = gr.Textbox(PROMPT, label="Prompt", lines=3, max_lines=10)
            offered, public = racers(), catalog.access.public
            rivals = gr.CheckboxGroup([*offered, *([] if public else [REMOTE])],
                                      value=[name for name, lane in offered.items()
                                             if lane.algo in FAVOURITES and lane.copies is None],
                                      label=f"Race against plain decoding (1 to {MAX_RIVALS})")
            with gr.Accordion(f"{REMOTE} lane: server URL, model, API key", open=False, visible=not public):
                gr.Markdown("Tick **OpenAI endpoint** above to stream the same prompt from a server (vLLM, SGLang, "
                            "llama.cpp's, or `python -m playground serve`) in the same rounds. Its lane is wall-clock "
                            "time over HTTP: no steps, no exactness check.")
                endpoint = gr.Textbox("", label="URL", placeholder="http://127.0.0.1:8000/v1", max_lines=1)
                with gr.Row():
                    endpoint_model = gr.Textbox("", label="model", placeholder="the first it lists", max_lines=1)
                    endpoint_key = gr.Textbox("", label="API key", placeholder="none", type="password", max_lines=1)
            with gr.Row():
                max_new_tokens = gr.Number(48, label="max new tokens (1..4096)", step=1)
                temperature = gr.Number(0.0, label="temperature (0 or below 1e-5 = greedy)")
                seed = gr.Number(0, label="seed (-1 = random)", step=1)
            plan = gr.Radio(list(PLANS), value=AS_SET, label="Plan",
                            info="as-set: every lane drafts and verifies all its settings ask for. measured: a "
                                 "step verifies only what should save time on this machine's measured costs.")
            with gr.Row():
                run = gr.Button("Race", variant="primary", scale=3)
                stop = gr.Button(STOP, variant="stop", scale=1)
        with gr.Column(scale=3, min_width=300):
            status = gr.Markdown(elem_id="pg-race-status")
            lanes = gr.HTML(elem_id="pg-race")
    table = gr.Dataframe(headers=TABLE_HEADERS, interactive=False, elem_id="pg-race-table", wrap=True,
                         # widths in pixels: on a phone the table scrolls sideways instead of crushing its columns
                         column_widths=["180px", "90px", "110px", "80px", "190px", "80px", "90px", "170px"])
    with gr.Accordion("Checks: where each lane's time went, and any flag in full", open=False):
        checks = gr.Markdown(elem_id="pg-race-checks")
    chart = gr.Plot(elem_id="pg-race-plot", show_label=False)
    stoppable(run, stop, on_gpu(run_race), [prompt, rivals, max_new_tokens, temperature, seed, plan, *model,
                                             endpoint, endpoint_model, endpoint_key, history],
              [lanes, status, table, checks, chart, history], show="pg-race-status", api_name="race",
              show_progress="hidden")
