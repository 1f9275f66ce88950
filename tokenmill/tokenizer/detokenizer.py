"""Incremental detokenization: the text each newly generated token adds, for streaming.

Decoding tokens one by one and concatenating goes wrong in two ways. A character can span several
tokens (byte-level BPE splits an emoji or a rare CJK character into bytes, SentencePiece falls
back to `<0xNN>` pieces), so a lone token decodes to U+FFFD. And a SentencePiece piece such as
"▁world" loses its leading space when decoded on its own, because decoding strips the space the
encoder prepended.

So, as vLLM and TGI do, we decode a short window: a few tokens already streamed, for context,
followed by the new ones, and emit what the window's text has gained. While that text ends in
U+FFFD the last character may still be incomplete, so it is held back until a later token
completes it, or until `flush()` at the end of generation. `Tokenizer.decode` is local (text up to
a character boundary never changes as tokens are appended), so the emitted deltas add up exactly to
the decoded text, and each step decodes only the window, not the whole sequence.
"""

from __future__ import annotations

from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated ids, fed one at a time, into text deltas.

    With `prompt_ids=None` the deltas add up to `tokenizer.decode(generated_ids)`. With a prompt,
    its last tokens are the first context, so the deltas add up to the text the generated ids add
    after the prompt (a SentencePiece "▁Hello" right after the prompt streams as " Hello").
    """

    CONTEXT = 4  # tokens already streamed that are decoded again in front of the new ones

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        *,
        skip_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._window: list[int] = list(prompt_ids or [])[-self.CONTEXT :]
        self._done = _settled_length(
            self._decode(self._window)
        )  # chars of the window's text passed on
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All the text streamed so far (the concatenation of every delta returned)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_id: int) -> str:
        """Take the next generated id; return the new text it completes (often "", never partial)."""
        self._window.append(token_id)
        text = self._decode(self._window)
        settled = _settled_length(text)
        delta = text[self._done : settled]
        self._done = settled
        if settled == len(text):  # at a character boundary: keep only a little context
            self._window = self._window[-self.CONTEXT :]
            self._done = len(self._decode(self._window))
        return self._emit(delta)

    def flush(self) -> str:
        """At the end of generation: the held-back tail, an incomplete character shown as U+FFFD."""
        text = self._decode(self._window)
        delta = text[self._done :]
        self._done = len(text)
        return self._emit(delta)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta


def _settled_length(text: str) -> int:
    """How much of `text` later tokens cannot change: all but a trailing U+FFFD, which may be the
    start of a character whose remaining bytes have not arrived yet."""
    return len(text) - text.endswith(_REPLACEMENT)
