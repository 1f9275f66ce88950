"""The OpenAI-compatible server, end to end: a real `tokenmill serve`, real clients.

The slow tests start the default model (SmolLM2-135M) in a subprocess and talk to
it with the official `openai` client and with raw httpx (for SSE details, bad
bodies and disconnects). The fast ones run the app in-process on a tiny random
model, for what the real model cannot show: a model without a chat template, and
an engine step that raises.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
from server_fixture import metric, running_server, sse_events

from tokenmill import kernels
from tokenmill.server.app import STATIC_DIR
from tokenmill.server.metrics import Histogram

openai = pytest.importorskip("openai")

KV = ("--kv-cache-memory", "256MiB")
API_KEY = "sk-test-secret"
MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def base_url(smollm_path) -> str:
    with running_server(*KV, "--max-num-seqs", "32", "--max-waiting", "64") as url:
        yield url


@pytest.fixture(scope="module")
def float_url(smollm_path) -> str:
    """Float32 weights: a greedy continuation then does not depend on which other
    requests share its batch. (The packed-weight path switches from the int16 decode
    kernel to a float32 GEMM above PREFILL_MIN_T rows: logits ~0.02 apart, which flips
    an occasional near-tie.)"""
    with running_server(*KV, "--max-num-seqs", "32", "--quantization", "none") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def guarded_url(smollm_path) -> str:
    """A server with an API key (from the environment) that runs one sequence at a
    time and lets one wait, so a third concurrent request is refused."""
    args = (*KV, "--max-num-seqs", "1", "--max-waiting", "1", "--threads", "1")
    with running_server(*args, env={"TOKENMILL_API_KEY": API_KEY}) as url:
        yield url


def _greedy_completion(client, prompt: str, max_tokens: int = 16):
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )


def _stream(base_url: str, path: str, body: dict, headers: dict | None = None) -> list:
    with httpx.stream(
        "POST", f"{base_url}/v1/{path}", json={**body, "stream": True}, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(response))


# --------------------------------------------------------------------------- basics


@pytest.mark.slow
def test_health_models_and_metrics(base_url, client):
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    if (STATIC_DIR / "index.html").is_file():  # the web inspector, mounted behind the API
        page = httpx.get(f"{base_url}/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    text = httpx.get(f"{base_url}/metrics").text
    for name in (
        "tokenmill_requests_running",
        "tokenmill_requests_waiting",
        "tokenmill_kv_blocks_used",
        "tokenmill_kv_blocks_free",
        "tokenmill_kv_blocks_held_by_requests",
        "tokenmill_prefix_cache_hit_rate",
        "tokenmill_prompt_tokens_total",
        "tokenmill_generation_tokens_total",
    ):
        metric(text, name)
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        name = f"tokenmill_{histogram}_seconds"
        assert f"# TYPE {name} histogram" in text
        assert f'{name}_bucket{{le="+Inf"}}' in text
    # which code runs: the server (same machine, same environment) names the kernels' ISA
    [info] = [ln for ln in text.splitlines() if ln.startswith("tokenmill_build_info{")]
    assert f'kernels="{kernels.isa()}"' in info and 'weights="gguf"' in info
    prefill = "integer GEMM" if kernels.gemm_prefill() else "float32 tiles"
    assert f'prefill="{prefill}"' in info
    assert info.endswith("} 1")


@pytest.mark.slow
def test_completion_usage_and_finish_reason(client):
    out = _greedy_completion(client, PROMPT, max_tokens=8)
    assert out.object == "text_completion" and out.model == MODEL
    [choice] = out.choices
    assert choice.finish_reason == "length" and choice.text.strip()
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == 5
    assert out.usage.total_tokens == 13


@pytest.mark.slow
def test_completion_stream_equals_non_stream(base_url, client):
    expected = _greedy_completion(client, PROMPT)
    events = _stream(
        base_url,
        "completions",
        {
            "prompt": PROMPT,
            "max_tokens": 16,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.choices[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == expected.choices[0].finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == expected.usage.model_dump(exclude_none=True)


@pytest.mark.slow
def test_chat_stream_equals_non_stream(client):
    expected = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=16, temperature=0
    )
    [choice] = expected.choices
    assert expected.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and not any(finishes[:-1])
    # the same counts; the second request found the first's full prompt blocks cached
    streamed = chunks[-1].usage
    assert streamed.model_dump(exclude={"prompt_tokens_details"}) == expected.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    assert expected.usage.prompt_tokens_details.cached_tokens == 0
    prompt = expected.usage.prompt_tokens
    assert streamed.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16 > 0


@pytest.mark.slow
def test_n_completions(base_url, client):
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text != out.choices[1].text  # per-completion seeds differ
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 24
    events = _stream(base_url, "chat/completions", {"messages": CHAT, "max_tokens": 8, "n": 2})
    assert events[-1] == "[DONE]"
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in events[:-1]}
    assert sorted(finished) == [0, 1] and all(finished.values())


@pytest.mark.slow
def test_stop_strings(base_url, client):
    full = _greedy_completion(client, PROMPT).choices[0].text  # " Paris. ..."
    stop = full[len(full) // 2 :].split()[0]
    cut = full[: full.index(stop)]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "@@@"]
    )
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    events = _stream(
        base_url,
        "completions",
        {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": stop},
    )
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow
def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed
        )
        return out.choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


@pytest.mark.slow
def test_completion_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    [choice] = out.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert top[token] == logprob == max(top.values())  # greedy: the sampled is the best


@pytest.mark.slow
def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        e for c in stream for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


@pytest.mark.slow
def test_echo(client):
    plain = _greedy_completion(client, PROMPT, max_tokens=6).choices[0].text
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain


@pytest.mark.slow
def test_prompt_forms_logit_bias_and_extensions(client, smollm_path):
    from tokenmill.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm_path)
    expected = _greedy_completion(client, PROMPT, 8).choices[0].text
    by_ids = client.completions.create(
        model=MODEL, prompt=tokenizer.encode(PROMPT), max_tokens=8, temperature=0
    )
    assert by_ids.choices[0].text == expected
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    chat_parts = client.chat.completions.create(
        model=MODEL, messages=parts, max_tokens=6, temperature=0
    )
    assert chat_parts.choices[0].message.content == chat.choices[0].message.content
    first = tokenizer.encode(expected, add_special_tokens=False)[0]
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != expected
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.8,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True},
        user="alice",
    )
    assert out.usage.completion_tokens == 8
    # llama.cpp's sampler names: typical-p, top-n-sigma, XTC, Mirostat v2
    for extra in (
        {"typical_p": 0.9, "top_n_sigma": 1.5},
        {"xtc_probability": 0.5, "xtc_threshold": 0.1},
        {"mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2},
    ):
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=3,
            extra_body={**extra, "ignore_eos": True},
        )  # fmt: skip
        assert out.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="mirostat"):
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"mirostat": 1}
        )
    # DRY by llama.cpp's names: a strong one turns greedy away from the phrase it copies
    echo = "Say it again and again: the cat sat on the mat, the cat sat on the mat, the cat"
    plain = client.completions.create(model=MODEL, prompt=echo, max_tokens=24, temperature=0)
    dry = client.completions.create(
        model=MODEL, prompt=echo, max_tokens=24, temperature=0,
        extra_body={"dry_multiplier": 100.0, "dry_base": 1.75, "dry_allowed_length": 2,
                    "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n"]},
    )  # fmt: skip
    assert "sat on the mat" in plain.choices[0].text
    assert "sat on the mat" not in dry.choices[0].text
    with pytest.raises(openai.BadRequestError, match="dry_sequence_breakers"):
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"dry_sequence_breakers": [""]}
        )


# --------------------------------------------------------------------------- concurrency


def _stream_collect(base_url: str, prompt: str, disconnect_after: int | None) -> dict:
    """Stream one greedy completion; with disconnect_after, close after that many chunks
    a request that would otherwise run for 200 tokens."""
    max_tokens = 16 if disconnect_after is None else 200
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, reason, done, chunks = "", None, False, 0
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for event in sse_events(response):
            if event == "[DONE]":
                done = True
                continue
            chunks += 1
            text += event["choices"][0]["text"]
            reason = event["choices"][0]["finish_reason"] or reason
            if disconnect_after is not None and chunks >= disconnect_after:
                break  # leaving the block closes the connection mid-stream
    return {"text": text, "finish_reason": reason, "done": done}


@pytest.mark.slow
def test_concurrent_streams_with_disconnects(float_url):
    base_url = float_url
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    prompts = [f"Here is fact number {i} about {topic}:" for i, topic in enumerate(
        ["cats", "rivers", "stars", "bread", "music", "rain", "chess", "glass"] * 2
    )]  # fmt: skip
    cut = [3 if i % 4 == 1 else None for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        expected = list(pool.map(lambda p: _greedy_completion(client, p).choices[0].text, prompts))
        generated_before = _generated_tokens(base_url)
        results = list(pool.map(partial(_stream_collect, base_url), prompts, cut))
    for i, (result, want) in enumerate(zip(results, expected, strict=True)):
        if cut[i] is None:
            assert result["done"] and result["finish_reason"] in ("stop", "length"), i
            assert result["text"] == want, (i, result["text"], want)
    _assert_engine_drains(base_url)
    # The 4 disconnected requests were aborted long before their 200 tokens.
    assert _generated_tokens(base_url) - generated_before < 12 * 16 + 4 * 100


def _generated_tokens(base_url: str) -> float:
    return metric(httpx.get(f"{base_url}/metrics").text, "tokenmill_generation_tokens_total")


def _assert_engine_drains(base_url: str, timeout_s: float = 10.0) -> None:
    """Aborts land at the engine's next step: poll briefly for an idle engine."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base_url}/metrics").text
        idle = metric(text, "tokenmill_requests_running") == 0
        if (idle and metric(text, "tokenmill_kv_blocks_held_by_requests") == 0) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert metric(text, "tokenmill_requests_running") == 0
    assert metric(text, "tokenmill_requests_waiting") == 0
    assert metric(text, "tokenmill_kv_blocks_held_by_requests") == 0


