"""Threads that share the CPU gracefully with other processes.

The native kernel and PyTorch run a forward on every thread they were given, meeting at a barrier several times a
layer. Alone on the machine that is fastest. Beside other busy processes it is not: when the scheduler takes one of
this process's threads away, the others wait for it at the next barrier, spinning, and a forward waits a whole time
slice many times over (docs/results.md: with two threads each, two neighbours cut plain decoding to a twelfth of its
speed alone, far below a fair third). One thread meets no barrier. So before each engine step `Governor.share` looks
at how busy the other processes keep the processors (`LoadMeter`, at most every INTERVAL seconds): above BUSY
processors it runs on one thread, below QUIET on all it started with. Tokens do not depend on the thread count:
every product and attention row is computed alike whichever thread runs it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from .decoding.costs import LoadMeter

SWITCH_ENV = "PLAYGROUND_SHARE_CPU"  # "0": always every thread
INTERVAL = 0.2  # seconds between looks at the processors
BUSY = 0.5  # processors other processes keep busy, above which a step runs on one thread
QUIET = 0.25  # ... below which it runs on every thread again


class Governor:
    """Sets torch's thread count (which the native kernel reads at each call) from how busy other processes keep
    the processors; `clock` and `meter` are replaceable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 meter: Callable[[], LoadMeter] = LoadMeter) -> None:
        self.clock, self.meter = clock, meter
        self.full = torch.get_num_threads()  # what this process was given: every thread
        self.looked = self.clock()
        self.current = meter()
        self.reason = "alone: every thread"

    def share(self) -> int:
        """The threads the next step runs on (set in torch); looks at the processors at most every INTERVAL."""
        if os.environ.get(SWITCH_ENV, "1") == "0" or self.full <= 1:
            return torch.get_num_threads()
        now = self.clock()
        if now - self.looked < INTERVAL:
            return torch.get_num_threads()
        others = self.current.others()
        self.looked, self.current = now, self.meter()
        if others is None:
            return torch.get_num_threads()
        threads = torch.get_num_threads()
        if others > BUSY and threads != 1:
            threads = 1
            self.reason = f"other processes keep {others:.1f} processors busy: one thread"
        elif others < QUIET and threads != self.full:
            threads = self.full
            self.reason = "alone: every thread"
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads


_GOVERNOR: list[Governor] = []


def share() -> int:
    """This process's governor (made on first use) adjusting the threads for the next step."""
    if not _GOVERNOR:
        _GOVERNOR.append(Governor())
    return _GOVERNOR[0].share()
