"""The newer dense families against transformers on tiny random-weight checkpoints
(float32): Phi-3/Phi-4 (fused projections, LongRoPE, partial rotary), Gemma 2 (attention
and final-logit soft-caps, sandwich norms, alternating sliding windows), OLMo 2 (norms
after the sublayers only, Q/K norm over the whole projection), SmolLM3 (NoPE layers) and
Granite 3 (embedding, attention, residual and logit multipliers).

Odd sizes: 6 query heads over 2 K/V heads of 12 dims, MLP width 100, vocabulary 301.
Prefill logits at every prompt position and the logits of a 32-token greedy continuation
must be close to transformers' (its own cached `generate`), and the tokens identical; with
native weights the decode steps run the fused stack where the family's switches allow it,
and models/paths.py names the reason where they do not.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers as tf
from gguf import GGMLQuantizationType as Q
from helpers import (
    FAMILIES,
    Single,
    assert_logits_match,
    assert_same_greedy_but_ties,
    build_hf_model,
    hf_generate,
    hf_greedy,
    hf_sizes,
    llama_cpp_greedy,
    write_gguf,
    write_llama_gguf,
)

from tokenmill import kernels
from tokenmill.config import ConfigError, ModelConfig
from tokenmill.llm import LLM
from tokenmill.loader import open_checkpoint
from tokenmill.loader.hf_config import from_hf_config
from tokenmill.models import paths
from tokenmill.sampling import SamplingParams

VOCAB = 301
# the odd sizes, over build_hf_model's common ones
SIZES = dict(vocab=VOCAB, hidden_size=72, intermediate_size=100, num_attention_heads=6)
HALF = 6  # rotary frequencies of a 12-dim head

# name -> (family in helpers.FAMILIES, config overrides, the decode path with native
# weights: "stack", or the reason paths.py gives for the torch path)
CASES = {
    "phi3-longrope": (
        "phi3",
        dict(
            original_max_position_embeddings=64,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.3 * i for i in range(HALF)],
                "long_factor": [1.5 + 2.0 * i for i in range(HALF)],
            },
        ),
        "stack",
    ),
    "phi4-partial-rotary": (
        "phi3",
        dict(partial_rotary_factor=0.5),
        "stack",
    ),
    "gemma2-softcaps": (
        "gemma2",
        dict(
            head_dim=16,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=20,
            sliding_window=8,
        ),
        "stack",
    ),
    "gemma2-no-attn-softcap": (
        "gemma2",
        dict(head_dim=16, attn_logit_softcapping=None, sliding_window=8),
        "stack",
    ),
    "olmo2": ("olmo2", {}, "stack"),
    "smollm3-nope": (
        "smollm3",
        dict(no_rope_layers=[1, 0, 1]),
        "stack",
    ),
    # transformers' default NoPE layers (every 4th), the ones llama.cpp hard-codes for GGUF
    "smollm3-default-nope": (
        "smollm3",
        dict(num_hidden_layers=4),
        "stack",
    ),
    "granite-multipliers": (
        "granite",
        dict(
            embedding_multiplier=3.0,
            attention_multiplier=0.2,
            residual_multiplier=0.4,
            logits_scaling=2.5,
            tie_word_embeddings=False,
        ),
        "stack",
    ),
}


def build(name: str, folder, seed: int = 0, **more):
    """Build, save and return the tiny random transformers model of case `name` (with
    `more` config overrides)."""
    family, overrides, _ = CASES[name]
    model_cls = FAMILIES[family][0]
    if not hasattr(tf, model_cls):  # pragma: no cover - an older transformers
        pytest.skip(f"transformers {tf.__version__} has no {model_cls}")
    return build_hf_model(family, folder, seed, **{**SIZES, **overrides, **more})


def _prompt(name: str) -> list[int]:
    # longer than the sliding windows (8); prompt and continuation stay inside LongRoPE's
    # original 64 positions, where transformers and tokenmill both use the short factors
    # (test_longrope_tables checks the long ones)
    length = 24 if "longrope" in name else 40
    return torch.randint(
        2, VOCAB - 1, (length,), generator=torch.Generator().manual_seed(1)
    ).tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_match_transformers(tmp_path, name):
    hf = build(name, tmp_path)
    prompt = _prompt(name)
    assert_logits_match(Single(tmp_path), hf, prompt)

    want, want_logits = hf_generate(hf, prompt, 32)
    ours = Single(tmp_path)
    assert ours.greedy(prompt, 32)[1] == want
    for mine, theirs in zip(ours.steps, want_logits, strict=True):
        assert (mine - theirs).abs().max().item() < 1e-4


@pytest.mark.skipif(kernels.library() is None, reason="native kernels unavailable")
@pytest.mark.parametrize("name", list(CASES))
def test_native_weights_take_the_stack_or_say_why(tmp_path, name):
    """With native float32 weights, decode runs the fused stack when the family's switches
    are ones it supports; otherwise the torch path, with the switch named."""
    hf = build(name, tmp_path)
    prompt = _prompt(name)
    ours = Single(tmp_path, quantize="float")
    _, tokens = ours.greedy(prompt, 24)
    path = ours.model.decode_path()
    expected = CASES[name][2]
    if expected == "stack":
        assert path.name == paths.STACK, path.reason
    else:
        assert path.name == paths.TORCH and expected in path.reason, path
    assert tokens == hf_greedy(hf, prompt, 24)


def test_longrope_tables_match_transformers(tmp_path):
    """Phi-3's rotary tables: short factors below original_max_position, long ones from
    it on, both times the attention factor, as transformers' rotary embedding gives them
    for a sequence that short (or that long)."""
    hf = build("phi3-longrope", tmp_path)
    rotary = Single(tmp_path).model.rotary
    emb = hf.model.rotary_emb
    for positions in (torch.arange(64), torch.arange(64, 200)):
        cos, sin = emb(torch.zeros(1), positions[None])  # [1, P, hd]
        assert (cos[0] - rotary.cos[positions]).abs().max().item() < 1e-6
        half = rotary.dim // 2  # our sin carries rotate_half's sign in its first half
        assert (sin[0, :, half:] - rotary.sin[positions, half:]).abs().max().item() < 1e-6
    assert rotary.rope.attention_factor == pytest.approx((1 + 3 / 6) ** 0.5)  # ln 8 / ln 64


YARN_CASES = {
    # gpt-oss's: the ramp's ends not rounded
    "gpt-oss": dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False),
    # Qwen's long-context recipe: transformers' defaults for the betas, ends rounded
    "defaults": dict(factor=4.0),
    # DeepSeek's: the attention factor from mscale / mscale_all_dim
    "mscale": dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707),
    "attention_factor": dict(factor=8.0, attention_factor=1.25, beta_fast=16.0),
}


@pytest.mark.parametrize("name", list(YARN_CASES))
def test_yarn_frequencies_match_transformers(name):
    """YaRN's frequencies and attention factor, as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenmill.layers.rotary import inv_frequencies

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **YARN_CASES[name]}
    params["original_max_position_embeddings"] = 4096
    hf_cfg = tf.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
        rope_parameters=dict(params),
    )  # fmt: skip
    ref, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    cfg = from_hf_config({**hf_cfg.to_dict(), "model_type": "llama", "vocab_size": 320})
    assert cfg.rope.scaling == "yarn"
    assert torch.equal(inv_frequencies(cfg.rope, 64), ref)
    assert cfg.rope.attention_factor == pytest.approx(ref_factor, rel=1e-12)


