"""Random-weight GGUFs of real model shapes: `tokenmill bench --shape NAME[:TYPE]`.

The model hub is out of reach here, and speed depends on the shapes and the block types,
not on the values: every tensor here has the real model's shape, and the type llama.cpp's
quantizer gives it for the file type (llama_tensor_get_type), filled with random codes and
small positive float16 scales (weights of about 0.02, as trained ones). Both engines read
the same file, so the comparison is the one a user gets on the real model's download.

Types per file type, as llama.cpp picks them:
  q8_0    every matrix Q8_0
  q4_0    every matrix Q4_0; the un-embedding Q6_K
  q4_k_m  Q4_K; attn_v and ffn_down Q6_K on the layers llama.cpp gives more bits (the
          first and last eighth, and every third between); the un-embedding Q6_K
  q5_k_m  as q4_k_m with Q5_K for Q4_K
  q6_k    every matrix Q6_K
  iq2_xs  IQ2_XS; attn_v Q4_K (a GQA model's, as llama.cpp picks it) and the un-embedding
          Q5_K. llama.cpp's quantizer needs an importance matrix for IQ2_XS; random
          blocks are valid without one
  K-quants need rows of a multiple of 256 values; llama.cpp falls back to Q5_0 for Q4_K,
  Q5_1 for Q5_K and Q8_0 for Q6_K otherwise, and so does this module.

A file is written once into the cache folder (cache.py) under a name of its shape, type,
layer count and seed, through a temporary name (a cut-off write leaves no file that looks
whole), tensor by tensor, so that writing an 8B file holds one tensor in memory at a time.
An MoE shape keeps a few of its layers by default (`bench_layers`): decode reads the
attention, the router and the k chosen experts of each layer, so its speed per layer does
not depend on the layer count, and the whole model twice (tokenmill's copy and
llama.cpp's map) would not fit a small machine's memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf.constants import GGML_QUANT_SIZES

from tokenmill.cache import cache_dir

# ---------------------------------------------------------------------- the shapes

# Dense shapes (the Llama layout; `tied`: the un-embedding is the token embedding).
DENSE = {
    "qwen2.5-0.5b": dict(arch="qwen2", d=896, f=4864, layers=24, heads=14, kv=2, vocab=151936,
                         theta=1000000.0, qkv_bias=True, tied=True),
    "llama-3.2-1b": dict(arch="llama", d=2048, f=8192, layers=16, heads=32, kv=8, vocab=128256,
                         theta=500000.0, qkv_bias=False, tied=True),
    "llama-3.1-8b": dict(arch="llama", d=4096, f=14336, layers=32, heads=32, kv=8, vocab=128256,
                         theta=500000.0, qkv_bias=False, tied=False),
    # Qwen3-0.6B (and Qwen3-Reranker-0.6B's tower): heads of 128 over d = 1024, Q/K norms
    "qwen3-0.6b": dict(arch="qwen3", d=1024, f=3072, layers=28, heads=16, kv=8, hd=128,
                       vocab=151669, theta=1000000.0, qkv_bias=False, tied=True),
}  # fmt: skip
# Mixture-of-experts shapes: E experts of width fe, top k; Q/K norms per head or over the
# whole projection; an untied un-embedding.
MOE = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", d=2048, heads=32, kv=4, hd=128, experts=128, fe=768,
                          top=8, vocab=151936, theta=1000000.0, qk_norm="head", layers=48,
                          bench_layers=4),
    "olmoe-1b-7b": dict(arch="olmoe", d=2048, heads=16, kv=16, hd=128, experts=64, fe=1024,
                        top=8, vocab=50304, theta=10000.0, qk_norm="full", layers=16,
                        bench_layers=4),
    # gpt-oss-20b: biases everywhere, attention sinks, every other layer a 128-token
    # sliding window, YaRN; as released, its experts MXFP4 (file type mxfp4_moe)
    "gpt-oss-20b": dict(arch="gpt-oss", d=2880, heads=64, kv=8, hd=64, experts=32, fe=2880,
                        top=4, vocab=201088, theta=150000.0, layers=24, bench_layers=4,
                        sliding=128, yarn=(32.0, 4096, 32.0, 1.0)),
}  # fmt: skip
# mxfp4_moe: llama.cpp's MXFP4_MOE, experts MXFP4 and every other matrix Q8_0 (gpt-oss's files)
FILE_TYPES = ("q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "iq2_xs", "mxfp4_moe")
DEFAULT_FILE_TYPE = "q4_k_m"
FALLBACK = {GT.Q4_K: GT.Q5_0, GT.Q5_K: GT.Q5_1, GT.Q6_K: GT.Q8_0}
# Dense layouts of other families at a dense shape (benchmarks/dense_families.py):
#   phi3     attn_qkv [q; k; v] and ffn_up [gate; up] fused; an untied output
#   gemma2   norms after attention and after the MLP too, soft-caps 50 and 30, a
#            4096-token sliding window
#   olmo2    norms after the sublayers only; Q/K norms over the whole projection
#   smollm3  llama's tensors; every 4th layer without RoPE (llama.cpp's rule for the arch)
#   granite  llama's tensors; Granite 3 2B's multipliers as granite.*_scale keys
FAMILIES = ("llama", "phi3", "gemma2", "olmo2", "smollm3", "granite")
GRANITE_SCALES = dict(embedding_scale=12.0, attention_scale=0.015625, residual_scale=0.22,
                      logit_scale=8.0)  # fmt: skip


def names() -> list[str]:
    return sorted({**DENSE, **MOE})


def parse_spec(spec: str) -> tuple[str, str]:
    """'NAME[:TYPE]' -> (shape, file type); a ValueError names what is known."""
    name, _, ftype = spec.partition(":")
    ftype = (ftype or DEFAULT_FILE_TYPE).lower()
    if name not in DENSE and name not in MOE:
        raise ValueError(f"unknown shape {name!r} (known: {', '.join(names())})")
    if ftype not in FILE_TYPES:
        raise ValueError(f"unknown file type {ftype!r} (known: {', '.join(FILE_TYPES)})")
    return name, ftype


# ---------------------------------------------------------------------- tensor types


def more_bits(layer: int, n: int) -> bool:
    """llama.cpp's use_more_bits: which layers of a *_K_M file get Q6_K attn_v/ffn_down."""
    return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2


