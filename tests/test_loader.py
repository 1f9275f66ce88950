"""GGUF loading on small generated files: the Q/K unpermutation, every block format, and
one clear error for each kind of bad file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import build_hf_model, write_llama_gguf
from test_models_hf import Single

from tokenmill.loader import LoadError, open_checkpoint
from tokenmill.models.transformer import Transformer


def _logits(folder_or_file, prompt):
    return Single(folder_or_file).feed(prompt)


@pytest.mark.parametrize("qtype", [None, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_gguf_matches_transformers(tmp_path, qtype):
    hf = build_hf_model("llama", tmp_path / "hf", tie_word_embeddings=False)
    path = tmp_path / "tiny.gguf"
    hf = write_llama_gguf(hf, path, qtype)  # hf now holds the file's exact weights
    prompt = list(range(2, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (_logits(path, prompt) - ref).abs().max().item() < 1e-4


def _load(path):
    ckpt = open_checkpoint(path)
    Transformer(ckpt.config).load_weights(ckpt, torch.float32)


@pytest.fixture
def tiny_gguf(tmp_path):
    def make(**kw):
        hf = build_hf_model("llama", tmp_path / "hf")
        path = tmp_path / "bad.gguf"
        write_llama_gguf(hf, path, **kw)
        return path

    return make


def _one_line_error(path, match):
    with pytest.raises(LoadError) as err:
        _load(path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and match in msg, msg


def test_wrong_magic(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + b"\0" * 100)
    _one_line_error(path, "not a GGUF file")


def test_truncated(tiny_gguf):
    path = tiny_gguf()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _one_line_error(path, "truncated")


def test_truncated_header(tiny_gguf):
    path = tiny_gguf()
    path.write_bytes(path.read_bytes()[:200])
    _one_line_error(path, "truncated")


def test_missing_tensor(tiny_gguf):
    _one_line_error(
        tiny_gguf(drop={"blk.1.ffn_up.weight"}), "missing tensor 'layers.1.mlp.up.weight'"
    )


def test_shape_mismatch(tiny_gguf):
    _one_line_error(tiny_gguf(reshape={"blk.0.ffn_gate.weight"}), "has shape")


def test_unsupported_architecture(tmp_path):
    hf = build_hf_model("llama", tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_llama_gguf(hf, path, arch="mamba")
    _one_line_error(path, "unsupported architecture 'mamba'")


def test_unsupported_quant_type(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(
        block_count=1, context_length=64, embedding_length=32, feed_forward_length=64, head_count=4
    ).items():
        getattr(w, f"add_{key}")(value)
    # Q8_1 (llama.cpp's activation type, never a weight's): a 32-value block is 40 bytes
    w.add_tensor(
        "token_embd.weight",
        np.zeros((8, 40), dtype=np.uint8),
        raw_dtype=gguf.GGMLQuantizationType.Q8_1,
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LoadError) as err:
        ckpt = open_checkpoint(path)
        ckpt.tensors["embed.weight"]()
    assert "unsupported quantization type Q8_1" in str(err.value)


def test_hf_folder_errors(tmp_path):
    hf_dir = tmp_path / "hf"
    build_hf_model("llama", hf_dir)
    # pickle weights only: refused
    pkl = tmp_path / "pkl"
    pkl.mkdir()
    shutil.copy(hf_dir / "config.json", pkl)
    (pkl / "pytorch_model.bin").write_bytes(b"\x80\x04")
    _one_line_error(pkl, "safetensors only")
    # truncated safetensors
    trunc = tmp_path / "trunc"
    shutil.copytree(hf_dir, trunc)
    st = trunc / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    with pytest.raises(LoadError) as err:
        _load(trunc)
    assert "model.safetensors" in str(err.value) and "\n" not in str(err.value)
    # unsupported architecture in config.json
    arch = tmp_path / "arch"
    shutil.copytree(hf_dir, arch)
    (arch / "config.json").write_text('{"model_type": "mamba"}')
    _one_line_error(arch, "unsupported architecture 'mamba'")
    # no such path
    _one_line_error(tmp_path / "nope", "no such file")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gpt2"])
def test_checkpoint_shapes_match_the_model(tmp_path, arch):
    """The shapes a file is checked against before loading (computed from the config) are
    the shapes of the model's parameters (built on the meta device), fused ones included."""
    from tokenmill.loader.hf_config import from_hf_config
    from tokenmill.loader.shapes import checkpoint_shapes
    from tokenmill.models.transformer import checkpoint_parts

    for tie in (True, False):
        build_hf_model(arch, tmp_path, tie_word_embeddings=tie)
        cfg = from_hf_config(json.loads((tmp_path / "config.json").read_text()))
        expected = checkpoint_shapes(cfg)
        with torch.device("meta"):
            model = Transformer(cfg)
        seen = set()
        for name, param in model.named_parameters():
            parts = checkpoint_parts(name, cfg.mlp == "gated")
            shapes = [expected[p] for p in parts]
            assert all(s[1:] == tuple(param.shape[1:]) for s in shapes), (name, shapes)
            assert sum(s[0] for s in shapes) == param.shape[0], (name, shapes, param.shape)
            seen.update(parts)
        assert seen == set(expected)
