"""Anthropic's Messages API over the shared engine.

    POST /v1/messages               a conversation -> {"type": "message", "content": [...]},
                                    or with `stream` Anthropic's event stream
    POST /v1/messages/count_tokens  the prompt's size, {"input_tokens": N}

A request is turned into what OpenAI's chat route prepares, so both answer alike: the
`system` text and the messages' content blocks become the OpenAI-style message dicts
that chat preparation (LLMEngine.encode_chat) renders with the model's template, the
tools become server/tools.py's ToolRequest (tool_choice `any` is OpenAI's "required",
`tool` a named function: both force a valid call by grammar), and the model's calls are
read back by server/tool_parser.py:

    text block                      {"role": user|assistant, "content": text}
    tool_use block (assistant)      {"tool_calls": [{id, function: {name, arguments}}]}
    tool_result block (user)        {"role": "tool", "tool_call_id", "content": text}

The answer's content is a thinking block (a reasoning model's thinking, split off by the
engine as for the chat route's reasoning_content), a text block (the model's text, when
it wrote any), then one tool_use block per call, its `input` the parsed arguments.
stop_reason: "max_tokens" for a cut (max_tokens or the context), "tool_use" after calls,
"stop_sequence" (the engine names the string, in `stop_sequence`), else "end_turn".
`thinking` {"type": "disabled"} reaches the template as enable_thinking false; thinking
blocks sent back in a history are left out of the prompt.

Streamed, the events are Anthropic's: message_start, a ping, then per block
content_block_start, content_block_delta (thinking_delta, text_delta; input_json_delta
with the call's arguments in fragments as the model writes them), content_block_stop;
message_delta with stop_reason and usage; message_stop. An error after the stream
started is an `error` event.

Errors are Anthropic's shape (errors.py's format_anthropic, picked for every path under
/v1/messages). Requests are strict as the OpenAI routes are: an unknown field, a block
type this server does not take (image, document) or a wrong JSON type is a 400.
`metadata` and blocks' `cache_control` are accepted and change nothing (the prefix
cache needs no marks); the `anthropic-version` and `anthropic-beta` headers are
accepted; the API key may come as `x-api-key` (app.py's check).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from tokenmill.engine.llm_engine import RequestOutput
from tokenmill.sampling import FinishReason, SamplingParams
from tokenmill.server.async_engine import EngineFailure, Generation, RequestStream
from tokenmill.server.errors import InternalError, format_anthropic, invalid, to_api_error
from tokenmill.server.json_body import json_body
from tokenmill.server.metrics import CLIENT_CLOSED_REQUEST
from tokenmill.server.protocol import (
    NamedToolChoice,
    ToolName,
    check_fits,
    function_tool,
    make_sampling_params,
    named_choice,
    resolve_tools,
)
from tokenmill.server.running import (
    EventStream,
    chat_prompt,
    check_model,
    collect_one,
    engine_of,
    reasoning_of,
    shorter,
    start_request,
    unless_disconnected,
)
from tokenmill.server.text import StrictModel, Text
from tokenmill.server.tool_parser import ToolCallParser, arguments_object, parse_tool_calls
from tokenmill.server.tools import MAX_JSON_DEPTH, MAX_TOOLS, ToolRequest, json_depth

log = logging.getLogger("tokenmill.server")

router = APIRouter()

# tool_choice's types, as OpenAI's tool_choice ("tool" is a NamedToolChoice)
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
MIN_THINKING_BUDGET = 1024  # Anthropic's least thinking.budget_tokens


# --------------------------------------------------------------------------- requests


class CacheControl(StrictModel):
    """Anthropic's prompt-caching mark: accepted, and needless here (every prompt's
    blocks are cached by prefix)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    # What an answer from Anthropic carries back in a history: the cited passages are
    # already in `text`, so the citations change nothing here.
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(StrictModel):
    """A call the assistant made, in the history."""

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # What the SDK's ToolUseBlock carries back in a history (who made the call, the
    # toolset of a server's tools); nothing here reads them.
    caller: dict[str, Any] | None = None
    toolset_name: Text | None = None


