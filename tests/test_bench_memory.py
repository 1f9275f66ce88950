"""`tokenmill bench --context ... --memory` (bench/context.py): each engine's peak memory
beyond its weights and KV cache, each (context, engine) in a process of its own. The
figures are checked for consistency with each other and with the engine, never against
a threshold."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import build_hf_model

from tokenmill import cli
from tokenmill.bench.context import markdown_memory_table

GEN = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_hf_model("llama", folder)
    return folder


def run_memory(model, tmp_path, contexts: str, *extra: str) -> dict:
    out = tmp_path / "memory.json"
    cli.main(
        [
            "bench", "--model", str(model), "--context", contexts, "--memory", "--runs", "1",
            "--gen-len", str(GEN), "--threads", "2", "--json", str(out), *extra,
        ]
    )  # fmt: skip
    return json.loads(out.read_text())


def check_consistent(r: dict) -> None:
    """The figures of one memory row agree with each other."""
    assert r["rss_after_load"] > 0
    assert r["load_peak_rss"] >= r["rss_after_load"]
    assert r["peak_rss"] >= r["load_peak_rss"]
    if r["run_peak_rss"] is not None:  # the run's own peak, VmHWM reset after the load
        assert r["peak_rss"] == max(r["load_peak_rss"], r["run_peak_rss"])
    assert r["beyond_bytes"] == r["peak_rss"] - r["weights_bytes"] - r["kv_bytes"]
    assert r["beyond_baseline_bytes"] == r["beyond_bytes"] - r["baseline_rss"]
    assert r["baseline_rss"] > 0
    assert r["kv_bytes"] == r["kv_tokens"] * r["kv_bytes_per_token"] > 0
    # the pool holds the prompt and the generated tokens, and the run filled that much
    assert r["kv_tokens"] >= r["prompt_tokens"] + r["gen_tokens"]
    assert r["kv_used_bytes"] == (r["prompt_tokens"] + r["gen_tokens"]) * r["kv_bytes_per_token"]
    assert r["gen_tokens"] == GEN and r["prompt_tokens"] == r["context"]


def test_memory_rows_tokenmill_alone(tiny_model, tmp_path, capsys):
    """One memory row per context length after the speed rows: tokenmill's pool of
    ctx + gen + 64 tokens in whole 16-token blocks, growing with the context; weights from
    the engine (a checkpoint folder has no GGUF tensors); a baseline of its modules."""
    from tokenmill import LLM
    from tokenmill.bench.machine import weight_bytes_by_dtype

    report = run_memory(tiny_model, tmp_path, "16,40", "--peers", "none")
    assert [r["context"] for r in report["context"]] == [16, 40]  # the speed rows still
    rows = report["memory"]
    assert [(r["engine"], r["kv"], r["context"]) for r in rows] == [
        ("tokenmill", "float32", 16),
        ("tokenmill", "float32", 40),
    ]
    llm = LLM(tiny_model, kv_cache_memory="64tok")
    held = sum(weight_bytes_by_dtype(llm.engine.model).values())
    for r in rows:
        check_consistent(r)
        assert r["kv_tokens"] == (r["context"] + GEN + 64) // 16 * 16
        assert r["kv_bytes_per_token"] == llm.engine.cache.bytes_per_token
        assert r["weights_source"] == "engine"
        assert r["weights_bytes"] == r["engine_weights_bytes"] == held
        assert r["torch_imported"]
    assert rows[1]["kv_bytes"] > rows[0]["kv_bytes"]
    assert rows[1]["kv_used_bytes"] > rows[0]["kv_used_bytes"]
    baseline = report["memory_baseline"]
    assert list(baseline) == ["tokenmill"]
    assert baseline["tokenmill"]["peak_rss"] == rows[0]["baseline_rss"] > 0
    table = capsys.readouterr().out
    assert "| beyond weights + cache |" in table
    assert table.count("| tokenmill | float32 |") == 2 * 2  # a speed row, a memory row each
    assert "Peak of each engine's modules alone (the baseline): tokenmill " in table


def test_memory_table_ratio():
    """tokenmill's beyond-weights-and-cache over llama.cpp's at the same context, against
    the issue's 1.2x; the same over the import-only baselines."""
    mib = 2**20

    def row(engine, context, beyond, baseline):
        return {
            "engine": engine, "kv": "q8_0", "context": context, "weights_bytes": 90 * mib,
            "kv_bytes": 10 * mib, "kv_tokens": 640, "rss_after_load": 200 * mib,
            "peak_rss": 100 * mib + beyond, "run_peak_rss": None, "beyond_bytes": beyond,
            "beyond_baseline_bytes": beyond - baseline,
        }  # fmt: skip

    rows = [
        row("tokenmill", 512, 110 * mib, 60 * mib),
        row("llama.cpp", 512, 100 * mib, 50 * mib),
        row("tokenmill", 2048, 130 * mib, 60 * mib),
        row("llama.cpp", 2048, 100 * mib, 50 * mib),
    ]
    table = markdown_memory_table(rows, {"tokenmill": {"peak_rss": 60 * mib}})
    assert "| 1.10x (within 1.2x); 1.00x beyond baselines |" in table
    assert "| 1.30x (beyond 1.2x); 1.40x beyond baselines |" in table
    assert (
        "| 512 | llama.cpp | q8_0 | 90.0 | 10.0 (640) | 200.0 | 200.0 (-) | 100.0 | 50.0 | - |"
        in table
    )
    assert table.endswith("Peak of each engine's modules alone (the baseline): tokenmill 60.0 MiB")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs llama-cpp-python")
def test_memory_beside_llama_cpp(smollm_path, tmp_path, capsys):
    """On the default model's GGUF with a q8_0 cache: a llama.cpp row beside tokenmill's,
    both with the file's tensor bytes as weights and the same KV bytes per token; llama.cpp's
    pool holds at least n_ctx = ctx + gen + 64 cells, and its process never imported torch."""
    from gguf import GGUFReader

    report = run_memory(smollm_path, tmp_path, "64", "--kv-cache-dtype", "q8_0")
    rows = report["memory"]
    assert [(r["engine"], r["kv"]) for r in rows] == [("tokenmill", "q8_0"), ("llama.cpp", "q8_0")]
    tm, peer = rows
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(smollm_path).tensors)
    for r in rows:
        check_consistent(r)
        assert r["weights_source"] == "gguf tensors" and r["weights_bytes"] == file_bytes
    assert tm["kv_bytes_per_token"] == peer["kv_bytes_per_token"]
    assert peer["kv_tokens"] >= 64 + GEN + 64
    assert tm["torch_imported"] and not peer["torch_imported"]
    assert set(report["memory_baseline"]) == {"tokenmill", "llama.cpp"}
    assert peer["engine_weights_bytes"] > 0
    table = capsys.readouterr().out
    assert "x (within 1.2x)" in table or "x (beyond 1.2x)" in table
