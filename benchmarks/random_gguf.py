"""Write a GGUF file of a real model's shape with random weights, for speed comparisons.

    python benchmarks/random_gguf.py llama-3.2-1b q4_0 /tmp/llama-1b-q4_0.gguf
    tokenmill bench --model /tmp/llama-1b-q4_0.gguf --peers llamacpp --skip throughput
    python benchmarks/random_gguf.py llama-3.2-1b q4_0 /tmp/gemma2-1b.gguf --family gemma2

The hub holds no model this size, and speed depends on the shapes and the block types,
not on the values: every tensor here has the real model's shape, and the tensor types a
llama.cpp quantization of that model would choose (llama-quant.cpp's rules, below), with
random codes and small random scales. A small synthetic SentencePiece vocabulary of the
real size lets both engines load the file; the benchmark feeds token ids, never text.

Types per file type, as llama.cpp picks them:
  q8_0    every matrix Q8_0
  q4_0    every matrix Q4_0; the output (here the tied token embedding) Q6_K
  q4_k_m  matrices Q4_K; attn_v and ffn_down Q6_K in the "more bits" layers (the first
          and last eighth, and every third between); the output Q6_K
  K-quants need rows of a multiple of 256 values; llama.cpp falls back to Q5_0 for Q4_K
  and Q8_0 for Q6_K otherwise, and so does this script.

--family F writes the shape's layers in another dense family's layout, under its GGUF
architecture name, so that each family's decode can be set against the Llama path's at
the same layer shape (benchmarks/dense_families.py):
  phi3     attn_qkv [q; k; v] and ffn_up [gate; up] fused; an untied output (Q6_K, as the
           tied embedding is here)
  gemma2   norms after attention and after the MLP too (post_attention_norm,
           post_ffw_norm), soft-caps 50 and 30, a 4096-token sliding window on even layers
  olmo2    norms after the sublayers only; Q/K norms over the whole projection
  smollm3  llama's tensors; every 4th layer without RoPE (llama.cpp's rule for the arch)
  granite  llama's tensors; Granite 3 2B's multipliers as granite.*_scale keys
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf.constants import GGML_QUANT_SIZES

SHAPES = {
    "llama-3.2-1b": dict(arch="llama", d=2048, f=8192, layers=16, heads=32, kv=8, vocab=128256,
                         theta=500000.0, qkv_bias=False),
    "qwen2.5-0.5b": dict(arch="qwen2", d=896, f=4864, layers=24, heads=14, kv=2, vocab=151936,
                         theta=1000000.0, qkv_bias=True),
}  # fmt: skip
FILE_TYPES = ("q8_0", "q4_0", "q4_k_m")
FAMILIES = ("llama", "phi3", "gemma2", "olmo2", "smollm3", "granite")
# Granite 3.x 2B's multipliers, as llama.cpp's converter names them
GRANITE_SCALES = dict(embedding_scale=12.0, attention_scale=0.015625, residual_scale=0.22,
                      logit_scale=8.0)  # fmt: skip
FALLBACK = {GT.Q4_K: GT.Q5_0, GT.Q6_K: GT.Q8_0}


def more_bits(layer: int, n: int) -> bool:
    """llama.cpp's use_more_bits: which layers of a Q4_K_M file get Q6_K attn_v/ffn_down."""
    return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2


def pick_type(ftype: str, role: str, cols: int, layer: int, n_layers: int) -> GT:
    if ftype == "q8_0":
        qtype = GT.Q8_0
    elif role == "output":
        qtype = GT.Q6_K
    elif ftype == "q4_0":
        qtype = GT.Q4_0
    elif role in ("attn_v", "ffn_down") and more_bits(layer, n_layers):
        qtype = GT.Q6_K
    else:
        qtype = GT.Q4_K
    if qtype in FALLBACK and cols % 256:
        qtype = FALLBACK[qtype]
    return qtype


