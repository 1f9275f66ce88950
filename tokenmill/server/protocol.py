"""The OpenAI wire format: request bodies, their checks, and response and chunk shapes.

Request bodies are pydantic models in strict mode, so JSON types are checked as
OpenAI documents them (no "0.5" for a float, no `true` for an int). Value ranges
are deliberately not repeated here: `sampling_params` hands the values to
SamplingParams, whose one-line messages become the 400 error text, so the server
and the Python API reject the same things with the same words. Its ParamError names
the parameter; `make_sampling_params` respells it as the request's field
(ParamError.renamed), and tokenmill/server/errors.py makes the 400.

Every string field is checked for lone UTF-16 surrogates ("\ud800" is valid JSON but
not Unicode text): they are refused with a 400 naming the field, before any of them
reaches the tokenizer or an error message.

Nothing a client sends is silently ignored. Fields outside the models land in
`model_extra` and are refused by `check_extra_fields`: unknown ones as OpenAI
does ("Unrecognized request argument supplied"), known-but-unsupported ones
(`suffix`, `best_of` > 1, `functions`...) with a message saying so, unless they hold
the value that means "feature off".

Structured output (`response_format`, vLLM's `guided_*` and `structured_outputs`)
is read by tokenmill/server/structured.py, tools by tokenmill/server/tools.py (a model's
calls by tool_parser.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints

from tokenmill.checks import ParamError
from tokenmill.engine.llm_engine import RequestOutput, TokenLogprob
from tokenmill.sampling import SamplingParams
from tokenmill.server import structured
from tokenmill.server.async_engine import Generation
from tokenmill.server.errors import MAX_MESSAGE_CHARS as MAX_MESSAGE_CHARS  # re-exported
from tokenmill.server.errors import clean_message as clean_message  # re-exported
from tokenmill.server.errors import invalid, to_api_error
from tokenmill.server.structured import ResponseFormat, StructuredOutputs
from tokenmill.server.text import StrictModel, Text
from tokenmill.server.tool_parser import Delta, ToolCallParser, parse_tool_calls
from tokenmill.server.tools import MAX_JSON_DEPTH, MAX_TOOLS, ToolRequest, json_depth
from tokenmill.tokenizer.chat_template import is_reserved

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way
MAX_N = 128  # OpenAI's cap on completions per request
MAX_CACHE_SALT = 256  # characters; a salt names a scope, it is not a payload


# --------------------------------------------------------------------------- requests


_UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {  # field -> values meaning "off"
    "suffix": (None, ""),
    "best_of": (None, 1),
}
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    # The deprecated forms of tools and tool_choice.
    "functions": (None,),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
}


# Request fields passed to SamplingParams under the same name.
_SAMPLING_FIELDS = (
    "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "logit_bias", "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids",
    "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau",
    "mirostat_eta", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "dry_sequence_breakers",
)  # fmt: skip


class StreamOptions(StrictModel):
    include_usage: bool = False


class ExtraFieldsRequest(BaseModel):
    """A request body whose unknown fields are kept (in `model_extra`) so that
    `refuse_extra_fields` can name them: OpenAI's message for a field it does not know,
    and a message of its own for one it knows but this server does not support
    (`unsupported_fields`: name -> the values that mean "off", which pass)."""

    model_config = ConfigDict(extra="allow", strict=True)
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def refuse_extra_fields(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name not in self.unsupported_fields:
                raise invalid(f"Unrecognized request argument supplied: {name}", name)
            if value not in self.unsupported_fields[name]:
                raise invalid(f"{name} is not supported by this server", name)


class _GenerationRequest(ExtraFieldsRequest):
    """Fields both endpoints share. Extra fields are kept for `check_extra_fields`."""

    model: Text | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions shared with vLLM.
    top_k: int | None = None
    min_p: float | None = None
    # Extensions as llama.cpp's server names them.
    typical_p: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[Text] | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's prefix-cache isolation: only requests with the same salt (and, under
    # --prefix-cache-scope per-key, the same API key) share cached prompt blocks.
    cache_salt: Text | None = None
    # Structured output (tokenmill/server/structured.py), OpenAI's and vLLM's names.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputs | None = None

    def check_extra_fields(self) -> None:
        self.refuse_extra_fields()
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        if self.n is not None and self.n > MAX_N:
            raise invalid(f"n must be at most {MAX_N}, got {self.n}", "n")
        if self.cache_salt is not None and not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT:
            raise invalid(
                f"cache_salt must be 1 to {MAX_CACHE_SALT} characters, got {len(self.cache_salt)}",
                "cache_salt",
            )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_kwargs(self) -> dict[str, Any]:
        """The sampling fields the client set; SamplingParams' defaults fill the rest."""
        return {k: v for k in _SAMPLING_FIELDS if (v := getattr(self, k)) is not None}

    @property
    def constraint_param(self) -> str | None:
        """The request field that carries the output constraint, for error messages."""
        found = self._constraint()
        return found[0] if found else None

    def _constraint(self) -> tuple[str, dict[str, Any]] | None:
        try:
            return structured.constraint(self)
        except ParamError as e:
            raise to_api_error(e) from None

    def _constraint_kwargs(self) -> tuple[dict[str, Any], dict[str, str]]:
        """SamplingParams keywords of the constraint, and the renames that make its errors
        name the request's field."""
        found = self._constraint()
        if found is None:
            return {}, {}
        param, kwargs = found
        return kwargs, {kind: param for kind in kwargs}


