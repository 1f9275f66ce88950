"""`tokenmill serve --kv-cache-dtype`: each dtype the engine offers is
served by a real server on loopback with the real default model, /metrics shows its bytes
per token, and the 16-bit caches answer greedy completions as the float32 cache does."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from server_fixture import running_server
from test_serve_speculative import samples

from tokenmill import hub
from tokenmill.engine.build import KV_CACHE_DTYPES
from tokenmill.loader import open_checkpoint

ARGS = ("--kv-cache-memory", "4096tok", "--threads", "1", "--log-level", "warning")
GAUGE = "tokenmill_kv_cache_bytes_per_token"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
# bytes of one cached value: 16-bit floats, or q8_0's blocks of 32 values in 34 bytes
VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "q8_0": 34 / 32}


def expected_bytes(dtype: str) -> int:
    """K and V of one token over all layers, from the default model's config."""
    cfg = open_checkpoint(hub.resolve_model(None)).config
    return int(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * VALUE_BYTES[dtype])


def greedy(url: str, prompt: str) -> list[str]:
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def float32_url():
    with running_server(*ARGS) as url:  # auto: the activations' float32
        yield url


@pytest.mark.slow
def test_auto_is_float32_and_its_bytes(float32_url):
    text = httpx.get(f"{float32_url}/metrics").text
    assert samples(text, GAUGE) == {"": expected_bytes("float32")}
    [info] = [ln for ln in text.splitlines() if ln.startswith("tokenmill_build_info{")]
    assert 'kv_cache_dtype="float32"' in info


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [d for d in KV_CACHE_DTYPES if d not in ("auto", "float32")])
def test_each_dtype_served_with_its_bytes_per_token(float32_url, dtype):
    with running_server(*ARGS, "--kv-cache-dtype", dtype) as url:
        text = httpx.get(f"{url}/metrics").text
        assert samples(text, GAUGE) == {"": expected_bytes(dtype)}
        [info] = [ln for ln in text.splitlines() if ln.startswith("tokenmill_build_info{")]
        assert f'kv_cache_dtype="{dtype}"' in info
        got = [greedy(url, prompt) for prompt in PROMPTS]
    assert all(len(tokens) == 64 for tokens in got)
    if dtype in ("float16", "bfloat16"):  # the engine's bound: greedy identical for 64 tokens
        assert got == [greedy(float32_url, prompt) for prompt in PROMPTS]


def test_an_unknown_dtype_is_a_one_line_error_naming_the_choices():
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--port", "0", "--kv-cache-dtype", "int8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    [line] = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "--kv-cache-dtype" in line and "int8" in line
    assert ", ".join(KV_CACHE_DTYPES) in line
