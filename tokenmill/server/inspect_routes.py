"""POST /v1/inspect: run one traced request and stream what the engine did, step by step.

The web inspector (static/app.js) posts a prompt or chat messages with sampling
parameters and the layer/head whose attention it wants drawn. The request runs
through the server's shared engine loop like any other (`AsyncEngine.run_traced`),
with a `tokenmill.inspect.trace.Trace` attached. With "stream": true (the default) the
answer is Server-Sent Events, one JSON object per `data:` line:

    {"type": "start", "model": {...}, "prompt": {...}, "trace": {...}}  with the first step
    {"type": "step", "step": {...}, "summary": {...}}                   after every engine step
    {"type": "done", "text": ..., "finish_reason": ..., "summary": {...}}
    {"type": "error", "error": {message, type, param, code}}            instead of "done"

A step event's summary holds the summary's scalars (Trace.live_summary), so every event
stays the size of its step; "done" carries the whole summary. With "stream": false the
whole trace (Trace.to_dict's layout, plus "text") comes back as one JSON body.

A trace's cost is bounded:
- attention maps only for the layers and heads asked for (`layers`/`heads`, or `layer`/
  `head`; default the middle layer, every head; `layers: []` for none), of the prompt only
  its last rows (trace.prompt_map_rows);
- at most MAX_TRACE_BYTES of JSON: a request whose trace could be bigger
  (trace.size_bound) is refused with a 400 before it runs, naming what to lower; the bytes
  actually made are counted too, and a trace that still outgrows the cap ends with a
  `trace_too_large` error (its request aborted);
- each step is serialized once, on the engine thread as it ends (a bounded piece: one
  step's records), so the event loop never encodes a whole trace: /health and every other
  request keep being answered while a big trace is made or sent. Steps are posted as
  they finish, so the page lights its pipeline diagram while the tokens are still being
  generated; the non-streamed body is those same pieces, joined as they are written;
- a traced prompt is prefilled in chunks like any other, so other requests decode between
  its chunks.

Privacy: a traced request gets a private prefix-cache root (a random cache salt), so it
never reuses another request's cached blocks: `steps[0].kv.written` and `start` cannot
tell a client which prompts others sent.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from tokenmill.engine.block_manager import salt_root
from tokenmill.engine.llm_engine import LLMEngine, RequestError
from tokenmill.inspect.trace import Trace, dumps, size_bound
from tokenmill.sampling import SamplingParams
from tokenmill.sampling.grammar import CompiledGrammar, GrammarError
from tokenmill.server.async_engine import AsyncEngine, Generation
from tokenmill.server.errors import APIError, invalid, to_api_error
from tokenmill.server.json_body import json_body
from tokenmill.server.protocol import ChatMessage, Text, check_fits, make_sampling_params
from tokenmill.server.running import check_model, engine_of, off_loop
from tokenmill.server.sse import sse
from tokenmill.units import format_bytes

router = APIRouter()
log = logging.getLogger("tokenmill.server")

MAX_INSPECT_TOKENS = 512  # a trace keeps data per step; keep inspected answers short
MAX_TRACE_BYTES = 32 * 2**20  # the most JSON one trace may make (a 512-step trace with every
# head of one layer's maps over a 1,000-token prompt would be ~40 MB)


class InspectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = None  # a served model's name (None: the default one)
    prompt: Text | None = None  # raw text, continued as is
    messages: list[ChatMessage] | None = None  # rendered with the model's chat template
    max_tokens: int = 64
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # Whose attention maps to keep: `layers` (a list; [] for none) or `layer` (one), and
    # `heads` (a list) or `head` (one); default the middle layer, every head.
    layers: list[int] | None = None
    layer: int | None = None
    heads: list[int] | None = None
    head: int | None = None
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


class TraceTooLarge(Exception):
    """The bytes a running trace made passed MAX_TRACE_BYTES."""


@router.post("/v1/inspect")
async def inspect(
    body: Annotated[InspectRequest, Depends(json_body(InspectRequest))], request: Request
) -> Response:
    server: AsyncEngine = engine_of(request)
    check_model(request, body.model)
    engine = server.engine
    params = body.sampling_params()
    trace_args = _trace_args(engine, body)
    prompt_ids = await off_loop(request, _prompt_ids, engine, body)
    check_fits(
        len(prompt_ids),
        params.max_tokens,
        engine.max_model_len,
        prompt_param="messages" if body.messages is not None else "prompt",
        max_param="max_tokens",
    )
    _check_size(engine, body, len(prompt_ids), params.max_tokens, trace_args)
    try:
        grammar = await off_loop(request, engine.compile_grammar, params)  # 400 if bad
    except GrammarError as e:  # the request names constraints as SamplingParams does
        raise to_api_error(e) from None
    traced = TracedRun(server, prompt_ids, params, trace_args, grammar, events=body.stream)
    if body.stream:
        return StreamingResponse(
            _events(traced),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    pieces: list[bytes] = []  # the header's JSON, then each step's: at most MAX_TRACE_BYTES
    try:
        async for piece in traced.pieces():
            pieces.append(piece)
    except TraceTooLarge as e:
        raise _too_large(str(e)) from None
    except Exception as e:
        raise to_api_error(e, fields=InspectRequest.model_fields) from None
    parts = _whole_body(pieces, traced)
    return StreamingResponse(
        _write(parts),
        media_type="application/json",
        headers={"Content-Length": str(sum(len(part) for part in parts))},
    )


def _prompt_ids(engine: LLMEngine, body: InspectRequest) -> list[int]:
    """The prompt's token ids (raw text, or a chat rendered by the template). Runs on a
    worker thread: see app.off_loop."""
    if (body.prompt is None) == (body.messages is None):
        raise invalid("send exactly one of 'prompt' (raw text) or 'messages' (a chat)", "messages")
    if body.prompt is not None:
        try:
            return engine.encode_prompt(body.prompt)
        except RequestError as e:  # about "prompt"
            raise to_api_error(e) from None
    messages = [m.as_template_input() for m in body.messages]
    try:  # tokenizer/chat.py's preparation, as the chat route's (history calls, results)
        ids = engine.encode_chat(messages)
    except ValueError as e:  # ChatTemplateError, RequestError (too long)
        raise to_api_error(e, param="messages") from None
    if not ids:
        raise invalid("the chat renders to no tokens", "messages")
    return ids


def _indices(values: list[int], count: int, name: str, what: str) -> list[int]:
    """A list of distinct layer or head indices, each in [0, count)."""
    if len(set(values)) != len(values):
        raise invalid(f"{name} must not repeat an index, got {values}", name)
    for i in values:
        if not 0 <= i < count:
            raise invalid(f"{name} must hold {what} in [0, {count - 1}], got {i}", name)
    return sorted(values)


def _trace_args(engine: LLMEngine, body: InspectRequest) -> dict[str, Any]:
    """Trace(...)'s arguments from the request: which attention maps, how many candidates."""
    cfg = engine.config
    if body.layers is not None and body.layer is not None:
        raise invalid("send 'layers' (a list) or 'layer' (one), not both", "layers")
    if body.heads is not None and body.head is not None:
        raise invalid("send 'heads' (a list) or 'head' (one), not both", "heads")
    if body.layers is not None:
        layers = _indices(body.layers, cfg.num_layers, "layers", "layers")
    else:
        layer = cfg.num_layers // 2 if body.layer is None else body.layer
        if not 0 <= layer < cfg.num_layers:
            raise invalid(f"layer must be in [0, {cfg.num_layers - 1}], got {layer}", "layer")
        layers = [layer]
    heads = None  # every head
    if body.heads is not None:
        if not body.heads:
            raise invalid(
                "heads must name at least one head (null: every head; 'layers': [] for no "
                "attention maps)",
                "heads",
            )
        heads = _indices(body.heads, cfg.num_heads, "heads", "heads")
    elif body.head is not None:
        if not 0 <= body.head < cfg.num_heads:
            raise invalid(
                f"head must be in [0, {cfg.num_heads - 1}] or null (all), got {body.head}",
                "head",
            )
        heads = [body.head]
    if not 1 <= body.top_n <= 50:
        raise invalid(f"top_n must be in [1, 50], got {body.top_n}", "top_n")
    return {"layers": layers, "heads": heads, "top_n": body.top_n}


