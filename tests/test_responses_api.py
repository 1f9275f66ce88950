"""POST /v1/responses (OpenAI's Responses API, stateless) through the real `openai` SDK.

Fast: a real `tokenmill serve` on a tiny random model, whose answers are t-words: the
whole answer is the chat route's greedy answer for the same conversation (a string, a
list of items, a history of calls and results), the stream's events are the ones the SDK
reads, numbered, and their text is the whole answer's; max_output_tokens makes the status
incomplete; bad input is a 400 naming the field. The events of an answer with a tool call
(which the tiny vocabulary cannot spell) are checked against the SDK's own types and its
stream accumulator, fed by hand.

Slow: the default model (SmolLM2-135M) makes a function call, whole and streamed, and
answers after its result; text.format holds the answer to a JSON Schema;
`client.responses.stream` gives the final response.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from api_helpers import call_turn, closed_object, tool_turn, weather_tool
from server_fixture import running_server

from tokenmill.engine.llm_engine import RequestOutput
from tokenmill.sampling import FinishReason, SamplingParams
from tokenmill.server.async_engine import Generation
from tokenmill.server.responses_routes import ResponseShape, ResponsesRequest

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

TINY = "tiny"
# the Responses API's tool is the chat route's function, flat beside its type
CHAT_WEATHER = weather_tool("Get the current weather in a city", city_max_length=30, unit=False)
WEATHER = {"type": "function", **CHAT_WEATHER["function"]}
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def tiny_url(tiny_llama):
    # every turn's role and content, so a wrong role or a lost turn changes the prompt
    (tiny_llama / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }} {{ m.content }} "
        "{% for c in m.tool_calls or [] %}{{ c.function.name }} {% endfor %}{% endfor %}"
    )
    args = ("--model", str(tiny_llama), "--served-model-name", TINY, "--kv-cache-memory", "512tok")
    with running_server(*args, "--threads", "1") as url:
        yield url


@pytest.fixture(scope="module")
def tiny(tiny_url):
    return openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0)


def _message_item(role: str, text: str) -> dict:
    """A Responses message item of one text part: input_text, or output_text from the
    assistant."""
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def _chat(client, messages, **kwargs) -> tuple[str, object]:
    answer = client.chat.completions.create(model=TINY, messages=messages, temperature=0, **kwargs)
    return answer.choices[0].message.content, answer.usage


def test_whole_answer_is_the_chat_routes_greedy_answer(tiny_url, tiny):
    response = tiny.responses.create(
        model=TINY, input="t1 t2 t3", instructions="t4 t5", max_output_tokens=6, temperature=0
    )
    text, usage = _chat(
        tiny,
        [{"role": "system", "content": "t4 t5"}, {"role": "user", "content": "t1 t2 t3"}],
        max_tokens=6,
    )
    assert response.output_text == text and text
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == TINY and response.instructions == "t4 t5"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert response.usage.total_tokens == usage.total_tokens
    # a list of items says the same: developer is system, parts join into one text
    items = tiny.responses.create(
        model=TINY,
        input=[
            {"role": "developer", "content": "t4 t5"},
            _message_item("user", "t1 t2 t3"),
        ],
        max_output_tokens=6,
        temperature=0,
    )
    assert items.output_text == text
    # every field the SDK declares is there, with its type
    raw = httpx.post(
        f"{tiny_url}/v1/responses",
        json={"model": TINY, "input": "t1", "max_output_tokens": 2, "metadata": {"k": "v"}},
        timeout=60,
    )
    assert raw.status_code == 200, raw.text
    parsed = Response.model_validate(raw.json())
    assert parsed.metadata == {"k": "v"} and parsed.store is False


def test_a_history_of_calls_and_results_is_the_chat_routes(tiny):
    """function_call items become the assistant turn's tool_calls, function_call_output
    items tool turns: the prompt, and so the greedy answer, are the chat route's."""
    response = tiny.responses.create(
        model=TINY,
        input=[
            {"role": "user", "content": "t1 t2"},
            _message_item("assistant", "t3"),
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "t6 t7"},
        ],  # fmt: skip
        tools=[WEATHER],
        max_output_tokens=5,
        temperature=0,
    )
    messages = [
        {"role": "user", "content": "t1 t2"},
        call_turn("call_1", "get_weather", '{"city": "Oslo"}', content="t3"),
        tool_turn("call_1", "t6 t7"),
    ]
    text, usage = _chat(tiny, messages, tools=[CHAT_WEATHER], max_tokens=5)
    assert response.usage.input_tokens == usage.prompt_tokens
    assert response.output_text == text
    [tool] = response.tools
    assert tool.name == "get_weather" and response.tool_choice == "auto"


