"""Reading tool calls back out of a model's output, whole or as it streams.

    ToolCallParser(fmt).feed(text) -> Delta   content and OpenAI `delta.tool_calls`
                       .finish() -> Delta     at the end; .calls holds the calls
    parse_tool_calls(fmt, text)               a whole output: (content, calls)
    arguments_object(call.arguments)          a call's arguments as a dict

fmt is the call syntax the chat template teaches (tokenizer/chat.py's tool_format):
Qwen/Hermes `<tool_call>{json}</tool_call>`, Llama 3 JSON `{"name", "parameters"}`
(after an optional <|python_tag|>), Mistral `[TOOL_CALLS][{...}]` (or
`[TOOL_CALLS]name[ARGS]{...}` in newer templates).

The parser reads the output incrementally, so a stream sends `delta.tool_calls` as OpenAI
does: the call's id and name, with the start of its arguments, then the rest of the
arguments in fragments as the model writes them. A whole response runs the same parser
over the whole text, so one rule decides both, and a stream ends with exactly the calls,
content and finish reason of the whole response:

- A call object is read strictly as JavaScript's JSON.parse reads JSON, and more strictly
  than Python's json: NaN, Infinity and numbers beyond a double are refused (json.loads
  takes them, a client's JSON.parse does not), and so is a second "name" or arguments key
  (json.loads keeps the last, while a stream has sent the first). The arguments must be a
  JSON object, or a JSON string holding one (some models write them so).
- The arguments go out only as far as they can still become a JSON object: a number or
  a literal once it has ended (`1e40` can still become `1e400`), a string or a bracket as
  it comes.
- A call goes out (id, name and the arguments so far) once its name is known and the
  value of its arguments' first member has begun to go out (or the arguments are
  complete): a call that breaks before that (cut off, not JSON, arguments that are no
  object, `{"x": NaN}`, `{"x": 1e400}`) was never sent, so it is content, as written.
- What went out cannot be taken back: a call that breaks later (cut off, NaN in its
  second member) keeps the arguments sent so far, and the text after them is content.
  Such arguments are the start of an object; arguments_object reads them as the
  anthropic SDK reads a stream's partial JSON.
- After a call that broke, the rest of the output is content.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenmill.tokenizer.chat import HERMES, LLAMA3, MISTRAL

# Free-form JSON (a tool's parameters, a call's arguments) nests at most this deep, dicts
# and lists counted alike: the chat template and the code that prepares it walk it
# recursively (about two Python frames a level), and Python's default stack of 1,000
# frames ran out near 500 levels. MAX_SCHEMA_DEPTH (sampling/grammar.py)
# allows about as much. A call nested deeper could not come back in the history.
MAX_JSON_DEPTH = 300

_ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"
_WS = re.compile(r"[ \t\r\n]*")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')  # what a string holds up to its next event
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_VALUE_STARTS = frozenset('{["-0123456789tfn')


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
    arguments: str  # JSON text: an object, or the start of one where the call broke

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


# --------------------------------------------------------------------------- strict JSON

_VALUE, _FIRST_ITEM, _FIRST_KEY, _KEY, _COLON, _AFTER = range(6)


class _JsonReader:
    """Reads one JSON value starting at text[start], as far as the text goes, and on from
    there when it grows: each character is read once, so a long call streamed in small
    pieces costs no more than read whole.

    done: the value is complete (end is just past it); error: the text cannot become
    JSON from here (pos is where it broke). sendable is how far the text can still
    become JSON whatever follows (a number or literal being written is not yet: 1e40 may
    become 1e400); first_value is where the outermost container's first member's value
    begins, once a value may begin there."""

    def __init__(self, start: int, max_depth: int = MAX_JSON_DEPTH):
        self.start = self.pos = start
        self.max_depth = max_depth
        self.done = self.error = False
        self.end: int | None = None
        self.first_value: int | None = None
        self._closers: list[str] = []  # "}" or "]" for each open container
        self._expect = _VALUE
        self._string: str | None = None  # "key" or "value" while inside a string
        self._escape = 0  # -1 just after a backslash, n while n hex digits of \u remain
        self._held: int | None = None  # where the number or literal being read starts
        self._literal = ""
        self._cut = start  # past the last complete value or opening bracket

    @property
    def sendable(self) -> int:
        return self.pos if self._held is None else self._held

    def closed(self, text: str) -> str:
        """text[start:sendable] made whole: the member being written dropped and the open
        brackets closed, as the anthropic SDK reads partial JSON."""
        return text[self.start : self._cut] + "".join(reversed(self._closers))

    def read(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and not (self.done or self.error):
            if self._string is not None:
                i = self._read_string(text, i)
            elif self._held is not None:
                i = self._read_scalar(text, i)
            else:
                i = _WS.match(text, i).end()
                if i < n:
                    i = self._read_structure(text, i)
        self.pos = i

    def _read_string(self, text: str, i: int) -> int:
        if self._escape == -1:
            if text[i] not in _ESCAPES:
                self.error = True
                return i
            self._escape = 4 if text[i] == "u" else 0
            return i + 1
        if self._escape > 0:
            if text[i] not in _HEX:
                self.error = True
                return i
            self._escape -= 1
            return i + 1
        i = _STRING_RUN.match(text, i).end()
        if i >= len(text):
            return i
        if text[i] == "\\":
            self._escape = -1
            return i + 1
        if text[i] != '"':  # a raw control character: JSON.parse refuses it
            self.error = True
            return i
        kind, self._string = self._string, None
        if kind == "key":
            self._expect = _COLON
        else:
            self._value_done(i + 1)
        return i + 1

    def _read_scalar(self, text: str, i: int) -> int:
        if self._literal:
            if text[i] != self._literal[i - self._held]:
                self.error = True
                return i
            if i + 1 - self._held == len(self._literal):
                self._held, self._literal = None, ""
                self._value_done(i + 1)
            return i + 1
        if text[i] in _NUMBER_CHARS:
            return i + 1
        # the number ended here: it must be whole JSON, and a double (1e400 is not)
        number = text[self._held : i]
        if not _NUMBER.fullmatch(number) or math.isinf(float(number)):
            self.error = True  # held stays: the number never goes out
            return i
        self._held = None
        self._value_done(i)
        return i

    def _read_structure(self, text: str, i: int) -> int:
        c, expect = text[i], self._expect
        if expect in (_VALUE, _FIRST_ITEM):
            if c == "]" and expect == _FIRST_ITEM:
                return self._close(i)
            if self.first_value is None and len(self._closers) == 1 and c in _VALUE_STARTS:
                self.first_value = i
            if c in "{[":
                if len(self._closers) >= self.max_depth:
                    self.error = True
                    return i
                self._closers.append("}" if c == "{" else "]")
                self._expect = _FIRST_KEY if c == "{" else _FIRST_ITEM
                self._cut = i + 1
            elif c == '"':
                self._string = "value"
            elif c in "-0123456789":
                self._held = i
            elif c in _LITERALS:
                self._held, self._literal = i, _LITERALS[c]
            else:  # NaN, Infinity, a bare word: no JSON
                self.error = True
                return i
            return i + 1
        if expect in (_FIRST_KEY, _KEY):
            if c == "}" and expect == _FIRST_KEY:
                return self._close(i)
            if c != '"':
                self.error = True
                return i
            self._string = "key"
            return i + 1
        if expect == _COLON:
            if c != ":":
                self.error = True
                return i
            self._expect = _VALUE
            return i + 1
        # _AFTER: a comma or the container's end
        if c == self._closers[-1]:
            return self._close(i)
        if c != ",":
            self.error = True
            return i
        self._expect = _KEY if self._closers[-1] == "}" else _VALUE
        return i + 1

    def _close(self, i: int) -> int:
        self._closers.pop()
        self._value_done(i + 1)
        return i + 1

    def _value_done(self, end: int) -> None:
        self._cut = end
        if not self._closers:
            self.done, self.end = True, end
            return
        self._expect = _AFTER


def _complete(text: str) -> _JsonReader:
    reader = _JsonReader(_skip_ws(text, 0))
    reader.read(text)
    return reader


def _is_object_text(text: str) -> bool:
    """text is one JSON object (whitespace around it allowed), by the rule above."""
    start = _skip_ws(text, 0)
    if not text.startswith("{", start):
        return False
    reader = _complete(text)
    return reader.done and _skip_ws(text, reader.end) == len(text)


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as a dict: all of them, or for a call that broke after its
    arguments began to go out, the members that were whole (as the anthropic SDK reads
    the same text streamed as partial JSON)."""
    # the space ends a number the arguments end with, as the SDK takes it whole
    reader = _complete(arguments + " ")
    if reader.done:
        return json.loads(arguments)
    return json.loads(reader.closed(arguments))


