"""Every finish reason, from the one rule to the wire.

`finish_reason` (tokenmill/sampling/stop.py) decides why a request ends and `FinishReason`
names it. Each case below ends a request one way, and checks the enum value the engine
reports and the string a client reads:

    reason       engine (a tiny random model)        server (`tokenmill serve`, for real)
    stop         EOS, a stop token id, a stop        the same, whole and streamed
                 string, a completed grammar
    length       max_tokens, the model's context,    max_tokens, the model's context
                 a prompt the pool cannot hold
    tool_calls   - (the server's: it parses calls)   forced calls on SmolLM2 (slow)
    abort        LLMEngine.abort                     a client that leaves mid-stream: nothing
                                                     is sent; the server counts a 499
    error        a request whose sampling raises     the same (in-process): a 500, no reason
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from server_fixture import metric, metric_by_label, running_server, server_process, sse_events

from tokenmill.engine.llm_engine import LLMEngine, RequestOutput
from tokenmill.llm import LLM
from tokenmill.sampling import FinishReason, SamplingParams, finish_reason, is_stop_token

EOS = 319  # build_hf_model's vocabulary is t0..t319, and its last word is EOS
WORD = 9  # an ordinary token, "t9", that a logit bias makes the greedy choice
FORCE = {WORD: 100.0}
PROMPT = [5, 6, 7]  # "t5 t6 t7"


# --------------------------------------------------------------------------- the rule


def test_the_enum_is_the_wire():
    """One member per reason a client or a caller can see, valued as OpenAI spells it:
    a reason added here must be walked through the cases below too."""
    assert {r.name: r.value for r in FinishReason} == {
        "STOP": "stop",
        "LENGTH": "length",
        "TOOL_CALLS": "tool_calls",
        "ABORT": "abort",
        "ERROR": "error",
    }
    for reason in FinishReason:
        assert reason == reason.value and f"{reason}" == str(reason) == reason.value
        assert json.dumps({"finish_reason": reason}) == json.dumps({"finish_reason": reason.value})
    # tool calls replace a stop only: a call cut short by max_tokens stays "length"
    assert FinishReason.STOP.with_tool_calls() is FinishReason.TOOL_CALLS
    assert FinishReason.LENGTH.with_tool_calls() is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("token", "params", "facts", "reason"),
    [
        (5, SamplingParams(max_tokens=4), {}, None),
        (EOS, SamplingParams(max_tokens=4), {}, FinishReason.STOP),
        (EOS, SamplingParams(max_tokens=4, ignore_eos=True), {}, None),
        (WORD, SamplingParams(max_tokens=4, stop_token_ids=[WORD]), {}, FinishReason.STOP),
        (5, SamplingParams(max_tokens=4), {"stop_string": True}, FinishReason.STOP),
        (5, SamplingParams(max_tokens=4), {"grammar_complete": True}, FinishReason.STOP),
        (5, SamplingParams(max_tokens=1), {}, FinishReason.LENGTH),
        (
            5,
            SamplingParams(max_tokens=4),
            {"num_tokens": 9, "max_model_len": 9},
            FinishReason.LENGTH,
        ),
        (5, SamplingParams(max_tokens=4), {"num_tokens": 8, "max_model_len": 9}, None),
        # a stop of any kind beats a length cut on the same token
        (EOS, SamplingParams(max_tokens=1), {}, FinishReason.STOP),
        (5, SamplingParams(max_tokens=1), {"stop_string": True}, FinishReason.STOP),
        (5, SamplingParams(max_tokens=1), {"grammar_complete": True}, FinishReason.STOP),
    ],
)
def test_the_rule(token, params, facts, reason):
    got = finish_reason(token, params, {EOS}, 1, **facts)
    assert got == reason and (got is None or isinstance(got, FinishReason))


# --------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(tiny_llama, kv_cache_memory="512tok", threads=1)


def _run(engine: LLMEngine, prompt, params: SamplingParams) -> tuple[str, list[int], RequestOutput]:
    """One request to its end: (text, token ids, the last output)."""
    request_id = f"r{time.monotonic_ns()}"
    engine.add_request(request_id, prompt, params)
    text, ids, last = "", [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                text, ids, last = text + out.text, ids + out.token_ids, out
    assert last is not None and last.finished
    assert engine.blocks.num_free == engine.blocks.num_blocks  # the request let go
    return text, ids, last


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 8, **kwargs})


def _assert_reason(out: RequestOutput, reason: FinishReason) -> None:
    assert out.finish_reason is reason and out.finish_reason == reason.value


def test_engine_eos(engine):
    text, ids, out = _run(engine, PROMPT, _greedy(logit_bias={EOS: 100.0}))
    _assert_reason(out, FinishReason.STOP)
    assert (text, ids) == ("", [EOS])  # EOS's own text is never shown


def test_engine_stop_token_id(engine):
    text, ids, out = _run(engine, PROMPT, _greedy(logit_bias=FORCE, stop_token_ids=[WORD]))
    _assert_reason(out, FinishReason.STOP)
    assert (text, ids) == ("", [WORD])


def test_engine_stop_string(engine):
    text, ids, out = _run(engine, PROMPT, _greedy(logit_bias=FORCE, stop=["t9 t9"]))
    _assert_reason(out, FinishReason.STOP)
    assert (text, ids) == (" ", [WORD, WORD])  # the text before the stop string


def test_engine_grammar_complete(engine, caplog):
    """The output the grammar wants is complete: the request ends without an EOS."""
    text, ids, out = _run(engine, PROMPT, _greedy(regex="t9"))
    _assert_reason(out, FinishReason.STOP)
    assert (text, ids) == (" t9", [WORD])
    assert "grammar matcher failed" not in caplog.text  # it ended complete, not refused


def test_engine_max_tokens(engine):
    text, ids, out = _run(engine, PROMPT, _greedy(max_tokens=3, ignore_eos=True))
    _assert_reason(out, FinishReason.LENGTH)
    assert len(ids) == 3


def test_engine_max_model_len(engine):
    """max_tokens far off; the model's context ends it."""
    prompt = [5] * (engine.max_model_len - 3)
    _, ids, out = _run(engine, prompt, _greedy(max_tokens=100, ignore_eos=True))
    _assert_reason(out, FinishReason.LENGTH)
    assert len(ids) == 3 and out.num_prompt_tokens + out.num_output_tokens == engine.max_model_len


