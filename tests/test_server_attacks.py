"""An attack run's cases against a real `tokenmill serve`
(SmolLM2-135M on 127.0.0.1), plus the pure functions behind the fixes.

5   20,000 tool definitions: a 400 naming the cap of 128, checked before validation.
7   a grammar llguidance panics on: a one-line 400, no panic text, backtrace or path.
8   JSON nested ~1,000 deep, sent in a call's arguments or forced into the model's own
    tool call by a regex: a 400, or plain content with a clean end of stream.
14  giant prompts run on their own worker lane: a normal chat is not queued behind them.
17  OPTIONS/TRACE/HEAD answered with the right `Allow`; a Host header naming another
    site (DNS rebinding) is refused on a keyless loopback server.
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_fixture import running_server, sse_events

from tokenmill.server.cli import allowed_hosts_from
from tokenmill.server.limits import host_name
from tokenmill.server.protocol import MAX_MESSAGE_CHARS, clean_message
from tokenmill.server.tool_parser import ToolCallParser, parse_tool_calls
from tokenmill.server.tools import MAX_JSON_DEPTH, json_depth
from tokenmill.tokenizer.chat import HERMES, LLAMA3, MISTRAL

openai = pytest.importorskip("openai")

# Bodies up to 4 MiB: the panic needs a 1.7 MB grammar. The prompt bound (bytes per token
# times the context) does not depend on it.
ARGS = ("--kv-cache-memory", "128MiB", "--max-num-seqs", "8", "--max-body-bytes", "4MiB")
DEEP = "[" * 1100 + "]" * 1100  # deeper than json's decoder recurses on Python's stack
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def _tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def _assert_clean(text: str) -> None:
    """No native panic, backtrace, traceback or source path in a response body."""
    for leak in ("panic", "backtrace", "Traceback", ".rs:", ".py", ".c:", "/tmp/", "/root/"):
        assert leak not in text, text


# --------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize(
    "fmt, text",
    [
        (HERMES, f'<tool_call>\n{{"name": "f", "arguments": {DEEP}}}\n</tool_call>'),
        (LLAMA3, f'{{"name": "f", "parameters": {DEEP}}}'),
        (MISTRAL, f'[TOOL_CALLS][{{"name": "f", "arguments": {DEEP}}}]'),
        (MISTRAL, f"[TOOL_CALLS]f[ARGS]{DEEP}"),
    ],
)
def test_calls_nested_too_deep_are_content(fmt, text):
    """Arguments deeper than json's decoder goes raised RecursionError out of the parser
    (a 500 whole, a cut stream streamed); they are no call, so the text is content."""
    assert parse_tool_calls(fmt, text) == (text, [])
    parser = ToolCallParser(fmt)
    for i in range(0, len(text), 50):  # streamed: no exception, whatever the pieces
        parser.feed(text[i : i + 50])
    parser.finish()
    assert parser.broken


def test_json_depth_counts_without_recursion():
    deep: object = 0
    for _ in range(100_000):  # far past Python's stack
        deep = [deep]
    assert json_depth(deep, MAX_JSON_DEPTH) == MAX_JSON_DEPTH + 1
    assert json_depth({"a": [1, {"b": []}]}, MAX_JSON_DEPTH) == 4
    assert json_depth("text", MAX_JSON_DEPTH) == 0


def test_error_messages_are_cleaned():
    panic = (
        "invalid json_schema: panic: assertion failed: grammar.symbols.len() < u16::MAX\n"
        "<backtrace>\n  16: type_call\n     at /tmp/python-build/Objects/typeobject.c:1091:11"
    )
    assert clean_message(panic) == "invalid json_schema: an internal error in a native library"
    traceback = 'boom\nTraceback (most recent call last):\n  File "/x/app.py", line 3'
    assert clean_message(traceback) == "boom"
    assert clean_message("at /home/u/.cargo/src/lib.rs:12:5 failed") == "at <source> failed"
    assert clean_message("rank 1 at 127.0.0.1:29500 died", internal=True) == (
        "rank 1 at <address> died"
    )
    assert clean_message("two\nlines") == "two lines"
    assert len(clean_message("x" * 10_000)) == MAX_MESSAGE_CHARS
    quoted = "The model 'panic' does not exist; this server serves 'm'"
    assert clean_message(quoted) == quoted  # a client's own word is no panic


def test_prep_threads_yield_to_the_engine():
    """The soak's probe chat waited 19.9 s (quiet: 1.15 s) while attackers' schemas
    compiled on prep threads at the engine's priority; they now run niced."""
    import os

    from tokenmill.server.running import PREP_NICE, lower_priority

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = nice()
    with ThreadPoolExecutor(1, initializer=lower_priority) as pool:
        assert pool.submit(nice).result() == min(19, mine + PREP_NICE)
    assert nice() == mine  # the calling (engine's) thread keeps its priority


