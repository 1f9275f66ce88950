"""Every error the HTTP API answers with, decided in one place.

    to_api_error(exc) -> APIError      what an exception means for a client: status,
                                       type, message, param, code
    format_openai(error) -> dict       OpenAI's body, {"error": {message, type, param, code}}
    format_anthropic(error) -> dict    Anthropic's, {"type": "error", "error": {type, message}}
    error_body(error, path) -> dict    the body in the shape of the API that `path` belongs to

Routes, the exception handlers and the streams (completion, chat, inspect) all go
through `to_api_error`; nothing reads a message to find out what it is about. A
request parameter's error is a tokenmill.checks.ParamError (SamplingParams, the request
models, the engine's RequestError), which carries that parameter as `param`.

APIError is the error itself, not its wire form: another API's shape (Anthropic's,
the Responses API's) is another formatter beside `format_openai`, over the same APIError,
and FORMATTERS says which paths answer in it (the app's error handlers ask `error_body`).

Whatever raised it, no message carries a native panic, a backtrace, a source path, or
in a server error a loopback address (`clean_message`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.checks import ParamError
from tokenmill.sampling.grammar import GrammarError
from tokenmill.server.async_engine import EngineFailure, QueueFull, ShuttingDown

log = logging.getLogger("tokenmill.server")

RETRY = {"Retry-After": "1"}  # a full queue or a draining server: worth another try
INTERNAL = "internal server error"  # all a client learns of a failure that is a bug here


class APIError(Exception):
    """An error response: HTTP status, OpenAI's error `type`, message, the request
    parameter it is about (or None), a machine-readable code, extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers

    def body(self, path: str = "") -> dict[str, Any]:
        """The body in the shape of the API whose route `path` is (OpenAI's by default)."""
        return error_body(self, path)


class InternalError(Exception):
    """A failure that is a bug here, already logged: the client is told only that it
    happened (INTERNAL)."""

    def __init__(self) -> None:
        super().__init__(INTERNAL)


def format_openai(error: APIError) -> dict[str, Any]:
    """OpenAI's error shape. Render it ASCII-escaped (json.dumps' default): a message may
    quote what the client sent. The message goes through `clean_message` first."""
    message = clean_message(error.message, internal=error.type == "server_error")
    return {
        "error": {"message": message, "type": error.type, "param": error.param, "code": error.code}
    }


# Anthropic's error types (docs.anthropic.com, "Errors"), by HTTP status; any other 4xx is
# an invalid_request_error, any other 5xx an api_error.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",  # a draining server: worth another try, as a 529 is
}


def format_anthropic(error: APIError) -> dict[str, Any]:
    """Anthropic's error shape, {"type": "error", "error": {"type", "message"}}: the type
    follows the status (the Anthropic SDK picks its exception class by the status). The
    shape has no `param`; the message names the field."""
    kind = _ANTHROPIC_TYPES.get(error.status)
    if kind is None:
        kind = "api_error" if error.status >= 500 else "invalid_request_error"
    message = clean_message(error.message, internal=error.status >= 500)
    return {"type": "error", "error": {"type": kind, "message": message}}


def format_ollama(error: APIError) -> dict[str, Any]:
    """Ollama's error shape, {"error": "message"}: the status says the rest."""
    return {"error": clean_message(error.message, internal=error.status >= 500)}


# The error shape of each API that is not OpenAI's, by the path its routes live under
# (that path itself, or below it): a route's errors, including FastAPI's validation
# errors, the API key's 401 and an unknown path's 404 under it, come out in its shape.
FORMATTERS: dict[str, Callable[[APIError], dict[str, Any]]] = {
    "/v1/messages": format_anthropic,
    "/api": format_ollama,
}


def error_body(error: APIError, path: str = "") -> dict[str, Any]:
    """The body of `error` in the shape of the API whose route `path` is (OpenAI's when
    no entry of FORMATTERS claims the path)."""
    for prefix, formatter in FORMATTERS.items():
        if path == prefix or path.startswith(prefix + "/"):
            return formatter(error)
    return format_openai(error)


def invalid(message: str, param: str | None = None) -> APIError:
    """A 400 about `param`, for what a route checks itself."""
    return APIError(400, message, param=param)