def test_engine_prompt_the_pool_cannot_hold(engine, monkeypatch):
    """The scheduler places nothing and nothing runs: the head request is refused."""
    monkeypatch.setattr(engine.blocks, "can_grow", lambda *args: False)
    engine.add_request("too big", PROMPT, _greedy())
    [out] = engine.step()
    assert out.request_id == "too big" and out.finished and out.token_ids == []
    _assert_reason(out, FinishReason.LENGTH)
    assert not engine.has_unfinished()


def test_engine_abort(engine):
    engine.add_request("left", PROMPT, _greedy(max_tokens=50, ignore_eos=True))
    engine.step()
    seq = engine.requests["left"].seq
    assert engine.abort("left") and not engine.has_unfinished()
    assert seq.finish_reason is FinishReason.ABORT and seq.finish_reason == "abort"
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_engine_error(engine):
    engine.add_request("bad", PROMPT, _greedy())
    state = engine.requests["bad"].seq.sampling  # a logit_bias id past the vocabulary
    state.bias_ids, state.bias_values = torch.tensor([10**6]), torch.tensor([1.0])
    [out] = engine.step()
    _assert_reason(out, FinishReason.ERROR)
    assert out.finished and out.error and "this request failed" in out.error


def test_the_trace_asks_the_same_rule(engine):
    """The view a trace gets answers "is this a stop token" with the engine's own rule."""
    view = engine.view()
    for token, params in [
        (EOS, SamplingParams()),
        (EOS, SamplingParams(ignore_eos=True)),
        (WORD, SamplingParams(stop_token_ids=[WORD])),
        (WORD, SamplingParams()),
    ]:
        expected = is_stop_token(token, params, engine.eos_token_ids)
        assert view.is_stop_token(token, params) is expected
        assert expected is (finish_reason(token, params, engine.eos_token_ids, 0) is not None)


def test_llm_outputs_carry_the_enum(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory="512tok", threads=1)
    [out] = llm.generate(PROMPT, _greedy(max_tokens=2, ignore_eos=True))
    assert out.finish_reason is FinishReason.LENGTH
    [out] = llm.generate(PROMPT, _greedy(logit_bias={EOS: 100.0}))
    assert out.finish_reason is FinishReason.STOP


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tiny_llama):
    # a chat template, for a chat's default max_tokens: the rest of the context
    (tiny_llama / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }} {% endfor %}"
    )
    args = ("--model", str(tiny_llama), "--kv-cache-memory", "256tok", "--threads", "1")
    with server_process(*args) as proc:
        yield proc


def _both(url: str, body: dict) -> tuple[dict, dict]:
    """A completion asked for whole and streamed: (the whole answer's choice and usage,
    the stream's joined text and last finish_reason). Both give one reason."""
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    text, reason = "", None
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        [choice] = event["choices"]
        text += choice["text"]
        assert reason is None  # a reason comes once, in the last chunk
        reason = choice["finish_reason"]
    [choice] = answer["choices"]
    assert (text, reason) == (choice["text"], choice["finish_reason"])
    return choice, answer["usage"]


