"""How aggregate decode speed grows with the number of requests decoded together.

    python benchmarks/batch_scaling.py [--batches 1,2,4,8,16] [--gen 128] [--runs 3]
                                       [--model PATH] [--activation-bits 16|8]
                                       [--threads 2] [--json out.json]

B greedy requests (short, different prompts) are submitted at once and decoded together,
one token of each per engine step; the aggregate rate is the tokens generated over the wall
time of the whole call (their prompts are 12-27 tokens, prefilled in the first step). Each
B is timed `--runs` times, the batch sizes taking turns run by run, and the median kept.
Every batched request's tokens are checked against the same request run alone: a batch
must never change a greedy sequence.

Run it on a quiet machine, and say which CPU (`lscpu`) with its figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenmill.llm import LLM
from tokenmill.sampling import SamplingParams

WORDS = (
    "the river carried salt and silt past the old mill where the wheel turned slowly "
    "while children counted boats and the baker sang about bread and winter and light"
).split()


def prompts(n: int) -> list[str]:
    """n different short prompts (12-27 words)."""
    return [" ".join(WORDS[i % 7 : i % 7 + 12 + (i * 5) % 16]) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--activation-bits", type=int, choices=(8, 16), default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        threads=args.threads,
        activation_bits=args.activation_bits,
        enable_prefix_caching=False,
    )
    batches = [int(b) for b in args.batches.split(",")]
    greedy = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True)
    texts = prompts(max(batches))
    alone = [llm.generate([p], greedy)[0].token_ids for p in texts]  # also warms up
    rates: dict[int, list[float]] = {b: [] for b in batches}
    same = {b: True for b in batches}
    for run in range(args.runs):
        for b in batches if run % 2 == 0 else batches[::-1]:
            start = time.perf_counter()
            outs = llm.generate(texts[:b], greedy)
            seconds = time.perf_counter() - start
            rates[b].append(sum(len(o.token_ids) for o in outs) / seconds)
            same[b] &= [o.token_ids for o in outs] == alone[:b]
            print(f"B={b} run {run + 1}/{args.runs}: {rates[b][-1]:.1f} tok/s", flush=True)
    one = statistics.median(rates[batches[0]])
    rows = [
        {"batch": b, "tok_s": statistics.median(rates[b]), "vs_first": statistics.median(rates[b]) / one,
         "runs": rates[b], "same_as_alone": same[b]}
        for b in batches
    ]  # fmt: skip
    engine = llm.engine
    print(f"\n{engine.path.name}, {engine.info()['kernels']}, {engine.activation_bits}-bit "
          f"activations, {args.threads} threads, {args.gen} tokens per request")  # fmt: skip
    print(f"| requests at once | aggregate tok/s | vs {batches[0]} | tokens as alone |")
    print("|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['tok_s']:.1f} | {r['vs_first']:.2f}x | "
              f"{'yes' if r['same_as_alone'] else 'NO'} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
