"""The HTTP layer: OpenAI-compatible routes over one AsyncEngine, or several models.

    create_app(engine, model_name=..., api_key=...) -> FastAPI
    create_app(pool, api_key=...) -> FastAPI      several models (server/model_pool.py)

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming as
Server-Sent Events when `stream` is true), GET /v1/models[/{model}], GET /health,
GET /metrics; plus POST /v1/inspect from tokenmill.server.inspect_routes when that
module exists, and the web inspector's static files at / when
tokenmill/server/static/index.html exists (mounted last, so API routes win).

`app.state.engine` is the AsyncEngine (tokenmill/server/async_engine.py): routes
submit requests to it (`generate`, `run_traced`) and read its `.engine`, the
synchronous LLMEngine, for the tokenizer, config and max_model_len. The engine
thread starts and stops with the app's lifespan. What every API's routes share (the prep
threads, the model check, the prefix-cache scope, queueing a request, streaming with
abort) is server/running.py; this module holds OpenAI's routes and the app's assembly.

With a ModelPool, `app.state.pool` is it and `app.state.engine` is None: the model_pool
module's ModelSelect middleware picks (and loads) each POST's model from its body, and
running.engine_of hands the routes that model's engine. /v1/models lists every served
model with `loaded`; /health is one answer for the server (every loaded engine healthy);
/metrics labels each engine's series with model="NAME".

Every error is OpenAI's JSON shape, {"error": {message, type, param, code}}:
FastAPI's own 422 validation errors become 400s. With an API key, every /v1 path
needs `Authorization: Bearer <key>` (unknown ones too: a client without the key
learns nothing about which routes exist); /health, /metrics and the web page's
static files stay open. There are no /docs, /redoc or /openapi.json pages.

No one request can stall the others (see limits.py for the HTTP side):
- the head is bounded (431) and must frame its body once (400), and the body is read
  in full by BodyLimit before any route runs, within a size limit (413), a timeout
  between chunks and a deadline for all of it (408);
- tokenizing a prompt and rendering a chat template run on worker threads
  (`off_loop`), never on the event loop, and a text that cannot fit in the context
  is refused before it is tokenized; a chat template renders within a budget;
- a request that could never run (n above 128, or more sequences than the queue
  holds) is a 400, a full queue a 429 with Retry-After, a draining server a 503.

A client that goes away aborts its request at once (its KV blocks are freed at
the engine's next step): a stream notices through cancellation or
`request.is_disconnected()`, a non-streaming request through a watcher on the
connection's receive channel.
"""

from __future__ import annotations

import hmac
import importlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from tokenmill.engine.llm_engine import LLMEngine, RequestError
from tokenmill.sampling import SamplingParams
from tokenmill.server import (
    anthropic_routes,
    embeddings_routes,
    ollama_routes,
    rerank_routes,
    responses_routes,
    tokenize_routes,
)
from tokenmill.server.async_engine import (
    AsyncEngine,
    EngineFailure,
    RequestStream,
)
from tokenmill.server.errors import APIError, InternalError, to_api_error
from tokenmill.server.json_body import json_body
from tokenmill.server.limits import BodyLimit, HostCheck, ServerLimits, default_max_body_bytes
from tokenmill.server.metrics import (
    CLIENT_CLOSED_REQUEST,
    CONTENT_TYPE,
    CountRequests,
    HTTPRequests,
    ModelSeries,
    render_models,
)
from tokenmill.server.model_pool import ModelPool, ModelSelect
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    check_fits,
)
from tokenmill.server.running import (
    BIG_PREP_THREADS,
    PREP_THREADS,
    EventStream,
    chat_prompt,
    check_model,
    decoder,
    engine_of,
    lower_priority,
    off_loop,
    reasoning_of,
    shorter,
    start_request,
    unless_disconnected,
)
from tokenmill.server.sse import sse
from tokenmill.tokenizer.reasoning import resolve as resolve_reasoning

log = logging.getLogger("tokenmill.server")

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
PREFIX_CACHE_SCOPES = ("global", "per-key")
# Methods the fallback routes answer (with 405, or 204 for OPTIONS) so that no API path
# falls through to the static files' "405, Allow: GET, HEAD". Not CONNECT: h11 treats it
# as a tunnel.
OTHER_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"]

