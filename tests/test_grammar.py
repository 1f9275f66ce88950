"""Constrained decoding without a model: the grammar compiler, the token masks it gives on
the real SmolLM2 vocabulary, the sampler stage that applies them, and the parameters.

The central property: whatever the sampler picks among the tokens a mask allows, the text
ends up matching the constraint. Random walks through the masks (uniform picks, from seeds
hypothesis chooses) check it for JSON Schemas, regexes, choices and grammars.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.sampling import Sampler, SamplingParams, SamplingState, process_logits
from tokenmill.sampling.grammar import (
    GrammarCompiler,
    GrammarError,
    apply_token_mask,
    unpack_bitmask,
)
from tokenmill.tokenizer import Tokenizer

VOCAB = 49152  # SmolLM2's logits width
EOS = [0, 2]  # <|endoftext|>, <|im_end|>

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "member": {"type": "boolean"},
        "pets": {
            "type": "array",
            "items": {"enum": ["cat", "dog", "fish"]},
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(smollm_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_path)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, EOS)


def walk(compiled, rng: random.Random, max_steps: int = 400) -> list[int]:
    """Pick uniformly among the allowed tokens until the grammar ends or EOS is drawn."""
    matcher = compiled.matcher()
    out: list[int] = []
    for _ in range(max_steps):
        allowed = np.flatnonzero(matcher.allowed().numpy()).tolist()
        assert allowed, "a mask that allows nothing"
        ends = [t for t in allowed if t in EOS]
        others = [t for t in allowed if t not in EOS]
        if ends and (not others or rng.random() < 0.3):
            return out
        token = rng.choice(others)
        matcher.consume(token)
        assert matcher.error is None
        out.append(token)
        if matcher.finished:
            return out
    raise AssertionError(f"no end after {max_steps} tokens")


# --------------------------------------------------------------------------- masks are sound


SHAPES = {
    "type": "array",
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"circle": {"type": "integer", "minimum": 0, "maximum": 10}},
                "required": ["circle"],
                "additionalProperties": False,
            },
            {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "maxItems": 3,
            },
            {"type": "null"},
        ]
    },
    "minItems": 1,
    "maxItems": 4,
}


@pytest.mark.parametrize("schema", [PERSON, SHAPES], ids=["person", "any-of-and-arrays"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32))
def test_json_schema_walks_validate(compiler, tokenizer, schema, seed):
    rng = random.Random(seed)
    text = tokenizer.decode(walk(compiler.compile("json_schema", schema), rng))
    jsonschema.validate(json.loads(text), schema)


REGEX = r"[a-z]{1,6}@[a-z]{2,5}\.(com|org)"
GBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32))
def test_regex_grammar_and_choice_walks_match(compiler, tokenizer, seed):
    rng = random.Random(seed)
    text = tokenizer.decode(walk(compiler.compile("regex", REGEX), rng))
    assert re.fullmatch(REGEX, text), text
    text = tokenizer.decode(walk(compiler.compile("grammar", GBNF), rng))
    assert re.fullmatch(r"\((\d|[1-9]\d)(\+(\d|[1-9]\d))*\)", text), text
    choices = ["yes", "no", "maybe so", "ünïcode ✓"]
    assert tokenizer.decode(walk(compiler.compile("choice", choices), rng)) in choices


CHOICE_TEXT = st.text(
    st.sampled_from([*"abc xyz09", *".+*?()|[]{}^$#&-~/\\\"'", "\n", "ü", "✓"]), max_size=8
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(choices=st.lists(CHOICE_TEXT, min_size=1, max_size=5, unique=True), data=st.data())
def test_every_choice_and_nothing_else_is_accepted(compiler, tokenizer, choices, data):
    """Every character that means something to a regex or to Lark is taken literally:
    forcing a choice's own tokens is accepted, and a text that is none of them is not."""
    target = data.draw(st.sampled_from(choices))
    matcher = compiler.compile("choice", choices).matcher()
    for token in tokenizer.encode(target, add_special_tokens=False):
        assert matcher.allowed()[token], (choices, target)
        matcher.consume(token)
    assert matcher.error is None and any(matcher.allowed()[EOS])
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    assert tokenizer.decode(walk(compiler.compile("choice", choices), rng)) in choices
    if "z" not in "".join(choices):
        matcher = compiler.compile("choice", choices).matcher()
        first = tokenizer.encode("z", add_special_tokens=False)[0]
        assert not matcher.allowed()[first]


