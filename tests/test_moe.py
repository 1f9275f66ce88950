"""Mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, gpt-oss) against transformers,
on tiny random-weight checkpoints of odd sizes (hidden 72, 5 experts, experts 40 wide).

Prefill logits at every position and greedy tokens must match transformers; several
prompts in one engine step must give the tokens each gives alone (the per-step grouping
of tokens by expert must not leak between sequences).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import Single, assert_logits_match, build_hf_model, hf_greedy, hf_logits

from tokenmill.config import ConfigError, ModelConfig
from tokenmill.layers.moe import MoE
from tokenmill.llm import LLM
from tokenmill.loader import LoadError, open_checkpoint
from tokenmill.loader.hf_config import from_hf_config
from tokenmill.models import paths
from tokenmill.sampling import SamplingParams

VOCAB = 320
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

CASES = {
    # dense layer 1 mixed in (mlp_only_layers), top-2 without renormalization
    "qwen3_moe": dict(num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False),
    # every second layer sparse (decoder_sparse_step), top-3 renormalized
    "qwen3_moe-step-norm": dict(num_experts_per_tok=3, decoder_sparse_step=2, norm_topk_prob=True),
    # shared expert with its sigmoid gate
    "qwen2_moe": dict(num_experts_per_tok=2, shared_expert_intermediate_size=48),
    "qwen2_moe-norm-dense": dict(
        num_experts_per_tok=3,
        norm_topk_prob=True,
        shared_expert_intermediate_size=24,
        mlp_only_layers=[0],
    ),  # fmt: skip
    "mixtral": dict(num_experts_per_tok=2),
    "olmoe": dict(num_experts_per_tok=3),  # Q/K norm over the whole projection
    "olmoe-norm": dict(num_experts_per_tok=2, norm_topk_prob=True),
    # attention sinks, sliding and full layers, YaRN, router and expert biases, the clamped
    # SwiGLU (helpers.FAMILIES)
    "gpt_oss": dict(num_experts_per_tok=2),
    # Granite's embedding, attention, residual and logit multipliers (helpers.FAMILIES), the
    # top-k logits then a softmax, experts stored fused (input_linear, output_linear)
    "granitemoe": dict(num_experts_per_tok=2),
    "granitemoe-bias-top3": dict(num_experts_per_tok=3, attention_bias=True),
    # and an ungated shared expert
    "granitemoeshared": dict(num_experts_per_tok=2),
}
# cases the fused stack cannot decode, and why (they decode on the per-layer path)
PER_LAYER_ONLY: dict[str, str] = {}


def build_moe_model(arch: str, folder, seed: int = 0, **overrides):
    """Build, save (as transformers writes it, or with save={...} for save_pretrained) and
    return a tiny random MoE model: helpers.FAMILIES' experts, hidden 72."""
    return build_hf_model(arch, folder, seed, vocab=VOCAB, **{"hidden_size": 72, **overrides})


def _case(name: str):
    return name.split("-")[0], CASES[name]


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_match_transformers(tmp_path, name):
    arch, overrides = _case(name)
    hf = build_moe_model(arch, tmp_path, **overrides)
    torch.manual_seed(1)
    prompt = torch.randint(2, 300, (24,)).tolist()

    # ---- prefill logits at every position, then decode steps fed the oracle's tokens ----
    assert_logits_match(Single(tmp_path), hf, prompt, decode_steps=6)

    # ---- greedy through the engine, as loaded by default (native float experts): every
    # decode step in the fused stack (router, top-k, the chosen experts, shared expert) ----
    llm = LLM(tmp_path, kv_cache_memory="1024tok")
    if name in PER_LAYER_ONLY:
        assert PER_LAYER_ONLY[name] in llm.engine.model.decode_path().reason
    else:
        assert llm.engine.model.decode_path().name == paths.STACK
        assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(hf, prompt, 12)
    # the per-layer path (native attention, torch experts) gives the same tokens
    llm.engine.model.native_model().stack_blocker = "test: the per-layer path"
    assert llm.engine.model.decode_path().name == paths.NATIVE_ATTENTION
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(hf, prompt, 12)