class ToolResultBlock(StrictModel):
    """A call's result, in a user turn; is_error results reach the model marked so."""

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(StrictModel):
    """An earlier answer's thinking, sent back in the history: accepted and left out of
    the prompt, as chat templates leave out earlier turns' reasoning."""

    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: Text
    cache_control: CacheControl | None = None


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class ToolDefinition(StrictModel):
    type: Literal["custom"] | None = None  # server tools (web search...) are not served
    name: ToolName
    description: Text | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None  # the tool to call, with type "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(StrictModel):
    """Whether the model thinks first: passed to the chat template as enable_thinking
    (Qwen3's switch; a template without one thinks as it always does). budget_tokens is
    checked as Anthropic checks it (at least MIN_THINKING_BUDGET) and not enforced:
    max_tokens bounds the thinking and the answer together."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET)] | None = None

    @model_validator(mode="after")
    def _budget_with_enabled(self) -> ThinkingConfig:
        # Anthropic requires the budget exactly when thinking is "enabled"
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking.budget_tokens is required when thinking.type is 'enabled'")
        return self


class Metadata(StrictModel):
    user_id: Text | None = None  # logged, as OpenAI's `user` is


class CountTokensRequest(StrictModel):
    """What makes the prompt: /v1/messages/count_tokens takes this alone."""

    model: Text
    messages: list[InputMessage]
    system: Text | list[TextBlock] | None = None
    # capped before it is validated, as the chat route's tools are
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None  # the whole prompt's mark: as the blocks'
    thinking: ThinkingConfig | None = None

    @property
    def template_vars(self) -> dict[str, Any] | None:
        """The chat template's further variables: `thinking` as enable_thinking."""
        if self.thinking is None:
            return None
        return {"enable_thinking": self.thinking.type != "disabled"}

    def check(self) -> None:
        """What the types cannot say; a 400 naming the field."""
        if not self.messages:
            raise invalid("messages: at least one message is required", "messages")
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.content if isinstance(message.content, list) else []):
                where = f"messages[{i}].content[{j}]"
                if block.type == "tool_use" and message.role != "assistant":
                    raise invalid(f"{where}: tool_use blocks belong in assistant messages")
                if block.type == "tool_result" and message.role != "user":
                    raise invalid(f"{where}: tool_result blocks belong in user messages")
                if block.type.endswith("thinking") and message.role != "assistant":
                    raise invalid(f"{where}: {block.type} blocks belong in assistant messages")
                if block.type == "tool_use" and json_depth(block.input, MAX_JSON_DEPTH) > (
                    MAX_JSON_DEPTH
                ):
                    raise invalid(f"{where}.input nests more than {MAX_JSON_DEPTH} levels")
        if self.messages[-1].role != "user":
            # Anthropic continues a final assistant turn (a prefill); the chat templates
            # here render every turn whole and open a new one, which is not that.
            raise invalid(
                "the last message must be a user message: continuing a final assistant "
                "message (prefill) is not supported",
                "messages",
            )
        choice = self.tool_choice
        if choice is not None and (choice.type == "tool") != (choice.name is not None):
            raise invalid(
                "tool_choice: name is required with type 'tool', and only allowed with it",
                "tool_choice",
            )
        if choice is not None and choice.type == "none" and choice.disable_parallel_tool_use:
            raise invalid(
                "tool_choice: disable_parallel_tool_use is not allowed with type 'none'",
                "tool_choice",
            )

    def tool_request(self, tokenizer: Any) -> ToolRequest | None:
        """The tools resolved against the model's template (None without tools), as the
        chat route's: OpenAI's Tool models and tool_choice, for protocol.py's
        resolve_tools."""
        tools = None
        if self.tools is not None:
            tools = [function_tool(t.name, t.description, t.input_schema) for t in self.tools]
        choice: str | NamedToolChoice | None = None
        parallel = None
        if self.tool_choice is not None:
            if self.tool_choice.type == "tool":
                choice = named_choice(self.tool_choice.name)
            else:
                choice = _CHOICES[self.tool_choice.type]
            if self.tool_choice.disable_parallel_tool_use is not None and tools is not None:
                parallel = not self.tool_choice.disable_parallel_tool_use
        return resolve_tools(tokenizer, tools, choice, parallel)

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the OpenAI-style message dicts chat preparation takes."""
        out: list[dict[str, Any]] = []
        if self.system is not None:
            out.append({"role": "system", "content": _text_of(self.system)})
        for message in self.messages:
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif message.role == "assistant":
                out.append(_assistant_turn(message.content))
            else:
                out.extend(_user_turns(message.content))
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int  # required, as Anthropic's API requires it
    stop_sequences: list[Text] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None

    def sampling_params(self, tools: ToolRequest | None, reasoning: str | None) -> SamplingParams:
        """SamplingParams of the request; a forced call (tool_choice any or tool) is a
        grammar; reasoning: the format the answer is split by (None: not split). A refused
        value is a 400 naming the request's field."""
        kwargs: dict[str, Any] = {
            k: v for k in ("temperature", "top_p", "top_k") if (v := getattr(self, k)) is not None
        }
        kwargs["reasoning"] = reasoning
        if self.stop_sequences is not None:
            kwargs["stop"] = self.stop_sequences
        if tools is not None and tools.grammar() is not None:
            kwargs["grammar"] = tools.grammar()
        renames = {"stop": "stop_sequences", "grammar": "tools"}
        return make_sampling_params(max_tokens=self.max_tokens, renames=renames, **kwargs)


