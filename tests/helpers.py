"""Shared test helpers: tiny random-weight checkpoints built with transformers (the oracle),
the engine driven one sequence at a time, transformers' references, and GGUF files written
the way llama.cpp's converter writes them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.engine.sequence import Sequence
from tokenmill.loader import open_checkpoint
from tokenmill.models.transformer import Transformer


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A trivial word-level tokenizer (ids <-> 't{id}') so an engine can run on a tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{vocab_size - 1}"}))


# family -> (transformers model class, its config class, the family's config defaults over
# build_hf_model's common sizes)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 32}),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "num_key_value_heads": 1,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "layer_types": [
                "sliding_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "query_pre_attn_scalar": 24,
        },
    ),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {}),
    # the newer dense families (tests/test_dense_families.py sets their switches)
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {}),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {}),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {}),
    "granite": ("GraniteForCausalLM", "GraniteConfig", {}),
    # mixtures of experts (tests/test_moe.py): 5 experts, 40 wide
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {"head_dim": 16, "intermediate_size": 56, "moe_intermediate_size": 40, "num_experts": 5},
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {"intermediate_size": 56, "moe_intermediate_size": 40, "num_experts": 5},
    ),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        {"intermediate_size": 40, "num_local_experts": 5},
    ),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", {"intermediate_size": 40, "num_experts": 5}),
    # gpt-oss: sinks, alternating sliding (8) and full layers, YaRN, the clamped SwiGLU
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        {
            "head_dim": 16,
            "intermediate_size": 40,
            "num_local_experts": 5,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
            "swiglu_limit": 1.5,  # low enough that random weights reach the clamps
        },
    ),
}

# GPT-2's names for the common sizes (it has no K/V heads, MLP width or pad token to set)
_GPT2_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "n_positions",
    "initializer_range": "initializer_range",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
}


def hf_sizes(vocab: int, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int) -> dict:
    """A transformers config's size fields, by config.json's names."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


def build_hf_model(
    arch: str,
    folder: Path,
    seed: int = 0,
    *,
    vocab: int = 320,
    save: dict | None = None,
    **overrides,
):
    """Build, save and return a tiny random transformers model of family `arch` (FAMILIES).

    Its config: the common sizes below (hidden 64, 3 layers, 4 query over 2 K/V heads, MLP
    width 128, a `vocab`-word vocabulary ending in EOS), then the family's defaults, then
    `overrides`. `save`: keyword arguments for save_pretrained.
    """
    import transformers as tf

    model_cls, config_cls, defaults = FAMILIES[arch]
    torch.manual_seed(seed)
    base = {
        **hf_sizes(vocab, hidden=64, mlp=128, layers=3, heads=4, kv_heads=2),
        "max_position_embeddings": 512,
        "initializer_range": 0.2,
        "bos_token_id": 1,
        "eos_token_id": vocab - 1,
        "pad_token_id": 0,
        **defaults,
    }
    if arch == "gpt2":
        base = {_GPT2_NAMES[k]: v for k, v in base.items() if k in _GPT2_NAMES}
    model = getattr(tf, model_cls)(getattr(tf, config_cls)(**{**base, **overrides}))
    model.eval()
    # Random norm weights, so a wrong norm convention (e.g. Gemma's 1 + w) or a norm over
    # the wrong span shows up.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.3)
            elif arch == "gpt_oss" and (name.endswith("sinks") or name.endswith("bias")):
                p.normal_(0.0, 1.5 if name.endswith("sinks") else 0.5)  # zero or tiny at init
    model.save_pretrained(folder, **(save or {}))
    save_word_tokenizer(folder, vocab)
    return model


