"""The web inspector in a real browser: headless Chromium against `tokenmill serve`.

Sends a prompt, checks that the answer streams in token by token, clicks a
generated token to see its alternatives with probabilities, and saves a
screenshot to test-artifacts/inspector.png for people to look at. Then the page's
finish: the model's name and an explanation in every panel before the first message,
"New chat" putting all of that back, plurals, bars wide enough for their labels, WCAG AA
contrast on the highlight styles (computed from the rendered elements' styles), a
resizable constraint box and the dark theme on every input. And its layout at 1,400 and 900
px (a header that stays in readable lines, diagram labels inside their boxes, a glyph for
every character), cards that reset when a new answer starts, a mark on an answer cut at
max_tokens, the untraced speed beside the traced one, and the speculation card only on a
server that speculates.
"""

from __future__ import annotations

import json
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
    # no key from the environment (an empty $TOKENMILL_API_KEY is an error)
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


def open_inspector(browser, server: str):
    """A new page on the inspector at server. Returns (page, the list its script errors
    are collected in)."""
    page = browser.new_page(viewport={"width": 1600, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + "/")
    return page, errors


def shown_model(page, server: str) -> str:
    """The served model's name, once the page shows it."""
    model = served_model(server)
    page.wait_for_function(
        "m => document.getElementById('model-name').innerText.includes(m)", arg=model
    )
    return model


def test_inspector_streams_and_explains_a_token(browser, server: str) -> None:
    page, errors = open_inspector(browser, server)
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
    page, errors = open_inspector(browser, server)
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
    # struck through, and still easy to read: AA contrast on the text and its label
    assert "line-through" in masked.first.locator(".text").evaluate(
        "e => getComputedStyle(e).textDecorationLine"
    )
    assert assert_readable(page, ".cand.masked .text, .cand.masked .masked-label") >= 2
    assert_readable(page, ".grammar-note, .funnel .bar span")

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "inspector-grammar.png"), full_page=True)
    assert not errors, errors


# ---------------------------------------------------------------------------- the page's finish

# WCAG 2 contrast of one rendered element's text: its colour (`fill` for SVG text) against
# what is painted under it, from computed styles. Walks the element's ancestors from the root
# down, compositing each one's background-color (and each stop of a gradient: the worst one
# counts), each one's opacity as a group, and, for SVG text, the fill of the shapes drawn
# before it under its centre (a stage box's rect). Colours are premultiplied [r, g, b, a].
CONTRAST = """(el) => {
  const parse = (text) => {
    const m = /^rgba?\\(([^)]*)\\)$/.exec(text.trim());
    if (!m) throw new Error(`unparsed colour ${text}`);
    const [r, g, b, a = 1] = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number);
    return [r * a, g * a, b * a, a];
  };
  const over = (top, bottom) => top.map((t, i) => t + bottom[i] * (1 - top[3]));
  const scale = (c, k) => c.map((v) => v * k);
  const CLEAR = [0, 0, 0, 0];
  const svgPaint = (node) => {
    const s = getComputedStyle(node);
    if (s.fill === 'none') return CLEAR;
    return scale(parse(s.fill), Number(s.fillOpacity) * Number(s.opacity));
  };
  const backgrounds = (node) => {
    const s = getComputedStyle(node);
    const color = parse(s.backgroundColor);
    const stops = (s.backgroundImage.match(/rgba?\\([^)]*\\)/g) || []).map(parse);
    return stops.length ? stops.map((stop) => over(stop, color)) : [color];
  };
  const chain = [];
  for (let n = el; n; n = n.parentElement) chain.unshift(n);
  const levels = chain.map((n) => ({
    alternatives: n instanceof SVGElement && !(n instanceof SVGSVGElement) ? [CLEAR] : backgrounds(n),
    opacity: Number(getComputedStyle(n).opacity),
  }));
  const style = getComputedStyle(el);
  let fg = parse(style.color);
  if (el instanceof SVGElement) {
    fg = scale(parse(style.fill), Number(style.fillOpacity));
    const box = el.getBoundingClientRect();
    const [x, y] = [box.x + box.width / 2, box.y + box.height / 2];
    const svg = el.ownerSVGElement;
    const shapes = [...svg.querySelectorAll('rect, circle, ellipse, path')].filter((shape) => {
      const r = shape.getBoundingClientRect();
      const before = shape.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING;
      return before && x >= r.left && x <= r.right && y >= r.top && y <= r.bottom &&
        !shape.closest('marker, defs') && getComputedStyle(shape).fill !== 'none';
    });
    // the shapes paint over the <svg>'s own background, in document order
    const level = levels[chain.indexOf(svg)];
    level.alternatives = level.alternatives.map(
      (bg) => shapes.reduce((under, shape) => over(svgPaint(shape), under), bg));
  }
  const pixel = (picks, glyph) => {
    let inner = null;
    for (let i = levels.length - 1; i >= 0; i -= 1) {
      let c = picks[i];
      if (glyph && i === levels.length - 1) c = over(fg, c);
      if (inner) c = over(inner, c);
      inner = scale(c, levels[i].opacity);
    }
    return over(inner, [255, 255, 255, 1]); // the canvas under the root
  };
  const luminance = (c) => {
    const [r, g, b] = c.slice(0, 3).map((v) => {
      const s = v / 255;
      return s <= 0.04045 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const hex = (c) => '#' + c.slice(0, 3).map((v) => Math.round(v).toString(16).padStart(2, '0')).join('');
  let worst = null;
  const walk = (i, picks) => {
    if (i === levels.length) {
      const [text, bg] = [pixel(picks, true), pixel(picks, false)];
      const [a, b] = [luminance(text), luminance(bg)].sort((x, y) => y - x);
      const ratio = (a + 0.05) / (b + 0.05);
      if (!worst || ratio < worst.ratio) worst = {ratio, text: hex(text), background: hex(bg)};
      return;
    }
    for (const alt of levels[i].alternatives) walk(i + 1, [...picks, alt]);
  };
  walk(0, []);
  worst.what = `${el.className?.baseVal ?? el.className} ${JSON.stringify(el.textContent.slice(0, 24))}`;
  return worst;
}"""

