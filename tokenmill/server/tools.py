"""Tool calls in /v1/chat/completions: a request's tools, resolved against the template.

    ToolRequest.create(tools, tool_choice, parallel_tool_calls, template, token_id)
        .offered                     the definitions shown to the model (tool_choice
                                     "none": none), for tokenizer/chat.py's encode_chat
        .template_inputs(messages)   messages and `tools` for the chat template
        .grammar()                   Lark text that forces a valid call (tool_choice
                                     "required" or a named function), else None
        .parser()                    a ToolCallParser (tool_parser.py) for one choice's output

The call syntax depends on the model family, and the chat template tells which
(tokenizer/chat.py's `tool_format`). How tools reach the prompt (the template's own
rendering, or the Hermes instructions for a template that renders none) is chat
preparation's, in tokenizer/chat.py; the wire models are in protocol.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tokenmill.checks import ParamError
from tokenmill.sampling.grammar import JSON_LAYOUT
from tokenmill.server.tool_parser import MAX_JSON_DEPTH, ToolCallParser
from tokenmill.tokenizer.chat import LLAMA3, MISTRAL, renders_tools, template_inputs, tool_format

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
MAX_TOOLS = 128  # OpenAI's cap on functions per request


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
        tools: Sequence[BaseModel] | None,
        tool_choice: str | BaseModel | None,
        parallel_tool_calls: bool | None,
        template: str | None,
        token_id: Callable[[str], int | None] = lambda piece: None,
    ) -> ToolRequest | None:
        """The request's tool setup, or None when it involves no tools.

        tools: protocol.py's Tool models; tool_choice: "none", "auto", "required" or a
        NamedToolChoice (typed loosely: they live in protocol.py, which imports this module).
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
            # a call's arguments are a JSON object, as OpenAI's and Anthropic's APIs require
            # of the schema: any other type lets a forced call be a string or a number,
            # which no client can read back as arguments ({} and none: no parameters)
            if parameters and parameters.get("type") != "object":
                raise ParamError(
                    f"tools[{i}].function.parameters must be a JSON Schema of type "
                    f"'object', not {parameters.get('type', 'untyped')!r}: a call's arguments "
                    "are an object",
                    "tools",
                )
            if json_depth(parameters, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
                raise ParamError(
                    f"tools[{i}].function.parameters nests more than {MAX_JSON_DEPTH} levels",
                    "tools",
                )
        names = [d["function"]["name"] for d in definitions]
        seen: set[str] = set()  # a set, not names.count(): 20,000 tools took 4.7 s that way
        duplicate = next((n for n in names if n in seen or seen.add(n)), None)
        if duplicate is not None:
            raise ParamError(f"tools defines the function {duplicate!r} twice", "tools")
        forced = None
        if isinstance(tool_choice, BaseModel):  # a NamedToolChoice
            forced = tool_choice.model_dump()["function"]["name"]
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

    # ---- the prompt (tokenizer/chat.py prepares it) ----
    @property
    def offered(self) -> list[dict[str, Any]] | None:
        """The definitions shown to the model: with tool_choice "none" it is not told
        about the tools."""
        return self.tools if self.choice != "none" else None

    def template_inputs(
        self, messages: list[dict[str, Any]], results_as: str = "tool"
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) for the chat template. results_as: see chat.as_plain_chat."""
        return template_inputs(messages, self.offered, self.native, results_as)

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
