"""Tensor and pipeline parallelism (tokenmill/distributed) on 2 gloo processes over
loopback, against the single-process engine on the same weights: greedy tokens
identical, the log-probabilities of every chosen token and of the top alternatives equal
within float tolerance (the logits themselves, as the sampler sees them).

The tolerance depends on the weights. Float weights: 1e-4. Packed weights quantize each
layer's input to 16 bits, so a sum taken in another order (tensor parallelism adds the
ranks' partial products after the fact) can move a value across a rounding step of the
next layer's quantization: ~1e-2, as between the decode kernel and the prefill GEMM of
one process (layers/native_linear.py). Pipeline parallelism keeps every sum's order but
runs a step in micro-batches, and packed weights already differ by ~1e-3 between batch
compositions on one process (one sequence at a time against all together)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import build_hf_model

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.distributed.plan import PlanError, pp_plan, split, tp_plan

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [3, 4]]  # decode rows and prefill chunks
# family -> build_hf_model overrides; K/V heads fewer than the ranks for qwen3 and gemma3
FAMILIES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-mqa": ("qwen3", {"num_key_value_heads": 1}),
    "gemma3": ("gemma3", {}),
    "gpt2": ("gpt2", {}),
}


def _assert_same(ref, got, atol: float) -> None:
    """The same greedy tokens and log-probabilities, up to a near tie: where the two runs
    pick different tokens, both must be within atol of each other in both runs (the
    float sums run in another order across ranks; a random tiny model has ties within
    1e-4, e.g. 159 vs 291 at -3.0003 / -3.0004 on AVX-512), and the texts part there."""
    for r, g in zip(ref, got, strict=True):
        lps = r.outputs[0].logprobs, g.outputs[0].logprobs
        steps = zip(r.token_ids, g.token_ids, *lps, strict=True)
        for rt, gt, a, b in steps:
            if rt != gt:  # a near tie, then the continuations differ
                for lp in (a, b):
                    assert rt in lp.top and gt in lp.top, (rt, gt, lp.top)
                    assert abs(lp.top[rt] - lp.top[gt]) < atol, (rt, gt, lp.top)
                break
            assert abs(a.logprob - b.logprob) < atol
            # the alternatives: the same ones, but for a near tie at the cut-off
            common = a.top.keys() & b.top.keys()
            assert len(common) >= len(a.top) - 1
            assert all(abs(a.top[k] - b.top[k]) < atol for k in common)


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("quantization", ["float", "q4"])
def test_two_ranks_equal_one_process(tmp_path, name, mode, quantization):
    arch, overrides = FAMILIES[name]
    build_hf_model(arch, tmp_path, **overrides)
    kw = dict(kv_cache_memory="2048tok", quantization=quantization)
    ref = LLM(tmp_path, **kw).generate(PROMPTS, PARAMS)
    par = LLM(tmp_path, **kw, **{f"{mode}_parallel_size": 2})
    try:
        assert par.engine.parallel.world == 2
        _assert_same(ref, par.generate(PROMPTS, PARAMS), 1e-4 if quantization == "float" else 3e-2)
    finally:
        par.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_real_model_two_ranks(smollm_path, mode):
    """SmolLM2's 9 query heads in 3 K/V groups go 6 + 3; its Q4_1 blocks are cut in the
    file's encoding (each rank packs only its part)."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    ref = LLM(smollm_path, kv_cache_memory="64MiB").generate(prompts, params)
    par = LLM(smollm_path, kv_cache_memory="64MiB", **{f"{mode}_parallel_size": 2})
    try:
        if mode == "tensor":
            assert "query heads 0-5" in par.engine.describe()
            assert par.engine.quantization == "gguf"
        _assert_same(ref, par.generate(prompts, params), 5e-2)
    finally:
        par.engine.close()


# ------------------------------------------------------------------ the plan


def _cfg(H: int, Hkv: int, f: int = 1536, vocab: int = 49152) -> ModelConfig:
    return ModelConfig("llama", vocab, 576, f, 4, H, Hkv, 64)


def test_tp_plan_deals_whole_kv_groups():
    a, b = tp_plan(_cfg(9, 3), 2)
    assert (a.q_heads, a.kv_heads, b.q_heads, b.kv_heads) == ((0, 6), (0, 2), (6, 9), (2, 3))
    assert a.mlp == (0, 768) and b.mlp == (768, 1536)  # 256-aligned for K-quant blocks
    assert a.vocab == (0, 24576) and b.vocab == (24576, 49152)


def test_tp_plan_replicates_kv_heads_when_fewer_than_ranks():
    shards = tp_plan(_cfg(8, 1), 4)
    assert [s.kv_heads for s in shards] == [(0, 1)] * 4
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(PlanError, match="K/V heads"):
        tp_plan(_cfg(6, 2), 3)  # 3 ranks over 2 K/V heads: neither divides


