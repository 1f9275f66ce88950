"""The KV cache in 16 and 8 bits: `kv_cache_dtype` float16 / bfloat16
holds twice the tokens of a float32 pool in the same memory, q8_0 (llama.cpp's blocks: 34
bytes per 32 values) 128/34 = 3.76 times; each decodes on the native paths (the kernels
read and write the same K/V as torch: tests/test_fused_decode.py checks the 16-bit ones on
every build, this file the q8_0 one), and on the real default model gives the float32
cache's greedy tokens."""

from __future__ import annotations

import random

import pytest
import test_fused_decode
import torch
from helpers import build_hf_model
from kernel_builds import BUILDS, use_build
from test_fused_decode import CASES, TWEAKS, _count_calls, _run

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.checks import ParamError
from tokenmill.dtypes import Q8_0, dequantize_q8_0, quantize_q8_0
from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.models import paths

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv") / "qwen3"
    build_hf_model("qwen3", folder, initializer_range=0.05)
    return folder


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_a_16_bit_cache_holds_twice_the_tokens_and_decodes_natively(tiny, name):
    full = LLM(tiny, kv_cache_memory="256KiB")
    half = LLM(tiny, kv_cache_memory="256KiB", kv_cache_dtype=name)
    assert half.engine.cache.dtype == getattr(torch, name)
    assert half.engine.cache.bytes_per_token * 2 == full.engine.cache.bytes_per_token
    blocks = full.engine.cache.num_blocks  # 2x, or one more where 256 KiB left one over
    assert half.engine.cache.num_blocks in (2 * blocks, 2 * blocks + 1)
    assert f"{name}, {half.engine.cache.bytes_per_token} bytes per token" in half.engine.describe()
    assert half.engine.model.decode_path().name == paths.STACK
    # the logits of the first decode steps stay within 16-bit rounding of float32's
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    a = full.generate([prompt], params)[0]
    b = half.generate([prompt], params)[0]
    step = 2.0**-11 if name == "float16" else 2.0**-8
    for la, lb in zip(a.logprobs, b.logprobs, strict=True):
        if la.token_id != lb.token_id:
            break  # a near tie resolved the other way: later steps see other tokens
        assert abs(la.logprob - lb.logprob) < 200 * step


def test_auto_is_the_activations_dtype_and_a_bad_name_is_refused(tiny):
    assert LLM(tiny, kv_cache_memory="64tok").engine.cache.dtype == torch.float32
    with pytest.raises(
        ParamError, match="kv_cache_dtype must be one of auto, float32, float16, bfloat16, q8_0"
    ):
        LLM(tiny, kv_cache_dtype="int8")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_default_model_gives_the_float32_caches_tokens(smollm_path, name):
    """The issue's bound: greedy tokens identical to the float32 cache's for 64 tokens on
    the real default model."""
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    full = LLM(smollm_path, kv_cache_memory="4096tok")
    half = LLM(smollm_path, kv_cache_memory="4096tok", kv_cache_dtype=name)
    for prompt in prompts:
        want = full.generate([prompt], params)[0].token_ids
        assert half.generate([prompt], params)[0].token_ids == want, prompt


# ---- q8_0 ----


def test_q8_0_blocks_round_trip_within_half_a_step():
    """Each value comes back within half its block's step d = max|x| / 127 (plus d's own
    float16 rounding); a zero block stays zero; the bytes are llama.cpp's layout."""
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, :32] = 0
    b = quantize_q8_0(x)
    assert b.dtype == torch.uint8 and b.shape == (5, 3, 68)
    y = dequantize_q8_0(b)
    d = x.reshape(5, 3, 2, 32).abs().amax(-1, keepdim=True) / 127  # [5, 3, 2, 1]
    err = (x - y).reshape(5, 3, 2, 32).abs()
    assert (err <= d * (0.5 + 2.0**-10) + 127 * d * 2.0**-11).all()
    assert (y[0, 0, :32] == 0).all()
    # block 1 of row (1, 2): float16 d in bytes 0-1, then the int8 q
    blk = b[1, 2, 34:68]
    scale = blk[:2].view(torch.float16).float()
    assert torch.allclose(blk[2:].view(torch.int8).float() * scale, y[1, 2, 32:])


