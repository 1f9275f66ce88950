"""OpenAI's Responses API, stateless: POST /v1/responses.

    ResponsesRequest            the body: `input` (a string, or message, function_call,
                                function_call_output and reasoning items), `instructions`,
                                `tools`, `text.format`, `max_output_tokens`, `reasoning`...
    ResponseShape               the `response` object and, streamed, its `response.*` events

A request becomes the OpenAI-style chat messages that the chat route prepares
(`instructions` the system turn, function_call items an assistant turn's `tool_calls`,
function_call_output items `tool` turns), rendered by the engine's one chat preparation
(LLMEngine.encode_chat) with the chat route's tool machinery: ToolRequest (server/tools.py)
puts the tools in the prompt and forces calls, the tool-call parser (server/tool_parser.py)
reads them back. `text.format` is a JSON Schema (or any JSON object) constraint, compiled
as the chat route's `response_format` is.

Stateless: nothing is stored, so `previous_response_id` is refused (the client sends the
whole conversation in `input`), and `store` is accepted and answered as false.

A reasoning model's thinking (split off by the engine, as for the chat route's
reasoning_content: SamplingParams.reasoning, the server's --reasoning-parser) is a
reasoning item before the message, its text one reasoning_text part, as OpenAI's
reasoning models and gpt-oss answer; usage.output_tokens_details.reasoning_tokens counts
the tokens generated before the answer's first text (the closing tag included).
`reasoning.effort` reaches the template as the chat route's reasoning_effort (see
template_vars). Reasoning items sent back in `input` are the reasoning_content of the
assistant turn that follows them, the field Qwen3's and DeepSeek-R1's templates read.

Streamed, the answer is the event sequence the openai SDK reads (`client.responses.create(
stream=True)` and `client.responses.stream`): response.created, response.in_progress, then
per output item output_item.added, for reasoning content_part.added,
reasoning_text.delta..., reasoning_text.done, content_part.done, for a message
content_part.added, output_text.delta..., output_text.done, content_part.done, for a
function call function_call_arguments.delta..., function_call_arguments.done, then
output_item.done; last response.completed (or response.incomplete when max_output_tokens
cut the answer, response.failed when the engine failed). Every event carries
`sequence_number`, from 0.

Errors are OpenAI's shape (the Responses API shares it): unknown fields are a 400 naming
the field, as on the other routes.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag

from tokenmill.engine.llm_engine import RequestOutput
from tokenmill.sampling import FinishReason, SamplingParams
from tokenmill.server import running
from tokenmill.server.async_engine import EngineFailure, Generation, RequestStream
from tokenmill.server.errors import (
    InternalError,
    clean_message,
    invalid,
    to_api_error,
)
from tokenmill.server.json_body import json_body
from tokenmill.server.metrics import CLIENT_CLOSED_REQUEST
from tokenmill.server.protocol import (
    ExtraFieldsRequest,
    Tool,
    ToolName,
    check_fits,
    function_tool,
    json_or_text,
    make_sampling_params,
    named_choice,
    resolve_tools,
)
from tokenmill.server.structured import JSON_OBJECT
from tokenmill.server.text import StrictModel, Text
from tokenmill.server.tool_parser import ToolCallParser, parse_tool_calls
from tokenmill.server.tools import MAX_TOOLS, ToolRequest

log = logging.getLogger("tokenmill.server")

router = APIRouter()

# Known fields this server does not support, and the values that mean "feature off".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "include": (None, []),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "service_tier": (None, "auto", "default"),
    "prompt": (None,),
    "conversation": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "stream_options": (None,),
}


def _kind(known: tuple[str, ...], default: str | None = None):
    """A discriminator for a union of models tagged by their "type": a known type is its
    own tag, any other "other" (a model that check() refuses by name, which says more than
    pydantic's list of tags). `default`: the tag of an object without "type"."""

    def tag(value: Any) -> str:
        if not isinstance(value, dict):
            return TAG + (default or known[0])  # fails as "not an object" against it
        kind = value.get("type", default)
        return TAG + (kind if kind in known else "other")

    return Discriminator(tag)


# Tags of the unions above begin with TAG: pydantic puts them in an error's location
# (input, "~list", 0, "~function_call", call_id), and _untagged drops them again.
TAG = "~"


def _tag(name: str) -> Tag:
    return Tag(TAG + name)


class _Other(BaseModel):
    """An item, part or tool of a type this server does not serve: refused by name."""

    model_config = ConfigDict(extra="allow")
    type: Any = None


# --------------------------------------------------------------------------- input items


class InputText(StrictModel):
    type: Literal["input_text"]
    text: Text


class OutputText(StrictModel):
    """An earlier answer's text, as the SDK sends `response.output` back."""

    type: Literal["output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[
    Annotated[InputText, _tag("input_text")]
    | Annotated[OutputText, _tag("output_text")]
    | Annotated[RefusalPart, _tag("refusal")]
    | Annotated[_Other, _tag("other")],
    _kind(("input_text", "output_text", "refusal")),
]


def _text_or(items: Any) -> Any:
    """A string or a list of `items`, whose errors are those of the form sent (a union
    would add "should be a valid string" to every item's error, and drop its field)."""
    return Annotated[
        Annotated[Text, _tag("text")] | Annotated[list[items], _tag("list")],
        Discriminator(lambda value: TAG + ("text" if isinstance(value, str) else "list")),
    ]


Content = _text_or(ContentPart)


class _SentBackItem(StrictModel):
    """The fields every item of an earlier response carries when it is sent back."""

    id: Text | None = None
    status: Text | None = None


class MessageItem(_SentBackItem):
    """A turn: EasyInputMessage (no type, content a string or parts) or a message item."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    phase: Text | None = None


class _CallPart(_SentBackItem):
    """A function call's half, tied to the other half by its call_id."""

    call_id: Text


class FunctionCallItem(_CallPart):
    """A call the model made, sent back in the history."""

    type: Literal["function_call"]
    name: Text
    arguments: Text  # JSON text


class FunctionCallOutputItem(_CallPart):
    """The result of a call, for the model's next turn."""

    type: Literal["function_call_output"]
    output: Content


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: Text


class SummaryText(StrictModel):
    type: Literal["summary_text"]
    text: Text


class ReasoningItem(_SentBackItem):
    """An earlier answer's reasoning: its reasoning_text parts reach the template as the
    reasoning_content of the assistant turn it led to (see template_messages). The
    summary and encrypted_content (OpenAI's, which no other server can read) are not
    used."""

    type: Literal["reasoning"]
    summary: list[SummaryText] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = Annotated[
    Annotated[MessageItem, _tag("message")]
    | Annotated[FunctionCallItem, _tag("function_call")]
    | Annotated[FunctionCallOutputItem, _tag("function_call_output")]
    | Annotated[ReasoningItem, _tag("reasoning")]
    | Annotated[_Other, _tag("other")],
    _kind(("message", "function_call", "function_call_output", "reasoning"), default="message"),
]


# --------------------------------------------------------------------------- the rest


class FunctionTool(StrictModel):
    """A function tool, flat as the Responses API spells it (chat nests `function`)."""

    type: Literal["function"]
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls are always valid when forced; taken as given

    def as_chat_tool(self) -> Tool:
        return function_tool(self.name, self.description, self.parameters, self.strict)


ToolIn = Annotated[
    Annotated[FunctionTool, _tag("function")] | Annotated[_Other, _tag("other")],
    _kind(("function",)),
]


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: ToolName


class TextFormat(StrictModel):
    """text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "name", "schema", "strict", "description"}."""

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    # `schema` would shadow a BaseModel method: stored under another name
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here


class TextConfig(StrictModel):
    format: TextFormat | None = None


# reasoning.effort -> the reasoning_effort a template reads (low, medium or high)
_EFFORTS = {"none": "low", "minimal": "low", "xhigh": "high"}


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(ExtraFieldsRequest):
    """POST /v1/responses. Extra fields are kept for `check`, which refuses them."""

    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED

    model: Text | None = None
    input: _text_or(InputItem)
    instructions: Text | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # capped before it is validated, as the chat route's (see ChatCompletionRequest.tools)
    tools: Annotated[list[ToolIn], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # nothing is stored either way
    metadata: dict[Text, Text] | None = None  # echoed back
    reasoning: ReasoningConfig | None = None
    previous_response_id: Text | None = None  # refused: stateless
    user: Text | None = None
    safety_identifier: Text | None = None
    _tools: ToolRequest | None = PrivateAttr(default=None)  # set by tool_request()

    # ---- checks ----
    def check(self) -> None:
        """What the types cannot say; a 400 naming the field."""
        self.refuse_extra_fields()
        if self.previous_response_id is not None:
            raise invalid(
                "previous_response_id is not supported: this server is stateless and stores "
                "no responses; send the whole conversation in input",
                "previous_response_id",
            )
        _check_metadata(self.metadata)
        if isinstance(self.input, list):
            if not self.input:
                raise invalid("input must not be empty", "input")
            for i, item in enumerate(self.input):
                _check_item(item, f"input[{i}]")
        for i, tool in enumerate(self.tools or []):
            if isinstance(tool, _Other):
                raise invalid(
                    f"tools[{i}] is of type {_quoted(tool.type)}, which this server does not "
                    "support: only function tools",
                    "tools",
                )
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            if fmt.type == "json_schema" and fmt.name is None:
                raise invalid("text.format.name is required when type is 'json_schema'", "text")
            if fmt.type == "json_schema" and fmt.schema_ is None:
                raise invalid("text.format.schema is required when type is 'json_schema'", "text")
            if fmt.type != "json_schema" and (fmt.schema_ is not None or fmt.name is not None):
                raise invalid(
                    f"text.format.name and schema need type 'json_schema', not '{fmt.type}'",
                    "text",
                )

    # ---- the prompt ----
    def tool_request(self, tokenizer: Any) -> ToolRequest | None:
        """The tools set up against the model's chat template (None without tools); a
        ParamError names the field. Runs on a worker thread (it walks every schema)."""
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = named_choice(choice.name)
        tools = None if self.tools is None else [t.as_chat_tool() for t in self.tools]
        self._tools = resolve_tools(
            tokenizer,
            tools,
            choice,
            self.parallel_tool_calls,
            lambda: f"text.format {self.text.format.type}" if self._constraint() else None,
        )
        return self._tools

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the OpenAI-style messages the chat template reads: the
        instructions a system turn, each run of function_call items the tool_calls of one
        assistant turn (the one their text came in, if it comes right before), each
        function_call_output a tool turn. Arguments go as a dict, as chat's do. Reasoning
        items are the reasoning_content of the assistant turn right after them."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = (
            [MessageItem(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        reasoning = ""  # reasoning items' text, for the assistant turn they led to
        for i, item in enumerate(items):
            if isinstance(item, ReasoningItem):
                reasoning += item.text
                continue
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {
                        "name": item.name,
                        "arguments": json_or_text(item.arguments, f"input[{i}].arguments", "input"),
                    },
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
                )
            # Qwen3's and DeepSeek-R1's templates read an assistant turn's reasoning_content
            # (and show it for the turns after the last user message); a template that does
            # not read it renders the turn without it. Reasoning that no assistant turn
            # followed is dropped.
            last = messages[-1]
            if reasoning and last["role"] == "assistant":
                last["reasoning_content"] = last.get("reasoning_content", "") + reasoning
            reasoning = ""
        return messages

    @property
    def template_vars(self) -> dict[str, Any] | None:
        """reasoning.effort as the chat route's reasoning_effort, for a template that reads
        it (gpt-oss's): the levels templates know are low, medium and high, so "minimal"
        is "low" and "xhigh" "high"; "none" also switches thinking off where the template
        has a switch (Qwen3's enable_thinking)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is None:
            return None
        found: dict[str, Any] = {"reasoning_effort": _EFFORTS.get(effort, effort)}
        if effort == "none":
            found["enable_thinking"] = False
        return found

    # ---- sampling ----
    def _constraint(self) -> dict[str, Any]:
        """SamplingParams keywords of text.format (empty for plain text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return {}
        return {"json_schema": JSON_OBJECT if fmt.type == "json_object" else fmt.schema_}

    @property
    def constraint_param(self) -> str | None:
        """The field that carries the output constraint, for a grammar's 400."""
        if self._tools is not None and self._tools.grammar() is not None:
            return "tools"
        return "text" if self._constraint() else None

    def sampling_params(
        self, default_max_tokens: int, reasoning: str | None = None
    ) -> SamplingParams:
        """reasoning: the reasoning format the answer is split by (None: not split)."""
        constraint, renames = self._constraint(), {"json_schema": "text"}
        if self._tools is not None and self._tools.grammar() is not None:  # a forced call
            constraint, renames = {"grammar": self._tools.grammar()}, {"grammar": "tools"}
        sampling = {"temperature": self.temperature, "top_p": self.top_p}
        return make_sampling_params(
            max_tokens=default_max_tokens
            if self.max_output_tokens is None
            else self.max_output_tokens,
            renames={"max_tokens": "max_output_tokens", **renames},
            reasoning=reasoning,
            **{k: v for k, v in sampling.items() if v is not None},
            **constraint,
        )


# OpenAI's caps on metadata: it is for a few labels, echoed back with the response
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise invalid(
            f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed",
            "metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise invalid(
                f"metadata key {_quoted(key)} has {len(key)} characters; at most "
                f"{MAX_METADATA_KEY_CHARS} are allowed",
                "metadata",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise invalid(
                f"metadata[{_quoted(key)}] has {len(value)} characters; at most "
                f"{MAX_METADATA_VALUE_CHARS} are allowed",
                "metadata",
            )


def _quoted(value: Any) -> str:
    return repr(running.shorter(value, 40)) if isinstance(value, str) else "unknown"


def _check_item(item: Any, where: str) -> None:
    if isinstance(item, _Other):
        raise invalid(
            f"{where} is of type {_quoted(item.type)}, which this server does not support: "
            "send message, function_call, function_call_output or reasoning items",
            "input",
        )
    field = {MessageItem: "content", FunctionCallOutputItem: "output"}.get(type(item))
    content = getattr(item, field) if field is not None else None
    for j, part in enumerate(content if isinstance(content, list) else []):
        if isinstance(part, _Other):
            raise invalid(
                f"{where}.{field}[{j}] is of type {_quoted(part.type)}, which this server "
                "does not support: text only (input_text, output_text, refusal)",
                "input",
            )


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.refusal if isinstance(part, RefusalPart) else part.text for part in content)


# --------------------------------------------------------------------------- the answer


def _hex() -> str:
    return uuid.uuid4().hex


class ResponseShape:
    """The `response` object of one request, whole or as its stream's events.

    whole(generation, ...) -> the response; opening() / feed(out) / closing(...) -> the
    events of a stream, numbered in order; failed(error) -> the event of a stream that
    broke off. A streamed answer's final response holds the items as they were streamed.

    With reasoning (the engine split the output: SamplingParams.reasoning) the thinking is
    a reasoning item before the answer's: {"type": "reasoning", "summary": [], "content":
    [{"type": "reasoning_text", "text"}]}, streamed as output_item.added,
    content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
    and output_item.done. `tally(out)`, fed every output, counts its tokens."""

    def __init__(
        self,
        request_id: str,
        model: str,
        body: ResponsesRequest,
        tools: ToolRequest | None,
        params: SamplingParams,
    ):
        self.id = f"resp_{request_id}"
        self.created_at = int(time.time())
        self.model = model
        self.body = body
        self.params = params
        self.tools = tools if tools is not None and tools.parses_calls else None
        # reasoning tokens: those generated before the answer's first text, once a
        # reasoning delta came (the tags and the whitespace around them included)
        self._before_answer, self._reasoned, self._answered = 0, False, False
        # streaming state
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # closed items
        self._open: dict[str, Any] | None = None  # the open item: reasoning, message or call
        self._parser: ToolCallParser | None = self.tools.parser() if self.tools else None

    # ---- the envelope ----
    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None else None
        choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {
                "effort": body.reasoning.effort if body.reasoning else None,
                "summary": body.reasoning.summary if body.reasoning else None,
            },
            "store": False,  # stateless
            "temperature": self.params.temperature,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt is not None
                else {"type": "text"}
            },
            "tool_choice": choice.model_dump()
            if isinstance(choice, BaseModel)
            else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": self.params.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
        }

    def tally(self, out: RequestOutput) -> None:
        """Count one output's tokens: reasoning until the answer's first text."""
        self._reasoned = self._reasoned or bool(out.reasoning)
        self._answered = self._answered or bool(out.text)
        if not self._answered:
            self._before_answer += len(out.token_ids)

    def usage(self, num_input: int, num_output: int, num_cached: int) -> dict[str, Any]:
        return {
            "input_tokens": num_input,
            # the prompt tokens computed here went into the KV cache (its full blocks stay
            # cached for later prompts); the others came from it
            "input_tokens_details": {
                "cached_tokens": num_cached,
                "cache_write_tokens": num_input - num_cached,
            },
            "output_tokens": num_output,
            "output_tokens_details": {
                "reasoning_tokens": self._before_answer if self._reasoned else 0
            },
            "total_tokens": num_input + num_output,
        }

    @staticmethod
    def status(reason: FinishReason | None) -> str:
        return "incomplete" if reason is FinishReason.LENGTH else "completed"

    # ---- items ----
    @staticmethod
    def _message_item(text: str, status: str) -> dict[str, Any]:
        return {
            "id": f"msg_{_hex()}",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [_text_part(text)] if status != "in_progress" else [],
        }

    @staticmethod
    def _reasoning_item(text: str, status: str) -> dict[str, Any]:
        return {
            "id": f"rs_{_hex()}",
            "type": "reasoning",
            "summary": [],
            "content": [_reasoning_part(text)] if status != "in_progress" else [],
            "status": status,
        }

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {
            "id": f"fc_{_hex()}",
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    # ---- whole ----
    def whole(self, generation: Generation, num_input: int, num_cached: int) -> dict[str, Any]:
        """The response for a whole answer: a reasoning item with its thinking (if any), a
        message item with its text, then a function_call item per call (the chat route's
        parse of the same text). The items' statuses are the stream's: the reasoning is
        completed once an answer followed it."""
        status = self.status(generation.finish_reason)
        content, calls = generation.text, []
        if self.tools is not None:
            content, calls = parse_tool_calls(self.tools.fmt, generation.text)
        output = []
        if generation.reasoning:
            answered = bool(content or calls)
            output.append(
                self._reasoning_item(generation.reasoning, "completed" if answered else status)
            )
        if content is not None or not calls:
            output.append(self._message_item(content or "", status))
        for call in calls:
            output.append(self._call_item(call.id, call.name, call.arguments, "completed"))
        usage = self.usage(num_input, len(generation.token_ids), num_cached)
        return self.response(status, output, usage)

    # ---- streamed ----
    def _event(self, type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        snapshot = self.response("in_progress", [])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The events for one engine output: reasoning deltas, text deltas, calls opened,
        argument deltas."""
        self.tally(out)
        events = self._part_text("reasoning", out.reasoning) if out.reasoning else []
        if self._parser is None:
            return events + (self._part_text("message", out.text) if out.text else [])
        delta = self._parser.feed(out.text)
        if out.finished:
            delta.add(self._parser.finish())
        if delta.content:
            events += self._part_text("message", delta.content)
        for entry in delta.tool_calls:  # id and name first, then argument fragments
            if "id" in entry:
                events += self._close("completed")
                events += self._open_call(entry["id"], entry["function"]["name"])
            if entry["function"]["arguments"]:
                events += self._arguments(entry["function"]["arguments"])
        return events

    def closing(
        self, reason: FinishReason | None, num_input: int, num_output: int, num_cached: int
    ) -> list[dict[str, Any]]:
        """The open item closed, and response.completed (or .incomplete). An answer with no
        text and no call still has its (empty) message, as the whole response does."""
        status = self.status(reason)
        events = self._close(status)
        if all(item["type"] == "reasoning" for item in self._output):
            events += self._open_part("message") + self._close(status)
        usage = self.usage(num_input, num_output, num_cached)
        done = self.response(status, list(self._output), usage)
        return [*events, self._event(f"response.{status}", response=done)]

    def failed(self, message: str) -> dict[str, Any]:
        """response.failed, for a stream the engine broke off (message: the server error's,
        cleaned as every error message is)."""
        error = {"code": "server_error", "message": clean_message(message, internal=True)}
        return self._event("response.failed", response=self.response("failed", [], error=error))

    def _part_text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Text for the open item of `kind` ("reasoning" or "message"), opening one (and
        closing the item before it) if another is open."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed") + self._open_part(kind)
        item = self._open
        item["content"][0]["text"] += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [
            *events,
            self._event(
                f"response.{name}.delta",
                item_id=item["id"],
                output_index=len(self._output),
                content_index=0,
                delta=text,
                **extra,
            ),
        ]

    def _open_part(self, kind: str) -> list[dict[str, Any]]:
        """A reasoning or message item opened, with its one content part."""
        if kind == "reasoning":
            item, part = self._reasoning_item("", "in_progress"), _reasoning_part
        else:
            item, part = self._message_item("", "in_progress"), _text_part
        where = {"item_id": item["id"], "output_index": len(self._output)}
        events = [
            self._event("response.output_item.added", output_index=len(self._output), item=item),
            self._event("response.content_part.added", **where, content_index=0, part=part("")),
        ]
        self._open = {**item, "content": [part("")]}
        return events

    def _open_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        item = self._call_item(call_id, name, "", "in_progress")
        self._open = dict(item)
        return [
            self._event("response.output_item.added", output_index=len(self._output), item=item)
        ]

    def _arguments(self, fragment: str) -> list[dict[str, Any]]:
        self._open["arguments"] += fragment
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=self._open["id"],
                output_index=len(self._output),
                delta=fragment,
            )
        ]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's done events; it joins the output. A call is always completed
        (a cut one is not parsed as a call); reasoning and a message take `status`."""
        if self._open is None:
            return []
        index = len(self._output)
        item, self._open = self._open, None
        if item["type"] == "function_call":
            item["status"] = "completed"
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        else:
            item["status"] = status
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "reasoning":
                done = self._event("response.reasoning_text.done", **where, text=part["text"])
            else:
                done = self._event(
                    "response.output_text.done", **where, text=part["text"], logprobs=[]
                )
            events = [done, self._event("response.content_part.done", **where, part=part)]
        self._output.append(item)
        return [*events, self._event("response.output_item.done", output_index=index, item=item)]


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _sse(event: dict[str, Any]) -> str:
    """One server-sent event named by its type, as OpenAI sends them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


# --------------------------------------------------------------------------- the route


def _untagged(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validation errors without the union tags in their locations, which name no field
    (input[0].~function_call.call_id -> input[0].call_id)."""
    return [
        {**error, "loc": tuple(p for p in error["loc"] if not str(p).startswith(TAG))}
        for error in errors
    ]


@router.post("/v1/responses")
async def create_response(
    body: Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest, _untagged))],
    request: Request,
) -> Response:
    engine = running.engine_of(request)
    model = running.check_model(request, body.model)
    body.check()
    tools, prompt_ids = await running.chat_prompt(request, body, param="input")
    max_model_len = engine.engine.max_model_len
    params = body.sampling_params(
        default_max_tokens=max(1, max_model_len - len(prompt_ids)),
        reasoning=running.reasoning_of(request),  # the format answers are split by, or None
    )
    check_fits(
        len(prompt_ids),
        params.max_tokens,
        max_model_len,
        prompt_param="input",
        max_param="max_output_tokens",
    )
    request_id = _hex()
    shape = ResponseShape(request_id, model, body, tools, params)
    log.info(
        "%s: %d input tokens, max_output_tokens=%d, tools=%d, stream=%s",
        shape.id,
        len(prompt_ids),
        params.max_tokens,
        len(body.tools or []),
        body.stream,
    )
    stream = await running.start_request(
        request,
        request_id,
        [prompt_ids],
        params,
        constraint_param=body.constraint_param,
        fields=ResponsesRequest.model_fields,
    )
    if body.stream:
        return running.EventStream(
            _events(request, shape, stream, len(prompt_ids)), stream, shape.id
        )
    answer = await running.unless_disconnected(request, _collect(shape, stream))
    if answer is None:
        log.info("%s: client disconnected; aborted", shape.id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    generation, last = answer
    num_cached = last.num_cached_tokens if last else 0  # the prompt tokens the cache held
    return JSONResponse(shape.whole(generation, len(prompt_ids), num_cached))


async def _collect(
    shape: ResponseShape, stream: RequestStream
) -> tuple[Generation, RequestOutput | None]:
    """running.collect_one, with each output counted by the shape (its reasoning tokens)."""
    generation, last = Generation(), None
    try:
        async for _, out in stream:
            shape.tally(out)
            generation.add(out)
            last = out
    finally:
        stream.abort()
    return generation, last


async def _events(
    request: Request, shape: ResponseShape, stream: RequestStream, num_input: int
) -> AsyncIterator[str]:
    """The SSE body: the response's events as the engine's outputs come."""
    for event in shape.opening():
        yield _sse(event)
    num_output, num_cached, reason = 0, 0, None
    try:
        async for _, out in stream:
            num_output += len(out.token_ids)
            num_cached, reason = out.num_cached_tokens, out.finish_reason
            for event in shape.feed(out):
                yield _sse(event)
            if await request.is_disconnected():
                return  # EventStream aborts the rest
        events = shape.closing(reason, num_input, num_output, num_cached)
    except EngineFailure as e:
        yield _sse(shape.failed(to_api_error(e).message))
        return
    except Exception:  # an event that could not be made: the stream still ends cleanly
        log.exception("%s: the stream failed", shape.id)
        yield _sse(shape.failed(to_api_error(InternalError()).message))
        return
    for event in events:
        yield _sse(event)
