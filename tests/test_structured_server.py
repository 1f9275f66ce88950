"""Structured output and tool calls over HTTP, end to end.

The slow tests run a real `tokenmill serve` on the default model (SmolLM2-135M, whose
chat template knows nothing of tools, so it gets the Hermes instructions) and talk to it
with the official `openai` client: answers that validate against their JSON Schemas,
json_object, regex and choice; a tool-call round trip, whole and streamed; greedy
neighbours whose tokens do not change. The fast ones run the app in-process on a tiny
random model, for the 400s that must come before any work is queued.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from api_helpers import call_turn, closed_object, tool_turn, weather_tool
from server_fixture import running_server

from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.tokenizer.chat import encode_tool_chat

openai = pytest.importorskip("openai")

KV = ("--kv-cache-memory", "256MiB")
MODEL = "smollm2-135m-instruct"

SCHEMAS = {
    "nested": closed_object(
        {
            "name": {"type": "string", "maxLength": 20},
            "address": closed_object(
                {
                    "city": {"type": "string", "maxLength": 20},
                    "country": {"type": "string", "maxLength": 20},
                }
            ),
        }
    ),
    "array of enums": closed_object(
        {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", "yellow"]},
                "minItems": 1,
                "maxItems": 4,
            }
        }
    ),
    "bounded numbers": closed_object(
        {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "height_m": {"type": "number", "minimum": 1.2, "maximum": 2.2},
            "member": {"type": "boolean"},
        }
    ),
    "array of objects": {
        "type": "array",
        "items": closed_object(
            {
                "item": {"type": "string", "maxLength": 16},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            }
        ),
        "minItems": 1,
        "maxItems": 3,
    },
}
QUESTIONS = {
    "nested": "Where does Marie Curie come from? Answer in JSON.",
    "array of enums": "Which colors does the French flag have? Answer in JSON.",
    "bounded numbers": "Describe a basketball player in JSON.",
    "array of objects": "Write a shopping list in JSON.",
}

WEATHER = weather_tool("Get the current weather in a city", city_max_length=30)
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# --------------------------------------------------------------------------- real server


@pytest.fixture(scope="module")
def url(smollm_path) -> str:
    with running_server(*KV) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _ask(client, question: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        temperature=kwargs.pop("temperature", 0),
        max_tokens=kwargs.pop("max_tokens", 80),
        **kwargs,
    )


@pytest.mark.slow
def test_json_schema_answers_validate(client):
    def ask(name: str):
        schema_format = {"name": name.replace(" ", "_"), "schema": SCHEMAS[name], "strict": True}
        return _ask(
            client,
            QUESTIONS[name],
            response_format={"type": "json_schema", "json_schema": schema_format},
        )

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # batched together, like real traffic
        answers = dict(zip(SCHEMAS, pool.map(ask, SCHEMAS), strict=True))
    for name, response in answers.items():
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


@pytest.mark.slow
def test_json_object_regex_and_choice(client):
    answer = _ask(
        client,
        "Return a JSON object with the name and age of a person.",
        response_format={"type": "json_object"},
    )
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    phone = _ask(client, "Give me a phone number.", extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", phone.choices[0].message.content)
    yes_no = _ask(
        client, "Is Paris in France?", extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert yes_no.choices[0].message.content in ("yes", "no")
    completion = client.completions.create(
        model=MODEL,
        prompt="The best pet is the",
        max_tokens=5,
        extra_body={"guided_choice": [" cat", " dog"]},
    )
    assert completion.choices[0].text in (" cat", " dog")


@pytest.mark.slow
def test_constrained_stream_equals_whole_and_n_choices_all_validate(client):
    schema = SCHEMAS["array of enums"]
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}}
    whole = _ask(client, QUESTIONS["array of enums"], response_format=fmt)
    chunks = _ask(client, QUESTIONS["array of enums"], response_format=fmt, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    many = _ask(
        client, QUESTIONS["array of enums"], response_format=fmt, n=3, temperature=1.0, seed=5
    )
    assert len(many.choices) == 3
    for choice in many.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.slow
def test_bad_schema_is_400_and_the_server_keeps_serving(url, client):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "if": {}, "then": {}}},
        },
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format" and "if, then" in error["message"]
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        _ask(client, "hi", extra_body={"guided_regex": "(unclosed"})
    assert _ask(client, "Is water wet?", extra_body={"guided_choice": ["yes", "no"]}).choices


@pytest.mark.slow
def test_schemas_and_grammars_too_deep_are_400s_not_a_crash(url, client):
    """1,000 $defs chained through $ref, or 3,000 chained rules, segfaulted the server
    inside llguidance: now each is one client's 400, and the server serves on."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(1000)
    }
    defs["d1000"] = {"type": "string"}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"
    rules = "\n".join(["start: r0"] + [f'r{i}: "x" r{i + 1}' for i in range(3000)] + ['r3000: "y"'])
    with pytest.raises(openai.BadRequestError, match="rules deep"):
        _ask(client, "hi", extra_body={"guided_grammar": rules})
    assert _ask(client, "Is water wet?", extra_body={"guided_choice": ["yes", "no"]}).choices


@pytest.mark.slow
def test_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    messages.append(choice.message)  # the client's own object, sent back as it is
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'})
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40
    )
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    message = second.choices[0].message
    assert message.content or message.tool_calls
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=40
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def _reassemble(chunks) -> tuple[list[dict], str | None]:
    """Tool calls rebuilt from `delta.tool_calls` fragments, as OpenAI's clients do."""
    calls: dict[int, dict] = {}
    reason = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        assert not choice.delta.content  # a forced call: no text around it
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            if part.id:
                assert call["id"] is None  # the id and name come once, first
                call["id"], call["name"] = part.id, part.function.name
            call["arguments"] += part.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.slow