def pick_type(
    ftype: str, role: str, cols: int, layer: int, n_layers: int, expert: bool = False
) -> GT:
    """The type llama.cpp's quantizer gives a [rows, cols] matrix of `role` in `ftype`
    (`expert`: a stack of experts' matrices)."""
    if ftype == "mxfp4_moe":
        return GT.MXFP4 if expert else GT.Q8_0
    if ftype == "q8_0":
        qtype = GT.Q8_0
    elif ftype == "iq2_xs":
        qtype = {"output": GT.Q5_K, "attn_v": GT.Q4_K}.get(role, GT.IQ2_XS)
    elif role == "output" or ftype == "q6_k":
        qtype = GT.Q6_K
    elif ftype == "q4_0":
        qtype = GT.Q4_0
    elif role in ("attn_v", "ffn_down") and more_bits(layer, n_layers):
        qtype = GT.Q6_K
    else:
        qtype = GT.Q5_K if ftype == "q5_k_m" else GT.Q4_K
    if qtype in FALLBACK and cols % 256:
        qtype = FALLBACK[qtype]
    return qtype


# The super-block or block scale d per type that makes random codes weigh ~0.02 on
# average, as trained weights do: 0.02 over the mean |code term| (Q8_0 |q| ~ 64, Q4_0
# |q - 8| ~ 4, Q4_K sc * q ~ 32 * 7.5, Q6_K |sc (q - 32)| ~ 64 * 16, ...). Speed does
# not depend on it; agreement between engines does, as huge weights make activations
# and logits huge and every rounding difference a flipped token.
TYPICAL_D = {GT.Q8_0: 3e-4, GT.Q4_0: 5e-3, GT.Q4_1: 2.5e-3, GT.Q5_0: 2.5e-3, GT.Q5_1: 1.3e-3,
             GT.Q4_K: 8e-5, GT.Q5_K: 4e-5, GT.Q6_K: 2e-5, GT.IQ4_NL: 3e-4,
             GT.Q3_K: 1.5e-4, GT.Q2_K: 4e-4, GT.IQ2_XS: 4e-4}  # fmt: skip
# MXFP4: the E8M0 exponent byte e scales codes (ggml's doubled FP4 values, |v| <= 12) by
# 2^(e - 128): e 120-121 makes weights of about 0.02
MXFP4_EXPONENTS = (120, 122)


