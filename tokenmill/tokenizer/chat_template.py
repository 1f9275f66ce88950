"""Chat templates: turn a list of messages into the prompt text a chat model was trained on.

Models ship their template as Jinja source (`tokenizer_config.json` or the GGUF key
`tokenizer.chat_template`). We render it the way transformers does, so the prompt text is the same
one the model saw in training: a sandboxed environment with `trim_blocks` and `lstrip_blocks`,
the `loopcontrols` extension, a `tojson` filter that leaves non-ASCII text alone, and the
`raise_exception` and `strftime_now` helpers templates call. Tool definitions go in as
`tools` (OpenAI's {"type": "function", "function": {...}} dicts), as transformers passes them;
an assistant message may carry `tool_calls` and a tool message its `tool_call_id`.

The template comes from the model file, so it is untrusted code: it renders in a sandbox with a
budget (template_limits.py: steps, wall clock, sizes), and whatever goes wrong inside it (a limit,
a Python error, runaway recursion) becomes one ChatTemplateError for that request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2

from .template_limits import LimitedSandbox, RenderLimits, TemplateLimitError

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template refused or failed to render the messages."""


def validate_messages(messages: Any) -> None:
    """Raise a one-line ValueError unless `messages` is a non-empty list of {role, content} dicts."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, not {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(
                f"messages[{i}]['role'] must be one of {', '.join(ROLES)}; got {role!r}"
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}]['content'] must be a string, not {type(content).__name__}"
            )


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_vars: Mapping[str, Any] | None = None,
    limits: RenderLimits = RenderLimits(),  # noqa: B008 (frozen)
) -> str:
    """Render `template` for `messages` (validated first) within `limits`; every failure
    is a one-line ChatTemplateError. tools: function definitions for templates that render
    them (None: no tools). template_vars: further variables for the template's context,
    such as Qwen3's {"enable_thinking": False}; a ValueError for one that would replace a
    variable set here."""
    validate_messages(messages)
    context = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token or "",
        "eos_token": eos_token or "",
        "tools": tools or None,
        "documents": None,
    }
    for name in template_vars or {}:
        if not isinstance(name, str) or name in context or is_reserved(name):
            raise ValueError(
                f"template_vars cannot set {name!r}: not a name, or one the renderer sets"
            )
    compiled = _compile(template)
    try:
        return _ENV.render(compiled, limits, **context, **(template_vars or {}))
    except ChatTemplateError:
        raise  # the template's own raise_exception
    except TemplateLimitError as e:
        raise ChatTemplateError(str(e)) from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {_first_line(e)}") from None
    except (Exception, RecursionError) as e:  # TypeError, ZeroDivisionError... in its code
        raise ChatTemplateError(
            f"chat template failed: {type(e).__name__}: {_first_line(e)}"
        ) from None


# The variables render_chat_template sets in every template's context.
RENDERER_VARS = (
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "tools",
    "documents",
)


def is_reserved(name: str) -> bool:
    """Whether template_vars may not set `name`: a variable the renderer sets
    (RENDERER_VARS, the sandbox's globals such as raise_exception)."""
    return name in RENDERER_VARS or name in _ENV.globals


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> LimitedSandbox:
    env = LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.finish_setup()
    return env


_ENV = _environment()  # one environment: compiled templates are cached per source below


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {_first_line(e)}") from None
    except (Exception, RecursionError) as e:  # e.g. nesting deep enough to exhaust the parser
        raise ChatTemplateError(
            f"chat template does not compile: {type(e).__name__}: {_first_line(e)}"
        ) from None
