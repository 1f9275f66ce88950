"""`tokenmill bench` on a tiny random model: the report's shape, never its timings."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
from helpers import build_hf_model, write_gguf, write_llama_gguf

from tokenmill import bench, cli, kernels
from tokenmill.bench.report import (
    _disagreement_lines,
    format_runs,
    runs_disagree,
    summarize_latency,
    summarize_runs,
)

PROMPT_LENS = [8, 16]
NUM_REQUESTS = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_hf_model("llama", folder)
    return folder


def run_bench(model, tmp_path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    cli.main(
        [
            "bench", "--model", str(model), "--peers", "none", "--runs", "2",
            "--prompt-len", ",".join(map(str, PROMPT_LENS)), "--gen-len", "4",
            "--num-requests", str(NUM_REQUESTS), "--request-prompt-len", "4,12",
            "--request-gen-len", "2,6", "--kv-cache-memory", "4MiB",
            "--bandwidth-mib", "16", "--gemm-size", "64", "--json", str(out), *extra,
        ]
    )  # fmt: skip
    return json.loads(out.read_text())


def test_report_shape(tiny_model, tmp_path):
    report = run_bench(tiny_model, tmp_path)
    assert set(report) >= {"tokenmill_version", "date", "machine", "model", "settings", "engines"}
    machine = report["machine"]
    assert machine["read_gb_s"] > 0 and machine["copy_gb_s"] > 0
    assert set(machine["gemm_gflop_s"]) == {"float32", "bfloat16"}
    if not bench.has_native_bf16():  # an emulated bf16 GEMM is no machine limit: skipped
        assert machine["gemm_gflop_s"]["bfloat16"] is None
    assert set(machine["working_set_read_gb_s"]) == {"tokenmill"}
    assert report["model"]["gguf_decode_bytes_per_token"] is None  # a checkpoint folder

    assert list(report["engines"]) == ["tokenmill"]
    tm = report["engines"]["tokenmill"]
    assert tm["status"] == "ok"
    assert tm["kernels"] == kernels.isa()  # the instruction set the worker's kernels ran
    assert tm["peak_rss_bytes"] > 0 and tm["kv_pool_bytes"] > 0 and tm["decode_bytes_per_token"] > 0
    assert set(tm["latency"]) == {str(p) for p in PROMPT_LENS}
    for p in PROMPT_LENS:
        lat = tm["latency"][str(p)]
        assert set(lat) == {"ttft_ms", "prefill_tok_s", "decode_tok_s", "spread", "best", "runs"}
        assert set(lat["best"]) == {"ttft_ms", "prefill_tok_s", "decode_tok_s"}
        for figure, runs in lat["spread"].items():
            assert runs["min"] <= runs["median"] == lat[figure] <= runs["max"]
        assert len(lat["runs"]) == 2
        assert all(run["output_tokens"] == 4 for run in lat["runs"])
    assert tm["decode_tok_s"] == tm["latency"]["8"]["decode_tok_s"]
    assert tm["ratio_to_tokenmill"] == 1.0
    assert tm["ratio_to_ceiling"] > 0 and tm["working_set_ceiling_tok_s"] > 0
    assert sum(tm["weight_bytes_by_dtype"].values()) >= tm["decode_bytes_per_token"]
    tp = tm["throughput"]
    assert tp["requests"] == NUM_REQUESTS
    assert tp["computed_output_tokens"] == tp["output_tokens"]  # ignore_eos: every token requested
    assert tp["output_tok_s"] > 0 and tp["total_tok_s"] > tp["output_tok_s"]


def test_summarize_runs_gives_the_median_and_the_spread():
    runs = summarize_runs([125.7, 16.5])  # two runs, one on a busy machine
    assert runs == {"median": pytest.approx(71.1), "min": 16.5, "max": 125.7}
    assert format_runs(runs) == "71.1 (16.5-125.7)"
    assert runs_disagree(runs)

    runs = summarize_runs([10.0, 20.0, 12.0])
    assert runs == {"median": 12.0, "min": 10.0, "max": 20.0}
    assert format_runs(runs, 0) == "12 (10-20)"
    assert not runs_disagree(runs)  # 2x exactly is within the runs' normal spread

    runs = summarize_runs([1234.5])
    assert format_runs(runs) == "1,234.5"  # one run: no range to show
    assert not runs_disagree(runs)


def test_runs_that_disagree_by_more_than_2x_are_a_warning():
    def run(ttft_s: float, decode_s: float) -> dict:
        return {"ttft_s": ttft_s, "decode_s": decode_s, "output_tokens": 11}

    steady = [run(0.1, 1.0), run(0.1, 1.1), run(0.11, 1.0)]
    busy = [run(0.1, 1.0), run(0.1, 7.6), run(0.1, 1.1)]  # one decode 7.6x slower
    engines = {
        "tokenmill": {"status": "ok", "latency": {"8": summarize_latency(steady, 8)}},
        "llama.cpp": {"status": "ok", "latency": {"8": summarize_latency(busy, 8)}},
        "transformers": {"status": "skipped", "reason": "not installed"},
    }
    assert _disagreement_lines({"engines": engines}) == [
        "warning: llama.cpp: runs disagree by more than 2x (decode tok/s @8): the machine is busy"
    ]


def test_skip_throughput(tiny_model, tmp_path):
    tm = run_bench(tiny_model, tmp_path, "--skip", "throughput")["engines"]["tokenmill"]
    assert "latency" in tm and "throughput" not in tm


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plot(tiny_model, tmp_path):
    png = tmp_path / "bench.png"
    run_bench(tiny_model, tmp_path, "--skip", "throughput", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_peer_is_skipped_with_a_reason(tiny_model):
    run, skipped = bench.resolve_peers(["llamacpp"], install=False, model=tiny_model)
    assert run == [] and skipped["llamacpp"]["status"] == "skipped"
    assert "gguf" in skipped["llamacpp"]["reason"]


def test_dead_worker_is_reported_failed(tmp_path):
    work = bench.Workload(
        model=str(tmp_path / "missing.gguf"), dtype="float32", threads=1, runs=1, gen_len=2,
        latency_prompts={}, requests=[], skip=[], kv_cache_memory=None, peer_batch_size=1,
    )  # fmt: skip
    spec = tmp_path / "workload.json"
    spec.write_text(json.dumps(dataclasses.asdict(work)))
    with bench.Engines(["tokenmill"], spec) as engines:
        raw = engines.finish()
    assert raw["tokenmill"]["status"] == "failed"
    assert raw["tokenmill"]["reason"].startswith("exit status 1: ")
    assert "missing.gguf" in raw["tokenmill"]["reason"]


def test_decode_bytes_of_a_mixture_of_experts_count_the_active_experts(tmp_path):
    """A decode step of an MoE model reads k of the E experts: both counts take that share
    of the 3-D expert tensors (the router, attention and shared expert whole)."""
    import gguf
    import torch

    from tokenmill.loader import open_checkpoint
    from tokenmill.models.transformer import Transformer

    model = build_hf_model(
        "qwen2_moe", tmp_path / "hf", tie_word_embeddings=False, hidden_size=72,
        num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    path = tmp_path / "moe.gguf"
    write_gguf(model, path, "qwen2moe")
    reader = gguf.GGUFReader(path)
    dense = sum(int(t.n_bytes) for t in reader.tensors)
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    dense -= int(embed.n_bytes) - int(embed.n_bytes) // int(embed.shape[1])
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    assert experts > 0 and any("_shexp" in t.name for t in reader.tensors)
    assert bench.gguf_decode_bytes(path) == dense - experts + experts * 2 // 8

    ckpt = open_checkpoint(path)
    loaded = Transformer(ckpt.config)
    loaded.load_weights(ckpt, torch.float32)
    assert bench.torch_decode_bytes(loaded) == bench.gguf_decode_bytes(path)


def test_decode_bytes_gguf_matches_torch(tmp_path):
    """Both counts of the bytes a decode step reads agree on an untied F32 model: all
    weights, the token embedding one row."""
    import gguf
    import torch

    from tokenmill.loader import open_checkpoint
    from tokenmill.models.transformer import Transformer

    model = build_hf_model("llama", tmp_path / "hf", tie_word_embeddings=False)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(model, path)
    reader = gguf.GGUFReader(path)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    row = int(embed.n_bytes) // int(embed.shape[1])
    assert bench.gguf_decode_bytes(path) == total - int(embed.n_bytes) + row

    ckpt = open_checkpoint(path)
    loaded = Transformer(ckpt.config)
    loaded.load_weights(ckpt, torch.float32)
    assert bench.torch_decode_bytes(loaded) == bench.gguf_decode_bytes(path)
    tied = torch.nn.Embedding(4, 2)
    assert bench.torch_decode_bytes(tied, tied) == 4 * 2 * 4
    assert bench.torch_decode_bytes(tied) == 2 * 4


@pytest.mark.skipif(kernels.library() is None, reason="native kernels unavailable")
def test_decode_bytes_count_one_row_of_a_packed_token_embedding(tmp_path):
    """A Q8_0 file's token embedding, packed as stored (Q8_0 packs to its own 34 bytes per
    32 values), is looked up one row per token: the torch count equals the file's, as it
    does for float weights (it counted the whole table, 1.3x the bytes of an 8-layer
    Qwen3-30B-A3B-shaped file, before)."""
    from gguf import GGMLQuantizationType as Q

    from tokenmill.llm import LLM

    model = build_hf_model("llama", tmp_path / "hf", tie_word_embeddings=False, hidden_size=64)
    path = tmp_path / "q8.gguf"
    write_llama_gguf(model, path, Q.Q8_0)
    loaded = LLM(path, kv_cache_memory="256tok").engine.model
    assert loaded.lm_head is not None and type(loaded.embed).__name__ != "Embedding"
    assert bench.torch_decode_bytes(loaded) == bench.gguf_decode_bytes(path)


# ---- --context (bench/context.py) ----


def run_context(model, tmp_path, *extra: str) -> dict:
    out = tmp_path / "context.json"
    cli.main(
        [
            "bench", "--model", str(model), "--context", "16,40,600", "--runs", "2",
            "--gen-len", "4", "--threads", "2", "--json", str(out), *extra,
        ]
    )  # fmt: skip
    return json.loads(out.read_text())


def test_context_rows_tokenmill_alone(tiny_model, tmp_path, capsys):
    """One row per context length, with the pool's own KV bytes per token; a context past
    the model's window (512) is cut to leave room for the generated tokens."""
    from tokenmill import LLM

    report = run_context(tiny_model, tmp_path, "--peers", "none")
    rows = report["context"]
    assert [r["context"] for r in rows] == [16, 40, 600]
    assert [r["prompt_tokens"] for r in rows] == [16, 40, 512 - 4]
    per_token = LLM(tiny_model, kv_cache_memory="64tok").engine.cache.bytes_per_token
    for r in rows:
        assert r["engine"] == "tokenmill" and r["kv"] == "float32"
        assert r["kv_bytes_per_token"] == per_token
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
    table = capsys.readouterr().out
    assert "| 600 (508 + gen) | tokenmill | float32 | " in table


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_context_plot(tiny_model, tmp_path, monkeypatch):
    """--plot with --context draws the context chart: a PNG of every row's prefill and
    decode speed, one line per engine and KV type, in prompt-length order."""
    from tokenmill.bench import report as report_mod

    drawn = {}
    real = report_mod.write_context_plot

    def spy(rows, path, title):
        drawn["series"], drawn["rows"] = real(rows, path, title), rows
        return drawn["series"]

    monkeypatch.setattr(report_mod, "write_context_plot", spy)
    png = tmp_path / "context.png"
    rows = run_context(tiny_model, tmp_path, "--peers", "none", "--plot", str(png))["context"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn["series"] == {
        "tokenmill float32 prefill": [(r["prompt_tokens"], r["prefill_tok_s"]) for r in rows],
        "tokenmill float32 decode": [(r["prompt_tokens"], r["decode_tok_s"]) for r in rows],
    }


def test_context_plot_rows_in_context_order(tmp_path):
    """Rows of two engines, given out of order, become one line each, sorted by length."""
    pytest.importorskip("matplotlib", reason="needs matplotlib")
    from tokenmill.bench.report import write_context_plot

    rows = [
        {"engine": e, "kv": "q8_0", "prompt_tokens": n, "prefill_tok_s": p, "decode_tok_s": d}
        for e, n, p, d in [("tokenmill", 2048, 90.0, 20.0), ("llama.cpp", 512, 60.0, 15.0),
                           ("tokenmill", 512, 100.0, 30.0), ("llama.cpp", 2048, 50.0, 9.0)]
    ]  # fmt: skip
    series = write_context_plot(rows, str(tmp_path / "c.png"), "t")
    assert series == {
        "llama.cpp q8_0 prefill": [(512, 60.0), (2048, 50.0)],
        "llama.cpp q8_0 decode": [(512, 15.0), (2048, 9.0)],
        "tokenmill q8_0 prefill": [(512, 100.0), (2048, 90.0)],
        "tokenmill q8_0 decode": [(512, 30.0), (2048, 20.0)],
    }
    assert (tmp_path / "c.png").stat().st_size > 1000


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs llama-cpp-python")
def test_context_beside_llama_cpp_at_q8_0(tmp_path, capsys):
    """On a GGUF file with --kv-cache-dtype q8_0: llama.cpp runs beside tokenmill with a
    q8_0 cache, and both caches take the same bytes per token (llama.cpp's layout)."""
    model = build_hf_model("llama", tmp_path / "hf", hidden_size=128)  # head_dim 32
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(model, path)
    rows = run_context(path, tmp_path, "--kv-cache-dtype", "q8_0")["context"]
    assert [(r["engine"], r["kv"]) for r in rows] == [
        ("tokenmill", "q8_0"),
        ("llama.cpp", "q8_0"),
    ] * 3
    for tm, peer in zip(rows[::2], rows[1::2], strict=True):
        assert tm["kv_bytes_per_token"] == peer["kv_bytes_per_token"]
        assert tm["context"] == peer["context"] and tm["prompt_tokens"] == peer["prompt_tokens"]
        assert peer["prefill_tok_s"] > 0 and peer["decode_tok_s"] > 0
    table = capsys.readouterr().out
    assert "x / " in table  # tokenmill's ratios to llama.cpp
    assert table.count("(1.00x llama.cpp's, within 5%)") == 3  # tokenmill's q8_0 rows
