"""Loading packs GGUF blocks in one native pass (kernels/pack.c), byte for byte as the
numpy path (gguf_blocks.parse_* and quant_linear._store) packs them.

Every type packed as stored (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K;
2-, 3-, 5- and 6-bit codes end in a partial group where a row is not whole lane groups;
Q6_K requantized to 8-bit blocks where asked, from gguf-py's float values), at row lengths with and without a tail of blocks after the whole
groups (and a lone last block of a 4-bit tail), a dense layer and a MoE layer's experts;
then the same greedy tokens from a model file loaded either way.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from helpers import build_hf_model, mapped_rss_kib, write_llama_gguf

from tokenmill import kernels
from tokenmill.bench.shapes import random_blocks
from tokenmill.layers import quant_linear
from tokenmill.layers.quant_linear import QuantLinear
from tokenmill.llm import LLM
from tokenmill.sampling import SamplingParams

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="native kernels unavailable")
BUFFERS = ("codes", "scales_raw", "mins_raw", "dsup_raw", "msup_raw")
GW = 32 * kernels.group_blocks()  # values per whole lane group of this build
SUPER_GW = max(GW, 256)  # whole groups and whole K-quant super-blocks (256 values)
WIDTHS = {  # row lengths: whole groups, groups and a tail, a tail only, a lone tail block
    GT.Q4_0: [GW, GW + 64, 96, GW + 32 * 3, 576],
    GT.Q4_1: [GW, GW + 96, 64],
    GT.Q8_0: [GW, GW + 32, 576],
    GT.Q5_0: [2 * GW, GW + 96],
    GT.Q5_1: [GW, 160],
    GT.IQ4_NL: [GW, GW + 64, 96, 576],
    GT.MXFP4: [GW, GW + 32 * 3, 2880],
    GT.Q4_K: [256, SUPER_GW, 3 * 256, 2048],
    GT.Q5_K: [256, 3 * 256, 2048],
    GT.Q6_K: [
        SUPER_GW,
        2 * SUPER_GW,
        2048,
        256,
        768,
        1280,
    ],  # the last three end in a half group on AVX-512
    GT.Q3_K: [SUPER_GW, 2 * SUPER_GW, 2048],  # rows of whole groups (others: numpy's)
    GT.Q2_K: [SUPER_GW, 2048],
}


def _python_pack(monkeypatch, make):
    """make() with the native packer switched off."""
    with monkeypatch.context() as m:
        m.setattr(QuantLinear, "_packs_natively", classmethod(lambda cls, q, k: False))
        return make()


def _same(a: QuantLinear, b: QuantLinear) -> None:
    assert (a.bits, a.in_features, a.out_features) == (b.bits, b.in_features, b.out_features)
    for name in BUFFERS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(x.numpy().view(np.uint8), y.numpy().view(np.uint8)), name


@pytest.mark.parametrize("qtype, k", [(q, k) for q, ks in WIDTHS.items() for k in ks])
def test_dense_layer_packs_the_same_bytes(monkeypatch, qtype, k):
    rows = 37  # odd: rows split unevenly among threads
    raw = random_blocks(np.random.default_rng(k), qtype, rows, k)
    assert QuantLinear._packs_natively(qtype, k)
    native = QuantLinear.from_gguf(raw, qtype, rows, k)
    _same(native, _python_pack(monkeypatch, lambda: QuantLinear.from_gguf(raw, qtype, rows, k)))


@pytest.mark.parametrize("exponent", [1, 255])
def test_mxfp4_scales_no_byte_form_holds_take_the_numpy_path(monkeypatch, exponent):
    """An MXFP4 exponent the kernels cannot read as a byte (1: 2^-128 halved, a float32
    subnormal; 255: NaN): the native packer refuses the rows, and the layer keeps float32
    scales, as numpy packs them."""
    raw = random_blocks(np.random.default_rng(3), GT.MXFP4, 9, GW)
    raw.reshape(-1, 17)[5, 0] = exponent
    assert not kernels.pack_gguf(int(GT.MXFP4), raw, GW, *_scratch(9, GW))
    native = QuantLinear.from_gguf(raw, GT.MXFP4, 9, GW)
    assert native.scales_raw.element_size() == 4  # float32 scales (held as their bits)
    _same(native, _python_pack(monkeypatch, lambda: QuantLinear.from_gguf(raw, GT.MXFP4, 9, GW)))


def _scratch(rows: int, k: int) -> tuple[np.ndarray, np.ndarray, None, None]:
    """Packed arrays of 4-bit codes and byte scales (MXFP4's) for rows of k values."""
    return np.empty((rows, k // 2), np.uint8), np.empty((rows, k // 32), np.uint8), None, None


def test_permuted_rows_pack_from_a_copy(monkeypatch):
    """Rows reordered before packing (llama's Q/K un-permute: a non-contiguous view)."""
    raw = random_blocks(np.random.default_rng(0), GT.Q4_K, 64, 512)
    view = raw[::-1]
    native = QuantLinear.from_gguf(view, GT.Q4_K, 64, 512)
    _same(native, _python_pack(monkeypatch, lambda: QuantLinear.from_gguf(view, GT.Q4_K, 64, 512)))


@pytest.mark.parametrize("qtype, k", [(GT.Q4_K, 512), (GT.Q6_K, 2 * SUPER_GW), (GT.Q6_K, 768),
                                      (GT.Q8_0, 512), (GT.Q5_K, 512), (GT.MXFP4, 2880),
                                      (GT.Q3_K, 2 * SUPER_GW), (GT.Q2_K, 2048)])  # fmt: skip
def test_experts_pack_the_same_bytes(monkeypatch, qtype, k):
    """Four experts of two parts (gate, up) into one [E, rows, ...] stack, each expert's
    layer a view of it; the release callback hears of every part."""
    rng = np.random.default_rng(1)
    raws = [[random_blocks(rng, qtype, 24, k) for _ in range(2)] for _ in range(4)]
    heard: list[tuple[int, int]] = []
    native = QuantLinear.from_gguf_experts(raws, qtype, k, lambda j, p: heard.append((j, p)))
    assert sorted(heard) == [(j, p) for j in range(4) for p in range(2)]
    python = _python_pack(monkeypatch, lambda: QuantLinear.from_gguf_experts(raws, qtype, k))
    for a, b in zip(native, python, strict=True):
        _same(a, b)


@pytest.mark.parametrize("qtype", [GT.Q4_0, GT.Q5_1])
def test_a_model_file_decodes_the_same_either_way(tmp_path, monkeypatch, qtype):
    """A model file gives the same greedy tokens packed natively and by numpy."""
    hf = build_hf_model("llama", tmp_path / "hf", hidden_size=256, intermediate_size=512)
    path = tmp_path / "model.gguf"
    write_llama_gguf(hf, path, qtype)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(3, 19))
    ours = LLM(path, kv_cache_memory="256tok").generate([prompt], greedy)[0].token_ids
    calls = []
    real = quant_linear._pack_native
    monkeypatch.setattr(quant_linear, "_pack_native", lambda *a: calls.append(1) or real(*a))
    again = LLM(path, kv_cache_memory="256tok").generate([prompt], greedy)[0].token_ids
    assert calls, "the native packer did not run"
    numpy = _python_pack(
        monkeypatch,
        lambda: LLM(path, kv_cache_memory="256tok").generate([prompt], greedy)[0].token_ids,
    )
    assert ours == again == numpy


def test_q6_k_requantization_edges(monkeypatch):
    """Q6_K rows requantized to 8 bits (as where 6-bit kernels cannot run): zero blocks,
    subnormal float16 scales and scales that overflow float16 (inf: codes of 128) give the
    numpy path's bytes too."""
    monkeypatch.setattr(QuantLinear, "runs_6bit", staticmethod(lambda k: False))
    rng = np.random.default_rng(5)
    raw = random_blocks(rng, GT.Q6_K, 8, 768).reshape(8, 3, 210)
    for row, d in enumerate([0.0, 1e-7, 6e-8, 60000.0, 3e-5]):
        raw[row, :, 208:210] = np.array([d] * 3, np.float16).view(np.uint8).reshape(3, 2)
    raw[7, :, :208] = 0  # codes 0 (value -32 d sc), sub-scales 0: a zero row
    raw = raw.reshape(8, -1)
    native = QuantLinear.from_gguf(raw, GT.Q6_K, 8, 768)
    assert native.bits == 8
    _same(native, _python_pack(monkeypatch, lambda: QuantLinear.from_gguf(raw, GT.Q6_K, 8, 768)))


def test_big_tensors_pack_in_chunks_each_released_once_packed(monkeypatch):
    """From a chunk size on, rows pack chunk by chunk, and release hears of each chunk in
    order (a checkpoint drops its file pages then); the bytes are the one-pass bytes."""
    raw = random_blocks(np.random.default_rng(2), GT.Q4_K, 100, 512)  # 288 bytes a row
    whole = QuantLinear.from_gguf(raw, GT.Q4_K, 100, 512)
    monkeypatch.setattr(quant_linear, "PACK_CHUNK_BYTES", 288 * 30)
    seen: list[tuple[int, int]] = []
    base = raw.ctypes.data
    chunked = QuantLinear.from_gguf(
        raw,
        GT.Q4_K,
        100,
        512,
        release=lambda v: seen.append(((v.ctypes.data - base) // 288, len(v))),
    )
    assert seen == [(0, 30), (30, 30), (60, 30), (90, 10)]
    _same(chunked, whole)


def test_release_view_drops_only_the_files_pages(tmp_path):
    """GGUFFile.release_view drops the resident pages under a view of its mapping (they
    read back from the file), and leaves any other memory alone (DONTNEED would zero
    anonymous pages)."""
    import gguf

    from tokenmill.loader.gguf_reader import GGUFFile

    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    data = np.random.default_rng(0).integers(0, 255, (512, 4096), dtype=np.uint8)
    w.add_tensor("t", data.view(np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    view = np.asarray(f.tensors[0].data).reshape(-1).view(np.uint8)
    assert int(view.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # all resident
    resident = mapped_rss_kib(path.resolve())
    assert resident >= len(view) // 1024
    f.release_view(view[: len(view) // 2])
    assert mapped_rss_kib(path.resolve()) <= resident - len(view) // 2 // 1024 + 8
    assert np.array_equal(view.reshape(512, 4096), data)  # read back from the file
    other = data.copy()
    f.release_view(other)  # not the file's memory: untouched
    assert np.array_equal(other, data)
