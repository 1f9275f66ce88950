"""The kernels' thread teams (tokenmill/kernels/team.c): 10 ms of regions whose masters
waited for a stalled thread longer than their own work make the next regions run
with one thread less, a cool-down later the whole team is tried again, and a probe that
is slow again doubles the next cool-down. Driven with the library's own entry points
and made-up clock times, so nothing here depends on how fast or how loaded the machine
is; and the numbers are the same whatever team ran.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill import kernels
from tokenmill.layers.quant_linear import QuantLinear

MS = 1_000_000  # ns
US = 1_000
COOL_MIN, COOL_MAX, TRIAL = 20 * MS, 2000 * MS, 200 * MS  # team.c's constants
T0 = 10**15  # made-up times far from the real clock: no real region interferes


@pytest.fixture
def lib():
    lib = kernels.library()
    if lib is None:
        pytest.skip("no native library")
    was = lib.tm_team_adapt(1)  # a fresh start, adaptive
    yield lib
    lib.tm_team_adapt(was)  # and a fresh one for whoever runs next


def stats():
    return kernels.team_stats()


def region(lib, nt, start, work, wait):
    """Tells the team a region of nt threads ran from `start`: its master worked `work` ns,
    then waited `wait` ns at the barrier. Returns its end."""
    lib.tm_team_note(nt, start, start + work, start + work + wait)
    return start + work + wait


def slow_window(lib, t, nt=2):
    """A region right after the last one that fills a window, waiting longer than it
    worked (a stalled thread). Returns its end."""
    return region(lib, nt, t + 5 * US, 5 * MS, 6 * MS)


def test_a_slow_window_shrinks_the_team_until_the_cool_down_ends(lib):
    t = region(lib, 2, T0, 10 * US, 1 * US)  # the first region (after a gap): not counted
    assert lib.tm_team_at(2, 100, t) == 2
    before = stats()
    t = slow_window(lib, t)
    assert stats()["slow_windows"] == before["slow_windows"] + 1
    assert lib.tm_team_at(2, 100, t + 1 * MS) == 1
    assert lib.tm_team_at(4, 100, t + 1 * MS) == 3  # one thread less, whatever was asked
    assert stats()["shrunk_regions"] == before["shrunk_regions"] + 2
    assert lib.tm_team_at(2, 100, t + COOL_MIN) == 2  # cooled down: the probe
    assert stats()["probes"] == before["probes"] + 1
    assert stats()["deficit"] == 0


def test_waits_below_the_work_and_first_regions_after_a_gap_keep_the_team(lib):
    t = region(lib, 2, T0, 10 * US, 1 * US)
    before = stats()["slow_windows"]
    for _ in range(1000):  # 15 ms of decode regions, a third of it waiting
        t = region(lib, 2, t + 1 * US, 10 * US, 5 * US)
    t = region(lib, 2, t + 5 * US, 8 * MS, 7 * MS)  # a GEMM that waited less than it worked
    # A region 5 ms after the last one: its thread may have gone to sleep, and the wait
    # to wake it is not counted.
    t = region(lib, 2, t + 5 * MS, 6 * MS, 5 * MS)
    assert stats()["slow_windows"] == before
    assert lib.tm_team_at(2, 100, t) == 2
    slow_window(lib, t)  # the same wait with no gap: slow
    assert stats()["slow_windows"] == before + 1


def test_probes_double_the_cool_down_when_slow_and_halve_it_when_not(lib):
    t = region(lib, 2, T0, 10 * US, 1 * US)
    t = slow_window(lib, t)
    expected = COOL_MIN
    assert stats()["cool_ns"] == expected
    for _ in range(8):
        t += stats()["cool_ns"]
        assert lib.tm_team_at(2, 100, t) == 2  # the probe
        t = region(lib, 2, t, 10 * US, 1 * US)  # its first region (after the gap)
        t = slow_window(lib, t)  # its window is slow again
        expected = min(2 * expected, COOL_MAX)
        assert stats()["cool_ns"] == expected
        assert lib.tm_team_at(2, 100, t + 1 * MS) == 1
    assert expected == COOL_MAX
    t += COOL_MAX
    probe = t
    assert lib.tm_team_at(2, 100, t) == 2  # a probe that pays off...
    t = region(lib, 2, t, 10 * US, 1 * US)
    while t - probe < TRIAL:  # ... for a whole trial: the first good windows are no proof
        assert stats()["cool_ns"] == COOL_MAX
        t = region(lib, 2, t + 5 * US, 10 * MS, 1 * MS)
    assert stats()["cool_ns"] == COOL_MAX // 2
    # the next slow window, long after: the cool-down remembers the last episode
    t = region(lib, 2, t + 5 * US, 10 * MS, 1 * MS)
    t = slow_window(lib, t)
    assert stats()["cool_ns"] == COOL_MAX // 2
    assert lib.tm_team_at(2, 100, t + COOL_MAX // 2 - 1) == 1
    assert lib.tm_team_at(2, 100, t + COOL_MAX // 2) == 2


def test_a_probe_fails_on_a_slow_window_late_in_its_trial(lib):
    t = region(lib, 2, T0, 10 * US, 1 * US)
    t = slow_window(lib, t)
    t += COOL_MIN
    assert lib.tm_team_at(2, 100, t) == 2
    t = region(lib, 2, t, 10 * US, 1 * US)
    for _ in range(10):  # 110 ms of good windows...
        t = region(lib, 2, t + 5 * US, 10 * MS, 1 * MS)
    t = slow_window(lib, t)  # ...then a slow one, still within the trial
    assert stats()["cool_ns"] == 2 * COOL_MIN
    assert lib.tm_team_at(2, 100, t + 1 * MS) == 1


def test_fixed_team_never_shrinks(lib):
    lib.tm_team_adapt(0)
    before = stats()["slow_windows"]
    t = region(lib, 2, T0, 10 * US, 1 * US)
    t = slow_window(lib, t)
    assert lib.tm_team_at(2, 100, t + 1 * MS) == 2
    assert stats()["adaptive"] == 0 and stats()["slow_windows"] == before
    assert kernels.adaptive_threads(True) is False and kernels.adaptive_threads() is True


def test_team_size_is_capped_by_the_work(lib):
    assert lib.tm_team_at(8, 3, -1) == 3
    assert lib.tm_team_at(8, 0, -1) == 1
    assert lib.tm_team_at(1, 100, -1) == 1


def _shrink_now(lib):
    """A stall at the real clock's now: the next COOL_MIN of regions run one thread less."""
    t = lib.tm_now()
    lib.tm_team_note(2, t, t, t)  # sets the last region's end
    lib.tm_team_note(2, t, t + 1, t + 1 + 15 * MS)