def test_config_reads_each_family(tmp_path):
    build_moe_model("qwen2_moe", tmp_path / "q2", **CASES["qwen2_moe-norm-dense"])
    cfg = open_checkpoint(tmp_path / "q2").config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (5, 3, 40)
    assert cfg.shared_expert_intermediate_size == 24 and cfg.norm_topk_prob
    assert cfg.moe_layers == [False, True, True] and cfg.qkv_bias and cfg.qk_norm is None
    build_moe_model("qwen3_moe", tmp_path / "q3", **CASES["qwen3_moe-step-norm"])
    cfg = open_checkpoint(tmp_path / "q3").config
    assert cfg.moe_layers == [False, True, False] and cfg.qk_norm == "head"
    assert cfg.intermediate_size == 56 and cfg.shared_expert_intermediate_size == 0
    build_moe_model("mixtral", tmp_path / "mx", num_experts_per_tok=2)
    cfg = open_checkpoint(tmp_path / "mx").config
    assert cfg.norm_topk_prob and cfg.moe_intermediate_size == 40 and all(cfg.moe_layers)
    build_moe_model("olmoe", tmp_path / "ol", num_experts_per_tok=2)
    cfg = open_checkpoint(tmp_path / "ol").config
    assert cfg.qk_norm == "full" and not cfg.norm_topk_prob
    build_moe_model("granitemoeshared", tmp_path / "gr", num_experts_per_tok=2)
    cfg = open_checkpoint(tmp_path / "gr").config
    assert (cfg.router, cfg.moe_intermediate_size, cfg.num_experts) == ("topk_softmax", 40, 5)
    assert (cfg.embed_scale, cfg.attn_scale, cfg.residual_scale) == (3.0, 0.09, 0.5)
    assert cfg.logit_scale == 1 / 2.5 and all(cfg.moe_layers)
    assert cfg.shared_expert_intermediate_size == 24 and not cfg.shared_expert_gate


@pytest.mark.parametrize("arch", ["qwen2_moe", "granitemoe"])
def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path, arch):
    """transformers 5 keeps experts as 3-D tensors in memory ([E, 2fe, d] gate_up, [E, d,
    fe] down); save_original_format=False writes those instead of the file's own names
    (one tensor per expert; Granite-MoE's input_linear, output_linear, router.layer)."""
    build_moe_model(arch, tmp_path / "per", **CASES[arch])
    hf = build_moe_model(
        arch, tmp_path / "fused", save={"save_original_format": False}, **CASES[arch]
    )
    from safetensors import safe_open

    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.endswith("experts.gate_up_proj") for k in keys), keys
    prompt = list(range(2, 30))
    a, b = Single(tmp_path / "per").feed(prompt), Single(tmp_path / "fused").feed(prompt)
    assert torch.equal(a, b)
    assert (b - hf_logits(hf, prompt)).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["qwen2_moe-norm-dense", "olmoe"])
