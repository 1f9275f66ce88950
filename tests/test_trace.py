"""The tracer (tokenmill/inspect/trace.py), `tokenmill inspect` and POST /v1/inspect.

A trace must observe without changing anything: the traced run's tokens and
logits equal the untraced run's. What it records must agree with the engine:
KV sizes with the cache and block manager, attention rows that are
distributions and causal, sampling distributions that sum to 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill import kernels
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.inspect import trace as trace_module
from tokenmill.inspect.trace import Trace
from tokenmill.models import paths
from tokenmill.sampling import SamplingParams

PROMPT = "The capital of France is"
SAMPLED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


class LogitsRecorder:
    """Wraps the engine's sampler to keep a copy of every logits batch it sees."""

    def __init__(self, sampler):
        self.sampler, self.logits = sampler, []

    def __call__(self, logits, states):
        self.logits.append(logits.clone())
        return self.sampler(logits, states)


def generate(engine: LLMEngine, rid: str, prompt, params: SamplingParams, trace=None):
    """Run one request to the end; returns (its Sequence, the logits of every step)."""
    recorder = LogitsRecorder(engine.sampler)
    engine.sampler = recorder
    try:
        engine.add_request(rid, prompt, params, trace=trace)
        seq = engine.requests[rid].seq
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.sampler = recorder.sampler
    return seq, recorder.logits


def rows_are_causal_distributions(att: dict) -> None:
    for head in att["weights"]:
        for q, row in zip(att["query_positions"], head, strict=True):
            assert len(row) == att["context"]
            # each weight is rounded to 4 decimals: up to 5e-5 off
            assert sum(row) == pytest.approx(1.0, abs=5e-5 * len(row) + 1e-6)
            assert all(w == 0 for w in row[q + 1 :]), f"query {q} sees the future"
            assert all(w >= 0 for w in row)


@pytest.fixture(scope="module")
def engine(smollm_path: Path) -> LLMEngine:
    # No prefix cache: a repeated prompt must be computed the same way every time.
    return LLMEngine(smollm_path, kv_cache_memory="64MiB", enable_prefix_caching=False)


# ---------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_traced_run_has_the_same_tokens_and_logits(engine: LLMEngine, monkeypatch) -> None:
    # A traced request takes the torch attention path (the hooks need q, k and the mask);
    # untraced decode rows would take the fused C kernel, equal only to ~1e-4 relative.
    # Compare like with like: the trace must not change the math of its own path.
    monkeypatch.setattr(paths, "NATIVE_DECODE", False)
    # A fixed thread team: a shrunk one (a busy machine, kernels/team.c) also lowers
    # torch's thread count, and torch's own matmuls then sum in another order.
    was = kernels.adaptive_threads(False)
    try:
        plain, plain_logits = generate(engine, "plain", PROMPT, SAMPLED)
        trace = Trace(layers=[5])
        traced, traced_logits = generate(engine, "traced", PROMPT, SAMPLED, trace)
    finally:
        kernels.adaptive_threads(was)
    assert traced.output_ids == plain.output_ids
    assert len(traced_logits) == len(plain_logits) == SAMPLED.max_tokens
    for a, b in zip(plain_logits, traced_logits, strict=True):
        assert torch.equal(a, b)
    # The recorded candidates carry those very logits.
    for step, logits in zip(trace.steps, traced_logits, strict=True):
        for cand in step["sample"]["candidates"]:
            assert cand["logit"] == pytest.approx(float(logits[0, cand["id"]]), abs=1e-3)
    assert trace.summary["output_ids"] == plain.output_ids


