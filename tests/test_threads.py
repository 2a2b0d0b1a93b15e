"""The thread governor: one thread while other processes keep the processors busy, every thread again when they
are quiet, never more often than its interval, and not at all where switched off or unknown."""

from __future__ import annotations

import pytest
import torch

from playground import threads


class Meter:
    """A LoadMeter whose reading is set by the test."""

    reading: float | None = 0.0

    def others(self) -> float | None:
        return Meter.reading


@pytest.fixture
def governor(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    now = [0.0]
    governor = threads.Governor(clock=lambda: now[0], meter=Meter)
    yield governor, now
    torch.set_num_threads(before)


def test_one_thread_while_others_are_busy_every_thread_when_quiet(governor):
    governor, now = governor
    Meter.reading = 1.2
    assert governor.share() == 2  # too soon to look
    now[0] = threads.INTERVAL
    assert governor.share() == 1 and torch.get_num_threads() == 1
    assert governor.reason == "other processes keep 1.2 processors busy: one thread"
    Meter.reading = 0.4  # between QUIET and BUSY: stays as it is
    now[0] += threads.INTERVAL
    assert governor.share() == 1
    Meter.reading = 0.1
    looked = now[0]
    now[0] = looked + threads.INTERVAL / 2
    assert governor.share() == 1  # not yet
    now[0] = looked + threads.INTERVAL
    assert governor.share() == 2 and torch.get_num_threads() == 2 and governor.reason.startswith("alone")


def test_an_unknown_load_or_the_switch_changes_nothing(governor, monkeypatch):
    governor, now = governor
    Meter.reading = None
    now[0] = threads.INTERVAL
    assert governor.share() == 2
    Meter.reading = 5.0
    monkeypatch.setenv(threads.SWITCH_ENV, "0")
    now[0] += threads.INTERVAL
    assert governor.share() == 2 and torch.get_num_threads() == 2
