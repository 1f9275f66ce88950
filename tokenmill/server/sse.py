"""What every streaming route shares: the server-sent-event framing, and how the engine's
refusals become OpenAI-shaped errors (one mapping for the completion, chat and inspect
routes)."""

from __future__ import annotations

import json
import logging
from typing import Any

from tokenmill.engine.llm_engine import RequestError
from tokenmill.server.async_engine import EngineFailure, QueueFull, ShuttingDown
from tokenmill.server.protocol import APIError, invalid

log = logging.getLogger(__name__)

RETRY = {"Retry-After": "1"}  # a full queue or a draining server: worth another try


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json or literal>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def engine_error(e: Exception, param_names=()) -> APIError:
    """The API error for what submitting to or running on the engine raised: a full queue
    is 429, a draining server 503, a request the engine refuses 400 (naming the request
    field when the message starts with one of `param_names`), anything else 500."""
    if isinstance(e, QueueFull):
        return APIError(429, str(e), type="rate_limit_error", code="queue_full", headers=RETRY)
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), type="server_error", code="shutting_down", headers=RETRY)
    if isinstance(e, RequestError):
        param = str(e).split(" ", 1)[0]
        return invalid(str(e), param if param in param_names else None)
    if not isinstance(e, EngineFailure):
        log.exception("request failed", exc_info=e)
    return APIError(500, str(e), type="server_error", code="internal_error")
