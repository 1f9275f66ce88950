"""Every architecture against transformers on tiny random-weight checkpoints (float32).

Prefill logits at every prompt position, then 16 decode steps fed the same tokens
as the oracle, must match within 1e-4; a 32-token greedy continuation must be
token-identical to transformers' `generate`.
"""

from __future__ import annotations

import json

import pytest
import torch

# Single and hf_greedy live in helpers; test_loader and test_real_models import them from here
from helpers import Single, assert_logits_match, build_hf_model, hf_greedy

from tokenmill.loader import open_checkpoint

CASES = {
    "llama": {},
    "llama3-rope-mha-untied": dict(
        num_key_value_heads=4,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": {},
    "mistral-swa": dict(sliding_window=8),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3-mqa": dict(num_key_value_heads=1),
    "gpt2": {},
    "gemma3": {},
}


def _case(name: str):
    arch = name.split("-")[0]
    if arch == "llama3":
        arch = "llama"
    return arch, CASES[name]


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_match_transformers(tmp_path, name):
    arch, overrides = _case(name)
    hf = build_hf_model(arch, tmp_path, **overrides)
    torch.manual_seed(1)
    prompt = torch.randint(2, 300, (40,)).tolist()  # longer than the sliding windows (8)

    # ---- prefill: logits at every position, then 16 decode steps fed the same tokens ----
    assert_logits_match(Single(tmp_path), hf, prompt, decode_steps=16)

    # ---- 32-token greedy continuation vs transformers.generate ----
    _, ours_out = Single(tmp_path).greedy(prompt, 32)
    assert ours_out == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2"])
def test_cached_decode_equals_full_recompute(tmp_path, name):
    arch, overrides = _case(name)
    # fp32 rounding is relative: keep logits O(1) so 1e-5 absolute is meaningful.
    build_hf_model(arch, tmp_path, initializer_range=0.05, **overrides)
    torch.manual_seed(2)
    tokens = torch.randint(2, 300, (30,)).tolist()
    cached = Single(tmp_path)
    cached.feed(tokens[:10])
    for i in range(10, 30):
        step = cached.feed([tokens[i]])[0]
        full = Single(tmp_path).feed(tokens[: i + 1])[-1]
        assert (step - full).abs().max().item() < 1e-5


def test_transformers_4x_config_spelling(tmp_path):
    """config.json as transformers 4.x writes it: rope_theta + rope_scaling."""
    hf = build_hf_model(
        "llama",
        tmp_path,
        rope_theta=5000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters", None)
    if params is not None:
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.config.rope.theta == 5000.0 and ckpt.config.rope.scaling == "llama3"
    prompt = list(range(2, 50))
    assert_logits_match(Single(tmp_path), hf, prompt)


def test_sharded_safetensors(tmp_path):
    hf = build_hf_model("llama", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    prompt = list(range(2, 20))
    a = Single(tmp_path / "one").feed(prompt)
    b = Single(tmp_path / "sharded").feed(prompt)
    assert torch.equal(a, b)


def test_bfloat16_close_to_float32(tmp_path):
    build_hf_model("llama", tmp_path)
    prompt = list(range(2, 30))
    f32 = Single(tmp_path).feed(prompt)
    bf16 = Single(tmp_path, torch.bfloat16).feed(prompt)
    assert bf16.dtype == torch.float32  # logits are always float32
    # bf16 keeps ~3 significant digits; the top choice should agree almost everywhere
    agree = (f32.argmax(-1) == bf16.argmax(-1)).float().mean().item()
    assert agree > 0.9