def test_batched_equals_alone(tmp_path, name):
    arch, overrides = _case(name)
    build_moe_model(arch, tmp_path, initializer_range=0.05, **overrides)
    llm = LLM(tmp_path, max_num_batched_tokens=48, kv_cache_memory="2048tok")
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(2, 300, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 40, (8,), generator=g)
    ]
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert together == [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_q8_packs_every_expert(tmp_path):
    """quantization="q8" packs each expert's projections; the router stays float."""
    # q8 packs blocks of 32 along the input: sizes multiple of 32 here
    build_moe_model(
        "qwen2_moe", tmp_path, initializer_range=0.05, num_experts_per_tok=2, hidden_size=64,
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
    )  # fmt: skip
    q8 = LLM(tmp_path, quantization="q8", kv_cache_memory="1024tok")
    model = q8.engine.model
    from tokenmill.layers.native_linear import NativeLinear

    moe = model.layers[0].mlp
    assert isinstance(moe, MoE)
    assert all(
        isinstance(e.up, NativeLinear) and isinstance(e.down, NativeLinear) for e in moe.experts
    )
    assert isinstance(moe.shared.up, NativeLinear)
    assert type(moe.router.weight) is torch.nn.Parameter  # a float Gate, not packed
    exact = LLM(tmp_path, quantization="none", kv_cache_memory="1024tok")
    prompt = list(range(30, 50))
    a = q8.generate([prompt], GREEDY)[0].token_ids
    b = exact.generate([prompt], GREEDY)[0].token_ids
    assert sum(x == y for x, y in zip(a, b, strict=True)) >= len(b) // 2


def _config(**moe) -> ModelConfig:
    return ModelConfig(
        arch="qwen3_moe", vocab_size=64, hidden_size=24, intermediate_size=32, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=12, **moe,
    )  # fmt: skip


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax"])
@pytest.mark.parametrize("norm", [False, True])
def test_grouped_experts_equal_each_token_alone(router, norm):
    """The grouped forward (one matmul per expert over its rows) against a per-token loop
    written from the definition: softmax, top-k, weighted sum of the chosen experts."""
    cfg = _config(
        num_experts=7, num_experts_per_tok=3, moe_intermediate_size=10, router=router,
        norm_topk_prob=norm, shared_expert_intermediate_size=6, router_bias=True,
    )  # fmt: skip
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        p.data = 0.3 * torch.randn(p.shape, dtype=torch.float64)
    x = torch.randn(11, 24, dtype=torch.float64)
    got = moe(x)
    for t in range(x.shape[0]):
        logits = moe.router.weight @ x[t] + moe.router.bias
        if router == "softmax_topk":
            w, ids = torch.softmax(logits, -1).topk(3)
            w = w / w.sum() if norm else w
        else:
            top, ids = logits.topk(3)
            w = torch.softmax(top, -1)
        want = sum(w[j] * moe.experts[int(ids[j])](x[t : t + 1])[0] for j in range(3))
        want = want + torch.sigmoid(moe.shared_gate.weight @ x[t]) * moe.shared(x[t : t + 1])[0]
        # the router's softmax runs in float32 (as the references do): weights ~1e-7 off
        assert (got[t] - want).abs().max().item() < 1e-5


def test_moe_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        _config(num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ConfigError, match="num_experts"):
        _config(num_experts=-1)
    with pytest.raises(ConfigError, match="router"):
        _config(num_experts=4, num_experts_per_tok=2, router="sigmoid")
    with pytest.raises(ConfigError, match="moe_layers"):
        _config(num_experts=4, num_experts_per_tok=2, moe_layers=[True])
    with pytest.raises(ConfigError, match="moe_layers"):
        _config(moe_layers=[True, False])  # sparse layers without experts
    with pytest.raises(ConfigError, match="qk_norm"):
        _config(qk_norm="rows")
    dense = _config()
    assert dense.moe_layers == [False, False] and dense.num_experts == 0


def test_hf_config_errors(tmp_path):
    base = dict(
        model_type="qwen3_moe", vocab_size=64, hidden_size=24, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8,
    )  # fmt: skip
    assert from_hf_config(base).num_experts == 4
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        from_hf_config({**base, "mlp_only_layers": "all"})
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        from_hf_config({**base, "num_experts_per_tok": 0})
    with pytest.raises(ConfigError, match="missing field 'moe_intermediate_size'"):
        from_hf_config({k: v for k, v in base.items() if k != "moe_intermediate_size"})
    with pytest.raises(ConfigError, match="clip_qkv"):
        from_hf_config({**base, "model_type": "olmoe", "clip_qkv": 8.0})
    with pytest.raises(ConfigError, match="supported: .*qwen3_moe.*mixtral.*olmoe.*gpt_oss"):
        from_hf_config({**base, "model_type": "deepseek_v3"})
    oss = {**base, "model_type": "gpt_oss", "num_local_experts": 4, "sliding_window": 8}
    del oss["num_experts"]
    cfg = from_hf_config(oss)
    assert (cfg.attn_sinks, cfg.swiglu_limit, cfg.router) == (True, 7.0, "topk_softmax")
    assert cfg.layer_types == ["sliding", "full"] and cfg.qkv_bias and cfg.o_bias
    with pytest.raises(ConfigError, match="swiglu_limit"):
        from_hf_config({**oss, "swiglu_limit": -1.0})
    with pytest.raises(ConfigError, match="beta_fast"):
        yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": "fast"}
        from_hf_config({**oss, "rope_parameters": yarn})


def test_missing_expert_tensor_is_one_clear_error(tmp_path):
    build_moe_model("mixtral", tmp_path, num_experts_per_tok=2)
    from safetensors.torch import load_file, save_file

    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    dropped = [k for k in tensors if "experts.4.w3" in k][0]
    del tensors[dropped]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        LoadError, match=r"missing tensor 'layers\.\d\.mlp\.experts\.4\.up\.weight'"
    ):
        open_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "mixtral"


