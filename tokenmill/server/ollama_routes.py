"""Ollama's API over the shared engine, for the clients that speak only it (the `ollama`
Python and JS libraries, Open WebUI's Ollama mode, editor plugins).

    POST /api/chat        messages -> {"message": {role, content, thinking, tool_calls}}
    POST /api/generate    a prompt (templated as one user turn, or `raw`) -> {"response"}
    POST /api/embed       input (a string or several) -> {"embeddings"}, L2-normalised
    POST /api/embeddings  the older form: one prompt -> {"embedding"}
    POST /api/show        a model's details, template, model_info and capabilities
    GET  /api/tags        the served models;  GET /api/ps  the loaded ones
    GET  /api/version     the Ollama API version this follows

Answers stream by default, as Ollama's do: one JSON object per line (NDJSON), the last
with "done": true, done_reason ("stop" or "length"), and the counts and durations
(nanoseconds) Ollama reports. `stream: false` gives that last object whole.

The request maps onto what the other APIs prepare:
- `options`: num_predict -> max_tokens (-1, the default: until the context is full),
  temperature, top_k, top_p, min_p, typical_p, repeat_penalty (over the whole context:
  repeat_last_n may only be -1), presence/frequency_penalty, mirostat (2) with its tau and
  eta, seed, stop; and llama.cpp's samplers by their names (top_n_sigma, xtc_*, dry_*).
  What Ollama uses to load a model (num_ctx, num_gpu, num_thread ...) changes nothing
  here: the served model is loaded once, at its own context. An unknown option is a 400.
  Unset, temperature, top_k and top_p take Ollama's defaults (0.8, 40, 0.9).
- `format`: "json" (a JSON object) or a JSON Schema -> structured output.
- `tools` -> the chat template's tools, the model's calls read back into tool_calls with
  their arguments as objects; `tool` messages (with tool_name) are the results.
- `think` -> the template's enable_thinking; a reasoning model's thinking is split off
  into `thinking`.
- `context` (generate): the token ids of an earlier answer's context, prepended; the
  last object returns the new one.
- `keep_alive` is accepted: the served models stay loaded. `images`, `suffix` and
  `template` are refused (a 400 naming them).

Errors are Ollama's shape, {"error": "message"} (errors.py's format_ollama, for every path
under /api), mid-stream as a line of their own.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tokenmill.engine import report
from tokenmill.engine.llm_engine import LLMEngine, RequestOutput
from tokenmill.sampling import FinishReason, SamplingParams
from tokenmill.server.async_engine import EngineFailure, RequestStream
from tokenmill.server.embeddings_routes import embed_prompts, encode_inputs
from tokenmill.server.errors import InternalError, format_ollama, invalid, to_api_error
from tokenmill.server.json_body import json_body
from tokenmill.server.metrics import CLIENT_CLOSED_REQUEST
from tokenmill.server.model_pool import ModelPool, engine_bytes
from tokenmill.server.protocol import check_fits, function_tool, make_sampling_params, resolve_tools
from tokenmill.server.running import (
    EventStream,
    chat_prompt,
    check_model,
    engine_of,
    off_loop,
    reasoning_of,
    start_request,
    unless_disconnected,
)
from tokenmill.server.text import StrictModel, Text
from tokenmill.server.tool_parser import ToolCallParser, arguments_object
from tokenmill.server.tools import MAX_TOOLS, ToolRequest

log = logging.getLogger("tokenmill.server")

router = APIRouter()

OLLAMA_VERSION = "0.12.0"  # the Ollama API release whose routes and fields this follows
# Ollama's sampling defaults where a request sets none (its runner's, not the model's)
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# option name -> SamplingParams' name, for the options that sample
_SAMPLING_OPTIONS = {
    "num_predict": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
    "seed": "seed",
    "stop": "stop",
    "top_n_sigma": "top_n_sigma",
    "xtc_probability": "xtc_probability",
    "xtc_threshold": "xtc_threshold",
    "dry_multiplier": "dry_multiplier",
    "dry_base": "dry_base",
    "dry_allowed_length": "dry_allowed_length",
    "dry_penalty_last_n": "dry_penalty_last_n",
    "dry_sequence_breakers": "dry_sequence_breakers",
}
# Options that choose how Ollama loads a model: the served model is loaded already
_LOAD_OPTIONS = {
    "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv",
    "logits_all", "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread",
    "num_keep", "penalize_newline",
}  # fmt: skip
# Options with one value this server can honour, which a request may send
_FIXED_OPTIONS = {"repeat_last_n": (-1,), "tfs_z": (1.0,)}
_FAR_FUTURE = "2318-01-01T00:00:00Z"  # expires_at of a model that stays loaded


# --------------------------------------------------------------------------- requests


class ToolFunction(StrictModel):
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"] = "function"
    function: ToolFunction


class CalledFunction(StrictModel):
    name: Text
    arguments: dict[str, Any]
    index: int | None = None  # newer Ollama numbers the calls of one answer


class ToolCall(StrictModel):
    function: CalledFunction
    id: Text | None = None


class Message(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = None
    thinking: Text | None = None  # an earlier answer's: left out of the prompt
    images: list[Text] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: Text | None = None  # a tool message: which tool answered
    tool_call_id: Text | None = None

    def as_template_input(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id or f"call_{i}",
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for i, call in enumerate(self.tool_calls)
            ]
        if self.tool_name is not None:
            message["name"] = self.tool_name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class _Request(StrictModel):
    """What /api/chat and /api/generate share."""

    model: Text
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: float | int | Text | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    images: list[Text] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @property
    def template_vars(self) -> dict[str, Any] | None:
        return None if self.think is None else {"enable_thinking": self.think is not False}

    def check(self) -> None:
        if self.images:
            raise invalid("images are not supported: this server runs text models", "images")
        if self.logprobs or self.top_logprobs:
            raise invalid("logprobs are not supported on the Ollama API", "logprobs")

    def sampling_params(
        self, max_tokens: int, tools: ToolRequest | None, reasoning: str | None
    ) -> SamplingParams:
        """SamplingParams of the options, format and tools; max_tokens: what is left of
        the context after the prompt, num_predict's -1."""
        options = dict(self.options or {})
        kwargs: dict[str, Any] = dict(OLLAMA_DEFAULTS)
        for name, value in options.items():
            if name in _SAMPLING_OPTIONS:
                kwargs[_SAMPLING_OPTIONS[name]] = value
            elif name in _FIXED_OPTIONS:
                if value not in _FIXED_OPTIONS[name]:
                    allowed = " or ".join(map(str, _FIXED_OPTIONS[name]))
                    raise invalid(f"options.{name} may only be {allowed} here", "options")
            elif name not in _LOAD_OPTIONS:
                raise invalid(f"options: unknown option {name!r}", "options")
        if kwargs.get("max_tokens") in (-1, -2, None):  # Ollama's "until the context is full"
            kwargs["max_tokens"] = max_tokens
        if kwargs.get("stop") is None:
            kwargs.pop("stop", None)
        if self.format == "json":
            kwargs["json_schema"] = {"type": "object"}
        elif isinstance(self.format, dict):
            kwargs["json_schema"] = self.format
        if tools is not None and tools.grammar() is not None:
            kwargs["grammar"] = tools.grammar()
        kwargs["reasoning"] = reasoning
        renames = {v: f"options.{k}" for k, v in _SAMPLING_OPTIONS.items()}
        renames.update(json_schema="format", grammar="tools")
        return make_sampling_params(renames=renames, **kwargs)