T = TypeVar("T")

router = APIRouter()  # /v1: behind the API key when one is set
ops_router = APIRouter()  # /health, /metrics: always open
# Unknown /v1 paths get a JSON 404 rather than the static files' answer. A known path
# with the wrong method lands here too (a full match beats a method mismatch).
fallback_router = APIRouter()


def create_app(
    engine: AsyncEngine | ModelPool,
    *,
    model_name: str | None = None,
    api_key: str | Sequence[str] | None = None,
    aliases: Sequence[str] = (),
    limits: ServerLimits | None = None,
    prefix_cache_scope: str | None = None,
    reasoning_parser: str = "auto",
) -> FastAPI:
    """An app serving `engine` under the name `model_name`; `api_key` (one key or
    several, one per client) guards /v1 paths; `limits` bounds request bodies (the
    default size follows the context length).

    prefix_cache_scope: "global" (every client shares cached prompt blocks) or
    "per-key" (only requests with the same API key do); default per-key when keys are
    set. A request's `cache_salt` narrows its scope further either way.

    Requests may also name the model by any of `aliases` (e.g. its file name); responses
    and /v1/models always use `model_name`, as vLLM does with several served names.

    reasoning_parser: how chat answers split into reasoning_content and content: "auto"
    (by the chat template: tokenizer/reasoning.py's detect), "none", or a format ("think" or "harmony").

    With a ModelPool instead of an engine, the pool's models are served by their own names
    (model_name, aliases and reasoning_parser are the pool's ServedModels'), the body
    limit follows the longest context among the models loaded now."""
    pool = engine if isinstance(engine, ModelPool) else None
    if pool is None and model_name is None:
        raise ValueError("create_app needs model_name for its engine")
    if pool is not None and (model_name is not None or aliases):
        raise ValueError("a ModelPool names its own models: pass no model_name or aliases")
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if api_key is not None and (not keys or not all(keys)):
        raise ValueError("api_key is empty: pass None to serve without a key")
    if prefix_cache_scope is None:
        prefix_cache_scope = "per-key" if keys else "global"
    if prefix_cache_scope not in PREFIX_CACHE_SCOPES:
        raise ValueError(
            f"prefix_cache_scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}, "
            f"got {prefix_cache_scope!r}"
        )
    limits = limits or ServerLimits()
    if pool is None:
        context = engine.engine.max_model_len
    else:
        context = max((s.max_model_len or 0 for s in pool.loaded()), default=0)
    max_body = limits.max_body_bytes or default_max_body_bytes(context)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.prep = ThreadPoolExecutor(
            PREP_THREADS, thread_name_prefix="tokenmill-prep", initializer=lower_priority
        )
        app.state.prep_big = ThreadPoolExecutor(
            BIG_PREP_THREADS, thread_name_prefix="tokenmill-prep-big", initializer=lower_priority
        )
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            app.state.prep.shutdown(wait=False, cancel_futures=True)
            app.state.prep_big.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="tokenmill",
        summary="OpenAI-compatible LLM server",
        lifespan=lifespan,
        docs_url=None,  # the docs pages load their scripts from a CDN, and are not needed
        redoc_url=None,
        openapi_url=None,
    )
    app.state.pool = pool
    app.state.engine = engine if pool is None else None
    app.state.model_name = model_name if pool is None else pool.default
    app.state.model_names = {model_name, *aliases} if pool is None else set(pool.names)
    app.state.created = int(time.time())
    app.state.max_body_bytes = max_body
    app.state.prefix_cache_scope = prefix_cache_scope
    # the reasoning format chat answers are split by (None: not split)
    app.state.reasoning = (
        resolve_reasoning(reasoning_parser, engine.engine.tokenizer.chat_template)
        if pool is None
        else None  # each model's own: running.reasoning_of
    )
    _add_error_handlers(app)
    # Added last = outermost: the counter sees every answer, the body limit's included.
    if limits.allowed_hosts is not None:  # inside the body limit: a bounded body first
        app.add_middleware(HostCheck, allowed=limits.allowed_hosts)
    app.add_middleware(
        BodyLimit,
        max_bytes=max_body,
        timeout_s=limits.body_timeout_s,
        deadline_s=limits.body_deadline_s,
        max_header_bytes=limits.max_header_bytes,
    )
    app.state.http = engine.metrics.http if pool is None else HTTPRequests()
    if pool is not None:  # innermost: the body is in memory, the Host checked
        app.add_middleware(
            ModelSelect,
            pool=pool,
            paths=lambda: app.state.post_paths,
            authorized=lambda scope: not keys or _key_index(scope, keys) is not None,
        )
    app.add_middleware(CountRequests, requests=app.state.http)
    auth = [Depends(_api_key_check(keys))] if keys else []
    routers = [
        router,
        anthropic_routes.router,
        ollama_routes.router,
        responses_routes.router,
        embeddings_routes.router,
        rerank_routes.router,
        tokenize_routes.router,
        _inspect_router(),
        ops_router,
    ]
    app.state.api_routes = [r for included in filter(None, routers) for r in included.routes]
    # the paths whose POST bodies name a model (all static: none has a path parameter)
    app.state.post_paths = {r.path for r in app.state.api_routes if "POST" in r.methods}
    for route in app.state.api_routes:  # before include_router copies them into the app
        if "GET" in route.methods:
            route.methods.add("HEAD")  # as Starlette's own routes do; uvicorn drops the body
    for included in filter(None, routers):
        app.include_router(included, dependencies=[] if included is ops_router else auth)
    app.include_router(fallback_router, dependencies=auth)
    # Paths outside /v1 (/tokenize, /detokenize, the inspector's, /health, /metrics): the
    # other methods get 405 or 204 here too, rather than falling through to the static
    # files; behind the key like their own routes (ops' are open)
    ops_paths = {route.path for route in ops_router.routes}
    for path in dict.fromkeys(r.path for r in app.state.api_routes):
        if not path.startswith("/v1/"):
            app.add_api_route(
                path,
                other_method,
                methods=OTHER_METHODS,
                include_in_schema=False,
                dependencies=[] if path in ops_paths else auth,
            )
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


