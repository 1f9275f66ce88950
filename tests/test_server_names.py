"""What a client may call the model, and an empty `tools` list refused.

In-process on a tiny random-weight model, so these are in the fast subset; the README's
own client snippet, which names the model by its file name, runs against a real
`tokenmill serve` in test_readme.py.
"""

from __future__ import annotations

import pytest

CHAT = [{"role": "user", "content": "t1 t2"}]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from fastapi.testclient import TestClient
    from helpers import build_hf_model

    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.app import create_app
    from tokenmill.server.async_engine import AsyncEngine

    folder = tmp_path_factory.mktemp("tiny")
    build_hf_model("llama", folder)
    engine = AsyncEngine(LLMEngine(folder, kv_cache_memory="512tok", threads=1))
    app = create_app(engine, model_name="tiny", aliases=["tiny.gguf", "tiny-alias"])
    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize("name", ["tiny", "tiny.gguf", "tiny-alias", None])
def test_every_served_name_is_accepted_and_answered_as_the_first(http, name):
    body = {"prompt": "t1 t2", "max_tokens": 2, **({"model": name} if name else {})}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tiny"
    if name:
        assert http.get(f"/v1/models/{name}").json()["id"] == "tiny"


def test_models_lists_the_first_name_only(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]


def test_an_unknown_name_is_404_naming_the_served_one(http):
    response = http.post("/v1/completions", json={"prompt": "t1", "model": "TINY.GGUF"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "model" and "'tiny'" in error["message"]


def test_an_empty_tools_list_is_refused(http):
    # OpenAI refuses it too; a client that sends tools expects them to be offered
    response = http.post("/v1/chat/completions", json={"messages": CHAT, "tools": []})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools" and "must not be empty" in error["message"]
