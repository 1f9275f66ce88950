"""A pytest plugin: slow (real-model) tests announce themselves in the default output.

pytest prints one line per test file and a dot as each test ends. A real-model test can
run for minutes on a small CPU, and a line that sits still that long looks hung, so
each slow test writes its name before its dot:

    tests/test_api_cli.py generate_paris . stream_equals_generate . ...

and the run opens with how many of the selected tests are slow and how to skip them.
`tests/conftest.py` loads this; `-v` output names every test already, so it stays quiet.
"""

from __future__ import annotations

import pytest


class SlowProgress:
    """The hooks, with their state kept per pytest run (a run inside a test, as pytester
    makes, gets its own instance)."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.slow: set[str] = set()
        self.last_file = ""  # the file of the test that started last

    def pytest_report_collectionfinish(self, items: list[pytest.Item]) -> str:
        self.slow = {item.nodeid for item in items if item.get_closest_marker("slow")}
        if not self.slow:
            return ""
        return (
            f"{len(self.slow)} of {len(items)} selected tests are slow (real models, named as "
            f'they start); -m "not slow" runs only the fast ones'
        )

    @pytest.hookimpl(trylast=True)  # after the terminal reporter has written the file's name
    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        # right after pytest writes a file's name the line already ends in a space
        first_in_file = location[0] != self.last_file
        self.last_file = location[0]
        if nodeid not in self.slow or self.config.get_verbosity() > 0:
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        name = location[2].removeprefix("test_")
        reporter.write(f"{'' if first_in_file else ' '}{name} ", cyan=True)
        reporter.flush()


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("slow-progress"):
        config.pluginmanager.register(SlowProgress(config), "slow-progress")