def random_blocks(rng: np.random.Generator, qtype: GT, rows: int, cols: int) -> np.ndarray:
    """Random valid blocks [rows, bytes per row]: random codes and sub-scales, positive
    f16 scales (and mins) of about TYPICAL_D."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if qtype == GT.MXFP4:  # the exponent byte first
        raw[..., 0] = rng.integers(*MXFP4_EXPONENTS, size=(rows, cols // block), dtype=np.uint8)
        return raw.reshape(rows, -1)
    d = TYPICAL_D[qtype]
    scale = (rng.random((rows, cols // block, 2)) * d + d * 0.5).astype(np.float16)
    scale = scale.view(np.uint8).reshape(rows, cols // block, 4)
    if qtype in (GT.Q6_K, GT.Q3_K):  # d last
        raw[..., -2:] = scale[..., :2]
    elif qtype == GT.Q2_K:  # d and dmin last
        raw[..., -4:] = scale
    elif qtype in (GT.Q4_K, GT.Q5_K, GT.Q4_1, GT.Q5_1):  # d and dmin (or m) first
        raw[..., 0:4] = scale
    else:  # Q8_0, Q4_0, Q5_0: d first
        raw[..., 0:2] = scale[..., :2]
    return raw.reshape(rows, -1)


# ---------------------------------------------------------------------- the writer


@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order; quantized: the byte shape
    qtype: GT | None  # None: float32
    make: Callable[[np.random.Generator], np.ndarray]

    @property
    def dtype(self) -> np.dtype:  # as made: block bytes, or float32 values
        return np.dtype(np.uint8 if self.qtype is not None else np.float32)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


class _Plan:
    """The file's tensors in order, made one at a time as they are written."""

    def __init__(self, ftype: str, n_layers: int):
        self.ftype, self.n_layers, self.tensors = ftype, n_layers, []

    def matrix(self, name: str, rows: int, cols: int, role: str, layer: int = 0, n: int = 0):
        """A [rows, cols] matrix, or n experts' [n, rows, cols], of the file type's type."""
        qtype = pick_type(self.ftype, role, cols, layer, self.n_layers, expert=n > 0)
        block, size = GGML_QUANT_SIZES[qtype]
        row_bytes = cols // block * size
        shape = (n, rows, row_bytes) if n else (rows, row_bytes)

        def make(rng, shape=shape):
            return random_blocks(rng, qtype, rows * max(n, 1), cols).reshape(shape)

        self.tensors.append(_Tensor(name, shape, qtype, make))

    def vector(self, name: str, shape: tuple[int, ...], value: float | None = 1.0):
        """Float32 `value` everywhere, or (None) small random values (biases, routers)."""

        def make(rng, shape=shape):
            if value is None:
                return (rng.standard_normal(shape) * 0.05).astype(np.float32)
            return np.full(shape, value, np.float32)

        self.tensors.append(_Tensor(name, shape, None, make))


def _vocab(w: gguf.GGUFWriter, vocab: int) -> None:
    """A SentencePiece-style vocabulary of `vocab` made-up pieces (<unk>, <s>, </s> first)."""
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"▁t{i}" for i in range(3, vocab)])
    w.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, vocab)])
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _dense(w: gguf.GGUFWriter, s: dict, plan: _Plan, family: str) -> None:
    d, f, n_layers = s["d"], s["f"], plan.n_layers
    hd = s.get("hd") or d // s["heads"]
    q_rows = s["heads"] * hd
    w.add_feed_forward_length(f)
    if "hd" in s:
        w.add_key_length(hd)
        w.add_value_length(hd)
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
    vocab, kv = s["vocab"], s["kv"] * hd
    # tied: quantized as the un-embedding (llama.cpp's rule for a tied token_embd)
    plan.matrix("token_embd.weight", vocab, d, "output" if s["tied"] else "token_embd")
    if not s["tied"] or family == "phi3":  # llama.cpp's phi3 needs its own output
        plan.matrix("output.weight", vocab, d, "output")
    for i in range(n_layers):
        blk = f"blk.{i}"
        if family != "olmo2":  # OLMo 2 norms after the sublayers only
            plan.vector(f"{blk}.attn_norm.weight", (d,))
        if family == "phi3":  # [q; k; v] in one matrix
            plan.matrix(f"{blk}.attn_qkv.weight", d + 2 * kv, d, "attn_v", i)
        else:
            for part, rows in (("attn_q", q_rows), ("attn_k", kv), ("attn_v", kv)):
                plan.matrix(f"{blk}.{part}.weight", rows, d, part, i)
                if s["qkv_bias"]:
                    plan.vector(f"{blk}.{part}.bias", (rows,), None)
        if family == "olmo2":
            plan.vector(f"{blk}.attn_q_norm.weight", (d,))
            plan.vector(f"{blk}.attn_k_norm.weight", (kv,))
        if s["arch"] == "qwen3":  # per head
            plan.vector(f"{blk}.attn_q_norm.weight", (hd,))
            plan.vector(f"{blk}.attn_k_norm.weight", (hd,))
        plan.matrix(f"{blk}.attn_output.weight", d, q_rows, "attn_output", i)
        if family in ("gemma2", "olmo2"):
            plan.vector(f"{blk}.post_attention_norm.weight", (d,))
        if family != "olmo2":
            plan.vector(f"{blk}.ffn_norm.weight", (d,))
        if family == "phi3":  # [gate; up] in one matrix
            plan.matrix(f"{blk}.ffn_up.weight", 2 * f, d, "ffn_up", i)
        else:
            plan.matrix(f"{blk}.ffn_gate.weight", f, d, "ffn_gate", i)
            plan.matrix(f"{blk}.ffn_up.weight", f, d, "ffn_up", i)
        plan.matrix(f"{blk}.ffn_down.weight", d, f, "ffn_down", i)
        if family in ("gemma2", "olmo2"):
            plan.vector(f"{blk}.post_ffw_norm.weight", (d,))
    plan.vector("output_norm.weight", (d,))