def test_allowed_hosts_default():
    def hosts(host: str, key: str | None = None, flag: tuple[str, ...] | None = None):
        args = argparse.Namespace(host=host, allowed_hosts=flag)
        return allowed_hosts_from(args, key)

    assert set(hosts("127.0.0.1")) == {"localhost", "127.0.0.1", "::1"}
    assert "192.168.1.5" in hosts("192.168.1.5")
    assert hosts("127.0.0.1", key="k") is None  # a key guards it
    assert hosts("0.0.0.0") is None  # reachable by any name anyway
    assert hosts("127.0.0.1", flag=("a.example",)) == ("a.example",)
    assert hosts("127.0.0.1", key="k", flag=("*",)) is None
    assert host_name("LocalHost.:8000") == "localhost"
    assert host_name("[::1]:8000") == "::1"
    assert host_name("::1") == "::1"


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def url(smollm_path) -> str:
    with running_server(*ARGS) as base_url:
        yield base_url


@pytest.mark.slow
@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "array"}, {"enum": [1, 2]}])
def test_a_tool_whose_arguments_are_not_an_object_is_400_in_every_api(url, schema):
    """A string schema with a forced call let the model write {"name": "f", "arguments":
    "f"}: chat dropped the call and ran to max_tokens, /v1/messages streamed partial_json
    "123" that the anthropic SDK cannot parse, /v1/responses ended incomplete. OpenAI and
    Anthropic both require an object schema."""
    expected = (
        f"tools[0].function.parameters must be a JSON Schema of type 'object', not "
        f"{schema.get('type', 'untyped')!r}: a call's arguments are an object"
    )
    chat = {"messages": HI, "tools": [_tool("f", schema)], "tool_choice": "required"}
    error = _error(httpx.post(f"{url}{CHAT}", json={**chat, "max_tokens": 8}), 400)
    assert (error["message"], error["param"]) == (expected, "tools")
    anthropic = {
        "model": "smollm2-135m-instruct",
        "max_tokens": 8,
        "messages": HI,
        "tools": [{"name": "f", "input_schema": schema}],
        "tool_choice": {"type": "any"},
    }
    assert _error(httpx.post(f"{url}/v1/messages", json=anthropic), 400)["message"] == expected
    responses = {
        "input": "hi",
        "max_output_tokens": 16,
        "tools": [{"type": "function", "name": "f", "parameters": schema}],
        "tool_choice": "required",
    }
    assert _error(httpx.post(f"{url}/v1/responses", json=responses), 400)["message"] == expected
    fine = {"type": "object", "properties": {"x": {"type": "string"}}}
    for parameters in (fine, {}, None):
        ok = httpx.post(
            f"{url}{CHAT}",
            json={"messages": HI, "tools": [_tool("f", parameters)], "max_tokens": 1},
        )
        assert ok.status_code == 200, ok.text


@pytest.mark.slow
def test_too_many_tools_is_400_before_validation(url):
    """Item 5: 20,000 definitions were validated, then checked for duplicates with
    names.count (O(n^2), 4.7 s on the event loop)."""
    tools = [_tool(f"f{i}") for i in range(20_000)]
    error = _error(httpx.post(f"{url}{CHAT}", json={"messages": HI, "tools": tools}), 400)
    assert error["param"] == "tools"
    assert error["message"] == "'tools' has 20000 items; at most 128 are allowed"
    duplicated = [_tool(f"f{i}") for i in range(127)] + [_tool("f5")]
    error = _error(httpx.post(f"{url}{CHAT}", json={"messages": HI, "tools": duplicated}), 400)
    assert error["message"] == "tools defines the function 'f5' twice"


@pytest.mark.slow
def test_a_grammar_engine_panic_is_one_clean_line(url):
    """Item 7: 70,000 rules pass llguidance's 65,535 grammar symbols; its panic (assertion,
    backtrace, build paths) was the 400's message."""
    rules = 70_000
    grammar = "start: " + "|".join(f"r{i}" for i in range(rules)) + "\n"
    grammar += "\n".join(f'r{i}: "b"' for i in range(rules))
    response = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "x", "max_tokens": 1, "guided_grammar": grammar},
        timeout=300,
    )
    error = _error(response, 400)
    _assert_clean(response.text)
    assert error["param"] == "guided_grammar"
    assert error["message"] == (
        "grammar is too large to compile: it needs more than the grammar engine's 65,535 "
        "symbols; make it smaller"
    )


