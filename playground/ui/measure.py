"""Measuring in the app: entrants run on the engine alone, interleaved over rounds (`playground.speedup`), while
the page shows only a progress line; the Decode and Race tabs replay what was measured afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Mapping
from typing import Any

import gradio as gr

from ..speedup import ROUNDS, order
from ..trace import CommitEvent, Event, Trace

PROGRESS_S = 0.5  # while measuring, a progress line at most this often


def status_frame(outputs: int, at: int, line: str) -> tuple:
    """An event's outputs left as they are but one: the status line at index `at`."""
    return (*[gr.update()] * at, line, *[gr.update()] * (outputs - at - 1))


Stream = Callable[[], Generator[Event, None, tuple[Any, Trace]]]


def measured(streams: Mapping[str, Stream], label: Callable[[str], str], frame: Callable[[str], tuple],
             stopped: Callable[[], bool]):
    """Run every entrant's stream to its end, interleaved over ROUNDS rounds (`speedup.order`); yields
    `frame(progress line)` at most every PROGRESS_S (the engine's clock stops while it is shown) and returns each
    entrant's traces in round order, or None as soon as `stopped()` says so between two engine steps."""
    traces: dict[str, list[Trace]] = {name: [] for name in streams}
    total, last = len(streams) * ROUNDS, time.perf_counter()
    for done, (round_, name) in enumerate(order(list(streams), ROUNDS)):
        stream, tokens = streams[name](), 0
        while True:
            if stopped():
                stream.close()  # its engine hands back what it holds
                return None
            try:
                event = next(stream)
            except StopIteration as stop:
                traces[name].append(stop.value[1])
                break
            tokens += event.num_tokens if isinstance(event, CommitEvent) else 0
            if time.perf_counter() - last >= PROGRESS_S:
                last = time.perf_counter()
                yield frame(f"measuring run {done + 1} of {total} (round {round_ + 1} of {ROUNDS}: {label(name)}, "
                            f"{tokens} tokens so far); one at a time, so none slows another; the replay follows")
    return traces
