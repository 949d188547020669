"""Where the suite's time goes, by file: every run ends with the 15 test files that took the
longest (setup, call and teardown of their tests, module fixtures included), beside pytest's
30 slowest tests. The suite must stay under 20 minutes (docs/ENGINEERING.md): a file's own
fixtures (a Ray cluster, a Serve app, a venv) are often more of it than any one test."""

from __future__ import annotations

from collections import defaultdict

import pytest

_BY_FILE: dict[str, float] = defaultdict(float)
_COUNT: dict[str, int] = defaultdict(int)
SHOWN = 15


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _BY_FILE[path] += report.duration
    if report.when == "call":
        _COUNT[path] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _BY_FILE:
        return
    total = sum(_BY_FILE.values())
    terminalreporter.write_sep("=", f"slowest {SHOWN} files ({total:.0f} s in all)")
    for path, secs in sorted(_BY_FILE.items(), key=lambda kv: -kv[1])[:SHOWN]:
        terminalreporter.write_line(f"{secs:8.1f}s  {_COUNT[path]:4d} tests  {path}")
