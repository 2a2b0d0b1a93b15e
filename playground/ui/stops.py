"""The Stop buttons. A run that its visitor stops ends itself between two engine steps (or, still waiting in the
queue, as soon as its turn comes) and says so, instead of having its task cancelled: a cancel leaves the worker
thread running to its next frame, and on a busy server the browser may show that cancel as an error."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import gradio as gr

STOPPED = "stopped: nothing measured is shown (a run shows once every round of it is measured)"
STOP, STOPPING = "Stop", "Stopping…"  # the Stop button's label, idle and while its run ends


class Stops:
    """Runs by number: each click of a run button draws a new one (`start`), Stop marks it while it lasts (`stop`),
    the run reads the mark between steps (`stopped`) and forgets its number when it ends (`end`)."""

    def __init__(self) -> None:
        self._numbers = itertools.count(1)
        self._live: set[int] = set()
        self._marked: set[int] = set()
        self._lock = threading.Lock()

    def start(self) -> int:
        with self._lock:
            run = next(self._numbers)
            self._live.add(run)
        return run

    def stop(self, run: int | None) -> bool:
        """Mark the run; False when it has already ended (or never started)."""
        with self._lock:
            if run not in self._live:
                return False
            self._marked.add(run)
        return True

    def stopped(self, run: int | None) -> bool:
        return run in self._marked

    def live(self, run: int | None) -> bool:
        return run in self._live

    def end(self, run: int | None) -> None:
        with self._lock:
            self._live.discard(run)
            self._marked.discard(run)


STOPS = Stops()


# every event that runs a model (a Decode, a Race, a Memory run, a load, a measurement) waits in this one queue, one
# at a time (the app's default limit): two runs never share the processor, so every speed shown is one run's
RUN_QUEUE = "runs"


def stoppable(run: gr.Button, stop: gr.Button, fn: Callable, inputs: Sequence[gr.Component],
              outputs: Sequence[gr.Component], show: str | None = None, **how: Any):
    """Wire a run button and its Stop: the run button stays disabled while its run lasts; `fn` gets the run's number
    after `inputs` and checks `STOPS.stopped` between engine steps, and its last frame says it stopped; Stop marks
    the run and reads "Stopping…" (disabled) until the run has ended. Returns the run's event (a stopped run ends
    successfully too).

    Stop writes only its own button, never a line the run writes: its answer and the run's frames come back on
    different connections, in either order. Its follow-up (`settle`) is sent once its answer is shown and resets
    the label if the run has already ended, so a late answer cannot leave "Stopping…" behind.

    show: the id of the element where the run's output starts; where a narrow screen stacks it below the fold (a
    phone), the run button scrolls to it, so the run is seen as it happens."""
    number = gr.State(None)
    if show is not None:
        run.click(None, js=f"() => {{ const shown = document.getElementById('{show}'); if (shown && "
                           "shown.getBoundingClientRect().top > window.innerHeight) "
                           "shown.scrollIntoView({behavior: 'smooth', block: 'start'}); }")
    started = run.click(lambda: (gr.update(interactive=False), STOPS.start()), None, [run, number],
                        api_visibility="private", queue=False).then(fn, [*inputs, number], outputs,
                                                                    concurrency_id=RUN_QUEUE, **how)
    idle = gr.update(value=STOP, interactive=True)

    def ended(run_number: int | None) -> tuple[dict, dict]:
        STOPS.end(run_number)
        return gr.update(interactive=True), idle

    for after in (started.then, started.failure):  # in the browser `then` does not follow a failed run
        after(ended, [number], [run, stop], api_visibility="private", queue=False)

    def settle(run_number: int | None) -> dict:
        return gr.update() if STOPS.live(run_number) else idle  # still live: `ended` comes after this

    stop.click(lambda n: gr.update(value=STOPPING, interactive=False) if STOPS.stop(n) else gr.update(), [number],
               stop, api_visibility="private", queue=False).then(settle, [number], stop, api_visibility="private",
                                                                 queue=False)
    return started