# --------------------------------------------------------------------------- errors

# (name, path, body (dict, or str for raw bytes), status, param)
BAD_REQUESTS = [
    ("temperature type", "completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("temperature range", "completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p zero", "completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p zero in float32", "completions", {"prompt": "x", "top_p": 1e-46}, 400, "top_p"),
    ("n zero", "completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("max_tokens zero", "completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens bool", "completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("huge max_tokens", "completions", {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("logprobs range", "completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("logit_bias key", "completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias id", "completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("logit_bias value", "completions", {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("stop type", "completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("penalty range", "completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("seed type", "completions", {"prompt": "x", "seed": "x"}, 400, "seed"),
    ("missing prompt", "completions", {"max_tokens": 4}, 400, "prompt"),
    ("prompt type", "completions", {"prompt": 5}, 400, "prompt"),
    ("prompt too long", "completions", {"prompt": [1] * 6000}, 400, "prompt"),
    ("prompt token id", "completions", {"prompt": [10**7]}, 400, "prompt"),
    ("prompt batch mixed", "completions", {"prompt": ["a", [1]]}, 400, "prompt"),
    ("prompt batch empty item", "completions", {"prompt": ["a", ""]}, 400, "prompt"),
    ("n over 128", "completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("n over the queue", "completions", {"prompt": "x", "n": 100}, 400, "n"),
    ("logit_bias non-ASCII digits", "completions", {"prompt": "x", "logit_bias": {"١٢": 1}}, 400, "logit_bias"),
    ("lone surrogate prompt", "completions", '{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("lone surrogate in batch", "completions", '{"prompt": ["ok", "\\udfff"]}', 400, "prompt"),
    ("lone surrogate stop", "completions", '{"prompt": "x", "stop": "\\ud800"}', 400, "stop"),
    ("lone surrogate model", "completions", '{"prompt": "x", "model": "\\ud800"}', 400, "model"),
    ("lone surrogate chat", "chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
    ("lone surrogate chat part", "chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', 400, "messages"),
    ("lone surrogate inspect", "inspect", '{"prompt": "\\ud800"}', 400, "prompt"),
    ("bad json", "completions", '{"prompt": "x",', 400, None),
    ("body not object", "completions", "[1, 2]", 400, None),
    ("unknown field", "completions", {"prompt": "x", "foo": 1}, 400, "foo"),
    ("suffix", "completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("best_of", "completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("echo logprobs", "completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("stream_options", "completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("unknown model", "completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("empty messages", "chat/completions", {"messages": []}, 400, "messages"),
    ("unknown role", "chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("content type", "chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("message field", "chat/completions", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, 400, "messages"),
    ("tools", "chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("empty tool name", "chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools"),
    ("spaced tool name", "chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools"),
    ("stop list too long", "completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    ("top_logprobs alone", "chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs range", "chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ("huge max_completion_tokens", "chat/completions", {"messages": CHAT, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ("chat unknown model", "chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model"),
    ("no such route", "nothing", {}, 404, None),
]  # fmt: skip


def _assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, body, status, param",
    [case[1:] for case in BAD_REQUESTS],
    ids=[c[0] for c in BAD_REQUESTS],
)
def test_bad_request(base_url, path, body, status, param):
    url = f"{base_url}/v1/{path}"
    if isinstance(body, str):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(url, json=body)
    error = _assert_openai_error(response, status, param)
    if status == 404 and param == "model":
        assert error["code"] == "model_not_found"


@pytest.mark.slow
def test_a_top_k_past_int64_fails_no_one(base_url, client):
    """top_k 2**63 overflowed the sampler's int64 tensor and failed every request in its
    step: now it means "off", beside an ordinary request in the same step."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        huge = pool.submit(
            httpx.post,
            f"{base_url}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 8, "top_k": 2**63, "seed": 1},
            timeout=60,
        )
        plain = pool.submit(_greedy_completion, client, PROMPT, 8)
        assert huge.result().status_code == 200, huge.result().text
        assert plain.result().usage.completion_tokens == 8


@pytest.mark.slow
def test_sampling_params_messages_are_reused(base_url):
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "temperature": -1})
    assert response.json()["error"]["message"] == "temperature must be >= 0.0, got -1.0"


@pytest.mark.slow
def test_still_serves_after_bad_requests(base_url, client):
    headers = {"content-type": "application/json"}
    for _, path, body, *_ in BAD_REQUESTS:
        raw = body if isinstance(body, str) else json.dumps(body)
        assert httpx.post(f"{base_url}/v1/{path}", content=raw, headers=headers).status_code >= 400
    assert _greedy_completion(client, PROMPT, 4).usage.completion_tokens == 4
    _assert_engine_drains(base_url)


@pytest.mark.slow
def test_api_key(guarded_url):
    assert httpx.get(f"{guarded_url}/health").status_code == 200  # stays open
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(f"{guarded_url}/v1/models", headers=headers)
        assert _assert_openai_error(response, 401, None)["code"] == "invalid_api_key"
    response = httpx.post(f"{guarded_url}/v1/completions", json={"prompt": 5})
    assert response.status_code == 401  # the key is checked before the body
    for method, path in (("GET", "nothing"), ("POST", "models/x/y"), ("GET", "completions")):
        response = httpx.request(method, f"{guarded_url}/v1/{path}")  # no route enumeration
        assert _assert_openai_error(response, 401, None)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded_url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{guarded_url}/v1", api_key=API_KEY, max_retries=0)
    out = good.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert out.usage.completion_tokens <= 4


@pytest.mark.slow
def test_full_queue_is_429_at_once(guarded_url):
    """One sequence runs, one waits (--max-waiting 1): the third request is refused."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 24, "ignore_eos": True, "stream": True}
    url = f"{guarded_url}/v1/completions"
    with httpx.Client(headers=headers, timeout=60) as http:
        with http.stream("POST", url, json=body) as running:
            events = sse_events(running)
            next(events)  # the first request has a token: it is running
            with http.stream("POST", url, json=body) as waiting:
                assert waiting.status_code == 200  # admitted: waiting for the batch slot
                refused = http.post(url, json={**body, "stream": False}, timeout=5)
                assert refused.status_code == 429
                assert int(refused.headers["retry-after"]) >= 1
                error = refused.json()["error"]
                assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
                assert list(sse_events(waiting))[-1] == "[DONE]"
            assert list(events)[-1] == "[DONE]"
    _assert_engine_drains(guarded_url)


# --------------------------------------------------------------------------- in-process, tiny model


@pytest.fixture(scope="module")
def tiny_app(tmp_path_factory):
    from helpers import build_hf_model

    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.app import create_app
    from tokenmill.server.async_engine import AsyncEngine

    folder = tmp_path_factory.mktemp("tiny")
    build_hf_model("llama", folder)
    engine = AsyncEngine(LLMEngine(folder, kv_cache_memory="512tok", threads=1))
    return create_app(engine, model_name="tiny")


def test_chat_without_template_is_400(tiny_app):
    from fastapi.testclient import TestClient

    with TestClient(tiny_app) as http:
        response = http.post("/v1/chat/completions", json={"messages": CHAT})
        assert "chat template" in _assert_openai_error(response, 400, "messages")["message"]
        response = http.post("/v1/completions", json={"prompt": "t1 t2", "max_tokens": 3})
        assert response.json()["usage"]["completion_tokens"] == 3


def test_engine_failure_is_500_and_the_loop_survives(tiny_app, monkeypatch):
    from fastapi.testclient import TestClient

    engine = tiny_app.state.engine.engine
    real_step, calls = engine.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_once)
    body = {"prompt": "t1 t2", "max_tokens": 3}
    with TestClient(tiny_app) as http:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 500
        error = response.json()["error"]
        assert "boom" in error["message"] and error["type"] == "server_error"
        assert engine.kv_stats()["blocks_used"] == 0  # the failed request's blocks are freed
        calls.clear()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            events = list(sse_events(stream))
        assert events[-2]["error"]["type"] == "server_error" and events[-1] == "[DONE]"
        assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
        assert http.get("/health").status_code == 200


def test_prompts_are_prepared_off_the_event_loop(tiny_app, monkeypatch):
    """Tokenizing and template rendering run on the prep threads, never on the event loop
    (an attack run's finding): for completions, chat and the inspector alike."""
    import threading

    from fastapi.testclient import TestClient

    engine = tiny_app.state.engine.engine
    threads = []
    for name in ("encode_prompt", "encode_chat"):
        real = getattr(engine, name)

        def recording(*args, _real=real, **kwargs):
            threads.append(threading.current_thread().name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(engine, name, recording)
    with TestClient(tiny_app) as http:
        http.post("/v1/completions", json={"prompt": "t1 t2", "max_tokens": 1})
        http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        http.post("/v1/inspect", json={"prompt": "t1", "max_tokens": 1, "stream": False})
    prepared = [name for name in threads if not name.startswith("tokenmill-engine")]
    assert len(prepared) >= 3 and all(n.startswith("tokenmill-prep") for n in prepared), threads


def test_a_draining_server_answers_503(tiny_app):
    from fastapi.testclient import TestClient

    engine = tiny_app.state.engine
    with TestClient(tiny_app) as http:
        engine.drain()
        try:
            response = http.post("/v1/completions", json={"prompt": "t1", "max_tokens": 1})
        finally:
            engine.draining = False
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "shutting_down"
        assert (
            http.post("/v1/completions", json={"prompt": "t1", "max_tokens": 1}).status_code == 200
        )


def test_histogram_exposition():
    h = Histogram("x_seconds", "help text", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    assert h.render().splitlines() == [
        "# HELP x_seconds help text",
        "# TYPE x_seconds histogram",
        'x_seconds_bucket{le="0.1"} 2',
        'x_seconds_bucket{le="1.0"} 3',
        'x_seconds_bucket{le="+Inf"} 4',
        "x_seconds_sum 3.65",
        "x_seconds_count 4",
    ]
