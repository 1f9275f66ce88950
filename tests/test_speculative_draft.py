"""Speculative decoding with a draft model (engine/speculative.py, method "draft"; issue
26): a second model with the same tokenizer proposes k greedy tokens, the target verifies
them in one step. The output is the target's alone: token-identical to plain decoding
whether the draft agrees (the same weights) or never does (other random weights), and the
draft holds no KV block between steps."""

from __future__ import annotations

import pytest
from helpers import build_hf_model

from tokenmill.engine.llm_engine import LLMEngine, RequestOutput
from tokenmill.engine.speculative import SpeculativeConfig
from tokenmill.sampling import SamplingParams


def _drive(engine: LLMEngine, prompts: list, params: SamplingParams) -> list[list[int]]:
    """Run prompts together; each request's tokens. The draft engine must be idle, with
    every block free (cached ones count as free), after every step."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[int]] = {rid: [] for rid in ids}
    draft = engine.speculator.draft if engine.speculator is not None else None
    while engine.has_unfinished():
        out: RequestOutput
        for out in engine.step():
            assert out.error is None, out.error
            outs[out.request_id].extend(out.token_ids)
        if draft is not None:
            assert not draft.has_unfinished() and not draft.requests
            assert draft.blocks.num_free == draft.blocks.num_blocks
    return [outs[rid] for rid in ids]


def test_config_parsing_and_errors(tmp_path):
    cfg = SpeculativeConfig.parse(f"draft:{tmp_path}")
    assert (cfg.method, cfg.draft, cfg.k) == ("draft", str(tmp_path), 4)
    cfg = SpeculativeConfig.parse({"draft": "m", "num_speculative_tokens": 3})
    assert (cfg.method, cfg.draft, cfg.k) == ("draft", "m", 3)
    assert SpeculativeConfig.parse({"method": "draft:m", "k": 2}).draft == "m"
    with pytest.raises(ValueError, match="method 'draft' needs the draft model"):
        SpeculativeConfig.parse("draft")
    with pytest.raises(ValueError, match="method 'draft' needs the draft model"):
        SpeculativeConfig.parse("draft:")
    with pytest.raises(ValueError, match="a draft model is for method 'draft', not 'ngram'"):
        SpeculativeConfig.parse({"method": "ngram", "draft": "m"})
    with pytest.raises(ValueError, match="method 'medusa' is not one of ngram, draft"):
        SpeculativeConfig.parse("medusa")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random target and a random draft of another shape and seed, one word vocabulary."""
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    build_hf_model("llama", target, initializer_range=0.05, max_position_embeddings=1024)
    build_hf_model("qwen3", draft, seed=7, initializer_range=0.05, num_hidden_layers=1)
    return target, draft


PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, [40, 41, 42] * 6 + [43], list(range(100, 130))]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_a_draft_that_disagrees_changes_nothing(pair):
    target, draft = pair
    plain = LLMEngine(target, kv_cache_memory="2048tok")
    spec = LLMEngine(
        target, kv_cache_memory="2048tok", speculative={"draft": str(draft), "adaptive": False}
    )
    want = _drive(plain, PROMPTS, GREEDY)
    assert _drive(spec, PROMPTS[:1], GREEDY) == want[:1]  # alone
    assert _drive(spec, PROMPTS, GREEDY) == want  # batched
    stats = spec.speculative_stats()
    assert stats["speculative_method"] == "draft" and stats["speculative_proposed_tokens"] > 0
    assert stats["speculative_accepted_tokens"] < stats["speculative_proposed_tokens"]


def test_the_target_as_its_own_draft_accepts_its_guesses(pair):
    target, _ = pair
    plain = LLMEngine(target, kv_cache_memory="2048tok")
    spec = LLMEngine(
        target, kv_cache_memory="2048tok", speculative={"draft": str(target), "adaptive": False}
    )
    assert _drive(spec, PROMPTS, GREEDY) == _drive(plain, PROMPTS, GREEDY)
    stats = spec.speculative_stats()
    assert stats["speculative_acceptance_rate"] > 0.9, stats
    # a whole verification of k guesses takes 1 + k tokens: fewer steps than tokens
    assert stats["speculative_steps"] < len(PROMPTS) * GREEDY.max_tokens / 2


def test_a_draft_with_another_tokenizer_is_refused(pair, tmp_path):
    target, _ = pair
    build_hf_model("llama", tmp_path, vocab=200)
    with pytest.raises(ValueError, match="has another tokenizer than the model"):
        LLMEngine(target, kv_cache_memory="2048tok", speculative=f"draft:{tmp_path}")


@pytest.mark.slow
def test_real_model_with_itself_as_draft(smollm_path):
    """The default model's weights as both: its greedy text, alone and batched, with
    nearly every guess accepted (the two paths round alike but not always the same)."""
    plain = LLMEngine(smollm_path, threads=2)
    spec = LLMEngine(
        smollm_path,
        threads=2,
        speculative={"draft": str(smollm_path), "adaptive": False, "k": 3},
    )
    prompts = ["Once upon a time, in a small village by the sea,", "The capital of France is"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = _drive(plain, prompts, params)
    assert _drive(spec, prompts[:1], params) == want[:1]
    assert _drive(spec, prompts, params) == want
    assert spec.speculative_stats()["speculative_acceptance_rate"] > 0.8


def test_the_draft_runs_under_the_sequence_cache_salt(pair, monkeypatch):
    """The draft's prefix cache is scoped as the target's (cache_salt): its timing must
    not reveal another user's prompt either."""
    target, draft = pair
    spec = LLMEngine(
        target, kv_cache_memory="2048tok", speculative={"draft": str(draft), "adaptive": False}
    )
    engine, salts = spec.speculator.draft, []
    real = engine.add_request
    monkeypatch.setattr(
        engine, "add_request", lambda *a, **kw: salts.append(kw["cache_salt"]) or real(*a, **kw)
    )
    spec.add_request("a", PROMPTS[0], GREEDY, cache_salt=1234)
    while spec.has_unfinished():
        spec.step()
    assert salts and set(salts) == {1234}


def test_a_traced_request_speculates_beside_an_untraced_one(pair):
    """A traced sequence is verified like any other (the inspector shows its guesses):
    beside an untraced one that speculates too, both get the plain tokens, and the trace's
    verification steps account for every token it emitted."""
    from tokenmill.inspect.trace import Trace

    target, _ = pair
    forced = {"method": "ngram", "adaptive": False, "max_running": 64}
    spec = LLMEngine(target, kv_cache_memory="2048tok", speculative=forced)
    plain = LLMEngine(target, kv_cache_memory="2048tok")
    trace = Trace()
    spec.add_request("traced", PROMPTS[0], GREEDY, trace=trace)
    spec.add_request("other", PROMPTS[1], GREEDY)
    got: dict[str, list[int]] = {"traced": [], "other": []}
    while spec.has_unfinished():
        for out in spec.step():
            got[out.request_id].extend(out.token_ids)
    assert [got["traced"], got["other"]] == _drive(plain, PROMPTS[:2], GREEDY)
    assert trace.summary["output_ids"] == got["traced"]
    verify = [s for s in trace.steps if s["phase"] == "verify"]
    assert verify, "the traced sequence proposed guesses"
    emitted = sum(len(s.get("samples", [s["sample"]])) for s in trace.steps if "sample" in s)
    assert emitted == len(got["traced"])
    assert trace.summary["verify_tokens"] == sum(s["speculation"]["emitted"] for s in verify)
    assert spec.speculative_stats()["speculative_proposed_tokens"] > 0
