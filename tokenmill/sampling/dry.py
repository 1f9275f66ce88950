"""DRY, "don't repeat yourself" (Weidmann; llama.cpp's and koboldcpp's dry sampler): a
penalty on the tokens that would extend a repetition of the context.

If the context ends with a run of tokens that also occurred earlier, followed there by
token t, then emitting t would repeat that run one step further. For every such t the
sampler takes the longest run n (at least `allowed_length`) and subtracts

    multiplier * base ** (n - allowed_length)

from its logit, so short echoes pass and long verbatim copies grow ever less likely.
Runs do not reach back across a sequence breaker (a newline, ":", a quote ...): the
repetition of a line's opening words in a list, say, is not punished. A breaker is a
string; a token whose text contains it is one on its own, and a token whose text ends
with the breaker's beginning is one when the tokens after it spell the rest.

Two stages: `sequence_breakers` once per vocabulary and breaker list (it looks at every
token's text), `penalties` per row and step, over the last `last_n` tokens of the
context (prompt and output).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's and koboldcpp's defaults
MAX_BREAKER_CHARS = 40  # a longer breaker is cut to this, as llama.cpp does
MAX_TAIL_TOKENS = 20  # a breaker's continuation after its head token, at most
_FLOAT_MAX_LOG = 88.7228391  # log of float32's largest: base ** exponent stays finite


@dataclass(frozen=True)
class Breakers:
    """The sequence breakers of one vocabulary: head token id -> the token sequences that
    must follow it to complete a breaker (an empty tail: the head is one by itself)."""

    tails: dict[int, tuple[tuple[int, ...], ...]]

    @functools.cached_property
    def heads(self) -> np.ndarray:
        """[H] int64: the head token ids, for the search of a context."""
        return np.fromiter(self.tails, np.int64, len(self.tails))

    def single_token(self, token_id: int) -> bool:
        return () in self.tails.get(token_id, ())


def sequence_breakers(
    token_bytes: Sequence[bytes], encode: Callable[[str], list[int]], breakers: Sequence[str]
) -> Breakers:
    """Find each breaker's head tokens in the vocabulary.

    token_bytes: each id's text as bytes (Tokenizer.token_bytes); encode: text -> ids
    without BOS or special-token parsing, for the rest of a breaker that a head token
    only begins."""
    tails: dict[int, list[tuple[int, ...]]] = {}
    for breaker in breakers:
        text = breaker[:MAX_BREAKER_CHARS].encode()
        if not text:
            continue
        for token_id, word in enumerate(token_bytes):
            if text in word:
                tails.setdefault(token_id, []).append(())
                continue
            # The word ends with the breaker's first k bytes: the tokens of the rest follow
            for k in range(min(len(text) - 1, len(word)), 0, -1):
                if word.endswith(text[:k]):
                    rest = text[k:].decode(errors="ignore")
                    tail = tuple(encode(rest)[:MAX_TAIL_TOKENS])
                    if tail not in tails.get(token_id, []):
                        tails.setdefault(token_id, []).append(tail)
    return Breakers({t: tuple(s) for t, s in tails.items()})


def penalties(
    context: np.ndarray,
    breakers: Breakers,
    multiplier: float,
    base: float,
    allowed_length: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The DRY penalty of every token that would extend a repeat of the end of `context`.

    context: [L] int64, the last tokens (prompt and output) the sampler looks at, oldest
    first. Returns (token ids [M] int64, penalties [M] float32) to subtract from the
    logits; empty when nothing repeats far enough."""
    empty = (np.zeros(0, np.int64), np.zeros(0, np.float32))
    n_ctx = len(context)
    if multiplier == 0.0 or base < 1.0 or n_ctx <= allowed_length:
        return empty
    back = context[::-1]  # [L] back[0] is the newest token
    # The newest breaker bounds every run: a run may not reach back across it
    limit = n_ctx
    heads = np.flatnonzero(np.isin(back, breakers.heads))
    for i in heads.tolist():
        longest = -1
        for tail in breakers.tails[int(back[i])]:
            s = len(tail)
            if longest < s <= i and all(tail[o] == back[i - o - 1] for o in range(s)):
                longest = s
        if longest >= 0:
            limit = i - longest
            break
    if limit < allowed_length:
        return empty
    # run[k - 1]: how many tokens before position k (counted back from the newest) match
    # the newest ones, capped at the limit; grown one token at a time over the positions
    # still matching, which are few after the first step in any natural text
    run = np.zeros(n_ctx - 1, np.int64)  # [L-1]
    alive = np.arange(1, n_ctx)
    for step in range(limit):
        alive = alive[alive + step < n_ctx]
        alive = alive[back[alive + step] == back[step]]
        if len(alive) == 0:
            break
        run[alive - 1] += 1
    ends = np.flatnonzero(run >= allowed_length)  # positions k - 1 with a long enough run
    if len(ends) == 0:
        return empty
    # The token after each run's earlier copy (back[k - 1]) is the one that extends it
    longest: dict[int, int] = {}
    for token, n in zip(back[ends].tolist(), run[ends].tolist(), strict=True):
        if n > longest.get(token, -1):
            longest[token] = n
    cap = int(_FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    ids, values = [], []
    for token, n in longest.items():
        if breakers.single_token(token):
            continue  # a breaker ends the run it would extend: never penalised
        exponent = n - allowed_length
        if cap > 0:
            exponent = min(exponent, cap)
        ids.append(token)
        values.append(multiplier * base**exponent)
    return np.array(ids, np.int64), np.array(values, np.float32)