# The explanation each panel shows before its first data, and whether its canvases are drawn
# (of the cards this server shows: the speculation card is hidden on one that does not speculate).
PANELS = """() => [...document.querySelectorAll('.inspector .card:not([hidden])')].map((card) => {
  const body = [...card.children].filter((n) => n.tagName !== 'H2');
  const text = body.map((n) => n.offsetParent ? n.innerText : '').join(' ').trim();
  const canvases = [...card.querySelectorAll('canvas')].filter((c) => c.getClientRects().length);
  return {title: card.querySelector('h2').innerText, text, canvases: canvases.length};
})"""

# What "New chat" must put back as it was before the first message.
INSPECTOR_TEXT = """() => ['.phase-bar', '.sequence', '.cards', '.stats', '#pipeline']
  .map((s) => document.querySelector(s).innerText).join('\\n--\\n')"""

ONE_TOKENS = re.compile(r"(?<![\d.,])1 (tokens|layers|heads|blocks|keys|entries|steps)\b")


def contrast(locator) -> dict:
    return locator.evaluate(CONTRAST)


def assert_readable(page, selector: str) -> int:
    """Every element matching `selector` has AA contrast (4.5:1); returns how many there are."""
    found = page.locator(selector)
    results = [contrast(found.nth(i)) for i in range(found.count())]
    poor = [r for r in results if r["ratio"] < 4.5]
    assert not poor, f"{selector}: text below 4.5:1 contrast: {poor}"
    return len(results)


def ratio(color: str, background: str) -> float:
    """WCAG contrast of two opaque colours, 'rgb(r, g, b)' or '#rrggbb'."""

    def luminance(text: str) -> float:
        if text.startswith("#"):
            rgb = [int(text[i : i + 2], 16) for i in (1, 3, 5)]
        else:
            rgb = [float(v) for v in re.findall(r"[\d.]+", text)[:3]]
        lin = [
            c / 255 / 12.92 if c / 255 <= 0.04045 else ((c / 255 + 0.055) / 1.055) ** 2.4
            for c in rgb
        ]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    a, b = sorted([luminance(color), luminance(background)], reverse=True)
    return (a + 0.05) / (b + 0.05)


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def set_range(page, selector: str, value: float) -> None:
    page.eval_on_selector(
        selector,
        "(e, v) => { e.value = v; e.dispatchEvent(new Event('input', {bubbles: true})); }",
        value,
    )


def ask(page, prompt: str, max_tokens: int) -> None:
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#prompt", prompt)
    page.click("#send")
    page.wait_for_selector("#phase.done", timeout=180_000)