# F16: the odd sizes (72 columns) fit no 32-wide block format
@pytest.mark.parametrize("qtype", [None, Q.F16])
def test_smollm3_gguf_reads_back_as_the_folder(tmp_path, qtype):
    """A SmolLM3 GGUF as llama.cpp's converter writes it (Q/K rows permuted, no key for the
    NoPE layers: every 4th) gives transformers' logits and greedy tokens."""
    hf = build("smollm3-default-nope", tmp_path / "hf")
    assert hf.config.no_rope_layers == [1, 1, 1, 0]
    path = tmp_path / "smollm3.gguf"
    hf = write_llama_gguf(hf, path, qtype, arch="smollm3")  # now the file's exact weights
    ckpt = open_checkpoint(path)
    assert ckpt.config.rope_layers == [True, True, True, False]
    prompt = _prompt("smollm3")
    assert_logits_match(Single(path), hf, prompt)
    assert Single(path).greedy(prompt, 16)[1] == hf_greedy(hf, prompt, 16)


def _granite_keys(c) -> dict:
    """Granite's multipliers as llama.cpp's converter writes them: granite.*_scale keys."""
    import gguf

    f32 = gguf.GGUFValueType.FLOAT32
    return {
        "granite.attention.scale": (c.attention_multiplier, f32),
        "granite.embedding_scale": (c.embedding_multiplier, f32),
        "granite.residual_scale": (c.residual_multiplier, f32),
        "granite.logit_scale": (c.logits_scaling, f32),
    }