def _moe_keys(w: gguf.GGUFWriter, s: dict) -> None:
    """The header keys every MoE shape has: head size, expert count, width and top k."""
    w.add_feed_forward_length(s["fe"])
    w.add_key_length(s["hd"])
    w.add_value_length(s["hd"])
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["top"])
    w.add_expert_feed_forward_length(s["fe"])


def _gpt_oss(w: gguf.GGUFWriter, s: dict, plan: _Plan) -> None:
    """gpt-oss's tensors and keys under llama.cpp's names (tests/test_gpt_oss_gguf.py)."""
    d, hd, E, fe, H = s["d"], s["hd"], s["experts"], s["fe"], s["heads"]
    q_rows, kv_rows = H * hd, s["kv"] * hd
    _moe_keys(w, s)
    w.add_sliding_window(s["sliding"])
    factor, orig, beta_fast, beta_slow = s["yarn"]
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(factor)
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_rope_scaling_yarn_beta_fast(beta_fast)
    w.add_rope_scaling_yarn_beta_slow(beta_slow)
    plan.matrix("token_embd.weight", s["vocab"], d, "token_embd")
    for i in range(plan.n_layers):
        blk = f"blk.{i}"
        plan.vector(f"{blk}.attn_norm.weight", (d,))
        for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
            plan.matrix(f"{blk}.{part}.weight", rows, d, part, i)
            plan.vector(f"{blk}.{part}.bias", (rows,), None)
        plan.matrix(f"{blk}.attn_output.weight", d, q_rows, "attn_output", i)
        plan.vector(f"{blk}.attn_output.bias", (d,), None)
        plan.vector(f"{blk}.attn_sinks.weight", (H,), None)
        plan.vector(f"{blk}.post_attention_norm.weight", (d,))
        plan.vector(f"{blk}.ffn_gate_inp.weight", (E, d), None)  # the router, F32
        plan.vector(f"{blk}.ffn_gate_inp.bias", (E,), None)
        for part in ("ffn_gate", "ffn_up"):
            plan.matrix(f"{blk}.{part}_exps.weight", fe, d, part, i, n=E)
            plan.vector(f"{blk}.{part}_exps.bias", (E, fe), None)
        plan.matrix(f"{blk}.ffn_down_exps.weight", d, fe, "ffn_down", i, n=E)
        plan.vector(f"{blk}.ffn_down_exps.bias", (E, d), None)
    plan.vector("output_norm.weight", (d,))
    plan.matrix("output.weight", s["vocab"], d, "output")


def _moe(w: gguf.GGUFWriter, s: dict, plan: _Plan) -> None:
    d, hd, E, fe = s["d"], s["hd"], s["experts"], s["fe"]
    q_rows, kv_rows = s["heads"] * hd, s["kv"] * hd
    _moe_keys(w, s)
    plan.matrix("token_embd.weight", s["vocab"], d, "token_embd")
    norm = hd if s["qk_norm"] == "head" else None
    for i in range(plan.n_layers):
        blk = f"blk.{i}"
        plan.vector(f"{blk}.attn_norm.weight", (d,))
        plan.matrix(f"{blk}.attn_q.weight", q_rows, d, "attn_q", i)
        plan.matrix(f"{blk}.attn_k.weight", kv_rows, d, "attn_k", i)
        plan.matrix(f"{blk}.attn_v.weight", kv_rows, d, "attn_v", i)
        plan.vector(f"{blk}.attn_q_norm.weight", (norm or q_rows,))
        plan.vector(f"{blk}.attn_k_norm.weight", (norm or kv_rows,))
        plan.matrix(f"{blk}.attn_output.weight", d, q_rows, "attn_output", i)
        plan.vector(f"{blk}.ffn_norm.weight", (d,))
        plan.vector(f"{blk}.ffn_gate_inp.weight", (E, d), None)  # the router, F32
        plan.matrix(f"{blk}.ffn_gate_exps.weight", fe, d, "ffn_gate", i, n=E)
        plan.matrix(f"{blk}.ffn_up_exps.weight", fe, d, "ffn_up", i, n=E)
        plan.matrix(f"{blk}.ffn_down_exps.weight", d, fe, "ffn_down", i, n=E)
    plan.vector("output_norm.weight", (d,))
    plan.matrix("output.weight", s["vocab"], d, "output")


