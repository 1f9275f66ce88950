"""`tokenmill bench --shape NAME[:TYPE]` (bench/shapes.py): random-weight GGUFs of real
model shapes, written once into the cache.

The real shapes are checked without writing them (their tensor bytes against the sizes
of the published files); the files themselves are written at tiny shapes of the same
layouts, and read by tokenmill and by llama.cpp to the same greedy tokens.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as GT
from gguf import GGUFReader
from helpers import assert_same_greedy_but_ties, llama_cpp_greedy

from tokenmill.bench import shapes
from tokenmill.layers.quant_linear import QuantLinear
from tokenmill.llm import LLM
from tokenmill.sampling import SamplingParams

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
TINY_DENSE = dict(arch="llama", d=256, f=512, layers=3, heads=4, kv=2, vocab=300,
                  theta=10000.0, qkv_bias=False, tied=True)  # fmt: skip
TINY_MOE = dict(arch="qwen3moe", d=256, heads=4, kv=2, hd=64, experts=8, fe=256, top=2,
                vocab=300, theta=10000.0, qk_norm="head", layers=3, bench_layers=2)  # fmt: skip
# gpt-oss's layout (biases, sinks, sliding and full layers, YaRN) at a tiny size
TINY_GPT_OSS = dict(shapes.MOE["gpt-oss-20b"], d=256, heads=4, kv=2, hd=64, experts=8, fe=256,
                    top=2, vocab=300, layers=2, sliding=8)  # fmt: skip


@pytest.mark.parametrize(
    "shape, ftype, published",
    [
        # bartowski's Llama-3.2-1B-Instruct and Llama-3.1-8B-Instruct GGUFs (bytes)
        ("llama-3.2-1b", "q4_k_m", 807.7e6),
        ("llama-3.2-1b", "q8_0", 1.32e9),
        ("llama-3.1-8b", "q4_k_m", 4.92e9),
        ("llama-3.1-8b", "q8_0", 8.54e9),
    ],
)
def test_real_shapes_weigh_what_the_published_files_do(shape, ftype, published):
    """Shapes and per-tensor types as llama.cpp's quantizer gives them: the tensor bytes
    are within 3% of the published file of that model and type."""
    assert abs(shapes.tensor_bytes(shape, ftype) / published - 1) < 0.03


def test_tensor_types_follow_llama_cpps_rules():
    """Q4_K_M: Q6_K attn_v / ffn_down on the layers given more bits, Q6_K output; the
    K-quants fall back where a row is not whole super-blocks; an untied 8B embedding is
    Q4_K, a tied one is quantized as the output."""
    assert shapes.pick_type("q4_k_m", "ffn_down", 4096, 0, 32) == GT.Q6_K
    assert shapes.pick_type("q4_k_m", "ffn_down", 4096, 4, 32) == GT.Q4_K
    assert shapes.pick_type("q4_k_m", "ffn_up", 896, 0, 24) == GT.Q5_0
    assert shapes.pick_type("q5_k_m", "ffn_up", 896, 0, 24) == GT.Q5_1
    assert shapes.pick_type("q5_k_m", "ffn_up", 1024, 0, 24) == GT.Q5_K
    assert shapes.pick_type("q6_k", "attn_q", 896, 0, 24) == GT.Q8_0
    _, big = shapes.plan("llama-3.1-8b", "q4_k_m", layers=1)
    types = {t.name: t.qtype for t in big.tensors}
    assert types["token_embd.weight"] == GT.Q4_K and types["output.weight"] == GT.Q6_K
    _, small = shapes.plan("llama-3.2-1b", "q4_k_m", layers=1)
    assert "output.weight" not in {t.name for t in small.tensors}


def test_spec_errors_name_the_problem():
    assert shapes.parse_spec("llama-3.2-1b") == ("llama-3.2-1b", "q4_k_m")
    assert shapes.parse_spec("qwen3-30b-a3b:Q8_0") == ("qwen3-30b-a3b", "q8_0")
    with pytest.raises(
        ValueError, match=r"unknown shape 'llama-9b' \(known: gpt-oss-20b, llama-3.1-8b"
    ):
        shapes.parse_spec("llama-9b")
    with pytest.raises(ValueError, match=r"unknown file type 'iq3_s' \(known: q8_0"):
        shapes.parse_spec("llama-3.2-1b:iq3_s")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "llama-9b"], "unknown shape 'llama-9b'"),
        (
            ["--shape", "llama-3.2-1b", "--model", "smollm2-135m-instruct"],
            "--shape and --model each name",
        ),
        (["--shape-layers", "2"], "--shape-layers applies to --shape"),
        (["--shape", "llama-3.2-1b", "--shape-layers", "0"], "--shape-layers"),
    ],
)
def test_cli_refuses_bad_shapes_in_one_line(argv, message, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "bench", "--quick", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TOKENMILL_CACHE": str(tmp_path)},  # nothing written for real
    )
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr


def test_cached_writes_once_under_a_name_of_its_shape(tmp_path, monkeypatch):
    """The file lands in the cache under its shape, type, layer count and seed, written
    once; an MoE shape keeps its bench_layers by default."""
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    monkeypatch.setitem(shapes.DENSE, "tiny", TINY_DENSE)
    monkeypatch.setitem(shapes.MOE, "tiny-moe", TINY_MOE)
    path = shapes.cached("tiny:q8_0")
    assert path == tmp_path / "shapes" / "tiny-q8_0-3of3-seed0.gguf"
    stamp = path.stat().st_mtime_ns
    assert shapes.cached("tiny:q8_0") == path and path.stat().st_mtime_ns == stamp
    moe = shapes.cached("tiny-moe")
    assert moe.name == "tiny-moe-q4_k_m-2of3-seed0.gguf"
    reader = GGUFReader(moe)
    assert int(reader.fields["qwen3moe.block_count"].parts[-1][0]) == 2
    assert [p.name for p in (tmp_path / "shapes").iterdir() if p.name.startswith(".")] == []
    assert os.path.getsize(moe) > shapes.tensor_bytes("tiny-moe", "q4_k_m", 2)


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")
@pytest.mark.parametrize(
    "shape, ftype",
    [(s, f) for s in ("tiny", "tiny-moe") for f in shapes.FILE_TYPES]
    # rows of 512 and 1024: Q5_K and Q5_0/Q5_1 as 5-bit codes in whole lane groups on every
    # build (the 256-wide tiny rows: a partial group on AVX-512)
    # (IQ2_XS as 3-bit codes into its table)
    + [
        ("tiny-wide", "q5_k_m"),
        ("tiny-wide", "iq2_xs"),
        ("tiny-gpt-oss", "mxfp4_moe"),
        ("tiny-gpt-oss", "q8_0"),
    ],  # fmt: skip
)
def test_tokenmill_and_llama_cpp_read_a_shape_file_alike(tmp_path, monkeypatch, shape, ftype):
    """Each file type of both layouts loads in both engines, and greedy decoding agrees
    but for a near tie (llama.cpp quantizes activations to 8 bits, tokenmill to 16)."""
    monkeypatch.setitem(shapes.DENSE, "tiny", TINY_DENSE)
    monkeypatch.setitem(shapes.DENSE, "tiny-wide", {**TINY_DENSE, "d": 512, "f": 1024})
    monkeypatch.setitem(shapes.MOE, "tiny-moe", TINY_MOE)
    monkeypatch.setitem(shapes.MOE, "tiny-gpt-oss", TINY_GPT_OSS)
    path = tmp_path / f"{shape}-{ftype}.gguf"
    shapes.write(shape, ftype, path, seed=3)
    prompt = list(range(5, 29))
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)
    llm = LLM(path, kv_cache_memory="256tok")
    layers = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    if shape == "tiny-wide" and ftype == "q5_k_m":  # the Q5_K layers kept at 5 bits (Q6_K's at 6)
        assert {m.bits for m in layers} == {5, 6}
    if ftype == "iq2_xs":  # IQ2_XS at 3.44 bits, not requantized
        grid = [m for m in layers if "IQ2_XS" in m.sources]
        assert grid and all(m.bits == 3 and m.lut is not None for m in grid)
    if ftype == "mxfp4_moe" and shape != "tiny":  # experts at 4.25 bits, a table of FP4 values
        experts = [
            m
            for m in llm.engine.model.modules()
            if isinstance(m, QuantLinear) and "MXFP4" in m.sources
        ]
        assert experts and all(m.bits == 4 and m.lut is not None for m in experts)
    ours = llm.generate([prompt], greedy)[0]
    assert_same_greedy_but_ties(ours, llama_cpp_greedy(path, prompt, 10), tol=0.05)


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")
@pytest.mark.parametrize(
    "ftype, kept", [("q2_k", {2: GT.Q2_K, 3: GT.Q3_K}), ("q3_k_m", {3: GT.Q3_K})]
)
def test_llama_cpps_2_and_3_bit_k_quants_are_held_at_their_size_and_read_alike(
    tmp_path, monkeypatch, ftype, kept
):
    """A Q8_0 shape file re-quantized by llama.cpp's own quantizer to Q2_K and Q3_K_M (rows
    of 512 and 1024: whole lane groups on every build): the Q2_K and Q3_K tensors are held
    as 2- and 3-bit codes at the file's bytes (10.5 and 13.75 per 32 values), and greedy
    decoding agrees with llama.cpp's on the same file."""
    from tokenmill.bench import types

    monkeypatch.setitem(shapes.DENSE, "tiny-wide", {**TINY_DENSE, "d": 512, "f": 1024})
    source = tmp_path / "tiny-wide-q8_0.gguf"
    shapes.write("tiny-wide", "q8_0", source, seed=5)
    path = types.requantized(source, ftype)
    file_types = {t.tensor_type for t in GGUFReader(path).tensors}
    assert set(kept.values()) <= file_types, file_types
    llm = LLM(path, kv_cache_memory="256tok")
    layers = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    for bits, qtype in kept.items():
        held = [m for m in layers if qtype.name in m.sources]
        assert held and all(m.bits == bits for m in held), (qtype.name, {m.bits for m in held})
        per32 = {2: 10.5, 3: 13.75}[bits]
        assert all(m.nbytes == m.out_features * m.in_features * per32 / 32 for m in held)
    prompt = list(range(5, 29))
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)
    ours = llm.generate([prompt], greedy)[0]
    assert_same_greedy_but_ties(ours, llama_cpp_greedy(path, prompt, 10), tol=0.05)