@pytest.mark.slow
def test_sampling_record(engine: LLMEngine) -> None:
    trace = Trace(top_n=40)
    params = SamplingParams(max_tokens=5, temperature=0.9, top_p=0.6, top_k=30, seed=3)
    seq, _ = generate(engine, "sampling", PROMPT, params, trace)
    for step in trace.steps:
        s = step["sample"]
        cut = s["survivors"]
        assert s["vocab"] >= cut["top_k"] >= cut["top_p"] >= cut["min_p"] >= 1
        assert cut["top_k"] == 30
        assert s["final_sum"] == pytest.approx(1.0, abs=1e-5)
        kept = [c for c in s["candidates"] if c["kept"]]
        assert len(kept) == cut["min_p"]  # top_n 40 > top_k 30: every survivor is listed
        assert sum(c["final_prob"] for c in kept) == pytest.approx(1.0, abs=1e-4)
        assert all(c["final_prob"] == 0 for c in s["candidates"] if not c["kept"])
        chosen = next(c for c in s["candidates"] if c["id"] == s["token"])
        assert chosen["kept"] and chosen["final_prob"] == pytest.approx(s["prob"])
        assert sum(c["prob"] for c in s["candidates"]) <= 1.0 + 1e-4
    assert [s["sample"]["token"] for s in trace.steps] == seq.output_ids
    text = "".join(s["sample"]["text"] for s in trace.steps)
    assert text == engine.tokenizer.decode(seq.output_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_kv_sizes_match_the_cache(engine: LLMEngine) -> None:
    trace = Trace()
    engine.add_request(
        "kv", PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), trace=trace
    )
    seq = engine.requests["kv"].seq
    per_token = engine.cache.bytes_per_token
    while engine.has_unfinished():
        engine.step()
        kv = trace.steps[-1]["kv"]
        assert kv["pool_blocks_used"] == engine.blocks.num_used
        assert kv["pool_blocks_total"] == engine.blocks.num_blocks
        if not kv["released"]:
            assert kv["tokens"] == seq.num_computed
            assert kv["bytes"] == seq.num_computed * per_token
            assert (
                kv["blocks"] == len(seq.block_table) == engine.blocks.blocks_for(seq.num_computed)
            )
    final = trace.steps[-1]["kv"]
    assert final["released"] and engine.blocks.num_used == 0
    assert final["tokens"] == len(seq) - 1  # the last token was sampled, never fed back
    assert final["blocks"] == engine.blocks.blocks_for(final["tokens"]) == 2
    assert [s["kv"]["written"] for s in trace.steps] == [len(seq.prompt_ids)] + [1] * 19


@pytest.mark.slow
def test_attention_is_causal_and_normalised(engine: LLMEngine) -> None:
    trace = Trace(layers=[3])
    generate(engine, "attention", PROMPT, SamplingParams(max_tokens=4, temperature=0), trace)
    cfg = engine.config
    prefill, *decode = trace.steps
    (att,) = prefill["attention"]
    n = len(trace.prompt["ids"])
    assert att["layer"] == 3 and att["heads"] == list(range(cfg.num_heads))
    assert att["query_positions"] == list(range(n)) and att["context"] == n
    rows_are_causal_distributions(att)
    assert all(head[0][0] == 1.0 for head in att["weights"])  # the first token sees only itself
    for i, step in enumerate(decode):
        assert step["phase"] == "decode"
        (att,) = step["attention"]
        assert att["query_positions"] == [n + i]
        rows_are_causal_distributions(att)
    for step in trace.steps:
        layers = step["layers"]
        assert [layer["layer"] for layer in layers] == list(range(cfg.num_layers))
        context = step["start"] + step["num_tokens"]
        q_rows = step["num_tokens"]
        assert layers[0]["q"] == [q_rows, cfg.num_heads, cfg.head_dim]
        assert layers[0]["k"] == layers[0]["v"] == [context, cfg.num_kv_heads, cfg.head_dim]
        assert all(0 < m <= 1 for layer in layers for m in layer["max"])


@pytest.mark.slow
def test_positions_and_embeddings(engine: LLMEngine) -> None:
    trace = Trace(sample_dims=4)
    generate(engine, "embed", PROMPT, SamplingParams(max_tokens=2, temperature=0), trace)
    prefill, decode = trace.steps
    ids = trace.prompt["ids"]
    e = prefill["embedding"]
    assert e["shape"] == [len(ids), engine.config.hidden_size]
    expected = engine.model.embed_tokens(torch.tensor([ids[1]]))[0, :4].tolist()
    assert e["sample"][1] == pytest.approx(expected, abs=1e-4)
    pe = prefill["position_encoding"]
    assert pe["kind"] == "rope" and prefill["positions"] == list(range(len(ids)))
    theta = engine.config.rope.theta
    inv_freq = [theta ** (-2 * i / engine.config.head_dim) for i in range(4)]
    assert pe["inv_freq"] == pytest.approx(inv_freq, rel=1e-4)
    assert pe["angles"][3] == pytest.approx([3 * f for f in inv_freq], abs=1e-3)
    assert decode["positions"] == [len(ids)]
    assert decode["input_ids"] == [prefill["sample"]["token"]]


