"""The native decode paths (models/paths.py) equal the torch path.

Same steps run twice, with tokenmill.models.paths.NATIVE_DECODE on and off: several
sequences of different lengths (contexts over several 16-token blocks) decoding together,
then a mixed step (decode rows plus a prefill chunk). Compared: every layer's attention
output (the o projection's input) and the logits. With native weights, the pure decode
steps run every layer in one native call (the stack, models/native_model.py); compared:
the logits. Every test runs on each kernel build the host can execute.
"""

from __future__ import annotations

import pytest
import torch
from helpers import build_hf_model
from kernel_builds import BUILDS, use_build

from tokenmill import kernels
from tokenmill.config import RopeConfig
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.engine.sequence import Sequence
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import Rotary
from tokenmill.loader import open_checkpoint
from tokenmill.models import paths
from tokenmill.models.native_model import NativeModel
from tokenmill.models.transformer import Transformer

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="native kernels unavailable")

CASES = {
    "llama-gqa": ("llama", {}),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "qwen3-mqa-qknorm": ("qwen3", dict(num_key_value_heads=1)),
    "qwen3-gqa-qknorm": ("qwen3", {}),
    "gemma3-sliding": ("gemma3", {}),
    "gpt2-no-rotary": ("gpt2", {}),
    "llama-partial-rotary": ("llama", dict(partial_rotary=16)),
    # switches of the newer families, set on a loaded Llama (see _tweak): Gemma 2's score
    # soft-cap, OLMo 2's Q/K norms over the whole projection, Granite's residual scale
    "llama-softcap": ("llama", dict(softcap=0.5)),
    "llama-qk-norm-full": ("llama", dict(qk_full=True)),
    "llama-residual-scale": ("llama", dict(residual_scale=0.5)),
    # gpt-oss's attention sinks: a logit per head in each softmax
    "llama-sinks": ("llama", dict(sinks=1.5)),
}
TWEAKS = ("partial_rotary", "softcap", "qk_full", "residual_scale", "sinks")


def _tweak(model: Transformer, tweaks: dict) -> None:
    """Give a loaded model a family's switch that its checkpoint has no setting for; the
    torch path and the native descriptors (built later) both read these attributes."""
    cfg, gen = model.cfg, torch.Generator().manual_seed(2)
    dim = tweaks.get("partial_rotary")
    rotary = Rotary(RopeConfig(dim=dim), cfg.head_dim, 512) if dim else None
    for layer in model.layers:
        a = layer.attn
        if rotary is not None:
            a.rotary = rotary
        if "softcap" in tweaks:  # small: most scores of these random weights are capped
            a.softcap = tweaks["softcap"]
        if "qk_full" in tweaks:
            a.q_norm, a.k_norm = (
                RMSNorm(cfg.q_size, cfg.norm_eps),
                RMSNorm(cfg.kv_size, cfg.norm_eps),
            )
            for norm in (a.q_norm, a.k_norm):
                norm.weight.data = 0.5 + torch.rand(norm.weight.shape, generator=gen)
            a.qk_norm_full = True
        if "residual_scale" in tweaks:
            layer.residual_scale = tweaks["residual_scale"]
        if "sinks" in tweaks:  # large enough to take much of each softmax
            a.sinks = torch.nn.Parameter(
                tweaks["sinks"] * torch.randn(cfg.num_heads, generator=gen), requires_grad=False
            )


def _run(
    folder,
    fused: bool,
    monkeypatch,
    tweaks: dict,
    quantize=None,
    n=3,
    kv=torch.float32,
    lengths=None,
):
    """Prefill n sequences, 6 batched decode steps, then one mixed decode + prefill step,
    over a KV cache of dtype kv. Returns per step (logits [T, vocab], [attention outputs
    [T, q_size] per layer])."""
    monkeypatch.setattr(paths, "NATIVE_DECODE", fused)
    ckpt = open_checkpoint(folder)
    model = Transformer(ckpt.config)
    model.load_weights(ckpt, torch.float32, quantize=quantize)
    _tweak(model, tweaks)
    attn_out: list[torch.Tensor] = []
    for layer in model.layers:
        layer.attn.o.register_forward_pre_hook(lambda _m, args: attn_out.append(args[0].clone()))
    lengths = lengths or (5, 23, 40) + tuple(range(2, n - 1))  # 1, 2, 3 blocks, then short ones
    cache = KVCache(ckpt.config, 16, kv, torch.device("cpu"), f"{max(1024, 2 * sum(lengths))}tok")
    blocks = BlockManager(cache.num_blocks, 16)
    runner = ModelRunner(model, cache, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)

    def step(chunks):
        for c in chunks:
            blocks.grow(c.seq.block_table, len(c.seq))
        attn_out.clear()
        logits, _ = runner.run(chunks, all_logits=True)
        for c in chunks:
            c.seq.num_computed += c.num_tokens
        return logits, list(attn_out)

    seqs = [Sequence(f"s{i}", [], None, None) for i in range(n + 1)]
    results = []
    for seq, length in zip(seqs[:n], lengths, strict=True):
        seq.prompt_ids = torch.randint(2, 300, (length,), generator=gen).tolist()
        results.append(step([ScheduledChunk(seq, length)]))
    for _ in range(6):
        for seq in seqs[:n]:
            seq.prompt_ids = seq.prompt_ids + [int(torch.randint(2, 300, (1,), generator=gen))]
        results.append(step([ScheduledChunk(seq, 1) for seq in seqs[:n]]))
    seqs[n].prompt_ids = torch.randint(2, 300, (9,), generator=gen).tolist()
    for seq in seqs[:n]:
        seq.prompt_ids = seq.prompt_ids + [7]
    results.append(
        step([ScheduledChunk(seq, 1) for seq in seqs[:n]] + [ScheduledChunk(seqs[n], 9)])
    )
    return results


