"""When to stop generating, and what text a stream may show before it stops.

Stop strings are matched on detokenized text, not tokens: a stop string can
span several tokens, and a token can hold the end of one stop string and the
start of another. A streaming client must never see any part of a stop string,
so the matcher holds back every trailing piece of text that could still grow
into one, and releases it only once it cannot (or when generation ends for
another reason, via `flush`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tokenmill.sampling.params import SamplingParams


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


def check_stop_token(
    token_id: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    num_generated: int,
) -> str | None:
    """Finish reason after sampling token_id as the num_generated-th output token.

    "stop" on an EOS token (unless params.ignore_eos) or one of
    params.stop_token_ids; the caller must then leave that token's text out of
    the output. "length" once max_tokens tokens have been generated. Else None.
    """
    if (token_id in eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