@pytest.mark.slow
def test_twenty_thousand_choices_and_a_grammar_that_fails_mid_way(url):
    """20,000 guided_choice entries sharing a first token failed inside llguidance at the
    first token ("max is 2000") and came back as a 200 with a truncated text. Now a
    choice is one regex lexeme and completes; a Lark grammar of 2,500 alternatives still
    trips that limit, and the request fails alone with a one-line 400 (whole) or an error
    event and [DONE] (streamed), while another request in the same steps completes."""
    choices = [f"option {i} word{i * 7}" for i in range(20_000)]
    body = {"prompt": "Pick one:", "max_tokens": 20, "temperature": 0, "guided_choice": choices}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] in choices and choice["finish_reason"] == "stop"

    grammar = "start: " + " | ".join(f'"option {i}"' for i in range(2_500))
    bad = {"prompt": "Pick one:", "max_tokens": 8, "guided_grammar": grammar}
    plain = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}

    def streamed() -> list:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**bad, "stream": True}, timeout=300
        ) as r:
            assert r.status_code == 200
            return list(sse_events(r))

    with ThreadPoolExecutor(3) as pool:
        whole = pool.submit(httpx.post, f"{url}/v1/completions", json=bad, timeout=300)
        events = pool.submit(streamed)
        other = pool.submit(httpx.post, f"{url}/v1/completions", json=plain, timeout=300)
        whole, events, other = whole.result(), events.result(), other.result()
    error = _error(whole, 400)
    _assert_clean(whole.text)
    assert error["param"] == "guided_grammar"
    assert error["message"].startswith("the grammar constraint failed after 0 tokens: ")
    assert "max is 2000" in error["message"] and "\n" not in error["message"]
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == error["message"]
    assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 24


@pytest.mark.slow
def test_deep_json_in_a_request_is_400(url):
    """Item 8: nested arguments or parameters made the template's preparation recurse
    past Python's stack: a 500 with a RecursionError traceback in the log."""
    history = [
        *HI,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": "[" * 990 + "]" * 990},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    response = httpx.post(f"{url}{CHAT}", json={"messages": history, "max_tokens": 1})
    assert _error(response, 400)["message"] == (
        f"messages[1].tool_calls[0].function.arguments nests more than {MAX_JSON_DEPTH} levels"
    )
    parameters: dict = {"type": "object"}
    for _ in range(600):
        parameters = {"type": "array", "items": parameters}
    parameters = {"type": "object", "properties": {"x": parameters}}
    body = {"messages": HI, "tools": [_tool("f", parameters)], "max_tokens": 1}
    response = httpx.post(f"{url}{CHAT}", json=body)
    assert _error(response, 400)["message"] == (
        f"tools[0].function.parameters nests more than {MAX_JSON_DEPTH} levels"
    )
    _assert_clean(response.text)


@pytest.mark.slow
def test_a_forced_deep_tool_call_ends_cleanly(url):
    """Item 8: a regex makes the model write a call whose arguments nest 1,050 deep. The
    parser raised RecursionError: a 500 whole, a stream cut with no error and no [DONE].
    Now the text is content, whole and streamed (both at once: one batch)."""
    depth = 1050
    brackets = f"\\[{{{depth}}}\\]{{{depth}}}"  # \[{1050}\]{1050}
    regex = '<tool_call>\\n\\{"name": "f", "arguments": ' + brackets + "\\}\\n</tool_call>"
    body = {
        "messages": [{"role": "user", "content": "Call f."}],
        "tools": [_tool("f")],
        "guided_regex": regex,
        "max_tokens": 2 * depth + 100,
        "temperature": 0,
    }

    def whole() -> dict:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        fields = {k: v for k, v in body.items() if k != "guided_regex"}
        return client.chat.completions.create(
            model="smollm2-135m-instruct",
            **fields,
            extra_body={"guided_regex": regex},
            timeout=900,
        ).model_dump()

    def streamed() -> list:
        with httpx.stream("POST", f"{url}{CHAT}", json={**body, "stream": True}, timeout=900) as r:
            assert r.status_code == 200
            return list(sse_events(r))

    with ThreadPoolExecutor(2) as pool:
        whole_future, stream_future = pool.submit(whole), pool.submit(streamed)
        response, events = whole_future.result(), stream_future.result()
    choice = response["choices"][0]
    assert choice["finish_reason"] == "stop" and not choice["message"]["tool_calls"]
    assert choice["message"]["content"].count("[") == depth
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert not any("error" in e for e in chunks)
    # the stream ends as streams do; the call it had announced keeps the arguments it
    # sent before they nested too deep, and the rest of the text is content
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "tool_calls")
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    assert content.endswith("</tool_call>")


