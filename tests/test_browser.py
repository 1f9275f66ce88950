"""The web inspector in a real browser: headless Chromium against `tokenmill serve`.

Sends a prompt, checks that the answer streams in token by token, clicks a
generated token to see its alternatives with probabilities, and saves a
screenshot to test-artifacts/inspector.png for people to look at.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# Installed before the prompt is sent: logs how many answer tokens exist each time the
# answer bubble changes, and whether the run had finished by then.
WATCH_STREAM = """() => {
  window.streamLog = [];
  new MutationObserver(() => {
    const bubble = document.querySelector('.bubble.assistant');
    if (!bubble) return;
    const done = document.getElementById('phase').classList.contains('done');
    window.streamLog.push([bubble.querySelectorAll('.tok').length, done]);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true});
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the server at {url} did not become healthy in {timeout:.0f} s")


@pytest.fixture(scope="module")
def server(smollm_path: Path) -> Iterator[str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli",
        "serve",
        "--model",
        str(smollm_path),
        "--port",
        str(port),
        "--kv-cache-memory",
        "128MiB",
        "--log-level",
        "warning",
    ]
    # no key from the environment (an empty $TOKENMILL_API_KEY is an error since issue 11)
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


def test_inspector_streams_and_explains_a_token(browser, server: str) -> None:
    page = browser.new_page(viewport={"width": 1600, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + "/")
    assert "tokenmill" in page.title()

    page.fill("#max_tokens", "16")
    page.evaluate(WATCH_STREAM)
    page.fill("#prompt", "What is the capital of France?")
    page.click("#send")

    page.wait_for_selector("#phase.done", timeout=180_000)
    log = page.evaluate("window.streamLog")
    counts_while_running = sorted({n for n, done in log if not done and n > 0})
    assert len(counts_while_running) >= 3, f"tokens did not stream in one by one: {log}"
    tokens = page.locator(".bubble.assistant .tok")
    assert tokens.count() >= 3
    assert page.locator(".bubble.assistant").inner_text().strip()

    tokens.nth(1).click()
    alternatives = page.locator("#alternatives .cand")
    alternatives.first.wait_for(timeout=10_000)
    assert alternatives.count() >= 2
    assert "chose" in page.locator("#choice-title").inner_text()
    assert "%" in alternatives.first.inner_text()
    widths = [
        alternatives.nth(i).locator(".final").evaluate("e => e.getBoundingClientRect().width")
        for i in range(alternatives.count())
    ]
    assert max(widths) > 10, "the probability bars are not drawn"
    lit = page.evaluate(
        """() => {
          const c = document.getElementById('heatmap');
          const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let n = 0;
          for (let i = 0; i < d.length; i += 4) if (d[i] + d[i + 1] + d[i + 2] > 200) n++;
          return n;
        }"""
    )
    assert lit > 100, "the attention heatmap is empty"
    assert page.locator("#kv-blocks .slot.prompt").count() > 0

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "inspector.png"), full_page=True)
    assert not errors, errors


def test_inspector_shows_the_grammar_mask(browser, server: str) -> None:
    page = browser.new_page(viewport={"width": 1600, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + "/")
    page.select_option("#constraint", "choice")
    page.fill("#constraint_value", "yes\nno")
    page.fill("#prompt", "Is the sky blue?")
    page.click("#send")
    page.wait_for_selector("#phase.done", timeout=180_000)
    answer = "".join(page.locator(".bubble.assistant .tok").all_inner_texts())
    assert answer in ("yes", "no")

    page.locator(".bubble.assistant .tok").first.click()
    note = page.locator("#grammar-note")
    note.wait_for(timeout=10_000)
    # the first token of "yes"/"no": only their prefixes are allowed (y, ye, yes, n, no)
    assert re.search(
        r"choice grammar: [1-9] of 49,152 vocabulary entries allowed", note.inner_text()
    )
    masked = page.locator("#alternatives .cand.masked")
    assert masked.count() >= 1, "the model's top candidates should include masked ones"
    assert "masked" in masked.first.inner_text()
    assert page.locator(".funnel .stage-row.grammar").count() == 1

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "inspector-grammar.png"), full_page=True)
    assert not errors, errors
