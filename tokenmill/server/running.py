"""What every API route of the server shares, whichever API it speaks.

OpenAI's routes (server/app.py), the inspector's (server/inspect_routes.py) and the other
APIs' route modules all turn a request into prompt ids and sampling parameters, then run
it through the one shared engine the same way:

    off_loop(request, fn, ...)      tokenizing, templates, tool checks: on the prep threads
    chat_prompt(request, body)      a chat-like request's tools and prompt ids, off the loop
    engine_of(request)              the engine of the model the request names
    check_model(request, name)      the model a request names, or a 404
    reasoning_of(request)           the reasoning format its chat answers split by
    cache_salt_for(request, salt)   the prefix-cache scope (per API key, then cache_salt)
    start_request(...)              compile the grammar (a 400 naming its field), queue it
    EventStream(events, stream, id) a streamed answer that aborts its request however it ends
    unless_disconnected(request, w) a whole answer, cancelled when the client leaves
    collect_one(stream)             a one-prompt request's answer and its last output

How each API shapes its answers (chunks, events, error bodies) stays with that API.

With several models (server/model_pool.py) the model is chosen once per request, before
the route runs: ModelSelect reads the body's `model`, loads and pins that model, and
leaves its choice in request.state.model_choice; engine_of, check_model and reasoning_of
read it, so no route picks a model itself. With one model (app.state.pool is None) they
read app.state as they always did.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.engine.block_manager import salt_root
from tokenmill.engine.llm_engine import LLMEngine, RequestError, RequestOutput
from tokenmill.sampling import SamplingParams
from tokenmill.sampling.grammar import GrammarError
from tokenmill.server.async_engine import (
    AsyncEngine,
    Generation,
    QueueFull,
    RequestStream,
    ShuttingDown,
)
from tokenmill.server.errors import APIError, invalid, to_api_error
from tokenmill.server.model_pool import ModelPool, Slot, unknown_model
from tokenmill.server.tools import ToolRequest
from tokenmill.tokenizer.tokenizer import TextTooLong

log = logging.getLogger("tokenmill.server")

T = TypeVar("T")

# Worker threads for tokenizing, template rendering, tool checks and grammar compiles.
# A few: each job is bounded (the body limit, the template budget), and more would only
# compete with the engine thread. Two lanes: a request whose body has BIG_BODY_BYTES or
# more runs its jobs on the big lane's own thread, so giant prompts queue behind each
# other, not ahead of everyone (8 prompts of 1 MB held a normal chat for 13.7 s when all
# shared one pool).
PREP_THREADS = 4
BIG_PREP_THREADS = 1
BIG_BODY_BYTES = 64 << 10  # ~16k tokens of English; a normal chat is a few KB
# Prep threads run at this nice level (Linux nice is per thread): a request that is not
# yet admitted must not take CPU from the engine thread that decodes for everyone. Two
# attackers compiling 15,000-pattern schemas on the 2 cores held a small chat for 19.9 s
# at equal priority (its quiet median: 1.15 s). A small job still runs at once: it only
# yields to the engine, and shares with the other prep threads.
PREP_NICE = 10


def engine_of(request: Request) -> AsyncEngine:
    """The engine of the model the request names (its choice's error when there is none:
    an unknown name's 404, a model that could not load)."""
    if request.app.state.pool is None:
        return request.app.state.engine
    return _chosen(request).engine


def _chosen(request: Request) -> Slot:
    """The pool's slot ModelSelect pinned for this request, or raise why there is none."""
    choice = getattr(request.state, "model_choice", None)
    if choice is None:  # not a POST through ModelSelect (a route that names no model)
        raise APIError(400, "this request names no model", param="model", code="model_not_found")
    if choice.slot is None:
        raise choice.error
    return choice.slot


def reasoning_of(request: Request) -> str | None:
    """The reasoning format the request's model splits chat answers by (None: not split)."""
    if request.app.state.pool is None:
        return request.app.state.reasoning
    return _chosen(request).reasoning


def shorter(text: str, limit: int = 100) -> str:
    """Client text quoted in a message, cut to a readable length."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_model(request: Request, model: str | None) -> str:
    """The served name of the model a request names (None: the default one), or a 404."""
    pool: ModelPool | None = request.app.state.pool
    if pool is not None:
        choice = getattr(request.state, "model_choice", None)
        if choice is not None:  # the body's model, as ModelSelect resolved it
            return _chosen(request).name
        name = pool.resolve(model)  # a GET naming it in its path
        if name is None:
            raise unknown_model(pool, model)
        return name
    served = request.app.state.model_name
    if model is not None and model not in request.app.state.model_names:
        raise APIError(
            404,
            f"The model '{shorter(model)}' does not exist; this server serves '{served}'",
            param="model",
            code="model_not_found",
        )
    return served


def decoder(engine: LLMEngine) -> Callable[[int], str]:
    return lambda token_id: engine.tokenizer.decode([token_id])


def lower_priority() -> None:
    """Run the calling (prep) thread PREP_NICE steps below the server's own priority; a
    no-op where threads have no nice."""
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + PREP_NICE)
        )
    except (AttributeError, OSError):  # not Linux, or not allowed: equal priority then
        pass


async def off_loop(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a worker thread: tokenizing or rendering a big prompt must not hold the
    event loop (the tokenizers library releases the GIL while it works). A request with a
    big body uses the big lane (see BIG_BODY_BYTES)."""
    big = getattr(request.state, "body_bytes", 0) >= BIG_BODY_BYTES  # set by BodyLimit
    pool = request.app.state.prep_big if big else request.app.state.prep
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, functools.partial(fn, *args))


