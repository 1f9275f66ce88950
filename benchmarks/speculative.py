"""Speculative decoding (n-gram prompt lookup) against plain decoding, batch 1.

    python benchmarks/speculative.py [--model M] [--threads 2] [--runs 3]
        [--gen-len 128] [--reps 15] [--json PATH] [--cost-only] [--peers none]

`tokenmill bench --speculative` (tokenmill/bench/speculative.py: its docstring says what
the tasks and figures are) with one more engine beside it: ngram with adaptive=False,
every match verified, which shows what the guesses cost where they do not pay. Then the
cost of one verification step of T rows against a plain decode step, T = 1, 2, 3, 4, 5,
8, 16, the T values interleaved in each of --reps rounds; --cost-only measures that alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenmill import LLM
from tokenmill.bench.machine import cpu_name
from tokenmill.bench.speculative import (
    cost_lines,
    markdown_table,
    speculative_rows,
    summary,
    verify_cost,
)
from tokenmill.engine.llm_engine import resolve_model

COST_T = [1, 2, 3, 4, 5, 8, 16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model name or path [the default model]")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", "--rounds", type=int, default=3)  # --rounds: its earlier name
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="most guesses per step")
    p.add_argument("--reps", type=int, default=15, help="steps per T in the cost curve")
    p.add_argument("--peers", choices=("llamacpp", "none"), default="llamacpp")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--cost-only", action="store_true", help="only the cost of a T-row step")
    args = p.parse_args()
    path = resolve_model(args.model)
    report: dict = {"cpu": cpu_name(), "threads": args.threads}
    if args.cost_only:
        llm = LLM(path, threads=args.threads)
    else:
        rows, plain = speculative_rows(
            path, methods=["ngram", {"method": "ngram", "adaptive": False}], k=args.k,
            runs=args.runs, gen=args.gen_len, threads=args.threads,
            llama_cpp=args.peers == "llamacpp", log=print,
        )  # fmt: skip
        print(f"{report['cpu']}, {args.threads} threads")
        print(markdown_table(rows))
        report.update(speculative=rows, summary=summary(rows))
        llm = plain.llm
    cost = verify_cost(llm, COST_T, reps=args.reps)
    print("a step of T rows of one sequence over 512 cached tokens (T = 1: a plain decode step):")
    print("\n".join(cost_lines(cost)))
    report["cost"] = cost
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