@pytest.mark.parametrize("T", [1, 5, 40])  # the GEMV, the small-T GEMV, the GEMM
def test_shrunk_team_gives_the_same_numbers(lib, T):
    layer = QuantLinear.from_float(torch.randn(1000, 576), "q4")
    x = torch.randn(T, 576)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, old))
        lib.tm_team_adapt(0)
        whole = layer(x)
        lib.tm_team_adapt(1)
        _shrink_now(lib)
        before = stats()["shrunk_regions"]
        shrunk = layer(x)
        # the clock can pass the cool-down on a stalled test process; then it probed
        assert stats()["shrunk_regions"] > before or stats()["probes"] > 0
        torch.set_num_threads(1)
        one = layer(x)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(shrunk, whole) and torch.equal(one, whole)


def test_a_shrink_lowers_torch_threads_of_this_thread_until_the_probe(lib):
    """torch's own parallel regions (over the logits...) run on the same OpenMP pool: they
    shrink with the team, through this thread's OpenMP count, which the probe restores."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        t = region(lib, 4, T0, 10 * US, 1 * US)
        t = slow_window(lib, t, nt=4)
        assert torch.get_num_threads() == 3
        # the kernels get torch's count: 3 means the 4 asked for before the shrink
        assert lib.tm_team_at(torch.get_num_threads(), 100, t + 1 * MS) == 3
        assert lib.tm_team_at(torch.get_num_threads(), 100, t + COOL_MIN) == 4  # the probe
        assert torch.get_num_threads() == 4
        # a count set during a shrink is the caller's: the probe leaves it
        t = region(lib, 4, t + COOL_MIN, 10 * US, 1 * US)  # after the gap: not counted
        t = slow_window(lib, t, nt=4)
        assert torch.get_num_threads() == 3
        torch.set_num_threads(2)
        assert lib.tm_team_at(2, 100, t + 1 * MS) == 1
        assert lib.tm_team_at(2, 100, t + 10 * COOL_MAX) == 2
        assert torch.get_num_threads() == 2
        # a reset (tm_team_adapt) gives the thread its count back too
        t = region(lib, 2, t + 10 * COOL_MAX, 10 * US, 1 * US)
        slow_window(lib, t)
        assert torch.get_num_threads() == 1
        lib.tm_team_adapt(1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
