"""Speculative decoding (engine/speculative.py): n-gram guesses verified in one step give
exactly the tokens, text, stops and logprobs of plain decoding; sampling keeps the target's
distribution; rejected guesses' blocks go back."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from helpers import build_hf_model

from tokenmill import kernels
from tokenmill.engine.llm_engine import LLMEngine, RequestOutput
from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.engine.speculative import SpeculativeConfig, Speculator
from tokenmill.sampling import FinishReason, SamplingParams
from tokenmill.sampling.sampler import SamplingState, process_logits

# guesses verified every time they exist (the adaptive gate would rest sequences whose
# guesses do not pay on this machine), also in the batched tests
FORCED = {"method": "ngram", "k": 4, "adaptive": False, "max_running": 64}

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wiped the "
    "great lens, trimmed the wick and lit the lamp, and the beam swept across the bay "
    "where the fishing boats came home. In winter the storms were fierce, and he kept "
    "a log of every ship that passed, its name, its flag and the hour it was seen."
)
COPY = f"Repeat this paragraph exactly, word for word:\n\n{PASSAGE}\n\nThe paragraph:\n\n"
CODE = (
    "Add type hints to this code:\n\n"
    "def add_numbers(first, second):\n    total = first + second\n    return total\n\n"
    "def scale_list(values, factor):\n    return [value * factor for value in values]\n\n"
    "The code with type hints:\n\n"
)
STORY = "Write a short story about a dragon."


def _drive(engine: LLMEngine, prompts: list, params: SamplingParams) -> list[list[RequestOutput]]:
    """Run prompts together; each request's step outputs, in order. Checks the block
    manager's invariants after every step."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
        engine.blocks.check_invariants([s.block_table for s in engine.scheduler.running])
    return [outs[rid] for rid in ids]


def _tokens(steps: list[RequestOutput]) -> list[int]:
    return [t for out in steps for t in out.token_ids]


def _text(steps: list[RequestOutput]) -> str:
    return "".join(out.text for out in steps)


def _runs(steps: list[RequestOutput]) -> list[tuple[int, int]]:
    """(first output index, length) of each step that gave several tokens."""
    runs, at = [], 0
    for out in steps:
        if len(out.token_ids) > 1:
            runs.append((at, len(out.token_ids)))
        at += len(out.token_ids)
    return runs


# --------------------------------------------------------------------------- options


def test_config_parsing_and_errors():
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse("ngram") == SpeculativeConfig()
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 6})
    assert cfg.k == 6
    with pytest.raises(ValueError, match="method 'lookahead' is not one of ngram, draft"):
        SpeculativeConfig.parse("lookahead")
    with pytest.raises(ValueError, match="k must be an integer >= 1, got 0"):
        SpeculativeConfig.parse({"k": 0})
    with pytest.raises(ValueError, match="no option 'kk'"):
        SpeculativeConfig.parse({"kk": 3})
    with pytest.raises(ValueError, match="prompt_lookup_min 3 is above prompt_lookup_max 2"):
        SpeculativeConfig.parse({"prompt_lookup_min": 3, "prompt_lookup_max": 2})


class _Seq:
    def __init__(self, tokens: list[int]):
        self.token_ids, self.spec = tokens, None


def test_ngram_proposals_longest_then_most_recent():
    spec = Speculator(SpeculativeConfig(k=3))
    # "7 8 9" occurs twice; the most recent occurrence's continuation is proposed
    assert spec.propose(_Seq([7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9]), 3) == [4, 5, 6]
    # the 2-gram "5 6" beats the 1-gram "6" (whose latest continuation is 9)
    assert spec.propose(_Seq([5, 6, 1, 6, 9, 5, 6]), 3) == [1, 6, 9]
    assert spec.propose(_Seq([1, 2, 3, 4]), 3) == []  # no earlier occurrence
    assert spec.propose(_Seq([1, 2, 1, 2]), 1) == [1]  # the limit caps k
    seq = _Seq([3, 4, 5, 3, 4])
    assert spec.propose(seq, 3) == [5, 3, 4]
    seq.token_ids = seq.token_ids + [6, 3, 4]  # the index follows new tokens
    assert spec.propose(seq, 3) == [6, 3, 4]


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smol(smollm_path):
    plain = LLMEngine(smollm_path, threads=2)
    spec = LLMEngine(smollm_path, threads=2, speculative=FORCED)
    return plain, spec


def _compare(plain: LLMEngine, spec: LLMEngine, prompts, params):
    ref = _drive(plain, prompts, params)
    got = _drive(spec, prompts, params)
    for r, g in zip(ref, got, strict=True):
        assert _tokens(g) == _tokens(r)
        assert _text(g) == _text(r)
        assert (g[-1].finish_reason, g[-1].stop_string) == (r[-1].finish_reason, r[-1].stop_string)
    return ref, got


