"""Reranking (engine/scoring.py, LLM.rerank/score, /v1/rerank, /v1/score) against
transformers on the same random weights: a *ForSequenceClassification head (Qwen3 and
Gemma 3) scores sigmoid(score . h) of the pair's last token, and a causal LM (Qwen3, as
Qwen3-Reranker) P(yes) over {yes, no} after its judging prompt; the documents come back
in the order of transformers' scores. A classifier refuses to generate, and a classifier
of several labels refuses to rank, each with one line naming why."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from helpers import FAMILIES, hf_sizes, save_word_tokenizer
from server_fixture import server_process

from tokenmill import LLM
from tokenmill.engine.inputs import RequestError
from tokenmill.engine.scoring import YES_NO_TEMPLATE

VOCAB = 320
QUERY = "t5 t6 t7"
DOCUMENTS = ["t8 t9 t10", "t5 t6", "t11", "t7 t7 t7 t12", "t40 t41 t42 t43 t44"]


def build(arch: str, kind: str, folder, labels: int = 1, seed: int = 0):
    """A tiny random transformers model of family `arch`, saved with its config's
    architecture: kind "classifier" (ForSequenceClassification with `labels` outputs) or
    "causal" (ForCausalLM, with "yes" and "no" words in its vocabulary)."""
    import transformers as tf

    model_cls, config_cls, defaults = FAMILIES[arch]
    torch.manual_seed(seed)
    fields = {
        **hf_sizes(VOCAB, hidden=64, mlp=128, layers=3, heads=4, kv_heads=2),
        "max_position_embeddings": 512, "initializer_range": 0.2, "bos_token_id": 1,
        "eos_token_id": VOCAB - 1, "pad_token_id": VOCAB - 2, "num_labels": labels,
        **defaults,
    }  # fmt: skip
    config = getattr(tf, config_cls)(**fields)
    if kind == "classifier":
        name = {"qwen3": "Qwen3", "gemma3": "Gemma3Text"}[arch] + "ForSequenceClassification"
        model = getattr(tf, name)(config)
    else:
        model = getattr(tf, model_cls)(config)
    with torch.no_grad():  # random norms and head, so a wrong convention shows
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.3)
            if pname == "score.weight":
                p.normal_(0.0, 0.5)
    model.eval().save_pretrained(folder)
    save_word_tokenizer(folder, VOCAB)
    if kind == "causal":  # the judging words as single tokens
        data = json.loads((folder / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        del vocab["t100"], vocab["t101"]
        vocab["yes"], vocab["no"] = 100, 101
        (folder / "tokenizer.json").write_text(json.dumps(data))
    return model


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def hf_classifier_score(model, ids: list[int]) -> float:
    with torch.no_grad():  # ForSequenceClassification pools the last (non-pad) token
        return torch.sigmoid(model(torch.tensor([ids])).logits[0, 0]).item()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_classifier_scores_as_transformers(arch, tmp_path):
    hf = build(arch, "classifier", tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory="512tok", threads=1)
    scorer = llm.engine.scorer
    assert scorer.kind == "classifier"
    ids = [scorer.prompt(QUERY, d) for d in DOCUMENTS]
    assert ids[0] == llm.engine.tokenizer.encode(QUERY) + [8, 9, 10]  # the pair, joined
    expected = [hf_classifier_score(hf, i) for i in ids]
    ours = llm.score(QUERY, DOCUMENTS)
    assert ours == pytest.approx(expected, abs=2e-3)
    ranked = llm.rerank(QUERY, DOCUMENTS, top_n=3)
    assert [r.index for r in ranked] == sorted(range(5), key=lambda i: -expected[i])[:3]
    assert ranked[0].document == DOCUMENTS[ranked[0].index]
    with pytest.raises(RequestError, match="sequence classifier .* does not generate"):
        llm.generate("t5 t6")
    llm.close()


def test_yes_no_reranker_scores_as_transformers(tmp_path):
    hf = build("qwen3", "causal", tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory="512tok", threads=1)
    scorer = llm.engine.scorer
    assert scorer.kind == "yes_no"
    ids = [scorer.prompt(QUERY, d, "t30 t31") for d in DOCUMENTS]
    for one, document in zip(ids, DOCUMENTS, strict=True):
        expected_text = YES_NO_TEMPLATE.format(
            system=scorer_system(), instruction="t30 t31", query=QUERY, document=document
        )
        assert one == llm.engine.tokenizer.encode(expected_text, add_special_tokens=False)
    expected = []
    for one in ids:
        logits = hf_last_logits(hf, one)
        expected.append(torch.softmax(logits[[100, 101]], 0)[0].item())
    ours = llm.score(QUERY, DOCUMENTS, instruction="t30 t31")
    assert ours == pytest.approx(expected, abs=2e-3)
    assert len({round(s, 3) for s in ours}) > 1  # the documents score differently
    ranked = llm.rerank(QUERY, DOCUMENTS, instruction="t30 t31")
    assert [r.index for r in ranked] == sorted(range(5), key=lambda i: -expected[i])
    llm.close()


def scorer_system() -> str:
    from tokenmill.engine.scoring import YES_NO_SYSTEM

    return YES_NO_SYSTEM


def test_a_classifier_of_several_labels_does_not_rank(tmp_path):
    build("qwen3", "classifier", tmp_path, labels=3)
    llm = LLM(str(tmp_path), kv_cache_memory="512tok", threads=1)
    with pytest.raises(ValueError, match="has 3 labels"):
        llm.score(QUERY, DOCUMENTS)
    llm.close()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reranker")
    return folder, build("qwen3", "classifier", folder)


def test_rerank_and_score_routes(classifier):
    folder, hf = classifier
    args = ("--model", str(folder), "--kv-cache-memory", "512tok", "--threads", "1")
    with server_process(*args, "--served-model-name", "rr") as server:
        url = server.base_url
        body = {"model": "rr", "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
        r = httpx.post(f"{url}/v1/rerank", json=body, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()
        from tokenmill.tokenizer.tokenizer import Tokenizer

        tok = Tokenizer.from_pretrained(folder)
        llm_ids = [tok.encode_pair(QUERY, d) for d in DOCUMENTS]
        expected = [hf_classifier_score(hf, i) for i in llm_ids]
        order = sorted(range(5), key=lambda i: -expected[i])
        assert [x["index"] for x in data["results"]] == order[:2]
        for x in data["results"]:
            assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=2e-3)
            assert x["document"] == {"text": DOCUMENTS[x["index"]]}
        assert data["model"] == "rr" and data["usage"]["total_tokens"] == sum(map(len, llm_ids))
        # Cohere's documents as objects, without the documents back; llama.cpp's path
        body = {"model": "rr", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
                "return_documents": False}  # fmt: skip
        r = httpx.post(f"{url}/rerank", json=body, timeout=60)
        assert [x["index"] for x in r.json()["results"]] == order
        assert "document" not in r.json()["results"][0]
        # vLLM's /v1/score: one text against several, in their order
        body = {"model": "rr", "text_1": QUERY, "text_2": DOCUMENTS}
        r = httpx.post(f"{url}/v1/score", json=body, timeout=60)
        scores = [x["score"] for x in r.json()["data"]]
        assert scores == pytest.approx(expected, abs=2e-3)
        assert [x["index"] for x in r.json()["data"]] == list(range(5))
        # bad input: one line naming the field
        for bad, field in (
            ({"model": "rr", "query": QUERY, "documents": []}, "documents"),
            ({"model": "rr", "query": QUERY, "documents": DOCUMENTS, "top_n": 0}, "top_n"),
            ({"model": "rr", "documents": DOCUMENTS}, "query"),
        ):
            r = httpx.post(f"{url}/v1/rerank", json=bad, timeout=60)
            assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
        completion = {"model": "rr", "prompt": "t5", "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=completion, timeout=60)
        assert r.status_code == 400 and "does not generate" in r.json()["error"]["message"]


@pytest.mark.parametrize("labels", [1, 2])
def test_gguf_reranker_scores_as_transformers(labels, tmp_path):
    """llama.cpp's reranker file: the language model plus its head as cls.output (one
    label: a classifier's score; two: a converted yes/no reranker's no and yes rows, the
    score P(yes) on the judging prompt)."""
    import transformers as tf
    from helpers import write_gguf

    hf = build("qwen3", "classifier", tmp_path / "hf", labels=labels)
    causal = tf.Qwen3ForCausalLM(
        tf.Qwen3Config(**{**hf.config.to_dict(), "tie_word_embeddings": True})
    )
    causal.model.load_state_dict(hf.model.state_dict())
    path = tmp_path / "reranker.gguf"
    head = hf.score.weight.detach().float().numpy()
    write_gguf(causal.eval(), path, "qwen3", extra={"cls.output.weight": head})
    llm = LLM(str(path), kv_cache_memory="512tok", threads=1)
    scorer = llm.engine.scorer
    assert scorer.kind == "classifier" and scorer.judge == (labels == 2)
    ids = [scorer.prompt(QUERY, d) for d in DOCUMENTS]
    with torch.no_grad():
        logits = [hf(torch.tensor([i])).logits[0].float() for i in ids]
    expected = [
        torch.sigmoid(x[0]).item() if labels == 1 else torch.softmax(x, 0)[1].item() for x in logits
    ]
    assert llm.score(QUERY, DOCUMENTS) == pytest.approx(expected, abs=2e-3)
    with pytest.raises(RequestError, match="reranker .*does not generate"):
        llm.generate("t5 t6")
    llm.close()


@pytest.mark.slow
def test_llama_cpp_scores_a_real_shape_reranker_alike():
    """Random weights of Qwen3-Reranker-0.6B's shape as llama.cpp's converter lays a
    reranker out (cls.output rows no, yes; rank pooling): llama.cpp's reranking mode and
    tokenmill give each pair the same P(yes), up to llama.cpp's 8-bit activations, and
    rank the documents alike (bench/rerank.py's engines, as `tokenmill bench --rerank`)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from tokenmill.bench import rerank, shapes

    path = shapes.cached(rerank.DEFAULT_SHAPE, reranker=True)
    ours = rerank.Tokenmill(path, threads=2, context=4096)
    prompts = rerank.pairs(ours.engine.config.vocab_size, ours.engine.tokenizer.bos_token_id,
                           n=8, length=64)  # fmt: skip
    mine = ours.scores(prompts)
    ours.llm.close()
    theirs = rerank.LlamaCpp(path, threads=2, context=128).scores(prompts)
    assert mine == pytest.approx(theirs, abs=0.03)
    assert max(mine) - min(mine) > 0.05  # the documents do score differently
    order = sorted(range(8), key=lambda i: -mine[i])
    assert order[:2] == sorted(range(8), key=lambda i: -theirs[i])[:2]