@pytest.mark.slow
def test_messages_too_long_are_refused_before_rendering(url, max_model_len):
    """Item 14: a chat's text alone proves it cannot fit; it was swept for special
    tokens and rendered by the template before the rendered prompt was measured."""
    content = "x " * 450_000
    response = httpx.post(
        f"{url}{CHAT}", json={"messages": [{"role": "user", "content": content}]}, timeout=120
    )
    error = _error(response, 400)
    assert error["param"] == "messages"
    assert error["message"].startswith(f"messages hold {len(content)} bytes of text")


@pytest.mark.slow
def test_giant_prompts_do_not_queue_ahead_of_a_small_chat(url, max_model_len, smollm_path):
    """Item 14: twelve prompts just under the size refused unread are each tokenized
    (then refused: too many tokens). They share one pool with everyone else, so a chat
    sent while they are queued waited for most of them (13.7 s instead of 0.12 s in
    the attack run). Now they have their own lane, and the chat is answered while most
    of them are still queued (an order, not a time: the machine may be slow)."""
    from tokenmill.tokenizer import Tokenizer

    size = Tokenizer.from_gguf(smollm_path).max_bytes_per_token * max_model_len - 1000
    prompt = ("ab " * size)[:size]
    count = 12
    finished: list[float] = []
    lock = threading.Lock()

    def big(_: int) -> int:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt}, timeout=600)
        with lock:
            finished.append(time.monotonic())
        return response.status_code

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(big, i) for i in range(count)]
        # all twelve arrived, and one was tokenized: the rest are queued by now
        while not finished:
            time.sleep(0.05)
        chat = httpx.post(f"{url}{CHAT}", json={"messages": HI, "max_tokens": 1}, timeout=600)
        chat_done = time.monotonic()
        statuses = [f.result() for f in futures]
    assert chat.status_code == 200, chat.text
    assert statuses == [400] * count  # tokenized, then too long for the context
    after = sum(t > chat_done for t in finished)
    # shared pool (4 threads): 1 done, 4 running, 7 queued ahead of the chat; at most 3
    # finished after it. Own lane (1 thread): at most 2 finished before it.
    assert after >= count - 4, (after, count)


@pytest.mark.slow
def test_methods_get_the_right_allow_header(url):
    """Item 17: OPTIONS and TRACE on a POST route fell through to the static files (405,
    `Allow: GET, HEAD`), HEAD on a GET route was a 404."""
    for method in ("OPTIONS", "TRACE", "GET", "HEAD", "PUT"):
        response = httpx.request(method, f"{url}/v1/completions")
        assert response.headers["allow"] == "POST, OPTIONS", (method, response.headers)
        assert response.status_code == (204 if method == "OPTIONS" else 405), method
    for path in ("/v1/models", "/health", "/metrics", "/"):
        head = httpx.head(f"{url}{path}")
        assert head.status_code == 200 and head.content == b"", path
        options = httpx.options(f"{url}{path}")
        if path != "/":  # the static files answer for themselves
            assert options.status_code == 204, path
            assert options.headers["allow"] == "GET, HEAD, OPTIONS", path
    error = _error(httpx.post(f"{url}/health"), 405)
    assert error["code"] == "method_not_allowed"
    assert _error(httpx.options(f"{url}/v1/nothing"), 404)["code"] == "not_found"
    # /tokenize and /detokenize (outside /v1) fell through to the static files too: OPTIONS
    # 405 with "Allow: GET, HEAD", GET and HEAD 404
    for path in ("/tokenize", "/detokenize"):
        for method in ("OPTIONS", "GET", "HEAD", "PUT"):
            response = httpx.request(method, f"{url}{path}")
            assert response.status_code == (204 if method == "OPTIONS" else 405), (path, method)
            assert response.headers["allow"] == "POST, OPTIONS", (path, method)
        assert httpx.post(f"{url}{path}", json={"tokens": [1]}).status_code != 405


@pytest.mark.slow
def test_a_foreign_host_header_is_refused(url):
    """Item 17: a keyless loopback server answered `Host: attacker.example`, so a page
    there could read it through DNS rebinding. Loopback names keep working, the web
    page included."""
    port = url.rsplit(":", 1)[1]
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.2"):
        for path in ("/v1/models", "/", "/health"):
            response = httpx.get(f"{url}{path}", headers={"Host": host})
            error = _error(response, 400)
            assert error["code"] == "invalid_host", (host, path)
            assert f"'{host.split(':')[0]}'" in error["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(f"{url}/v1/models", headers={"Host": host}).status_code == 200
        page = httpx.get(f"{url}/", headers={"Host": host})
        assert page.status_code == 200 and "<html" in page.text