class Single:
    """Drive the model runner for one sequence: prefill, then decode one token at a time."""

    def __init__(self, folder, dtype=torch.float32, quantize: str | None = None):
        ckpt = open_checkpoint(folder)
        self.model = Transformer(ckpt.config)
        self.model.load_weights(ckpt, dtype, quantize=quantize)
        self.cache = KVCache(ckpt.config, 16, dtype, torch.device("cpu"), "1024tok")
        self.blocks = BlockManager(self.cache.num_blocks, 16)
        self.runner = ModelRunner(self.model, self.cache, torch.device("cpu"))
        self.seq = Sequence("s", [], None, None)
        self.steps: list[torch.Tensor] = []  # the last greedy run's logits [vocab], a token each

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Run `tokens` after those already fed; their logits [len(tokens), vocab]."""
        seq = self.seq
        seq.prompt_ids = seq.prompt_ids + tokens
        self.blocks.grow(seq.block_table, len(seq))
        logits, _ = self.runner.run([ScheduledChunk(seq, len(tokens))], all_logits=True)
        seq.num_computed = len(seq)
        return logits

    def greedy(self, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
        """Feed prompt, then n greedy tokens, each fed back. Returns (the prompt's logits
        [T, vocab], the n token ids); self.steps keeps the logits [vocab] that chose each."""
        logits = self.feed(prompt)
        step, out = logits[-1], []
        self.steps = []
        for _ in range(n):
            self.steps.append(step)
            out.append(int(step.argmax()))
            step = self.feed([out[-1]])[0]
        return logits, out


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [T, vocab] at every position of `tokens`."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def hf_generate(hf, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation of prompt (its own cached `generate`, EOS not
    stopping it): the n token ids, and the logits [vocab] that chose each."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of prompt: n token ids, EOS not stopping it."""
    return hf_generate(hf, prompt, n)[0]


def assert_logits_match(
    ours: Single, hf, prompt: list[int], decode_steps: int = 0, tol: float = 1e-4
) -> None:
    """Prefill: ours' logits at every position of prompt within `tol` of transformers'.
    Then `decode_steps` steps, each fed transformers' top token: the step's logits [vocab]
    within `tol` of transformers' on the whole sequence so far."""
    ref = hf_logits(hf, prompt)
    assert (ours.feed(prompt) - ref).abs().max().item() < tol
    tokens = list(prompt)
    for _ in range(decode_steps):
        tokens.append(int(ref[-1].argmax()))
        step = ours.feed([tokens[-1]])[0]
        ref = hf_logits(hf, tokens)
        assert (step - ref[-1]).abs().max().item() < tol


# llama.cpp's tensor names: the model's own, and a layer's (HF name without .weight/.bias)
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections, stored fused
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",  # a dense MLP
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",  # an MoE layer's router
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Gemma 2 and OLMo 2 norm after each sublayer too: their names for the norms around the MLP
_GGUF_SANDWICH = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _permute_qk(w, n_head: int):
    """llama.cpp's converter permutation of Q/K rows (what our loader undoes)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_writer(cfg, path: Path, arch: str, split_max_tensors: int = 0):
    """A GGUFWriter for `arch` with the header keys every family's file has, from the HF
    config `cfg`; split_max_tensors > 0 writes llama.cpp's split parts of that many tensors
    each (path NAME.gguf becomes NAME-00001-of-0000N.gguf ...)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return w


def finish_gguf(w) -> None:
    """Write a GGUFWriter's header, keys and tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def quantize_iq4(data, qtype):
    """A plain IQ4_NL / IQ4_XS encoder (gguf-py decodes these types but cannot encode them):
    per 32 values a scale max|x| / 127 (IQ4_XS: a 6-bit multiple of its 256-block's d) and
    each value's nearest entry of the 16-value table, laid out as llama.cpp lays them (low
    nibbles values 0-15 of a 32-block, high nibbles 16-31). data [rows, cols] float32 ->
    raw blocks uint8 [rows, cols / 32 * 18] (IQ4_NL) or [rows, cols / 256 * 136]."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    rows = data.shape[0]
    x = data.reshape(rows, -1, 32).astype(np.float32)  # [rows, n32, 32]
    table = np.array(_IQ4_VALUES, dtype=np.float32)
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127  # [rows, n32, 1]
    if qtype == Q.IQ4_XS:  # 6-bit sub-block scales (ls - 32) * d, d per 256 values
        sub = scale.reshape(rows, -1, 8)  # [rows, n256, 8]
        d = (sub.max(axis=-1, keepdims=True) / 31).astype(np.float16)
        ls = np.clip(np.rint(sub / np.maximum(d.astype(np.float32), 1e-30)), 0, 31) + 32
        ls = ls.astype(np.uint8)  # [rows, n256, 8]
        scale = (d.astype(np.float32) * (ls.astype(np.float32) - 32)).reshape(rows, -1, 1)
    codes = np.abs(x[..., None] - scale[..., None] * table).argmin(axis=-1).astype(np.uint8)
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # [rows, n32, 16]
    if qtype == Q.IQ4_NL:
        d16 = scale.astype(np.float16).view(np.uint8)  # [rows, n32, 2]
        return np.concatenate([d16, qs], axis=-1).reshape(rows, -1)
    n256 = ls.shape[1]
    low = (ls & 15).reshape(rows, n256, 4, 2)
    scales_l = low[..., 0] | (low[..., 1] << 4)  # [rows, n256, 4]
    high = (ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))
    scales_h = high.sum(axis=-1, dtype=np.uint16)[..., None].view(np.uint8)  # [rows, n256, 2]
    d8 = d.view(np.uint8)  # [rows, n256, 2]
    qs = qs.reshape(rows, n256, 128)
    return np.concatenate([d8, scales_h, scales_l, qs], axis=-1).reshape(rows, -1)


