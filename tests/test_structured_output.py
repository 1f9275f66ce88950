"""Structured output through the engine with the real default model (the Python API):
answers that validate, and the engine features a constraint must survive — preemption
(the matcher's state across recomputation), prefix caching, stop strings, n > 1, and
greedy neighbours whose tokens must not change — and `tokenmill inspect` showing the mask."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
QUESTIONS = [
    "Describe a person called Alice as JSON.",
    "Invent a pirate and describe him as JSON.",
    "Describe your best friend as JSON.",
    "Describe a famous scientist as JSON.",
]


@pytest.fixture(scope="module")
def llm(smollm_path) -> LLM:
    return LLM(smollm_path)


@pytest.fixture(scope="module")
def float_llm(smollm_path) -> LLM:
    # float32 weights: greedy tokens then do not depend on the batch around them (see
    # test_batching), so outputs can be compared across batch compositions
    return LLM(smollm_path, quantization="none")


def chats(llm: LLM, questions: list[str]) -> list[list[int]]:
    return [llm.chat_prompt([{"role": "user", "content": q}]) for q in questions]


def test_preemption_keeps_the_matcher_where_it_was(smollm_path, float_llm):
    params = SamplingParams(max_tokens=40, temperature=0, json_schema=PERSON)
    prompts = chats(float_llm, QUESTIONS[:3])
    reference = [o.token_ids for o in float_llm.generate(prompts, params)]
    # 16 blocks of 8 tokens: room for one or two of these (~45 prompt + 40 answer) at a time
    tight = LLM(smollm_path, quantization="none", kv_cache_memory="128tok", block_size=8)
    outputs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == reference
    for out in outputs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)


def test_prefix_cache_and_n_completions(llm):
    prompt = chats(llm, QUESTIONS[:1])[0]
    greedy = SamplingParams(max_tokens=40, temperature=0, json_schema=PERSON)
    first = llm.generate([prompt], greedy)[0]
    again = llm.generate([prompt], greedy)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    sampled = SamplingParams(max_tokens=50, temperature=1.0, seed=7, n=3, json_schema=PERSON)
    out = llm.generate([prompt], sampled)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # n differently drawn answers
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)


def test_stop_strings_still_cut_constrained_output(llm):
    prompt = chats(llm, QUESTIONS[:1])[0]
    whole = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, json_schema=PERSON))
    cut = llm.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0, json_schema=PERSON, stop=['"age"'])
    )
    assert cut[0].finish_reason == "stop"
    assert cut[0].text == whole[0].text.split('"age"')[0]


def test_greedy_neighbours_are_unchanged_and_constraints_hold(float_llm):
    llm = float_llm
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    free_prompts = chats(llm, ["Name three colors.", "What is 2+2?"])
    alone = [llm.generate([p], plain)[0].token_ids for p in free_prompts]
    engine = llm.engine
    constrained = [
        SamplingParams(max_tokens=40, temperature=0, json_schema=PERSON),
        SamplingParams(max_tokens=10, temperature=0.8, seed=1, regex=r"[0-9]{3}-[0-9]{4}"),
        SamplingParams(max_tokens=5, temperature=0, choice=["yes", "no"]),
    ]
    ids = []
    for i, params in enumerate(constrained):
        engine.add_request(f"c{i}", chats(llm, QUESTIONS[i : i + 1])[0], params)
        ids.append(f"c{i}")
    for i, prompt in enumerate(free_prompts):
        engine.add_request(f"f{i}", prompt, plain)
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
    assert [tokens["f0"], tokens["f1"]] == alone
    jsonschema.validate(json.loads(texts["c0"]), PERSON)
    assert texts["c2"] in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts["c1"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m tokenmill.cli ARGS` to its end (no stdin), checked to succeed."""
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return r


def test_inspect_shows_the_grammar_mask(smollm_path, tmp_path):
    trace_path = tmp_path / "trace.json"
    r = _cli(
        "inspect", "Is the sky blue?", "--chat", "--model", str(smollm_path),
        "--choice", "yes", "--choice", "no", "--max-tokens", "3", "--json", str(trace_path),
    )  # fmt: skip
    assert re.search(
        r"9b\. Grammar mask \(choice\): 5 of 49,152 vocabulary entries allowed", r.stdout
    )
    assert "masked" in r.stdout
    trace = json.loads(trace_path.read_text())
    sample = trace["steps"][0]["sample"]
    grammar = sample["grammar"]
    # y, ye, yes, n, no: the tokens that can begin "yes" or "no"
    assert grammar["kind"] == "choice" and grammar["allowed"] == 5
    masked = [c for c in sample["candidates"] if not c["allowed"]]
    assert [c["id"] for c in masked] == grammar["masked"] and masked
    assert all(c["final_prob"] == 0 and c["unconstrained_prob"] > 0 for c in masked)
    assert trace["summary"]["text"] in ("yes", "no")


def test_cli_generate_with_a_json_schema_file(smollm_path, tmp_path):
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    r = _cli(
        "generate", "Invent a person, as JSON.", "--chat", "--model", str(smollm_path),
        "--json-schema", str(schema_file), "--temperature", "0", "--max-tokens", "60",
    )  # fmt: skip
    jsonschema.validate(json.loads(r.stdout), PERSON)
