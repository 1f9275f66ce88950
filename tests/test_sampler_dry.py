"""DRY (sampling/dry.py): its penalties against the definition written out by brute force
on random contexts, against llama.cpp's own dry sampler (llama-cpp-python) on the default
model's vocabulary and real text, and through the engine, where a strong DRY keeps greedy
decoding from repeating what a plain greedy run repeats."""

from __future__ import annotations

import ctypes
import importlib.util

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_samplers_llama_cpp import llama_cpp_apply

from tokenmill.sampling import dry
from tokenmill.sampling.params import ParamError, SamplingParams

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)


def brute_force(context, tails, multiplier, base, allowed):
    """The definition, quadratically: for each earlier position j, the longest run of
    tokens ending at j that equals the run ending the context, never reaching back
    across the newest breaker; the token after j is penalised for the longest such run."""
    n = len(context)
    if multiplier == 0 or n <= allowed:
        return {}
    # the newest breaker, searched from the end: its head at i, its tail after it
    limit = n
    for i in range(n - 1, -1, -1):
        ends = [
            len(t)
            for t in tails.get(context[i], ())
            if i + len(t) <= n - 1 and tuple(context[i + 1 : i + 1 + len(t)]) == t
        ]
        if ends:
            limit = (n - 1 - i) - max(ends)
            break
    if limit < allowed:
        return {}
    best: dict[int, int] = {}
    for j in range(n - 1):
        run = 0
        while run < j + 1 and context[j - run] == context[n - 1 - run]:
            run += 1
        run = min(run, limit)
        if run >= allowed:
            token = context[j + 1]
            best[token] = max(best.get(token, 0), run)
    out = {}
    for token, run in best.items():
        if () not in tails.get(token, ()):
            out[token] = multiplier * base ** (run - allowed)
    return out


@settings(max_examples=300, deadline=None)
@given(
    context=st.lists(st.integers(0, 5), min_size=0, max_size=60),
    allowed=st.integers(0, 4),
    heads=st.sampled_from([{}, {5: ((),)}, {4: ((3,),)}, {4: ((3,), ()), 5: ((2, 2),)}]),
)
def test_penalties_follow_the_definition(context, allowed, heads):
    breakers = dry.Breakers(heads)
    ids, values = dry.penalties(np.array(context, np.int64), breakers, 0.8, 1.75, allowed)
    ours = dict(zip(ids.tolist(), values.tolist(), strict=True))
    theirs = brute_force(context, heads, 0.8, 1.75, allowed)
    assert ours.keys() == theirs.keys()
    for t in ours:
        assert ours[t] == pytest.approx(theirs[t], rel=1e-6)


def test_a_repeat_is_penalised_by_its_length():
    # "1 2 3 4 ... 1 2 3": 4 would extend the run "1 2 3" (3 tokens, allowed 2)
    ids, values = dry.penalties(np.array([1, 2, 3, 4, 9, 1, 2, 3]), dry.Breakers({}), 0.8, 2.0, 2)
    assert ids.tolist() == [4] and values.tolist() == pytest.approx([0.8 * 2.0])
    # 2 a breaker (a token of its own): the run "3" after it is shorter than allowed
    ids, _ = dry.penalties(np.array([1, 2, 3, 4, 9, 1, 2, 3]), dry.Breakers({2: ((),)}), 0.8, 2, 2)
    assert ids.tolist() == []


def test_breakers_found_in_token_texts():
    words = [b"a", b"b\n", b'x"', b"::", b"q", b"\xe2"]
    breakers = dry.sequence_breakers(words, lambda s: [ord(c) for c in s], ["\n", '"y', "::"])
    assert breakers.single_token(1) and breakers.single_token(3)  # contain "\n", "::"
    assert breakers.tails[2] == ((ord("y"),),)  # ends with '"', the start of '"y'
    assert not breakers.single_token(0) and 4 not in breakers.tails and 5 not in breakers.tails