def write_llama_gguf(
    model,
    path: Path,
    qtype=None,
    arch: str = "llama",
    drop=(),
    reshape=(),
    metadata=None,
    split_max_tensors: int = 0,
):
    """Write a tiny HF Llama model as a GGUF file the way llama.cpp's converter does.

    qtype: a GGMLQuantizationType for every 2-D weight (None = F32). `drop` leaves
    tensors out and `reshape` corrupts their shape, for the error tests. `metadata`
    {key: (value, GGUFValueType) or None} replaces (or, with None, removes) header keys.
    Returns the model with its weights replaced by their quantize/dequantize round trip,
    so it computes exactly what the file holds.
    """
    import numpy as np
    from gguf.quants import dequantize, quantize

    cfg = model.config
    w = _gguf_writer(cfg, path, arch, split_max_tensors)
    # a small SentencePiece-style vocabulary so an engine can run on the file
    tokens = ["<unk>", "<s>", "</s>"] + [f"▁t{i}" for i in range(3, cfg.vocab_size)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, cfg.vocab_size)])
    w.add_token_types([2, 3, 3] + [1] * (cfg.vocab_size - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    state = model.state_dict()
    for hf_name, t in state.items():
        stem, _, kind = hf_name.rpartition(".")
        if stem in _GGUF_TOP:
            name = f"{_GGUF_TOP[stem]}.{kind}"
        else:
            _, _, idx, rest = stem.split(".", 3)
            name = f"blk.{idx}.{_GGUF_LAYER[rest]}.{kind}"
        if name in drop:
            continue
        data = t.float().numpy()
        if name.endswith("attn_q.weight"):
            data = _permute_qk(data, cfg.num_attention_heads)
        if name.endswith("attn_k.weight"):
            data = _permute_qk(data, cfg.num_key_value_heads)
        if name in reshape:
            data = data[:-1]
        if qtype is not None and data.ndim == 2:
            iq4 = qtype.name in ("IQ4_NL", "IQ4_XS")
            q = quantize_iq4(data, qtype) if iq4 else quantize(data, qtype)
            w.add_tensor(name, q, raw_dtype=qtype)
            back = torch.from_numpy(dequantize(q, qtype).reshape(data.shape).copy())
            if name.endswith("attn_q.weight") or name.endswith("attn_k.weight"):
                heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
                rows = back.shape[0]
                back = (
                    back.reshape(heads, rows // heads // 2, 2, -1)
                    .transpose(1, 2)
                    .reshape(back.shape)
                )
            with torch.no_grad():
                model.state_dict()[hf_name].copy_(back)
        else:
            w.add_tensor(name, np.ascontiguousarray(data))
    for key, typed in (metadata or {}).items():
        if typed is None:
            w.kv_data[0].pop(key, None)
        else:
            w.kv_data[0].pop(key, None)
            w.add_key_value(key, *typed)
    finish_gguf(w)
    return model


def write_gguf(
    hf, path: Path, arch: str, qtype=None, metadata: dict | None = None, extra: dict | None = None
) -> None:
    """hf's weights as llama.cpp's converter writes a GGUF of `arch`: a dense family
    (Gemma 2, OLMo 2, Phi-3) or a mixture of experts (qwen2moe, qwen3moe, olmoe, and
    llama with experts: Mixtral).

    Q/K rows are permuted for llama only (the others rotate NEOX-style); Gemma's norms are
    stored as 1 + w; each sparse layer's experts as 3-D tensors blk.N.ffn_{gate,up,down}_exps
    ([E, fe, d], [E, d, fe] in numpy order). qtype: None (F32), F16 (every matrix; hf's own
    weights are first rounded to float16 in place, so it computes what the file holds) or
    a block type for the experts and attention (the router and norms stay F32).
    `metadata` {key: value} more header keys, each by its GGUFWriter add_<key>; `extra`
    {name: numpy array} more tensors.
    """
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = _gguf_writer(cfg, path, arch)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):  # Mixtral and OLMoE: feed_forward_length
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for key, value in (metadata or {}).items():
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, cfg.vocab_size)])
    layer_names = {**_GGUF_LAYER, **(_GGUF_SANDWICH if arch in ("gemma2", "olmo2") else {})}

    def add(name: str, t: torch.Tensor) -> None:
        data = t.float().numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _permute_qk(data, heads if "attn_q" in name else kv_heads)
        matrix = data.ndim >= 2 and "ffn_gate_inp" not in name
        if qtype == Q.F16 and data.ndim >= 2:
            w.add_tensor(name, np.ascontiguousarray(data.astype(np.float16)))
        elif qtype not in (None, Q.F16) and matrix:
            w.add_tensor(name, quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(data))

    with torch.no_grad():
        if qtype == Q.F16:
            for p in hf.parameters():
                if p.dim() >= 2:
                    p.copy_(p.half().float())
        for name, t in hf.state_dict().items():
            stem, _, kind = name.rpartition(".")
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                stem, kind = name, "weight"  # transformers 5's 3-D experts, no suffix
            if arch == "gemma2" and stem.endswith("norm"):
                t = t + 1.0
            if stem in _GGUF_TOP:
                if stem == "lm_head" and cfg.tie_word_embeddings:
                    continue
                add(f"{_GGUF_TOP[stem]}.{kind}", t)
                continue
            _, _, idx, rest = stem.split(".", 3)
            if rest == "mlp.experts.gate_up_proj":  # [E, 2fe, d], each expert's rows [gate; up]
                gate, up = t.chunk(2, dim=1)
                add(f"blk.{idx}.ffn_gate_exps.weight", gate)
                add(f"blk.{idx}.ffn_up_exps.weight", up)
            elif rest == "mlp.experts.down_proj":  # [E, d, fe]
                add(f"blk.{idx}.ffn_down_exps.weight", t)
            elif rest == "mlp.shared_expert_gate":  # [1, d], stored as llama.cpp's [d]
                add(f"blk.{idx}.ffn_gate_inp_shexp.weight", t.reshape(-1))
            else:
                add(f"blk.{idx}.{layer_names[rest]}.{kind}", t)
    for name, t in (extra or {}).items():
        w.add_tensor(name, t)
    finish_gguf(w)