class ErrorResponse(JSONResponse):
    """A JSON error body rendered ASCII-escaped: it may quote client text, which must not
    make encoding the answer fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def _error_response(error: APIError, request: Request) -> JSONResponse:
    """The error in the shape of the API the request's path belongs to (errors.py's
    error_body: Anthropic's under /v1/messages, OpenAI's elsewhere)."""
    body = error.body(request.url.path)
    return ErrorResponse(body, status_code=error.status, headers=error.headers)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answer goes through to_api_error (tokenmill/server/errors.py)."""

    async def known(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(to_api_error(exc), request)

    async def too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        # Whatever recursed past Python's stack (JSON nested ~1,000 deep walked somewhere)
        # was the client's structure: a 400, not a 500 with a traceback.
        log.info("%s %s: RecursionError: %s", request.method, request.url.path, exc)
        return _error_response(to_api_error(exc), request)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback and re-raises after sending this.
        return _error_response(to_api_error(InternalError()), request)

    for known_type in (APIError, RequestValidationError, StarletteHTTPException, EngineFailure):
        app.add_exception_handler(known_type, known)
    app.add_exception_handler(RecursionError, too_deep)
    app.add_exception_handler(Exception, unexpected)


def _key_index(scope: Scope, keys: list[str]) -> int | None:
    """Which of `keys` the request's `Authorization: Bearer` (or `x-api-key`) gives, or
    None. Every key compared, in constant time each: which one matched stays hidden."""
    headers = Headers(scope=scope)
    given = headers.get("authorization", "").encode()
    if not given and "x-api-key" in headers:  # Anthropic's clients send this
        given = b"Bearer " + headers["x-api-key"].encode()
    matches = [hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys]
    return matches.index(True) if any(matches) else None


def _api_key_check(keys: list[str]) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        index = _key_index(request.scope, keys)
        if index is None:
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                "or 'x-api-key: <key>'",
                code="invalid_api_key",
            )
        request.state.api_key_index = index

    return check


# --------------------------------------------------------------------------- routes


