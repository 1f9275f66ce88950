"""When to stop generating, and what text a stream may show before it stops.

Stop strings are matched on detokenized text, not tokens: a stop string can
span several tokens, and a token can hold the end of one stop string and the
start of another. A streaming client must never see any part of a stop string,
so the matcher holds back every trailing piece of text that could still grow
into one, and releases it only once it cannot (or when generation ends for
another reason, via `flush`).

Why a request ends is decided here too, in one place: `finish_reason`, and the
`FinishReason` every layer reports (the engine, `LLM`, the server's JSON).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence

from tokenmill.sampling.params import SamplingParams


class FinishReason(enum.StrEnum):
    """Why a request ended, spelled as OpenAI's finish_reason: a str, so JSON, f-strings
    and comparisons with the wire text all see "stop", "length", ..."""

    STOP = "stop"  # an EOS or stop token, a stop string, or a completed grammar
    LENGTH = "length"  # max_tokens, the model's context, or a prompt the pool cannot hold
    TOOL_CALLS = "tool_calls"  # stopped after writing tool calls (the server parses them)
    ABORT = "abort"  # the caller stopped it (e.g. its client went away): never sent
    ERROR = "error"  # it alone failed in a step: its client gets an error, not a reason

    def with_tool_calls(self) -> FinishReason:
        """The reason once the output parsed into tool calls: a model that stopped after
        its calls finished for them; one cut short stays cut short."""
        return FinishReason.TOOL_CALLS if self is FinishReason.STOP else self


class StopStringMatcher:
    """Streams text deltas through, cutting at the first stop string.

    Invariant: the concatenation of everything `feed` (and `flush`) returned is
    the text fed so far, truncated before the earliest-starting stop-string
    occurrence in it. An occurrence can never start inside already-emitted text,
    because any text that might begin one is held back.
    """

    def __init__(self, stop: Sequence[str]):
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stop))
        # A held suffix is a proper prefix of some stop string, so shorter than it.
        self._max_held = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add newly generated text; return (text safe to emit now, stopped)."""
        if self.stopped:
            return "", True
        text = self._held + delta
        hits = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if hits:
            start, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            self._held = ""
            return text[:start], True
        cut = len(text) - self._partial_suffix_len(text)
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """Release held-back text when generation ends without a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._max_held), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0


def is_stop_token(token_id: int, params: SamplingParams, eos_token_ids: Collection[int]) -> bool:
    """Whether token_id ends generation as a stop token, whose own text is never shown: an
    EOS token (unless params.ignore_eos) or one of params.stop_token_ids."""
    eos = token_id in eos_token_ids and not params.ignore_eos
    return eos or token_id in params.stop_token_ids


def finish_reason(
    token_id: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    num_generated: int,
    *,
    num_tokens: int = 0,
    max_model_len: int | None = None,
    stop_string: bool = False,
    grammar_complete: bool = False,
) -> FinishReason | None:
    """Why generation ends after sampling token_id as the num_generated-th output token,
    or None if it goes on. The first that holds wins:

        STOP    token_id is a stop token (is_stop_token): the caller leaves its text out
        STOP    its text completed a stop string (stop_string, StopStringMatcher's)
        STOP    the grammar accepts the output and would allow only EOS next
                (grammar_complete): ending now saves a forward pass for that EOS
        LENGTH  params.max_tokens tokens generated, or the sequence (num_tokens: prompt
                and output) fills the model's context (max_model_len)
    """
    if is_stop_token(token_id, params, eos_token_ids) or stop_string or grammar_complete:
        return FinishReason.STOP
    if num_generated >= params.max_tokens:
        return FinishReason.LENGTH
    if max_model_len is not None and num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
