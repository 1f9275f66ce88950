"""/health tells the truth: 503 with one line naming the problem when
the engine loop has had pending work and finished no step for --health-stall-timeout
seconds, or when a parallel rank died or has not finished its part of the step in
flight; 200 while idle, however long. A rank that stops answering fails its requests
with one clean line (no gloo text, source path or port)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

import tokenmill.distributed.build  # noqa: F401  (LLMEngine's parallel builder)
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling import SamplingParams
from tokenmill.server.async_engine import AsyncEngine

T = TypeVar("T")


def _until(read: Callable[[], T], done: Callable[[T], bool], limit: float = 120) -> T:
    """Read until done(value) holds (a bounded wait for a state, not a time threshold)."""
    deadline = time.monotonic() + limit
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


class _Hold:
    """Step hooks (engine/hooks.py) whose step begin holds the engine thread until
    released: a step that does not finish, the way a stuck kernel or collective does."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def on_step_begin(self, seq, num_tokens: int, proposal=()) -> None:
        self.entered.set()
        self.release.wait(300)

    def on_embedding(self, *args) -> None:
        pass

    def on_attention(self, *args) -> None:
        pass

    def on_residual(self, *args) -> None:
        pass

    def on_sample(self, *args) -> None:
        pass

    def on_step_end(self, *args) -> None:
        pass


def test_a_stalled_engine_loop_is_unhealthy_and_an_idle_one_is_not(smollm_path):
    stall = 0.5
    server = AsyncEngine(
        LLMEngine(smollm_path, kv_cache_memory="8MiB", threads=1), stall_timeout=stall
    )
    prompt = server.engine.encode_prompt("The capital of France is")
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    hold = _Hold()

    async def main() -> None:
        server.start()
        try:
            await asyncio.sleep(2 * stall)  # idle past the stall timeout: still healthy
            assert server.health() == (True, "ok")
            stream = await server.generate("held", [prompt], params, trace=hold)
            assert await asyncio.to_thread(hold.entered.wait, 60)
            ok, reason = await asyncio.to_thread(_until, server.health, lambda h: not h[0])
            assert not ok and "made no progress on pending work for" in reason, reason
            hold.release.set()
            (generation,) = await stream.collect()
            assert len(generation.token_ids) == 3
            assert server.health() == (True, "ok")
            await asyncio.sleep(2 * stall)
            assert server.health() == (True, "ok")
        finally:
            hold.release.set()
            server.stop()

    asyncio.run(main())
    assert server.health() == (False, "the engine loop is not running")


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_health_and_fails_requests_cleanly(smollm_path, monkeypatch):
    """Rank 1 stopped (SIGSTOP): /health answers 503 naming it once a step has waited
    for it past the stall timeout; continued, the request completes and /health is 200
    again. Stopped until the collectives time out: the client's error is one line naming
    the rank, /health stays 503 with it, and close() ends the stopped worker."""
    from fastapi.testclient import TestClient

    from tokenmill.server.app import create_app

    monkeypatch.setenv("TOKENMILL_DIST_TIMEOUT", "30")  # workers inherit it
    engine = LLMEngine(smollm_path, kv_cache_memory="64MiB", tensor_parallel_size=2)
    app = create_app(AsyncEngine(engine, stall_timeout=1.0), model_name="smol")
    worker = engine.parallel.workers[0].proc.pid
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    try:
        with TestClient(app) as http, ThreadPoolExecutor(1) as pool:
            assert http.get("/health").status_code == 200
            os.kill(worker, signal.SIGSTOP)
            try:
                pending = pool.submit(http.post, "/v1/completions", json=body)
                health = _until(lambda: http.get("/health"), lambda r: r.status_code == 503)
                reason = health.json()["error"]["message"]
                assert "tensor-parallel rank 1 has not finished its part of step" in reason
            finally:
                os.kill(worker, signal.SIGCONT)
            answer = pending.result(timeout=120)
            assert answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["text"]
            assert http.get("/health").status_code == 200

            os.kill(worker, signal.SIGSTOP)
            answer = http.post("/v1/completions", json=body)  # fails after the 30 s timeout
            assert answer.status_code == 500
            message = answer.json()["error"]["message"]
            assert "tensor-parallel rank 1 did not answer for 30 s" in message, message
            assert "\n" not in message and "gloo" not in message.lower()
            assert not re.search(r"\.cc|/|\d+\.\d+\.\d+\.\d+", message), message
            health = http.get("/health")
            assert health.status_code == 503
            assert "rank 1 did not answer" in health.json()["error"]["message"]
    finally:
        engine.close()
    assert _gone(worker)