def test_max_output_tokens_makes_it_incomplete(tiny):
    response = tiny.responses.create(model=TINY, input="t1", max_output_tokens=2, temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.max_output_tokens == 2
    assert response.output[0].status == "incomplete"


def test_stream_events_are_numbered_and_add_up_to_the_whole_answer(tiny):
    kwargs = dict(model=TINY, input="t8 t9", max_output_tokens=6, temperature=0)
    whole = tiny.responses.create(**kwargs)
    events = list(tiny.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens cut it, as in the whole answer
    ]
    assert deltas >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-4].text == text and events[-3].part.text == text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert final.output[0].id == events[2].item.id
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the SDK's stream helper accumulates the same events without complaint
    with tiny.responses.stream(**kwargs) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
    assert snapshots[-1] == text


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
        ({"background": True}, "background", "not supported"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": 7}, "input", "JSON array"),  # the words of every route
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "'input_image'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input", "text only"),
        ({"input": [{"role": "robot", "content": "t1"}]}, "input", "'user'"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools", "pattern"),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "'nope'",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema is required"),
        (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "x",
                        "schema": {"type": "string", "format": "nope"},
                    }
                }
            },
            "text",
            "nope",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
            "cannot be combined",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"max_output_tokens": 100_000}, "max_output_tokens", "context length"),
        ({"temperature": "hot"}, "temperature", "temperature"),
        ({"model": "other"}, "model", "does not exist"),
    ],  # fmt: skip
)
def test_bad_input_is_a_400_naming_the_field(tiny_url, extra, param, words):
    body = {"model": TINY, "input": "t1", "max_output_tokens": 2, **extra}
    response = httpx.post(f"{tiny_url}/v1/responses", json=body, timeout=60)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"] and "\n" not in error["message"], error
    assert "Traceback" not in response.text


def test_the_sdk_raises_a_bad_request_for_previous_response_id(tiny):
    with pytest.raises(openai.BadRequestError, match="stateless"):
        tiny.responses.create(model=TINY, input="t1", previous_response_id="resp_123")


# --------------------------------------------------------------------------- a call's events


def _output(text: str, finished: bool) -> RequestOutput:
    reason = FinishReason.STOP if finished else None
    return RequestOutput("r", text, [5], [], finished, reason, 3, 1, 0, 0.0, None, None)


def test_a_streamed_call_is_the_sdks_events_and_the_whole_answers_items():
    """Text, then a Hermes call split across outputs: a message item, then a
    function_call item whose arguments arrive as deltas; every event is valid under the
    SDK's types, its stream accumulator builds the final response from them, and the
    items are the whole answer's (ids aside)."""
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState

    body = ResponsesRequest.model_validate({"input": "hi", "tools": [WEATHER]})
    tools = body.tool_request(_NoSpecials())
    assert tools is not None and tools.fmt == "hermes"
    pieces = ['Let me look.', ' <tool_', 'call>\n{"name": "get_weather", "argu', 'ments": {"city": "Oslo"}}\n</tool_call>']  # fmt: skip
    shape = ResponseShape("s", TINY, body, tools, SamplingParams())
    events = shape.opening()
    for i, piece in enumerate(pieces):
        events += shape.feed(_output(piece, i == len(pieces) - 1))
    events += shape.closing(FinishReason.STOP, 3, len(pieces), 0)
    state = ResponseStreamState(input_tools=[WEATHER], text_format=openai.omit)
    for event in events:
        EVENT.validate_python(event)  # strict: every field the SDK declares
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types.count("response.function_call_arguments.delta") >= 1
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = state._completed_response
    assert final is not None and final.output_text == "Let me look."
    whole = ResponseShape("w", TINY, body, tools, SamplingParams()).whole(
        Generation(text="".join(pieces), token_ids=[5] * 4, finish_reason=FinishReason.STOP), 3, 0
    )
    Response.model_validate(whole)

    def items(output):
        return [
            {k: v for k, v in item.items() if k not in ("id", "call_id")}
            for item in (
                o if isinstance(o, dict) else o.model_dump(exclude_none=True) for o in output
            )
        ]

    assert items(final.output) == items(whole["output"])
    [call] = [o for o in whole["output"] if o["type"] == "function_call"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Oslo"})


class _NoSpecials:
    """The tokenizer as tool_request reads it: no chat template (Hermes), no specials."""

    chat_template = None
    special_ids: frozenset[int] = frozenset()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1, 2]


# --------------------------------------------------------------------------- a real model

KV = ("--kv-cache-memory", "256MiB")
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def client(smollm_path):
    with running_server(*KV) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_function_call_round_trip(client):
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    kwargs = dict(model=MODEL, tools=[WEATHER], parallel_tool_calls=False, temperature=0)
    first = client.responses.create(input=question, tool_choice="required", **kwargs)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed" and not first.parallel_tool_calls
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        assert call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # streamed, the same call, its arguments in fragments
    events = list(
        client.responses.create(input=question, tool_choice="required", stream=True, **kwargs)
    )
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(fragments) > 1 and "".join(fragments) == done.arguments == calls[0].arguments
    assert events[-1].type == "response.completed"
    # the SDK's own output items go back as input, with the results
    history = [*question, *first.output]
    history += [
        {"type": "function_call_output", "call_id": c.call_id, "output": '{"temp_c": 21}'}
        for c in calls
    ]
    second = client.responses.create(input=history, max_output_tokens=40, **kwargs)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.output_text or any(o.type == "function_call" for o in second.output)
    final = client.responses.create(
        input=history, tool_choice="none", max_output_tokens=40, **kwargs
    )
    assert final.output_text and all(o.type == "message" for o in final.output)


@pytest.mark.slow
def test_text_format_json_schema_answers_validate(client):
    schema = closed_object(
        {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        }
    )
    response = client.responses.create(
        model=MODEL,
        input="Maria is 34. Extract the person as JSON.",
        text={
            "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
        },
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
    anything = client.responses.create(
        model=MODEL,
        input="Describe Paris as JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
        temperature=0,
    )
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)


@pytest.mark.slow
def test_the_stream_helper_gives_the_final_response(client):
    kwargs = dict(model=MODEL, input="Say hello in one short sentence.", temperature=0)
    whole = client.responses.create(**kwargs, max_output_tokens=60)
    assert whole.status == "completed", whole.output_text
    with client.responses.stream(**kwargs, max_output_tokens=60) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