@pytest.mark.parametrize("qtype", [None, Q.F16])
def test_granite_gguf_reads_back_as_the_folder(tmp_path, qtype):
    """A Granite GGUF as llama.cpp's converter writes it (a llama layout, Q/K rows
    permuted, the multipliers as granite.*_scale keys) gives transformers' logits and
    greedy tokens, on the torch path and on the fused stack with the file's weights."""
    hf = build("granite-multipliers", tmp_path / "hf")
    path = tmp_path / "granite.gguf"
    hf = write_llama_gguf(hf, path, qtype, arch="granite", metadata=_granite_keys(hf.config))
    cfg = open_checkpoint(path).config
    assert (cfg.embed_scale, cfg.residual_scale) == pytest.approx((3.0, 0.4))
    assert (cfg.attn_scale, cfg.logit_scale) == pytest.approx((0.2, 1 / 2.5))
    prompt = _prompt("granite")
    assert_logits_match(Single(path), hf, prompt)
    want = hf_greedy(hf, prompt, 16)
    assert Single(path).greedy(prompt, 16)[1] == want
    if kernels.library() is not None:
        packed = Single(path, quantize="gguf")
        assert packed.greedy(prompt, 16)[1] == want
        assert packed.model.decode_path().name == paths.STACK


@pytest.mark.parametrize("name", ["gemma2-softcaps", "olmo2"])
def test_gguf_reads_back_as_the_folder(tmp_path, name):
    """Gemma 2 (soft-caps from the header, even layers sliding) and OLMo 2 (post-norms,
    whole-projection Q/K norms) as GGUF give transformers' logits and greedy tokens."""
    if name.startswith("gemma2"):
        # llama.cpp's Gemma 2 scales queries by 1/sqrt(head_dim): the file cannot say 20
        hf = build(name, tmp_path / "hf", query_pre_attn_scalar=16)
        meta = dict(
            sliding_window=hf.config.sliding_window,
            attn_logit_softcapping=hf.config.attn_logit_softcapping,
            final_logit_softcapping=hf.config.final_logit_softcapping,
        )
    else:
        hf, meta = build(name, tmp_path / "hf"), {}
    path = tmp_path / f"{name}.gguf"
    write_gguf(hf, path, name.split("-")[0], metadata=meta)
    config = open_checkpoint(path).config
    ref = from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    for field in ("qk_norm", "pre_norm", "attn_logit_softcap", "final_logit_softcap"):
        assert getattr(config, field) == getattr(ref, field), field
    assert config.layer_types == ref.layer_types
    prompt = _prompt(name)
    assert_logits_match(Single(path), hf, prompt)
    assert Single(path).greedy(prompt, 16)[1] == hf_greedy(hf, prompt, 16)


