"""Tool calls in /v1/chat/completions: definitions in, the model's calls out.

    ToolRequest.create(tools, tool_choice, parallel_tool_calls, template, tokenizer)
        .template_inputs(messages)   messages and `tools` for the chat template
        .grammar()                   Lark text that forces a valid call (tool_choice
                                     "required" or a named function), else None
        .parser()                    a ToolCallParser for one choice's output

The call syntax depends on the model family, and the chat template tells which
(`tool_format`): Qwen/Hermes `<tool_call>{json}</tool_call>`, Llama 3 JSON
`{"name", "parameters"}` (after an optional <|python_tag|>), Mistral
`[TOOL_CALLS][{...}]` (or `[TOOL_CALLS]name[ARGS]{...}` in newer templates).
Tools are rendered by the model's own template (`tools=` in its context, as
transformers does). A template that does not render tools at all (the default
SmolLM2's, Gemma's) gets the Hermes instructions in its system message instead,
with earlier calls and tool results written out as text, so any chat model can
be offered tools.

ToolCallParser reads the output incrementally, so a stream sends `delta.tool_calls`
as OpenAI does: the call's id, type and name first, then its arguments in
fragments as the model writes them; a whole response runs the same parser over
the whole text, so the two agree.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, StringConstraints

from tokenmill.checks import ParamError
from tokenmill.sampling.grammar import JSON_LAYOUT
from tokenmill.server.text import Text
from tokenmill.tokenizer import ChatTemplateError

T = TypeVar("T")

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
_ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"
_DECODER = json.JSONDecoder()
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
MAX_TOOLS = 128  # OpenAI's cap on functions per request
# Free-form JSON (a tool's parameters, a call's arguments) nests at most this deep, dicts
# and lists counted alike: the chat template and the code that prepares it walk it
# recursively (about two Python frames a level), and Python's default stack of 1,000
# frames ran out near 500 levels (issue 21 item 8). MAX_SCHEMA_DEPTH (sampling/grammar.py)
# allows about as much.
MAX_JSON_DEPTH = 300


# --------------------------------------------------------------------------- request models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# OpenAI's rule ([a-zA-Z0-9_-], 1 to 64), plus dots: an empty or spaced name cannot be
# called back by a client, and it is the marker the call's grammar spells out
ToolName = Annotated[
    Text, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
]


class FunctionDefinition(_Strict):
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls are always valid when forced; taken as given


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: ToolName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """A call in an assistant message of the history."""

    id: Text
    type: Literal["function"]
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# --------------------------------------------------------------------------- formats


def tool_format(template: str | None) -> str:
    """Which call syntax a chat template teaches its model (Hermes when it says none)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<tool_call>" in t:
        return HERMES
    if "<|python_tag|>" in t or "Environment: ipython" in t:
        return LLAMA3
    return HERMES


def renders_tools(template: str | None) -> bool:
    """Does the template itself render tool definitions?"""
    return template is not None and re.search(r"\btools\b", template) is not None


def hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Qwen2.5's tool instructions, for templates that do not render tools themselves."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _hermes_call_text(name: str, arguments: Any) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def json_depth(value: Any, limit: int) -> int:
    """How deep dicts and lists nest in `value` (a scalar is 0, [] is 1), counted without
    recursion and no further than limit + 1: the caller refuses what is too deep before
    anything recursive walks it."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if level > limit:
            return level
        stack.extend((child, level + 1) for child in children)
    return deepest


def new_call_id(fmt: str) -> str:
    """A fresh tool-call id; Mistral's templates insist on 9 letters and digits."""
    if fmt == MISTRAL:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


# --------------------------------------------------------------------------- one request


