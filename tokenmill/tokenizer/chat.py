"""A chat request -> prompt token ids: the one preparation every chat caller uses.

    encode_chat(tokenizer, messages, tools=None, max_tokens=..., template_vars=...)

LLMEngine.encode_chat (and through it LLM.chat, the server's chat route and
/v1/inspect) calls it, so each prepares a conversation the same way:

- Tools are rendered by the model's own template when it renders tools (`tools=` in its
  context, as transformers does: `renders_tools`). A template that does not (the default
  SmolLM2's, Gemma's) gets the Hermes instructions in its system message instead, and
  earlier calls and tool results written out as text (`as_plain_chat`), so any chat model
  can be offered tools, and a history holding calls renders on any template.
- Tool results go to such a template as "tool" turns first: a ChatML template renders any
  role, and a small model answers from a tool turn where it only echoes a user turn. A
  template that refuses the role (Gemma's allows user and model turns only, alternating)
  gets them as a user turn instead (`encode_tool_chat`).
- template_vars: further variables for the template's context, such as Qwen3's
  {"enable_thinking": False}: the switch a reasoning model's template reads.

`tools` is what the request offers (server/tools.py's ToolRequest is one: `ToolOffer`);
`tool_format` tells which call syntax the template teaches its model, for the call
parser and the grammar that forces a call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from .chat_template import ChatTemplateError
from .tokenizer import Tokenizer

T = TypeVar("T")

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"  # call syntaxes (tool_format)


class ToolOffer(Protocol):
    """A request's tools as chat preparation sees them: the function definitions shown to
    the model (OpenAI's {"type": "function", "function": {...}} dicts), or None when it is
    shown none (tool_choice "none")."""

    @property
    def offered(self) -> list[dict[str, Any]] | None: ...


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: ToolOffer | None = None,
    *,
    max_tokens: int | None = None,
    template_vars: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of a conversation prepared for its tools (with or without tools in this
    request: a history may hold calls and results even when it offers none) and rendered
    with the model's chat template, messages' text kept as text.

    max_tokens: raise TextTooLong for a rendered prompt that cannot fit (before
    tokenizing). template_vars: further template variables (see the module's docstring).
    Raises ChatTemplateError (a ValueError) for a template that fails or goes over its
    limits."""

    def encode(prepared: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return tokenizer.encode_chat(
            prepared, max_tokens=max_tokens, tools=tools, template_vars=template_vars
        )

    return encode_tool_chat(encode, messages, tools, tokenizer.chat_template)


def encode_tool_chat(
    encode: Callable[..., T],
    messages: list[dict[str, Any]],
    tools: ToolOffer | None,
    template: str | None,
) -> T:
    """encode(messages, tools=definitions) on a chat prepared for its tools, retried with
    the results as a user turn when the template refuses "tool" turns (see the module's
    docstring). Raises what encode raises (ChatTemplateError for a template that refuses
    for another reason)."""
    prepared, defs = prepare_chat(messages, tools, template)
    try:
        return encode(prepared, tools=defs)
    except ChatTemplateError:
        if prepared is messages or not any(_is_tool_turn(m) for m in prepared):
            raise
    prepared, defs = prepare_chat(messages, tools, template, results_as="user")
    return encode(prepared, tools=defs)


def prepare_chat(
    messages: list[dict[str, Any]],
    tools: ToolOffer | None,
    template: str | None,
    results_as: str = "tool",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template, for a request with or without tools.
    Messages come back as they are (the same list) when they need no change."""
    offered = tools.offered if tools is not None else None
    return template_inputs(messages, offered, renders_tools(template), results_as)


def template_inputs(
    messages: list[dict[str, Any]],
    offered: list[dict[str, Any]] | None,
    native: bool,
    results_as: str = "tool",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for a template that renders tools itself (native) or not.
    offered: the definitions shown to the model (None: none); results_as: see
    as_plain_chat."""
    if native:
        return messages, offered
    if offered is None and not _has_calls(messages):
        return messages, None
    return as_plain_chat(messages, offered, results_as), None


def _has_calls(messages: list[Any]) -> bool:
    return any(_is_tool_turn(m) or (isinstance(m, dict) and m.get("tool_calls")) for m in messages)


def _is_tool_turn(message: Any) -> bool:
    # not a dict, or no role: left for the template's validation to name
    return isinstance(message, dict) and message.get("role") == "tool"


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


def as_plain_chat(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, results_as: str = "tool"
) -> list[dict[str, Any]]:
    """A tool conversation for a template that knows nothing of tools: the Hermes
    instructions in the system message, calls as <tool_call> text, and each run of
    results as one turn of <tool_response> blocks, whose role is results_as ("tool",
    or "user" for templates that allow only user and assistant turns)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(message)  # the template's validation names it
            continue
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                _hermes_call_text(c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join([content, *calls]).strip()})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and isinstance(out[-1], dict) and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": results_as, "content": block, "tool_results": True})
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content", "name")})
    for message in out:
        if isinstance(message, dict):
            message.pop("tool_results", None)
    if tools:
        prompt = hermes_system_prompt(tools)
        if out and isinstance(out[0], dict) and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
