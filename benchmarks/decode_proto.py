"""Decode ceiling of the quantized kernels on the real SmolLM2 GGUF, before wiring them in.

    .venv/bin/python benchmarks/decode_proto.py [--model PATH] [--threads N] [--accuracy]

Timing: builds every projection of all layers from the file's raw Q4_1 / Q8_0 blocks
(QKV fused, gate+up fused, as the model runs them) and times one decode token's worth
of GEMVs (T=1) plus the un-embedding, against F.linear on the float32 weights the
loader makes today. Only the weight multiplies: attention, norms and Python overhead
come on top, so this is an upper bound on tokens/s.

--accuracy: runs the engine greedy for 32 tokens with float32 weights, then again
with every Linear, the embedding and the un-embedding swapped for QuantLinear, and
reports whether the tokens match and the max |logits difference| per step. Both use
the same (dequantized) weight values, so the difference is the kernels' activation
quantization (--act-bits) and, for prompts over PREFILL_MIN_T tokens, the float32 GEMM
on dequantized tiles.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFReader

from tokenmill import hub, kernels
from tokenmill.layers import quant_linear
from tokenmill.layers.quant_linear import QuantLinear
from tokenmill.loader.gguf_file import _unpermute


def raw_layer(tensors: dict, name: str, heads: int | None = None) -> QuantLinear:
    """QuantLinear from one GGUF tensor's blocks; Q/K rows un-permuted like the loader."""
    t = tensors[name]
    raw = np.asarray(t.data)
    if heads is not None:
        raw = _unpermute(raw, heads)
    out_features, in_features = int(t.shape[1]), int(t.shape[0])
    return QuantLinear.from_gguf(raw, t.tensor_type, out_features, in_features)


def build_layers(path: Path) -> tuple[list[list[QuantLinear]], QuantLinear, int]:
    """Per layer [qkv, o, gate_up, down] and the tied un-embedding, from the file."""
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    fields = reader.fields
    heads = int(fields["llama.attention.head_count"].contents())
    kv_heads = int(fields["llama.attention.head_count_kv"].contents())
    n_layers = int(fields["llama.block_count"].contents())
    layers = []
    for i in range(n_layers):
        b = f"blk.{i}."
        qkv = QuantLinear.cat(
            [
                raw_layer(tensors, b + "attn_q.weight", heads),
                raw_layer(tensors, b + "attn_k.weight", kv_heads),
                raw_layer(tensors, b + "attn_v.weight"),
            ]
        )
        gate_up = QuantLinear.cat(
            [raw_layer(tensors, b + "ffn_gate.weight"), raw_layer(tensors, b + "ffn_up.weight")]
        )
        layers.append(
            [
                qkv,
                raw_layer(tensors, b + "attn_output.weight"),
                gate_up,
                raw_layer(tensors, b + "ffn_down.weight"),
            ]
        )
    return layers, raw_layer(tensors, "token_embd.weight"), n_layers


def time_token(fns: list, rounds: int, clock=time.perf_counter) -> list[float]:
    """Seconds per token: every GEMV of one token, repeated `rounds` times."""
    out = []
    for _ in range(rounds):
        t0 = clock()
        for f in fns:
            f()
        out.append(clock() - t0)
    return out


