"""Write a GGUF file of a real model's shape with random weights, for speed comparisons.

    python benchmarks/random_gguf.py llama-3.2-1b q4_0 /tmp/llama-1b-q4_0.gguf
    tokenmill bench --model /tmp/llama-1b-q4_0.gguf --peers llamacpp --skip throughput

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


def write(shape: str, ftype: str, path: Path, seed: int = 0) -> None:
    s = SHAPES[shape]
    d, f, n_layers, hd = s["d"], s["f"], s["layers"], s["d"] // s["heads"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), s["arch"])
    w.add_name(f"random {shape} {ftype}")
    w.add_block_count(n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(1e-6)
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
    kv = s["kv"] * hd
    for i in range(n_layers):
        vector(f"blk.{i}.attn_norm.weight", d, 1.0)
        for part, rows in (("attn_q", d), ("attn_k", kv), ("attn_v", kv)):
            matrix(f"blk.{i}.{part}.weight", rows, d, part, i)
            if s["qkv_bias"]:
                vector(f"blk.{i}.{part}.bias", rows)
        matrix(f"blk.{i}.attn_output.weight", d, d, "attn_output", i)
        vector(f"blk.{i}.ffn_norm.weight", d, 1.0)
        matrix(f"blk.{i}.ffn_gate.weight", f, d, "ffn_gate", i)
        matrix(f"blk.{i}.ffn_up.weight", f, d, "ffn_up", i)
        matrix(f"blk.{i}.ffn_down.weight", d, f, "ffn_down", i)
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
    args = p.parse_args()
    write(args.shape, args.ftype, args.out, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