def test_twenty_thousand_choices_with_one_first_token(compiler, tokenizer):
    """Issue 21: as Lark alternatives, 2,000+ choices that share their first token failed
    at the first token inside llguidance ("Current row has 20001 items; max is 2000"),
    and the request ended early with a 200 and a truncated text."""
    choices = [f"option {i} word{i * 7}" for i in range(20_000)]
    compiled = compiler.compile("choice", choices)
    text = tokenizer.decode(walk(compiled, random.Random(7), max_steps=40))
    assert text in choices
    matcher = compiled.matcher()
    for token in tokenizer.encode(choices[12_345], add_special_tokens=False):
        assert matcher.allowed()[token]
        matcher.consume(token)
        assert matcher.error is None
    assert matcher.finished


def test_first_mask_is_exactly_the_prefixes_of_the_choices(compiler, tokenizer):
    choices = ["yes", "no", "maybe so"]
    allowed = compiler.compile("choice", choices).matcher().allowed()
    table = tokenizer.token_bytes()
    expected = {
        i
        for i, b in enumerate(table)
        if b and i not in tokenizer.special_ids and any(c.encode().startswith(b) for c in choices)
    }
    assert set(allowed.nonzero().flatten().tolist()) == expected


def test_complete_output_allows_only_eos(compiler, tokenizer):
    matcher = compiler.compile("regex", "[0-9]+").matcher()
    for token in tokenizer.encode("2024", add_special_tokens=False):
        assert matcher.allowed()[token]
        matcher.consume(token)
    allowed = set(matcher.allowed().nonzero().flatten().tolist())
    assert set(EOS) <= allowed  # done, or more digits
    assert not matcher.finished
    matcher = compiler.compile("choice", ["yes"]).matcher()
    for token in tokenizer.encode("yes", add_special_tokens=False):
        matcher.consume(token)
    assert matcher.finished
    assert set(matcher.allowed().nonzero().flatten().tolist()) == set(EOS)


def test_special_tokens_never_match_text(compiler, tokenizer):
    # "<|im_end|>" typed as text is not the control token, and vice versa
    allowed = compiler.compile("regex", ".*").matcher().allowed()
    assert not allowed[tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]]
    assert allowed[2]  # <|im_end|> as EOS: ".*" may end at once


# --------------------------------------------------------------------------- compiling


@pytest.mark.parametrize(
    "kind, value, message",
    [
        ("json_schema", {"type": "object", "not": {}}, "does not support: not"),
        ("json_schema", {"type": "strin"}, "invalid json_schema: Invalid type: strin"),
        ("json_schema", {"$ref": "#/nowhere"}, "does not exist"),
        ("regex", "[a-", "invalid regex: regex parse error"),
        ("grammar", "start: missing_rule", 'unknown name: "missing_rule"'),
        ("grammar", "root ::= nothing", "Rule 'nothing' not found"),
    ],
)
def test_compile_errors_name_the_problem_in_one_line(compiler, kind, value, message):
    with pytest.raises(GrammarError) as info:
        compiler.compile(kind, value)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert info.value.kind == kind


