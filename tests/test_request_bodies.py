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