def assert_empty_inspector(page, model: str) -> None:
    assert model in page.locator("#model-name").inner_text()
    for panel in page.evaluate(PANELS):
        assert len(panel["text"]) > 60, f"the {panel['title']} panel has no explanation: {panel}"
        assert panel["canvases"] == 0, f"the {panel['title']} panel draws an empty canvas"
    assert page.locator("#sequence .chip, .cand, #kv-blocks .slot, #layers .layer-row").count() == 0
    assert page.locator("#phase").inner_text().lower() == "idle"
    assert page.locator(".stats .value").all_inner_texts() == ["–", "–", "–", "–"]
    assert "generated" not in page.locator("#phase-detail").inner_text()


def test_page_explains_every_panel_before_the_first_message(browser, server: str) -> None:
    page, errors = open_inspector(browser, server)
    model = shown_model(page, server)
    assert_empty_inspector(page, model)
    assert page.locator("#messages .hint").is_visible()
    # greedy by default: the small default model's answers hold at T = 0 (at 0.7 it
    # answered "Unam Sancto Francia..." to a plain question)
    assert page.input_value("#temperature") == "0"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "inspector-empty.png"), full_page=True)
    assert not errors, errors


def test_dark_theme_on_every_input_and_a_resizable_constraint_box(browser, server: str) -> None:
    page, errors = open_inspector(browser, server)
    fields = page.locator("input:not([type=range]):not([type=checkbox]), select, textarea")
    assert fields.count() >= 7  # prompt, top-k, max tokens, layer, API key, constraint ×2
    for i in range(fields.count()):
        field = fields.nth(i)
        name = field.evaluate("e => e.id")
        result = contrast(field)
        background = field.evaluate("e => getComputedStyle(e).backgroundColor")
        dark = field.evaluate(
            """e => { const [r, g, b] = getComputedStyle(e).backgroundColor.match(/\\d+/g).map(Number);
                      return r + g + b < 150; }"""
        )
        assert dark, f"#{name} is not on the dark theme: background {background}"
        assert result["ratio"] >= 4.5, f"#{name}: {result}"
        if field.evaluate("e => Boolean(e.placeholder)"):
            placeholder = field.evaluate("e => getComputedStyle(e, '::placeholder').color")
            shown = ratio(placeholder, result["background"])
            assert shown >= 4.5, f"#{name}: placeholder {placeholder} at {shown:.2f}:1"
    # native controls (sliders, the checkbox, select pop-ups) follow the page's dark scheme
    for selector in ("input[type=range]", "input[type=checkbox]", "select"):
        schemes = page.locator(selector).evaluate_all(
            "es => es.map((e) => getComputedStyle(e).colorScheme)"
        )
        assert schemes and all("dark" in s for s in schemes), (selector, schemes)

    box = page.locator("#constraint_value")
    assert not box.is_visible()  # no constraint chosen: no box
    page.select_option("#constraint", "json_schema")
    assert box.is_visible()
    assert box.evaluate("e => getComputedStyle(e).resize") in ("vertical", "both")
    before = box.bounding_box()
    assert before["height"] >= 70, "the constraint box shows only a couple of lines"
    # drag the resize handle at the bottom-right corner down
    page.mouse.move(before["x"] + before["width"] - 3, before["y"] + before["height"] - 3)
    page.mouse.down()
    page.mouse.move(
        before["x"] + before["width"] - 3, before["y"] + before["height"] + 120, steps=8
    )
    page.mouse.up()
    after = box.bounding_box()
    assert after["height"] > before["height"] + 60, (before, after)
    assert not errors, errors


