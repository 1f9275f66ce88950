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

_slow: set[str] = set()
_config: pytest.Config | None = None
_last_file = [""]  # the file of the test that started last


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> str:
    _slow.clear()
    _slow.update(item.nodeid for item in items if item.get_closest_marker("slow"))
    if not _slow:
        return ""
    return (
        f"{len(_slow)} of {len(items)} selected tests are slow (real models, named as they "
        f'start); -m "not slow" runs only the fast ones'
    )


@pytest.hookimpl(trylast=True)  # after the terminal reporter has written the file's name
def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    # right after pytest writes a file's name the line already ends in a space
    first_in_file = location[0] != _last_file[0]
    _last_file[0] = location[0]
    if nodeid not in _slow or _config is None or _config.get_verbosity() > 0:
        return
    reporter = _config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    name = location[2].removeprefix("test_")
    reporter.write(f"{'' if first_in_file else ' '}{name} ", cyan=True)
    reporter.flush()