def _check_size(
    engine: LLMEngine,
    body: InspectRequest,
    prompt_len: int,
    max_tokens: int,
    trace_args: dict[str, Any],
) -> None:
    """Refuse, before it runs, a trace that could make more than MAX_TRACE_BYTES: one line
    saying how big it could get and what to lower."""
    heads = trace_args["heads"]
    common = {
        "map_heads": engine.config.num_heads if heads is None else len(heads),
        "top_n": trace_args["top_n"],
        "chunk_tokens": engine.scheduler.max_num_batched_tokens,
        # a traced request speculates like any other: 1 + k rows per verification
        "speculative_k": engine.speculator.config.k if engine.speculator is not None else 0,
    }
    maps = len(trace_args["layers"])
    bound = size_bound(engine.config, prompt_len, max_tokens, map_layers=maps, **common)
    if bound <= MAX_TRACE_BYTES:
        return
    plain = size_bound(engine.config, prompt_len, max_tokens, map_layers=0, **common)
    if plain > MAX_TRACE_BYTES:  # too long even without attention maps
        param, advice = "max_tokens", "ask for fewer tokens (max_tokens) or send a shorter prompt"
    else:
        # the field the client set (or `layers`, the one that turns the maps off)
        named = [f for f in ("layers", "layer", "heads", "head") if getattr(body, f) is not None]
        param = named[0] if named else "layers"
        advice = (
            f"ask for fewer attention maps ({maps} layer(s) x {common['map_heads']} head(s) "
            "now; 'layers': [] for none, 'heads': [h] for one head) or fewer tokens (max_tokens)"
        )
    raise _too_large(
        f"this trace could make {format_bytes(bound)} of JSON, more than the "
        f"{format_bytes(MAX_TRACE_BYTES)} a trace may: {advice}",
        param,
    )


