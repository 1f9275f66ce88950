"""Context extension at full length: a YaRN model read from config.json
runs to the end of its extended window with transformers' logits and greedy tokens, far
past its original context; one token beyond the window is refused in one line."""

from __future__ import annotations

import random

import pytest
from helpers import Single, build_hf_model, hf_greedy, hf_logits

from tokenmill.engine.llm_engine import LLMEngine, RequestError
from tokenmill.loader import open_checkpoint
from tokenmill.sampling import SamplingParams

ORIGINAL, WINDOW = 128, 1024  # YaRN factor 8: the window is 8x the trained context


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def yarn_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"yarn-{request.param}")
    rope = {
        "rope_type": "yarn",
        "factor": WINDOW / ORIGINAL,
        "original_max_position_embeddings": ORIGINAL,
        "rope_theta": 10000.0,
    }
    hf = build_hf_model(
        request.param,
        folder,
        initializer_range=0.05,
        max_position_embeddings=WINDOW,
        rope_parameters=rope,
    )
    return hf, folder


def test_yarn_logits_at_full_length(yarn_model):
    hf, folder = yarn_model
    prompt = random.Random(0).choices(range(3, 300), k=WINDOW - 24)
    ours = Single(folder)
    assert open_checkpoint(folder).config.rope.scaling == "yarn"
    ref = hf_logits(hf, prompt)
    got = ours.feed(prompt)
    # every position, the ones past the original context included
    err = (got - ref).abs().amax(dim=-1)
    assert err[ORIGINAL:].max().item() < 2e-4 and err.max().item() < 2e-4, err.max()


def test_yarn_greedy_to_the_end_of_the_window(yarn_model):
    hf, folder = yarn_model
    prompt = random.Random(1).choices(range(3, 300), k=WINDOW - 40)
    engine = LLMEngine(folder, quantization="none", kv_cache_memory=f"{2 * WINDOW}tok")
    engine.add_request("r", prompt, SamplingParams(max_tokens=39, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
    assert tokens == hf_greedy(hf, prompt, 39)
    # the last position of the window is position WINDOW - 1; one token more is refused
    with pytest.raises(RequestError, match=str(WINDOW)):
        engine.add_request("long", [5] * WINDOW, SamplingParams(max_tokens=1))