class CompletionRequest(_GenerationRequest):
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED_COMPLETION

    # one prompt (text or token ids), or a batch of them: one choice per prompt (times n)
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def check_extra_fields(self) -> None:
        super().check_extra_fields()
        if self.echo and self.logprobs is not None:
            # Echo with logprobs means logprobs of the prompt tokens, which the engine
            # does not compute; refusing beats returning half of what was asked.
            raise invalid("echo together with logprobs is not supported", "echo")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        constraint, renames = self._constraint_kwargs()
        return make_sampling_params(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            logprobs=self.logprobs,
            renames=renames,
            **self._sampling_kwargs(),
            **constraint,
        )


# OpenAI's rule ([a-zA-Z0-9_-], 1 to 64), plus dots: an empty or spaced name cannot be
# called back by a client, and it is the marker the call's grammar spells out
ToolName = Annotated[
    Text, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
]


class FunctionDefinition(StrictModel):
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls are always valid when forced; taken as given


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: ToolName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def function_tool(
    name: str,
    description: str | None,
    parameters: dict[str, Any] | None,
    strict: bool | None = None,
) -> Tool:
    """A function tool in the chat form, from another API's spelling of one (Anthropic's
    input_schema, the Responses API's flat tools)."""
    return Tool(
        type="function",
        function=FunctionDefinition(
            name=name, description=description, parameters=parameters, strict=strict
        ),
    )


def named_choice(name: str) -> NamedToolChoice:
    """tool_choice naming the function to call, in the chat form."""
    return NamedToolChoice(type="function", function=FunctionName(name=name))