def cache_salt_for(request: Request, cache_salt: str | None) -> int | None:
    """The prefix-cache root of a request: its API key's (under the per-key scope) and
    its own cache_salt's; None, the shared cache, when neither applies."""
    key = None
    if request.app.state.prefix_cache_scope == "per-key":
        key = getattr(request.state, "api_key_index", None)
        key = None if key is None else f"key-{key}"
    return salt_root(key, None if cache_salt is None else f"salt-{cache_salt}")


def check_messages_fit(
    engine: LLMEngine, messages: list[dict[str, Any]], param: str = "messages"
) -> None:
    """Refuse messages whose text alone certainly needs more tokens than the context,
    before the template renders it or anything tokenizes it (a 1 MB message was swept for
    special-token text and rendered before the rendered prompt was measured). The
    template writes every message's content into the prompt, so the prompt has at least
    these bytes. param: the request field that holds them, for the 400."""
    text = "".join(m["content"] for m in messages if isinstance(m.get("content"), str))
    try:
        engine.tokenizer.check_length(text, engine.max_model_len)
    except TextTooLong as e:
        verb = "hold" if param.endswith("s") else "holds"  # messages hold, input holds
        raise invalid(
            f"{param} {verb} {e.num_bytes} bytes of text, at least {e.min_tokens} tokens: "
            f"more than the model's context of {engine.max_model_len - 1} (leaving room "
            "for at least one generated token)",
            param,
        ) from None


class ChatBody(Protocol):
    """A chat-like request body (chat completions, Anthropic's messages, responses)."""

    @property
    def template_vars(self) -> dict[str, Any] | None: ...

    def tool_request(self, tokenizer: Any) -> ToolRequest | None: ...

    def template_messages(self) -> list[dict[str, Any]]: ...


async def chat_prompt(
    request: Request, body: ChatBody, param: str = "messages"
) -> tuple[ToolRequest | None, list[int]]:
    """The tools and prompt ids of a chat-like request, prepared on the prep threads (a
    tool list's checks walk every schema: 20,000 tools held the loop 4.7 s; rendering
    walks every message). param: the field that holds the messages, for a 400."""
    engine = engine_of(request).engine
    tools = await off_loop(request, body.tool_request, engine.tokenizer)
    return tools, await off_loop(request, _encode_chat, engine, body, tools, param)


def _encode_chat(
    engine: LLMEngine, body: ChatBody, tools: ToolRequest | None, param: str
) -> list[int]:
    """The body's messages (and tools) rendered with the model's chat template and
    tokenized: tokenizer/chat.py's encode_chat, as LLM.chat and /v1/inspect do, with the
    body's further template variables. Runs on a worker thread."""
    messages = body.template_messages()
    if not messages:  # e.g. input of reasoning items only, which the prompt leaves out
        raise invalid(
            f"{param} has no message for the model to answer (an earlier answer's "
            "reasoning is left out of the prompt)",
            param,
        )
    check_messages_fit(engine, messages, param)
    try:
        return engine.encode_chat(messages, tools, body.template_vars)
    except ValueError as e:  # ChatTemplateError, RequestError (too long), a refused message
        raise to_api_error(e, param=param) from None


async def start_request(
    request: Request,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    cache_salt: str | None = None,
    constraint_param: str | None = None,
    fields: Mapping[str, Any] | None = None,
) -> RequestStream:
    """Compile params' constraint (off the loop; a schema the engine refuses is a 400 about
    `constraint_param`, the field that carried it) and queue the prompts on the engine.
    A full queue, a shutdown or a bad request (e.g. a logit_bias id) becomes an APIError
    (`fields`: the request model's fields, to name the parameter as the client sent it)."""
    engine = engine_of(request)
    try:
        grammar = await off_loop(request, engine.engine.compile_grammar, params)
    except GrammarError as e:
        raise to_api_error(e, param=constraint_param) from None
    try:
        salt = cache_salt_for(request, cache_salt)
        return await engine.generate(
            request_id,
            prompts,
            params,
            grammar=grammar,
            cache_salt=salt,
            constraint_param=constraint_param,
        )
    except (QueueFull, ShuttingDown, RequestError) as e:
        raise to_api_error(e, fields=fields) from None


class EventStream(StreamingResponse):
    """A streamed response (SSE by default) that aborts its request however the response ends: finished,
    client gone (Starlette cancels the body iterator), or never started."""

    def __init__(
        self,
        events: AsyncIterator[str],
        stream: RequestStream,
        request_id: str,
        media_type: str = "text/event-stream",
    ):
        """media_type: what the events are (Ollama's API streams NDJSON lines)."""
        super().__init__(
            events,
            media_type=media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._stream, self._request_id = stream, request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._stream.abort():
                log.info("%s: client disconnected mid-stream; aborted", self._request_id)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`; if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else None


async def collect_one(stream: RequestStream) -> tuple[Generation, RequestOutput | None]:
    """The whole answer of a request with one prompt and n = 1, and its last output (what
    ended it: stop_string, num_cached_tokens); aborted if cancelled."""
    generation, last = Generation(), None
    try:
        async for _, out in stream:
            generation.add(out)
            last = out
    finally:
        stream.abort()
    return generation, last


async def disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
