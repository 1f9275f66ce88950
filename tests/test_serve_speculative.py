"""`tokenmill serve --speculative ngram`: real servers on loopback with the
real default model answer greedy completions token for token as a server without
speculation does, and /metrics counts the guesses proposed and accepted, by method (and by
model on a server of several)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import build_hf_model
from server_fixture import running_server
from test_multi_model import Loads, serving
from test_speculative import CODE, COPY, FORCED, STORY

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.model_pool import ModelPool

KV = ("--kv-cache-memory", "4096tok", "--threads", "1", "--log-level", "warning")
SPEC = ("--speculative", "ngram", "--num-speculative-tokens", "4")
DRAFT = "tokenmill_spec_decode_num_draft_tokens_total"
ACCEPTED = "tokenmill_spec_decode_num_accepted_tokens_total"
DRAFTS = "tokenmill_spec_decode_num_drafts_total"
RATE = "tokenmill_spec_decode_draft_acceptance_rate"


def samples(text: str, name: str) -> dict[str, float]:
    """{labels text: value} of every sample of metric `name` on a /metrics page."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            if series == name or series.startswith(name + "{"):
                out[series.removeprefix(name)] = float(value)
    return out


def complete(url: str, prompt: str, max_tokens: int = 60) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def servers():
    """(plain, speculating) base URLs: the default model, one thread each."""
    with running_server(*KV) as plain, running_server(*KV, *SPEC) as spec:
        yield plain, spec


@pytest.mark.slow
def test_greedy_completions_identical_and_counters_move(servers):
    plain, spec = servers
    before = httpx.get(f"{spec}/metrics").text
    # the method's series are there from the start, at zero
    assert samples(before, DRAFT) == {'{method="ngram"}': 0.0}
    assert samples(before, RATE) == {'{method="ngram"}': 0.0}
    # the copy first: a fresh engine verifies its guesses before it has timed any
    for prompt in (COPY, CODE, STORY):
        want, got = complete(plain, prompt), complete(spec, prompt)
        assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt
        assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        assert got["usage"] == want["usage"]
    text = httpx.get(f"{spec}/metrics").text
    [draft] = samples(text, DRAFT).values()
    [accepted] = samples(text, ACCEPTED).values()
    [drafts] = samples(text, DRAFTS).values()
    [rate] = samples(text, RATE).values()
    assert 0 < accepted <= draft  # the copy's guesses were taken
    assert 0 < drafts <= draft
    assert rate == pytest.approx(accepted / draft)
    # a server without speculation shows none of its series
    assert not samples(httpx.get(f"{plain}/metrics").text, DRAFT)


def test_bad_speculative_options_are_one_line_errors():
    for args, word in (
        (["--speculative", "draft"], "--speculative"),
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli", "serve", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        [line] = r.stderr.strip().splitlines()
        assert r.returncode == 2 and word in line and "(see tokenmill serve --help)" in line


class SpeculatingLoads(Loads):
    """Loads whose engines speculate on every match (the adaptive gate off)."""

    def load(self, name: str) -> AsyncEngine:
        with self._lock:
            self.count[name] += 1
        engine = LLMEngine(
            self.folders[name], kv_cache_memory=self.kv, threads=1, speculative=FORCED
        )
        return AsyncEngine(engine)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    for name, seed in (("a", 1), ("b", 2)):
        build_hf_model("llama", root / name, seed=seed)
    return {name: root / name for name in "ab"}


def test_a_pool_labels_speculation_by_model_and_method(folders):
    """Two tiny models speculating behind one server: each one's counters under its own
    model label, beside the method, one header per metric."""
    pool = ModelPool(SpeculatingLoads(folders).models())
    body = {"prompt": "t5 t6 t7 t5 t6 t7 t5 t6", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with serving(pool) as url:
        for name in "ab":
            r = httpx.post(f"{url}/v1/completions", json={**body, "model": name}, timeout=300)
            assert r.status_code == 200, r.text
        text = httpx.get(f"{url}/metrics").text
        engines = {name: pool.slots[name].engine.engine for name in "ab"}
    stats = {name: engine.speculative_stats() for name, engine in engines.items()}
    for metric in (DRAFT, ACCEPTED, DRAFTS, RATE):
        assert text.count(f"# TYPE {metric} ") == 1
    draft, accepted = samples(text, DRAFT), samples(text, ACCEPTED)
    for name in "ab":
        labels = f'{{model="{name}",method="ngram"}}'
        assert draft[labels] == stats[name]["speculative_proposed_tokens"]
        assert accepted[labels] == stats[name]["speculative_accepted_tokens"]
    assert sum(draft.values()) > 0  # the prompt's repeats were looked up and guessed
    # the KV gauge too, per model: one slot's bytes in every layer's K and V tensors
    kv = samples(text, "tokenmill_kv_cache_bytes_per_token")
    for name, engine in engines.items():
        per_slot = sum(t[0].nbytes for t in engine.cache.k + engine.cache.v)
        assert kv[f'{{model="{name}"}}'] == per_slot
