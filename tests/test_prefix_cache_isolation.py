"""Prefix-cache isolation: a client must not reuse, and so cannot time,
another client's cached prompt. vLLM's `cache_salt` per request, and
`--prefix-cache-scope per-key` (the default when API keys are set)."""

from __future__ import annotations

import random

import pytest
from helpers import build_hf_model

from tokenmill.engine.block_manager import BlockManager, salt_root
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
PROMPT = [random.Random(7).randrange(2, 300) for _ in range(70)]  # 4 full blocks of 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    build_hf_model("llama", folder, initializer_range=0.05, max_position_embeddings=1024)
    return folder


class _Seq:  # what commit_full_blocks reads of a Sequence
    def __init__(self, tokens: list[int], table: list[int], root: int | None):
        self.tokens, self.block_table = tokens, table
        self.num_computed, self.committed_blocks, self.last_hash = len(tokens), 0, root

    def token_at(self, i: int) -> int:
        return self.tokens[i]


def test_blocks_named_under_one_root_are_not_matched_under_another():
    blocks = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks
    a = salt_root("key-0")
    table: list[int] = []
    blocks.grow(table, len(tokens))
    blocks.commit_full_blocks(_Seq(tokens, table, a))
    blocks.release(table)
    taken, _ = blocks.match_prefix(tokens, a)
    assert len(taken) == 3  # its own scope hits
    blocks.release(taken)
    for other in (None, salt_root("key-1"), salt_root("key-0", "salt-x")):
        taken, last = blocks.match_prefix(tokens, other)
        assert (taken, last) == ([], other)
    blocks.check_invariants([])


def _run(engine: LLMEngine, request_id: str, salt: int | None) -> tuple[list[int], int]:
    engine.add_request(request_id, PROMPT, GREEDY, cache_salt=salt)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return [t for o in outs for t in o.token_ids], outs[-1].num_cached_tokens


def test_engine_shares_cached_prompts_only_within_a_salt(tiny):
    engine = LLMEngine(tiny, kv_cache_memory="1024tok", threads=1)
    first, cached = _run(engine, "a", None)
    assert cached == 0
    assert _run(engine, "b", None) == (first, 64)  # the shared cache: 4 blocks reused
    salted = salt_root("salt-s")
    assert _run(engine, "c", salted) == (first, 0)  # same answer, nothing reused
    assert _run(engine, "d", salted) == (first, 64)  # its own scope now hits
    assert _run(engine, "e", salt_root("salt-t")) == (first, 0)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.blocks.check_invariants([])


# --------------------------------------------------------------------------- the server


def _app(tiny, **kwargs):
    from tokenmill.server.app import create_app
    from tokenmill.server.async_engine import AsyncEngine

    engine = AsyncEngine(LLMEngine(tiny, kv_cache_memory="1024tok", threads=1))
    return create_app(engine, model_name="tiny", **kwargs)


def _hits(app) -> int:
    return app.state.engine.engine.blocks.hit_tokens


def _complete(http, key: str | None, **extra) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    response = http.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_per_key_scope_is_the_default_with_keys(tiny):
    from fastapi.testclient import TestClient

    app = _app(tiny, api_key=["key-one", "key-two"])
    assert app.state.prefix_cache_scope == "per-key"
    with TestClient(app) as http:
        answer = _complete(http, "key-one")["choices"][0]["text"]
        assert _hits(app) == 0
        # Another key's client guessing the same prompt gets no hit (and so no faster
        # first token to time), but the same answer.
        assert _complete(http, "key-two")["choices"][0]["text"] == answer
        assert _hits(app) == 0
        _complete(http, "key-one")
        assert _hits(app) == 64
        _complete(http, "key-one", cache_salt="tenant-a")  # a salt narrows the scope
        assert _hits(app) == 64
        _complete(http, "key-one", cache_salt="tenant-a")
        assert _hits(app) == 128
        # Both keys work for every route; a wrong one is still a 401.
        response = http.post(
            "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k"}
        )
        assert response.status_code == 401


def test_global_scope_and_cache_salt(tiny):
    from fastapi.testclient import TestClient

    app = _app(tiny, api_key=["key-one", "key-two"], prefix_cache_scope="global")
    with TestClient(app) as http:
        _complete(http, "key-one")
        _complete(http, "key-two")
        assert _hits(app) == 64  # one cache for every key
        _complete(http, "key-two", cache_salt="private")
        assert _hits(app) == 64
        for salt in ("", "x" * 257, 5):
            response = http.post(
                "/v1/completions",
                json={"prompt": PROMPT, "cache_salt": salt},
                headers={"Authorization": "Bearer key-one"},
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "cache_salt"
    with pytest.raises(ValueError, match="prefix_cache_scope"):
        _app(tiny, prefix_cache_scope="everyone")
