"""One chat preparation for every caller: LLM.chat_prompt, the server's
chat route and /v1/inspect all prepare a conversation with tokenizer/chat.py's
encode_chat, so a history with tool calls and results gives the same prompt ids on each,
on templates that know nothing of tools (the calls and results are written out as text;
a template that refuses "tool" turns gets the results as a user turn). The template
variables (the reasoning switches) reach the template."""

from __future__ import annotations

import pytest
from api_helpers import call_turn, tool_turn

from tokenmill.llm import LLM
from tokenmill.tokenizer.chat import encode_chat

# Both render no tools. Shaped like Gemma's: user and model turns only, alternating.
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "t3 {{ m['role'] }} {{ m['content'] }} t4 {% endfor %}"
    "{% if add_generation_prompt %}t3 assistant{% endif %}"
)
# ChatML-like: any role; an assistant turn of calls only has empty content.
ANY_ROLE = (
    "{% for m in messages %}t3 {{ m['role'] }} {{ m['content'] }} t4 {% endfor %}"
    "{% if add_generation_prompt %}t3 assistant{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY = [
    {"role": "user", "content": "t5 t6 t7"},
    call_turn("call_1", "get_weather", '{"city": "t8"}', content=""),
    tool_turn("call_1", "t9 t10"),
]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory="512tok", threads=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def app(tiny_llama):
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.app import create_app
    from tokenmill.server.async_engine import AsyncEngine

    return create_app(
        AsyncEngine(LLMEngine(tiny_llama, kv_cache_memory="512tok", threads=1)), model_name="tiny"
    )


def _served_prompts(app, monkeypatch, bodies: list[tuple[str, dict]]) -> list[list[int]]:
    """The prompt ids each (route, body) hands the engine."""
    from fastapi.testclient import TestClient

    engine = app.state.engine.engine
    prompts: list[list[int]] = []
    real = engine.add_request

    def recording(request_id, prompt, *args, **kwargs):
        prompts.append(list(prompt))
        return real(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording)
    with TestClient(app) as http:
        for route, body in bodies:
            response = http.post(route, json={**body, "max_tokens": 1, "stream": False})
            assert response.status_code == 200, response.text
    return prompts


@pytest.mark.parametrize("template", [ALTERNATING, ANY_ROLE], ids=["alternating", "any-role"])
def test_every_caller_prepares_a_tool_history_alike(llm, app, monkeypatch, template):
    monkeypatch.setattr(llm.tokenizer, "chat_template", template)
    monkeypatch.setattr(app.state.engine.engine.tokenizer, "chat_template", template)
    expected = llm.chat_prompt(HISTORY)
    served = _served_prompts(
        app,
        monkeypatch,
        [
            ("/v1/chat/completions", {"messages": HISTORY}),
            # tools in the request, none shown to the model: the same prompt
            (
                "/v1/chat/completions",
                {"messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"},
            ),
            ("/v1/inspect", {"messages": HISTORY}),
        ],
    )
    assert served == [expected] * 3
    # the call is written out as text (more than an empty turn) and the result is there
    bare = [{k: v for k, v in m.items() if k in ("role", "content")} for m in HISTORY]
    bare[2]["role"] = "user"  # a turn both templates take
    plain = llm.tokenizer.encode_chat(bare)
    assert len(expected) > len(plain) and [9, 10] == [t for t in expected if t in (9, 10)]


def test_tool_results_become_a_user_turn_where_tool_turns_are_refused(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", ALTERNATING)
    text = llm.tokenizer.decode(llm.chat_prompt(HISTORY))
    # words outside the tiny vocabulary read back as t0: "user" and "<tool_response>" too
    assert text.endswith("t3 t0 t0 t9 t10 t0 t4 t3 t0")
    with pytest.raises(ValueError, match="alternate"):  # a refusal for another reason stays
        llm.chat_prompt([*HISTORY, {"role": "user", "content": "t11"}])


def test_template_vars_reach_the_template(llm, monkeypatch):
    monkeypatch.setattr(
        llm.tokenizer,
        "chat_template",
        "{% if enable_thinking is defined and not enable_thinking %}t11 {% endif %}"
        "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    )
    hi = [{"role": "user", "content": "t5"}]
    assert llm.chat_prompt(hi) == [5]
    assert llm.chat_prompt(hi, template_vars={"enable_thinking": False}) == [11, 5]
    assert llm.chat_prompt(hi, template_vars={"enable_thinking": True}) == [5]
    tokenizer = llm.tokenizer
    assert encode_chat(tokenizer, hi, template_vars={"enable_thinking": False}) == [11, 5]
    for reserved in ("messages", "tools", "raise_exception"):
        with pytest.raises(ValueError, match=f"cannot set '{reserved}'"):
            llm.chat_prompt(hi, template_vars={reserved: None})
