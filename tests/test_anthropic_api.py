"""Anthropic's Messages API (POST /v1/messages), through the real `anthropic` SDK against a
real `tokenmill serve`.

On a tiny random model (fast): the answer is the OpenAI chat route's greedy answer for the
same conversation, whole and streamed (`messages.stream`, `create(stream=True)` and its
event sequence); stop_sequences end it with stop_reason "stop_sequence" naming the
string, max_tokens with "max_tokens"; a history of tool_use and tool_result blocks makes
the prompt the chat route makes of the same calls and results; bad input is the SDK's
error classes with Anthropic's body; the API key may come as x-api-key. On SmolLM2
(slow): a tool round trip, whole and streamed.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from api_helpers import call_turn, tool_turn
from server_fixture import running_server, server_process

# Roles and contents as words: the tiny model's tokenizer knows t0..t319 (others are t0).
TEMPLATE = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
CONVERSATION = [
    {"role": "user", "content": "t5 t6 t7"},
    {"role": "assistant", "content": "t8 t9"},
    {"role": "user", "content": "t10 t11"},
]
SYSTEM = "t3 t4"
# The SDK's create() no longer takes temperature, top_p or top_k (Anthropic's newer models
# refuse them); the API still does, and clients send them as extra fields.
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    (tiny_llama / "chat_template.jinja").write_text(TEMPLATE)
    return tiny_llama


@pytest.fixture(scope="module")
def url(tiny):
    args = ("--model", str(tiny), "--kv-cache-memory", "512tok", "--threads", "1")
    with server_process(*args, "--served-model-name", "tiny") as server:
        yield server.base_url


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def openai_chat(url: str, messages: list[dict], **fields) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def blocks(message: anthropic.types.Message) -> list[dict]:
    """A message's content blocks as dicts (a stream's final message has parsed blocks)."""
    return [b.model_dump(exclude={"parsed_output"}) for b in message.content]


def greedy(client: anthropic.Anthropic, **fields) -> anthropic.types.Message:
    kwargs = {"model": "tiny", "max_tokens": 12, "messages": CONVERSATION, "extra_body": GREEDY}
    return client.messages.create(**{**kwargs, **fields})


# --------------------------------------------------------------------------- answers


def test_whole_answer_is_the_chat_routes(client, url):
    message = greedy(client, system=SYSTEM)
    chat = openai_chat(url, [{"role": "system", "content": SYSTEM}, *CONVERSATION], max_tokens=12)
    [choice] = chat["choices"]
    assert choice["message"]["content"]  # the tiny model writes words, not an EOS at once
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == "tiny"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choice["message"]["content"]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"] == 12
    # the system prompt and the messages as text blocks: the same prompt, the same answer
    system = [{"type": "text", "text": "t3 "}, {"type": "text", "text": "t4"}]
    blocks = [
        {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
        for m in CONVERSATION
    ]
    assert greedy(client, system=system, messages=blocks).content == message.content


def test_streamed_answer_is_the_whole_one(client):
    whole = greedy(client)
    with client.messages.stream(
        model="tiny", max_tokens=12, messages=CONVERSATION, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_the_event_sequence(client, url):
    events = list(greedy(client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:4] == ["content_block_start", "content_block_delta", "content_block_delta"]
    assert kinds[-3] == "content_block_stop"
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.output_tokens == 0
    assert events[1].index == 0 and events[1].content_block.type == "text"
    assert all(e.delta.type == "text_delta" for e in events[2:-3])
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12
    # the raw wire: each data line after its `event:` line, and a ping
    body = {"model": "tiny", "max_tokens": 2, "messages": CONVERSATION, "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert names == [d["type"] for d in data] and "ping" in names


def test_stop_sequences(client):
    text = greedy(client).content[0].text
    words = text.split()
    assert len(words) == 12
    # a word whose first appearance is past the start: the answer ends just before it
    # (or before a longer word it begins, which the stop matcher sees first as well)
    stop = next(w for i, w in enumerate(words) if i > 0 and w not in words[:i])
    end = text.index(stop)
    message = greedy(client, stop_sequences=["t999", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:end]
    # the tokens up to the one that completed the stop sequence are counted
    assert message.usage.output_tokens == len(text[: end + len(stop)].split())
    with client.messages.stream(
        model="tiny", max_tokens=12, messages=CONVERSATION, extra_body=GREEDY, stop_sequences=[stop]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert blocks(final) == blocks(message)
    # a stop sequence the answer never writes: it runs to max_tokens
    assert greedy(client, stop_sequences=["t999"]).stop_reason == "max_tokens"


def test_end_turn(client):
    """An answer that ends on EOS is "end_turn" (the tiny model's EOS is t319, which a
    chat of t319s makes likely; the test looks for a prompt whose answer ends early)."""
    for k in range(3, 60):
        message = greedy(client, messages=[{"role": "user", "content": f"t{k}"}], max_tokens=40)
        if message.stop_reason != "max_tokens":
            break
    else:
        pytest.skip("no short prompt makes the tiny model write its EOS")
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens < 40


def test_max_tokens(client):
    message = greedy(client, max_tokens=3)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_tool_history_is_the_chat_routes_prompt(client, url):
    """tool_use and tool_result blocks become the chat route's tool_calls and tool turns:
    the prompt (with the tools offered, the Hermes instructions) has the same tokens."""
    history = [
        {"role": "user", "content": "t5 t6"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "t7"},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "t8"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "t9 t10"},
                {"type": "text", "text": "t11"},
            ],
        },
    ]
    openai_history = [
        {"role": "user", "content": "t5 t6"},
        call_turn("toolu_1", "get_weather", '{"city": "t8"}', content="t7"),
        tool_turn("toolu_1", "t9 t10"),
        {"role": "user", "content": "t11"},
    ]
    tool = {"type": "function", "function": {**WEATHER, "parameters": WEATHER["input_schema"]}}
    del tool["function"]["input_schema"]
    chat = openai_chat(url, openai_history, max_tokens=1, tools=[tool])
    count = client.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER])
    assert count.input_tokens == chat["usage"]["prompt_tokens"]
    message = greedy(client, messages=history, tools=[WEATHER], max_tokens=1)
    assert message.usage.input_tokens == count.input_tokens
    # tool_choice none: the tools are not shown to the model
    chat = openai_chat(url, openai_history, max_tokens=1, tools=[tool], tool_choice="none")
    none = client.messages.count_tokens(
        model="tiny", messages=history, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert none.input_tokens == chat["usage"]["prompt_tokens"] < count.input_tokens


# --------------------------------------------------------------------------- errors


def assert_anthropic_error(error: anthropic.APIStatusError, status: int, kind: str) -> str:
    """The SDK's error carries Anthropic's body; its message, returned."""
    assert error.status_code == status
    assert error.body["type"] == "error" and set(error.body) == {"type", "error"}
    assert error.body["error"]["type"] == kind and set(error.body["error"]) == {"type", "message"}
    return error.body["error"]["message"]


BAD_REQUESTS = {
    # case: (fields over a good request, words of the message)
    "unknown field": ({"extra_body": {"frequency_penalty": 1}}, "frequency_penalty"),
    "no max_tokens": ({"max_tokens": None}, "max_tokens"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "wrong type": ({"extra_body": {"temperature": "0.5"}}, "temperature"),
    "temperature": ({"extra_body": {"temperature": -1.0}}, "temperature"),
    "top_k": ({"extra_body": {"top_k": -5}}, "top_k"),
    "image block": (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "image",
    ),
    "tool_use from the user": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}],
                }
            ]
        },
        "tool_use blocks belong in assistant messages",
    ),
    "prefill": (
        {"messages": [*CONVERSATION, {"role": "assistant", "content": "t1"}]},
        "prefill",
    ),
    "no messages": ({"messages": []}, "messages"),
    "named tool missing": (
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        "nope",
    ),
    "tool without a name": ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "name"),
    "too long": ({"max_tokens": 5000}, "max_tokens"),
    "stop sequences": ({"stop_sequences": [""]}, "stop_sequences"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests(client, case):
    fields, words = BAD_REQUESTS[case]
    kwargs = {"model": "tiny", "max_tokens": 4, "messages": CONVERSATION, **fields}
    with pytest.raises(anthropic.BadRequestError) as caught:
        if fields.get("max_tokens", 1) is None:  # the SDK itself would not send it
            del kwargs["max_tokens"]
            client.post("/v1/messages", cast_to=object, body=kwargs)
        else:
            client.messages.create(**kwargs)
    message = assert_anthropic_error(caught.value, 400, "invalid_request_error")
    assert words in message and "Traceback" not in message


def test_other_errors(client, url):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="gpt-9", max_tokens=4, messages=CONVERSATION)
    assert "gpt-9" in assert_anthropic_error(caught.value, 404, "not_found_error")
    # an unknown path below /v1/messages, and invalid JSON: Anthropic's shape too
    response = httpx.post(f"{url}/v1/messages/batches", json={})
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    response = httpx.post(f"{url}/v1/messages", content=b"{", headers={"content-type": "x"})
    assert response.status_code == 400 and response.json()["type"] == "error"
    # the OpenAI routes keep OpenAI's shape
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
    assert response.status_code == 400 and set(response.json()) == {"error"}


def test_api_key(tiny):
    args = ("--model", str(tiny), "--kv-cache-memory", "256tok", "--threads", "1")
    with running_server(*args, "--api-key", "secret", "--served-model-name", "tiny") as url:
        good = anthropic.Anthropic(base_url=url, api_key="secret", max_retries=0)
        message = good.messages.create(model="tiny", max_tokens=2, messages=CONVERSATION)
        assert message.usage.output_tokens == 2
        bearer = anthropic.Anthropic(base_url=url, auth_token="secret", max_retries=0)
        assert bearer.messages.count_tokens(model="tiny", messages=CONVERSATION).input_tokens
        bad = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model="tiny", max_tokens=2, messages=CONVERSATION)
        assert "x-api-key" in assert_anthropic_error(caught.value, 401, "authentication_error")
        # the OpenAI routes take x-api-key too, and answer in their own shape without it
        models = httpx.get(f"{url}/v1/models", headers={"x-api-key": "secret"})
        assert models.status_code == 200
        assert set(httpx.get(f"{url}/v1/models").json()) == {"error"}


# --------------------------------------------------------------------------- tools, for real


@pytest.mark.slow
def test_tool_round_trip(smollm_path):
    """A forced call comes back as a tool_use block whose input follows the schema, whole
    and streamed (input_json_delta); its result goes back as a tool_result block."""
    question = {"role": "user", "content": "What is the weather like in Paris?"}
    kwargs = {
        "model": "smollm2-135m-instruct",
        "max_tokens": 60,
        "extra_body": GREEDY,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    with running_server("--kv-cache-memory", "64MiB") as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        message = client.messages.create(messages=[question], **kwargs)
        assert message.stop_reason == "tool_use"
        [call] = [b for b in message.content if b.type == "tool_use"]
        assert call.name == "get_weather" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, WEATHER["input_schema"])
        with client.messages.stream(messages=[question], **kwargs) as stream:
            events = list(stream)
            final = stream.get_final_message()
        fragments = [
            e.delta.partial_json
            for e in events
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        assert len(fragments) > 1 and json.loads("".join(fragments)) == call.input
        [streamed] = [b for b in final.content if b.type == "tool_use"]
        assert (streamed.name, streamed.input) == (call.name, call.input)
        assert final.stop_reason == "tool_use"
        history = [
            question,
            {"role": "assistant", "content": message.content},  # as the SDK's docs do
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call.id,
                        "content": json.dumps({"city": call.input["city"], "temperature_c": 21}),
                    }
                ],
            },
        ]
        answer = client.messages.create(
            model="smollm2-135m-instruct", max_tokens=60, extra_body=GREEDY, messages=history
        )
        assert answer.content[0].type == "text" and "21" in answer.content[0].text
        # the chat route answers the same calls and result alike
        result = history[2]["content"][0]["content"]
        arguments = json.dumps(call.input)
        chat = openai_chat(
            url,
            [
                question,
                call_turn(call.id, call.name, arguments),
                tool_turn(call.id, result),
            ],
            model="smollm2-135m-instruct",
            max_tokens=60,
        )
        assert answer.content[0].text == chat["choices"][0]["message"]["content"]


# --------------------------------------------------------------------------- thinking


@pytest.fixture(scope="module")
def thinking_url(tmp_path_factory):
    from test_reasoning import build_thinking_model  # a tiny Qwen3 that writes <think>

    folder = tmp_path_factory.mktemp("thinking")
    build_thinking_model(folder)
    args = ("--model", str(folder), "--served-model-name", "tiny", "--kv-cache-memory", "512tok")
    with running_server(*args, "--threads", "1") as url:
        yield url


def test_thinking_blocks(thinking_url):
    """A reasoning model's thinking is a thinking block before the text block, whole and
    streamed (thinking_delta), the chat route's reasoning_content and content."""
    client = anthropic.Anthropic(base_url=thinking_url, api_key="unused", max_retries=0)
    # a prompt whose greedy answer ends its reasoning (the template opened it) early
    for k in range(5, 80):
        chat = [{"role": "user", "content": f"t{k}"}]
        [choice] = openai_chat(thinking_url, chat, max_tokens=24)["choices"]
        if choice["message"]["reasoning_content"] and choice["message"]["content"]:
            break
    else:
        pytest.skip("no short prompt makes the tiny model close its reasoning")
    message = greedy(client, messages=chat, max_tokens=24)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == choice["message"]["reasoning_content"]
    assert message.content[1].text == choice["message"]["content"]
    with client.messages.stream(
        model="tiny", max_tokens=24, messages=chat, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert blocks(final) == blocks(message)
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == sorted(deltas, reverse=True) and "thinking_delta" in deltas  # thinking first
    # the history takes the thinking back (and leaves it out of the prompt)
    history = [*chat, {"role": "assistant", "content": message.content}, *CONVERSATION[-1:]]
    with_thinking = client.messages.count_tokens(model="tiny", messages=history)
    history[1] = {"role": "assistant", "content": message.content[1].text}
    assert client.messages.count_tokens(model="tiny", messages=history) == with_thinking
    # thinking switched off: the template closes the tag in the prompt, so no thinking
    off = greedy(client, messages=chat, max_tokens=24, thinking={"type": "disabled"})
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    [choice] = openai_chat(thinking_url, chat, max_tokens=24, **kwargs)["choices"]
    assert [b.type for b in off.content] == ["text"]
    assert off.content[0].text == choice["message"]["content"]