def test_greedy_identical_on_the_real_model_alone_and_batched(smol):
    plain, spec = smol
    params = SamplingParams(max_tokens=60, temperature=0)
    before = spec.speculative_stats()
    got = []
    for prompt in (COPY, CODE, STORY):
        got += _compare(plain, spec, [prompt], params)[1]
    _compare(plain, spec, [COPY, CODE, STORY], params)  # batched
    stats = spec.speculative_stats()
    proposed = stats["speculative_proposed_tokens"] - before["speculative_proposed_tokens"]
    accepted = stats["speculative_accepted_tokens"] - before["speculative_accepted_tokens"]
    assert 0 < accepted < proposed  # guesses were accepted, and some were rejected
    assert _runs(got[0])  # the copy came several tokens a step
    assert not spec.has_unfinished() and spec.blocks.num_free == spec.blocks.num_blocks


def _a_run(spec: LLMEngine, params: SamplingParams) -> tuple[list[int], int]:
    """The copy prompt's tokens and the start of a step that gave >= 3 of them."""
    steps = _drive(spec, [COPY], params)[0]
    start = next(at for at, n in _runs(steps) if n >= 3)
    return _tokens(steps), start


def test_stops_and_max_tokens_inside_an_accepted_run(smol):
    plain, spec = smol
    full = SamplingParams(max_tokens=60, temperature=0)
    tokens, at = _a_run(spec, full)
    # max_tokens lands on the second token of the run
    ref, got = _compare(plain, spec, [COPY], SamplingParams(max_tokens=at + 2, temperature=0))
    assert len(_tokens(got[0])) == at + 2 and got[0][-1].finish_reason is FinishReason.LENGTH
    # a stop token id first seen inside the run
    stop_id = next(t for t in tokens[at + 1 :] if tokens.index(t) > at)
    params = SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[stop_id])
    ref, got = _compare(plain, spec, [COPY], params)
    assert got[0][-1].finish_reason is FinishReason.STOP
    assert _tokens(got[0]) == tokens[: tokens.index(stop_id) + 1]
    # a stop string made of the run's second and third tokens' text
    word = spec.tokenizer.decode(tokens[at + 1 : at + 3]).strip()
    ref, got = _compare(
        plain, spec, [COPY], SamplingParams(max_tokens=60, temperature=0, stop=[word])
    )
    assert got[0][-1].stop_string == word and word not in _text(got[0])


def test_logprobs_and_seeded_sampling_match_plain_decoding(smol):
    plain, spec = smol
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=2)
    ref, got = _compare(plain, spec, [COPY], params)
    ref_lp = [lp for out in ref[0] for lp in out.logprobs]
    got_lp = [lp for out in got[0] for lp in out.logprobs]
    assert [lp.token_id for lp in got_lp] == _tokens(got[0])
    for r, g in zip(ref_lp, got_lp, strict=True):
        assert g.logprob == pytest.approx(r.logprob, abs=2e-3)
        assert list(g.top) == list(r.top)
    # a seeded request draws the same randomness per token: the same tokens
    sampled = SamplingParams(
        max_tokens=40, temperature=0.7, top_p=0.95, repetition_penalty=1.05, seed=11
    )
    before = spec.speculative_stats()["speculative_accepted_tokens"]
    _compare(plain, spec, [COPY, COPY], sampled)
    assert spec.speculative_stats()["speculative_accepted_tokens"] > before


def test_a_guess_the_grammar_forbids_is_rejected(smol):
    plain, spec = smol
    params = SamplingParams(max_tokens=12, temperature=0, regex=r"[0-9]{3}-[0-9]{4}")
    letter = spec.tokenizer.encode("x", add_special_tokens=False)[0]
    proposed = []

    def always_x(seq, limit):  # an adversary: guesses a token the grammar never allows
        proposed.append(seq.request_id)
        return [letter] * min(limit, 3)

    spec.speculator.propose = always_x
    try:
        before = spec.speculative_stats()["speculative_accepted_tokens"]
        ref, got = _compare(plain, spec, ["Phone number: "], params)
    finally:
        del spec.speculator.propose
    assert proposed and spec.speculative_stats()["speculative_accepted_tokens"] == before
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", _text(got[0]))


def _verify_logits(engine: LLMEngine, seq, proposal: tuple[int, ...]) -> torch.Tensor:
    """Logits [1 + k, vocab] of one verification step of `seq`'s last token and `proposal`
    (nothing committed). The step's cache slots are filled with NaN first: a row that read
    one before the row it belongs to wrote it would turn to NaN, not to an earlier step's
    K/V of the same tokens."""
    chunk = ScheduledChunk(seq, 1 + len(proposal), proposal)
    start = seq.num_computed
    engine.blocks.grow(seq.block_table, start + chunk.num_tokens)
    slots = engine.runner._slots(seq.block_table, start, start + chunk.num_tokens)
    for cache in (*engine.runner.cache.k, *engine.runner.cache.v):
        cache[slots] = float("nan")
    logits, sampled = engine.runner.run([chunk])
    assert sampled == [0] * chunk.num_tokens
    return logits


