"""The fused native decode attention (tm_decode_attention) equals the torch path.

Same steps run twice, with tokenmill.layers.attention.FUSED_DECODE on and off: several
sequences of different lengths (contexts over several 16-token blocks) decoding together,
then a mixed step (decode rows plus a prefill chunk). Compared: every layer's attention
output (the o projection's input) and the logits.
"""

from __future__ import annotations

import pytest
import torch
from helpers import build_hf_model

from tokenmill import kernels
from tokenmill.config import RopeConfig
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.engine.sequence import Sequence
from tokenmill.layers import attention
from tokenmill.layers.rotary import Rotary
from tokenmill.loader import open_checkpoint
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
}


def _run(folder, fused: bool, monkeypatch, partial_rotary: int | None):
    """Prefill 3 sequences, 6 batched decode steps, then one mixed decode + prefill step.
    Returns per step (logits [T, vocab], [attention outputs [T, q_size] per layer])."""
    monkeypatch.setattr(attention, "FUSED_DECODE", fused)
    ckpt = open_checkpoint(folder)
    model = Transformer(ckpt.config)
    model.load_weights(ckpt, torch.float32)
    if partial_rotary:
        rot = Rotary(RopeConfig(dim=partial_rotary), ckpt.config.head_dim, 512)
        for layer in model.layers:
            layer.attn.rotary = rot
    attn_out: list[torch.Tensor] = []
    for layer in model.layers:
        layer.attn.o.register_forward_pre_hook(lambda _m, args: attn_out.append(args[0].clone()))
    cache = KVCache(ckpt.config, 16, torch.float32, torch.device("cpu"), "1024tok")
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

    seqs = [Sequence(f"s{i}", [], None, None) for i in range(4)]
    results = []
    for seq, n in zip(seqs[:3], (5, 23, 40), strict=True):  # 1, 2 and 3 blocks
        seq.prompt_ids = torch.randint(2, 300, (n,), generator=gen).tolist()
        results.append(step([ScheduledChunk(seq, n)]))
    for _ in range(6):
        for seq in seqs[:3]:
            seq.prompt_ids = seq.prompt_ids + [int(torch.randint(2, 300, (1,), generator=gen))]
        results.append(step([ScheduledChunk(seq, 1) for seq in seqs[:3]]))
    seqs[3].prompt_ids = torch.randint(2, 300, (9,), generator=gen).tolist()
    for seq in seqs[:3]:
        seq.prompt_ids = seq.prompt_ids + [7]
    results.append(
        step([ScheduledChunk(seq, 1) for seq in seqs[:3]] + [ScheduledChunk(seqs[3], 9)])
    )
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_fused_decode_matches_torch(tmp_path, monkeypatch, name):
    arch, overrides = CASES[name]
    overrides = dict(overrides)
    partial = overrides.pop("partial_rotary", None)
    build_hf_model(arch, tmp_path, **overrides)
    calls = []
    fused_call = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a: calls.append(1) or fused_call(*a))
    ref = _run(tmp_path, False, monkeypatch, partial)
    assert not calls
    got = _run(tmp_path, True, monkeypatch, partial)
    assert len(calls) == 7 * len(got[0][1])  # every decode step, every layer
    for (ref_logits, ref_attn), (got_logits, got_attn) in zip(ref, got, strict=True):
        for a, b in zip(ref_attn, got_attn, strict=True):
            assert (a - b).abs().max().item() < 1e-5
        assert (ref_logits - got_logits).abs().max().item() < 1e-4