def _too_large(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="trace_too_large")


class TracedRun:
    """One traced request on the shared engine, as pieces of JSON.

    The Trace's step listener runs on the engine thread: it serializes each finished
    step (and, with the first, the header) once, counts the bytes against MAX_TRACE_BYTES,
    and posts the bytes to the event loop; `pieces()` yields them in order. events=True
    makes each piece a whole event object ({"type": "start" | "step", ...}); False makes
    the header (model, prompt, trace) and then each bare step record. The Trace keeps no
    steps of its own (keep_steps=False): what is in flight is bytes, at most the cap.
    """

    def __init__(
        self,
        server: AsyncEngine,
        prompt_ids: list[int],
        params: SamplingParams,
        trace_args: dict[str, Any],
        grammar: CompiledGrammar | None,
        *,
        events: bool,
    ):
        self.server, self.prompt_ids, self.params = server, prompt_ids, params
        self.grammar, self.events = grammar, events
        self.trace = Trace(**trace_args, on_step=self._on_step, keep_steps=False)
        self.bytes = 0  # made so far (engine thread)
        self.generation: Generation | None = None  # once pieces() has ended
        self._post: Callable[[bytes | Exception], None] | None = None  # set by pieces()
        self._over = False  # past the cap or failed: later steps are dropped

    def _on_step(self, trace: Trace, step: dict[str, Any]) -> None:  # engine thread
        if self._over:
            return
        try:
            pieces = []
            if step["index"] == 0:
                header = trace.header()
                pieces.append(dumps({"type": "start", **header} if self.events else header))
            if self.events:
                event = {"type": "step", "step": step, "summary": trace.live_summary()}
                pieces.append(dumps(event))
            else:
                pieces.append(dumps(step))
            encoded = [piece.encode() for piece in pieces]
        except Exception as e:  # never fail the engine's step (everyone's) for a trace
            log.exception("serializing trace step %s failed", step.get("index"))
            self._over = True
            self._post(e)
            return
        self.bytes += sum(len(piece) for piece in encoded)
        if self.bytes > MAX_TRACE_BYTES:
            self._over = True
            self._post(
                TraceTooLarge(
                    f"the trace passed the {format_bytes(MAX_TRACE_BYTES)} a trace may make "
                    f"at step {step['index']}; its request was stopped: ask for fewer "
                    "attention maps (layers, heads) or fewer tokens (max_tokens)"
                )
            )
            return
        for piece in encoded:
            self._post(piece)

    async def pieces(self) -> AsyncIterator[bytes]:
        """Run the request; yield each piece as its step ends. Raises TraceTooLarge or
        what running the request raised; aborts the request if the caller stops early."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()

        def post(item: bytes | Exception) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (server shutting down)
                pass

        self._post = post
        run = asyncio.ensure_future(
            self.server.run_traced(
                self.prompt_ids,
                self.params,
                self.trace,
                self.grammar,
                # a private cache scope: never another request's blocks (see the module doc)
                cache_salt=salt_root("inspect", secrets.token_hex(16)),
            )
        )
        # Steps are posted before the engine's output for the same step, so None comes last.
        run.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
            self.generation = run.result()
        finally:
            run.cancel()  # the client left early, or the trace grew too big: abort, free blocks


def _whole_body(pieces: list[bytes], traced: TracedRun) -> list[bytes]:
    """The non-streamed body, {model, prompt, trace, steps, summary, text}, as the pieces
    already made plus a little glue: nothing is encoded twice, and nothing big on the loop."""
    tail = dumps({"summary": traced.trace.summary, "text": traced.generation.text}).encode()
    if not pieces:  # no step ran (cannot happen for a request that finished)
        return [dumps(traced.trace.header()).encode()[:-1] + b',"steps":[],' + tail[1:]]
    header, steps = pieces[0], pieces[1:]
    parts = [header[:-1] + b',"steps":[']  # the header object, left open
    for i, step in enumerate(steps):
        parts.append(step if i == 0 else b"," + step)
    parts.append(b"]," + tail[1:])  # the tail object's members close the body
    return parts


async def _write(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
        await asyncio.sleep(0)  # let other requests in between the pieces


async def _events(traced: TracedRun) -> AsyncIterator[bytes | str]:
    """The streamed answer: each piece as an SSE event, then "done" (or "error")."""
    try:
        async for piece in traced.pieces():
            yield b"data: " + piece + b"\n\n"
    except TraceTooLarge as e:
        yield sse({"type": "error", **_too_large(str(e)).body()})
        return
    except Exception as e:
        yield sse({"type": "error", **to_api_error(e, fields=InspectRequest.model_fields).body()})
        return
    generation = traced.generation
    yield sse(
        {
            "type": "done",
            "text": generation.text,
            "finish_reason": generation.finish_reason,
            "summary": traced.trace.summary,
        }
    )
