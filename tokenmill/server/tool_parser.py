"""Reading tool calls back out of a model's output, whole or as it streams.

    ToolCallParser(fmt).feed(text) -> Delta   content and OpenAI `delta.tool_calls`
                       .finish() -> Delta     at the end; .calls holds the calls
    parse_tool_calls(fmt, text)               a whole output: (content, calls)

fmt is the call syntax the chat template teaches (tokenizer/chat.py's tool_format):
Qwen/Hermes `<tool_call>{json}</tool_call>`, Llama 3 JSON `{"name", "parameters"}`
(after an optional <|python_tag|>), Mistral `[TOOL_CALLS][{...}]` (or
`[TOOL_CALLS]name[ARGS]{...}` in newer templates).

The parser reads the output incrementally, so a stream sends `delta.tool_calls` as OpenAI
does: the call's id, type and name first, then its arguments in fragments as the model
writes them; a whole response runs the same parser over the whole text, so the two agree.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenmill.tokenizer.chat import HERMES, LLAMA3, MISTRAL

_ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"
_DECODER = json.JSONDecoder()


def new_call_id(fmt: str) -> str:
    """A fresh tool-call id; Mistral's templates insist on 9 letters and digits."""
    if fmt == MISTRAL:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Delta:
    """What one piece of output adds: content text, and OpenAI `delta.tool_calls` entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: Delta) -> None:
        self.content += other.content
        for entry in other.tool_calls:
            same = next((e for e in self.tool_calls if e["index"] == entry["index"]), None)
            if same is None:
                self.tool_calls.append(entry)
            else:
                same["function"]["arguments"] += entry["function"]["arguments"]


@dataclass
class _Scan:
    """How far a call object has come: None fields are not known yet."""

    end: int | None = None  # index just past its closing brace
    name: str | None = None
    args_start: int | None = None  # where the arguments value starts
    args_end: int | None = None  # where it ends, once complete
    args_value: Any = None
    invalid: bool = False


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _scan_call(text: str, i: int) -> _Scan:
    """Read the call object starting at text[i] == "{" as far as the text goes."""
    scan = _Scan()
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            scan.invalid = True
            return scan
        try:
            key, j = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return scan  # the key is still being written
        except RecursionError:  # cannot happen for a string; kept symmetric with values
            scan.invalid = True
            return scan
        j = _skip_ws(text, j)
        if j >= len(text):
            return scan
        if text[j] != ":":
            scan.invalid = True
            return scan
        v = _skip_ws(text, j + 1)
        if v >= len(text):
            return scan
        try:
            value, end = _DECODER.raw_decode(text, v)
        except json.JSONDecodeError:
            if key in _ARGUMENT_KEYS:
                scan.args_start = v
            return scan  # incomplete (or broken, which the end of the output will tell)
        except RecursionError:
            # Nested deeper than the decoder's stack (~1,000 "[", which a regex can force
            # a model to write): not a call, whole or streamed (was a 500, issue 21 item 8)
            scan.invalid = True
            return scan
        if end == len(text) and text[v] not in '{["':
            return scan  # a number or literal may still grow
        if key == "name" and isinstance(value, str):
            scan.name = value
        elif key in _ARGUMENT_KEYS:
            scan.args_start, scan.args_end, scan.args_value = v, end, value
        i = end


class ToolCallParser:
    """Splits one choice's output into content and tool calls, as it streams.

    feed(text) -> Delta for each new piece, finish() -> Delta at the end; `calls`
    holds the completed calls. Text that might begin a call is held back until it is
    clear; whitespace-only content is held until something follows it (and dropped
    if calls follow)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self.content = ""  # all content passed on
        self.broken = False  # a call that did not parse (its text went to content)
        self._text = ""
        self._pos = 0  # text before this is handled
        self._mode = "start" if fmt == LLAMA3 else "content"
        self._call_start = 0  # where the call being read begins (its marker, for fallback)
        self._started: dict[str, Any] | None = None  # the call being streamed
        self._in_array = False  # inside Mistral's [...] of calls
        self._pending_ws = ""

    # ---- public ----
    def feed(self, text: str) -> Delta:
        self._text += text
        return self._run(final=False)

    def finish(self) -> Delta:
        delta = self._run(final=True)
        if self._started is not None:  # cut off mid-call (max_tokens): keep what came
            self._close_call(self._started["arguments"])
        elif self._mode in ("call", "after_marker") and self._pos < len(self._text):
            delta.add(self._fallback(final=True))
        if self._pending_ws and not self.calls:
            delta.content += self._pending_ws
            self.content += self._pending_ws
        self._pending_ws = ""
        return delta

    # ---- the state machine ----
    def _run(self, final: bool) -> Delta:
        delta = Delta()
        while True:
            before = (self._mode, self._pos, len(self.calls), self._started is None)
            step = getattr(self, f"_{self._mode}")(final)
            if step is None:
                return delta
            delta.add(step)
            after = (self._mode, self._pos, len(self.calls), self._started is None)
            if after == before and not (step.content or step.tool_calls):
                return delta  # no progress: wait for more text

    def _marker(self) -> str:
        return "[TOOL_CALLS]" if self.fmt == MISTRAL else "<tool_call>"

    def _emit(self, text: str) -> Delta:
        """Content, with whitespace-only runs held back."""
        text = self._pending_ws + text
        if not text.strip():
            self._pending_ws = text
            return Delta()
        self._pending_ws = ""
        self.content += text
        return Delta(content=text)

    def _content(self, final: bool) -> Delta | None:
        if self._pos >= len(self._text):
            return None
        marker = self._marker()
        found = self._text.find(marker, self._pos)
        if found >= 0:
            before = self._text[self._pos : found]
            self._call_start = found
            self._pos = found + len(marker)
            self._mode = "after_marker"
            return self._emit(before)
        cut = len(self._text)
        if not final:
            cut -= _partial_suffix(self._text[self._pos :], marker)
        if cut <= self._pos:
            return None
        piece, self._pos = self._text[self._pos : cut], cut
        return self._emit(piece)

    def _rest(self, final: bool) -> Delta | None:
        """After a call syntax that ends the calls: everything else is content."""
        if self._pos >= len(self._text):
            return None
        piece, self._pos = self._text[self._pos :], len(self._text)
        return self._emit(piece)

    def _start(self, final: bool) -> Delta | None:
        """Llama 3: a call is the whole answer, after an optional <|python_tag|>."""
        i = _skip_ws(self._text, self._pos)
        rest = self._text[i:]
        tag = "<|python_tag|>"
        if rest.startswith(tag):
            self._call_start, self._pos, self._mode = i, i + len(tag), "call"
            return Delta()
        if rest.startswith("{"):
            self._call_start, self._pos, self._mode = i, i, "call"
            return Delta()
        if not final and (not rest or tag.startswith(rest)):
            return None
        self._mode = "rest"  # text first: no call in this answer
        return Delta()

    def _after_marker(self, final: bool) -> Delta | None:
        i = _skip_ws(self._text, self._pos)
        if i >= len(self._text):
            return None
        if self.fmt == MISTRAL:
            if self._text[i] == "[":
                self._pos, self._mode, self._in_array = i + 1, "call", True
                return Delta()
            return self._named_call(final)
        self._pos, self._mode = i, "call"
        return Delta()

    def _call(self, final: bool) -> Delta | None:
        i = _skip_ws(self._text, self._pos)
        if i >= len(self._text):
            return None
        if self._text[i] != "{":
            return self._fallback(final)
        scan = _scan_call(self._text, i)
        if scan.invalid:
            return self._fallback(final)
        delta = Delta()
        if scan.name is not None and self._started is None:
            self._started = {"id": new_call_id(self.fmt), "name": scan.name, "arguments": ""}
            delta.tool_calls.append(self._entry(first=True))
        if self._started is not None and scan.args_start is not None:
            if scan.args_end is not None:
                delta.add(self._send_args(_arguments_text(self._text, scan)))
            elif self._text[scan.args_start] in "{[":
                delta.add(self._send_args(self._text[scan.args_start :]))
        if scan.end is None:
            return _unless_empty(delta)
        if self._started is None:  # a complete object without a name: not a call
            delta.add(self._fallback(final=True, upto=scan.end))
            return delta
        if scan.args_start is None:
            delta.add(self._send_args("{}"))
        self._close_call(self._started["arguments"])
        self._pos, self._mode = scan.end, "after_call"
        return delta

    def _named_call(self, final: bool) -> Delta | None:
        """Mistral's newer form: [TOOL_CALLS]name[ARGS]{...}."""
        args_marker = self._text.find("[ARGS]", self._pos)
        if args_marker < 0:
            return None if not final else self._fallback(final)
        name = self._text[self._pos : args_marker].strip()
        start = _skip_ws(self._text, args_marker + len("[ARGS]"))
        delta = Delta()
        if self._started is None:
            self._started = {"id": new_call_id(self.fmt), "name": name, "arguments": ""}
            delta.tool_calls.append(self._entry(first=True))
        if start >= len(self._text):
            return _unless_empty(delta)
        try:
            _, end = _DECODER.raw_decode(self._text, start)
        except RecursionError:  # nested too deep to be a call (see _scan_call)
            return self._fallback(final)
        except json.JSONDecodeError:
            if final:
                return self._fallback(final)
            delta.add(self._send_args(self._text[start:]))
            return _unless_empty(delta)
        delta.add(self._send_args(self._text[start:end]))
        self._close_call(self._started["arguments"])
        self._pos, self._mode = end, "content"
        return delta

    def _after_call(self, final: bool) -> Delta | None:
        i = _skip_ws(self._text, self._pos)
        rest = self._text[i:]
        if self.fmt == HERMES:
            close = "</tool_call>"
            if rest.startswith(close):
                self._pos, self._mode = i + len(close), "content"
                return Delta()
            if not final and close.startswith(rest):
                return None
            self._pos, self._mode = i, "content"  # no closing tag: read on as content
            return Delta()
        if not rest:
            return None
        if self.fmt == MISTRAL and self._in_array:
            if rest[0] == ",":
                self._pos, self._mode = i + 1, "call"
                return Delta()
            if rest[0] == "]":
                self._pos, self._mode, self._in_array = i + 1, "content", False
                return Delta()
        if self.fmt == LLAMA3 and rest[0] in ";{":
            self._pos, self._mode = i + (rest[0] == ";"), "call"
            return Delta()
        self._pos, self._mode = i, "rest"
        return Delta()

    # ---- helpers ----
    def _entry(self, first: bool, arguments: str = "") -> dict[str, Any]:
        index = len(self.calls)
        if not first:
            return {"index": index, "function": {"arguments": arguments}}
        call = self._started
        return {
            "index": index,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": arguments},
        }

    def _send_args(self, text: str) -> Delta:
        call = self._started
        if not text.startswith(call["arguments"]) or len(text) <= len(call["arguments"]):
            return Delta()
        fragment = text[len(call["arguments"]) :]
        call["arguments"] = text
        return Delta(tool_calls=[self._entry(first=False, arguments=fragment)])

    def _close_call(self, arguments: str) -> None:
        call = self._started
        self.calls.append(ToolCall(call["id"], call["name"], arguments))
        self._started = None

    def _fallback(self, final: bool, upto: int | None = None) -> Delta:
        """What looked like a call is not one: its text (marker included) is content."""
        if self._started is not None:  # already announced: the call keeps what it had
            self.broken = True
            self._close_call(self._started["arguments"])
            self._pos, self._mode = len(self._text) if upto is None else upto, "rest"
            return Delta()
        self.broken = True
        end = len(self._text) if upto is None else upto
        piece = self._text[self._call_start : end]
        self._pos, self._mode = end, "rest"
        return self._emit(piece)


def _unless_empty(delta: Delta) -> Delta | None:
    """None (nothing more to do until more text comes) when delta carries nothing."""
    return delta if (delta.tool_calls or delta.content) else None


def _arguments_text(text: str, scan: _Scan) -> str:
    """The arguments as JSON text: as written for an object, decoded when the model
    wrote them as a JSON string (some do)."""
    if isinstance(scan.args_value, str):
        return scan.args_value
    return text[scan.args_start : scan.args_end]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(fmt: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output as (content, calls). Output whose calls do not parse as JSON is
    all content, as the model wrote it."""
    parser = ToolCallParser(fmt)
    parser.feed(text)
    parser.finish()
    calls = parser.calls
    if parser.broken or not all(_is_json(c.arguments) for c in calls):
        return text, []
    content = parser.content.strip()
    return content or None, calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True