def test_q8_0_cache_holds_3_76_times_the_tokens_and_decodes_natively(tiny):
    full = LLM(tiny, kv_cache_memory="256KiB")
    q8 = LLM(tiny, kv_cache_memory="256KiB", kv_cache_dtype="q8_0")
    cache = q8.engine.cache
    assert cache.dtype == Q8_0 and cache.k[0].dtype == torch.uint8
    assert cache.bytes_per_token * 128 == full.engine.cache.bytes_per_token * 34
    assert cache.num_blocks == int(256 * 1024 // cache.bytes_per_token) // 16
    assert f"q8_0, {cache.bytes_per_token} bytes per token" in q8.engine.describe()
    assert q8.engine.model.decode_path().name == paths.STACK
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    a = full.generate([prompt], params)[0]
    b = q8.generate([prompt], params)[0]
    for la, lb in zip(a.logprobs, b.logprobs, strict=True):
        if la.token_id != lb.token_id:
            break
        assert abs(la.logprob - lb.logprob) < 0.1  # q8_0's steps are 2^-7 of a block's max


def test_q8_0_needs_a_head_dim_of_32s(tmp_path):
    build_hf_model("llama", tmp_path)  # head_dim 16
    with pytest.raises(ParamError, match="kv_cache_dtype q8_0 needs a head_dim that is a multiple"):
        LLM(tmp_path, kv_cache_dtype="q8_0")


def _engine_tokens(engine: LLMEngine, prompts, params) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
        engine.blocks.check_invariants([s.block_table for s in engine.scheduler.running])
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_q8_0_blocks_survive_preemption(tiny):
    """Preempted sequences recompute their K/V into q8_0 blocks: the prefill attends over
    the quantized chunk as decode steps do, so the tokens equal an unpreempted run's."""
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 300) for _ in range(rng.randrange(20, 40))] for _ in range(12)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    small = LLMEngine(tiny, kv_cache_memory="160tok", block_size=8, kv_cache_dtype="q8_0")
    together = _engine_tokens(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert small.blocks.num_free == small.blocks.num_blocks
    big = LLMEngine(tiny, kv_cache_memory="4096tok", kv_cache_dtype="q8_0")
    assert together == [_engine_tokens(big, [p], params)[0] for p in prompts]


def test_q8_0_blocks_serve_the_prefix_cache(tiny):
    rng = random.Random(7)
    prefix = [rng.randrange(2, 300) for _ in range(200)]
    first, second = prefix + [5, 6, 7], prefix + [rng.randrange(2, 300) for _ in range(21)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM(tiny, kv_cache_memory="4096tok", kv_cache_dtype="q8_0")
    llm.generate([first], params)
    before = llm.engine.stats["prefill_tokens_computed"]
    out = llm.generate([second], params)[0]
    assert llm.engine.stats["prefill_tokens_computed"] - before == 21 + 200 % 16
    assert out.num_cached_tokens == 200 // 16 * 16
    uncached = LLM(
        tiny, kv_cache_memory="4096tok", kv_cache_dtype="q8_0", enable_prefix_caching=False
    )
    assert out.token_ids == uncached.generate([second], params)[0].token_ids


# The native q8_0 path against the torch one, on every kernel build. Both quantize the same
# way (dtypes.quantize_q8_0 = attention.c's kv_store), but their float32 k (RoPE, norms)
# may differ in its last bit, which now and then moves a value to the neighbouring int8 step
# or its block's float16 scale by one step: the bound is one q8_0 step, 2^-7 of the block's
# largest value, still far below what a wrong read or write (a misplaced block, a lost
# scale) gives.
Q8_STEP = 2.0**-7 / 1e-5  # test_fused_decode's float32 bounds (1e-5, 1e-4) times this
Q8_CASES = {  # head_dim 32 for all: q8_0 blocks never straddle heads
    "llama-gqa": dict(head_dim=32),
    "qwen3-mqa-qknorm": {},
    "gemma3-sliding": {},
    "llama-sinks": dict(head_dim=32),
}


@pytest.fixture(params=BUILDS)
def kbuild(request, monkeypatch):
    use_build(monkeypatch, request.param)
    return request.param


def _q8_case(name: str, folder, **extra) -> dict:
    arch, overrides = CASES[name]
    build_hf_model(
        arch,
        folder,
        **{k: v for k, v in overrides.items() if k not in TWEAKS},
        **Q8_CASES[name],
        **extra,
    )
    return {k: v for k, v in overrides.items() if k in TWEAKS}


def _assert_close(ref, got) -> None:
    for (ref_logits, ref_attn), (got_logits, got_attn) in zip(ref, got, strict=True):
        for a, b in zip(ref_attn, got_attn, strict=True):
            assert (a - b).abs().max().item() < 1e-5 * Q8_STEP * max(1.0, a.abs().max().item())
        assert (ref_logits - got_logits).abs().max().item() < 1e-4 * Q8_STEP


def _record_caches(monkeypatch) -> list[KVCache]:
    """Keep every KVCache test_fused_decode._run makes (so a test can read its bytes)."""
    made: list[KVCache] = []

    def keep(*args, **kwargs) -> KVCache:
        made.append(KVCache(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(test_fused_decode, "KVCache", keep)
    return made


@pytest.mark.skipif(kernels.library() is None, reason="native kernels unavailable")
@pytest.mark.parametrize("name", list(Q8_CASES))
def test_native_q8_0_decode_matches_torch(kbuild, tmp_path, monkeypatch, name):
    tweaks = _q8_case(name, tmp_path)
    calls = _count_calls(monkeypatch, kernels, "decode_attention")
    caches = _record_caches(monkeypatch)
    ref = _run(tmp_path, False, monkeypatch, tweaks, kv=Q8_0)
    assert not calls
    got = _run(tmp_path, True, monkeypatch, tweaks, kv=Q8_0)
    assert len(calls) == 7 * len(got[0][1])  # every decode step, every layer
    _assert_close(ref, got)
    # the bytes themselves: layer 0's v rows reach both writers as the same float32 (the
    # projection is torch's in both runs), so every q8_0 block matches; its k rows went
    # through two RoPEs, so a last-bit difference may move a value by one step, rarely
    torch_cache, native_cache = caches
    assert torch.equal(torch_cache.v[0], native_cache.v[0])
    same = (torch_cache.k[0] == native_cache.k[0]).float().mean().item()
    assert same > 0.99, same


@pytest.mark.skipif(kernels.library() is None, reason="native kernels unavailable")
def test_native_q8_0_split_context_matches_torch(kbuild, tmp_path, monkeypatch):
    """1,100- and 700-token contexts on 4 threads: the flash-decoding split over q8_0."""
    tweaks = _q8_case("llama-gqa", tmp_path, max_position_embeddings=2048)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        args = (monkeypatch, tweaks, None, 2, Q8_0, (1100, 700))
        ref, got = _run(tmp_path, False, *args), _run(tmp_path, True, *args)
    finally:
        torch.set_num_threads(threads)
    _assert_close(ref, got)


NEAR_TIE = 0.1  # nats between float32's best two tokens where q8_0 may choose the other


@pytest.mark.slow
def test_default_model_q8_0_logits_and_greedy_tokens(smollm_path):
    """The issue's bound on the real default model, 64 greedy tokens on 3 prompts: while
    the tokens agree, the chosen token's log-probability under a q8_0 cache stays within
    0.25 nats of the float32 cache's and every shared top-5 token's within 0.75 (measured:
    0.09 and 0.54); and the tokens agree up to a near tie of float32's (its best two
    within NEAR_TIE), if they part at all. Measured: identical on "The capital of France
    is" and "Once upon a time"; "def fibonacci(n):" parts at token 53, where float32's
    best two are 0.015 nats apart."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    full = LLM(smollm_path, kv_cache_memory="4096tok")
    q8 = LLM(smollm_path, kv_cache_memory="4096tok", kv_cache_dtype="q8_0")
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=5)
    for prompt in prompts:
        a = full.generate([prompt], params)[0]
        b = q8.generate([prompt], params)[0]
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            if la.token_id != lb.token_id:
                best, second = sorted(la.top.values(), reverse=True)[:2]
                assert best - second < NEAR_TIE, (prompt, la, lb)
                break
            assert abs(la.logprob - lb.logprob) < 0.25, (prompt, la, lb)
            for tok in la.top.keys() & lb.top.keys():
                assert abs(la.top[tok] - lb.top[tok]) < 0.75, (prompt, tok)


# ---- the CLI ----


def test_generate_takes_kv_cache_dtype_and_prints_bytes_per_token(tiny, capsys):
    from tokenmill.cli import main

    main(["generate", "t5 t6 t7", "--model", str(tiny), "--max-tokens", "4"])
    main(["generate", "t5 t6 t7", "--model", str(tiny), "--max-tokens", "4", "--kv-cache-dtype", "q8_0"])  # fmt: skip
    err = capsys.readouterr().err
    full = LLM(tiny, kv_cache_memory="64tok").engine.cache.bytes_per_token
    assert f"float32, {full} bytes per token" in err
    assert f"q8_0, {full * 34 // 128} bytes per token" in err


@pytest.mark.parametrize(
    "command,value,words",
    [
        ("generate", "int4", "must be one of auto, float32, float16, bfloat16, q8_0, got 'int4'"),
        ("chat", "q8_0", "q8_0 needs a head_dim that is a multiple of 32; this model's is 16"),
    ],
)
def test_a_kv_cache_dtype_that_cannot_work_is_one_line_before_loading(
    tmp_path, capsys, command, value, words
):
    from tokenmill.cli import main

    build_hf_model("llama", tmp_path)  # head_dim 16
    capsys.readouterr()  # the build's progress bar
    args = [command, *(["hi"] if command == "generate" else []), "--model", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        main([*args, "--kv-cache-dtype", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --kv-cache-dtype: {words}" in err and err.count("\n") == 1