def to_api_error(
    exc: BaseException, *, param: str | None = None, fields: Collection[str] | None = None
) -> APIError:
    """The API error for `exc`:

    APIError                  itself
    QueueFull                 429 rate_limit_error, queue_full, Retry-After
    ShuttingDown              503 server_error, shutting_down, Retry-After
    RequestValidationError    400 about the first bad field (pydantic_errors_to_api_error)
    HTTPException             its status and detail (Starlette's own 404s and 405s)
    ParamError, RequestError  400 naming exc.param
    GrammarError              400 naming the constraint kind it compiled
    RecursionError            400: the client's structure nested past Python's stack
    EngineFailure             500 server_error with its message (the engine logged it)
    InternalError             500 saying only INTERNAL
    anything else             500 with its message, logged here

    param: the request field the caller knows `exc` is about (a chat template's refusal
    is about `messages`, a grammar's about the field that carried it); a ValueError
    given one is the client's 400. fields: the request's own field names; a ParamError
    naming anything else (the engine's `prompt` in a chat request) names no field."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers=RETRY)
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), type="server_error", code="shutting_down", headers=RETRY)
    if isinstance(exc, RequestValidationError):
        return pydantic_errors_to_api_error(list(exc.errors()))
    if isinstance(exc, StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers)
    if param is not None and isinstance(exc, ValueError):
        return invalid(str(exc), param)
    if isinstance(exc, ParamError):
        known = fields is None or exc.param in fields
        return invalid(str(exc), exc.param if known else None)
    if isinstance(exc, GrammarError):
        return invalid(str(exc), exc.kind)
    if isinstance(exc, RecursionError):
        return invalid("the request nests too deeply to process; flatten it")
    if not isinstance(exc, (EngineFailure, InternalError)):
        log.exception("request failed", exc_info=exc)
    return APIError(500, str(exc), type="server_error", code="internal_error")


def pydantic_errors_to_api_error(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI's 422 validation errors as one OpenAI-shaped 400 about the first bad field.

    A value that fails a union type fails once per member, with the member's name
    in its location; the errors for that field are merged and located at their
    common prefix (e.g. messages[0].content)."""
    first = errors[0]
    loc = _without_body(first["loc"])
    if first["type"] == "json_invalid":
        return invalid(f"The request body is not valid JSON: {first.get('msg')}")
    if not loc:
        return invalid(f"The request body must be a JSON object: {first['msg']}")
    param = str(loc[0])
    if first["type"] == "missing":
        return invalid(f"Missing required parameter: '{_path(loc)}'", param)
    if first["type"] == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {_path(loc)}", param)
    if first["type"] == "too_long" and "max_length" in first.get("ctx", {}):
        ctx = first["ctx"]
        return invalid(
            f"'{_path(loc)}' has {ctx.get('actual_length', 'too many')} items; at most "
            f"{ctx['max_length']} are allowed",
            param,
        )
    same_field = [e for e in errors if _without_body(e["loc"])[:1] == loc[:1]]
    common = loc
    for error in same_field:
        other = _without_body(error["loc"])
        while common != other[: len(common)]:
            common = common[:-1]
    # A validator's own refusal (a lone surrogate) says more than "not a list" from the
    # other members of a union.
    refusals = [e for e in same_field if e["type"] == "value_error"]
    shown = [_json_words(e) for e in refusals or same_field]
    messages = "; or ".join(dict.fromkeys(shown))
    return invalid(f"Invalid value for '{_path(common)}': {messages}", param)


# The body is validated in pydantic's python mode, whose messages name Python types;
# a client sent JSON, so it is told about arrays and objects.
_JSON_TYPE_MESSAGES = {
    "list_type": "Input should be a JSON array",
    "dict_type": "Input should be a JSON object",
    "model_type": "Input should be a JSON object",
    "model_attributes_type": "Input should be a JSON object",
}


def _json_words(error: dict[str, Any]) -> str:
    if error["type"] in _JSON_TYPE_MESSAGES:
        return _JSON_TYPE_MESSAGES[error["type"]]
    return error["msg"].removeprefix("Value error, ")


def _without_body(loc: tuple) -> tuple:
    return loc[1:] if loc[:1] == ("body",) else loc


def _path(loc: tuple) -> str:
    """The JSON path of a location: ("messages", 0, "content") -> messages[0].content."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path.lstrip(".")


# What no error message may carry to a client, whatever raised it (a
# schema made llguidance panic, and its 3.4 KB 400 held the assertion, a backtrace and
# build paths): a native panic or backtrace, a Python traceback, source and build paths;
# in a server error also loopback addresses with their port (a distributed rank's).
MAX_MESSAGE_CHARS = 2000
_TRACE = re.compile(r"<backtrace>|stack backtrace:|Traceback \(most recent call last\)")
_PANIC = re.compile(r"\bpanic(?:ked at\b|:)\s.*", re.S)
_SOURCE_PATH = re.compile(
    r"(?:[A-Za-z]:)?(?:[\\/][\w.@+~-]+)+\.(?:rs|py|pyx|c|cc|cpp|h|hpp|so)\b(?::\d+)*"
)
_ADDRESS = re.compile(r"\b(?:127(?:\.\d{1,3}){3}|0\.0\.0\.0|localhost|\[::1?\]):\d+\b")
_LINE_BREAKS = re.compile(r"\s*[\r\n]+\s*")


def clean_message(message: str, internal: bool = False) -> str:
    """`message` as one line without the leaks above, at most MAX_MESSAGE_CHARS long.
    internal: a server error's message (addresses are redacted there; a client's own
    text, which 4xx messages quote, is left alone)."""
    trace = _TRACE.search(message)
    if trace is not None:
        message = message[: trace.start()]
    message = _PANIC.sub("an internal error in a native library", message)
    message = _SOURCE_PATH.sub("<source>", message)
    if internal:
        message = _ADDRESS.sub("<address>", message)
    message = _LINE_BREAKS.sub(" ", message).strip()
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return message or INTERNAL