# Granite-MoE (tests/test_moe.py): Granite's multipliers over top-k experts stored fused
# (block_sparse_moe.input_linear [E, 2fe, d], output_linear [E, d, fe]); the "shared"
# variant adds an ungated shared expert (shared_mlp.input_linear [2fs, d]).
_GRANITE_MOE = {
    "intermediate_size": 40,
    "num_local_experts": 5,
    "embedding_multiplier": 3.0,
    "attention_multiplier": 0.09,
    "residual_multiplier": 0.5,
    "logits_scaling": 2.5,
}
FAMILIES.update(
    {
        "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", _GRANITE_MOE),
        "granitemoeshared": (
            "GraniteMoeSharedForCausalLM",
            "GraniteMoeSharedConfig",
            {**_GRANITE_MOE, "shared_intermediate_size": 24},
        ),
    }
)


def llama_cpp_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's (llama-cpp-python's) greedy continuation of prompt on GGUF `path`: n
    token ids, EOS not stopping it (tests skip where llama_cpp is not importable)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(prompt) + n + 8, n_threads=2, verbose=False)
    out: list[int] = []
    for token in llm.generate(list(prompt), temp=0.0, reset=True):
        out.append(token)
        if len(out) == n:
            break
    return out


def assert_same_greedy_but_ties(ours, theirs: list[int], tol: float) -> None:
    """Greedy tokens `theirs` (another engine's, on the same quantized file) equal ours
    (a CompletionOutput generated with logprobs >= 2) up to the first step where the two
    part, and there ours was a near tie: the other engine's token is among our top
    alternatives, within `tol` of our choice's log-probability. Engines that quantize
    activations differently (llama.cpp: 8 bits, tokenmill: 16) move logits by a few
    hundredths, which flips a near tie and nothing else."""
    for i, (mine, other) in enumerate(zip(ours.token_ids, theirs, strict=False)):
        if mine == other:
            continue
        lp = ours.logprobs[i]
        gap = lp.logprob - lp.top.get(other, float("-inf"))
        assert gap <= tol, (
            f"step {i}: ours {mine} (logprob {lp.logprob:.4f}), theirs {other} "
            f"(ours gives it {lp.top.get(other)}): not a near tie"
        )
        return


def mapped_rss_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps: the pages
    mapped into this process, not the page cache's)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total
