"""The Python API and the CLI on the real default model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import RequestError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smollm_path):
    return LLM(smollm_path, kv_cache_memory="256MiB")


def test_generate_paris(llm):
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.text.startswith(" Paris")
    # greedy: " Paris." and the model goes on, so the 8-token budget ends it
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert out.timings.time_to_first_token > 0


def test_stream_equals_generate(llm):
    params = SamplingParams(max_tokens=24, temperature=0)
    deltas = list(llm.stream("Write a haiku about the sea.", params))
    assert len(deltas) > 3
    assert "".join(deltas) == llm.generate("Write a haiku about the sea.", params)[0].text


def test_stop_string_across_token_boundary_never_printed(llm):
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0]
    ids = full.token_ids
    pieces = [llm.tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    # a stop string made of the end of token 0 and the start of token 1: " Paris" + "."
    first = pieces[0]
    second = pieces[1][len(first) :]
    assert len(first) > 1 and second
    stop = first[-2:] + second[:1]
    params = SamplingParams(max_tokens=8, temperature=0, stop=[stop])
    streamed = list(llm.stream(prompt, params))
    expected = first[:-2]
    assert "".join(streamed) == expected
    assert all(stop[:1] not in d for d in streamed[-1:])  # not even its first half leaked
    out = llm.generate(prompt, params)[0]
    assert out.text == expected and out.finish_reason == "stop"


def test_seed_reproducible(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    a = llm.generate("Once upon a time", params)[0].text
    b = llm.generate("Once upon a time", params)[0].text
    c = llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=1.0, seed=99))[
        0
    ].text
    assert a == b and a != c


def test_logprobs(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for lp, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy: chosen is the top


def test_chat(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=20, temperature=0),
    )
    assert "Paris" in out.text


def test_prompt_too_long_is_a_clear_error(llm):
    with pytest.raises(RequestError, match="more than the model's context"):
        llm.generate(list(range(10, 10 + llm.engine.max_model_len + 5)), SamplingParams())
    # and the engine still works afterwards
    assert llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def _cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_generate():
    r = _cli("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr and "time to first token" in r.stderr


def test_cli_chat_answers_and_exits_on_eof():
    r = _cli(
        "chat", "--max-tokens", "24", "--temperature", "0", stdin="What is the capital of France?\n"
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_cli_errors_are_one_line():
    r = _cli("generate", "hi", "--model", "/no/such/model.gguf")
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("tokenmill: error:") and "Traceback" not in r.stderr
    r = _cli("generate", "hi", "--top-p", "1.5")
    assert r.returncode != 0 and "--top-p" in r.stderr and "Traceback" not in r.stderr
