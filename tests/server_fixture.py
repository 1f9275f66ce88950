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
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 180  # loading the model on a busy 2-core machine can take a while


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT, no /v1
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def server_process(*args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """Start `tokenmill serve` on a free loopback port and wait until /health answers;
    stop it (SIGTERM, then SIGKILL) on exit unless the test already did."""
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
            yield ServerProcess(proc, base_url, log_path)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def running_server(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start `tokenmill serve` on a free loopback port; yield its base URL (no /v1)."""
    with server_process(*args, env=env) as server:
        yield server.base_url


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric_by_label(text: str, name: str) -> dict[str, float]:
    """The samples of a labelled metric, by their single label's value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(f"{name}{{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('"')[1]] = float(value)
    return out


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