def _ref_chain(n: int) -> dict:
    """n object schemas, each one property deep into the next through $ref."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _rule_chain(n: int, gbnf: bool = False) -> str:
    if gbnf:
        return "\n".join(
            ["root ::= r0"] + [f'r{i} ::= "x" r{i + 1}' for i in range(n)] + [f'r{n} ::= "y"']
        )
    return "\n".join(["start: r0"] + [f'r{i}: "x" r{i + 1}' for i in range(n)] + [f'r{n}: "y"'])


@pytest.mark.parametrize(
    "kind, value, message",
    [
        # each of these segfaulted the process inside llguidance: 1,000 $defs
        # chained through $ref, 3,000 chained grammar rules, in Lark and GBNF, and a tool
        # call's grammar with such a schema inside
        ("json_schema", _ref_chain(1000), "nests more than 300 levels"),
        ("grammar", _rule_chain(3000), "chains more than 500 rules"),
        ("grammar", _rule_chain(3000, gbnf=True), "chains more than 500 rules"),
        ("grammar", "start: %json " + json.dumps(_ref_chain(1000)), "a JSON schema in the grammar"),
    ],
    ids=["ref-chain", "lark-chain", "gbnf-chain", "embedded-json"],
)
def test_constraints_too_deep_for_llguidance_are_refused(compiler, kind, value, message):
    with pytest.raises(GrammarError, match=message) as info:
        compiler.compile(kind, value)
    assert "\n" not in str(info.value)


def _properties(n: int) -> dict:
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": f"^x{i}[a-z]+$"} for i in range(n)},
    }


def test_schemas_too_large_to_compile_in_bounded_time_are_refused(compiler, monkeypatch):
    """15,000 pattern properties cost llguidance ~7 s of CPU before it panicked on its
    symbol table (the soak's latency): counted before it starts."""
    from tokenmill.sampling import grammar

    def no_compile(*args, **kw):
        raise AssertionError("llguidance was asked to compile it")

    # the compile measures RSS right before llguidance starts: it must not get that far
    monkeypatch.setattr(grammar, "_rss_bytes", no_compile)
    message = "declares 15,000 properties, more than the 4,096"
    with pytest.raises(GrammarError, match=message):
        compiler.compile("json_schema", _properties(15_000))
    # spread over nested objects and inside a tool call's grammar, counted all the same
    nested = {"type": "object", "properties": {"a": _properties(3000), "b": _properties(3000)}}
    with pytest.raises(GrammarError, match="declares 6,002 properties"):
        compiler.compile("json_schema", nested)
    with pytest.raises(GrammarError, match="a JSON schema in the grammar declares"):
        compiler.compile("grammar", "start: %json " + json.dumps(_properties(5000)))


def test_deep_but_reasonable_constraints_still_compile(compiler):
    """Recursive schemas (a tree) and chains well inside the limits compile."""
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    compiler.compile("json_schema", tree)
    compiler.compile("json_schema", _ref_chain(60))
    compiler.compile("grammar", _rule_chain(300))
    compiler.compile("json_schema", _properties(4096))


def test_compiled_grammars_are_cached_and_matchers_independent(compiler, tokenizer):
    a = compiler.compile(
        "json_schema", {"type": "object", "properties": {"x": {"type": "integer"}}}
    )
    b = compiler.compile(
        "json_schema", {"properties": {"x": {"type": "integer"}}, "type": "object"}
    )
    assert a is b
    first, second = a.matcher(), a.matcher()
    first.consume(tokenizer.encode('{"', add_special_tokens=False)[0])
    assert not torch.equal(first.allowed(), second.allowed())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"json_schema": {}, "regex": "a"}, "give at most one of"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": 5}, "json_schema must be a JSON Schema object"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", 1]}, "choice must be a non-empty list"),
        ({"grammar": 3}, "grammar must be a non-empty string"),
        ({"regex": "a", "ignore_eos": True}, "ignore_eos cannot be combined with regex"),
    ],
)
def test_sampling_params_check_constraints(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_sampling_params_constraint():
    assert SamplingParams().constraint is None
    assert SamplingParams(json_schema='{"type": "object"}').constraint == (
        "json_schema",
        {"type": "object"},
    )
    assert SamplingParams(choice=("a", "b")).constraint == ("choice", ["a", "b"])


# --------------------------------------------------------------------------- the sampler stage


@settings(max_examples=50, deadline=None)
@given(
    words=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=6), rows=st.integers(1, 3)
)
def test_unpack_bitmask(words, rows):
    bitmask = torch.tensor([words] * rows, dtype=torch.int32)
    vocab = 32 * len(words) - 5
    expected = [[(words[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)]] * rows
    assert unpack_bitmask(bitmask, vocab).tolist() == expected


def test_apply_token_mask_touches_only_its_rows():
    logits = torch.randn(3, 10)
    allowed = torch.zeros(1, 10, dtype=torch.bool)
    allowed[0, [2, 7]] = True
    out = apply_token_mask(logits, torch.tensor([1]), allowed)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isinf(out[1]).sum() == 8 and out[1, 2] == logits[1, 2]


def _state(params: SamplingParams, compiler: GrammarCompiler, index: int = 0) -> SamplingState:
    grammar = compiler.compile(*params.constraint) if params.constraint else None
    return SamplingState.create(
        params, [1, 2, 3], vocab_size=VOCAB, completion_index=index, grammar=grammar
    )


def test_constrained_rows_pick_allowed_tokens_and_leave_the_others_alone(compiler):
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 5
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=1.0, top_k=50, seed=3)
    constrained = SamplingParams(temperature=0, regex="[0-9]+")
    states = [_state(p, compiler) for p in (greedy, constrained, sampled, greedy)]
    out = Sampler()(logits, states).token_ids
    allowed = states[1].grammar.allowed()
    assert allowed[out[1]]
    assert out[1] == int(logits[1].masked_fill(~allowed, float("-inf")).argmax())
    # the same rows without the constrained one: identical tokens (the seeded row too)
    alone = Sampler()(logits[[0, 2, 3]], [_state(p, compiler) for p in (greedy, sampled, greedy)])
    assert alone.token_ids == [out[0], out[2], out[3]]