def _text_of(content: str | list[TextBlock] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _assistant_turn(blocks: list[Any]) -> dict[str, Any]:
    """An assistant message's blocks: its text, and its calls as OpenAI's tool_calls with
    the arguments as a dict (the form chat templates read)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(b.text for b in blocks if b.type == "text"),
    }
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in blocks
        if b.type == "tool_use"
    ]
    if calls:
        message["tool_calls"] = calls
    return message


def _user_turns(blocks: list[Any]) -> list[dict[str, Any]]:
    """A user message's blocks, in order: each tool result a "tool" message, each run of
    text blocks one user message."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for block in blocks:
        if block.type == "text":
            text.append(block.text)
            continue
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text = []
        content = _text_of(block.content)
        out.append(
            {
                "role": "tool",
                "tool_call_id": block.tool_use_id,
                "content": f"Error: {content}" if block.is_error else content,
            }
        )
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


# --------------------------------------------------------------------------- routes


@router.post("/v1/messages")
async def create_message(
    body: Annotated[MessagesRequest, Depends(json_body(MessagesRequest))], request: Request
) -> Response:
    engine = engine_of(request)
    model = check_model(request, body.model)
    body.check()
    tools, prompt_ids = await chat_prompt(request, body)
    reasoning = reasoning_of(request)  # the format answers are split by, or None
    params = body.sampling_params(tools, reasoning)
    check_fits(
        len(prompt_ids),
        params.max_tokens,
        engine.engine.max_model_len,
        prompt_param="messages",
        max_param="max_tokens",
    )
    request_id = uuid.uuid4().hex
    fmt = MessageFormat(f"msg_{request_id}", model, len(prompt_ids), tools)
    log.info(
        "%s: %d prompt tokens, max_tokens=%d, stream=%s, user=%r",
        fmt.id,
        len(prompt_ids),
        params.max_tokens,
        body.stream,
        shorter(body.metadata.user_id, 64) if body.metadata and body.metadata.user_id else None,
    )
    stream = await start_request(
        request,
        request_id,
        [prompt_ids],
        params,
        constraint_param="tools" if params.constraint is not None else None,
        fields=MessagesRequest.model_fields,
    )
    if body.stream:
        return EventStream(_events(request, fmt, stream), stream, fmt.id)
    answer = await unless_disconnected(request, collect_one(stream))
    if answer is None:
        log.info("%s: client disconnected; aborted", fmt.id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    generation, last = answer
    return JSONResponse(fmt.message(generation, last.stop_string if last else None))


@router.post("/v1/messages/count_tokens")
async def count_tokens(
    body: Annotated[CountTokensRequest, Depends(json_body(CountTokensRequest))], request: Request
) -> dict[str, int]:
    """The prompt a /v1/messages request with these fields would run, in tokens."""
    check_model(request, body.model)
    body.check()
    _, prompt_ids = await chat_prompt(request, body)
    return {"input_tokens": len(prompt_ids)}


# --------------------------------------------------------------------------- responses


class MessageFormat:
    """The answer to one /v1/messages request, whole (`message`) or as events (`start`,
    `feed` per engine output, `finish`). With tools the text goes through the call
    parser, streamed and whole alike; with reasoning (the engine split the output:
    SamplingParams.reasoning) the thinking comes first, as a thinking block."""

    def __init__(self, message_id: str, model: str, num_prompt: int, tools: ToolRequest | None):
        self.id, self.model, self.num_prompt = message_id, model, num_prompt
        self.tools = tools if tools is not None and tools.parses_calls else None
        # streaming state
        self._parser: ToolCallParser | None = self.tools.parser() if self.tools else None
        self._blocks = 0  # content blocks started
        self._open: str | None = None  # the open block's type: "thinking", "text", "tool_use"
        self._num_tokens = 0
        self._called = False

    # ---- whole ----
    def message(self, generation: Generation, stop_string: str | None) -> dict[str, Any]:
        text, calls = generation.text, []
        if self.tools is not None:
            text, calls = parse_tool_calls(self.tools.fmt, generation.text)
        content: list[dict[str, Any]] = []
        if generation.reasoning:
            content.append(_thinking_block(generation.reasoning))
        if text:
            content.append({"type": "text", "text": text})
        for call in calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_use_id(call.id),
                    "name": call.name,
                    "input": arguments_object(call.arguments),
                }
            )
        reason, sequence = _stop(generation.finish_reason, stop_string, bool(calls))
        return {
            **self._envelope(content, reason, sequence),
            "usage": self._usage(len(generation.token_ids)),
        }

    # ---- streamed ----
    def start(self) -> list[dict[str, Any]]:
        message = {**self._envelope([], None, None), "usage": self._usage(0)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def feed(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The events for one engine output (none while text is held back); the closing
        ones after the last."""
        self._num_tokens += len(out.token_ids)
        events = self._block_text("thinking", out.reasoning)
        if self._parser is None:
            events += self._block_text("text", out.text)
        else:
            parsed = self._parser.feed(out.text)
            if out.finished:
                parsed.add(self._parser.finish())
            events += self._block_text("text", parsed.content)
            for entry in parsed.tool_calls:
                if "id" in entry:  # a new call: id and name first
                    events += self._close()
                    self._called = True
                    block = {
                        "type": "tool_use",
                        "id": _tool_use_id(entry["id"]),
                        "name": entry["function"]["name"],
                        "input": {},
                    }
                    events.append(self._begin("tool_use", block))
                fragment = entry["function"]["arguments"]
                if fragment:
                    events.append(
                        self._delta({"type": "input_json_delta", "partial_json": fragment})
                    )
        if out.finished:
            events += self._finish(out.finish_reason, out.stop_string)
        return events

    def _finish(self, reason: FinishReason | None, stop_string: str | None) -> list[dict[str, Any]]:
        stop_reason, sequence = _stop(reason, stop_string, self._called)
        return [
            *self._close(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": sequence},
                "usage": self._usage(self._num_tokens),
            },
            {"type": "message_stop"},
        ]

    def _block_text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Text for a thinking or text block: the open one, or a new one after it."""
        if not text:
            return []
        events = []
        if self._open != kind:
            events += self._close()
            block = _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            events.append(self._begin(kind, block))
        key = "thinking" if kind == "thinking" else "text"
        events.append(self._delta({"type": f"{kind}_delta", key: text}))
        return events

    def _begin(self, kind: str, block: dict[str, Any]) -> dict[str, Any]:
        self._open, self._blocks = kind, self._blocks + 1
        return {"type": "content_block_start", "index": self._blocks - 1, "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._blocks - 1}]

    # ---- both ----
    def _envelope(
        self, content: list[dict[str, Any]], reason: str | None, sequence: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": reason,
            "stop_sequence": sequence,
        }

    def _usage(self, output_tokens: int) -> dict[str, int]:
        return {"input_tokens": self.num_prompt, "output_tokens": output_tokens}


def _stop(
    reason: FinishReason | None, stop_string: str | None, called: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer: a cut is max_tokens (calls cut
    short too), calls end in tool_use, a stop string (the engine names it) in stop_sequence,
    anything else (an EOS) in end_turn."""
    if reason is FinishReason.LENGTH:
        return "max_tokens", None
    if called:
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def _thinking_block(thinking: str) -> dict[str, Any]:
    # Anthropic signs its thinking so that it can check what comes back; nothing here
    # checks it, so the signature is empty
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic spells them (toolu_...); Mistral's 9-character ids, which
    its templates insist on, stay as they are."""
    return "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id


def event(data: dict[str, Any]) -> str:
    """One server-sent event as Anthropic frames them: `event: <type>` then `data:`."""
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(
    request: Request, fmt: MessageFormat, stream: RequestStream
) -> AsyncIterator[str]:
    """The SSE body: message_start, the blocks' events, message_delta, message_stop; an
    `error` event if the engine fails on the way."""
    for data in fmt.start():
        yield event(data)
    try:
        async for _, out in stream:
            for data in fmt.feed(out):
                yield event(data)
            if await request.is_disconnected():
                return  # EventStream aborts the rest
    except EngineFailure as e:
        yield event(format_anthropic(to_api_error(e)))
    except Exception:  # an event that could not be made: the stream still ends cleanly
        log.exception("%s: the stream failed", fmt.id)
        yield event(format_anthropic(to_api_error(InternalError())))
