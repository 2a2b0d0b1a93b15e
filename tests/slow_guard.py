"""A pytest plugin: a test whose setup, call and teardown take longer than --max-test-seconds (120 by default, on the
machine the suite runs on) fails the run, and the summary lists it beside the slowest tests, so that a slow test is
seen the day it lands. Loaded by tests/conftest.py."""

from __future__ import annotations

import pytest

MAX_TEST_SECONDS = 120.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--max-test-seconds", type=float, default=MAX_TEST_SECONDS,
                     help=f"fail the run when a test takes longer (default {MAX_TEST_SECONDS:.0f}; 0: no limit)")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SlowGuard(config.getoption("--max-test-seconds")), "slow-guard")


class SlowGuard:
    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.seconds: dict[str, float] = {}  # node id -> seconds in its setup, call and teardown

    def too_slow(self) -> list[tuple[float, str]]:
        return sorted(((s, node) for node, s in self.seconds.items() if self.limit and s > self.limit), reverse=True)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == pytest.ExitCode.OK and self.too_slow():
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        slow = self.too_slow()
        if not slow:
            return
        terminalreporter.section(f"tests over {self.limit:g} s (--max-test-seconds): the run fails", red=True)
        for seconds, node in slow:
            terminalreporter.line(f"{seconds:7.1f} s  {node}")
        terminalreporter.line("the slowest of all:")
        for node, seconds in sorted(self.seconds.items(), key=lambda item: -item[1])[:10]:
            terminalreporter.line(f"{seconds:7.1f} s  {node}")