def _build_case(name: str, folder) -> tuple[str, dict]:
    """Write CASES[name]'s checkpoint to folder. Returns (arch, tweaks): the TWEAKS are no
    checkpoint setting, _run sets them on the loaded model."""
    arch, overrides = CASES[name]
    tweaks = {k: v for k, v in overrides.items() if k in TWEAKS}
    build_hf_model(arch, folder, **{k: v for k, v in overrides.items() if k not in TWEAKS})
    return arch, tweaks


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    """Patch owner.name to record each call (one entry per call) and run as before."""
    calls: list[int] = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.fixture(params=BUILDS)
def kbuild(request, monkeypatch):
    """Runs the test once per kernel build (native, AVX2, scalar), each the active library."""
    use_build(monkeypatch, request.param)
    return request.param


@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["llama-gqa", "llama-sinks"])
def test_long_context_split_across_threads_matches_torch(kbuild, tmp_path, monkeypatch, case, kv):
    """One sequence of 1,100 tokens and a 700-token one: too few (row, K/V head) tasks for
    4 threads, so tm_decode_attention splits each context into parts and merges their
    softmax sums (flash-decoding); it must still equal the torch path."""
    arch, overrides = CASES[case]
    tweaks = {k: v for k, v in overrides.items() if k in TWEAKS}
    build_hf_model(arch, tmp_path, max_position_embeddings=2048)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # the split depends on the threads asked for, not the cores
    try:
        args = (monkeypatch, tweaks, None, 2, kv, (1100, 700))
        ref, got = _run(tmp_path, False, *args), _run(tmp_path, True, *args)
    finally:
        torch.set_num_threads(threads)
    step = 1.0 if kv == torch.float32 else 2.0**-11 / 1e-5
    for (ref_logits, ref_attn), (got_logits, got_attn) in zip(ref, got, strict=True):
        for a, b in zip(ref_attn, got_attn, strict=True):
            assert (a - b).abs().max().item() < 1e-5 * step * max(1.0, a.abs().max().item())
        assert (ref_logits - got_logits).abs().max().item() < 1e-4 * step


KV_CASES = [
    (name, kv)
    for name in ("llama-gqa", "qwen3-mqa-qknorm", "gemma3-sliding", "llama-sinks")
    for kv in (torch.float16, torch.bfloat16)
]