class _CallScan:
    """How far one call has come: the call object {"name": ..., "arguments": ...} from
    text[start] == "{", or with name given, Mistral's bare arguments object after [ARGS]."""

    def __init__(self, start: int, name: str | None = None):
        self.name = name
        self.bare = name is not None
        self.done = self.error = False
        self.end: int | None = None
        self.args: _JsonReader | None = None
        self._args_text: str | None = None  # decoded arguments written as a JSON string
        if self.bare:
            self.args = self._value = _JsonReader(start)
            self._key: str | None = _ARGUMENT_KEYS[0]
        else:
            self._value, self._key = None, None
            self._seen: set[str] = set()
            self._pos, self._expect = start + 1, _FIRST_KEY

    def read(self, text: str) -> None:
        while not (self.done or self.error):
            if self._value is not None:
                if not self._read_value(text):
                    return
                continue
            i = self._pos = _WS.match(text, self._pos).end()
            if i >= len(text):
                return
            c = text[i]
            if self._expect in (_FIRST_KEY, _KEY):
                if c == "}" and self._expect == _FIRST_KEY:
                    self.done, self.end = True, i + 1
                elif c == '"':
                    self._value, self._key = _JsonReader(i), None
                else:
                    self.error = True
            elif self._expect == _COLON:
                if c == ":":
                    self._pos, self._expect = i + 1, _VALUE
                else:
                    self.error = True
            elif self._expect == _VALUE:
                self._value = _JsonReader(i)
                if self._key in _ARGUMENT_KEYS:
                    if c not in '{"':  # no object, and no string that could hold one
                        self.error = True
                    self.args = self._value
            elif c == "}":
                self.done, self.end = True, i + 1
            elif c == ",":
                self._pos, self._expect = i + 1, _KEY
            else:
                self.error = True

    def _read_value(self, text: str) -> bool:
        """Reads the value (or key) under way; True once it is done."""
        value = self._value
        value.read(text)
        if value.error:
            self.error = True
        if not value.done:
            return False
        self._value = None
        raw = text[value.start : value.end]
        if self._key is None:  # that was a key
            key = json.loads(raw)
            # a second name or arguments: json.loads keeps the last one, but a stream
            # has sent the first by then
            slot = "arguments" if key in _ARGUMENT_KEYS else key
            if slot in ("name", "arguments") and slot in self._seen:
                self.error = True
                return True
            self._seen.add(slot)
            self._key, self._pos, self._expect = key, value.end, _COLON
            return True
        if self._key == "name":
            if raw[0] != '"':
                self.error = True
                return True
            self.name = json.loads(raw)
        elif self._key in _ARGUMENT_KEYS and raw[0] == '"':
            decoded = json.loads(raw)
            if not _is_object_text(decoded):
                self.error = True
                return True
            self._args_text = decoded
        if self.bare:
            self.done, self.end = True, value.end
        self._pos, self._expect = value.end, _AFTER
        return True

    def outgoing(self, text: str) -> str | None:
        """The arguments as far as they may go out now; None while the call may not."""
        if self.name is None:
            return None
        args = self.args
        if args is None:  # a call without arguments has {} once it is complete
            return "{}" if self.done else None
        if text[args.start] == '"':
            return self._args_text
        if args.done or args.first_value is not None and args.sendable > args.first_value:
            return text[args.start : args.sendable]
        return None

    def resume(self) -> int:
        """Where the content starts once this call, already sent, broke: past the
        arguments that went out (a call without arguments goes out only complete)."""
        return self.args.sendable if self.args is not None else self._pos


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