@pytest.mark.parametrize("name", ["phi3-longrope", "phi4-partial-rotary"])
def test_phi3_gguf_reads_back_as_the_folder(tmp_path, name):
    """Phi-3 as llama.cpp's converter writes it: attn_qkv and ffn_up fused, LongRoPE's
    factors as the rope_factors_short/long tensors with the original context length and
    the attention factor in the header, the rotary dimensions for partial rotary. Read
    back (float weights, and packed as stored, which decodes through the fused stack) it
    gives transformers' logits and greedy tokens."""
    import numpy as np

    hf = build(name, tmp_path / "hf")
    rope = hf.config.rope_parameters
    ref = from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text())).rope
    meta = {"rope_dimension_count": ref.dim or 12}
    extra = {}
    if "longrope" in name:
        meta["rope_scaling_orig_ctx_len"] = ref.original_max_position
        meta["rope_scaling_attn_factors"] = ref.attention_factor
        for kind in ("short", "long"):
            extra[f"rope_factors_{kind}.weight"] = np.array(rope[f"{kind}_factor"], np.float32)
    path = tmp_path / f"{name}.gguf"
    write_gguf(hf, path, "phi3", metadata=meta, extra=extra)
    got = open_checkpoint(path).config.rope
    assert (got.scaling, got.dim or 12) == (ref.scaling, ref.dim or 12)
    for kind in ("short_factor", "long_factor", "attention_factor"):  # float32 in the file
        assert getattr(got, kind) == pytest.approx(getattr(ref, kind)), kind
    prompt = _prompt(name)
    assert_logits_match(Single(path), hf, prompt)
    tokens = hf_greedy(hf, prompt, 16)
    assert Single(path).greedy(prompt, 16)[1] == tokens
    packed = Single(path, quantize="gguf")
    assert packed.greedy(prompt, 16)[1] == tokens
    if kernels.library() is not None:
        assert packed.model.decode_path().name == paths.STACK


HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
# how far apart in log-probability two tokens may be for llama.cpp's 8-bit activations to
# pick the other one on a Q8_0 file (the tiny models here have near-flat distributions)
Q8_TIE = 0.05


def _write_for_llama_cpp(tmp_path, name: str, qtype, **more):
    """Case `name` as llama.cpp's converter writes its GGUF (the writers the read-back tests
    above use); the transformers model (for a block type: its weights as the file holds
    them where the writer can say, else None) and the file."""

    family = CASES[name][0]
    path = tmp_path / f"{name}.gguf"
    if family in ("smollm3", "granite"):  # llama's layout, Q/K rows permuted
        hf = build(name, tmp_path / "hf", **more)
        meta = _granite_keys(hf.config) if family == "granite" else None
        write_llama_gguf(hf, path, qtype, arch=family, metadata=meta)
        return (hf if qtype is None else None), path
    if family == "gemma2":  # llama.cpp scales queries by 1/sqrt(head_dim)
        hf = build(name, tmp_path / "hf", query_pre_attn_scalar=16, **more)
        c = hf.config
        meta = dict(
            sliding_window=c.sliding_window,
            attn_logit_softcapping=c.attn_logit_softcapping,
            final_logit_softcapping=c.final_logit_softcapping,
        )
    elif family == "phi3":
        hf = build(name, tmp_path / "hf", **more)
        c = hf.config
        head_dim = c.hidden_size // c.num_attention_heads
        meta = {"rope_dimension_count": int(head_dim * c.partial_rotary_factor)}
    else:  # olmo2: llama.cpp's OLMo 2 K norm is [d], so no grouped K/V heads
        hf = build(name, tmp_path / "hf", num_key_value_heads=more.pop("heads", 6), **more)
        meta = {}
    write_gguf(hf, path, family, qtype, metadata=meta)
    return (hf if qtype is None else None), path


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("qtype", [None, Q.Q8_0])
@pytest.mark.parametrize(
    "name",
    [
        "phi4-partial-rotary",
        "gemma2-softcaps",
        "olmo2",
        "smollm3-default-nope",
        "granite-multipliers",
    ],
)
def test_llama_cpp_reads_the_same_file_to_the_same_tokens(tmp_path, name, qtype):
    """llama.cpp (llama-cpp-python) on the same GGUF gives tokenmill's greedy tokens, as
    tokenmill loads the file by default (Q8_0 packed as stored, decoding through the fused
    stack), and transformers' where the file holds float weights; on Q8_0 files the two
    engines may part only at a near tie (their activations are quantized apart)."""
    more = {}
    if qtype is not None:  # Q8_0 blocks are 32 wide along every matrix's input
        more = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4)
        more.update(initializer_range=0.1)
        more["num_key_value_heads" if name != "olmo2" else "heads"] = 2 if name != "olmo2" else 4
    hf, path = _write_for_llama_cpp(tmp_path, name, qtype, **more)
    prompt = _prompt(name)[:24]
    llm = LLM(path, kv_cache_memory="1024tok")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    out = llm.generate([prompt], greedy)[0]
    if qtype is not None and kernels.library() is not None:
        assert llm.engine.model.decode_path().name == paths.STACK
    theirs = llama_cpp_greedy(path, prompt, 12)
    if hf is not None:  # float weights: both engines exactly
        assert out.token_ids == theirs == hf_greedy(hf, prompt, 12)
    else:  # llama.cpp multiplies Q8_0 by 8-bit activations, tokenmill by 16-bit ones
        assert_same_greedy_but_ties(out, theirs, tol=Q8_TIE)