def resolve_tools(
    tokenizer: Any,
    tools: list[Tool] | None,
    choice: str | NamedToolChoice | None,
    parallel: bool | None,
    constraint: Callable[[], str | None] = lambda: None,
) -> ToolRequest | None:
    """The tools set up against the model's chat template (None without tools), for every
    API that takes tools: ToolRequest.create with the tokenizer's special tokens (Mistral's
    [TOOL_CALLS]), its ParamError a 400 naming the field. constraint() -> the field of an
    output constraint the request also sets (None: none), which a forced call refuses;
    asked only when the call is forced. Runs on a worker thread (it walks every schema)."""

    def special_id(piece: str) -> int | None:
        ids = tokenizer.encode(piece, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and ids[0] in tokenizer.special_ids else None

    try:
        request = ToolRequest.create(tools, choice, parallel, tokenizer.chat_template, special_id)
    except ParamError as e:
        raise to_api_error(e) from None
    forced = request is not None and request.grammar() is not None
    if forced and (name := constraint()) is not None:
        raise invalid(
            f"{name} cannot be combined with tool_choice "
            f"{request.choice if request.forced is None else 'naming a function'}: "
            "the answer is a tool call",
            "tool_choice",
        )
    return request


class CalledFunction(StrictModel):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCallIn(StrictModel):
    """A call in an assistant message of the history."""

    id: Text
    type: Literal["function"]
    function: CalledFunction


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


class ChatMessage(StrictModel):
    role: Text
    content: Text | list[TextPart] | None = None  # None: an assistant turn of tool calls only
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: Text | None = None  # tool: which call this is the result of
    refusal: Text | None = None  # as OpenAI's responses carry it back

    def check(self, i: int) -> None:
        """What the types cannot say; a 400 naming messages[i]."""
        where = f"messages[{i}]"
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            if not (self.role == "assistant" and self.refusal is not None):
                raise invalid(f"{where}.content is required (role {self.role!r})", "messages")
        if self.tool_calls is not None and self.role != "assistant":
            raise invalid(f"{where}.tool_calls is only allowed in assistant messages", "messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise invalid(f"{where}.tool_call_id is required for a tool message", "messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise invalid(f"{where}.tool_call_id is only allowed in tool messages", "messages")

    def as_template_input(self, index: int | None = None) -> dict[str, Any]:
        """The dict a chat template reads; "developer" is OpenAI's new name for "system".

        Tool calls carry their arguments as a dict, the form transformers' templates
        expect (OpenAI sends JSON text). index: this message's place, for error messages
        (a 400 for arguments nested too deep to render)."""
        content = self.content if self.content is not None else self.refusal or ""
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content,
        }
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json_or_text(
                            call.function.arguments,
                            f"messages[{'' if index is None else index}].tool_calls[{j}]"
                            ".function.arguments",
                        ),
                    },
                }
                for j, call in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def json_or_text(text: str, where: str, param: str = "messages") -> Any:
    """JSON text as its value (a 400 about `param` naming `where` when it nests too deep
    for the chat template to walk: "[" * 990 was a 500), other text as it
    is: a call's arguments in a history, as chat templates read them."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    except RecursionError:  # deeper than json's own stack allows
        value = None
        depth = MAX_JSON_DEPTH + 1
    else:
        depth = json_depth(value, MAX_JSON_DEPTH)
    if depth > MAX_JSON_DEPTH:
        raise invalid(f"{where} nests more than {MAX_JSON_DEPTH} levels", param)
    return value


class ChatCompletionRequest(_GenerationRequest):
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED_CHAT

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # capped before it is validated: 20,000 definitions took 0.6 s to validate (on the
    # event loop, where FastAPI validates a body); over the cap it is 2 ms
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: further variables for the chat template ({"enable_thinking": false})
    chat_template_kwargs: dict[Text, Any] | None = None
    # OpenAI's: the template's variable of the same name, where it reads one (gpt-oss)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    _tools: ToolRequest | None = PrivateAttr(default=None)  # set by tool_request()

    def check_extra_fields(self) -> None:
        super().check_extra_fields()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        for i, message in enumerate(self.messages):
            message.check(i)
        for name, value in (self.chat_template_kwargs or {}).items():
            if not name.isidentifier() or is_reserved(name):
                raise invalid(
                    f"chat_template_kwargs cannot set {name!r}: "
                    + ("the chat template sets it" if name.isidentifier() else "not a name"),
                    "chat_template_kwargs",
                )
            if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
                raise invalid(
                    f"chat_template_kwargs[{name!r}] nests more than {MAX_JSON_DEPTH} levels",
                    "chat_template_kwargs",
                )

    @property
    def template_vars(self) -> dict[str, Any] | None:
        """The chat template's further variables: chat_template_kwargs, and reasoning_effort
        under its own name (over a chat_template_kwargs entry of that name). A template
        that reads neither renders as without them."""
        found = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            found["reasoning_effort"] = self.reasoning_effort
        return found or None

    def tool_request(self, tokenizer: Any) -> ToolRequest | None:
        """The tools set up against the model's chat template (None without tools)."""
        # constraint_param before _tools is set: the output constraint's own field
        tools = resolve_tools(
            tokenizer,
            self.tools,
            self.tool_choice,
            self.parallel_tool_calls,
            lambda: self.constraint_param,
        )
        self._tools = tools
        return tools

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template reads them (their text kept as text)."""
        return [message.as_template_input(i) for i, message in enumerate(self.messages)]

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def sampling_params(
        self, default_max_tokens: int, reasoning: str | None = None
    ) -> SamplingParams:
        """reasoning: the reasoning format the answer is split by (None: not split)."""
        requested = self.requested_max_tokens
        constraint, renames = self._constraint_kwargs()
        tools = self._tools
        if tools is not None and tools.grammar() is not None:  # tool_choice forces a call
            constraint, renames = {"grammar": tools.grammar()}, {"grammar": "tools"}
        return make_sampling_params(
            max_tokens=default_max_tokens if requested is None else requested,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            renames={"max_tokens": self.max_tokens_param, "logprobs": "top_logprobs", **renames},
            reasoning=reasoning,
            **self._sampling_kwargs(),
            **constraint,
        )

    @property
    def constraint_param(self) -> str | None:
        if self._tools is not None and self._tools.grammar() is not None:
            return "tools"
        return super().constraint_param


def make_sampling_params(renames: dict[str, str] | None = None, **kwargs: Any) -> SamplingParams:
    """SamplingParams(**kwargs), its ParamError turned into a 400 naming the parameter.

    renames maps SamplingParams' names to the request's own (chat's top_logprobs is
    SamplingParams.logprobs, guided_regex is regex), in both `param` and the message."""
    try:
        return SamplingParams(**kwargs)
    except ParamError as e:
        raise to_api_error(e.renamed(renames or {})) from None


def check_fits(
    num_prompt: int, max_tokens: int, max_model_len: int, *, prompt_param: str, max_param: str
) -> None:
    """Refuse a prompt, or prompt + max_tokens, that the context cannot hold."""
    if num_prompt >= max_model_len:
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens, and your prompt "
            f"has {num_prompt} tokens, leaving no room for a completion. Please shorten it.",
            prompt_param,
        )
    if num_prompt + max_tokens > max_model_len:
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the prompt or {max_param}.",
            max_param,
        )


# --------------------------------------------------------------------------- responses


def usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage, with prompt_tokens_details.cached_tokens: the prompt tokens the
    prefix cache (in memory or on disk) served, which were not computed again."""
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