def timing(path: Path, rounds: int, clock) -> None:
    layers, unembed, n_layers = build_layers(path)
    d = unembed.in_features
    x_d = torch.randn(1, d)
    x_f = torch.randn(1, layers[0][3].in_features)
    quant = [(m, x_d if m.in_features == d else x_f) for lay in layers for m in lay]
    quant.append((unembed, x_d))
    fp32 = [(m.dequantize(), x) for m, x in quant]
    q_fns = [lambda m=m, x=x: m(x) for m, x in quant]
    f_fns = [lambda w=w, x=x: F.linear(x, w) for w, x in fp32]
    q_bytes = sum(m.nbytes for m, _ in quant)
    f_bytes = sum(w.numel() * 4 for w, _ in fp32)
    time_token(q_fns + f_fns, 3)  # warm up both
    q_t, f_t = [], []
    for _ in range(rounds):  # interleaved so both see the same machine load
        q_t += time_token(q_fns, 1, clock)
        f_t += time_token(f_fns, 1, clock)
    print(
        f"model {path.name}: {n_layers} layers, {len(quant)} GEMVs per token, "
        f"threads {torch.get_num_threads()}, clock {clock.__name__}"
    )
    print(
        f"kernels: {kernels.library() is not None and 'native' or 'torch fallback'}, avx512 {kernels.uses_avx512()}"
    )
    print(
        f"{'path':<28}{'MB/token':>10}{'median ms':>11}{'min ms':>9}{'tok/s (med)':>13}{'GB/s (med)':>12}"
    )
    for name, ts, nbytes in [
        (f"QuantLinear ({quant_linear.DEFAULT_ACT_BITS}-bit act.)", q_t, q_bytes),
        ("F.linear float32", f_t, f_bytes),
    ]:
        med = statistics.median(ts)
        print(
            f"{name:<28}{nbytes / 1e6:>10.1f}{med * 1e3:>11.2f}{min(ts) * 1e3:>9.2f}"
            f"{1 / med:>13.1f}{nbytes / med / 1e9:>12.1f}"
        )
    per_kind = {}
    for idx, (m, x) in enumerate(quant[:-1]):
        kind = ["qkv", "o", "gate_up", "down"][idx % 4]
        per_kind.setdefault(kind, (m, x))
    per_kind["unembed"] = quant[-1]
    print("per GEMV, weights hot in cache (median over 200 calls):")
    for kind, (m, x) in per_kind.items():
        ts = time_token([lambda m=m, x=x: m(x)], 200, clock)
        med = statistics.median(ts)
        print(
            f"  {kind:<8} {m.out_features:>6}x{m.in_features:<5} {med * 1e6:8.1f} us  {m.nbytes / med / 1e9:6.1f} GB/s"
        )


PROMPTS = {
    "short": "Explain why the printing press changed how knowledge spread across Europe.",
    "long": (
        "The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden screw press "
        "adapted from wine making. Within fifty years presses operated in more than two "
        "hundred cities, and millions of books had been printed. Explain, step by step, why "
        "this invention changed how knowledge spread across Europe, and who gained from it."
    ),
}


def accuracy(path: Path, steps: int) -> None:
    from tokenmill.llm import LLM
    from tokenmill.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)

    def run(llm, prompt: str) -> tuple[list[int], list[torch.Tensor]]:
        logits = []
        model = llm.engine.model
        orig = model.unembed

        def record(x):
            y = orig(x)
            logits.append(y.detach().clone())
            return y

        model.unembed = record
        out = llm.generate([prompt], params)[0]
        model.unembed = orig
        return out.token_ids, logits

    llm = LLM(str(path))
    refs = {name: run(llm, prompt) for name, prompt in PROMPTS.items()}
    model = llm.engine.model
    layers, table, _ = build_layers(path)
    for block, (qkv, o, gate_up, down) in zip(model.layers, layers, strict=True):
        block.attn.qkv, block.attn.o, block.mlp.up, block.mlp.down = qkv, o, gate_up, down
    model.embed.forward = table.embed
    model.embed.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    model.unembed = lambda x: table(x)  # tied: logits = x @ embed^T, the same kernel
    print(
        f"activations {quant_linear.DEFAULT_ACT_BITS}-bit, PREFILL_MIN_T {quant_linear.PREFILL_MIN_T}"
    )
    for name, prompt in PROMPTS.items():
        ref_tokens, ref_logits = refs[name]
        q_tokens, q_logits = run(llm, prompt)
        pairs = list(zip(ref_tokens, q_tokens, strict=True))
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        upto = steps if same is None else same + 1
        diffs = [
            (a - b).abs().max().item()
            for a, b in zip(ref_logits[:upto], q_logits[:upto], strict=True)
        ]
        decode = diffs[1:] or [0.0]
        print(
            f"{name} prompt ({len(llm.engine.encode_prompt(prompt))} tokens): greedy {steps} tokens "
            f"{'all match' if same is None else f'first mismatch at step {same}'}; max |logits diff| "
            f"prefill {diffs[0]:.4f}, decode max {max(decode):.4f} median "
            f"{statistics.median(decode):.4f} (max |logit| {ref_logits[0].abs().max().item():.1f})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the calling thread's CPU clock (robust on a loaded machine; "
        "only meaningful with --threads 1)",
    )
    ap.add_argument("--act-bits", type=int, choices=(8, 16), default=quant_linear.DEFAULT_ACT_BITS)
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quant_linear.DEFAULT_ACT_BITS = args.act_bits
    path = args.model or hub.fetch("smollm2-135m-instruct", quiet=True)
    with torch.inference_mode():
        if args.accuracy:
            accuracy(path, args.steps)
        else:
            timing(path, args.rounds, time.thread_time if args.cpu_time else time.perf_counter)


if __name__ == "__main__":
    main()