@pytest.mark.slow
def test_only_the_traced_request_is_recorded(engine: LLMEngine) -> None:
    trace = Trace(layers=[0], heads=[1])
    other = "A much longer prompt that shares the batch with the traced one, step after step"
    engine.add_request("other", other, SamplingParams(max_tokens=5, temperature=0))
    engine.add_request("mine", PROMPT, SamplingParams(max_tokens=3, temperature=0), trace=trace)
    mine = engine.requests["mine"].seq
    while engine.has_unfinished():
        engine.step()
    assert trace.prompt["ids"] == mine.prompt_ids
    assert trace.steps[0]["input_ids"] == mine.prompt_ids
    assert trace.steps[0]["embedding"]["shape"][0] == len(mine.prompt_ids)
    assert [s["sample"]["token"] for s in trace.steps] == mine.output_ids
    for step in trace.steps:
        (att,) = step["attention"]
        assert att["heads"] == [1] and att["context"] == step["start"] + step["num_tokens"]


@pytest.mark.slow
def test_json_export(engine: LLMEngine, tmp_path: Path) -> None:
    trace = Trace()
    generate(engine, "json", PROMPT, SamplingParams(max_tokens=3), trace)
    path = tmp_path / "trace.json"
    trace.save_json(path)
    data = json.loads(path.read_text())
    json.dumps(data, allow_nan=False)
    assert data["model"]["num_layers"] == engine.config.num_layers
    assert len(data["steps"]) == 3
    s = data["summary"]
    assert s["prefill_ms"] > 0 and len(s["decode_ms"]) == 2 and s["time_to_first_token_ms"] > 0