@dataclass
class _Format:
    """The response and stream chunks of one request, for one endpoint.

    decode: token id -> its text (tokenizer.decode([id])), for logprobs.
    want_logprobs: whether the request asked for logprobs.
    Subclasses say how a choice's text and logprobs are laid out, and add their own
    fields after these four."""

    id_prefix: ClassVar[str]
    object_name: ClassVar[str]
    chunk_object_name: ClassVar[str]

    request_id: str
    model: str
    decode: Callable[[int], str]
    want_logprobs: bool

    def __post_init__(self) -> None:
        self.id = f"{self.id_prefix}-{self.request_id}"
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def response(
        self, generations: list[Generation], num_prompt: int, n: int = 1
    ) -> dict[str, Any]:
        """The whole answer; n: choices per prompt (each prompt's first choice says how
        much of it the cache served)."""
        choices = [self._choice(i, g) for i, g in enumerate(generations)]
        num_completion = sum(len(g.token_ids) for g in generations)
        cached = sum(g.num_cached_tokens for g in generations[::n])
        return self._envelope(
            self.object_name, choices, usage=usage(num_prompt, num_completion, cached)
        )

    def usage_chunk(
        self, num_prompt: int, num_completion: int, num_cached: int = 0
    ) -> dict[str, Any]:
        usage_ = usage(num_prompt, num_completion, num_cached)
        return self._envelope(self.chunk_object_name, [], usage=usage_)

    def _choice(self, index: int, generation: Generation) -> dict[str, Any]:
        raise NotImplementedError

    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        """Chunks sent before any token (chat's role, completions' echo)."""
        return []

    def chunk(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        """The chunk for one engine output; None when it carries nothing to send
        (text held back by the detokenizer or stop matching, no logprobs asked)."""
        raise NotImplementedError

    def _worth_sending(self, out: RequestOutput) -> bool:
        return bool(out.text or out.finished or (self.want_logprobs and out.logprobs))


@dataclass
class CompletionFormat(_Format):
    """/v1/completions: choices[i].text, logprobs {tokens, token_logprobs, top_logprobs,
    text_offset}. The sampled token is always among its top_logprobs, as OpenAI
    documents (so up to logprobs + 1 entries)."""

    id_prefix = "cmpl"
    object_name = chunk_object_name = "text_completion"

    n: int  # choices in all
    echo: list[str] | None  # each choice's prompt text, when the request echoes

    def __post_init__(self) -> None:
        super().__post_init__()
        # text offset of each choice's next token
        self._offsets = [len(e) for e in self.echo] if self.echo else [0] * self.n

    def logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict[str, list]:
        tokens = [self.decode(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(token)
        tops = [
            {self.decode(t): _clamped(v) for t, v in {**lp.top, lp.token_id: lp.logprob}.items()}
            for lp in logprobs
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [_clamped(lp.logprob) for lp in logprobs],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _choice(self, index: int, generation: Generation) -> dict[str, Any]:
        logprobs = self.logprobs(index, generation.logprobs) if self.want_logprobs else None
        return {
            "index": index,
            "text": (self.echo[index] if self.echo else "") + generation.text,
            "logprobs": logprobs,
            "finish_reason": generation.finish_reason,
        }

    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        return [self._chunk(i, self.echo[i], None, None) for i in range(n)]

    def chunk(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        if not self._worth_sending(out):
            return None
        logprobs = self.logprobs(index, out.logprobs) if self.want_logprobs else None
        reason = out.finish_reason if out.finished else None
        return self._chunk(index, out.text, logprobs, reason)

    def _chunk(self, index: int, text: str, logprobs, reason: str | None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return self._envelope(self.chunk_object_name, [choice])


@dataclass
class ChatFormat(_Format):
    """/v1/chat/completions: choices[i].message, streamed as deltas after one role
    chunk per choice; logprobs {content: [{token, logprob, bytes, top_logprobs}]}.

    With tools, the output is parsed into message.tool_calls (finish_reason
    "tool_calls"), streamed as delta.tool_calls: id and name first, then the
    arguments in fragments.

    With reasoning (the engine split the output: SamplingParams.reasoning), the thinking
    is message.reasoning_content (null when there was none), streamed as
    delta.reasoning_content before the answer's delta.content; tool calls are parsed
    from the answer alone."""

    id_prefix = "chatcmpl"
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    tools: ToolRequest | None = None
    reasoning: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tools is not None and not self.tools.parses_calls:
            self.tools = None
        self._parsers: dict[int, ToolCallParser] = {}  # per choice, when streaming

    def logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, list]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.decode(token_id)
            return {"token": token, "logprob": _clamped(logprob), "bytes": list(token.encode())}

        content = [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(*top) for top in lp.top.items()],
            }
            for lp in logprobs
        ]
        return {"content": content}

    def _choice(self, index: int, generation: Generation) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": generation.text}
        if self.reasoning:
            message["reasoning_content"] = generation.reasoning or None
        reason = generation.finish_reason
        if self.tools is not None:
            message["content"], calls = parse_tool_calls(self.tools.fmt, generation.text)
            if calls:
                message["tool_calls"] = [call.as_openai() for call in calls]
                reason = reason.with_tool_calls()
        return {
            "index": index,
            "message": message,
            "logprobs": self.logprobs(generation.logprobs) if self.want_logprobs else None,
            "finish_reason": reason,
        }

    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        return [self._chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(n)]

    def chunk(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        if self.tools is not None:
            return self._tool_chunk(index, out)
        if not (self._worth_sending(out) or out.reasoning):
            return None
        delta = _reasoning_delta(out)
        if out.text or not (out.finished or out.reasoning):
            delta["content"] = out.text
        logprobs = self.logprobs(out.logprobs) if self.want_logprobs else None
        return self._chunk(index, delta, logprobs, out.finish_reason if out.finished else None)

    def _tool_chunk(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        """A chunk whose text went through the tool-call parser first."""
        parser = self._parsers.setdefault(index, self.tools.parser())
        parsed = parser.feed(out.text)
        if out.finished:
            parsed.add(parser.finish())
        if not (parsed.content or parsed.tool_calls or out.finished or out.reasoning) and not (
            self.want_logprobs and out.logprobs
        ):
            return None
        delta = {**_reasoning_delta(out), **_delta(parsed)}
        reason = out.finish_reason if out.finished else None
        if reason is not None and parser.calls:
            reason = reason.with_tool_calls()
        logprobs = self.logprobs(out.logprobs) if self.want_logprobs else None
        return self._chunk(index, delta, logprobs, reason)

    def _chunk(self, index: int, delta: dict, logprobs, reason: str | None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self._envelope(self.chunk_object_name, [choice])


def _reasoning_delta(out: RequestOutput) -> dict[str, Any]:
    return {"reasoning_content": out.reasoning} if out.reasoning else {}


def _delta(parsed: Delta) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.tool_calls:
        delta["tool_calls"] = parsed.tool_calls
    return delta