class ChatRequest(_Request):
    messages: list[Message] = Field(default_factory=list)
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise invalid("messages: at least one message is required", "messages")
        if any(m.images for m in self.messages):
            raise invalid("images are not supported: this server runs text models", "messages")

    def tool_request(self, tokenizer: Any) -> ToolRequest | None:
        if not self.tools:
            return None
        tools = [
            function_tool(t.function.name, t.function.description, t.function.parameters)
            for t in self.tools
        ]
        return resolve_tools(tokenizer, tools, "auto", None)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]


class GenerateRequest(_Request):
    prompt: Text | None = None
    system: Text | None = None
    raw: bool | None = None
    context: list[int] | None = None  # an earlier answer's context: its token ids
    suffix: Text | None = None
    template: Text | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise invalid("suffix (fill-in-the-middle) is not supported", "suffix")
        if self.template:
            raise invalid("template is not supported: the model's own chat template is", "template")

    def tool_request(self, tokenizer: Any) -> None:
        return None

    def template_messages(self) -> list[dict[str, Any]]:
        messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*messages, {"role": "user", "content": self.prompt or ""}]


class EmbedRequest(StrictModel):
    model: Text
    input: Text | list[Text]
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | int | Text | None = None
    dimensions: int | None = Field(default=None, ge=1)


