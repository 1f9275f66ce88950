"""Stop strings on streamed text deltas, and stop/length decisions per token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.sampling import SamplingParams, StopStringMatcher
from tokenmill.sampling import finish_reason as check_stop_token


def stream(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    """Feed deltas until stopped; returns every emitted piece (flush included)."""
    emitted = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        emitted.append(text)
        if stopped:
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


@pytest.mark.parametrize(
    "deltas",
    [
        ["Hello ###", " world"],
        ["Hello #", "## world"],
        ["Hello ##", "# world"],
        ["Hello #", "#", "# world"],
        ["Hel", "lo ", "#", "#", "#"],
    ],
)
def test_stop_string_split_across_deltas(deltas: list[str]) -> None:
    matcher = StopStringMatcher(["###"])
    emitted, stopped = stream(matcher, deltas)
    assert stopped and matcher.matched == "###"
    assert "".join(emitted) == "Hello "
    assert all("#" not in piece for piece in emitted)  # not even part of it leaks


def test_partial_match_is_held_then_released() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("a </e") == ("a ", False)
    assert matcher.feed("n") == ("", False)
    assert matcher.feed("x") == ("</enx", False)  # could no longer become "</end>"
    assert matcher.feed("</") == ("", False)
    assert matcher.flush() == "</"


def test_earliest_stop_string_wins_and_feed_after_stop_is_empty() -> None:
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.feed("hello world!") == ("hel", True)
    assert matcher.matched == "lo w"
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush() == ""


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(["a", ""])


alphabet = st.text(alphabet="ab#", min_size=0, max_size=40)
stop_lists = st.lists(st.text(alphabet="ab#", min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(text=alphabet, stops=stop_lists, data=st.data())
def test_stream_equals_text_cut_at_first_stop(text: str, stops: list[str], data) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    matcher = StopStringMatcher(stops)
    emitted_so_far = ""
    fed = ""
    emitted_lengths = []
    for delta in deltas:
        fed += delta
        piece, stopped = matcher.feed(delta)
        emitted_so_far += piece
        emitted_lengths.append(len(emitted_so_far))
        if stopped:
            break
        # Nothing that could still grow into a stop string has been shown: no
        # emitted position starts a tail of the text fed so far that begins a stop string.
        for j in range(len(emitted_so_far)):
            assert not any(s.startswith(fed[j:]) for s in stops)
    else:
        emitted_so_far += matcher.flush()

    starts = [i for s in stops if (i := fed.find(s)) >= 0]
    first = min(starts, default=len(fed))
    assert emitted_so_far == fed[:first]
    assert matcher.stopped == bool(starts)
    # No emission ever reached into an occurrence of a stop string that completed.
    occurrences = [i for s in stops for i in range(len(fed)) if fed.startswith(s, i)]
    assert all(n <= min(occurrences, default=len(fed)) for n in emitted_lengths)
    if not starts:
        assert fed == text


# --------------------------------------------------------------------------- stop tokens

EOS = {2, 3}


@pytest.mark.parametrize(
    ("token", "params", "n", "reason"),
    [
        (5, SamplingParams(max_tokens=4), 1, None),
        (2, SamplingParams(max_tokens=4), 1, "stop"),
        (3, SamplingParams(max_tokens=4), 4, "stop"),  # EOS beats length on the last token
        (2, SamplingParams(max_tokens=4, ignore_eos=True), 1, None),
        (2, SamplingParams(max_tokens=4, ignore_eos=True), 4, "length"),
        (7, SamplingParams(max_tokens=4, stop_token_ids=[7]), 1, "stop"),
        (7, SamplingParams(max_tokens=4, stop_token_ids=[7], ignore_eos=True), 1, "stop"),
        (5, SamplingParams(max_tokens=4), 4, "length"),
        (5, SamplingParams(max_tokens=1), 1, "length"),
    ],
)
def test_check_stop_token(token: int, params: SamplingParams, n: int, reason: str | None) -> None:
    assert check_stop_token(token, params, EOS, n) == reason
