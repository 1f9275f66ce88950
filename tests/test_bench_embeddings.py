"""`tokenmill bench --embeddings` (the throughput target): the texts' lengths, the
report's shape on a tiny random model, and, where llama-cpp-python is installed, the same
vectors from both engines on the real default GGUF. Never its timings."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import build_hf_model

from tokenmill import cli, hub
from tokenmill.bench import embeddings
from tokenmill.engine.llm_engine import load_tokenizer

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_hf_model("llama", folder)
    return folder


def test_texts_are_distinct_and_exactly_their_length_in_tokens(smollm_path):
    tokenizer = load_tokenizer(smollm_path)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=True))

    texts = embeddings.make_texts(count, (32, 512), {32: 8, 512: 2}, seed=3)
    assert set(texts) == {"32", "512"}
    for n, group in texts.items():
        assert [count(t) for t in group] == [int(n)] * len(group)
        assert len(set(group)) == len(group)  # no run is served by another's tokens
    assert texts == embeddings.make_texts(count, (32, 512), {32: 8, 512: 2}, seed=3)


def test_report_shape(tiny_model, tmp_path):
    out = tmp_path / "embeddings.json"
    cli.main(
        ["bench", "--embeddings", "--model", str(tiny_model), "--peers", "none", "--quick", "--runs", "2",
         "--threads", "1", "--json", str(out)]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["runs"] == 2 and report["threads"] == 1 and report["cpu"]
    assert report["engines"]["tokenmill"]["status"] == "ok"
    assert report["engines"]["tokenmill"]["peak_rss_bytes"] > 0
    assert list(report["lengths"]) == ["32", "512"]
    for n, row in report["lengths"].items():
        assert row["inputs"] == embeddings.QUICK_INPUTS[int(n)]  # --quick
        tm = row["tokenmill"]
        assert len(tm["runs_s"]) == 2 and tm["inputs_per_s"] > 0
        assert tm["tokens_per_input"] == int(n)  # every token computed: no prefix cache
        assert tm["tokens_per_s"] == pytest.approx(tm["inputs_per_s"] * int(n))
        assert "ratio" not in row and embeddings.PEER not in row  # --peers none


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="needs llama-cpp-python")
def test_beside_llama_cpp_the_same_vectors_on_the_real_gguf():
    path = hub.resolve_model(None)
    assert path.suffix == ".gguf"
    report = embeddings.measure(
        path, 2, 1, [embeddings.PEER], lengths=(32, 512), inputs={32: 4, 512: 2}
    )
    assert report["engines"][embeddings.PEER]["status"] == "ok"
    for n, row in report["lengths"].items():
        assert row["ratio"] == pytest.approx(
            row["tokenmill"]["inputs_per_s"] / row[embeddings.PEER]["inputs_per_s"]
        )
        assert row[embeddings.PEER]["tokens_per_input"] == int(n)  # the same tokens, from the GGUF
        assert row["cosine"] > 0.99  # the same last-token vector, from the same weights