def test_params_are_checked():
    assert SamplingParams().dry is False
    assert SamplingParams(dry_multiplier=0.8).dry_sequence_breakers == ["\n", ":", '"', "*"]
    assert SamplingParams(dry_multiplier=0.8, dry_penalty_last_n=0).dry is False
    for bad in (
        dict(dry_multiplier=-1),
        dict(dry_base=0.5),
        dict(dry_allowed_length=-1),
        dict(dry_penalty_last_n=-2),
        dict(dry_sequence_breakers=[""]),
        dict(dry_sequence_breakers="\n"),
    ):
        with pytest.raises(ParamError) as e:
            SamplingParams(**bad)
        assert e.value.param == next(iter(bad))


TEXT = (
    'The list: "one", "two", "three".\n'
    "def add(a, b):\n    return a + b\n"
    "def add(a, b, c):\n    return a + b + c\n"
    "Once upon a time there was a cat. Once upon a time there was a dog. Once upon a time"
)


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize(
    "allowed, last_n, breakers",
    [(2, -1, ["\n", ":", '"', "*"]), (1, 24, ["\n", ":", '"', "*"]), (3, -1, ["a time", "\n"])],
)
def test_penalties_match_llama_cpp(smollm_path, allowed, last_n, breakers):
    import llama_cpp

    from tokenmill.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm_path)
    found = dry.sequence_breakers(
        tok.token_bytes(),
        lambda s: tok.encode(s, add_special_tokens=False, parse_special=False),
        breakers,
    )
    llm = llama_cpp.Llama(model_path=str(smollm_path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    context = tok.encode(TEXT, add_special_tokens=False)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
    checked = 0
    for end in range(8, len(context) + 1):
        seen = np.array(context[:end], np.int64)
        window = seen if last_n < 0 else seen[-last_n:]
        ids, values = dry.penalties(window, found, 0.8, 1.75, allowed)
        ours = logits.copy()
        ours[ids] -= values
        c_breakers = (ctypes.c_char_p * len(breakers))(*[b.encode() for b in breakers])
        # llama.cpp's -1 is the model's training context, which a vocabulary alone has as
        # 0: a window longer than the text says "all of it" there
        their_n = 4096 if last_n < 0 else last_n
        sampler = llama_cpp.llama_sampler_init_dry(
            vocab, 0.8, 1.75, allowed, their_n, c_breakers, len(breakers)
        )
        for t in seen.tolist():
            llama_cpp.llama_sampler_accept(sampler, t)
        theirs = llama_cpp_logits(logits, sampler)
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
        checked += int((ours != logits).any())
    assert checked >= 5  # the prefixes that end in a repeat DRY penalises


def llama_cpp_logits(logits: np.ndarray, sampler) -> np.ndarray:
    """The logits [V] after a llama.cpp sampler that drops nothing (DRY)."""
    out = np.full(logits.shape[0], np.nan, np.float32)
    for i, x in llama_cpp_apply(logits, sampler).items():
        out[i] = x
    return out


@pytest.mark.slow
def test_engine_greedy_with_dry_does_not_extend_repeats(smollm_path):
    from tokenmill import LLM

    llm = LLM(str(smollm_path))
    prompt = "Say it again and again: the cat sat on the mat, the cat sat on the mat, the cat"
    ids = llm.engine.encode_prompt(prompt)
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0]
    strong = SamplingParams(temperature=0, max_tokens=40, dry_multiplier=100.0)
    out = llm.generate(prompt, strong)[0]
    breakers = llm.engine.dry_breakers(strong)
    plain_ids, dry_ids = plain.outputs[0].token_ids, out.outputs[0].token_ids

    def extensions(generated):  # the generated tokens that extend a repeat DRY penalises
        context = list(ids)
        found = 0
        for t in generated:
            found += t in brute_force(context, breakers.tails, 100.0, 1.75, 2)
            context.append(t)
        return found

    assert extensions(plain_ids) >= 5  # the model copies the phrase when left alone
    assert extensions(dry_ids) == 0
