"""Several models behind one server: two tiny random-weight Llamas with
different seeds, so their greedy answers differ, served by name through the real `openai`
client.

Most tests run the app under uvicorn on a thread of this process, on a real loopback port,
so they can look at the pool itself (which models are loaded, how many loads ran, whether
an evicted engine's memory was let go); one runs a real `tokenmill serve --models-dir` in
a subprocess.
"""

from __future__ import annotations

import gc
import socket
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from helpers import build_hf_model
from server_fixture import metric_by_label, server_process, sse_events

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import create_app
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.model_pool import ModelPool, ServedModel, engine_bytes

PROMPT = "t5 t6 t7 t8"
GREEDY = {"max_tokens": 6, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
OLLAMA_GREEDY = {"num_predict": 6, "temperature": 0.0}
KV = "512tok"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Two tiny Llama checkpoints, "a" and "b" (seeds 1 and 2), in one models folder."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        build_hf_model("llama", root / name, seed=seed)
        out[name] = root / name
    (root / "notes.txt").write_text("not a model")  # --models-dir skips it
    return out


class Loads:
    """The ServedModels of the two folders, counting the loads each one ran."""

    def __init__(self, folders: dict[str, Path], kv: str = KV):
        self.folders, self.kv = folders, kv
        self.count = {name: 0 for name in folders}
        self.engines: dict[str, list[weakref.ref]] = {name: [] for name in folders}
        self._lock = threading.Lock()

    def load(self, name: str) -> AsyncEngine:
        with self._lock:
            self.count[name] += 1
        engine = LLMEngine(self.folders[name], kv_cache_memory=self.kv, threads=1)
        self.engines[name].append(weakref.ref(engine))
        return AsyncEngine(engine)

    def models(self) -> list[ServedModel]:
        return [
            ServedModel(name, lambda name=name: self.load(name), (f"{name}-alias",), path)
            for name, path in self.folders.items()
        ]


@contextmanager
def serving(pool: ModelPool, first: str = "a", **kwargs) -> Iterator[str]:
    """The app over `pool` under uvicorn on a free loopback port (the first model loaded
    before it starts, as serve does); yields the base URL."""
    import uvicorn

    pool.add_loaded(first, pool.slots[first].model.load())
    app = create_app(pool, **kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server thread ended before it started")
            thread.join(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def answer(url: str, model: str) -> str:
    return client(url).completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text


@pytest.fixture(scope="module")
def alone(folders) -> dict[str, str]:
    """Each model's greedy answer to PROMPT from a pool with nothing to evict."""
    pool = ModelPool(Loads(folders).models())
    with serving(pool) as url:
        return {name: answer(url, name) for name in folders}


def test_two_models_answer_by_name_and_differ(folders, alone):
    assert alone["a"] != alone["b"]  # different weights: a request reached the one it named
    loads = Loads(folders)
    pool = ModelPool(loads.models())
    with serving(pool) as url:
        c = client(url)
        cards = {m.id: m for m in c.models.list()}
        assert set(cards) == {"a", "b"}
        assert cards["a"].loaded is True and cards["b"].loaded is False
        assert cards["b"].max_model_len is None  # known once it has loaded
        done = c.completions.create(model="b-alias", prompt=PROMPT, **GREEDY)
        assert done.model == "b" and done.choices[0].text == alone["b"]
        assert loads.count == {"a": 1, "b": 1}
        cards = {m.id: m for m in c.models.list()}
        assert cards["b"].loaded is True and cards["b"].max_model_len > 0
        assert c.models.retrieve("b-alias").id == "b"
        # no model named: the first one, the default
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert plain.status_code == 200 and plain.json()["model"] == "a"


def test_concurrent_requests_for_an_unloaded_model_share_one_load(folders, alone):
    loads = Loads(folders)
    pool = ModelPool(loads.models())
    with serving(pool) as url, ThreadPoolExecutor(6) as workers:
        texts = list(workers.map(lambda _: answer(url, "b"), range(6)))
    assert texts == [alone["b"]] * 6
    assert loads.count["b"] == 1 and pool.slots["b"].loads == 1


def _interleaved(url: str, rounds: int) -> list[tuple[str, str]]:
    """(model, answer) of 2 clients at once, each alternating between the models, one
    starting at each: every request for one model finds the other loaded."""

    def one_client(start: int) -> list[tuple[str, str]]:
        order = ["a", "b"] if start == 0 else ["b", "a"]
        return [(order[i % 2], answer(url, order[i % 2])) for i in range(rounds)]

    with ThreadPoolExecutor(2) as workers:
        return [pair for part in workers.map(one_client, (0, 1)) for pair in part]


def _assert_released(loads: Loads, pool: ModelPool) -> None:
    """Every engine the pool evicted is gone from memory: nothing holds its LLMEngine."""
    gc.collect()
    for name, refs in loads.engines.items():
        live = [r for r in refs if r() is not None]
        assert len(live) == (pool.slots[name].engine is not None), (name, len(live))


def test_max_loaded_models_evicts_the_least_recently_used(folders, alone):
    loads = Loads(folders)
    pool = ModelPool(loads.models(), max_loaded=1)
    with serving(pool) as url:
        answers = _interleaved(url, rounds=4)
        assert answers and all(text == alone[model] for model, text in answers)
        assert len(pool.loaded()) == 1
        assert pool.slots["a"].evictions >= 1 and pool.slots["b"].loads >= 2
        _assert_released(loads, pool)
        metrics = httpx.get(f"{url}/metrics").text
        evictions = metric_by_label(metrics, "tokenmill_model_evictions_total")
        assert evictions == {m: float(pool.slots[m].evictions) for m in ("a", "b")}
        assert metric_by_label(metrics, "tokenmill_http_requests_total") == {"200": 8.0}


def test_a_memory_budget_evicts_to_stay_within_it(folders, alone):
    sizes = {
        n: engine_bytes(LLMEngine(p, kv_cache_memory=KV, threads=1)) for n, p in folders.items()
    }
    budget = max(sizes.values()) + min(sizes.values()) // 2  # room for one, never both
    loads = Loads(folders)
    pool = ModelPool(loads.models(), memory_budget=budget)
    with serving(pool) as url:
        answers = _interleaved(url, rounds=4)
        assert all(text == alone[model] for model, text in answers)
        assert sum(s.nbytes for s in pool.loaded()) <= budget
        assert pool.slots["a"].evictions >= 1
        _assert_released(loads, pool)
    # a budget below one model's size: a 503 naming the model and the budget
    pool = ModelPool(Loads(folders).models(), memory_budget=sizes["a"] + 1)
    pool.slots["b"].nbytes = sizes["a"] + 2  # as measured at an earlier load
    with serving(pool) as url:
        with pytest.raises(openai.InternalServerError) as e:
            answer(url, "b")
        assert e.value.status_code == 503 and "'b' needs" in e.value.message
        assert "--models-memory" in e.value.message


def test_a_model_with_a_running_stream_is_not_evicted(folders, alone):
    loads = Loads(folders, kv="8192tok")
    pool = ModelPool(loads.models(), max_loaded=1)
    # 8 choices of 400 tokens with logprobs: well over a megabyte of events, more than the
    # loopback socket's buffers hold, so the answer is still being sent (a's request is
    # running) until this client reads it
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 400, "n": 8, "stream": True}
    body.update(temperature=1.0, seed=3, ignore_eos=True, logprobs=5)
    with serving(pool) as url, ThreadPoolExecutor(1) as workers:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as stream:
            events = sse_events(stream)
            assert next(events)["model"] == "a"
            waiting = workers.submit(answer, url, "b")
            while pool.slots["b"].users == 0:  # b's request is in the pool, waiting for room
                threading.Event().wait(0.01)
            assert pool.slots["a"].users == 1 and pool.slots["a"].engine is not None
            assert pool.slots["b"].engine is None and not waiting.done()
            tokens = sum(
                len((c.get("logprobs") or {}).get("tokens", []))
                for e in events
                if e != "[DONE]"
                for c in e["choices"]
            )
        assert tokens >= 8 * 400 - 8  # the whole answer ran on a, never evicted under it
        assert waiting.result() == alone["b"]  # then b loaded, in a's place
        assert pool.slots["a"].engine is None and pool.slots["a"].evictions == 1


def test_metrics_label_each_loaded_model(folders):
    pool = ModelPool(Loads(folders).models())
    with serving(pool) as url:
        answer(url, "a")
        answer(url, "b")
        text = httpx.get(f"{url}/metrics").text
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert set(metric_by_label(text, "tokenmill_requests_running")) == {"a", "b"}
    generated = metric_by_label(text, "tokenmill_generation_tokens_total")
    assert generated == {"a": 6.0, "b": 6.0}
    assert metric_by_label(text, "tokenmill_model_loaded") == {"a": 1.0, "b": 1.0}
    assert 'tokenmill_time_to_first_token_seconds_count{model="b"} 1' in text
    for name in ("tokenmill_requests_running", "tokenmill_time_to_first_token_seconds"):
        assert text.count(f"# TYPE {name} ") == 1  # one header per metric, as the format says


def test_an_unknown_model_is_a_404_in_each_apis_shape(folders):
    loads = Loads(folders)
    pool = ModelPool(loads.models())
    with serving(pool) as url:
        with pytest.raises(openai.NotFoundError) as e:
            client(url).completions.create(model="c", prompt=PROMPT, max_tokens=1)
        assert "'c' does not exist" in e.value.message and "'a', 'b'" in e.value.message
        with pytest.raises(openai.NotFoundError):
            client(url).models.retrieve("c")
        chat = {"model": "c", "messages": [{"role": "user", "content": "t1"}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        anthropic = {**chat, "max_tokens": 4}
        r = httpx.post(f"{url}/v1/messages", json=anthropic)
        assert r.status_code == 404
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
        r = httpx.post(f"{url}/v1/responses", json={"model": "c", "input": "t1"})
        assert r.status_code == 404 and "'c' does not exist" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/api/chat", json=chat)
        assert r.status_code == 404 and "'c' does not exist" in r.json()["error"]
    assert loads.count == {"a": 1, "b": 0}  # nothing loaded for them


def test_ollama_lists_every_model_and_runs_the_loaded(folders, alone):
    import ollama

    pool = ModelPool(Loads(folders).models())
    with serving(pool) as url:
        c = ollama.Client(host=url, timeout=300)
        listed = {m.model: m for m in c.list().models}
        assert set(listed) == {"a", "b"} and listed["b"].details.family is None  # not loaded
        assert [m.model for m in c.ps().models] == ["a"]
        out = c.generate(model="b-alias", prompt=PROMPT, raw=True, options=OLLAMA_GREEDY)
        # (Ollama has no ignore_eos: an answer may end sooner)
        assert out.model == "b" and out.response and alone["b"].startswith(out.response)
        assert {m.model for m in c.ps().models} == {"a", "b"}
        assert c.show("b").modelinfo["general.architecture"] == "llama"


def test_without_the_api_key_nothing_loads(folders):
    loads = Loads(folders)
    pool = ModelPool(loads.models())
    with serving(pool, api_key="sesame") as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": "b", "prompt": PROMPT})
        assert r.status_code == 401
        assert loads.count["b"] == 0
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert keyed.completions.create(model="b", prompt=PROMPT, max_tokens=1).model == "b"
        assert loads.count["b"] == 1


def test_serve_with_a_models_dir_loads_and_evicts(folders, alone):
    root = folders["a"].parent
    args = ("--models-dir", str(root), "--max-loaded-models", "1", "--kv-cache-memory", KV)
    with server_process(*args, "--threads", "1", "--log-level", "warning") as server:
        c = client(server.base_url)
        cards = {m.id: m.loaded for m in c.models.list()}
        assert cards == {"a": True, "b": False}
        answers = _interleaved(server.base_url, rounds=4)
        assert all(text == alone[model] for model, text in answers)
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert metric_by_label(metrics, "tokenmill_model_evictions_total")["a"] >= 1
        assert sum(metric_by_label(metrics, "tokenmill_model_loaded").values()) == 1
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="notes.txt", prompt=PROMPT, max_tokens=1)