def test_new_chat_clears_the_inspector_plurals_and_bar_labels(browser, server: str) -> None:
    page, errors = open_inspector(browser, server)
    model = shown_model(page, server)
    pristine = page.evaluate(INSPECTOR_TEXT)
    set_range(page, "#temperature", 0)  # greedy: the funnel has a one-token bar

    ask(page, "What is the capital of France?", 1)
    assert page.locator("#phase-detail").inner_text().startswith("1 token generated ·")
    assert page.locator(".bubble.assistant .meta").inner_text().startswith("1 token ·")
    first_prompt = page.locator("#seq-count").inner_text()
    page.locator(".bubble.assistant .tok").first.click()
    page.locator("#alternatives .cand").first.wait_for()
    text = page.locator("body").inner_text()
    assert not ONE_TOKENS.search(text), ONE_TOKENS.search(text)
    assert "1 token" in page.locator(".funnel").inner_text()
    bars = page.locator(".funnel .bar")
    for i in range(bars.count()):
        bar = bars.nth(i)
        width = bar.evaluate("e => e.getBoundingClientRect().width")
        label = bar.locator("span").evaluate("e => e.getBoundingClientRect().width")
        assert width >= label, (
            f"the bar {bar.inner_text()!r} ({width}px) is narrower than its label"
        )
    assert_readable(page, ".funnel .bar span")
    assert_readable(page, ".bubble .tok.selected")
    assert_readable(page, "#sequence .chip > span")
    assert_readable(page, ".cand .text, .cand .pct")
    assert_readable(page, ".phase")

    # the pulse that lights each stage of a live step: readable all through its fade
    pulsed = page.evaluate(
        """() => {
          const stages = [...document.querySelectorAll('.pipeline .stage.pulse')];
          stages.forEach((g) => g.classList.remove('pulse'));
          void document.body.getBoundingClientRect();
          stages.forEach((g) => g.classList.add('pulse'));  // as the app restarts it, per step
          return stages.length;
        }"""
    )
    assert pulsed >= 10, "the last step lit no stages"
    animations = page.evaluate(
        """() => { const a = document.getAnimations();
                   a.forEach((x) => x.pause()); return a.map((x) => x.animationName); }"""
    )
    assert animations and set(animations) == {"pulse"}, animations
    for fraction in (0, 0.1, 0.25, 0.5, 0.75, 0.99):
        page.evaluate(
            """f => document.getAnimations().forEach(
                 (a) => { a.currentTime = f * a.effect.getTiming().duration; })""",
            fraction,
        )
        peak = page.locator(".pipeline .stage.pulse rect").first
        if fraction == 0:  # the flash is on: the box is not its resting colour
            assert peak.evaluate("e => getComputedStyle(e).fill") != "rgb(29, 34, 48)"
        assert assert_readable(page, ".pipeline .stage.pulse text") == 2 * pulsed
    page.evaluate("() => document.getAnimations().forEach((a) => a.finish())")
    # slow motion's lit stage: gold box, dark text, no half-faded fill in between
    page.evaluate(
        "() => document.querySelector('.stage[data-stage=sample]').classList.add('active')"
    )
    assert_readable(page, ".pipeline .stage.active text")
    page.evaluate("() => document.querySelector('.stage.active').classList.remove('active')")
    assert_readable(page, ".pipeline text")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "inspector-one-token.png"), full_page=True)

    page.click("#reset")
    assert page.locator(".bubble").count() == 0
    assert_empty_inspector(page, model)
    # everything is as before the first message (the pipeline now knows the layer count)
    after = page.evaluate(INSPECTOR_TEXT)
    assert re.sub(r"× \d+ transformer layers", "× N transformer layers", after) == pristine

    # the conversation is forgotten too: the same question reads the same prompt again
    ask(page, "What is the capital of France?", 2)
    assert page.locator("#phase-detail").inner_text().startswith("2 tokens generated ·")
    assert page.locator(".bubble.assistant .meta").inner_text().startswith("2 tokens ·")
    assert page.locator("#seq-count").inner_text().replace("+ 2", "+ 1") == first_prompt
    assert not ONE_TOKENS.search(page.locator("body").inner_text())
    assert not errors, errors


def requests_running(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(r"^tokenmill_requests_running (\S+)$", text, re.M).group(1))


def test_new_chat_during_an_answer_drops_it(browser, server: str) -> None:
    page, errors = open_inspector(browser, server)
    model = served_model(server)
    set_range(page, "#slowmo", 40)  # slow motion: the answer is still coming when we click
    page.fill("#max_tokens", "64")
    page.fill("#prompt", "Write a long story about a dragon.")
    page.click("#send")
    page.locator(".bubble.assistant .tok").first.wait_for(timeout=180_000)
    page.click("#reset")
    page.wait_for_selector("#send:not([disabled])")
    # the server sees the disconnect (or has finished) and holds no request of ours
    deadline = time.monotonic() + 60
    while requests_running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert requests_running(server) == 0
    # the stage being lit when we clicked ends its 40 ms; the queued steps must not draw
    page.wait_for_timeout(400)
    assert page.locator(".bubble").count() == 0
    assert_empty_inspector(page, model)
    assert not errors, errors


