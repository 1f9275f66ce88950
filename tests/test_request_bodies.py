"""Request bodies against a real `tokenmill serve` on a tiny random model: one JSON reader
for every route (the same bytes accepted or refused with the same words everywhere), and
the fields whose size or value had no check, each tried just inside and just past its
limit.
"""

from __future__ import annotations

import codecs
import json

import httpx
import pytest
from server_fixture import running_server

TINY = "tiny"
CHAT = [{"role": "user", "content": "t1"}]

# every route that reads a JSON body, with a body it answers 200
ROUTES = [
    ("/v1/completions", {"model": TINY, "prompt": "t1", "max_tokens": 1}),
    ("/v1/chat/completions", {"model": TINY, "messages": CHAT, "max_tokens": 1}),
    ("/v1/responses", {"model": TINY, "input": "t1", "max_output_tokens": 1}),
    ("/v1/messages", {"model": TINY, "messages": CHAT, "max_tokens": 1}),
    ("/v1/messages/count_tokens", {"model": TINY, "messages": CHAT}),
    ("/v1/embeddings", {"model": TINY, "input": "t1"}),
    ("/v1/inspect", {"model": TINY, "prompt": "t1", "max_tokens": 1}),
    ("/tokenize", {"model": TINY, "prompt": "t1"}),
    ("/detokenize", {"model": TINY, "tokens": [1, 2]}),
]
ROUTE_IDS = [path.strip("/").replace("/", "-") for path, _ in ROUTES]


@pytest.fixture(scope="module")
def url(tiny_llama):
    (tiny_llama / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
    )
    args = ("--model", str(tiny_llama), "--served-model-name", TINY, "--kv-cache-memory", "512tok")
    with running_server(*args, "--threads", "1") as base_url:
        yield base_url


@pytest.fixture(scope="module")
def vocab_size(tiny_llama) -> int:
    return json.loads((tiny_llama / "config.json").read_text())["vocab_size"]


def _post(url: str, path: str, content: bytes, content_type: str | None = "application/json"):
    headers = {} if content_type is None else {"content-type": content_type}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=60)


def _error(response: httpx.Response) -> dict:
    """The error of an OpenAI- or Anthropic-shaped answer."""
    return response.json()["error"]


# --------------------------------------------------------------------------- one reader


@pytest.mark.parametrize("path, body", ROUTES, ids=ROUTE_IDS)
def test_every_route_reads_json_alike(url, path, body):
    """UTF-8 with a byte order mark is read (RFC 8259 lets a reader skip it); UTF-16 and
    UTF-32 are refused by name; so is a body not sent as JSON. /v1/completions read a
    UTF-16 body and /v1/responses refused it, each with its own parser."""
    raw = json.dumps(body).encode()
    assert _post(url, path, raw).status_code == 200
    assert _post(url, path, codecs.BOM_UTF8 + raw).status_code == 200
    assert _post(url, path, raw, "application/vnd.api+json").status_code == 200
    for encoding in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"):
        response = _post(url, path, json.dumps(body).encode(encoding))
        assert response.status_code == 400, (encoding, response.text)
        assert "must be JSON in UTF-8" in _error(response)["message"]
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        # what a page on another site may POST without asking first
        response = _post(url, path, raw, content_type)
        assert response.status_code == 400, (content_type, response.text)
        assert "Content-Type: application/json" in _error(response)["message"]
    for bad, words in (
        (b"{", "not valid JSON"),
        (b"[1]", "must be a JSON object, not an array"),
        (b"", "empty"),
        (b"\xff{}", "not valid UTF-8"),
    ):
        response = _post(url, path, bad)
        assert response.status_code == 400, (bad, response.text)
        assert words in _error(response)["message"], (bad, response.text)


# --------------------------------------------------------------------------- fields


def test_metadata_is_held_to_openais_caps(url):
    def metadata(keys: int, key_chars: int = 8, value_chars: int = 8) -> httpx.Response:
        tags = {f"{i:0{key_chars}d}": "v" * value_chars for i in range(keys)}
        body = {"model": TINY, "input": "t1", "max_output_tokens": 1, "metadata": tags}
        return httpx.post(f"{url}/v1/responses", json=body, timeout=60)

    response = metadata(16, key_chars=64, value_chars=512)  # at every limit
    assert response.status_code == 200 and len(response.json()["metadata"]) == 16
    for response, words in (
        (metadata(17), "metadata has 17 keys; at most 16"),
        (metadata(100, value_chars=500), "metadata has 100 keys"),  # the case
        (metadata(1, key_chars=65), "has 65 characters; at most 64"),
        (metadata(1, value_chars=513), "has 513 characters; at most 512"),
    ):
        assert response.status_code == 400, response.text
        error = _error(response)
        assert error["param"] == "metadata" and words in error["message"], error


def test_thinking_budget_is_checked(url):
    def budget(tokens) -> httpx.Response:
        body = {
            "model": TINY,
            "messages": CHAT,
            "max_tokens": 1,
            "thinking": {"type": "enabled", "budget_tokens": tokens},
        }
        return httpx.post(f"{url}/v1/messages", json=body, timeout=60)

    assert budget(1024).status_code == 200  # Anthropic's least budget
    for tokens in (1023, 0, -100, 1024.5, "2048", None):  # None: enabled needs a budget
        response = budget(tokens)
        assert response.status_code == 400, (tokens, response.text)
        body = response.json()
        assert body["type"] == "error", body  # Anthropic's shape
        assert "thinking.budget_tokens" in body["error"]["message"], body


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": TINY, "prompt": "t1", "max_tokens": 1}),
        ("/v1/chat/completions", {"model": TINY, "messages": CHAT, "max_tokens": 1}),
    ],
    ids=["completions", "chat"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_must_be_in_the_vocabulary(url, vocab_size, path, body, stream):
    def stop(ids: list[int]) -> httpx.Response:
        full = {**body, "stop_token_ids": ids, "stream": stream}
        return httpx.post(f"{url}{path}", json=full, timeout=60)

    assert stop([0, vocab_size - 1]).status_code == 200
    response = stop([0, vocab_size])
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == "stop_token_ids", error
    assert f"id {vocab_size} is out of range for vocab size {vocab_size}" in error["message"]


def test_input_of_reasoning_items_only_names_input(url):
    """The reasoning of an earlier answer is left out of the prompt, so an input of only
    that leaves no message: the 400 names the request's field, not the template's."""
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "t2"}],
    }
    body = {"model": TINY, "input": [reasoning], "max_output_tokens": 1}
    response = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == "input", error
    assert error["message"].startswith("input has no message"), error
    assert "'role', 'content'" not in error["message"]
    # one message beside it is enough
    body["input"] = [reasoning, {"role": "user", "content": "t1"}]
    assert httpx.post(f"{url}/v1/responses", json=body, timeout=60).status_code == 200
