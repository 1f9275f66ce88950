"""POST /v1/inspect: run one traced request and stream what the engine did, step by step.

The web inspector (static/app.js) posts a prompt or chat messages with sampling
parameters and the layer/head whose attention it wants drawn. The request runs
through the server's shared engine loop like any other (`AsyncEngine.run_traced`),
with a `tokenmill.trace.Trace` attached. With "stream": true (the default) the
answer is Server-Sent Events, one JSON object per `data:` line:

    {"type": "start", "model": {...}, "prompt": {...}, "trace": {...}}  with the first step
    {"type": "step", "step": {...}, "summary": {...}}                   after every engine step
    {"type": "done", "text": ..., "finish_reason": ..., "summary": {...}}
    {"type": "error", "error": {message, type, param, code}}            instead of "done"

Steps are posted from the engine thread as they finish, so the page lights its
pipeline diagram while the tokens are still being generated. With "stream": false
the whole trace (Trace.to_dict) comes back as one JSON body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from tokenmill.engine.llm_engine import LLMEngine, RequestError
from tokenmill.sampling import SamplingParams
from tokenmill.sampling.grammar import CompiledGrammar, GrammarError
from tokenmill.server.app import off_loop  # app imports this module only in create_app
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.protocol import ChatMessage, Text, check_fits, invalid, make_sampling_params
from tokenmill.server.sse import engine_error, sse
from tokenmill.trace import Trace

router = APIRouter()
log = logging.getLogger("tokenmill.server")

MAX_INSPECT_TOKENS = 512  # a trace keeps data per step; keep inspected answers short


class InspectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Text | None = None  # raw text, continued as is
    messages: list[ChatMessage] | None = None  # rendered with the model's chat template
    max_tokens: int = 64
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    layer: int | None = None  # default: the middle layer
    head: int | None = None  # None: every head of `layer`
    top_n: int = 10
    stream: bool = True
    # Structured output, as SamplingParams names it: the trace shows the mask at work.
    json_schema: dict[str, Any] | bool | Text | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None

    def sampling_params(self) -> SamplingParams:
        if not 1 <= self.max_tokens <= MAX_INSPECT_TOKENS:
            raise invalid(
                f"max_tokens must be in [1, {MAX_INSPECT_TOKENS}] for an inspected run",
                "max_tokens",
            )
        return make_sampling_params(  # the completion and chat routes' adapter too
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            json_schema=self.json_schema,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
        )


@router.post("/v1/inspect")
async def inspect(body: InspectRequest, request: Request) -> Response:
    server: AsyncEngine = request.app.state.engine
    engine = server.engine
    params = body.sampling_params()
    prompt_ids = await off_loop(request, _prompt_ids, engine, body)
    check_fits(
        len(prompt_ids),
        params.max_tokens,
        engine.max_model_len,
        prompt_param="messages" if body.messages is not None else "prompt",
        max_param="max_tokens",
    )
    trace_args = _trace_args(engine, body)
    try:
        grammar = await off_loop(request, engine.compile_grammar, params)  # 400 if bad
    except GrammarError as e:
        raise invalid(str(e), e.kind) from None
    if body.stream:
        return StreamingResponse(
            _events(server, prompt_ids, params, trace_args, grammar),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    trace = Trace(**trace_args)
    try:
        generation = await server.run_traced(prompt_ids, params, trace, grammar)
    except Exception as e:
        raise engine_error(e) from None
    return JSONResponse({**trace.to_dict(), "text": generation.text})


def _prompt_ids(engine: LLMEngine, body: InspectRequest) -> list[int]:
    """The prompt's token ids (raw text, or a chat rendered by the template). Runs on a
    worker thread: see app.off_loop."""
    if (body.prompt is None) == (body.messages is None):
        raise invalid("send exactly one of 'prompt' (raw text) or 'messages' (a chat)", "messages")
    if body.prompt is not None:
        try:
            return engine.encode_prompt(body.prompt)
        except RequestError as e:
            raise invalid(str(e), "prompt") from None
    messages = [m.as_template_input() for m in body.messages]
    try:
        ids = engine.encode_chat(messages)
    except ValueError as e:  # ChatTemplateError, RequestError (too long)
        raise invalid(str(e), "messages") from None
    if not ids:
        raise invalid("the chat renders to no tokens", "messages")
    return ids


def _trace_args(engine: LLMEngine, body: InspectRequest) -> dict[str, Any]:
    cfg = engine.config
    layer = cfg.num_layers // 2 if body.layer is None else body.layer
    if not 0 <= layer < cfg.num_layers:
        raise invalid(f"layer must be in [0, {cfg.num_layers - 1}], got {layer}", "layer")
    if body.head is not None and not 0 <= body.head < cfg.num_heads:
        raise invalid(
            f"head must be in [0, {cfg.num_heads - 1}] or null (all), got {body.head}", "head"
        )
    if not 1 <= body.top_n <= 50:
        raise invalid(f"top_n must be in [1, 50], got {body.top_n}", "top_n")
    return {"layer": layer, "head": body.head, "top_n": body.top_n}


async def _events(
    server: AsyncEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    trace_args: dict[str, Any],
    grammar: CompiledGrammar | None,
) -> AsyncIterator[str]:
    """Run the traced request; yield each step's event as the engine thread posts it."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def post(event: dict[str, Any]) -> None:  # engine thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody listens
            pass

    def on_step(trace: Trace, step: dict[str, Any]) -> None:  # engine thread
        if step["index"] == 0:
            post({"type": "start", **trace.header()})
        post({"type": "step", "step": step, "summary": dict(trace.summary)})

    trace = Trace(**trace_args, on_step=on_step)
    run = asyncio.ensure_future(server.run_traced(prompt_ids, params, trace, grammar))
    # Steps are posted before the engine's output for the same step, so None comes last.
    run.add_done_callback(lambda _: events.put_nowait(None))
    try:
        while (event := await events.get()) is not None:
            yield sse(event)
        try:
            generation = run.result()
        except Exception as e:
            yield sse({"type": "error", **engine_error(e).body()})
            return
        yield sse(
            {
                "type": "done",
                "text": generation.text,
                "finish_reason": generation.finish_reason,
                "summary": trace.summary,
            }
        )
    finally:
        run.cancel()  # the client left early: abort the request and free its blocks
