"""The slow_progress plugin: slow tests name themselves in pytest's default output."""

from __future__ import annotations

pytest_plugins = ["pytester"]

SAMPLE = """
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_real_model():
    pass

@pytest.mark.slow
def test_another_model():
    pass
"""


def _run(pytester, *args):
    pytester.makeini("[pytest]\nmarkers =\n    slow: real-model tests\n")
    pytester.makepyfile(test_sample=SAMPLE)
    # the plugin module is already imported (by tests/conftest.py), hence no rewriting
    quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning", "-p", "no:cacheprovider"]
    return pytester.runpytest("-p", "slow_progress", *quiet, *args)


def test_slow_tests_are_named_as_they_start(pytester):
    result = _run(pytester)
    result.assert_outcomes(passed=3)
    result.stdout.re_match_lines([r"2 of 3 selected tests are slow .* -m \"not slow\""])
    result.stdout.re_match_lines([r"test_sample\.py \. real_model \. another_model \. +\[100%\]"])


def test_quiet_when_nothing_slow_is_selected(pytester):
    result = _run(pytester, "-m", "not slow")
    result.assert_outcomes(passed=1, deselected=2)
    assert "are slow" not in result.stdout.str() and "real_model" not in result.stdout.str()


def test_verbose_output_is_left_alone(pytester):
    result = _run(pytester, "-v")
    assert " real_model " not in result.stdout.str()
    result.stdout.fnmatch_lines(["*test_sample.py::test_real_model PASSED*"])