class LegacyEmbeddingsRequest(StrictModel):
    model: Text
    prompt: Text
    options: dict[str, Any] | None = None
    keep_alive: float | int | Text | None = None


class ModelRequest(StrictModel):
    model: Text | None = None
    name: Text | None = None  # the older spelling of model
    verbose: bool | None = None


# --------------------------------------------------------------------------- generation


@router.post("/api/chat")
async def chat(
    body: Annotated[ChatRequest, Depends(json_body(ChatRequest))], request: Request
) -> Response:
    body.check()
    model = check_model(request, body.model)
    tools, prompt_ids = await chat_prompt(request, body)
    return await _answer(request, body, model, prompt_ids, tools, chat=True)


@router.post("/api/generate")
async def generate(
    body: Annotated[GenerateRequest, Depends(json_body(GenerateRequest))], request: Request
) -> Response:
    body.check()
    model = check_model(request, body.model)
    if not body.prompt:  # Ollama's way to load a model: an empty prompt answers at once
        return JSONResponse(
            {"model": model, "created_at": _now(), "response": "", "done": True,
             "done_reason": "load"}
        )  # fmt: skip
    engine = engine_of(request).engine
    if body.raw:
        prompt_ids = await off_loop(request, _encode_raw, engine, body.prompt)
    else:
        _, prompt_ids = await chat_prompt(request, body, param="prompt")
    if body.context:
        vocab = engine.config.vocab_size
        if not all(0 <= t < vocab for t in body.context):
            raise invalid(f"context holds a token id outside [0, {vocab})", "context")
        prompt_ids = list(body.context) + prompt_ids
    return await _answer(request, body, model, prompt_ids, None, chat=False)


def _encode_raw(engine: LLMEngine, prompt: str) -> list[int]:
    try:
        return engine.encode_prompt(prompt)
    except ValueError as e:
        raise to_api_error(e, param="prompt") from None