def test_the_model_picker_lists_every_model_and_sends_the_chosen_one(
    browser, smollm_path: Path, tmp_path: Path
) -> None:
    """A server with two models (serve --model A --model B): the page's picker lists both,
    the one not loaded yet marked so, and a message sent with the second chosen is
    answered by it (it loads on that message; /metrics counts its tokens by its name)."""
    from helpers import build_hf_model
    from server_fixture import metric_by_label, server_process

    build_hf_model("llama", tmp_path / "tiny")  # the default, loaded at start
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    args = ("--model", str(tmp_path / "tiny"), "--model", str(smollm_path))
    with server_process(*args, "--kv-cache-memory", "128MiB", env=env) as served:
        with urllib.request.urlopen(f"{served.base_url}/v1/models", timeout=10) as r:
            ids = [card["id"] for card in json.loads(r.read())["data"]]
        assert len(ids) == 2 and ids[0] == "tiny"
        page, errors = open_inspector(browser, served.base_url)
        page.wait_for_function(
            "() => document.querySelectorAll('#model-picker option').length == 2"
        )
        options = page.locator("#model-picker option")
        assert [options.nth(i).get_attribute("value") for i in range(2)] == ids
        assert options.nth(1).inner_text() == f"{ids[1]} (not loaded)"
        assert page.locator("#model-pick").is_visible()
        page.select_option("#model-picker", ids[1])
        assert ids[1] in page.locator("#model-name").inner_text()
        page.fill("#max_tokens", "4")
        page.fill("#prompt", "Hi")
        page.click("#send")
        page.locator(".bubble.assistant .tok").first.wait_for(timeout=180_000)
        page.wait_for_selector("#send:not([disabled])", timeout=180_000)
        with urllib.request.urlopen(f"{served.base_url}/metrics", timeout=10) as r:
            generated = metric_by_label(r.read().decode(), "tokenmill_generation_tokens_total")
        assert generated.get(ids[1], 0) > 0 and generated.get("tiny", 0) == 0
        assert not errors, errors


def test_the_inspector_shows_speculative_guesses(browser, smollm_path: Path) -> None:
    """A server that speculates (serve --speculative ngram): a traced answer that copies
    its prompt is verified in steps of several rows, and the page shows each one's
    guesses (accepted or rejected), the tokens the accepted ones became, and what a guess
    was when one of them is clicked."""
    from server_fixture import server_process

    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    args = ("--model", str(smollm_path), "--kv-cache-memory", "128MiB", "--speculative", "ngram")
    with server_process(*args, env=env) as served:
        page, errors = open_inspector(browser, served.base_url)
        shown_model(page, served.base_url)
        page.fill("#max_tokens", "40")
        page.fill(
            "#prompt",
            "Repeat this sentence exactly: The lighthouse keeper climbed the spiral stairs "
            "every evening at dusk and lit the great lamp.",
        )
        # the page learned from GET /metrics that this server speculates: the card shows
        # (with its method) before any answer
        page.wait_for_selector("#card-spec[data-server=speculates]", timeout=30_000)
        assert page.locator("#card-spec").is_visible()
        assert "ngram" in page.locator("#spec-method").inner_text()
        page.click("#send")
        page.wait_for_selector("#phase.done", timeout=180_000)
        assert page.locator("#spec-steps").is_visible()  # the card has data, not its explanation
        assert page.locator("#spec-steps .spec-step").count() >= 1
        assert page.locator("#spec-steps .guess.accepted").count() >= 1
        assert "guesses accepted" in page.locator("#spec-text").inner_text()
        guessed = page.locator(".bubble.assistant .tok.guessed")
        assert guessed.count() >= 1
        # every token of the answer appears once, in order: the bubble's text is the answer
        positions = [int(p) for p in page.locator(".bubble.assistant .tok").evaluate_all(
            "ts => ts.map(t => t.dataset.pos)"
        )]  # fmt: skip
        assert positions == list(range(positions[0], positions[0] + len(positions)))
        guessed.first.click()
        title = page.locator("#choice-title")
        title.wait_for()
        assert "speculative guess" in title.inner_text() and "accepted" in title.inner_text()
        # an accepted guess ran as an input row of its step: its embedding is on record
        assert "embedding" in page.locator("#token-detail").inner_text().lower()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "inspector-speculation.png"), full_page=True)
        assert not errors, errors


# ---------------------------------------------------------------------------- layout and marks

# The text lines an element's contents take on screen: its text's line boxes, told apart by
# their top edges (spans of different sizes on one line start within a few pixels).
LINES = """(el) => {
  const range = document.createRange();
  range.selectNodeContents(el);
  const tops = [...range.getClientRects()].filter((r) => r.width > 0).map((r) => r.top);
  tops.sort((a, b) => a - b);
  return tops.filter((top, i) => i === 0 || top - tops[i - 1] > 6).length;
}"""

# Each pipeline stage's text and how far it lies inside its box, in the diagram's own units.
STAGE_TEXTS = """() => [...document.querySelectorAll('.pipeline .stage text')].map((t) => {
  const [box, text] = [t.parentNode.querySelector('rect').getBBox(), t.getBBox()];
  return {text: t.textContent, left: text.x - box.x, right: box.x + box.width - text.x - text.width};
})"""

