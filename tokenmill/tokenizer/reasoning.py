"""A reasoning model's output split into its thinking and its answer, as it streams.

    parser = start_parser("think", prompt_tail)     # None: this answer has no reasoning
    reasoning, content = parser.feed(text_delta)    # per detokenized delta
    reasoning, content = parser.finish()            # what was held back, at the end

Qwen3, DeepSeek-R1 (and its distills) and SmolLM3 think inside `<think>` ... `</think>`
before they answer (the "think" format). Their templates differ in who opens the tag:

- Qwen3 and SmolLM3 leave it to the model: the answer may begin with `<think>` (after
  whitespace), and the first such block is the reasoning;
- DeepSeek-R1 and Qwen3's thinking-only releases write `<think>` at the end of the prompt,
  so the answer starts inside the reasoning and only `</think>` ends it;
- with thinking switched off (Qwen3's enable_thinking false) the prompt ends with an empty,
  closed `<think></think>` block: the whole answer is content (`start_parser` gives None).

A tag can arrive split across deltas ("</th" then "ink>"): the parser holds back any tail
that could still grow into the tag it waits for, and releases it once it cannot. Whitespace
around the reasoning is trimmed (Qwen3 writes "<think>\\n...\\n</think>\\n\\n"): the
reasoning is the block's text stripped, the content what follows the closing tag with its
leading whitespace dropped. An answer that does not open with `<think>` is content exactly
as generated, and a `<think>` later in it is text. Without a closing tag, everything after
the opening one is reasoning.

gpt-oss's harmony channels (analysis, final, commentary) are not parsed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

NONE, AUTO = "none", "auto"  # the server's --reasoning-parser choices besides a format


@dataclass(frozen=True)
class ReasoningFormat:
    """How one template family marks its reasoning."""

    name: str
    start: str  # the tag that opens the reasoning
    end: str  # the tag that closes it


THINK = ReasoningFormat("think", "<think>", "</think>")
FORMATS = {THINK.name: THINK}
PARSER_CHOICES = (AUTO, NONE, *FORMATS)  # what --reasoning-parser accepts


def detect(template: str | None) -> str | None:
    """The reasoning format a chat template's model writes: "think" for a template that
    mentions `<think>`, else None."""
    if template and any(fmt.start in template for fmt in FORMATS.values()):
        return THINK.name
    return None


def resolve(choice: str, template: str | None) -> str | None:
    """A --reasoning-parser choice ("auto", "none" or a format's name) -> the format to
    parse with, or None. A ValueError for an unknown choice."""
    if choice == AUTO:
        return detect(template)
    if choice == NONE:
        return None
    if choice not in FORMATS:
        raise ValueError(
            f"unknown reasoning parser {choice!r}; choose one of {', '.join(PARSER_CHOICES)}"
        )
    return choice


class _State(Enum):
    BEFORE = "before"  # nothing but whitespace yet: the answer may still open the tag
    LEADING = "leading"  # just inside the tag: dropping the reasoning's leading whitespace
    INSIDE = "inside"  # reasoning
    TRIMMING = "trimming"  # just past the closing tag: dropping the content's whitespace
    CONTENT = "content"  # the answer


class ReasoningParser:
    """Splits one answer's text deltas into (reasoning, content) deltas.

    Invariant: the reasoning and content returned so far, joined each, are what the
    module's docstring says of the text fed so far, less a held-back tail of at most a
    partial tag and the whitespace before it."""

    def __init__(self, fmt: ReasoningFormat, *, inside: bool = False):
        """inside: the prompt opened the tag, so the answer starts in the reasoning."""
        self.fmt = fmt
        self._state = _State.LEADING if inside else _State.BEFORE
        self._held = ""
        self.reasoned = inside  # whether a reasoning block opened

    @property
    def ended(self) -> bool:
        """Whether the reasoning is over (or never began): what follows is the answer."""
        return self._state in (_State.TRIMMING, _State.CONTENT)

    def feed(self, delta: str) -> tuple[str, str]:
        """Add generated text; returns (reasoning, content) safe to show now."""
        text, self._held = self._held + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            text = self._step(text, reasoning, content)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The held-back tail once generation ends: a partial tag is text after all."""
        held, self._held = self._held, ""
        if self._state is _State.BEFORE:
            self._state = _State.CONTENT
            return "", held
        if self._state in (_State.LEADING, _State.INSIDE):
            return held.rstrip(), ""  # no closing tag: the rest was reasoning
        if self._state is _State.CONTENT:
            return "", held
        return "", ""  # TRIMMING: only whitespace was held

    def _step(self, text: str, reasoning: list[str], content: list[str]) -> str:
        """Consume a prefix of text in the current state; returns the rest (""
        when the rest is held back)."""
        start, end = self.fmt.start, self.fmt.end
        state = self._state
        if state is _State.CONTENT:
            content.append(text)
            return ""
        if state is _State.BEFORE:
            body = text.lstrip()
            if body.startswith(start):
                self._state, self.reasoned = _State.LEADING, True
                return body[len(start) :]
            if start.startswith(body):  # whitespace, or a partial tag: wait for more
                self._held = text
                return ""
            self._state = _State.CONTENT  # an answer without reasoning: kept as it came
            return text
        if state in (_State.LEADING, _State.TRIMMING):
            body = text.lstrip()
            if not body:
                return ""  # whitespace to drop; the next delta may have more
            self._state = _State.INSIDE if state is _State.LEADING else _State.CONTENT
            return body
        # INSIDE
        at = text.find(end)
        if at >= 0:
            reasoning.append(text[:at].rstrip())
            self._state = _State.TRIMMING
            return text[at + len(end) :]
        cut = len(text) - _partial_suffix_len(text, end)
        while cut > 0 and text[cut - 1].isspace():
            cut -= 1  # trailing whitespace waits: the closing tag may follow it
        reasoning.append(text[:cut])
        self._held = text[cut:]
        return ""


def _partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def start_parser(name: str, prompt_tail: str = "") -> ReasoningParser | None:
    """The parser for one answer in format `name`, given the end of its prompt's text
    (a few tokens decoded): inside the reasoning when the prompt opened the tag, None when
    the prompt closed it (thinking switched off: the answer is all content). A ValueError
    for an unknown format."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown reasoning format {name!r}; known: {', '.join(FORMATS)}")
    tail = prompt_tail.rstrip()
    if tail.endswith(fmt.end):
        return None
    return ReasoningParser(fmt, inside=tail.endswith(fmt.start))


def split(text: str, name: str, prompt_tail: str = "") -> tuple[str, str]:
    """(reasoning, content) of a whole answer: what the streaming parser gives, at once."""
    parser = start_parser(name, prompt_tail)
    if parser is None:
        return "", text
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    return reasoning + more_reasoning, content + more_content
