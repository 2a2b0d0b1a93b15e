"""Forward-cost figures that hold: a curve says when and how quietly it was measured, one taken under load is
detected (and measured again rather than kept), and live corrections never price a forward outside what a
machine can do."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from playground.decoding import costs as costs_module
from playground.decoding.costs import BUSY_CORES, BUSY_SPREAD, ForwardCosts, LiveCosts, LoadMeter, OneRequest
from playground.metrics import perfect

from .test_engine import TINY


def test_a_curve_says_when_and_how_quietly_it_was_measured() -> None:
    quiet = ForwardCosts((1, 8), (1.0, 2.0), "2026-12-06T19:41:07Z", 0.02, 0.03)
    assert not quiet.busy and quiet.provenance() == "measured on this machine 2026-12-06 19:41 UTC, while it was quiet"
    loaded = ForwardCosts((1, 8), (1.0, 2.0), "2026-12-06T19:41:07Z", BUSY_CORES + 0.8, 0.03)
    assert loaded.busy and "under load (other processes kept 1.1 processors busy)" in loaded.provenance()
    noisy = ForwardCosts((1, 8), (1.0, 2.0), "2026-12-06T19:41:07Z", None, BUSY_SPREAD + 0.1)
    assert noisy.busy and "its rounds disagreed by 25%" in noisy.provenance()
    assert "not measured here" in ForwardCosts((1, 8), (1.0, 2.0)).provenance()


def test_the_load_meter_sees_other_processes() -> None:
    """Two processes spinning on this machine's processors while the meter runs are seen as busy processors."""
    if LoadMeter().start is None:
        pytest.skip("no /proc/stat counting this process's processors here: the load is not known")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)  # started
        busy = LoadMeter()
        time.sleep(1.0)
        seen = busy.others()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert seen is not None and seen > BUSY_CORES


def test_a_busy_curve_is_measured_again_and_the_quieter_kept(tmp_path, monkeypatch, unpinned) -> None:
    """A curve taken under load is measured once more at once and the quieter one cached; a cached curve marked
    busy is measured again once by a later process, which keeps the quieter."""
    taken = []

    def measure(model, rounds=5, forwards="eager", requests=1, widths=costs_module.WIDTHS):
        others = taken.pop(0) if widths == costs_module.WIDTHS else 0.0
        return ForwardCosts(widths, tuple(1.0 + 0.1 * w for w in widths), "2026-12-06T19:41:07Z", others, 0.01)

    monkeypatch.setattr(costs_module, "measure", measure)
    monkeypatch.setattr(costs_module, "_READ", {})
    taken[:] = [1.2, 0.9]  # both busy: the quieter is kept, and says so
    first = costs_module.forward_costs(TINY.model, tmp_path)
    assert first.curve.others == 0.9 and "under load" in first.provenance() and not taken
    monkeypatch.setattr(costs_module, "_READ", {})
    taken[:] = [1.5]  # a later process measures again once; busier still: the cached one is kept
    assert costs_module.forward_costs(TINY.model, tmp_path).curve.others == 0.9 and not taken
    monkeypatch.setattr(costs_module, "_READ", {})
    taken[:] = [0.01]  # and once quiet, the quiet curve replaces it
    again = costs_module.forward_costs(TINY.model, tmp_path)
    assert again.curve.others == 0.01 and not again.curve.busy and not taken
    monkeypatch.setattr(costs_module, "_READ", {})
    assert costs_module.forward_costs(TINY.model, tmp_path).curve == again.curve  # quiet: read from the cache


def test_live_corrections_stay_within_what_the_machine_can_do() -> None:
    """One-token forwards timed while the machine was busy and wide ones while it was quiet would make a wide
    forward look cheaper than a one-token one and a perfect proposer gain tenfold: the price of a width stays at
    least the curve's over BOUND and within [1, width]."""
    curve = ForwardCosts((1, 5, 64), (1.0, 1.4, 6.0))
    live = LiveCosts(curve)
    for _ in range(LiveCosts.MEASURED):
        live.record(1, 6.0)  # busy: six times the curve
        live.record(5, 1.4)  # quiet
    def relative(width: int) -> float:
        return live.step_cost(1, width)

    assert relative(5) == pytest.approx(max(1.0, 1.4 / LiveCosts.BOUND))
    assert perfect(relative)[1] <= perfect(OneRequest(curve))[1] * LiveCosts.BOUND + 1e-9
    assert live.slowdown() == pytest.approx(6.0)
    assert "forwards have run 6.0x slower than that since: the machine is busier now" in live.provenance()
    # what reports quote is the curve as measured, whatever the live corrections say meanwhile
    assert OneRequest(live)(5) == pytest.approx(1.4)
    for _ in range(LiveCosts.MEASURED):
        live.record(5, 1000.0)  # a width priced past its tokens run one by one
    assert relative(5) == pytest.approx(5.0) and OneRequest(live)(5) == pytest.approx(1.4)