@pytest.mark.parametrize(
    "name,kv",
    [(name, torch.float32) for name in CASES] + KV_CASES,
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_fused_decode_matches_torch(kbuild, tmp_path, monkeypatch, name, kv):
    """Also over 16-bit KV caches: both paths round each new k/v to nearest even, but
    their float32 k (RoPE, norms) may differ in its last bit, which now and then rounds to
    the neighbouring 16-bit value: the bound there is one 16-bit step (2^-11 of a value in
    float16, 2^-8 in bfloat16), still far below what a wrong read or write would give."""
    _, tweaks = _build_case(name, tmp_path)
    calls = _count_calls(monkeypatch, kernels, "decode_attention")
    ref = _run(tmp_path, False, monkeypatch, tweaks, kv=kv)
    assert not calls
    got = _run(tmp_path, True, monkeypatch, tweaks, kv=kv)
    assert len(calls) == 7 * len(got[0][1])  # every decode step, every layer
    step = {torch.float32: 1.0, torch.float16: 2.0**-11 / 1e-5, torch.bfloat16: 2.0**-8 / 1e-5}
    for (ref_logits, ref_attn), (got_logits, got_attn) in zip(ref, got, strict=True):
        for a, b in zip(ref_attn, got_attn, strict=True):
            # float32 rounding relative to the outputs' size (|a| ~ 2.5: torch's own
            # attention on AVX-512 hosts differs from the kernels' sums by ~1e-5)
            bound = 1e-5 * step[kv] * max(1.0, a.abs().max().item())
            assert (a - b).abs().max().item() < bound
        assert (ref_logits - got_logits).abs().max().item() < 1e-4 * step[kv]


@pytest.mark.parametrize(
    "name,scheme,n",
    [(name, scheme, 3) for name in CASES for scheme in ("q8", "q4")]
    # 24 rows per decode step: the integer GEMM's share of kernels.linear (from
    # kernels.gemm_min_rows() rows, where it runs: 16 on AVX2, 24 on AVX-512) inside the
    # fused stack too
    + [("llama-gqa", "q4", 24), ("qwen3-gqa-qknorm", "q8", 24)],
)
def test_fused_stack_matches_per_layer_path(kbuild, tmp_path, monkeypatch, name, scheme, n):
    if n > 3:
        assert n >= kernels.gemm_min_rows()
    arch, tweaks = _build_case(name, tmp_path)
    runs = _count_calls(monkeypatch, NativeModel, "run_stack")
    real_best = paths.best_decode_path
    with monkeypatch.context() as m:  # the per-layer native path only
        m.setattr(
            paths, "best_decode_path",
            lambda model: paths.DecodePath(paths.NATIVE_ATTENTION, "test")
            if real_best(model).name == paths.STACK else real_best(model),
        )  # fmt: skip
        ref = _run(tmp_path, True, monkeypatch, tweaks, scheme, n)
    assert not runs
    got = _run(tmp_path, True, monkeypatch, tweaks, scheme, n)
    # the 6 pure decode steps; GPT-2 (LayerNorm, plain MLP) keeps the per-layer path
    assert len(runs) == (0 if arch == "gpt2" else 6)
    # exact products with the same packed weights: no native library at all
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_tried", True)
    exact = _run(tmp_path, False, monkeypatch, tweaks, scheme, n)
    for (ref_logits, _), (got_logits, _), (ex, _) in zip(ref, got, exact, strict=True):
        scale = ex.abs().max().item()
        e_ref = (ref_logits - ex).abs().max().item() / scale
        e_got = (got_logits - ex).abs().max().item() / scale
        # Both paths quantize activations to 16 bits (error ~1e-4 here, up to 1.5e-3 on
        # a few of the 20-sequence run's 4-bit prefills); float rounding differences flip
        # some of those roundings, so the two differ at that level, never more: the
        # fused stack is exactly as accurate as the per-layer path.
        assert e_got < 2 * e_ref + 1e-5 and e_got < 2e-3, (e_ref, e_got)


@pytest.mark.parametrize("name", ["qwen3-gqa-qknorm", "gemma3-sliding"])  # SiLU, tanh-GELU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_stack_takes_float_weights(kbuild, tmp_path, monkeypatch, name, dtype):
    """16-bit float checkpoints run the whole decode step natively too (FloatLinear)."""
    arch, overrides = CASES[name]
    model = build_hf_model(arch, tmp_path, **overrides)
    model.to(dtype).save_pretrained(tmp_path)  # a bf16 / f16 safetensors folder
    runs = _count_calls(monkeypatch, NativeModel, "run_stack")
    got = _run(tmp_path, True, monkeypatch, {}, "float")
    assert len(runs) == 6
    # the same 16-bit weights, widened to float32 torch Linears: the reference path
    ref = _run(tmp_path, False, monkeypatch, {}, None)
    for (a, _), (b, _) in zip(got, ref, strict=True):
        assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()


def test_decode_path_is_chosen_in_one_place_with_a_reason(tmp_path, monkeypatch):
    """models/paths.py: every step's path and why, for the cases that send a step off
    the fastest path."""
    from types import SimpleNamespace

    def model_for(arch, quantize):
        folder = tmp_path / f"{arch}-{quantize}"
        build_hf_model(arch, folder)
        ckpt = open_checkpoint(folder)
        model = Transformer(ckpt.config)
        model.load_weights(ckpt, torch.float32, quantize=quantize)
        cache = KVCache(ckpt.config, 16, torch.float32, torch.device("cpu"), "256tok")
        model.attach_kv_cache(cache.k, cache.v)
        return model

    def step(num_decode, rows, trace=None):
        return SimpleNamespace(num_decode=num_decode, trace=trace), rows

    llama = model_for("llama", "q8")
    assert paths.choose(llama, *step(3, 3)).name == paths.STACK
    mixed = paths.choose(llama, *step(3, 12))
    assert mixed.name == paths.NATIVE_ATTENTION and "prefill rows" in mixed.reason
    traced = paths.choose(llama, *step(3, 3, trace=object()))
    assert traced.name == paths.TORCH and "traced" in traced.reason
    assert paths.choose(llama, *step(0, 9)).name == paths.TORCH

    gpt2 = model_for("gpt2", "q8").decode_path()
    assert gpt2.name == paths.NATIVE_ATTENTION and "RMSNorm" in gpt2.reason
    torch_linears = model_for("llama", None).decode_path()
    assert torch_linears.name == paths.NATIVE_ATTENTION and "torch Linear" in torch_linears.reason

    monkeypatch.setattr(paths, "NATIVE_DECODE", False)
    off = llama.decode_path()
    assert off.name == paths.TORCH and "TOKENMILL_FUSED_DECODE" in off.reason
    monkeypatch.setattr(paths, "NATIVE_DECODE", True)
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_tried", True)
    assert "no native kernel library" in llama.decode_path().reason
