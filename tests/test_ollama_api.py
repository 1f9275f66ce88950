"""Ollama's API (server/ollama_routes.py) through the real `ollama` Python client against a
real `tokenmill serve`.

On a tiny random model (fast): chat and generate, streamed and whole, answer what the
OpenAI routes answer for the same prompt (greedy); options map onto the sampler
(num_predict, stop, seed); `format` constrains the output to a schema; a history of
tool calls and results makes the prompt the OpenAI chat route makes of them; generate's
`context` continues an answer; list, show, ps, version and embed answer in Ollama's
shapes; bad input is the client's ResponseError with the status and a message naming
the problem. On SmolLM2 (slow): the model calls an offered tool, whole and streamed.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest
from server_fixture import server_process

TEMPLATE = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
CONVERSATION = [
    {"role": "system", "content": "t3 t4"},
    {"role": "user", "content": "t5 t6 t7"},
    {"role": "assistant", "content": "t8 t9"},
    {"role": "user", "content": "t10 t11"},
]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def url(tiny_llama):
    (tiny_llama / "chat_template.jinja").write_text(TEMPLATE)
    args = ("--model", str(tiny_llama), "--kv-cache-memory", "512tok", "--threads", "1")
    with server_process(*args, "--served-model-name", "tiny") as server:
        yield server.base_url


@pytest.fixture(scope="module")
def client(url) -> ollama.Client:
    return ollama.Client(host=url, timeout=120)


def openai_chat(url: str, messages: list[dict], **fields) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_whole_and_streamed(client, url):
    expected = openai_chat(url, CONVERSATION)
    answer = client.chat(model="tiny", messages=CONVERSATION, options=GREEDY, stream=False)
    assert answer.message.role == "assistant"
    assert answer.message.content == expected["choices"][0]["message"]["content"]
    assert answer.done and answer.done_reason == "length"
    assert answer.prompt_eval_count == expected["usage"]["prompt_tokens"]
    assert answer.eval_count == 8
    assert answer.total_duration >= answer.eval_duration > 0
    parts = list(client.chat(model="tiny", messages=CONVERSATION, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == answer.message.content
    assert parts[-1].eval_count == 8 and parts[-1].done_reason == "length"


def test_generate_templated_raw_and_context(client, url):
    # a prompt is one user turn of the template, as the chat route renders it
    expected = openai_chat(url, [{"role": "user", "content": "t5 t6 t7"}])
    answer = client.generate(model="tiny", prompt="t5 t6 t7", options=GREEDY)
    assert answer.response == expected["choices"][0]["message"]["content"]
    streamed = list(client.generate(model="tiny", prompt="t5 t6 t7", options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == answer.response
    assert streamed[-1].context == answer.context
    # raw: the prompt as it is, as /v1/completions takes it
    raw = client.generate(model="tiny", prompt="t5 t6 t7", raw=True, options=GREEDY)
    body = {"model": "tiny", "prompt": "t5 t6 t7", "temperature": 0, "max_tokens": 8}
    completion = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert raw.response == completion["choices"][0]["text"]
    # context: the last answer's prompt and output ids, continued by the next prompt
    assert len(raw.context) == completion["usage"]["total_tokens"]
    more = client.generate(model="tiny", prompt="t9", raw=True, context=raw.context, options=GREEDY)
    assert more.prompt_eval_count == len(raw.context) + 1
    assert more.context[: len(raw.context)] == raw.context
    # an empty prompt only loads the model
    loaded = client.generate(model="tiny", prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_options_map_onto_the_sampler(client):
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "num_predict": 12, "seed": 7}
    one = client.chat(model="tiny", messages=CONVERSATION, options=base)
    two = client.chat(model="tiny", messages=CONVERSATION, options=base)
    other = client.chat(model="tiny", messages=CONVERSATION, options={**base, "seed": 8})
    assert one.message.content == two.message.content != other.message.content
    assert one.eval_count == 12
    # a stop string ends the answer before it
    words = client.chat(model="tiny", messages=CONVERSATION, options=GREEDY).message.content
    stop = words.split()[2]
    cut = client.chat(model="tiny", messages=CONVERSATION, options={**GREEDY, "stop": [stop]})
    assert cut.done_reason == "stop" and stop not in cut.message.content
    # llama.cpp's samplers by their names, and load options that change nothing
    extra = {"typical_p": 0.9, "mirostat": 2, "dry_multiplier": 0.8, "num_ctx": 4096}
    assert client.chat(model="tiny", messages=CONVERSATION, options={**base, **extra}).done


def test_tool_history_renders_as_the_chat_route(client, url):
    history = [
        {"role": "user", "content": "t5 t6"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "t7"}}}]},
        {"role": "tool", "content": "t8 t9", "tool_name": "get_weather"},
    ]  # fmt: skip
    openai_history = [
        history[0],
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "t7"}'}}]},
        {"role": "tool", "content": "t8 t9", "tool_call_id": "call_0", "name": "get_weather"},
    ]  # fmt: skip
    expected = openai_chat(url, openai_history)
    answer = client.chat(model="tiny", messages=history, options=GREEDY)
    assert answer.prompt_eval_count == expected["usage"]["prompt_tokens"]
    assert answer.message.content == expected["choices"][0]["message"]["content"]


def test_models_listed_shown_and_embedded(client, url):
    [listed] = client.list().models
    assert listed.model == "tiny" and listed.size > 0 and len(listed.digest) == 64
    assert listed.details.format == "safetensors" and listed.details.family == "llama"
    shown = client.show("tiny")
    assert shown.template == TEMPLATE and "completion" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 512
    [running] = client.ps().models
    assert running.model == "tiny" and running.context_length == 512 and running.size > 0
    assert httpx.get(f"{url}/api/version").json()["version"]
    vectors = client.embed(model="tiny", input=["t5 t6", "t7"]).embeddings
    body = {"model": "tiny", "input": ["t5 t6", "t7"]}
    theirs = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60).json()["data"]
    for ours, other in zip(vectors, theirs, strict=True):
        norm = sum(x * x for x in other["embedding"]) ** 0.5
        assert ours == pytest.approx([x / norm for x in other["embedding"]], rel=1e-5, abs=1e-6)
        assert sum(x * x for x in ours) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "call, status, words",
    [
        (lambda c: c.chat(model="nope", messages=CONVERSATION), 404, "nope"),
        (lambda c: c.chat(model="tiny", messages=CONVERSATION, options={"bogus": 1}), 400, "bogus"),
        (
            lambda c: c.chat(model="tiny", messages=CONVERSATION, options={"repeat_last_n": 64}),
            400,
            "repeat_last_n",
        ),
        (
            lambda c: c.chat(model="tiny", messages=CONVERSATION, options={"temperature": -1}),
            400,
            "options.temperature",
        ),
        (lambda c: c.chat(model="tiny", messages=[]), 400, "messages"),
        (lambda c: c.generate(model="tiny", prompt="t5", images=[b"\x89PNG"]), 400, "images"),
        (lambda c: c.generate(model="tiny", prompt="t5", suffix="t6"), 400, "suffix"),
    ],
)
def test_bad_input_is_a_clear_error(client, call, status, words):
    with pytest.raises(ollama.ResponseError) as e:
        call(client)
    assert e.value.status_code == status
    assert words in e.value.error


@pytest.mark.slow
def test_format_constrains_the_output(smollm):
    client, name = smollm
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    options = {"temperature": 0, "num_predict": 60}
    answer = client.chat(model=name, messages=CONVERSATION, format=schema, options=options)
    jsonschema.validate(json.loads(answer.message.content), schema)
    answer = client.generate(model=name, prompt="t5", format="json", options=options)
    assert isinstance(json.loads(answer.response), dict)


@pytest.fixture(scope="module")
def smollm(smollm_path):
    """(client, model name) of a server of the real default model."""
    args = ("--model", str(smollm_path), "--kv-cache-memory", "2048tok")
    with server_process(*args) as server:
        client = ollama.Client(host=server.base_url, timeout=120)
        [name] = [m.model for m in client.list().models]
        yield client, name


@pytest.mark.slow
def test_tool_call_round_trip(smollm):
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    # the 135M model calls a tool only when shown the call (it answers questions itself)
    say = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    question = [{"role": "user", "content": f"Reply with exactly this and nothing else: {say}"}]
    client, name = smollm
    options = {"temperature": 0, "num_predict": 60}
    answer = client.chat(model=name, messages=question, tools=[weather], options=options)
    [call] = answer.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == {"city": "Paris"} and not answer.message.content
    streamed = list(
        client.chat(model=name, messages=question, tools=[weather], options=options, stream=True)
    )
    calls = [c for p in streamed for c in (p.message.tool_calls or [])]
    assert [c.function.model_dump() for c in calls] == [call.function.model_dump()]
    # the result goes back as a tool message, and the model answers from it
    history = [
        *question,
        answer.message.model_dump(exclude_none=True),
        {"role": "tool", "content": '{"temperature": 18}', "tool_name": "get_weather"},
    ]
    final = client.chat(model=name, messages=history, tools=[weather], options=options)
    assert final.done and (final.message.content or final.message.tool_calls)