def test_tp_refuses_a_qk_norm_over_the_whole_projection():
    """OLMo 2's q/k norms take one RMS over every head: a rank holding some heads cannot."""
    cfg = _cfg(8, 2)
    cfg.qk_norm = "full"
    with pytest.raises(PlanError, match="whole projection"):
        tp_plan(cfg, 2)
    assert len(tp_plan(cfg, 1)) == 1  # one rank holds every head: nothing to cut


def test_split_and_pp_plan():
    assert split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split(1536 + 32, 2, 256) == [(0, 768), (768, 1568)]  # remainder to the last
    stages = pp_plan(_cfg(9, 3), 2)
    assert [s.layers for s in stages] == [(0, 2), (2, 4)]
    assert stages[0].first and stages[1].last
    with pytest.raises(PlanError, match="pipeline stages"):
        pp_plan(_cfg(9, 3), 5)


def test_a_stage_keeps_its_layers_entries_and_tp_refuses_experts():
    """A pipeline stage's config keeps its own layers' entries of every per-layer list
    (an MoE stage once kept all of moe_layers and failed validation); tensor parallelism
    refuses MoE models (every rank held every expert and the all-reduce summed them
    once per rank: wrong output)."""
    from tokenmill.distributed.plan import pp_local_config

    cfg = ModelConfig(
        "qwen3_moe", 64, 72, 96, 4, 4, 2, 16, num_experts=5, num_experts_per_tok=2,
        moe_intermediate_size=40, moe_layers=[True, False, True, True],
        rope_layers=[True, True, False, True], layer_types=["full", "sliding"] * 2,
        sliding_window=8,
    )  # fmt: skip
    a, b = (pp_local_config(cfg, stage) for stage in pp_plan(cfg, 2))
    assert (a.moe_layers, a.rope_layers, a.layer_types) == (
        [True, False],
        [True, True],
        ["full", "sliding"],
    )
    assert (b.moe_layers, b.rope_layers, b.layer_types) == (
        [True, True],
        [False, True],
        ["full", "sliding"],
    )
    assert set(ModelConfig.PER_LAYER) == {
        name
        for name, value in vars(cfg).items()
        if isinstance(value, list) and name.endswith(("_layers", "_types"))
    }
    with pytest.raises(PlanError, match="Mixture-of-Experts"):
        tp_plan(cfg, 2)


def test_parallel_arguments_are_checked(tmp_path):
    build_hf_model("llama", tmp_path)
    with pytest.raises(ValueError, match="not both"):
        LLM(tmp_path, tensor_parallel_size=2, pipeline_parallel_size=2)


# ------------------------------------------------------------------ the server


@pytest.mark.slow
def test_server_with_two_ranks_streams_and_dies_loudly(smollm_path):
    """`tokenmill serve --tensor-parallel-size 2`: the official client streams greedy
    tokens identical to one process; killing the worker mid-stream ends that stream with
    one clean line naming the rank (no gloo text, source path or port: those go to the
    log), then the server within seconds, with that line, leaving no process behind."""
    import httpx
    from openai import OpenAI
    from server_fixture import server_process, sse_events

    args = (
        "--model",
        str(smollm_path),
        "--kv-cache-memory",
        "64MiB",
        "--tensor-parallel-size",
        "2",
    )
    with server_process(*args) as server:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
        model = client.models.list().data[0].id
        stream = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=12, temperature=0,
            stream=True,
        )  # fmt: skip
        text = "".join(c.choices[0].text for c in stream)
        [ref] = LLM(smollm_path, kv_cache_memory="64MiB").generate(
            "The capital of France is", SamplingParams(max_tokens=12, temperature=0)
        )
        assert text == ref.text
        workers = _children(server.pid)
        assert len(workers) == 1
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
            events = sse_events(r)
            assert next(events)["choices"][0]["text"] is not None  # generating
            os.kill(workers[0], signal.SIGKILL)
            start = time.monotonic()
            rest = list(events)
        assert rest[-1] == "[DONE]", rest[-3:]
        message = rest[-2]["error"]["message"]
        assert "tensor-parallel rank 1 died (exit code -9, SIGKILL)" in message, message
        assert "\n" not in message and "gloo" not in message.lower() and "/" not in message
        code = server.proc.wait(timeout=30)
        assert time.monotonic() - start < 10 and code != 0
        log = server.log()
        assert "tensor-parallel rank 1 died" in log
        time.sleep(1)
        assert not [p for p in _children(server.pid) if _alive(p)]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    kids = [int(x) for x in out.stdout.split()]
    # the worker is the child that runs tokenmill.distributed.worker (it holds the model:
    # the larger RSS, should anything else, e.g. a compiler, run beside it)
    return sorted(kids, key=lambda p: -_rss(p))[:1]


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
