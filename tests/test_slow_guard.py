"""tests/slow_guard.py: a test over --max-test-seconds fails the run and is named with the slowest."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SLEEPY = """
import time

def test_sleeps():
    time.sleep(0.3)

def test_returns():
    pass
"""


def test_a_test_over_the_limit_fails_the_run_and_is_named(pytester, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the plugin, imported by the run in pytester's folder
    pytester.makepyfile(test_sleepy=SLEEPY)
    over = pytester.runpytest_subprocess("-p", "tests.slow_guard", "--max-test-seconds", "0.2")
    assert over.ret == 1
    over.assert_outcomes(passed=2)
    over.stdout.fnmatch_lines(["*tests over 0.2 s (--max-test-seconds): the run fails*",
                               "*s  test_sleepy.py::test_sleeps", "the slowest of all:"])
    within = pytester.runpytest_subprocess("-p", "tests.slow_guard", "--max-test-seconds", "5")
    assert within.ret == 0 and "the run fails" not in within.stdout.str()