# --------------------------------------------------------------------------- the parser


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
        self._scan: _CallScan | None = None  # the call being read
        self._started: dict[str, Any] | None = None  # the call being streamed
        self._in_array = False  # inside Mistral's [...] of calls
        self._pending_ws = ""

    # ---- public ----
    def feed(self, text: str) -> Delta:
        self._text += text
        return self._run(final=False)

    def finish(self) -> Delta:
        delta = self._run(final=True)
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
            return self._fallback() if final else None
        if self.fmt == MISTRAL:
            if self._text[i] == "[":
                self._pos, self._mode, self._in_array = i + 1, "call", True
            else:
                self._mode = "named_call"
            return Delta()
        self._pos, self._mode = i, "call"
        return Delta()

    def _call(self, final: bool) -> Delta | None:
        if self._scan is None:
            i = _skip_ws(self._text, self._pos)
            if i >= len(self._text):
                return self._fallback() if final else None
            if self._text[i] != "{":
                return self._fallback()
            self._scan = _CallScan(i)
        return self._read_call(final, then="after_call")

    def _named_call(self, final: bool) -> Delta | None:
        """Mistral's newer form: [TOOL_CALLS]name[ARGS]{...}."""
        if self._scan is None:
            args_marker = self._text.find("[ARGS]", self._pos)
            if args_marker < 0:
                return self._fallback() if final else None
            start = _skip_ws(self._text, args_marker + len("[ARGS]"))
            if start >= len(self._text):
                return self._fallback() if final else None
            if self._text[start] != "{":
                return self._fallback()
            name = self._text[self._pos : args_marker].strip()
            self._scan = _CallScan(start, name=name)
        return self._read_call(final, then="content")

    def _read_call(self, final: bool, then: str) -> Delta | None:
        """One rule for every syntax: the call goes out once _CallScan.outgoing says so,
        its arguments as far as they may; a call that breaks before is content, one that
        breaks after keeps what went out."""
        scan = self._scan
        scan.read(self._text)
        delta = Delta()
        arguments = scan.outgoing(self._text)
        if arguments is not None:
            if self._started is None:
                self._started = {"id": new_call_id(self.fmt), "name": scan.name, "arguments": ""}
                delta.tool_calls.append(self._entry(first=True))
            delta.add(self._send_args(arguments))
        if scan.done:
            if self._started is None:  # a complete object without a name: not a call
                return self._fallback()
            self._close_call()
            self._scan, self._pos, self._mode = None, scan.end, then
            return delta
        if not (scan.error or final):
            return _unless_empty(delta)
        if self._started is None:
            return self._fallback()
        self._close_call()
        self.broken = True
        self._scan, self._pos, self._mode = None, scan.resume(), "rest"
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
        # the next call's text begins at the separator: if it is no call, that is content
        if self.fmt == MISTRAL and self._in_array:
            if rest[0] == ",":
                self._call_start, self._pos, self._mode = self._pos, i + 1, "call"
                return Delta()
            if rest[0] == "]":
                self._pos, self._mode, self._in_array = i + 1, "content", False
                return Delta()
        if self.fmt == LLAMA3 and rest[0] in ";{":
            self._call_start, self._pos = self._pos, i + (rest[0] == ";")
            self._mode = "call"
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

    def _close_call(self) -> None:
        call = self._started
        self.calls.append(ToolCall(call["id"], call["name"], call["arguments"]))
        self._started = None

    def _fallback(self) -> Delta:
        """What looked like a call is not one, and nothing of it went out: its text
        (marker included) is content, and so is all that follows."""
        self.broken = True
        self._scan = None
        piece = self._text[self._call_start :]
        self._pos, self._mode = len(self._text), "rest"
        return self._emit(piece)


def _unless_empty(delta: Delta) -> Delta | None:
    """None (nothing more to do until more text comes) when delta carries nothing."""
    return delta if (delta.tool_calls or delta.content) else None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(fmt: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output as (content, calls): what a stream of it ends with (the content
    without the whitespace around it). Output whose calls do not parse is content, as
    the model wrote it."""
    parser = ToolCallParser(fmt)
    parser.feed(text)
    parser.finish()
    return parser.content.strip() or None, parser.calls