async def _answer(
    request: Request,
    body: _Request,
    model: str,
    prompt_ids: list[int],
    tools: ToolRequest | None,
    chat: bool,
) -> Response:
    """Queue the request and answer it, streamed or whole."""
    engine = engine_of(request).engine
    limit = engine.max_model_len
    left = max(1, limit - len(prompt_ids))
    params = body.sampling_params(left, tools, reasoning_of(request))
    check_fits(
        len(prompt_ids), params.max_tokens, limit, prompt_param="messages" if chat else "prompt",
        max_param="options.num_predict",
    )  # fmt: skip
    request_id = f"ollama-{uuid.uuid4().hex}"
    fmt = OllamaFormat(model, prompt_ids, tools, chat)
    log.info(
        "%s: %d prompt tokens, max_tokens=%d, stream=%s",
        request_id, len(prompt_ids), params.max_tokens, body.stream,
    )  # fmt: skip
    constrained = "format" if params.json_schema is not None else "tools"
    stream = await start_request(
        request,
        request_id,
        [prompt_ids],
        params,
        constraint_param=constrained if params.constraint is not None else None,
        fields=type(body).model_fields,
    )
    if body.stream:
        return EventStream(
            _lines(request, fmt, stream), stream, request_id, media_type="application/x-ndjson"
        )
    parts = await unless_disconnected(request, _whole(fmt, stream))
    if parts is None:
        log.info("%s: client disconnected; aborted", request_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(parts)


class OllamaFormat:
    """The answer to one /api/chat or /api/generate request: objects per engine output
    (`feed`), the last one with the counts and durations."""

    def __init__(
        self, model: str, prompt_ids: list[int], tools: ToolRequest | None, chat: bool
    ) -> None:
        self.model, self.prompt_ids, self.chat = model, prompt_ids, chat
        self.tools = tools if tools is not None and tools.parses_calls else None
        self._parser: ToolCallParser | None = self.tools.parser() if self.tools else None
        self._start = time.monotonic_ns()
        self._first: int | None = None  # when the first token came
        self._output_ids: list[int] = []

    def feed(self, out: RequestOutput) -> list[dict[str, Any]]:
        if self._first is None:
            self._first = time.monotonic_ns()
        self._output_ids += out.token_ids
        text, calls = out.text, []
        if self._parser is not None:
            text = self._parser.feed(out.text).content
            if out.finished:
                text += self._parser.finish().content
                calls = self._parser.calls
        parts = []
        if text or out.reasoning:
            parts.append(self._part(text, out.reasoning))
        if calls:
            message = self._part("", "")
            message["message"]["tool_calls"] = [
                {"function": {"index": i, "name": c.name,
                              "arguments": arguments_object(c.arguments)}}
                for i, c in enumerate(calls)
            ]  # fmt: skip
            parts.append(message)
        if out.finished:
            parts.append(self._last(out.finish_reason))
        return parts

    def _part(self, text: str, thinking: str) -> dict[str, Any]:
        part: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.chat:
            part["message"] = {"role": "assistant", "content": text}
            if thinking:
                part["message"]["thinking"] = thinking
        else:
            part["response"] = text
            if thinking:
                part["thinking"] = thinking
        part["done"] = False
        return part

    def _last(self, reason: FinishReason | None) -> dict[str, Any]:
        now = time.monotonic_ns()
        first = self._first or now
        last = self._part("", "")
        last.update(
            done=True,
            done_reason="length" if reason is FinishReason.LENGTH else "stop",
            total_duration=now - self._start,
            load_duration=0,
            prompt_eval_count=len(self.prompt_ids),
            prompt_eval_duration=first - self._start,
            eval_count=len(self._output_ids),
            eval_duration=now - first,
        )
        if not self.chat:
            last["context"] = self.prompt_ids + self._output_ids
        return last


def _merge(parts: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """A whole answer: the last object with every earlier one's text, thinking and calls."""
    whole = dict(parts[-1])
    key = "message" if chat else None
    text = "".join((p["message"]["content"] if key else p["response"]) for p in parts)
    thinking = "".join(
        (p["message"].get("thinking", "") if key else p.get("thinking", "")) for p in parts
    )
    calls = [c for p in parts if key for c in p["message"].get("tool_calls", [])]
    if chat:
        whole["message"] = {"role": "assistant", "content": text}
        if thinking:
            whole["message"]["thinking"] = thinking
        if calls:
            whole["message"]["tool_calls"] = calls
    else:
        whole["response"] = text
        if thinking:
            whole["thinking"] = thinking
    return whole


async def _whole(fmt: OllamaFormat, stream: RequestStream) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    try:
        async for _, out in stream:
            parts += fmt.feed(out)
    finally:
        stream.abort()
    return _merge(parts, fmt.chat)


async def _lines(request: Request, fmt: OllamaFormat, stream: RequestStream) -> AsyncIterator[str]:
    try:
        async for _, out in stream:
            for part in fmt.feed(out):
                yield json.dumps(part, ensure_ascii=False) + "\n"
            if await request.is_disconnected():
                return
    except EngineFailure as e:
        yield json.dumps(format_ollama(to_api_error(e))) + "\n"
    except Exception:  # a line that could not be made: the stream still ends cleanly
        log.exception("the Ollama stream failed")
        yield json.dumps(format_ollama(to_api_error(InternalError()))) + "\n"


# --------------------------------------------------------------------------- embeddings


@router.post("/api/embed")
async def embed(
    body: Annotated[EmbedRequest, Depends(json_body(EmbedRequest))], request: Request
) -> Response:
    model = check_model(request, body.model)
    start = time.monotonic_ns()
    engine = engine_of(request).engine
    prompts = await off_loop(request, encode_inputs, engine, body.input)
    vectors = await embed_prompts(request, prompts, EmbedRequest.model_fields)
    if vectors is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if body.dimensions is not None:
        vectors = [v[: body.dimensions] for v in vectors]
    return JSONResponse(
        {
            "model": model,
            "embeddings": [_normalized(v) for v in vectors],
            "total_duration": time.monotonic_ns() - start,
            "load_duration": 0,
            "prompt_eval_count": sum(len(p) for p in prompts),
        }
    )


@router.post("/api/embeddings")
async def embeddings(
    body: Annotated[LegacyEmbeddingsRequest, Depends(json_body(LegacyEmbeddingsRequest))],
    request: Request,
) -> Response:
    check_model(request, body.model)
    engine = engine_of(request).engine
    prompts = await off_loop(request, encode_inputs, engine, body.prompt)
    vectors = await embed_prompts(request, prompts, LegacyEmbeddingsRequest.model_fields)
    if vectors is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse({"embedding": vectors[0]})  # not normalised, as Ollama's


def _normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


# --------------------------------------------------------------------------- models


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    pool: ModelPool | None = request.app.state.pool
    if pool is None:
        engine = engine_of(request).engine
        return {"models": [_card(request.app.state.model_name, engine.path, engine)]}
    return {
        "models": [
            _card(s.name, s.model.path, s.engine.engine if s.engine else None)
            for s in pool.slots.values()
        ]
    }


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    pool: ModelPool | None = request.app.state.pool
    if pool is None:
        loaded = [(request.app.state.model_name, engine_of(request).engine)]
    else:
        loaded = [(s.name, s.engine.engine) for s in pool.loaded()]
    models = []
    for name, engine in loaded:
        card = _card(name, engine.path, engine)
        card.pop("modified_at")
        card.update(
            size=engine_bytes(engine),
            size_vram=0,
            expires_at=_FAR_FUTURE,
            context_length=engine.max_model_len,
        )
        models.append(card)
    return {"models": models}


@router.post("/api/show")
async def show(
    body: Annotated[ModelRequest, Depends(json_body(ModelRequest))], request: Request
) -> dict[str, Any]:
    name = body.model or body.name
    if name is None:
        raise invalid("model is required", "model")
    check_model(request, name)
    engine = engine_of(request).engine
    c = engine.config
    capabilities = ["completion"]
    if engine.tokenizer.chat_template and "tools" in engine.tokenizer.chat_template:
        capabilities.append("tools")
    if reasoning_of(request) is not None:
        capabilities.append("thinking")
    return {
        "modelfile": "",
        "parameters": "",
        "template": engine.tokenizer.chat_template or "",
        "details": _details(engine.path, engine),
        "model_info": {
            "general.architecture": c.arch,
            "general.parameter_count": report.num_weights(engine.model),
            f"{c.arch}.context_length": engine.max_model_len,
            f"{c.arch}.embedding_length": c.hidden_size,
            f"{c.arch}.block_count": c.num_layers,
            f"{c.arch}.attention.head_count": c.num_heads,
            f"{c.arch}.attention.head_count_kv": c.num_kv_heads,
            f"{c.arch}.feed_forward_length": c.intermediate_size,
            f"{c.arch}.vocab_size": c.vocab_size,
        },
        "capabilities": capabilities,
        "modified_at": _modified(engine.path),
    }


def _card(name: str, path: Path | None, engine: LLMEngine | None) -> dict[str, Any]:
    """A model as /api/tags lists it: size on disk, a digest of where and what the file
    is (its path, size and time: hashing gigabytes for a listing would take seconds), and
    its details once loaded."""
    size = _disk_size(path)
    stamp = f"{path}:{size}:{_modified(path)}"
    return {
        "name": name,
        "model": name,
        "modified_at": _modified(path),
        "size": size,
        "digest": hashlib.sha256(stamp.encode()).hexdigest(),
        "details": _details(path, engine),
    }


def _details(path: Path | None, engine: LLMEngine | None) -> dict[str, Any]:
    fmt = "gguf" if path is not None and path.suffix == ".gguf" else "safetensors"
    details: dict[str, Any] = {"parent_model": "", "format": fmt}
    if engine is not None:
        n = report.num_weights(engine.model)
        details.update(
            family=engine.config.arch,
            families=[engine.config.arch],
            parameter_size=f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M",
            quantization_level=engine.quantization or str(engine.dtype).removeprefix("torch."),
        )
    return details


def _disk_size(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _modified(path: Path | None) -> str:
    when = path.stat().st_mtime if path is not None and path.exists() else 0.0
    return dt.datetime.fromtimestamp(when, dt.UTC).isoformat().replace("+00:00", "Z")


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")
