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

gpt-oss writes its answer as harmony messages (the "harmony" format), each a header and a
body; the prompt usually ends with `<|start|>assistant`, so the answer opens in a header:

    <|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>

`HarmonyParser` reads them with the same interface. An `analysis` body is reasoning, a
`final` body content (`ended` turns true where it starts, so a constraint applies to the
answer), a `commentary` body content too (gpt-oss's preambles to the user). The markers
(`<|start|>`, `<|channel|>`, `<|message|>`, `<|constrain|>`, `<|end|>`, `<|return|>`,
`<|call|>`) and the headers between them (`assistant`, the channel's name, ` to=...`,
`json`) never reach the client; bodies are kept as written, each side its messages' text
joined. A message addressed `to=functions.NAME` (in its header, either place harmony allows)
is a tool call: its content is the call rewritten in the Hermes syntax,
`<tool_call>{"name": NAME, "arguments": BODY}</tool_call>`, which is what server/tool_parser.py
reads for a harmony template (tokenizer/chat.py's tool_format names none other for it), so
the routes that parse calls turn it into a call; a request that parses none sees that text.
Text outside any message (well-formed harmony has none) is content, stripped of the
whitespace around it. The prompt's tail is read by the same machine: where it leaves off
(in a header, or inside a message the template opened) is where the answer starts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum

NONE, AUTO = "none", "auto"  # the server's --reasoning-parser choices besides a format


@dataclass(frozen=True)
class ReasoningFormat:
    """How one template family marks its reasoning."""

    name: str
    start: str  # the tag that opens the reasoning (harmony: a message's channel)
    end: str  # the tag that closes it (harmony: a message's end)


THINK = ReasoningFormat("think", "<think>", "</think>")
HARMONY = ReasoningFormat("harmony", "<|channel|>", "<|end|>")
FORMATS = {THINK.name: THINK, HARMONY.name: HARMONY}
PARSER_CHOICES = (AUTO, NONE, *FORMATS)  # what --reasoning-parser accepts


def detect(template: str | None) -> str | None:
    """The reasoning format a chat template's model writes: "think" for a template that
    mentions `<think>`, "harmony" for one that mentions `<|channel|>`, else None."""
    if not template:
        return None
    return next((fmt.name for fmt in FORMATS.values() if fmt.start in template), None)


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


# harmony's markers; the name picks what each does (HarmonyParser._marker)
_HARMONY_MARKERS = ("start", "channel", "message", "constrain", "end", "return", "call")
_HARMONY_MARKER = re.compile(r"<\|(" + "|".join(_HARMONY_MARKERS) + r")\|>")
_HARMONY_TAGS = tuple(f"<|{name}|>" for name in _HARMONY_MARKERS)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")  # in a header: the channel's name
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")  # " to=functions.get_weather"
_FUNCTIONS = "functions."  # the recipient prefix of the request's tools
# A call rewritten in the Hermes syntax (see the module's docstring): opening, closing.
_CALL_OPEN, _CALL_CLOSE = '<tool_call>{{"name": {name}, "arguments": ', "}</tool_call>"


class _Where(Enum):
    OUTSIDE = "outside"  # between messages (or before any)
    HEADER = "header"  # from <|start|> or <|channel|> to <|message|>: dropped
    BODY = "body"  # a message's text, to self._side


class HarmonyParser(ReasoningParser):
    """Splits one harmony answer's text deltas into (reasoning, content) deltas, as the
    module's docstring says; the same interface as the think format's parser.

    Invariant: what has been returned is the split of the text fed so far, less a held-back
    tail of at most a partial marker (and, between messages, the whitespace before it)."""

    def __init__(self, prompt_tail: str = ""):
        """prompt_tail: the end of the prompt's text; its last marker says where the
        answer starts (`<|start|>assistant`: in a header)."""
        super().__init__(HARMONY)
        self._where = _Where.OUTSIDE
        self._header = ""  # the header read so far, markers included
        self._side = "content"  # where the body's text goes: reasoning, content or call
        self._final = False  # a final body has started
        self._args = False  # the call being written has had arguments
        self._strip = True  # between messages, just past a marker: leading space dropped
        self.feed(prompt_tail)  # read as the answer would be, and its output dropped
        self._held = ""  # a partial marker at the prompt's very end is the prompt's
        self._final = self._where is _Where.BODY and self._channel() == "final"
        # the constraint waits unless the answer starts in its final message
        self.reasoned = self._where is _Where.HEADER or self._side == "reasoning"

    @property
    def ended(self) -> bool:
        """Whether the final channel has started: what follows is the answer."""
        return self._final

    def finish(self) -> tuple[str, str]:
        """The held-back tail once generation ends (a partial marker is text after all),
        and the close of a call cut off before its end."""
        held, self._held = self._held, ""
        reasoning: list[str] = []
        content: list[str] = []
        if self._where is _Where.BODY:
            self._body(held, reasoning, content)
            self._end_message(content)
        elif self._where is _Where.OUTSIDE:
            self._outside(held.rstrip(), content)
        return "".join(reasoning), "".join(content)

    def _step(self, text: str, reasoning: list[str], content: list[str]) -> str:
        """Consume text up to and including its first marker; returns the rest (""
        when the rest is held back)."""
        found = _HARMONY_MARKER.search(text)
        if found is None:
            cut = len(text) - max(_partial_suffix_len(text, tag) for tag in _HARMONY_TAGS)
            if self._where is _Where.OUTSIDE:
                while cut > 0 and text[cut - 1].isspace():
                    cut -= 1  # a marker may follow: the space before it is dropped
            self._text(text[:cut], reasoning, content)
            self._held = text[cut:]
            return ""
        before = text[: found.start()]
        self._text(before.rstrip() if self._where is _Where.OUTSIDE else before, reasoning, content)
        self._marker(found.group(1), found.group(), content)
        return text[found.end() :]

    def _text(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._where is _Where.HEADER:
            self._header += text
        elif self._where is _Where.BODY:
            self._body(text, reasoning, content)
        else:
            self._outside(text, content)

    def _body(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._side == "call":
            self._args = self._args or bool(text.strip())
        (reasoning if self._side == "reasoning" else content).append(text)

    def _outside(self, text: str, content: list[str]) -> None:
        if self._strip:
            text = text.lstrip()
        if text:
            self._strip = False
            content.append(text)

    def _marker(self, name: str, tag: str, content: list[str]) -> None:
        """One marker: it starts a header, ends one (<|message|>) or ends a message."""
        if name in ("channel", "constrain") and self._where is _Where.HEADER:
            self._header += tag
        elif name in ("start", "channel", "constrain"):  # a new header (a stray
            self._end_message(content)  # <|channel|> in a body begins one too)
            self._where, self._header = _Where.HEADER, "" if name == "start" else tag
        elif name == "message":
            if self._where is _Where.BODY:
                return  # a stray one inside a body: dropped
            self._begin_body(content)
        else:  # end, return, call
            self._end_message(content)
            self._where, self._strip = _Where.OUTSIDE, True

    def _channel(self) -> str | None:
        found = _CHANNEL.search(self._header)
        return found.group(1) if found else None

    def _begin_body(self, content: list[str]) -> None:
        """<|message|>: the header read so far says where the body goes."""
        header = self._header if self._where is _Where.HEADER else ""  # a bare <|message|>
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        channel = channel.group(1) if channel else None
        self._where = _Where.BODY
        if recipient is not None and recipient.group(1).startswith(_FUNCTIONS):
            name = recipient.group(1)[len(_FUNCTIONS) :]
            self._side, self._args = "call", False
            content.append(_CALL_OPEN.format(name=json.dumps(name)))
        elif channel == "analysis":
            self._side, self.reasoned = "reasoning", True
        else:
            self._side = "content"
            self._final = self._final or channel == "final"

    def _end_message(self, content: list[str]) -> None:
        """A body ends (its end marker, a new header, or the end of the output): a call
        is closed, with {} for arguments the model never wrote."""
        if self._where is _Where.BODY and self._side == "call":
            content.append(_CALL_CLOSE if self._args else "{}" + _CALL_CLOSE)
        self._where, self._side = _Where.OUTSIDE, "content"


def start_parser(name: str, prompt_tail: str = "") -> ReasoningParser | None:
    """The parser for one answer in format `name`, given the end of its prompt's text
    (a few tokens decoded): inside the reasoning when the prompt opened the tag, None when
    the prompt closed it (thinking switched off: the answer is all content); a harmony
    answer gets a HarmonyParser, which reads the tail itself. A ValueError for an unknown
    format."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown reasoning format {name!r}; known: {', '.join(FORMATS)}")
    if fmt is HARMONY:
        return HarmonyParser(prompt_tail)
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