SERVER_CASES = {
    # case: (request fields, finish_reason, completion tokens, text)
    "eos": ({"logit_bias": {str(EOS): 100}}, "stop", 1, ""),
    "stop token id": ({"logit_bias": {str(WORD): 100}, "stop_token_ids": [WORD]}, "stop", 1, ""),
    "stop string": ({"logit_bias": {str(WORD): 100}, "stop": ["t9 t9"]}, "stop", 2, " "),
    "grammar complete": ({"guided_regex": "t9"}, "stop", 1, " t9"),
    "max_tokens": ({"logit_bias": {str(WORD): 100}, "max_tokens": 3}, "length", 3, " t9 t9 t9"),
}


@pytest.mark.parametrize("case", list(SERVER_CASES))
def test_server(server, case):
    extra, wire, completion_tokens, text = SERVER_CASES[case]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    choice, usage = _both(server.base_url, body)
    assert choice["finish_reason"] == wire == FinishReason(wire).value
    assert (usage["completion_tokens"], choice["text"]) == (completion_tokens, text)


def test_server_max_model_len(server):
    """No max_tokens on a chat: the answer runs to the end of the context. (A completion's
    max_tokens defaults to 16, and prompt + max_tokens past the context is a 400.)"""
    url = server.base_url
    context = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    words = " ".join(["t5"] * (context - 4))
    body = {"messages": [{"role": "user", "content": words}], "temperature": 0}
    body["ignore_eos"] = True
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    [choice], usage = whole.json()["choices"], whole.json()["usage"]
    assert choice["finish_reason"] == FinishReason.LENGTH == "length"
    assert usage["total_tokens"] == context and usage["completion_tokens"] > 0
    stream = {**body, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=stream, timeout=60) as response:
        events = [e for e in sse_events(response) if e != "[DONE]"]
    reasons = [e["choices"][0]["finish_reason"] for e in events]
    assert [r for r in reasons if r is not None] == ["length"] == reasons[-1:]


def test_server_abort(server):
    """A client that leaves mid-stream is aborted: no reason reaches it (it is gone); the
    server logs the abort, counts a 499, and holds nothing of the request."""
    url = server.base_url

    def aborted() -> tuple[float, float]:
        """(499s counted, /v1 requests in flight); the stream is counted as it leaves."""
        text = httpx.get(f"{url}/metrics").text
        by_code = metric_by_label(text, "tokenmill_http_requests_total")
        return by_code.get("499", 0), metric(text, "tokenmill_http_requests_in_flight")

    # The tiny model writes its 240 tokens in a few hundred ms; on a loaded machine the
    # whole stream can be sent before the cut reaches the server, which then counts a 200.
    # So cut again until one cut lands mid-stream (under a full suite's load five tries
    # once all ran to the end).
    body = {"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}
    for _ in range(20):
        before, _ = aborted()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            first = next(sse_events(response))  # one chunk, then leave
        assert first["choices"][0]["finish_reason"] is None
        deadline = time.monotonic() + 10
        while (now := aborted())[1] > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert now[1] == 0, "the cut stream is still being answered after 10 s"
        if now[0] == before + 1:
            break
    else:
        pytest.fail("twenty streams cut after their first chunk all ran to the end")
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, "tokenmill_requests_running") == 0
    assert metric(text, "tokenmill_kv_blocks_held_by_requests") == 0
    assert "client disconnected mid-stream; aborted" in server.log()


def test_server_error(tiny_llama, monkeypatch):
    """A request whose sampling raises gets an error, never a finish_reason "error"."""
    from fastapi.testclient import TestClient

    from tokenmill.server.app import create_app
    from tokenmill.server.async_engine import AsyncEngine

    engine = LLMEngine(tiny_llama, kv_cache_memory="512tok", threads=1)

    def raising(*args, **kwargs):
        raise RuntimeError("poisoned")

    monkeypatch.setattr(engine, "sampler", raising)
    body = {"prompt": PROMPT, "max_tokens": 3}
    with TestClient(create_app(AsyncEngine(engine), model_name="tiny")) as http:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 500, response.text
        assert "this request failed while sampling" in response.json()["error"]["message"]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            events = list(sse_events(stream))
    assert "choices" not in events[-2] and "poisoned" in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]"


# --------------------------------------------------------------------------- tool calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.slow
def test_server_tool_calls(smollm_path):
    """Calls the model was made to write end in "tool_calls", whole and streamed."""
    body = {
        "messages": [{"role": "user", "content": "What is the weather like in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
    }
    with running_server("--kv-cache-memory", "64MiB") as url:
        chat = f"{url}/v1/chat/completions"
        whole = httpx.post(chat, json=body, timeout=120).json()
        [choice] = whole["choices"]
        assert choice["finish_reason"] == FinishReason.TOOL_CALLS == "tool_calls"
        assert choice["message"]["tool_calls"]
        with httpx.stream("POST", chat, json={**body, "stream": True}, timeout=120) as response:
            events = [e for e in sse_events(response) if e != "[DONE]"]
        reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert [r for r in reasons if r is not None] == ["tool_calls"] and reasons[-1]
