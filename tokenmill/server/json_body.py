"""The one reader of JSON request bodies: every POST route, and ModelSelect (which reads a
body's `model` before the route runs), parse a body with `parse_body` and so accept and
refuse the same bytes with the same words.

    json_body(Model)   a FastAPI dependency: the request's body read, parsed and
                       validated as Model (its errors a 400 naming the field)
    parse_body()       the body as a JSON object, parsed once per request (the value, or
                       the refusal, is kept in the request's scope for the next reader)

What a body must be:
- sent as `Content-Type: application/json` (or another `+json` type). A browser page on
  any site can POST `text/plain` or a form, or a body with no type at all, to a loopback
  server without asking first (CORS lets these "simple requests" through); a JSON type
  needs the page to ask, and this server never answers yes.
- UTF-8, as RFC 8259 requires of JSON between systems; a leading byte order mark is
  skipped (the RFC lets a reader ignore it), and UTF-16 or UTF-32 is refused by name
  rather than read as garbled UTF-8.
- one JSON object, with Python's json module reading it: before, the routes parsed with
  json (FastAPI's) or pydantic's own parser (/v1/responses), which disagreed on a byte
  order mark and on UTF-16.

A body of BIG_BODY_BYTES or more is parsed on a worker thread, not on the event loop.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.types import Scope

from tokenmill.server.errors import APIError, invalid, pydantic_errors_to_api_error

BIG_BODY_BYTES = 64 << 10
_PARSED = "json_body"  # the key in the request scope's state

M = TypeVar("M", bound=BaseModel)


def json_body(
    model: type[M], errors: Callable[[list[Any]], list[Any]] = lambda e: e
) -> Callable[[Request], Awaitable[M]]:
    """A dependency giving the request's body as `model` (pydantic's python mode, as
    FastAPI validated bodies); errors: a rewrite of the validation errors' list before it
    becomes the 400."""

    async def read(request: Request) -> M:
        value = await parse_body(request.scope, await request.body())
        try:
            return model.model_validate(value)
        except ValidationError as e:
            raise pydantic_errors_to_api_error(errors(list(e.errors()))) from None

    return read


async def parse_body(scope: Scope, raw: bytes) -> dict[str, Any]:
    """The body of the request in `scope` (whose bytes are `raw`) as a JSON object; an
    APIError (400) when it is none. Parsed once: later calls give the same answer."""
    state = scope.setdefault("state", {})
    if _PARSED not in state:
        try:
            _check_content_type(scope)
            if len(raw) >= BIG_BODY_BYTES:
                loop = asyncio.get_running_loop()
                state[_PARSED] = await loop.run_in_executor(None, parse_json, raw)
            else:
                state[_PARSED] = parse_json(raw)
        except APIError as e:
            state[_PARSED] = e
    parsed = state[_PARSED]
    if isinstance(parsed, APIError):
        raise parsed
    return parsed


def parse_json(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object in UTF-8 (a byte order mark skipped); a 400 otherwise."""
    raw = raw.removeprefix(codecs.BOM_UTF8)
    if raw[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE) or b"\0" in raw[:4]:
        # JSON text begins with ASCII, so a NUL among its first bytes means 2 or 4 bytes
        # per character
        raise invalid("The request body must be JSON in UTF-8 (RFC 8259), not UTF-16 or UTF-32")
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise invalid(f"The request body is not valid UTF-8 (at byte {e.start})") from None
    if not text.strip():
        raise invalid("The request body is empty; it must be a JSON object")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid(
            f"The request body is not valid JSON: {e.msg} (line {e.lineno} column {e.colno})"
        ) from None
    except RecursionError:
        raise invalid("the request nests too deeply to process; flatten it") from None
    if not isinstance(value, dict):
        raise invalid(f"The request body must be a JSON object, not {_json_type(value)}")
    return value


def _check_content_type(scope: Scope) -> None:
    value = next((v for k, v in scope["headers"] if k == b"content-type"), None)
    kind = value.decode("latin-1").split(";", 1)[0].strip().lower() if value else ""
    if kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")):
        return
    shown = f"'{kind[:100]}'" if kind else "none"
    raise invalid(
        f"The request body must be sent with Content-Type: application/json (this one has {shown})"
    )


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return "a boolean" if isinstance(value, bool) else "a number"