def plan(
    shape: str, ftype: str, layers: int | None = None, family: str = "llama"
) -> tuple[gguf.GGUFWriter, _Plan]:
    """The file of shape `shape` in file type `ftype` (`layers` of the real model's,
    default all; `family`: a dense shape in another family's layout): a writer holding its
    metadata, no file opened yet, and its tensors, none made yet."""
    dense = shape in DENSE
    s = DENSE[shape] if dense else MOE[shape]
    if family != "llama" and not dense:
        raise ValueError(f"{shape} is a mixture of experts; --family applies to dense shapes")
    n_layers = layers or s["layers"]
    w = gguf.GGUFWriter(None, s["arch"] if family == "llama" else family)
    label = f"random {shape} {ftype}"
    if n_layers != s["layers"]:
        label += f", {n_layers} of {s['layers']} layers"
    w.add_name(label + ("" if family == "llama" else f", {family} layout"))
    w.add_block_count(n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(s["d"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(1e-6)
    _vocab(w, s["vocab"])
    tensors = _Plan(ftype, n_layers)
    if dense:
        _dense(w, s, tensors, family)
    elif s["arch"] == "gpt-oss":
        _gpt_oss(w, s, tensors)
    else:
        _moe(w, s, tensors)
    return w, tensors


def reranker_plan(shape: str, ftype: str) -> tuple[gguf.GGUFWriter, _Plan]:
    """`plan`'s file made a reranker as llama.cpp's converter makes Qwen3-Reranker: its
    head as cls.output [2, d] (the LM head's "no" and "yes" rows, random here), the labels
    as <arch>.classifier.output_labels, and rank pooling."""
    w, tensors = plan(shape, ftype)
    w.add_classifier_output_labels(["no", "yes"])
    w.add_pooling_type(gguf.PoolingType.RANK)
    d = (DENSE.get(shape) or MOE[shape])["d"]
    tensors.vector("cls.output.weight", (2, d), None)
    return w, tensors


def tensor_bytes(shape: str, ftype: str, layers: int | None = None) -> int:
    """Bytes of the file's tensors, without writing it."""
    return sum(t.nbytes for t in plan(shape, ftype, layers)[1].tensors)


def write(
    shape: str,
    ftype: str,
    path: Path,
    layers: int | None = None,
    seed: int = 0,
    family: str = "llama",
    reranker: bool = False,
) -> None:
    """Write the file `plan` (or `reranker_plan`) describes to `path`, one tensor in memory
    at a time."""
    w, tensors = reranker_plan(shape, ftype) if reranker else plan(shape, ftype, layers, family)
    rng = np.random.default_rng(seed)
    for t in tensors.tensors:
        w.add_tensor_info(t.name, t.shape, t.dtype, t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors.tensors:
        w.write_tensor_data(t.make(rng))
    w.close()


def cached(
    spec: str, layers: int | None = None, seed: int = 0, log=None, reranker: bool = False
) -> Path:
    """The cached file of 'NAME[:TYPE]' (written first if missing): `layers` of the
    model's (default: an MoE shape's bench_layers, a dense shape's all); with `reranker`,
    the shape made a reranker (reranker_plan), all its layers."""
    shape, ftype = parse_spec(spec)
    s = DENSE.get(shape) or MOE[shape]
    n = layers or s.get("bench_layers") or s["layers"]
    if n < 1:
        raise ValueError(f"--shape-layers must be at least 1, got {n}")
    folder = cache_dir() / "shapes"
    folder.mkdir(exist_ok=True)
    kind = "-reranker" if reranker else ""
    if reranker:
        n = s["layers"]
    path = folder / f"{shape}{kind}-{ftype}-{n}of{s['layers']}-seed{seed}.gguf"
    if path.exists():
        return path
    if log:
        log(f"writing {path.name}: random weights of {shape}'s shape as {ftype} (once)")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(shape, ftype, tmp, n, seed, reranker=reranker)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