def test_trace_records_each_tokens_router_choice(tmp_path):
    """A traced request's steps carry, per sparse layer, each of its tokens' experts and
    weights: those transformers' router computes on the same tokens (softmax over all
    experts, the top k, renormalized here), best first. An untraced request in the same
    steps leaves its rows out; the dense layer has no router record."""
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.inspect.trace import Trace

    name = "qwen2_moe-norm-dense"  # layer 0 dense, top-3 renormalized, a shared expert
    arch, overrides = _case(name)
    hf = build_moe_model(arch, tmp_path, **overrides)
    engine = LLMEngine(tmp_path, kv_cache_memory="1024tok", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompt = torch.randint(2, 300, (17,), generator=torch.Generator().manual_seed(4)).tolist()
    engine.add_request("other", list(range(40, 61)), params)  # shares the traced steps
    trace = Trace()
    engine.add_request("traced", prompt, params, trace=trace)
    while engine.has_unfinished():
        engine.step()
    assert trace.model["num_experts"] == 5 and trace.model["experts_per_token"] == 3

    tokens = prompt + trace.summary["output_ids"]
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    sparse = [i for i, s in enumerate(engine.config.moe_layers) if s]
    assert sparse == [1, 2] and len(out.router_logits) == len(sparse)
    want = {}
    for layer, logits in zip(sparse, out.router_logits, strict=True):
        w, ids = torch.softmax(logits.float(), -1).topk(3)  # [T, 3]
        want[layer] = (ids, w / w.sum(-1, keepdim=True))
    seen = 0
    for step in trace.steps:
        positions = step["positions"]
        assert len(positions) == step["num_tokens"]
        for record in step["layers"]:
            layer = record["layer"]
            if layer not in sparse:
                assert "experts" not in record
                continue
            experts = record["experts"]
            ids, w = want[layer]
            assert experts["ids"] == ids[positions].tolist(), (step["index"], layer)
            got = torch.tensor(experts["weights"])  # rounded to 4 decimals
            assert (got - w[positions]).abs().max().item() < 2e-4
            assert got.sum(-1).sub(1).abs().max().item() < 5e-4
            seen += len(positions)
    assert seen == len(sparse) * (len(tokens) - 1)  # every traced token, once per layer
    # and the bound the server checks before running a trace covers the router records
    from tokenmill.inspect import trace as trace_module

    made = len(trace_module.dumps(trace.to_dict()).encode())
    bound = trace_module.size_bound(
        engine.config, len(prompt), 5, map_layers=0, map_heads=0, top_n=10, chunk_tokens=1
    )
    assert made <= bound
