"""The HTTP layer: OpenAI-compatible routes over one AsyncEngine.

    create_app(engine, model_name=..., api_key=...) -> FastAPI

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming as
Server-Sent Events when `stream` is true), GET /v1/models[/{model}], GET /health,
GET /metrics; plus POST /v1/inspect from tokenmill.server.inspect_routes when that
module exists, and the web inspector's static files at / when
tokenmill/server/static/index.html exists (mounted last, so API routes win).

`app.state.engine` is the AsyncEngine (tokenmill/server/async_engine.py): routes
submit requests to it (`generate`, `run_traced`) and read its `.engine`, the
synchronous LLMEngine, for the tokenizer, config and max_model_len. The engine
thread starts and stops with the app's lifespan.

Every error is OpenAI's JSON shape, {"error": {message, type, param, code}}:
FastAPI's own 422 validation errors become 400s. With an API key, every /v1 route
needs `Authorization: Bearer <key>`; /health and /metrics stay open.

A client that goes away aborts its request at once (its KV blocks are freed at
the engine's next step): a stream notices through cancellation or
`request.is_disconnected()`, a non-streaming request through a watcher on the
connection's receive channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from tokenmill.engine.llm_engine import LLMEngine, RequestError
from tokenmill.sampling import SamplingParams
from tokenmill.sampling.grammar import GrammarError
from tokenmill.server.async_engine import AsyncEngine, EngineFailure, QueueFull, RequestStream
from tokenmill.server.metrics import CONTENT_TYPE
from tokenmill.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    check_fits,
    error_body,
    invalid,
    pydantic_errors_to_api_error,
)
from tokenmill.server.tools import ToolRequest, render_chat

log = logging.getLogger("tokenmill.server")

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"

T = TypeVar("T")

router = APIRouter()  # /v1: behind the API key when one is set
ops_router = APIRouter()  # /health, /metrics: always open
# Unknown /v1 paths get a JSON 404 rather than the static files' answer. A known path
# with the wrong method lands here too (a full match beats a method mismatch).
fallback_router = APIRouter()


def create_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    aliases: Sequence[str] = (),
) -> FastAPI:
    """An app serving `engine` under the name `model_name`; `api_key` guards /v1 routes.

    Requests may also name the model by any of `aliases` (e.g. its file name); responses
    and /v1/models always use `model_name`, as vLLM does with several served names."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="tokenmill", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.engine = engine
    app.state.model_name = model_name
    app.state.model_names = {model_name, *aliases}
    app.state.created = int(time.time())
    _add_error_handlers(app)
    auth = [Depends(_api_key_check(api_key))] if api_key else []
    app.include_router(router, dependencies=auth)
    inspect = _inspect_router()
    if inspect is not None:
        app.include_router(inspect, dependencies=auth)
    app.include_router(ops_router)
    app.include_router(fallback_router)
    if (STATIC_DIR / "index.html").is_file():
        app.mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="static")
    return app


def _inspect_router() -> APIRouter | None:
    name = "tokenmill.server.inspect_routes"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # it exists but imports something missing: a real error
            raise
        return None
    return module.router


# --------------------------------------------------------------------------- errors and auth


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(pydantic_errors_to_api_error(list(exc.errors())))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body(str(exc.detail), "invalid_request_error", None, None)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def engine_failure(request: Request, exc: EngineFailure) -> JSONResponse:
        return _error_response(_server_error(exc))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback and re-raises after sending this.
        return _error_response(_server_error(RuntimeError("internal server error")))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(EngineFailure, engine_failure)
    app.add_exception_handler(Exception, unexpected)


def _server_error(exc: Exception) -> APIError:
    return APIError(500, str(exc), type="server_error", code="internal_error")


def _api_key_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check


# --------------------------------------------------------------------------- routes


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    model = _check_model(request, body.model)
    body.check_extra_fields()
    prompt_ids, prompt_text = _completion_prompt(engine.engine, body.prompt)
    params = body.sampling_params(DEFAULT_COMPLETION_MAX_TOKENS)
    check_fits(
        len(prompt_ids),
        params.max_tokens,
        engine.engine.max_model_len,
        prompt_param="prompt",
        max_param="max_tokens",
    )
    request_id = uuid.uuid4().hex
    fmt = CompletionFormat(
        request_id,
        model,
        _decoder(engine.engine),
        body.logprobs is not None,
        params.n,
        prompt_text if body.echo else None,
    )
    return await _run(request, body, fmt, request_id, prompt_ids, params)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    model = _check_model(request, body.model)
    body.check_extra_fields()
    tools = body.tool_request(engine.engine.tokenizer)
    prompt_ids = _chat_prompt(engine.engine, body, tools)
    max_model_len = engine.engine.max_model_len
    params = body.sampling_params(default_max_tokens=max(1, max_model_len - len(prompt_ids)))
    check_fits(
        len(prompt_ids),
        params.max_tokens,
        max_model_len,
        prompt_param="messages",
        max_param=body.max_tokens_param,
    )
    request_id = uuid.uuid4().hex
    fmt = ChatFormat(request_id, model, _decoder(engine.engine), body.logprobs, tools)
    return await _run(request, body, fmt, request_id, prompt_ids, params)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict:
    _check_model(request, model)
    return _model_card(request)