def random_blocks(rng: np.random.Generator, qtype: GT, rows: int, cols: int) -> np.ndarray:
    """Random valid blocks [rows, bytes per row]: random codes, small positive f16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = (rng.random((rows, cols // block, 2)) * 1e-3 + 1e-3).astype(np.float16)
    scale = scale.view(np.uint8).reshape(rows, cols // block, 4)
    if qtype == GT.Q6_K:  # d last
        raw[..., -2:] = scale[..., :2]
    elif qtype in (GT.Q4_K, GT.Q5_K):  # d, dmin first
        raw[..., 0:4] = scale
    else:  # Q8_0, Q4_0, Q5_0: d first
        raw[..., 0:2] = scale[..., :2]
    return raw.reshape(rows, -1)


def write(shape: str, ftype: str, path: Path, seed: int = 0, family: str = "llama") -> None:
    s = SHAPES[shape]
    d, f, n_layers, hd = s["d"], s["f"], s["layers"], s["d"] // s["heads"]
    rng = np.random.default_rng(seed)
    arch = s["arch"] if family == "llama" else family
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random {shape} {ftype}" + ("" if family == "llama" else f", {family} layout"))
    w.add_block_count(n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(1e-6)
    if family == "gemma2":
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_sliding_window(4096)
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if family == "phi3":
        w.add_rope_dimension_count(hd)
    if family == "granite":
        for key, value in GRANITE_SCALES.items():
            getattr(w, f"add_{key}")(value)
    vocab = s["vocab"]
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"▁t{i}" for i in range(3, vocab)])
    w.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, vocab)])
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(name: str, rows: int, cols: int, role: str, layer: int = 0) -> None:
        qtype = pick_type(ftype, role, cols, layer, n_layers)
        w.add_tensor(name, random_blocks(rng, qtype, rows, cols), raw_dtype=qtype)

    def vector(name: str, n: int, value: float | None = None) -> None:
        data = np.full(n, value, np.float32) if value is not None else rng.standard_normal(n)
        w.add_tensor(name, data.astype(np.float32))

    matrix("token_embd.weight", vocab, d, "output")  # tied: quantized as the output
    if family == "phi3":  # llama.cpp's phi3 needs its own output
        matrix("output.weight", vocab, d, "output")
    kv = s["kv"] * hd
    for i in range(n_layers):
        blk = f"blk.{i}"
        if family != "olmo2":  # OLMo 2 norms after the sublayers only
            vector(f"{blk}.attn_norm.weight", d, 1.0)
        if family == "phi3":  # [q; k; v] in one matrix
            matrix(f"{blk}.attn_qkv.weight", d + 2 * kv, d, "attn_v", i)
        else:
            for part, rows in (("attn_q", d), ("attn_k", kv), ("attn_v", kv)):
                matrix(f"{blk}.{part}.weight", rows, d, part, i)
                if s["qkv_bias"]:
                    vector(f"{blk}.{part}.bias", rows)
        if family == "olmo2":
            vector(f"{blk}.attn_q_norm.weight", d, 1.0)
            vector(f"{blk}.attn_k_norm.weight", kv, 1.0)
        matrix(f"{blk}.attn_output.weight", d, d, "attn_output", i)
        if family in ("gemma2", "olmo2"):
            vector(f"{blk}.post_attention_norm.weight", d, 1.0)
        if family != "olmo2":
            vector(f"{blk}.ffn_norm.weight", d, 1.0)
        if family == "phi3":  # [gate; up] in one matrix
            matrix(f"{blk}.ffn_up.weight", 2 * f, d, "ffn_up", i)
        else:
            matrix(f"{blk}.ffn_gate.weight", f, d, "ffn_gate", i)
            matrix(f"{blk}.ffn_up.weight", f, d, "ffn_up", i)
        matrix(f"{blk}.ffn_down.weight", d, f, "ffn_down", i)
        if family in ("gemma2", "olmo2"):
            vector(f"{blk}.post_ffw_norm.weight", d, 1.0)
    vector("output_norm.weight", d, 1.0)
    finish(w)


def finish(w: gguf.GGUFWriter) -> None:
    """Write the file: header, metadata, tensors."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("ftype", choices=FILE_TYPES)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=FAMILIES, default="llama",
                   help="write the shape's layers in this dense family's layout")  # fmt: skip
    args = p.parse_args()
    write(args.shape, args.ftype, args.out, args.seed, args.family)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