# The characters on the page drawn without a glyph: each non-ASCII character of the page's text,
# drawn in its element's font, that comes out as the same picture as a code point no font has
# (the "tofu" box Chromium draws for a missing glyph).
MISSING_GLYPHS = """() => {
  const draw = (ch, font) => {
    const canvas = new OffscreenCanvas(48, 48);
    const ctx = canvas.getContext('2d');
    ctx.font = font;
    ctx.fillStyle = '#fff';
    ctx.fillText(ch, 4, 36);
    return ctx.getImageData(0, 0, 48, 48).data.join(',');
  };
  const seen = new Map();
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const parent = node.parentElement;
    if (!parent || !parent.getClientRects().length) continue;  // not shown
    const s = getComputedStyle(parent);
    const font = `${s.fontStyle} ${s.fontWeight} 28px ${s.fontFamily}`;
    for (const ch of node.textContent) {
      if (ch.codePointAt(0) > 127 && ch.trim()) seen.set(ch + font, [ch, font]);
    }
  }
  const missing = [];
  for (const [ch, font] of seen.values()) {
    if (draw(ch, font) === draw('\\u{10FFFD}', font)) missing.push(`U+${ch.codePointAt(0).toString(16)} in ${font}`);
  }
  return {checked: seen.size, missing};
}"""


def assert_header_readable(page) -> None:
    """Every part of the header on whole lines: the brand, tagline and each number with its
    label on one line each, the model line on at most three, none of them overlapping."""
    lines = {}
    for selector in (".brand .name", ".tagline", ".stat .label", ".stat .value", "#model-name"):
        found = page.locator(selector)
        for i in range(found.count()):
            item = found.nth(i)
            lines[f"{selector} {item.inner_text()!r}"] = item.evaluate(LINES)
    one_line = {k: n for k, n in lines.items() if not k.startswith("#model-name")}
    assert all(n == 1 for n in one_line.values()), f"the header wraps: {lines}"
    model_lines = next(n for k, n in lines.items() if k.startswith("#model-name"))
    assert model_lines <= 3, f"the model line wraps into a column: {lines}"
    boxes = [
        page.locator(s).bounding_box() for s in (".brand", "#model-name", ".stats")
    ]  # fmt: skip
    assert boxes[1]["width"] >= 280, f"the model line is squeezed: {boxes[1]}"
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            apart = (
                a["x"] + a["width"] <= b["x"] + 0.5
                or b["x"] + b["width"] <= a["x"] + 0.5
                or a["y"] + a["height"] <= b["y"] + 0.5
                or b["y"] + b["height"] <= a["y"] + 0.5
            )
            assert apart, f"header items overlap: {a} {b}"
    width = page.evaluate("() => [document.documentElement.scrollWidth, innerWidth]")
    assert width[0] <= width[1], f"the page is wider than the window: {width}"


def assert_stage_texts_inside(page) -> None:
    for stage in page.evaluate(STAGE_TEXTS):
        assert min(stage["left"], stage["right"]) >= 2, f"a diagram label sticks out: {stage}"


def assert_every_glyph_drawn(page) -> None:
    glyphs = page.evaluate(MISSING_GLYPHS)
    assert glyphs["checked"] >= 5  # ◆, ·, –, ␣, ↵ at least
    assert not glyphs["missing"], f"drawn as an empty box: {glyphs['missing']}"


def held_requests(page, pattern: str) -> list:
    """The requests to `pattern` from now on, held (not sent on) until the test continues them."""
    held: list = []
    page.route(pattern, lambda route: held.append(route))
    return held


def wait_for(page, found: list, what: str) -> None:
    deadline = time.monotonic() + 60
    while not found and time.monotonic() < deadline:
        page.wait_for_timeout(50)  # lets the page (and its route handlers) run
    assert found, f"no {what} came"