def test_tool_calls_stream_as_fragments(client):
    messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=named, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice=named,
            temperature=0,
            stream=True,
        )
    )
    calls, reason = _reassemble(chunks)
    assert reason == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_time" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMA_OF["get_time"])
    fragments = sum(len(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices)
    assert fragments > 2  # the arguments arrived in pieces, as they were written
    expected = whole.choices[0].message.tool_calls[0].function
    assert (calls[0]["name"], calls[0]["arguments"]) == (expected.name, expected.arguments)
    # the streamed call goes back as history like any other
    messages.append(call_turn(calls[0]["id"], "get_time", calls[0]["arguments"]))
    messages.append(tool_turn(calls[0]["id"], "09:30"))
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=20, stream=True
    )
    assert [c for c in answer if c.choices and c.choices[0].finish_reason]


@pytest.fixture(scope="module")
def float_url(smollm_path) -> str:
    # float32 weights: greedy tokens do not depend on the batch around them (test_server)
    with running_server(*KV, "--quantization", "none") as base:
        yield base


@pytest.mark.slow
def test_greedy_tokens_unchanged_beside_constrained_requests(float_url):
    client = openai.OpenAI(base_url=f"{float_url}/v1", api_key="unused", max_retries=0)
    prompts = ["The capital of France is", "Once upon a time"]

    def plain(prompt: str) -> list[str]:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0
        )
        return out.choices[0].logprobs.tokens

    def constrained(i: int) -> str:
        kinds = [
            {"guided_json": SCHEMAS["array of enums"]},
            {"guided_regex": r"[A-Z][a-z]{2,8}"},
            {"guided_choice": ["yes", "no"]},
            {"guided_json": SCHEMAS["bounded numbers"]},
        ]
        out = client.completions.create(
            model=MODEL, prompt="Answer:", max_tokens=30, temperature=0.7, extra_body=kinds[i]
        )
        return out.choices[0].text

    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        neighbours = [pool.submit(constrained, i) for i in range(4)]
        together = list(pool.map(plain, prompts))
        [n.result() for n in neighbours]
    assert together == alone


# --------------------------------------------------------------------------- in-process, tiny model

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = [{"role": "user", "content": "t1 t2"}]

BAD = [
    ("unsupported keyword", "chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "nope"}}}}, "response_format", "Unknown format: nope"),
    ("schema missing", "chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ("response_format type", "chat/completions", {"response_format": {"type": "xml"}}, "response_format", None),
    ("schema name missing", "chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
    ("two constraints", "chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "cannot be combined"),
    ("structured_outputs two", "completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("bad regex", "completions", {"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
    ("bad grammar", "completions", {"guided_grammar": "start: nope"}, "guided_grammar", "unknown name"),
    ("empty choice", "completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("guided_json text", "completions", {"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ("with ignore_eos", "completions", {"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "with guided_regex"),
    ("tool_choice without tools", "chat/completions", {"tool_choice": "required"}, "tool_choice", "requires tools"),
    ("unknown function", "chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ("tool schema", "chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}], "tool_choice": "required"}, "tools", "not"),
    ("tools and response_format", "chat/completions", {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ("tool message without id", "chat/completions", {"messages": [*CHAT, {"role": "tool", "content": "x"}]}, "messages", "tool_call_id is required"),
    ("assistant without content", "chat/completions", {"messages": [*CHAT, {"role": "assistant"}]}, "messages", "content is required"),
    ("calls from a user", "chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages", "only allowed in assistant"),
    ("functions", "chat/completions", {"functions": [{"name": "f"}]}, "functions", "not supported"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_http(tiny_llama):
    from fastapi.testclient import TestClient

    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.app import create_app
    from tokenmill.server.async_engine import AsyncEngine

    engine = LLMEngine(tiny_llama, kv_cache_memory="512tok", threads=1)
    engine.tokenizer.chat_template = CHATML
    app = create_app(AsyncEngine(engine), model_name="tiny")
    with TestClient(app) as http:
        yield http


@pytest.mark.parametrize(
    "path, extra, param, words", [case[1:] for case in BAD], ids=[case[0] for case in BAD]
)
def test_bad_constraints_are_400_before_anything_is_queued(tiny_http, path, extra, param, words):
    engine = tiny_http.app.state.engine.engine
    before = engine.stats["prompt_tokens"]
    body = {"prompt": "t1 t2"} if path == "completions" else {"messages": CHAT}
    response = tiny_http.post(f"/v1/{path}", json={**body, "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert "\n" not in error["message"]
    if words:
        assert words in error["message"], error
    assert engine.stats["prompt_tokens"] == before  # nothing reached the engine
    ok = tiny_http.post("/v1/completions", json={"prompt": "t1 t2", "max_tokens": 2})
    assert ok.status_code == 200  # and the server goes on serving


def test_tools_reach_the_prompt_and_auto_answers_parse(tiny_http):
    body = {
        "messages": [
            *CHAT,
            call_turn("call_1", "get_weather", '{"city": "Oslo"}'),
            tool_turn("call_1", "sunny"),
        ],
        "tools": [WEATHER],
        "max_tokens": 3,
    }
    response = tiny_http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and "tool_calls" not in message  # t-words: no call
    engine = tiny_http.app.state.engine.engine
    request = ChatCompletionRequest.model_validate(body)
    text = encode_tool_chat(
        engine.tokenizer.apply_chat_template,
        [m.as_template_input() for m in request.messages],
        request.tool_request(engine.tokenizer),
        CHATML,
    )
    assert text.startswith("<|im_start|>system\n# Tools")  # the Hermes instructions
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