@router.post("/v1/completions")
async def create_completion(
    body: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))], request: Request
) -> Response:
    engine = engine_of(request)
    model = check_model(request, body.model)
    body.check_extra_fields()
    params = body.sampling_params(DEFAULT_COMPLETION_MAX_TOKENS)
    prompts = await off_loop(request, _completion_prompts, engine.engine, body.prompt, body.echo)
    for ids, _ in prompts:
        check_fits(
            len(ids),
            params.max_tokens,
            engine.engine.max_model_len,
            prompt_param="prompt",
            max_param="max_tokens",
        )
    request_id = uuid.uuid4().hex
    echo = [text for _, text in prompts for _ in range(params.n)] if body.echo else None
    fmt = CompletionFormat(
        request_id,
        model,
        decoder(engine.engine),
        body.logprobs is not None,
        len(prompts) * params.n,
        echo,
    )
    return await _run(request, body, fmt, request_id, [ids for ids, _ in prompts], params)


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))],
    request: Request,
) -> Response:
    engine = engine_of(request)
    model = check_model(request, body.model)
    body.check_extra_fields()
    tools, prompt_ids = await chat_prompt(request, body)
    max_model_len = engine.engine.max_model_len
    reasoning = reasoning_of(request)
    params = body.sampling_params(
        default_max_tokens=max(1, max_model_len - len(prompt_ids)), reasoning=reasoning
    )
    check_fits(
        len(prompt_ids),
        params.max_tokens,
        max_model_len,
        prompt_param="messages",
        max_param=body.max_tokens_param,
    )
    request_id = uuid.uuid4().hex
    fmt = ChatFormat(
        request_id, model, decoder(engine.engine), body.logprobs, tools, reasoning is not None
    )
    return await _run(request, body, fmt, request_id, [prompt_ids], params)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    pool: ModelPool | None = request.app.state.pool
    names = [None] if pool is None else pool.names
    return {"object": "list", "data": [_model_card(request, name) for name in names]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict:
    name = check_model(request, model)
    return _model_card(request, None if request.app.state.pool is None else name)


@ops_router.get("/health")
async def health(request: Request) -> JSONResponse:
    # 503 with one line naming the problem: the loop is down or stalled on pending work,
    # or a parallel rank died or is stuck (AsyncEngine.health reads, never waits); with
    # several models, the first loaded one whose engine is not healthy
    pool: ModelPool | None = request.app.state.pool
    ok, reason = (engine_of(request) if pool is None else pool).health()
    if not ok:
        error = APIError(503, reason, type="server_error", code="unhealthy")
        return JSONResponse(error.body(), status_code=error.status)
    return JSONResponse({"status": "ok"})


@ops_router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    pool: ModelPool | None = request.app.state.pool
    if pool is None:
        engine = engine_of(request)
        return PlainTextResponse(engine.metrics.render(engine.stats()), media_type=CONTENT_TYPE)
    series = []
    for slot in pool.slots.values():
        live = slot.engine
        series.append(
            ModelSeries(
                slot.name,
                live is not None,
                slot.loads,
                slot.evictions,
                None if live is None else live.metrics,
                None if live is None else live.stats(),
            )
        )
    return PlainTextResponse(render_models(request.app.state.http, series), media_type=CONTENT_TYPE)


@fallback_router.api_route("/v1/{path:path}", methods=OTHER_METHODS, include_in_schema=False)
async def unknown_route(path: str, request: Request) -> Response:
    return await other_method(request)


async def other_method(request: Request) -> Response:
    """A known path with a method its routes lack: 405 naming the right ones in `Allow`
    (OPTIONS: 204 with that header); an unknown /v1 path: 404."""
    path = shorter(request.url.path)
    allowed = _allowed_methods(request)
    if not allowed:
        raise APIError(404, f"Unknown API route: {request.method} {path}", code="not_found")
    allow = ", ".join([*allowed, "OPTIONS"])
    if request.method == "OPTIONS":
        return Response(status_code=204, headers={"Allow": allow})
    raise APIError(
        405,
        f"Method {request.method} is not allowed for {path}; use {', '.join(allowed)}",
        code="method_not_allowed",
        headers={"Allow": allow},
    )


def _allowed_methods(request: Request) -> list[str]:
    """The methods of the routes whose path matches the request's (all but its method)."""
    methods: set[str] = set()
    for route in request.app.state.api_routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= route.methods
    return sorted(methods)


# --------------------------------------------------------------------------- helpers


def _model_card(request: Request, name: str | None = None) -> dict:
    """The card of the one model (name None), or of the pool's model `name`: with
    `loaded`, and max_model_len once it has loaded (null before its first load)."""
    if name is None:
        return {
            "id": request.app.state.model_name,
            "object": "model",
            "created": request.app.state.created,
            "owned_by": "tokenmill",
            "max_model_len": engine_of(request).engine.max_model_len,
        }
    slot = request.app.state.pool.slots[name]
    return {
        "id": name,
        "object": "model",
        "created": request.app.state.created,
        "owned_by": "tokenmill",
        "max_model_len": slot.max_model_len,
        "loaded": slot.engine is not None,
    }


def _completion_prompts(
    engine: LLMEngine, prompt: str | list[str] | list[int] | list[list[int]], echo: bool
) -> list[tuple[list[int], str | None]]:
    """(token ids, text when echoed) of each prompt of a completion request: one, or a
    batch (a list of texts or of token-id lists). Runs on a worker thread."""
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = list(prompt) if batch else [prompt]
    out = []
    for i, one in enumerate(prompts):
        try:
            ids = engine.encode_prompt(one)
        except RequestError as e:  # about "prompt"; in a batch, say which one
            raise to_api_error(RequestError(f"prompt[{i}]: {e}", e.param) if batch else e) from None
        text = None
        if echo:
            text = one if isinstance(one, str) else engine.tokenizer.decode(ids)
        out.append((ids, text))
    return out


async def _run(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    fmt: CompletionFormat | ChatFormat,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
) -> Response:
    """Hand the request to the engine; answer with a stream or a whole response."""
    num_prompt = sum(len(ids) for ids in prompts)
    log.info(
        "%s: %d prompt(s), %d prompt tokens, n=%d, max_tokens=%d, stream=%s, user=%r",
        fmt.id,
        len(prompts),
        num_prompt,
        params.n,
        params.max_tokens,
        body.stream,
        shorter(body.user, 64) if body.user else None,
    )
    stream = await start_request(
        request,
        request_id,
        prompts,
        params,
        cache_salt=body.cache_salt,
        constraint_param=body.constraint_param,
        fields=type(body).model_fields,
    )
    if body.stream:
        events = _events(request, fmt, stream, num_prompt, body.include_usage, params.n)
        return EventStream(events, stream, fmt.id)
    generations = await unless_disconnected(request, stream.collect())
    if generations is None:
        log.info("%s: client disconnected; aborted", fmt.id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(fmt.response(generations, num_prompt, params.n))


async def _events(
    request: Request,
    fmt: CompletionFormat | ChatFormat,
    stream: RequestStream,
    num_prompt: int,
    include_usage: bool,
    n: int = 1,
) -> AsyncIterator[str]:
    """The SSE body: opening chunks, one chunk per engine output, usage, [DONE]. n:
    choices per prompt (each prompt's first choice counts the prompt's cached tokens)."""
    for chunk in fmt.opening_chunks(len(stream.request_ids)):
        yield sse(chunk)
    num_completion = 0
    cached: dict[int, int] = {}  # the first choice of each prompt -> its cached tokens
    try:
        async for index, out in stream:
            num_completion += len(out.token_ids)
            if index % n == 0:
                cached[index] = max(cached.get(index, 0), out.num_cached_tokens)
            chunk = fmt.chunk(index, out)
            if chunk is not None:
                yield sse(chunk)
            if await request.is_disconnected():
                return  # EventStream aborts the rest
    except EngineFailure as e:
        yield sse(to_api_error(e).body())
        yield sse("[DONE]")
        return
    except Exception:  # a chunk that could not be made: the stream still ends cleanly
        log.exception("%s: the stream failed", fmt.id)
        yield sse(to_api_error(InternalError()).body())
        yield sse("[DONE]")
        return
    if include_usage:
        yield sse(fmt.usage_chunk(num_prompt, num_completion, sum(cached.values())))
    yield sse("[DONE]")
