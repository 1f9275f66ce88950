"""Shared test helpers: tiny random-weight checkpoints built with transformers (the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A trivial word-level tokenizer (ids <-> 't{id}') so an engine can run on a tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

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
                "layer_types": [
                    "sliding_attention",
                    "sliding_attention",
                    "sliding_attention",
                    "full_attention",
                ],
                "query_pre_attn_scalar": 24,
                **overrides,
            }
        )
        model = tf.Gemma3ForCausalLM(cfg)
    elif arch == "gpt2":
        gpt2 = dict(
            vocab_size=vocab,
            n_embd=64,
            n_layer=3,
            n_head=4,
            n_positions=512,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=vocab - 1,
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


def _permute_qk(w, n_head: int):
    """llama.cpp's converter permutation of Q/K rows (what our loader undoes)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(
    model, path: Path, qtype=None, arch: str = "llama", drop=(), reshape=(), metadata=None
):
    """Write a tiny HF Llama model as a GGUF file the way llama.cpp's converter does.

    qtype: a GGMLQuantizationType for every 2-D weight (None = F32). `drop` leaves
    tensors out and `reshape` corrupts their shape, for the error tests. `metadata`
    {key: (value, GGUFValueType) or None} replaces (or, with None, removes) header keys.
    Returns the model with its weights replaced by their quantize/dequantize round trip,
    so it computes exactly what the file holds.
    """
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    # a small SentencePiece-style vocabulary so an engine can run on the file
    tokens = ["<unk>", "<s>", "</s>"] + [f"▁t{i}" for i in range(3, cfg.vocab_size)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, cfg.vocab_size)])
    w.add_token_types([2, 3, 3] + [1] * (cfg.vocab_size - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    state = model.state_dict()
    for hf_name, t in state.items():
        if hf_name in names:
            name = names[hf_name]
        else:
            _, _, idx, rest = hf_name.split(".", 3)
            name = f"blk.{idx}.{per_layer[rest.rsplit('.', 1)[0]]}.weight"
        if name in drop:
            continue
        data = t.float().numpy()
        if name.endswith("attn_q.weight"):
            data = _permute_qk(data, cfg.num_attention_heads)
        if name.endswith("attn_k.weight"):
            data = _permute_qk(data, cfg.num_key_value_heads)
        if name in reshape:
            data = data[:-1]
        if qtype is not None and data.ndim == 2:
            q = quantize(data, qtype)
            w.add_tensor(name, q, raw_dtype=qtype)
            back = torch.from_numpy(dequantize(q, qtype).reshape(data.shape).copy())
            if name.endswith("attn_q.weight") or name.endswith("attn_k.weight"):
                heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
                rows = back.shape[0]
                back = (
                    back.reshape(heads, rows // heads // 2, 2, -1)
                    .transpose(1, 2)
                    .reshape(back.shape)
                )
            with torch.no_grad():
                model.state_dict()[hf_name].copy_(back)
        else:
            w.add_tensor(name, np.ascontiguousarray(data))
    for key, typed in (metadata or {}).items():
        if typed is None:
            w.kv_data[0].pop(key, None)
        else:
            w.kv_data[0].pop(key, None)
            w.add_key_value(key, *typed)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