@pytest.mark.parametrize("width", [1400, 900])
def test_layout_at_1400_and_900_px(browser, server: str, width: int) -> None:
    """The page at a wide and a narrow window: the header stays in readable lines (at 900 px
    it wrapped into a one-word column), every diagram label lies inside its box ("Append, feed
    back" stuck out of it), the stop token's mark is drawn (U+23F9 was an empty box), and the
    speculation card is hidden on this server, which does not speculate. Saves a screenshot
    of each width."""
    page = browser.new_page(viewport={"width": width, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + "/")
    shown_model(page, server)
    page.wait_for_selector("#card-spec[data-server]", state="attached", timeout=30_000)
    assert page.locator("#card-spec").get_attribute("data-server") == "no speculation"
    assert not page.locator("#card-spec").is_visible()
    assert_header_readable(page)
    assert_stage_texts_inside(page)
    assert_every_glyph_drawn(page)

    ask(page, "What is the capital of France?", 40)
    answer = page.locator(".bubble.assistant")
    stop = answer.locator(".tok.stop")
    assert stop.count() == 1, "the answer did not end with its stop token"
    mark = stop.locator(".stop-mark")
    box = mark.bounding_box()
    assert box and box["width"] >= 5 and box["height"] >= 5, box
    paint = mark.evaluate("e => getComputedStyle(e).backgroundColor")
    assert paint not in ("transparent", "rgba(0, 0, 0, 0)"), paint
    assert answer.locator(".cut-mark").count() == 0  # it stopped: nothing was cut
    assert not page.locator("#seq-scroll").is_visible()  # a short prompt: no scrolling
    stop.click()  # the cards now show the stop token: its text and the candidates'
    page.locator("#alternatives .cand").first.wait_for()
    assert not page.locator("#card-spec").is_visible()
    # the model line is longer once an answer has told the model's shape
    assert_header_readable(page)
    assert_stage_texts_inside(page)  # the stage boxes' second lines, set by the answer
    assert_every_glyph_drawn(page)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"inspector-{width}px.png"), full_page=True)
    assert not errors, errors


def test_a_new_request_resets_the_cards(browser, server: str) -> None:
    """Until a new answer's first step arrives (a long prompt's prefill takes a while), the
    cards showed the previous answer's tokens, candidates, cache and speed as if they were
    the new one's. The /v1/inspect request is held, so the page waits there as long as the
    test looks."""
    page, errors = open_inspector(browser, server)
    model = shown_model(page, server)
    ask(page, "What is the capital of France?", 6)
    page.locator(".bubble.assistant .tok").first.click()
    page.locator("#alternatives .cand").first.wait_for()
    assert page.locator("#sequence .chip").count() > 0

    held = held_requests(page, "**/v1/inspect")
    page.fill("#prompt", "And of Italy?")
    page.click("#send")
    wait_for(page, held, "/v1/inspect request")
    assert page.locator("#sequence .chip, .cand, #kv-blocks .slot, #layers .layer-row").count() == 0
    assert page.locator(".inspector .card.has-data").count() == 0
    assert page.locator(".stats .value").all_inner_texts() == ["–", "–", "–", "–"]
    assert page.locator("#phase").inner_text().lower() == "sent"
    assert "prefill" in page.locator("#phase-detail").inner_text()
    assert model in page.locator("#model-name").inner_text()
    held[0].continue_()
    page.unroute("**/v1/inspect")
    page.locator(".bubble.assistant").nth(1).locator(".meta").wait_for(timeout=180_000)
    assert page.locator("#sequence .chip").count() > 0
    assert "Italy" in page.locator("#sequence").inner_text()
    assert not errors, errors


def test_cut_answers_are_marked_and_the_untraced_speed_shown(browser, server: str) -> None:
    """An answer that ran out of max_tokens says so in its bubble (traced and plain), and the
    traced decode speed, taken on the slow traced path, is labelled traced, with the speed of
    the same request sent again untraced beside it (the page showed 16-45 tok/s where the
    CLI makes 56-140, and a user took the engine to be slow)."""
    page, errors = open_inspector(browser, server)
    shown_model(page, server)
    posts: list[tuple[str, dict]] = []
    page.on(
        "request",
        lambda r: posts.append((r.url, json.loads(r.post_data))) if r.method == "POST" else None,
    )
    labels = page.locator(".stat .label").all_inner_texts()
    assert [label.lower() for label in labels[1:3]] == ["decode, traced", "decode, untraced"]

    ask(page, "Write a long story about a dragon.", 5)
    answer = page.locator(".bubble.assistant")
    cut = answer.locator(".cut-mark")
    assert cut.is_visible()
    assert cut.inner_text() == "cut at max_tokens = 5"
    assert "finish reason: length" in page.locator("#phase-detail").inner_text()
    speed = re.compile(r"^\d+\.\d tok/s$")
    page.wait_for_function(
        "() => /tok\\/s/.test(document.getElementById('stat-plain').innerText)", timeout=60_000
    )
    assert speed.match(page.locator("#stat-tps").inner_text())
    assert speed.match(page.locator("#stat-plain").inner_text())
    meta = answer.locator(".meta").inner_text()
    assert re.search(r"\d tok/s traced · \d+\.\d tok/s untraced$", meta), meta
    # the untraced figure is the same request, sent as a plain chat completion
    traced = [body for url, body in posts if url.endswith("/v1/inspect")]
    plain = [body for url, body in posts if url.endswith("/v1/chat/completions")]
    assert len(traced) == 1 and len(plain) == 1, posts
    assert plain[0]["messages"] == traced[0]["messages"]
    assert plain[0]["max_tokens"] == 5 and plain[0]["temperature"] == traced[0]["temperature"]

    # tracing off: the plain answer is marked the same way, and its speed is the untraced one
    page.uncheck("#trace")
    page.fill("#max_tokens", "3")
    page.fill("#prompt", "Tell me more.")
    page.click("#send")
    second = page.locator(".bubble.assistant").nth(1)
    second.locator(".meta").wait_for(timeout=180_000)
    assert second.locator(".cut-mark").inner_text() == "cut at max_tokens = 3"
    assert speed.match(page.locator("#stat-plain").inner_text())
    assert page.locator("#stat-tps").inner_text() == "–"  # nothing was traced
    assert "untraced" in second.locator(".meta").inner_text()
    assert not errors, errors