@dataclass
class ToolRequest:
    """What a chat request says about tools, resolved against the model's template."""

    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}} dicts
    choice: str  # "none", "auto", "required", or "function" (then `forced` names it)
    forced: str | None
    parallel: bool
    fmt: str
    native: bool  # the template renders tools; else the Hermes prompt is added
    special_ids: dict[str, int] = field(default_factory=dict)  # Mistral's control tokens
    named_form: bool = False  # Mistral's newer [TOOL_CALLS]name[ARGS]{...}
    # grammar()'s text, built once: it walks every schema, and the request asks for it
    # several times (on the event loop, too)
    _grammar: tuple[str | None] | None = field(default=None, init=False, repr=False)

    @classmethod
    def create(
        cls,
        tools: list[Tool] | None,
        tool_choice: ToolChoice | None,
        parallel_tool_calls: bool | None,
        template: str | None,
        token_id: Callable[[str], int | None] = lambda piece: None,
    ) -> ToolRequest | None:
        """The request's tool setup, or None when it involves no tools.

        token_id(piece) -> the id of a special token (for Mistral's [TOOL_CALLS]).
        Raises ParamError (a ValueError) naming the field on bad combinations."""
        if tools is None:
            if tool_choice not in (None, "none", "auto"):
                raise ParamError(
                    "tool_choice requires tools: there is no function to call", "tool_choice"
                )
            if parallel_tool_calls is not None:
                raise ParamError(
                    "parallel_tool_calls is only allowed when tools are given",
                    "parallel_tool_calls",
                )
            return None
        if not tools:
            raise ParamError("tools must not be empty: send no tools field instead", "tools")
        if len(tools) > MAX_TOOLS:  # the request model caps it too; this is the Python API's
            raise ParamError(
                f"tools has {len(tools)} functions; at most {MAX_TOOLS} are allowed", "tools"
            )
        definitions = [t.model_dump(exclude_none=True) for t in tools]
        try:  # the parameters' schemas are free-form JSON, which the model types don't check
            json.dumps(definitions, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ParamError(
                "tools contains a lone UTF-16 surrogate (such as \\ud800), which is not "
                "valid Unicode",
                "tools",
            ) from None
        for i, definition in enumerate(definitions):
            parameters = definition["function"].get("parameters")
            if json_depth(parameters, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
                raise ParamError(
                    f"tools[{i}].function.parameters nests more than {MAX_JSON_DEPTH} levels",
                    "tools",
                )
        names = [t.function.name for t in tools]
        seen: set[str] = set()  # a set, not names.count(): 20,000 tools took 4.7 s that way
        duplicate = next((n for n in names if n in seen or seen.add(n)), None)
        if duplicate is not None:
            raise ParamError(f"tools defines the function {duplicate!r} twice", "tools")
        forced = None
        if isinstance(tool_choice, NamedToolChoice):
            forced = tool_choice.function.name
            if forced not in names:
                raise ParamError(
                    f"tool_choice names the function {forced!r}, which is not among the tools",
                    "tool_choice",
                )
            choice = "function"
        else:
            choice = tool_choice or "auto"
        fmt = tool_format(template)
        special = {p: i for p in ("[TOOL_CALLS]", "[ARGS]") if (i := token_id(p)) is not None}
        return cls(
            tools=definitions,
            choice=choice,
            forced=forced,
            parallel=parallel_tool_calls is not False,
            fmt=fmt,
            native=renders_tools(template),
            special_ids=special,
            named_form=fmt == MISTRAL and "[ARGS]" in (template or ""),
        )

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    # ---- the prompt ----
    def template_inputs(
        self, messages: list[dict[str, Any]], results_as: str = "tool"
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) for the chat template. With tool_choice "none" the model is
        not told about the tools. results_as: see as_plain_chat."""
        offered = self.tools if self.choice != "none" else None
        if self.native:
            return messages, offered
        return as_plain_chat(messages, offered, results_as), None

    # ---- the output ----
    def grammar(self) -> str | None:
        """Lark text (llguidance's dialect) whose every sentence is a valid call, when
        tool_choice requires one; None otherwise."""
        if self._grammar is None:
            self._grammar = (self._build_grammar(),)
        return self._grammar[0]

    def _build_grammar(self) -> str | None:
        if self.choice not in ("required", "function"):
            return None
        tools = [t for t in self.tools if self.forced in (None, t["function"]["name"])]
        many = self.parallel and self.forced is None
        if self.fmt == MISTRAL:
            return self._mistral_grammar(tools, many)
        key = "parameters" if self.fmt == LLAMA3 else "arguments"
        calls = _json_directive(
            {"anyOf": [_call_schema(t["function"], key) for t in tools], "x-guidance": JSON_LAYOUT}
        )
        if self.fmt == LLAMA3:  # Llama 3 templates render one call per turn
            return f"start: {calls}"
        start = 'start: call ("\\n" call)*' if many else "start: call"
        return f'{start}\ncall: "<tool_call>\\n" {calls} "\\n</tool_call>"'

    def _mistral_grammar(self, tools: list[dict[str, Any]], many: bool) -> str:
        marker = self._token("[TOOL_CALLS]")
        if self.named_form:  # [TOOL_CALLS]name[ARGS]{...}, newer templates
            alternatives = " | ".join(
                f"{json.dumps(t['function']['name'])} {self._token('[ARGS]')} "
                + _json_directive(
                    {
                        **(t["function"].get("parameters") or _NO_PARAMETERS),
                        "x-guidance": JSON_LAYOUT,
                    }
                )
                for t in tools
            )
            return f"start: call{'+' if many else ''}\ncall: {marker} ({alternatives})"
        array = {
            "type": "array",
            "items": {"anyOf": [_call_schema(t["function"], "arguments") for t in tools]},
            "minItems": 1,
            "x-guidance": JSON_LAYOUT,
        }
        if not many:
            array["maxItems"] = 1
        return f"start: {marker} {_json_directive(array)}"

    def _token(self, piece: str) -> str:
        """A control token in Lark: by id when the vocabulary has it, else its text."""
        i = self.special_ids.get(piece)
        return f"<[{i}]>" if i is not None else json.dumps(piece)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.fmt)


def _call_schema(function: dict[str, Any], key: str) -> dict[str, Any]:
    """JSON Schema of one call: {"name": <const>, key: <its parameters>}, in that order."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            key: function.get("parameters") or _NO_PARAMETERS,
        },
        "required": ["name", key],
        "additionalProperties": False,
    }


def _json_directive(schema: dict[str, Any]) -> str:
    return f"%json {json.dumps(_hoist_defs(schema), ensure_ascii=False)}"


def _hoist_defs(root: dict[str, Any]) -> dict[str, Any]:
    """The schema with every nested "$defs"/"definitions" moved to the root's "$defs".

    A tool's parameters may define their own {"$defs": {"city": ...}} and point at them
    as "#/$defs/city": a pointer from the parameters' own root. Nested inside a call's
    schema, that pointer would name the call's root, which has no $defs ("Pointer
    '/$defs/city' does not exist"). Each nested set of definitions gets a prefix of its
    own (p0_, p1_, ...), and the pointers below it are rewritten to match."""
    hoisted: dict[str, Any] = dict(root.get("$defs") or {})
    count = 0

    def rewrite_refs(node: Any, renames: dict[str, str]) -> Any:
        if isinstance(node, list):
            return [rewrite_refs(v, renames) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                for old, new in renames.items():
                    if value == old or value.startswith(old + "/"):
                        value = new + value[len(old) :]
                        break
            out[key] = rewrite_refs(value, renames)
        return out

    def walk(node: Any, top: bool) -> Any:
        nonlocal count
        if isinstance(node, list):
            return [walk(v, False) for v in node]
        if not isinstance(node, dict):
            return node
        defs = {
            k: node[k]
            for k in ("$defs", "definitions")
            if not top and isinstance(node.get(k), dict)
        }
        if defs:
            prefix, count = f"p{count}_", count + 1
            renames = {
                f"#/{k}/{name}": f"#/$defs/{prefix}{name}" for k, d in defs.items() for name in d
            }
            node = rewrite_refs({k: v for k, v in node.items() if k not in defs}, renames)
            for d in defs.values():
                for name, sub in d.items():
                    hoisted[prefix + name] = walk(rewrite_refs(sub, renames), False)
        return {k: (v if k == "$defs" and top else walk(v, False)) for k, v in node.items()}

    out = walk(root, True)
    if hoisted:
        out["$defs"] = hoisted
    return out


def encode_tool_chat(
    encode: Callable[..., T],
    messages: list[dict[str, Any]],
    tools: ToolRequest | None,
    template: str | None,
) -> T:
    """encode(messages, tools=definitions) on a chat prepared for its tools, with or without
    tools in this request (a history may hold calls and results even when it offers none).
    Raises what encode raises (ChatTemplateError for a template that refuses).

    A template that knows nothing of tools gets the results as "tool" turns first: a
    ChatML template renders any role, and a small model answers from a tool turn where it
    only echoes a user turn. A template that refuses the role (Gemma's allows user and
    model turns only, alternating) gets them as a user turn instead."""
    prepared, defs = prepare_chat(messages, tools, template)
    try:
        return encode(prepared, tools=defs)
    except ChatTemplateError:
        if prepared is messages or not any(m["role"] == "tool" for m in prepared):
            raise
    prepared, defs = prepare_chat(messages, tools, template, results_as="user")
    return encode(prepared, tools=defs)


def prepare_chat(
    messages: list[dict[str, Any]],
    tools: ToolRequest | None,
    template: str | None,
    results_as: str = "tool",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template, for a request with or without tools.
    Messages come back as they are (the same list) when they need no change."""
    if tools is not None:
        return tools.template_inputs(messages, results_as)
    has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not has_calls or renders_tools(template):
        return messages, None
    return as_plain_chat(messages, None, results_as), None


def as_plain_chat(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, results_as: str = "tool"
) -> list[dict[str, Any]]:
    """A tool conversation for a template that knows nothing of tools: the Hermes
    instructions in the system message, calls as <tool_call> text, and each run of
    results as one turn of <tool_response> blocks, whose role is results_as ("tool",
    or "user" for templates that allow only user and assistant turns)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                _hermes_call_text(c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join([content, *calls]).strip()})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": results_as, "content": block, "tool_results": True})
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content", "name")})
    for message in out:
        message.pop("tool_results", None)
    if tools:
        prompt = hermes_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# --------------------------------------------------------------------------- parsing


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
