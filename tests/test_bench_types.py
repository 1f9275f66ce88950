"""`tokenmill bench --types` (bench/types.py): its type list, llama.cpp's re-quantization
cached beside the source, the weights a decode step reads, and the table of rows."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
from gguf import GGMLQuantizationType as GT
from gguf import GGUFReader

from tokenmill.bench import types
from tokenmill.bench.machine import gguf_decode_bytes


def test_types_are_checked_by_name():
    assert types.parse_types("Q4_K_M, iq4_xs") == ["q4_k_m", "iq4_xs"]
    with pytest.raises(ValueError, match="unknown type 'q9_k'"):
        types.parse_types("q4_k_m,q9_k")
    with pytest.raises(ValueError, match="iq2_xs needs an importance matrix"):
        types.parse_types("iq2_xs")
    with pytest.raises(ValueError, match="name at least one type"):
        types.parse_types(" , ")


def test_memory_without_context_is_refused_before_any_file_is_built(tmp_path, monkeypatch):
    """`--types ... --memory` without --context: a one-line error at once, not after the
    shape files were written and re-quantized (minutes)."""
    from tokenmill.cli import main

    built = []
    monkeypatch.setattr(types, "cmd_types", lambda *a: built.append(a))
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--shape", "llama-3.2-1b", "--types", "q4_k_m", "--memory"])
    assert stop.value.code == 1 and not built


def test_decode_weights_count_what_gguf_decode_bytes_counts(smollm_path):
    """SmolLM2's file: every tensor, the tied embedding whole (it is the un-embedding)."""
    reader = GGUFReader(smollm_path)
    assert "output.weight" not in {t.name for t in reader.tensors}
    assert types.decode_weights(smollm_path) == sum(int(t.n_elements) for t in reader.tensors)
    assert gguf_decode_bytes(smollm_path) == sum(int(t.n_bytes) for t in reader.tensors)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)
def test_requantized_files_are_llama_cpps_and_cached(tmp_path, smollm_path):
    source = tmp_path / "smollm.gguf"
    shutil.copy(smollm_path, source)
    path = types.requantized(source, "iq4_nl")
    assert path == tmp_path / "smollm-as-iq4_nl.gguf"
    assert GT.IQ4_NL in {t.tensor_type for t in GGUFReader(path).tensors}
    mtime = path.stat().st_mtime_ns
    assert types.requantized(source, "iq4_nl").stat().st_mtime_ns == mtime  # cached


def test_the_table_has_a_row_per_type(tmp_path, smollm_path):
    report = {
        "machine": {"cpu": "a CPU"},
        "model": {"file_bytes": 100 * 2**20},
        "engines": {
            "tokenmill": {
                "decode_tok_s": 120.0,
                "ratio_to_ceiling": 0.5,
                "decode_bytes_per_token": gguf_decode_bytes(smollm_path),
                "latency": {"64": {"prefill_tok_s": 700.0}},
                "peak_rss_bytes": 500 * 2**20,
            },
            "llamacpp": {
                "decode_tok_s": 100.0,
                "ratio_to_ceiling": 0.4,
                "latency": {"64": {"prefill_tok_s": 600.0}},
                "peak_rss_bytes": 200 * 2**20,
            },
        },
    }
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(types.types_table([("q4_1", smollm_path, report)]))
    text = console.export_text()
    assert "q4_1" in text and "120.0 (50%)" in text and "100.0 (40%)" in text
    assert "700 / 600" in text and "500 / 200" in text
    bits = 8 * gguf_decode_bytes(smollm_path) / types.decode_weights(smollm_path)
    assert f"{bits:.2f} / {bits:.2f}" in text
