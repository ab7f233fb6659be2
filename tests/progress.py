"""pytest plugin (`pytest -p tests.progress`, as tox.ini runs it): one line per finished test
file instead of pytest's dots, prefixed with the tox env's name.

Why: `tox -p -o` streams four envs' output into one log; dots from four pytest processes mix
into noise, while a line such as

    [py311] 12/96 files, 340/1460 tests, 1m05s  tests/codec/test_wire.py: 42 passed

stays readable, and shows progress in a non-interactive shell (CI) where tox has no spinner.
Only the dots go: failure reports and the final summary are pytest's own. Use it with
`-o console_output_style=classic` (no percentages, which counted the dots).
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest


class _FileLines:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.prefix = f"[{os.environ.get('TOX_ENV_NAME') or 'pytest'}] "
        self.t0 = time.monotonic()
        self.files: list[str] = []
        self.current: str | None = None
        self.counts: Counter = Counter()
        self.tests_done = 0
        self.n_tests = 0

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.n_tests = len(session.items)
        self.files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in session.items))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_report_teststatus(self, report, config):
        # Drop only the letter (the dot): the category and word feed the summary.
        outcome = yield
        category, _letter, word = outcome.get_result()
        outcome.force_result((category, "", word))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::")[0]
        if path != self.current:
            self._flush()
            self.current = path
        if report.when == "call":
            self.counts[report.outcome] += 1
        elif report.failed:  # a fixture failed: pytest calls it an error
            self.counts["error"] += 1
        elif report.skipped:  # skipped in setup (skipif, a missing build)
            self.counts["skipped"] += 1

    def pytest_runtest_logfinish(self) -> None:
        self.tests_done += 1

    def pytest_sessionfinish(self) -> None:
        self._flush()

    def _flush(self) -> None:
        if self.current is None:
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        index = self.files.index(self.current) + 1 if self.current in self.files else 0
        elapsed = int(time.monotonic() - self.t0)
        what = ", ".join(f"{n} {outcome}" for outcome, n in sorted(self.counts.items())) or "nothing run"
        line = (f"{self.prefix}{index}/{len(self.files)} files, {self.tests_done}/{self.n_tests} tests, "
                f"{elapsed // 60}m{elapsed % 60:02d}s  {self.current}: {what}")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(line)
            reporter.flush()
        self.current, self.counts = None, Counter()


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_FileLines(config), "apir-file-lines")
