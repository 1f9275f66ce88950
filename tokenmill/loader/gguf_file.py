"""GGUF files (llama.cpp's format), read with the `gguf` package.

Metadata keys `{arch}.*` become the ModelConfig; tensors are dequantized from their
ggml block formats by `gguf.quants`. llama.cpp's converter permutes the rows of the
Q and K projections of llama-family models (its rotary kernel pairs adjacent
dimensions, HF's pairs the two halves); we undo that so one rotary implementation
serves both formats.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill.config import ModelConfig, RopeConfig
from tokenmill.loader import Checkpoint, LoadError
from tokenmill.loader.gguf_reader import GGUFFile, GGUFFormatError

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
}
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gpt2")
# Families whose Q/K rows llama.cpp's converter permuted.
_PERMUTED_QK = ("llama", "mistral")

_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.q",
    "attn_k": "attn.k",
    "attn_v": "attn.v",
    "attn_output": "attn.o",
    "attn_q_norm": "attn.q_norm",
    "attn_k_norm": "attn.k_norm",
    "post_attention_norm": "post_attn_norm",
    "ffn_norm": "mlp_norm",
    "post_ffw_norm": "post_mlp_norm",
    "ffn_gate": "mlp.gate",
    "ffn_up": "mlp.up",
    "ffn_down": "mlp.down",
}
_TOP_NAMES = {
    "token_embd": "embed",
    "position_embd": "pos_embed",
    "output_norm": "final_norm",
    "output": "lm_head",
}


def _field(reader: GGUFFile, key: str, default=None):
    return reader.metadata.get(key, default)


def _config(reader: GGUFFile, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise LoadError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )

    def meta(key: str, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise LoadError(path, f"missing metadata key {arch}.{key}")
        return value

    hidden = meta("embedding_length")
    heads = meta("attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or heads
    head_dim = _field(reader, f"{arch}.attention.key_length") or hidden // heads
    layers = meta("block_count")
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is not None:
        vocab = int(embd.shape[0])
    rope = RopeConfig(
        theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        dim=_field(reader, f"{arch}.rope.dimension_count"),
    )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        rope.scaling, rope.factor = "linear", float(meta("rope.scaling.factor"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    names = {t.name for t in reader.tensors}
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position=meta("context_length", 4096),
        rope=rope,
        tie_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[eos] if eos is not None else [],
    )
    rms_eps = _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if arch == "gpt2":
        return ModelConfig(
            arch="gpt2",
            norm="layer",
            norm_eps=meta("attention.layer_norm_epsilon", 1e-5),
            mlp="plain",
            activation="gelu_tanh",
            position="learned",
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            **common,
        )
    if arch == "gemma3":
        window = meta("attention.sliding_window")
        # llama.cpp: every 6th Gemma 3 layer is global, local layers use RoPE base 10k.
        types = ["full" if (i + 1) % 6 == 0 else "sliding" for i in range(layers)]
        return ModelConfig(
            arch="gemma3",
            norm_eps=rms_eps,
            activation="gelu_tanh",
            qk_norm=True,
            sandwich_norm=True,
            embed_scale=math.sqrt(hidden),
            attn_scale=head_dim**-0.5,
            sliding_window=window,
            layer_types=types,
            rope_local=RopeConfig(theta=10000.0),
            **common,
        )
    window = _field(reader, f"{arch}.attention.sliding_window")
    return ModelConfig(
        arch=arch,
        norm_eps=rms_eps,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=window,
        layer_types=["sliding" if window else "full"] * layers,
        **common,
    )


def _target_name(name: str) -> list[tuple[str, str | None]]:
    stem, _, kind = name.rpartition(".")
    if stem in _TOP_NAMES:
        return [(f"{_TOP_NAMES[stem]}.{kind}", None)]
    if stem == "rope_freqs":
        return [("rope_freqs", None)]
    if not stem.startswith("blk."):
        return []
    _, idx, part = stem.split(".", 2)
    if part == "attn_qkv":  # fused (GPT-2): split into q, k, v by the loader
        return [(f"layers.{idx}.attn.{p}.{kind}", p) for p in ("q", "k", "v")]
    mapped = _LAYER_NAMES.get(part)
    return [(f"layers.{idx}.{mapped}.{kind}", None)] if mapped else []


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows [h, d/2, 2] -> [h, 2, d/2]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_tensor(t, path: Path) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 numpy, shaped [rows, cols] (numpy order)."""
    if t.tensor_type not in SUPPORTED_TYPES:
        raise LoadError(
            path, f"tensor {t.name}: unsupported quantization type {t.tensor_type.name}"
        )
    shape = t.shape
    try:
        if t.tensor_type == GGMLQuantizationType.F32:
            data = np.asarray(t.data, dtype=np.float32)
        elif t.tensor_type == GGMLQuantizationType.F16:
            data = np.asarray(t.data).astype(np.float32)
        else:
            data = dequantize(np.asarray(t.data), t.tensor_type)
        return data.reshape(shape)
    except ValueError as e:
        raise LoadError(path, f"tensor {t.name}: data does not fit shape {shape} ({e})") from None


def open_gguf(path: Path) -> Checkpoint:
    try:
        reader = GGUFFile(path)
    except GGUFFormatError as e:
        raise LoadError(path, str(e).removeprefix(f"{path}: ")) from None
    config = _config(reader, path)
    file_size = path.stat().st_size
    tensors, raw, by_target = {}, {}, {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_size:
            raise LoadError(path, f"truncated: tensor {t.name} ends past the end of the file")
        for target, part in _target_name(t.name):
            tensors[target] = _gguf_loader(t, path, config, target, part)
            raw[target] = _raw_loader(t, path, config, target, part)
            by_target[target] = t
    return Checkpoint(
        path, "gguf", config, tensors, raw=raw, release=lambda n: reader.release(by_target[n])
    )


def _rows_in_our_order(w: np.ndarray, config: ModelConfig, target: str, part: str | None):
    """Split fused QKV rows and undo llama.cpp's Q/K row permutation. Works on dequantized
    floats and on raw block bytes alike: both only move whole rows."""
    if part is not None:
        w = np.split(w, 3, axis=0)[("q", "k", "v").index(part)]
    if config.arch in _PERMUTED_QK:
        if target.endswith("attn.q.weight"):
            w = _unpermute(w, config.num_heads)
        elif target.endswith("attn.k.weight"):
            w = _unpermute(w, config.num_kv_heads)
    return w


def _gguf_loader(t, path: Path, config: ModelConfig, target: str, part: str | None):
    def load() -> torch.Tensor:
        w = _rows_in_our_order(read_tensor(t, path), config, target, part)
        w = np.ascontiguousarray(w)
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    return load


def _raw_loader(t, path: Path, config: ModelConfig, target: str, part: str | None):
    def load() -> tuple:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise LoadError(
                path, f"tensor {t.name}: unsupported quantization type {t.tensor_type.name}"
            )
        data = np.asarray(t.data)
        if data.ndim == 1:
            data = data.reshape(1, -1)
        return t.tensor_type, _rows_in_our_order(data, config, target, part)

    return load
