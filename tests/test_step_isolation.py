"""One request's failure fails that request alone, never its step.

Before: one bad sampling value (a top_p of 1e-46, 0 in float32) raised inside the batched
sampler, and every request in the step got "the engine failed while generating: index -1
is out of bounds". The numbers are now checked up front; these tests poison one
request's state past the checks, as the next unchecked value would, and expect the other
requests to finish exactly as they would have alone."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from helpers import build_hf_model

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling import SamplingParams

PROMPTS = {"a": [5, 6, 7, 8, 9], "bad": [11, 12, 13], "c": [20, 21, 22, 23]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    build_hf_model("llama", folder, initializer_range=0.05)
    return folder


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.8, seed=seed, ignore_eos=True)


def _alone(engine: LLMEngine, request_id: str) -> list[int]:
    engine.add_request(request_id, PROMPTS[request_id], _params(len(request_id)))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.token_ids]
    return tokens


def _poison_sampling(engine: LLMEngine) -> None:
    # a logit_bias id past the vocabulary: indexing the [B, V] logits raises for the batch
    state = engine.requests["bad"].seq.sampling
    state.bias_ids = torch.tensor([10**6])
    state.bias_values = torch.tensor([1.0])


def _poison_grammar(engine: LLMEngine) -> None:
    # what a grammar matcher that refuses the sampled token does in append()
    def refuse(token_id: int) -> None:
        raise RuntimeError("the matcher refused the token")

    engine.requests["bad"].seq.sampling.append = refuse


@pytest.mark.parametrize("poison", [_poison_sampling, _poison_grammar])
def test_a_failing_request_fails_alone(tiny, poison):
    engine = LLMEngine(tiny, kv_cache_memory="512tok", threads=1)
    expected = {rid: _alone(engine, rid) for rid in ("a", "c")}
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, _params(len(rid)))
    poison(engine)
    got: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    errors = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
            if out.error is not None:
                assert out.finished and out.finish_reason == "error"
                errors[out.request_id] = out.error
    assert list(errors) == ["bad"]
    assert "\n" not in errors["bad"] and "this request failed" in errors["bad"]
    assert got["bad"] == []
    assert {rid: got[rid] for rid in ("a", "c")} == expected  # seeded: the very same tokens
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.blocks.check_invariants([])


def test_the_server_fails_that_api_request_alone(tiny):
    from tokenmill.server.async_engine import AsyncEngine, EngineFailure

    engine = LLMEngine(tiny, kv_cache_memory="512tok", threads=1)
    server = AsyncEngine(engine)
    real_add = engine.add_request

    def add_then_poison(request_id, *args, **kwargs):
        n = real_add(request_id, *args, **kwargs)
        if request_id.startswith("bad"):
            engine.requests[request_id].seq.sampling.bias_ids = torch.tensor([10**6])
            engine.requests[request_id].seq.sampling.bias_values = torch.tensor([1.0])
        return n

    engine.add_request = add_then_poison

    async def main():
        server.start()
        try:
            params = SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True)
            good = await server.generate("good", [PROMPTS["a"]], params)
            bad = await server.generate("bad", [PROMPTS["bad"]], dataclasses.replace(params, n=2))
            with pytest.raises(EngineFailure, match="this request failed while sampling"):
                await bad.collect()
            return await good.collect()
        finally:
            server.stop()

    (generation,) = asyncio.run(main())
    assert len(generation.token_ids) == 5 and generation.finish_reason == "length"
    assert engine.blocks.num_free == engine.blocks.num_blocks  # bad's second choice aborted
