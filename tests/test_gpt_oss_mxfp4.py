"""gpt-oss checkpoints whose experts are stored MXFP4, as the released gpt-oss-20b/120b
store them: config.json's quantization_config {"quant_method": "mxfp4"}, and per layer

    mlp.experts.gate_up_proj_blocks uint8 [E, 2fe, d / 32, 16]   rows: gate and up interleaved
    mlp.experts.gate_up_proj_scales uint8 [E, 2fe, d / 32]       e8m0: 2^(s - 127)
    mlp.experts.down_proj_blocks    uint8 [E, d, fe / 32, 16]
    mlp.experts.down_proj_scales    uint8 [E, d, fe / 32]

(each byte two e2m1 codes, value 2i in the low nibble), beside the float biases. The
folder here is written from a random transformers model by this file's own encoder, and
transformers itself reading that folder (it dequantizes MXFP4 on a CPU) is the oracle.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import Single, hf_greedy, hf_logits, save_word_tokenizer
from test_gpt_oss_gguf import build_gpt_oss
from test_moe import GREEDY

from tokenmill.layers.quant_linear import QuantLinear
from tokenmill.llm import LLM
from tokenmill.loader import LoadError, open_checkpoint

# e2m1 magnitudes by code; codes 8-15 are the same, negative
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., rows, cols] float -> (blocks uint8 [..., rows, cols / 32, 16], scales uint8
    [..., rows, cols / 32]): per 32 values the power of two that brings the largest to at
    most 6, and each value's nearest e2m1 code."""
    x = w.reshape(*w.shape[:-1], -1, 32).astype(np.float32)  # [..., rows, G, 32]
    amax = np.abs(x).max(axis=-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).clip(-127, 127)  # [..., G, 1]
    table = np.concatenate([_E2M1, -_E2M1])  # [16] by code
    scaled = x / np.exp2(exp)
    codes = np.abs(scaled[..., None] - table).argmin(axis=-1).astype(np.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks, (exp[..., 0] + 127).astype(np.uint8)


def write_mxfp4_folder(hf, folder) -> None:
    """hf saved with its experts' weights as MXFP4 (module docstring), the rest as is."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # HF keeps [E, in, out] in memory; the checkpoint stores [E, out, in] blocks
            blocks, scales = mxfp4_encode(t.transpose(1, 2).float().numpy())
            tensors[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            tensors[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_word_tokenizer(folder, hf.config.vocab_size)


def _oracle(folder):
    """transformers' own reading of the MXFP4 folder (dequantized: no MXFP4 kernel here)."""
    import transformers

    model = transformers.GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


@pytest.fixture
def mxfp4_folder(tmp_path):
    hf = build_gpt_oss(tmp_path / "float", hidden_size=64, intermediate_size=32)
    folder = tmp_path / "mxfp4"
    write_mxfp4_folder(hf, folder)
    return folder


def test_mxfp4_experts_load_as_transformers_reads_them(mxfp4_folder):
    """Our float path equals transformers on the same MXFP4 folder (logits at every
    position within 1e-4, greedy tokens equal); by default the experts pack from their
    MXFP4 blocks (requantized 8-bit, as a GGUF's MXFP4) and most positions' logits stay
    within that rounding."""
    oracle = _oracle(mxfp4_folder)
    ckpt = open_checkpoint(mxfp4_folder)
    assert ckpt.config.num_experts == 5 and ckpt.shapes["layers.0.mlp.experts.4.up.weight"] == (
        32,
        64,
    )
    prompt = torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    exact = Single(mxfp4_folder).feed(prompt)
    ref = hf_logits(oracle, prompt)
    assert (exact - ref).abs().max().item() < 1e-4
    llm = LLM(mxfp4_folder, quantization="none", kv_cache_memory="1024tok")
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(oracle, prompt, 12)

    packed = LLM(mxfp4_folder, kv_cache_memory="1024tok")  # auto: packed as stored
    moe = packed.engine.model.layers[0].mlp
    assert all(
        isinstance(e.up, QuantLinear) and isinstance(e.down, QuantLinear) for e in moe.experts
    )
    spread = (exact.max() - exact.min()).item()
    off = (Single(mxfp4_folder, quantize="float").feed(prompt) - exact).abs().amax(-1) / spread
    assert (off < 0.05).float().mean().item() >= 0.75, off


def test_mxfp4_blocks_without_scales_is_one_clear_error(mxfp4_folder):
    from safetensors.torch import load_file, save_file

    file = mxfp4_folder / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(LoadError, match="has no 'model.layers.1.mlp.experts.down_proj_scales'"):
        LLM(mxfp4_folder, quantization="none", kv_cache_memory="1024tok")
