"""activation_bits (engine/build.py set_activation_bits): what the packed layers' kernels
quantize activations to, per 32 values, before the integer dot.

16 (the default) keeps greedy tokens the float model's, which the parity tests against
transformers need; 8 is llama.cpp's q8 scheme, so it is checked against llama.cpp on the
same GGUF file: its logits move toward llama.cpp's, its greedy tokens agree but for a
near tie, and batching never changes a sequence's tokens.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_same_greedy_but_ties, build_hf_model, llama_cpp_greedy

from tokenmill.bench import shapes
from tokenmill.checks import ParamError
from tokenmill.llm import LLM
from tokenmill.sampling import SamplingParams

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
TINY = dict(arch="llama", d=256, f=512, layers=3, heads=4, kv=2, vocab=300,
            theta=10000.0, qkv_bias=False, tied=True)  # fmt: skip
PROMPT = list(range(5, 29))


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """A tiny Llama layout in the types llama.cpp's q8 activations pair with (Q8_0,
    Q4_0) and in Q4_K_M (its activations are 8-bit there too, in 256-blocks)."""
    folder = tmp_path_factory.mktemp("act8")
    saved = shapes.DENSE.get("tiny")
    shapes.DENSE["tiny"] = TINY
    try:
        files = {}
        for ftype in ("q8_0", "q4_0", "q4_k_m"):
            files[ftype] = folder / f"tiny-{ftype}.gguf"
            shapes.write("tiny", ftype, files[ftype], seed=5)
    finally:
        if saved is None:
            del shapes.DENSE["tiny"]
        else:
            shapes.DENSE["tiny"] = saved
    return files


def test_a_bad_value_is_refused_before_loading(tmp_path):
    with pytest.raises(ParamError, match=r"^activation_bits must be 8 or 16, got 7$") as e:
        LLM(tmp_path / "not-even-there.gguf", activation_bits=7)
    assert e.value.param == "activation_bits"


def test_float_weights_refuse_8_bits(tmp_path):
    """A float checkpoint has no packed layers: 8 bits would silently change nothing."""
    build_hf_model("llama", tmp_path, seed=0)
    with pytest.raises(ParamError, match=r"^activation_bits 8 applies to weights packed"):
        LLM(tmp_path, activation_bits=8, kv_cache_memory="64tok")
    assert LLM(tmp_path, kv_cache_memory="64tok").engine.info()["activation_bits"] == "16"


def _first_logprobs(llm: LLM, k: int = 8) -> dict[int, float]:
    """Our log-probabilities of the top k next tokens after PROMPT."""
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=k)
    out = llm.generate([PROMPT], params)[0]
    return {out.token_ids[0]: out.logprobs[0].logprob, **out.logprobs[0].top}


def _llama_cpp_logprobs(path) -> torch.Tensor:
    from llama_cpp import Llama

    peer = Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    peer.eval(PROMPT)
    return torch.log_softmax(torch.tensor(peer.scores[len(PROMPT) - 1]), dim=-1)


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("ftype", ["q8_0", "q4_0"])
def test_8_bits_take_effect_and_stay_near_llama_cpp(tiny_files, ftype):
    """The option reaches the kernels (the log-probabilities move), and both precisions
    stay within a few hundredths of llama.cpp's on the same file. (Not nearer at 8 bits:
    llama.cpp rounds each block's activation scale to float16, tokenmill keeps float32.)"""
    path = tiny_files[ftype]
    theirs = _llama_cpp_logprobs(path)
    ours = {}
    for bits in (16, 8):
        llm = LLM(path, activation_bits=bits, kv_cache_memory="64tok")
        assert llm.engine.info()["activation_bits"] == str(bits)
        ours[bits] = _first_logprobs(llm)
        error = max(abs(lp - float(theirs[t])) for t, lp in ours[bits].items())
        assert error < 0.05, (bits, error)
    assert ours[8] != ours[16]


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("prompt_len", [24, 150])
@pytest.mark.parametrize("ftype", ["q8_0", "q4_0", "q4_k_m"])
def test_8_bits_greedy_agrees_with_llama_cpp(tiny_files, ftype, prompt_len):
    """Prompts of 24 rows and more are prefilled by the integer GEMM (on VNNI CPUs its
    8-bit vpdpbusd form), the continuation by the GEMV: both against llama.cpp's own
    8-bit arithmetic on the same file."""
    path = tiny_files[ftype]
    prompt = PROMPT if prompt_len == len(PROMPT) else [5 + (7 * i) % 290 for i in range(prompt_len)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    ours = LLM(path, activation_bits=8, kv_cache_memory="256tok").generate([prompt], greedy)[0]
    assert_same_greedy_but_ties(ours, llama_cpp_greedy(path, prompt, 12), tol=0.05)


def test_8_bits_batched_equals_one_at_a_time(tiny_files):
    """Rows of a batch go through the GEMM and the many-row GEMV, a lone row through the
    one-row GEMV: the same 8-bit integers and sums, so the same tokens."""
    llm = LLM(tiny_files["q4_k_m"], activation_bits=8, kv_cache_memory="1024tok")
    prompts = [list(range(5 + i, 5 + i + 7 + 3 * i)) for i in range(6)]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, greedy)]
    alone = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    assert together == alone


def test_cli_takes_activation_bits(tiny_files):
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "generate", "t5 t6 t7", "--model",
         str(tiny_files["q8_0"]), "--activation-bits", "8", "--max-tokens", "4",
         "--temperature", "0"],
        capture_output=True, text=True, timeout=300, env={**os.environ},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
