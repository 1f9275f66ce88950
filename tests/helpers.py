"""Shared test helpers: tiny random-weight checkpoints built with transformers (the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A trivial word-level tokenizer (ids <-> 't{id}') so an engine can run on a tiny model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{vocab_size - 1}"}))


def build_hf_model(arch: str, folder: Path, seed: int = 0, **overrides):
    """Build, save and return a tiny random transformers model of family `arch`."""
    import transformers as tf

    torch.manual_seed(seed)
    vocab = 320
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=vocab - 1,
        pad_token_id=0,
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**{**common, **overrides})
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**{**common, "sliding_window": None, **overrides})
        model = tf.MistralForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**{**common, **overrides})
        model = tf.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**{**common, "head_dim": 32, **overrides})
        model = tf.Qwen3ForCausalLM(cfg)
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(
            **{
                **common,
                "head_dim": 32,
                "num_key_value_heads": 1,
                "num_hidden_layers": 4,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                "query_pre_attn_scalar": 24,
                **overrides,
            }
        )
        model = tf.Gemma3ForCausalLM(cfg)
    elif arch == "gpt2":
        gpt2 = dict(
            vocab_size=vocab, n_embd=64, n_layer=3, n_head=4, n_positions=512,
            initializer_range=0.2, bos_token_id=1, eos_token_id=vocab - 1,
        )
        cfg = tf.GPT2Config(**{**gpt2, **overrides})
        model = tf.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    model.eval()
    # Random norm weights, so a wrong norm convention (e.g. Gemma's 1 + w) shows up.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.normal_(1.0 if arch != "gemma3" else 0.0, 0.3)
    model.save_pretrained(folder)
    save_word_tokenizer(folder, vocab)
    return model