def test_sampled_constrained_rows_draw_only_allowed_tokens(compiler):
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=1, choice=["alpha", "beta", "gamma"])
    logits = torch.randn(16, VOCAB) * 3
    states = [_state(params, compiler, i) for i in range(16)]
    allowed = states[0].grammar.allowed()
    for token in Sampler()(logits, states).token_ids:
        assert allowed[token]


def test_process_logits_shows_the_mask(compiler):
    params = SamplingParams(temperature=0, choice=["yes", "no"])
    state = _state(params, compiler)
    logits = torch.randn(VOCAB)
    trace = process_logits(logits, state)
    assert torch.equal(trace.allowed, state.grammar.allowed())
    assert torch.equal(trace.logits, logits)  # before the mask: what the model wanted
    chosen = int(trace.final_probs.argmax())
    assert trace.allowed[chosen] and trace.probs[~trace.allowed].sum() == 0
    assert process_logits(logits, _state(SamplingParams(), compiler)).allowed is None


def test_state_needs_its_grammar(compiler):
    with pytest.raises(ValueError, match="compiled grammar"):
        SamplingState.create(SamplingParams(regex="a"), [1], vocab_size=VOCAB)
    grammar = compiler.compile("regex", "a")
    with pytest.raises(ValueError, match="compiled grammar"):
        SamplingState.create(SamplingParams(), [1], vocab_size=VOCAB, grammar=grammar)


def test_a_constraint_the_vocabulary_cannot_spell_ends_at_eos(tmp_path):
    """A word vocabulary ("t0".."t319") cannot spell the choice "c0". Whatever llguidance's
    mask lets through there, the token it then refuses ends the sequence (EOS only from
    there), as before: that is the model's dead end, not a failure of the request; only a
    limit of llguidance's fails the request (test_server_attacks)."""
    from helpers import build_hf_model

    from tokenmill.engine.llm_engine import load_tokenizer

    build_hf_model("llama", tmp_path)
    words = GrammarCompiler(load_tokenizer(tmp_path), 320, [319])
    matcher = words.compile("choice", ["c0"]).matcher()
    first = int(matcher.allowed().nonzero()[0][0])
    matcher.consume(first)  # refused by llguidance: no raise
    assert matcher.allowed().nonzero().flatten().tolist() == [319]