@ops_router.get("/health")
async def health(request: Request) -> JSONResponse:
    if not _engine(request).alive:
        body = error_body("the engine loop is not running", "server_error", None, "unhealthy")
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok"})


@ops_router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    engine = _engine(request)
    return PlainTextResponse(engine.metrics.render(engine.stats()), media_type=CONTENT_TYPE)


@fallback_router.api_route(
    "/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
)
async def unknown_route(path: str, request: Request) -> JSONResponse:
    raise APIError(404, f"Unknown API route: {request.method} /v1/{path}", code="not_found")


# --------------------------------------------------------------------------- helpers


def _engine(request: Request) -> AsyncEngine:
    return request.app.state.engine


def _check_model(request: Request, model: str | None) -> str:
    served = request.app.state.model_name
    if model is not None and model not in request.app.state.model_names:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{served}'",
            param="model",
            code="model_not_found",
        )
    return served


def _model_card(request: Request) -> dict:
    return {
        "id": request.app.state.model_name,
        "object": "model",
        "created": request.app.state.created,
        "owned_by": "tokenmill",
        "max_model_len": _engine(request).engine.max_model_len,
    }


def _decoder(engine: LLMEngine) -> Callable[[int], str]:
    return lambda token_id: engine.tokenizer.decode([token_id])


def _completion_prompt(
    engine: LLMEngine, prompt: str | list[str] | list[int]
) -> tuple[list[int], str]:
    """Token ids of a completion prompt, and its text (for echo)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise invalid(
                "a list of several prompts (a batch) is not supported; send one request per prompt",
                "prompt",
            )
        prompt = prompt[0]
    try:
        ids = engine.encode_prompt(prompt)
    except RequestError as e:
        raise invalid(str(e), "prompt") from None
    return ids, prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)


def _chat_prompt(
    engine: LLMEngine, body: ChatCompletionRequest, tools: ToolRequest | None = None
) -> list[int]:
    """Render the messages (and tools) with the model's chat template and tokenize them."""
    text = chat_text(engine, body, tools)
    return engine.tokenizer.encode(text, add_special_tokens=False)  # the template wrote BOS


def chat_text(engine: LLMEngine, body: ChatCompletionRequest, tools: ToolRequest | None) -> str:
    """The prompt text of a chat request: its messages (and tools) through the template."""
    messages = [message.as_template_input() for message in body.messages]
    try:
        return render_chat(engine.tokenizer, messages, tools)
    except ValueError as e:  # ChatTemplateError, or a message validate_messages refused
        raise invalid(str(e), "messages") from None


async def _run(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    fmt: CompletionFormat | ChatFormat,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
) -> Response:
    """Hand the request to the engine; answer with a stream or a whole response."""
    log.info(
        "%s: %d prompt tokens, n=%d, max_tokens=%d, stream=%s, user=%r",
        fmt.id,
        len(prompt_ids),
        params.n,
        params.max_tokens,
        body.stream,
        body.user,
    )
    try:
        # compiled before anything is queued: a schema the engine refuses is a 400
        grammar = await _engine(request).compile_grammar(params)
    except GrammarError as e:
        raise invalid(str(e), body.constraint_param) from None
    try:
        stream = await _engine(request).generate(request_id, prompt_ids, params, grammar=grammar)
    except QueueFull as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
    except RequestError as e:  # e.g. a logit_bias id beyond the vocabulary
        param = str(e).split(" ", 1)[0]
        raise invalid(str(e), param if param in type(body).model_fields else None) from None
    if body.stream:
        events = _events(request, fmt, stream, len(prompt_ids), body.include_usage)
        return _EventStream(events, stream, fmt.id)
    generations = await _unless_disconnected(request, stream.collect())
    if generations is None:
        log.info("%s: client disconnected; aborted", fmt.id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(fmt.response(generations, len(prompt_ids)))


def _sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def _events(
    request: Request,
    fmt: CompletionFormat | ChatFormat,
    stream: RequestStream,
    num_prompt: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    """The SSE body: opening chunks, one chunk per engine output, usage, [DONE]."""
    for chunk in fmt.opening_chunks(len(stream.request_ids)):
        yield _sse(chunk)
    num_completion = 0
    try:
        async for index, out in stream:
            num_completion += len(out.token_ids)
            chunk = fmt.chunk(index, out)
            if chunk is not None:
                yield _sse(chunk)
            if await request.is_disconnected():
                return  # _EventStream aborts the rest
    except EngineFailure as e:
        yield _sse(_server_error(e).body())
        yield _sse("[DONE]")
        return
    if include_usage:
        yield _sse(fmt.usage_chunk(num_prompt, num_completion))
    yield _sse("[DONE]")


class _EventStream(StreamingResponse):
    """An SSE response that aborts its request however the response ends: finished,
    client gone (Starlette cancels the body iterator), or never started."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream, request_id: str):
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._stream, self._request_id = stream, request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._stream.abort():
                log.info("%s: client disconnected mid-stream; aborted", self._request_id)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`; if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else None


async def _disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
