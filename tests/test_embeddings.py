"""Embeddings (POST /v1/embeddings, LLM.embed) and token counting (/tokenize, /detokenize).

The model is a random-weight Qwen3 written by transformers as Qwen3Model (an embedding
model's checkpoint: no LM head, tied embeddings), with sentence-transformers' files
beside it: modules.json (Transformer, Pooling, Normalize) and 1_Pooling/config.json. The
oracle is transformers' last_hidden_state (after the final norm), pooled the same way.
sentence-transformers is not installed here, so transformers is the only oracle.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import save_word_tokenizer
from server_fixture import metric, running_server

from tokenmill.engine.pooling import Pooling, PoolingError, read_pooling, truncate
from tokenmill.llm import LLM

VOCAB = 320
KEY = "sk-embed-test"
MODEL = "qwen3-embedding-tiny"  # --served-model-name
# inputs of several lengths: 1 token, one block and one more (the repeat's prefix-cache
# hit leaves one token: a decode row), several prefill chunks at 16 tokens a step
LENGTHS = (1, 5, 17, 40, 77)


def _text(n: int, seed: int) -> str:
    return " ".join(f"t{(seed * 31 + 7 * j) % 300 + 2}" for j in range(n))


TEXTS = [_text(n, i) for i, n in enumerate(LENGTHS)]


def _write_st_files(folder: Path, mode_key: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    keys = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken")
    config = {"word_embedding_dimension": 64, **{k: k == mode_key for k in keys}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory):
    """(folder, transformers model): last-token pooling, normalized."""
    import transformers as tf

    folder = tmp_path_factory.mktemp("qwen3-embedding")
    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=1, eos_token_id=VOCAB - 1, pad_token_id=0,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = tf.Qwen3Model(cfg).eval()
    with torch.no_grad():  # random norm weights, so a missed final norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    save_word_tokenizer(folder, VOCAB)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}assistant"
    )
    _write_st_files(folder, "pooling_mode_lasttoken", normalize=True)
    return folder, model


def _oracle(model, ids: list[int], mode: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]  # [T, d], final norm in
    vector = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(dim=0)}[mode]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def _cos(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def _ids(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]  # the word tokenizer: "t5" is id 5


# --------------------------------------------------------------------------- pooling files


def test_read_pooling(tmp_path):
    assert read_pooling(None) == Pooling("last", True)  # no files: decoder default
    assert read_pooling(tmp_path) == Pooling("last", True)
    for key, mode in (
        ("pooling_mode_lasttoken", "last"),
        ("pooling_mode_mean_tokens", "mean"),
        ("pooling_mode_cls_token", "cls"),
    ):
        _write_st_files(tmp_path, key, normalize=False)
        assert read_pooling(tmp_path) == Pooling(mode, False)
    _write_st_files(tmp_path, "pooling_mode_mean_tokens", normalize=True)
    assert read_pooling(tmp_path) == Pooling("mean", True)
    config = json.loads((tmp_path / "1_Pooling" / "config.json").read_text())
    config["pooling_mode_max_tokens"] = True
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with pytest.raises(PoolingError, match="pooling_mode_max_tokens"):
        read_pooling(tmp_path)
    _write_st_files(tmp_path, "pooling_mode_mean_tokens", normalize=True)  # a valid pooling
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append(
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(PoolingError, match="Dense"):
        read_pooling(tmp_path)


def test_truncate_renormalizes():
    out = truncate([3.0, 4.0, 12.0], 2)
    assert out == pytest.approx([0.6, 0.8])


# --------------------------------------------------------------------------- LLM.embed


@pytest.mark.parametrize(
    ("key", "mode", "normalize"),
    [
        ("pooling_mode_lasttoken", "last", True),
        ("pooling_mode_mean_tokens", "mean", True),
        ("pooling_mode_cls_token", "cls", False),
    ],
)
def test_llm_embed_matches_transformers(qwen3_embedding, tmp_path, key, mode, normalize):
    """Each pooling, with prompts cut into 16-token prefill chunks and batched together;
    the repeats hit the prefix cache (last token) or must not use it (mean, CLS): the
    same vectors either way, and no block left held."""
    folder, model = qwen3_embedding
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    _write_st_files(copy, key, normalize)
    with LLM(copy, max_num_batched_tokens=16, threads=1) as llm:
        vectors = llm.embed(TEXTS + TEXTS)
        assert all(block.ref_count == 0 for block in llm.engine.blocks.blocks)
        assert not llm.engine.has_unfinished()
        for text, vector, again in zip(
            TEXTS, vectors[: len(TEXTS)], vectors[len(TEXTS) :], strict=True
        ):
            expected = _oracle(model, _ids(text), mode, normalize)
            assert len(vector) == 64
            assert _cos(vector, expected) > 0.9999, (mode, text)
            assert torch.allclose(torch.tensor(vector), expected, rtol=1e-3, atol=1e-4)
            assert _cos(again, vector) > 0.99999
        # token ids in, and a single text
        assert _cos(llm.embed(_ids(TEXTS[3]))[0], vectors[3]) > 0.99999
        assert _cos(llm.embed(TEXTS[2])[0], vectors[2]) > 0.99999
        # generation still works beside it
        assert llm.generate("t5 t6")[0].token_ids


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(qwen3_embedding):
    folder, _ = qwen3_embedding
    args = ("--model", str(folder), "--kv-cache-memory", "2048tok", "--threads", "1",
            "--max-num-batched-tokens", "16", "--api-key", KEY, "--served-model-name", MODEL)  # fmt: skip
    with running_server(*args) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def test_openai_embeddings_match_transformers(qwen3_embedding, client, server):
    _, model = qwen3_embedding
    batch = client.embeddings.create(model=MODEL, input=TEXTS)
    assert batch.object == "list"
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    assert all(d.object == "embedding" for d in batch.data)
    tokens = sum(LENGTHS)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == tokens
    for text, item in zip(TEXTS, batch.data, strict=True):
        assert _cos(item.embedding, _oracle(model, _ids(text), "last", True)) > 0.9999
        # a batch does not mix rows: each input alone gives the same vector
        alone = client.embeddings.create(model=MODEL, input=text).data[0].embedding
        assert _cos(alone, item.embedding) > 0.99999
    # token ids in: one list, and a list of lists
    ids = client.embeddings.create(model=MODEL, input=_ids(TEXTS[3])).data[0].embedding
    assert _cos(ids, batch.data[3].embedding) > 0.99999
    many = client.embeddings.create(model=MODEL, input=[_ids(t) for t in TEXTS[:2]])
    assert _cos(many.data[1].embedding, batch.data[1].embedding) > 0.99999
    # every block back on the free list's side: none held by a request
    headers = {"Authorization": f"Bearer {KEY}"}
    text = httpx.get(f"{server}/metrics", headers=headers, timeout=10).text
    assert metric(text, "tokenmill_kv_blocks_held_by_requests") == 0


def test_base64_and_dimensions(client):
    plain = (
        client.embeddings.create(model=MODEL, input=TEXTS[3], encoding_format="float")
        .data[0]
        .embedding
    )
    raw = client.embeddings.with_raw_response.create(
        model=MODEL, input=TEXTS[3], encoding_format="base64"
    )
    packed = json.loads(raw.text)["data"][0]["embedding"]
    assert isinstance(packed, str)
    unpacked = struct.unpack(f"<{len(plain)}f", base64.b64decode(packed))
    assert unpacked == pytest.approx(plain, abs=1e-7)
    # the SDK's own default asks for base64 and decodes it
    assert client.embeddings.create(model=MODEL, input=TEXTS[3]).data[0].embedding == pytest.approx(
        plain
    )
    cut = client.embeddings.create(model=MODEL, input=TEXTS[3], dimensions=16).data[0].embedding
    assert len(cut) == 16
    assert cut == pytest.approx(truncate(plain, 16), abs=1e-6)
    assert sum(x * x for x in cut) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "t5", "dimensions": 65}, "dimensions"),
        ({"input": "t5", "dimensions": 0}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["t5"] * 2049}, "input"),
        ({"input": [5, VOCAB]}, "input"),
        ({"input": list(range(2, 300)) * 2}, "input"),  # 596 tokens, context 512
        ({"input": "t5", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "t5", "model": "nope"}, "model"),
        ({"input": "t5", "stream": True}, "stream"),
    ],
)
def test_embeddings_bad_input(server, body, param):
    r = httpx.post(
        f"{server}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert "Traceback" not in r.text


# --------------------------------------------------------------------------- tokenize


def test_tokenize_detokenize(qwen3_embedding, server):
    headers = {"Authorization": f"Bearer {KEY}"}
    post = lambda path, body: httpx.post(f"{server}{path}", json=body, headers=headers, timeout=30)  # noqa: E731
    r = post("/tokenize", {"prompt": TEXTS[3]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"tokens": _ids(TEXTS[3]), "count": LENGTHS[3], "max_model_len": 512}
    back = post("/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXTS[3]}
    messages = [{"role": "user", "content": "t5 t6"}]
    chat = post("/tokenize", {"messages": messages})
    assert chat.status_code == 200, chat.text
    with LLM(qwen3_embedding[0], threads=1, kv_cache_memory="2048tok") as llm:
        expected = llm.chat_prompt(messages)
        assert llm.tokenizer.encode(TEXTS[3]) == body["tokens"]
    assert chat.json()["tokens"] == expected and chat.json()["count"] == len(expected)
    # refusals: a 400 naming the field
    for path, bad, param in [
        ("/detokenize", {"tokens": [5, VOCAB]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "t5", "messages": messages}, "prompt"),
        ("/tokenize", {"messages": messages, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"prompt": "t5", "model": "nope"}, "model"),
    ]:
        r = post(path, bad)
        assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, (bad, r.text)
    # behind the API key, like /v1
    for path in ("/tokenize", "/detokenize", "/v1/embeddings"):
        r = httpx.post(f"{server}{path}", json={"prompt": "t5", "tokens": [5], "input": "t5"})
        assert r.status_code == 401, (path, r.text)
