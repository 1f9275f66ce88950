"""POST /v1/inspect within bounds, over real HTTP.

A trace could once stall the engine and the event loop for everyone (a 5,800-token
traced prompt: 147 s, another client's completion waited 142 s; a 137 MB body held
/health for 4.4 s) and tell a client which prompts others had sent (its first step's
`kv.written` showed the prefix-cache hit). These tests run the real model behind a real
uvicorn server on 127.0.0.1, in this process so that a test can hold a thread at a
chosen point and check what else is answered meanwhile (order, not time).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.inspect.trace import prompt_map_rows
from tokenmill.server import inspect_routes

CHUNK = 64  # the engine's per-step token budget: a few-hundred-token prompt takes steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(smollm_path: Path) -> Iterator[tuple[str, LLMEngine]]:
    """(base URL, engine) of a real server; prefix caching on, as `tokenmill serve` has it."""
    import uvicorn

    from tokenmill.server.app import create_app
    from tokenmill.server.async_engine import AsyncEngine

    engine = LLMEngine(smollm_path, kv_cache_memory="128MiB", max_num_batched_tokens=CHUNK)
    app = create_app(AsyncEngine(engine), model_name="smol")
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
    try:
        yield url, engine
    finally:
        server.should_exit = True
        thread.join(30)


def _text(tokens: int, engine: LLMEngine, salt: str = "") -> str:
    """A prompt of exactly `tokens` tokens."""
    words = " ".join(f"{salt}item {i} weighs {i * 7 % 100} grams." for i in range(tokens))
    ids = engine.tokenizer.encode(words)[:tokens]
    text = engine.tokenizer.decode(ids)
    assert len(engine.tokenizer.encode(text)) == tokens
    return text


def _until(read: Callable[[], Any], done: Callable[[Any], bool], limit: float = 120) -> Any:
    """Read until done(value) holds (a bounded wait for a state, not a time threshold)."""
    deadline = time.monotonic() + limit
    while not done(value := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


@pytest.mark.slow
def test_a_trace_over_the_size_cap_is_refused_up_front(served) -> None:
    url, engine = served
    prompt = _text(1200, engine)
    # every head of one layer's maps, 512 steps over a 1,200-token context: ~50 MB
    r = httpx.post(
        f"{url}/v1/inspect",
        json={"prompt": prompt, "max_tokens": 512, "layer": 15, "stream": False},
        timeout=120,
    )
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "trace_too_large" and error["param"] == "layer"
    message = error["message"]
    assert "\n" not in message and "more than the 32.0 MiB a trace may" in message, message
    assert "'layers': [] for none" in message  # says what to lower
    # the same, streamed, is refused before any event; all 30 layers' maps name `layers`
    r = httpx.post(
        f"{url}/v1/inspect",
        json={"prompt": prompt, "max_tokens": 64, "layers": list(range(30))},
        timeout=120,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "layers", r.text[:300]
    assert not r.headers["content-type"].startswith("text/event-stream")
    # one head of the same layer fits
    r = httpx.post(
        f"{url}/v1/inspect",
        json={"prompt": prompt[:400], "max_tokens": 2, "layer": 15, "head": 3, "stream": False},
        timeout=300,
    )
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    assert body["trace"]["layers"] == [15] and body["trace"]["heads"] == [3]
    assert all(m["heads"] == [3] for s in body["steps"] for m in s.get("attention", []))


@pytest.mark.slow
def test_health_answers_while_a_big_trace_body_is_made(served, monkeypatch) -> None:
    """Hold the thread that serializes the trace's biggest piece (the last prefill chunk's
    maps: 64 rows x 320 keys x 9 heads, ~1 MB of JSON) right after it did so: /health must
    answer while it is held. (The whole body was once encoded by one json.dumps on the
    event loop, which held /health for as long.)"""
    url, engine = served
    real_dumps = json.dumps
    entered, release = threading.Event(), threading.Event()
    holder: list[str] = []

    def dumps(*args: Any, **kwargs: Any) -> str:
        out = real_dumps(*args, **kwargs)
        if len(out) > 500_000 and not entered.is_set():
            holder.append(threading.current_thread().name)
            entered.set()
            release.wait(120)
        return out

    monkeypatch.setattr(json, "dumps", dumps)
    body = {"prompt": _text(320, engine), "max_tokens": 3, "layer": 15, "stream": False}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{url}/v1/inspect", json=body, timeout=300)
        try:
            assert entered.wait(240), "no piece of the trace was that big"
            health = httpx.get(f"{url}/health", timeout=60)  # while the serializer is held
            assert health.status_code == 200, health.text
        finally:
            release.set()
        answer = pending.result()
    assert answer.status_code == 200, answer.text[:300]
    assert holder[0] != "uvicorn"  # not the event loop's thread
    trace = answer.json()
    assert len(trace["steps"]) == 5 + 2  # 320 tokens in chunks of 64, then 2 decodes
    assert answer.headers["content-length"] == str(len(answer.content))
    # the maps the page draws: the prompt's last rows, then each decode step's
    map_from = 320 - prompt_map_rows(320, engine.config.num_heads)
    assert trace["trace"]["map_from"] == map_from
    rows = [q for s in trace["steps"] for m in s.get("attention", []) for q in m["query_positions"]]
    assert rows == list(range(map_from, 322))


@pytest.mark.slow
def test_a_traced_request_never_reuses_another_requests_cache(served) -> None:
    url, engine = served
    prompt = _text(150, engine, salt="secret ")
    done = httpx.post(
        f"{url}/v1/completions",
        json={"model": "smol", "prompt": prompt, "max_tokens": 1},
        timeout=300,
    )
    assert done.status_code == 200, done.text
    for _ in range(2):  # nor a traced request's own earlier cache
        r = httpx.post(
            f"{url}/v1/inspect",
            json={"prompt": prompt, "max_tokens": 1, "layers": [], "stream": False},
            timeout=300,
        )
        assert r.status_code == 200, r.text[:300]
        steps = r.json()["steps"]
        assert steps[0]["start"] == 0  # nothing came from the cache
        assert sum(s["kv"]["written"] for s in steps) == 150
    # the shared cache still serves untraced requests: its 9 full blocks of the 150 tokens
    hits = engine.blocks.hit_tokens
    again = httpx.post(
        f"{url}/v1/completions",
        json={"model": "smol", "prompt": prompt, "max_tokens": 1},
        timeout=300,
    )
    assert again.status_code == 200
    assert engine.blocks.hit_tokens - hits == 9 * 16


@pytest.mark.slow
def test_a_trace_that_outgrows_the_cap_stops_with_an_error(served, monkeypatch) -> None:
    """The bytes made are counted too: past the cap the trace ends with one error event
    (streamed) or a 400 (not streamed), and its request is aborted."""
    url, engine = served
    monkeypatch.setattr(inspect_routes, "MAX_TRACE_BYTES", 200_000)
    monkeypatch.setattr(inspect_routes, "size_bound", lambda *a, **k: 0)  # let it start
    body = {"prompt": _text(300, engine), "max_tokens": 200, "layer": 15}
    with httpx.stream("POST", f"{url}/v1/inspect", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error", [e["type"] for e in events]
    assert events[-1]["error"]["code"] == "trace_too_large"
    assert "done" not in [e["type"] for e in events]
    steps = [e for e in events if e["type"] == "step"]
    assert steps and all(s["step"]["phase"] == "prefill" for s in steps)  # stopped in prefill
    assert not _until(engine.has_unfinished, lambda busy: not busy)  # the request is gone
    r = httpx.post(f"{url}/v1/inspect", json={**body, "stream": False}, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["code"] == "trace_too_large"
    assert "\n" not in r.json()["error"]["message"]