def test_a_long_prompt_scrolls_with_a_hint(browser, server: str) -> None:
    """ "What the model reads" scrolls inside its card: the edge with more tokens past it
    fades and a note under the list says it scrolls (nothing showed it did), and the newest
    token is kept in view."""
    page, errors = open_inspector(browser, server)
    shown_model(page, server)
    ask(page, "Summarize this: " + "the keeper climbed the stairs and lit the lamp. " * 20, 2)
    box = page.locator("#sequence")
    assert box.evaluate("e => e.scrollHeight > e.clientHeight + 20"), "the list does not scroll"
    hint = page.locator("#seq-scroll")
    assert hint.is_visible()
    # following the answer: scrolled to its newest token, the start of the list above
    assert "scroll up" in hint.inner_text()
    newest = page.locator("#sequence .chip").last
    inside = newest.evaluate(
        """c => { const [a, b] = [c.getBoundingClientRect(), c.parentNode.getBoundingClientRect()];
                  return a.top >= b.top - 1 && a.bottom <= b.bottom + 1; }"""
    )
    assert inside, "the newest token is scrolled out of view"
    assert "more-above" in box.get_attribute("class")
    assert box.evaluate("e => getComputedStyle(e).maskImage") != "none"
    box.evaluate("e => { e.scrollTop = 0; e.dispatchEvent(new Event('scroll')); }")
    page.wait_for_function(
        "() => document.getElementById('seq-scroll').innerText.includes('below')"
    )
    assert "more-below" in box.get_attribute("class")
    assert not errors, errors


def test_the_kv_card_shows_the_prefix_cache_read_back_from_disk(
    browser, smollm_path: Path, tmp_path: Path
) -> None:
    """A server restarted on its --prefix-cache-dir: a chat it saw before is read back from
    disk, and the KV card says how much of the prompts the cache served and how many
    tokens came from disk."""
    import httpx
    from server_fixture import server_process

    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    args = ("--model", str(smollm_path), "--kv-cache-memory", "128MiB",
            "--prefix-cache-dir", str(tmp_path / "kv"))  # fmt: skip
    rules = " ".join(f"Rule {i}: be brief." for i in range(40))
    chat = {"messages": [{"role": "system", "content": rules}, {"role": "user", "content": "Hi"}],
            "max_tokens": 2}  # fmt: skip
    for restarted in (False, True):
        with server_process(*args, env=env) as served:
            r = httpx.post(f"{served.base_url}/v1/chat/completions", json=chat, timeout=120)
            assert r.status_code == 200, r.text
            if not restarted:
                continue
            page, errors = open_inspector(browser, served.base_url)
            shown_model(page, served.base_url)
            page.fill("#max_tokens", "2")
            page.fill("#prompt", "Hello")
            page.click("#send")
            page.wait_for_selector("#phase.done", timeout=180_000)
            page.wait_for_function(
                "() => document.getElementById('kv-cache-text').innerText.includes('on disk')"
            )
            text = page.locator("#kv-cache-text").inner_text()
            assert "% of prompt tokens served from it" in text and "read back" in text
            read = int(re.search(r"([\d,]+) prompt tokens read back", text)[1].replace(",", ""))
            assert read >= 16 * (r.json()["usage"]["prompt_tokens"] // 16) - 16
            assert not errors, errors