def _config(model_type: str, **extra) -> dict:
    return dict(
        model_type=model_type,
        **hf_sizes(64, hidden=32, mlp=48, layers=2, heads=4, kv_heads=2),
        **extra,
    )


def test_family_switches_read_from_config_json():
    phi = from_hf_config(
        _config(
            "phi3",
            max_position_embeddings=4096,
            original_max_position_embeddings=1024,
            rope_scaling={"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
        )
    )
    assert phi.rope.scaling == "longrope" and phi.rope.original_max_position == 1024
    # transformers' default attention factor: sqrt(1 + ln(4096 / 1024) / ln(1024))
    assert abs(phi.rope.attention_factor - (1 + 2 / 10) ** 0.5) < 1e-9
    olmo = from_hf_config(_config("olmo2"))
    assert olmo.qk_norm == "full" and not olmo.pre_norm and olmo.sandwich_norm
    smol = from_hf_config(_config("smollm3", no_rope_layers=[1, 0]))
    assert smol.rope_layers == [True, False]
    granite = from_hf_config(_config("granite", logits_scaling=8.0, residual_multiplier=0.25))
    assert granite.logit_scale == 0.125 and granite.residual_scale == 0.25
    gemma = from_hf_config(_config("gemma2", attn_logit_softcapping=50.0, sliding_window=16))
    assert gemma.attn_logit_softcap == 50.0 and gemma.layer_types == ["sliding", "full"]


@pytest.mark.parametrize(
    "model_type, extra, field",
    [
        ("phi3", dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 4}), "long_factor"),
        (
            "phi3",
            dict(
                rope_scaling={
                    "type": "longrope",
                    "short_factor": [1.0] * 3,
                    "long_factor": [1.0] * 4,
                }
            ),
            "short_factor",
        ),
        ("smollm3", dict(no_rope_layers=[1, 2]), "no_rope_layers"),
        ("smollm3", dict(no_rope_layers=[1]), "no_rope_layers"),
        ("granite", dict(logits_scaling=0), "logits_scaling"),
        ("granite", dict(residual_multiplier="x"), "residual_multiplier"),
        ("gemma2", dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    ],
)
def test_bad_family_fields_name_the_field(model_type, extra, field):
    with pytest.raises(ConfigError, match=field):
        from_hf_config(_config(model_type, original_max_position_embeddings=64, **extra))


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(pre_norm=False), "pre_norm"),
        (dict(pre_norm=1, sandwich_norm=True), "pre_norm"),
        (dict(rope_layers=[True]), "rope_layers"),
        (dict(attn_logit_softcap=0.0), "attn_logit_softcap"),
        (dict(logit_scale=-2.0), "logit_scale"),
    ],
)
def test_model_config_checks_the_switches(fields, name):
    with pytest.raises(ConfigError, match=name):
        ModelConfig("llama", 64, 32, 48, 2, 4, 2, 8, **fields)