@pytest.mark.parametrize("context", [40, 700])
def test_verification_rows_in_the_fused_stack_equal_plain_decode(smol, context):
    """A verification of k guesses runs as 1 + k decode rows of the fused stack, row j
    attending over the cache up to its own position (stack.c's chained attention): each
    row's logits equal, bit for bit, those of the last row of a verification of j guesses
    (row 0: a plain decode step), and the chunked-prefill path's within its rounding.
    2 threads: a row reading an earlier row's K/V before it is written would differ; 700
    tokens of context: tm_decode_attention splits a row's context between the threads."""
    _, spec = smol
    prompt = list(range(1000, 1000 + context))
    spec.add_request("v", prompt, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    # a fixed team: a shrunk one (team.c, on a loaded machine) lowers the thread count the
    # stack is called with, and with it how tm_decode_attention splits a long context,
    # which moves the last bits of a plain decode step as much as of a verification's
    adaptive = kernels.adaptive_threads(False)
    try:
        seq = spec.requests["v"].seq
        while seq.num_computed < context:  # the prompt (in chunks), one token sampled
            spec.step()
        guesses = tuple(range(2000, 2008))  # 8 guesses: 9 rows
        assert spec.runner._verify_as_decode([ScheduledChunk(seq, 9, guesses)], 0) == [0]
        full = _verify_logits(spec, seq, guesses)
        for j in range(len(guesses)):  # row j alone, as the last row of a shorter chunk
            assert torch.equal(full[j], _verify_logits(spec, seq, guesses[:j])[j]), j
        # the chunked-prefill path (torch attention over the gathered cache)
        spec.runner._verify_as_decode = lambda chunks, num_decode: []
        try:
            prefill = _verify_logits(spec, seq, guesses)
        finally:
            del spec.runner._verify_as_decode
        # a plain decode step and the prefill path part by ~4e-3 in SmolLM2's logits (up to
        # ~27): float sums in another order, through 30 layers of 16-bit activations
        assert (full - prefill).abs().max().item() < 5e-4 * full.abs().max().item()
    finally:
        spec.abort("v")
        kernels.adaptive_threads(adaptive)


# --------------------------------------------------------------------------- random weights

REPEATS = [[5, 6, 7, 8, 9, 10] * 4, [40, 41, 42] * 6 + [43], list(range(100, 130)) * 2]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2", "olmo2", "qwen2_moe"])
def test_greedy_identical_on_random_models(arch, tmp_path):
    build_hf_model(arch, tmp_path, initializer_range=0.05)
    plain = LLMEngine(tmp_path, kv_cache_memory="2048tok")
    spec = LLMEngine(tmp_path, kv_cache_memory="2048tok", speculative=FORCED)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    _compare(plain, spec, REPEATS[:1], params)
    _compare(plain, spec, REPEATS, params)
    assert spec.speculative_stats()["speculative_proposed_tokens"] > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    build_hf_model("llama", folder, initializer_range=0.05, max_position_embeddings=1024)
    return folder


def test_preemption_with_speculation(tiny):
    prompts = [p * 2 for p in REPEATS] * 4
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = LLMEngine(tiny, kv_cache_memory="4096tok")
    # 24 blocks of 8 tokens: enough for any one request, far too few for all 12 at once
    spec = LLMEngine(tiny, kv_cache_memory="192tok", block_size=8, speculative=FORCED)
    ref = [_tokens(_drive(plain, [p], params)[0]) for p in prompts]
    got = [_tokens(steps) for steps in _drive(spec, prompts, params)]
    assert got == ref
    assert spec.scheduler.num_preemptions > 0
    assert spec.speculative_stats()["speculative_accepted_tokens"] > 0
    assert spec.blocks.num_free == spec.blocks.num_blocks


def test_prefix_cache_holds_only_accepted_tokens(tiny):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLMEngine(tiny, kv_cache_memory="4096tok", block_size=4)
    spec = LLMEngine(tiny, kv_cache_memory="4096tok", block_size=4, speculative=FORCED)
    prompt = REPEATS[1]
    first = _tokens(_drive(spec, [prompt], params)[0])
    assert first == _tokens(_drive(plain, [prompt], params)[0])
    assert spec.speculative_stats()["speculative_accepted_tokens"] > 0
    # a prompt running on into the output reuses the blocks the output filled: their K/V
    # must be the accepted tokens', or its continuation would differ from plain decoding
    longer = prompt + first[:30]
    again = _drive(spec, [longer], params)[0]
    assert again[-1].num_cached_tokens >= len(prompt) + 24
    assert _tokens(again) == _tokens(_drive(plain, [longer], params)[0])


def test_rollback_frees_exactly_the_rejected_slots(tiny):
    engine = LLMEngine(
        tiny, kv_cache_memory="4096tok", block_size=4, enable_prefix_caching=False,
        speculative={"k": 4, "adaptive": False},
    )  # fmt: skip
    engine.speculator.propose = lambda seq, limit: [3] * min(limit, 4)  # never right
    engine.add_request("a", list(range(10, 19)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # the prompt: 9 tokens, 3 blocks
    seq, blocks = engine.requests["a"].seq, engine.blocks
    checked = 0
    while engine.has_unfinished():
        computed, used = seq.num_computed, blocks.num_used
        grown = blocks.blocks_for(computed + 5)  # the step's last token and 4 guesses
        out = engine.step()[0]
        if out.finished:
            break
        accepted = len(out.token_ids) - 1
        assert seq.num_computed == computed + 1 + accepted
        # the table keeps the accepted tokens' blocks; the guesses' others went back
        assert len(seq.block_table) == blocks.blocks_for(seq.num_computed)
        assert blocks.num_used == used + blocks.blocks_for(seq.num_computed) - blocks.blocks_for(
            computed
        )
        checked += grown > len(seq.block_table)
        blocks.check_invariants([seq.block_table])
    assert checked > 0  # some steps had taken blocks for guesses alone, and gave them back
    assert blocks.num_free == blocks.num_blocks


# --------------------------------------------------------------------------- the distribution

VOCAB, GUESS = 8, 3


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eight")
    hf = build_hf_model("llama", folder, vocab=VOCAB, initializer_range=0.1)
    return folder, hf


def _adversary(seq, limit):  # always guesses GUESS
    return [GUESS] * min(limit, 2)


def _target(hf, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """The exact distribution of output tokens 2 and 3 (the ones speculation samples,
    token 1 comes from the prompt's step) under the sampler's pipeline."""

    def probs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, -1]
        state = SamplingState.create(params, prompt, vocab_size=VOCAB)
        for t in tokens:
            state.append(t)
        return process_logits(logits, state).final_probs.double()

    joint: Counter = Counter()
    p1 = probs([])
    for a in range(VOCAB):
        p2 = probs([a])
        for b in range(VOCAB):
            p3 = probs([a, b])
            for c in range(VOCAB):
                joint[(b, c)] += float(p1[a] * p2[b] * p3[c])
    return joint


def test_speculative_sampling_keeps_the_target_distribution(eight):
    folder, hf = eight
    prompt = [1, 4, 2, 5]
    base = dict(max_tokens=3, temperature=1.0, top_k=6, repetition_penalty=1.3, ignore_eos=True)
    base["logit_bias"] = {GUESS: 1.5}  # the guess is often right, often wrong
    engine = LLMEngine(
        folder, kv_cache_memory="65536tok", max_num_seqs=512, max_num_batched_tokens=4096,
        speculative={"k": 2, "adaptive": False, "max_running": 10**6},
    )  # fmt: skip
    engine.speculator.propose = _adversary
    draws = 4000
    seeded = [SamplingParams(**base, seed=s) for s in range(draws)]
    ids = [f"s{s}" for s in range(draws)]
    for rid, params in zip(ids, seeded, strict=True):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    stats = engine.speculative_stats()
    assert 0 < stats["speculative_accepted_tokens"] < stats["speculative_proposed_tokens"]
    counts = Counter((t[1], t[2]) for t in tokens.values())
    # chi-square over the cells expecting >= 5 draws, the rest pooled into one
    expected = {cell: p * draws for cell, p in _target(hf, prompt, SamplingParams(**base)).items()}
    big = [cell for cell, e in expected.items() if e >= 5]
    obs = [counts[c] for c in big] + [draws - sum(counts[c] for c in big)]
    exp = [expected[c] for c in big] + [draws - sum(expected[c] for c in big)]
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    dof = len(obs) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))
    assert dof >= 8
    assert p_value > 1e-3, (chi2, dof)
    # and each seeded draw is the one plain decoding makes
    plain = LLMEngine(folder, kv_cache_memory="65536tok", max_num_seqs=512)
    for rid, params in zip(ids[:300], seeded[:300], strict=True):
        plain.add_request(rid, prompt, params)
    ref: dict[str, list[int]] = {rid: [] for rid in ids[:300]}
    while plain.has_unfinished():
        for out in plain.step():
            ref[out.request_id] += out.token_ids
    assert all(tokens[rid] == ref[rid] for rid in ref)
