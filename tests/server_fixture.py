"""Run a real `tokenmill serve` in a subprocess for the server tests, and read its SSE.

A subprocess, not a thread: the tests then exercise the command line, uvicorn and
the engine thread exactly as a user runs them, and the test process's own threads
(the concurrent clients) do not share a GIL with the engine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 180  # loading the model on a busy 2-core machine can take a while


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start `tokenmill serve` on a free loopback port; yield its base URL (no /v1)."""
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *args]
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=Path(__file__).parent.parent,
            )
        base_url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(proc, base_url, log_path)
            yield base_url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(proc: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()}")


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """The `data:` payloads of an SSE response: parsed JSON, or "[DONE]"."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload if payload == "[DONE]" else json.loads(payload)


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus exposition text."""
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise KeyError(name)