@pytest.mark.slow
def test_inspect_command(capsys, tmp_path: Path, smollm_path: Path) -> None:
    from tokenmill.cli import main

    out_json = tmp_path / "t.json"
    main(
        [
            "inspect",
            PROMPT,
            "--max-tokens",
            "4",
            "--model",
            str(smollm_path),
            "--seed",
            "1",
            "--kv-cache-memory",
            "32MiB",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    for section in [
        "Tokenize",
        "Embed",
        "Positions (RoPE)",
        "through 30 layers",
        "KV cache write",
        "Masked multi-head attention",
        "MLP (the feed-forward network)",
        "Un-embed",
        "Softmax",
        "top-p 0.9",
        "Sample",
        "Detokenize",
        "fed back",
        "decode loop",
        "prefill vs decode",
        "time to first token",
    ]:
        assert section in out, section
    assert len(json.loads(out_json.read_text())["steps"]) == 4


@pytest.mark.slow
def test_inspect_route(engine: LLMEngine) -> None:
    from fastapi.testclient import TestClient

    from tokenmill.server.app import create_app
    from tokenmill.server.async_engine import AsyncEngine

    app = create_app(AsyncEngine(engine), model_name="smol")
    with TestClient(app) as client:
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "layer": 2, "head": 0}
        whole = client.post("/v1/inspect", json={**body, "stream": False}).json()
        assert len(whole["steps"]) == 3 and whole["trace"]["layers"] == [2]
        with client.stream("POST", "/v1/inspect", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        assert [e["type"] for e in events] == ["start", "step", "step", "step", "done"]
        assert events[-1]["text"] == whole["text"]
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        chat_events = client.post("/v1/inspect", json=chat).text
        assert '"type": "done"' in chat_events
        bad = client.post("/v1/inspect", json={**body, "layer": 99})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "layer"
        both = client.post("/v1/inspect", json={**chat, "prompt": "x"})
        assert both.status_code == 400


# ---------------------------------------------------------------------- tiny random models


def tiny_engine(arch: str, folder: Path, **kwargs) -> LLMEngine:
    from helpers import build_hf_model

    build_hf_model(arch, folder)
    return LLMEngine(folder, kv_cache_memory="8MiB", **kwargs)


def test_prefix_cached_prefill_attention(tmp_path: Path) -> None:
    engine = tiny_engine("llama", tmp_path, block_size=16)
    shared = list(range(2, 40))
    engine.add_request("warm", shared + [50, 51], SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    trace = Trace(layers=[1])
    engine.add_request("hit", shared + [60, 61, 62], SamplingParams(max_tokens=2), trace=trace)
    while engine.has_unfinished():
        engine.step()
    prefill = trace.steps[0]
    assert prefill["start"] == 32  # two full blocks came from the prefix cache
    (att,) = prefill["attention"]
    assert att["query_positions"] == list(range(32, 41)) and att["context"] == 41
    rows_are_causal_distributions(att)
    assert prefill["kv"]["tokens"] == 41 and prefill["kv"]["written"] == 9


def test_long_prompts_keep_the_newest_attention_rows(tmp_path: Path) -> None:

    engine = tiny_engine("llama", tmp_path)
    trace = Trace(layers=[0])
    prompt = [2 + i % 300 for i in range(300)]
    engine.add_request("long", prompt, SamplingParams(max_tokens=1), trace=trace)
    while engine.has_unfinished():
        engine.step()
    (att,) = trace.steps[0]["attention"]
    rows = trace_module.PROMPT_MAP_CELLS // (engine.config.num_heads * 300)
    assert rows < 300 and att["query_positions"] == list(range(300 - rows, 300))
    rows_are_causal_distributions(att)


def test_learned_positions(tmp_path: Path) -> None:
    engine = tiny_engine("gpt2", tmp_path)
    trace = Trace(layers=[0], sample_dims=5)
    engine.add_request("gpt2", [5, 6, 7], SamplingParams(max_tokens=2), trace=trace)
    while engine.has_unfinished():
        engine.step()
    pe = trace.steps[0]["position_encoding"]
    assert pe["kind"] == "learned"
    expected = engine.model.pos_embed.weight[:3, :5].tolist()
    for got, want in zip(pe["sample"], expected, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    (att,) = trace.steps[0]["attention"]
    rows_are_causal_distributions(att)


def test_trace_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        Trace(layers=[-1])
    with pytest.raises(ValueError):
        Trace(heads=[-1])
    with pytest.raises(ValueError):
        Trace(top_n=0)


# ---------------------------------------------------------------------- bounded cost
# (a long prompt's trace once built every layer's full attention matrix)

LONG = 300  # prompt tokens: a few hundred, prefilled in chunks of CHUNK
CHUNK = 64


@pytest.fixture(scope="module")
def chunked(smollm_path: Path) -> LLMEngine:
    return LLMEngine(
        smollm_path,
        kv_cache_memory="64MiB",
        enable_prefix_caching=False,
        max_num_batched_tokens=CHUNK,
    )


def long_prompt(engine: LLMEngine) -> list[int]:
    text = " ".join(f"item {i} is the number {i * 7 % 100}." for i in range(60))
    ids = engine.tokenizer.encode(text)[:LONG]
    assert len(ids) == LONG
    return ids


class WeightsRecorder:
    """Wraps trace._attention_weights: the query rows [H, n, hd] of every call, by layer
    order, so a test sees how much attention the trace itself computed."""

    def __init__(self, monkeypatch):
        self.rows: list[int] = []
        real = trace_module._attention_weights

        def recorded(q, keys, mask, scale, first_query):
            self.rows.append(q.shape[1])
            return real(q, keys, mask, scale, first_query)

        monkeypatch.setattr(trace_module, "_attention_weights", recorded)


@pytest.mark.slow
def test_a_long_prompt_without_maps_computes_only_summary_rows(chunked, monkeypatch) -> None:
    recorder = WeightsRecorder(monkeypatch)
    trace = Trace()  # no attention maps asked for
    prompt = long_prompt(chunked)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    generate(chunked, "no-maps", prompt, params, trace)
    layers = chunked.config.num_layers
    prefill = [s for s in trace.steps if s["phase"] == "prefill"]
    assert len(prefill) == -(-LONG // CHUNK) and all(s["num_tokens"] <= CHUNK for s in prefill)
    assert len(recorder.rows) == layers * len(trace.steps)  # one call per layer and step
    # each call computed at most SUMMARY_ROWS query rows, never a chunk's (let alone all)
    assert max(recorder.rows) == trace_module.SUMMARY_ROWS < CHUNK
    assert all("attention" not in s for s in trace.steps)
    for step in prefill:
        for layer in step["layers"]:
            assert layer["summary_rows"] == min(step["num_tokens"], trace_module.SUMMARY_ROWS)
            assert layer["q"][0] == step["num_tokens"]  # the record still names the chunk
            assert all(0 < m <= 1 for m in layer["max"])
    assert trace.header()["trace"]["layers"] == []


@pytest.mark.slow
def test_maps_only_for_the_layers_and_heads_asked_for(chunked, monkeypatch) -> None:
    recorder = WeightsRecorder(monkeypatch)
    trace = Trace(layers=[2, 7], heads=[1, 4])
    prompt = long_prompt(chunked)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    generate(chunked, "some-maps", prompt, params, trace)
    rows = trace_module.prompt_map_rows(LONG, 2 * 2)
    assert trace.map_from == LONG - rows
    layers = chunked.config.num_layers
    prefill_rows = recorder.rows[: layers * -(-LONG // CHUNK)]
    wide = [i % layers for i, n in enumerate(prefill_rows) if n > trace_module.SUMMARY_ROWS]
    assert set(wide) <= {2, 7}  # only the map layers computed more than the summary rows
    kept: dict[int, list[int]] = {2: [], 7: []}
    for step in trace.steps:
        for att in step.get("attention", []):
            assert att["heads"] == [1, 4] and len(att["weights"]) == 2
            assert att["context"] == step["start"] + step["num_tokens"]
            rows_are_causal_distributions(att)
            kept[att["layer"]] += att["query_positions"]
    generated = len(trace.steps) - len([s for s in trace.steps if s["phase"] == "prefill"])
    expected = list(range(LONG - rows, LONG + generated))  # the prompt's end, then each decode
    assert kept == {2: expected, 7: expected}


@pytest.mark.slow
def test_the_size_bound_holds_for_real_traces(chunked) -> None:
    prompt = long_prompt(chunked)
    cfg = chunked.config
    for i, (layers, heads, top_n) in enumerate(
        [([], None, 10), ([15], None, 10), ([0, 29], [3], 50), (list(range(30)), None, 1)]
    ):
        trace = Trace(layers=layers, heads=heads, top_n=top_n)
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=i, ignore_eos=True)
        generate(chunked, f"bound-{i}", prompt, params, trace)
        made = len(trace_module.dumps(trace.to_dict()).encode())
        bound = trace_module.size_bound(
            cfg,
            LONG,
            6,
            map_layers=len(layers),
            map_heads=cfg.num_heads if heads is None else len(heads),
            top_n=top_n,
            chunk_tokens=CHUNK,
        )
        assert made <= bound, (layers, heads, made, bound)
        assert bound < 3 * made, (layers, heads, made, bound)  # and not far above


@pytest.mark.slow
def test_a_traced_prefill_is_chunked_and_other_requests_decode_between(chunked) -> None:
    """The scheduler chunks a traced prompt like any other: an untraced request that is
    decoding gets a token in every step of the traced prefill (order, not time)."""
    engine = chunked
    engine.add_request("other", "Once upon a time", SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # its prefill: it decodes from now on
    trace = Trace(layers=[15])
    engine.add_request(
        "traced", long_prompt(engine), SamplingParams(max_tokens=2, ignore_eos=True), trace=trace
    )
    order: list[str] = []  # per engine step: what it held, in order
    while engine.has_unfinished():
        before = len(trace.steps)
        outputs = engine.step()
        if len(trace.steps) > before:
            order.append(trace.steps[-1]["phase"])
        if any(o.request_id == "other" and o.token_ids for o in outputs):
            order.append("other token")
    prefill_steps = [i for i, what in enumerate(order) if what == "prefill"]
    assert len(prefill_steps) >= LONG // CHUNK  # the traced prompt took several steps
    for i in prefill_steps:  # and every one of them also decoded the other request
        assert order[i + 1] == "other token", order


# ---------------------------------------------------------------------- speculation

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wiped the "
    "great lens, trimmed the wick and lit the lamp, and the beam swept across the bay."
)
COPY = f"Repeat this sentence exactly:\n\n{PASSAGE}\n\nThe sentence:\n\n{PASSAGE[:40]}"


@pytest.mark.slow
def test_a_traced_request_speculates_and_records_its_guesses(smollm_path: Path) -> None:
    """Under speculation a traced request is verified like any other: its verification
    steps record the guesses, which were accepted (the engine's longest-prefix rule), the
    tokens emitted and the K/V rows rolled back, and the output stays the plain one."""
    forced = {"method": "ngram", "k": 4, "adaptive": False, "max_running": 64}
    spec = LLMEngine(smollm_path, kv_cache_memory="64MiB", speculative=forced)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _ = generate(spec, "untraced", COPY, params)  # the same engine, untraced
    trace = Trace(layers=[3])
    traced, _ = generate(spec, "traced", COPY, params, trace)
    assert traced.output_ids == plain.output_ids  # greedy: guesses never change tokens
    assert trace.summary["output_ids"] == traced.output_ids
    verify = [s for s in trace.steps if s["phase"] == "verify"]
    assert verify, "a copy task proposes guesses"
    assert trace.summary["verify_steps"] == len(verify)
    assert any(s["speculation"]["accepted"] > 0 for s in verify)
    out = list(traced.prompt_ids)
    for step in trace.steps:
        if "sample" not in step:
            continue
        # the step's input rows: the sequence's last token, then the guesses
        assert step["input_ids"][0] == out[step["start"]]
        samples = step.get("samples", [step["sample"]])
        assert step["sample"] is samples[-1]
        for sample in samples:  # the emitted tokens, in order
            out.append(sample["token"])
        if step["phase"] != "verify":
            continue
        sp = step["speculation"]
        assert step["input_ids"][1:] == sp["proposed"]
        assert step["num_tokens"] == 1 + len(sp["proposed"])
        agreed = 0
        while agreed < len(sp["proposed"]) and samples[agreed]["token"] == sp["proposed"][agreed]:
            agreed += 1
        assert sp["accepted"] == agreed
        assert sp["emitted"] == len(samples) == agreed + 1  # no stop inside (ignore_eos)
        assert [s["guess_accepted"] for s in samples[:agreed]] == [True] * agreed
        for s, guess in zip(samples, sp["proposed"], strict=False):
            assert s["guess"] == guess and 0.0 <= s["guess_prob"] <= 1.0
        # greedy: an accepted guess was the target's most likely token
        assert all(s["candidates"][0]["id"] == s["token"] for s in samples)
        assert sp["rolled_back"] == len(sp["proposed"]) - agreed
        kv = step["kv"]
        assert kv["written"] == step["num_tokens"]
        assert kv["tokens"] == step["start"] + 1 + agreed  # the rejected rows given back
        layer = next(a for a in step["attention"] if a["layer"] == 3)
        assert layer["query_positions"] == list(
            range(step["start"], step["start"] + step["num_tokens"])
        )
        rows_are_causal_distributions(layer)
        if sp["plain_step_ms"] is not None:
            assert sp["step_vs_plain"] == pytest.approx(
                step["step_ms"] / sp["plain_step_ms"], rel=1e-2
            )
    assert out[len(traced.prompt_ids) :] == traced.output_ids
    text = spec.tokenizer.decode(traced.output_ids)
    assert trace.summary["text"] == text
    made = len(trace_module.dumps(trace.to_dict()).encode())
    cfg = spec.config
    bound = trace_module.size_bound(
        cfg, len(traced.prompt_ids), params.max_tokens, map_layers=1, map_heads=cfg.num_heads,
        top_n=trace.top_n, chunk_tokens=spec.scheduler.max_num_batched_tokens, speculative_k=4,
    )  # fmt: skip
    assert made <= bound
    assert spec.blocks.num_used == 0  # every block back, the rolled-back ones too
